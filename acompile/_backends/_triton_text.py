"""Kernels given as source strings: run in a short-lived process, never in the pool's.

``kernel_from_text`` runs a text's top-level code under ``_triton_probe`` (a process group of its
own, bounded in time and, with the pool's ``memory_limit``, in memory) and keeps what it reports
(the kernels it defines, Triton's key and parameters of the one asked for) as a ``SourceKernel``,
which stands in for the JIT function in this process. The most recent texts' findings are
remembered, so that a cache hit of a source-string kernel costs a hash of the text, not a process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio

from acompile import _linux
from acompile._backends import _triton_probe
from acompile._backends._memos import remembered
from acompile._backends._triton_once import once_async, this_loops
from acompile._errors import InvalidSpecError


class SourceKernel:
    """What the pool's process knows of a kernel defined in a source string.

    The string itself runs in a short-lived process (``_triton_probe``), never here; this holds
    what came back: the name, Triton's cache key, the parameters. It stands in for the JIT
    function wherever this process needs one (keying, checking, Triton's launcher). Workers run
    the string themselves to compile it.
    """

    launch_metadata = None

    def __init__(self, info: dict[str, Any], digest: str) -> None:
        self.__name__ = self.__qualname__ = info["name"]
        self.__module__ = f"acompile_source_{digest[:16]}"
        self.cache_key: str = info["cache_key"]
        self.arg_names: list[str] = list(info["arg_names"])
        self.params = [_SourceParam(*p) for p in info["params"]]

    def __repr__(self) -> str:
        return f"<SourceKernel {self.__name__} from {self.__module__}>"


@dataclass(frozen=True)
class _SourceParam:
    name: str
    is_constexpr: bool
    has_default: bool
    default: Any


# Source string and kernel name -> (found JIT functions, kernel), for the most recent ones: a
# cache hit of a source-string kernel costs a hash of the text, not a process. Bounded, as a
# server may be sent any number of distinct sources.
SOURCE_MEMO_SIZE = 256
_source_memo: OrderedDict[tuple[str, str | None], tuple[list[str], SourceKernel | None]] = remembered(
    OrderedDict()
)
# The longest a source string's top-level code may run (importing torch on a busy machine takes
# seconds); a caller's own deadline usually comes first.
SOURCE_RUN_SECONDS = 300.0
# Source strings' processes start at most max(2, CPUs) at a time, per event loop. One still running
# after PROBE_SLOT_SECONDS (top-level code that sleeps, or imports a large library) gives its
# place to the next: slow texts pace how fast others start, and never hold them for their own
# run time.
PROBE_SLOT_SECONDS = 2.0
_probe_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.Semaphore] = (
    weakref.WeakKeyDictionary()
)
# How often a probe's memory is measured, when the pool has a memory_limit.
PROBE_MEMORY_INTERVAL = 0.1


async def kernel_from_text(text: str, kernel_name: str | None) -> tuple[Any, dict[str, Any]]:
    """The kernel ``kernel_name`` (or the only one) of a source string, as a ``SourceKernel``,
    and what a worker gets to rebuild it; ``InvalidSpecError`` saying what is wrong with the text
    (it does not parse or run, names no such kernel, passes the memory limit or the time)."""
    if "\0" in text:
        raise InvalidSpecError("the kernel source contains a NUL character (\\0)")
    digest = await _digest(text)
    filename = f"<acompile-source-{digest[:16]}>"
    memo = (digest, kernel_name)
    known = _source_memo.get(memo)
    if known is None:
        known = await once_async(
            ("source", memo), lambda: _source_memo.get(memo), _probe, text, filename, memo
        )
    else:
        _source_memo.move_to_end(memo)
    found, fn = known
    if fn is None:
        if kernel_name is None:
            raise InvalidSpecError(
                f"the source defines JIT functions {found}: say which with kernel_name="
                if found
                else "the source defines no @triton.jit function"
            )
        raise InvalidSpecError(
            f"the source has no @triton.jit function named {kernel_name!r}; it defines {found or 'none'}"
        )
    return fn, {"kind": "text", "text": text, "filename": filename, "name": fn.__name__, "digest": digest}


async def _digest(text: str) -> str:
    if len(text) < 1 << 20:
        return hashlib.sha256(text.encode()).hexdigest()
    return await anyio.to_thread.run_sync(lambda: hashlib.sha256(text.encode()).hexdigest())


async def _probe(
    text: str, filename: str, memo: tuple[str, str | None]
) -> tuple[list[str], SourceKernel | None]:
    """Run the text in a process group of its own (see ``_triton_probe``), under the pool's
    memory limit, and remember what it reports."""
    request, token = _triton_probe.make_request(text, filename, memo[1], list(sys.path))
    memory_limit = _linux.pool_memory_limit.get()
    stderr = await anyio.to_thread.run_sync(tempfile.TemporaryFile)
    try:
        data, code, rss = await _run_probe(request, stderr, memory_limit)
        if memory_limit is not None and rss is not None:
            raise InvalidSpecError(
                f"the kernel source's top-level code passed the pool's memory limit of "
                f"{memory_limit >> 20} MiB ({rss >> 20} MiB in its processes) and was stopped"
            )
        status, body, answer = code, b"", None
        if code == 0 and data:
            try:
                status, body = _triton_probe.read_envelope(data, token)
                if body:
                    answer = _triton_probe.read_answer(body)
            except _triton_probe.BadAnswer as exc:
                raise InvalidSpecError(
                    f"running the kernel source failed: its process's answer is not the probe's "
                    f"({exc}); the source's top-level code may have written to it"
                ) from None
        if answer is None:
            tail = await anyio.to_thread.run_sync(_tail, stderr)
            raise InvalidSpecError(
                f"running the kernel source failed: its process ended with status {status}"
                + (f"\n{tail}" if tail.strip() else "")
            )
    finally:
        stderr.close()
    if not answer["ok"]:
        if answer["kind"] == "syntax":
            raise InvalidSpecError(f"the kernel source does not parse: {answer['message']}")
        raise InvalidSpecError(
            f"running the kernel source failed: {answer['message']}\n{answer['traceback']}".rstrip()
        )
    kernel = answer["kernel"]
    result = (answer["found"], SourceKernel(kernel, memo[0]) if kernel is not None else None)
    _source_memo[memo] = result
    while len(_source_memo) > SOURCE_MEMO_SIZE:
        _source_memo.popitem(last=False)
    return result


async def _run_probe(
    request: bytes, stderr: Any, memory_limit: int | None
) -> tuple[bytes, int | None, int | None]:
    """Start the probe, give it the request, and take all it writes on its stdout; with its
    exit status, and the memory its group held if it passed ``memory_limit`` (it was killed).

    However it ends (an answer, the deadline, the caller's cancellation, the memory limit), its
    whole process group is killed before this returns: the supervisor, the runner and whatever
    the text started that stayed in the group."""
    slots = this_loops(_probe_slots, lambda: anyio.Semaphore(max(2, os.cpu_count() or 2)))
    await slots.acquire()
    held = True

    def give_slot_back() -> None:
        nonlocal held
        if held:
            held = False
            slots.release()

    async def give_slot_back_later() -> None:
        await anyio.sleep(PROBE_SLOT_SECONDS)
        give_slot_back()

    over: list[int] = []

    async def watch_memory(pid: int, limit: int) -> None:
        while True:
            await anyio.sleep(PROBE_MEMORY_INTERVAL)
            rss = await anyio.to_thread.run_sync(_linux.group_rss, pid)
            if rss > limit:
                over.append(rss)
                _linux.kill_group(pid)
                return

    process = None
    chunks: list[bytes] = []
    code = None
    try:
        # ACOMPILE_WORKER: the supervisor imports acompile's modules it uses, not the library.
        env = dict(os.environ, ACOMPILE_PARENT_PID=str(os.getpid()), ACOMPILE_WORKER="1")
        process = await anyio.open_process(
            [sys.executable, "-c", _triton_probe.BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        with anyio.fail_after(SOURCE_RUN_SECONDS):
            async with anyio.create_task_group() as tg:
                tg.start_soon(give_slot_back_later)
                if memory_limit is not None:
                    tg.start_soon(watch_memory, process.pid, memory_limit)
                assert process.stdin is not None and process.stdout is not None
                await process.stdin.send(request)
                await process.stdin.aclose()
                size, limit = 0, _triton_probe.HEADER_LIMIT + _triton_probe.ANSWER_LIMIT
                async for chunk in process.stdout:
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        _linux.kill_group(process.pid)  # more than any answer: refused whole
                        break
                code = await process.wait()
                tg.cancel_scope.cancel()
    except TimeoutError:
        if over:
            return b"", None, over[0]
        raise InvalidSpecError(
            f"the kernel source's top-level code ran longer than {SOURCE_RUN_SECONDS:.0f} s"
        ) from None
    finally:
        give_slot_back()
        if process is not None:
            with anyio.CancelScope(shield=True):
                # The group first: with it goes everything the text started that stayed in it. A
                # probe too young to lead its group yet has started nothing: it alone is killed.
                _linux.kill_group(process.pid)
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await process.aclose()
    return b"".join(chunks), code, over[0] if over else None


def _tail(f: Any, limit: int = 8192) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return str(f.read().decode("utf-8", "replace"))
