"""The parent's half of the Triton backend: check a request, key it, load its result.

Nothing here compiles: ``prepare()`` turns a ``TritonSpec`` into a request with its cache key and
the payload a worker needs (see ``_triton_worker``), and ``load()`` turns a cache entry back into
a ``TritonKernel`` holding the same ``CompiledKernel`` Triton itself would build.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any, ClassVar, TypeVar

import anyio

from acompile import _pacing
from acompile._backends import _triton_probe, _triton_source, _triton_toolchain
from acompile._backends._registry import BACKENDS
from acompile._cache._entry import CorruptEntry, Entry
from acompile._cache._keys import make_key
from acompile._cache._layout import logs_dir
from acompile._errors import DeviceUnavailableError, InvalidSpecError, bounded
from acompile._targets import Target, parse_target
from acompile._version import __version__
from acompile._workers import _linux

WORKER_MODULE = BACKENDS["triton"].worker

# TRITON_* variables that cannot change a compiled kernel (paths, caches, logging). Every other
# TRITON_* variable, and every variable Triton itself lists as cache-invalidating, is part of the
# key and is set in the worker exactly as it was in the parent when the request was keyed. Tool
# paths are left out on purpose: the key holds the tools' versions instead, which travel.
_ENV_IGNORED = frozenset(
    {
        "TRITON_CACHE_DIR",
        "TRITON_HOME",
        "TRITON_DUMP_DIR",
        "TRITON_OVERRIDE_DIR",
        "TRITON_CACHE_MANAGER",
        "TRITON_REMOTE_CACHE_BACKEND",
        "TRITON_REMOTE_CACHE_URL",
        "TRITON_REDIS_HOST",
        "TRITON_REDIS_PORT",
        "TRITON_REDIS_KEY_FORMAT",
        "TRITON_CACHE_AUTOTUNING",
        "TRITON_PRINT_AUTOTUNING",
        "TRITON_ALWAYS_COMPILE",
        "TRITON_STORE_BINARY_ONLY",
        "TRITON_KERNEL_DUMP",
        "TRITON_INTERPRET",
        "TRITON_PTXAS_PATH",
        "TRITON_PTXAS_BLACKWELL_PATH",
        "TRITON_CUOBJDUMP_PATH",
        "TRITON_NVDISASM_PATH",
        "TRITON_LIBDEVICE_PATH",
        "TRITON_LIBCUDA_PATH",
        "TRITON_CUDACRT_PATH",
        "TRITON_CUDART_PATH",
    }
)


def key_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that change what Triton compiles, as they are in environ."""
    # One pass over the names only: this runs for every request, and os.environ decodes each
    # entry it yields.
    extra = _invalidating_env_names()
    names = sorted(k for k in environ if (k.startswith("TRITON_") or k in extra) and k not in _ENV_IGNORED)
    return {k: environ[k] for k in names}


@functools.cache
def _invalidating_env_names() -> frozenset[str]:
    # Triton lists only the variables that are set; read the names it knows from its knobs.
    from triton import knobs

    names: set[str] = set()
    for group_name in dir(knobs):
        group = getattr(knobs, group_name, None)
        for attr in getattr(type(group), "__dict__", {}).values():
            key = getattr(attr, "key", None)
            if isinstance(key, str) and key.isupper():
                names.add(key)
    return frozenset(n for n in names if not n.startswith("TRITON_"))


@dataclass(frozen=True)
class TritonSpec:
    """One Triton compile request, as ``CompilePool.triton()`` takes it (see there).

    Specs are plain values: build a list of them and hand it to ``CompilePool.gather()``.
    """

    backend: ClassVar[str] = "triton"

    fn: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] | None = None
    kernel_name: str | None = None
    num_warps: int = 4
    num_stages: int = 3
    target: str | Target | None = None
    attrs: Mapping[Any, Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TritonRequest:
    key: str
    name: str
    target: Target
    fn: Any
    signature: dict[str, str]
    constants: dict[str, Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    payload: dict[str, Any]
    key_parts: dict[str, Any]


async def setup(memo_dir: Path, target: Target | None) -> None:
    """Pay this process's one-time costs off the loop, before requests arrive: the toolchain's
    identity (remembered on disk), the option names and compiler backend of the target, and the
    parsing thread (started here: ``Thread.start`` waits for the thread to run)."""

    def work() -> None:
        _toolchain(memo_dir)
        _invalidating_env_names()
        _parse_thread().submit(int)
        if target is not None:
            _option_names(target.backend)
            with contextlib.suppress(Exception):  # a warm-up: loading a kernel says what is wrong
                _backend_for(target.to_triton())

    with _pacing.quick_switches():  # imports and file walks: Python on a thread, beside the loop
        await anyio.to_thread.run_sync(work)


async def worker_config(memo_dir: Path) -> dict[str, Any]:
    """What workers need from the parent: Triton's own key of its binaries, computed once."""
    # Abandoned on cancellation: a pool left while this runs (the first time on a machine, it
    # hashes Triton's binaries, ~0.7 s) does not wait for it; the thread finishes and remembers
    # the result on disk for the next process.
    with _pacing.quick_switches():  # the walk of Triton's sources is Python, beside the loop
        key = await anyio.to_thread.run_sync(_triton_toolchain.triton_key, memo_dir, abandon_on_cancel=True)
    return {"triton_key": key}


_toolchain_memo: dict[str, str] | None = None


def _toolchain(memo_dir: Path) -> dict[str, str]:
    global _toolchain_memo
    if _toolchain_memo is None:
        _toolchain_memo = _triton_toolchain.toolchain(memo_dir)
    return _toolchain_memo


async def prepare(spec: TritonSpec, default_target: Target | None, memo_dir: Path) -> TritonRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change."""
    target = _resolve_target(spec.target, default_target)
    fn, kernel_ref = await _resolve_kernel(spec)
    # Requests that arrive together (gather(), a warm start) are keyed a slice of the loop at a
    # time; not before: what _resolve_kernel starts in a thread (the function's key) starts now.
    await _pacing.checkpoint()
    signature, constants = _full_signature(fn, spec.signature, spec.constexprs or {})
    attrs = _normalize_attrs(fn, spec.attrs, signature)
    if target.backend not in _option_names_memo:
        await anyio.to_thread.run_sync(_option_names, target.backend)  # imports the backend
    options = _check_options(target, spec)
    tools = _toolchain_memo or await anyio.to_thread.run_sync(_toolchain, memo_dir)
    env = key_environment(os.environ)
    key_parts = {
        "format": 1,
        "backend": "triton",
        "acompile": __version__,
        "toolchain": tools,
        "kernel": fn.cache_key,
        "name": fn.__name__,
        "signature": list(signature.items()),
        "constexprs": {k: _canonical(k, v) for k, v in sorted(constants.items())},
        "attrs": sorted([list(k), v] for k, v in attrs.items()),
        "options": options,
        "target": str(target),
        "env": env,
    }
    if kernel_ref is not None and kernel_ref["kind"] == "text":
        # A text's Triton key is what its own process reported: a text that lies (its top-level
        # code may patch Triton) would otherwise be keyed, and served, as another kernel. Keyed by
        # the text itself too, a lie reaches no request but those for this very text.
        key_parts["text"] = kernel_ref["digest"]
    key = make_key(key_parts)
    payload = {
        "key": key,
        "name": fn.__name__,
        "kernel": kernel_ref,
        "signature": signature,
        "constexprs": constants,
        "attrs": attrs,
        "options": options,
        "target": str(target),
        "env": env,
        # Stored with the entry, so that a miss that should have been a hit can be explained.
        "key_parts": key_parts,
        # Where a worker writes a compiler message too long for an error (see _logs).
        "log_dir": _log_dir(memo_dir),
    }
    return TritonRequest(key, fn.__name__, target, fn, signature, constants, attrs, payload, key_parts)


@functools.lru_cache(maxsize=16)
def _log_dir(memo_dir: Path) -> str:
    return str(logs_dir(memo_dir.parent))


def _resolve_target(value: Any, default: Target | None) -> Target:
    if value is not None:
        return parse_target(value)
    if default is None:
        raise InvalidSpecError("no target: pass target='cuda:90' (or set one on the CompilePool)")
    return default


def _has_cache_key(fn: Any) -> bool:
    key = getattr(fn, "hash", None)  # where JITFunction keeps its computed cache_key
    return isinstance(key, str) and not key.startswith("recursion:")


async def payload(request: TritonRequest) -> dict[str, Any]:
    """The job a worker runs for request (called on a cache miss only)."""
    if request.payload["kernel"] is None:
        fn = request.fn
        ref = _described_already(fn)
        if ref is None:
            ref = await _once(("describe", id(fn)), lambda: _described_already(fn), _describe, fn)
        request.payload["kernel"] = ref
    return request.payload


async def _resolve_kernel(spec: TritonSpec) -> tuple[Any, dict[str, Any] | None]:
    from triton.runtime.jit import JITFunction

    fn = spec.fn
    if spec.kernel_name is not None and (
        not isinstance(spec.kernel_name, str) or not spec.kernel_name.isidentifier()
    ):
        raise InvalidSpecError(f"kernel_name must be a Python identifier, got {_show(spec.kernel_name)}")
    if isinstance(fn, str):
        return await _kernel_from_text(fn, spec.kernel_name)
    if isinstance(fn, JITFunction):
        if spec.kernel_name is not None and spec.kernel_name != fn.__name__:
            raise InvalidSpecError(
                f"kernel_name={spec.kernel_name!r} names a kernel in a source string; the JIT "
                f"function passed is {fn.__name__!r}: drop kernel_name"
            )
        if not _has_cache_key(fn):
            # Triton's key of a function parses it and everything it calls: off the loop, once,
            # however many requests for it arrive together.
            await _once(("key", id(fn)), lambda: _has_cache_key(fn) or None, lambda: fn.cache_key)
        # What a worker needs to rebuild it is worked out only if a worker is needed.
        return fn, None
    inner = getattr(fn, "fn", None)
    if isinstance(inner, JITFunction) or (
        inner is not None and isinstance(getattr(inner, "fn", None), JITFunction)
    ):
        raise InvalidSpecError(
            f"{type(fn).__name__} wraps a JIT function with its own configs: pass the inner "
            "function (its .fn) with the config's constexprs and options, or use pool.autotune()"
        )
    if callable(fn):
        raise InvalidSpecError(
            f"{getattr(fn, '__qualname__', fn)!r} is not a Triton JIT function: decorate it with "
            "@triton.jit, or pass the kernel's source text with kernel_name="
        )
    raise InvalidSpecError(f"expected a @triton.jit function or a source string, got {type(fn).__name__}")


_T = TypeVar("_T")
_loops_lock = threading.Lock()


def _this_loops(
    table: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _T], make: Callable[[], _T]
) -> _T:
    """The running event loop's own value in table, made the first time. What tasks wait on
    (events, limiters) belongs to one loop, and pools on loops in several threads of a process
    run at the same time."""
    loop = asyncio.get_running_loop()
    with _loops_lock:
        value = table.get(loop)
        if value is None:
            value = table[loop] = make()
    return value


# The parses each loop's tasks wait for, by key (the parse thread is one for all loops).
_in_progress: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, anyio.Event]] = (
    weakref.WeakKeyDictionary()
)
_parser: tuple[int, ThreadPoolExecutor] | None = None
_parser_lock = threading.Lock()


def _parse_thread() -> ThreadPoolExecutor:
    """The one thread that parses kernels (this process's: a forked child makes its own).

    Parsing is pure Python: in several threads at once, it would queue the event loop's thread
    behind them for the GIL. One thread with a queue takes each function straight after the
    last; a warm start asks for every function's key at once, and a round trip through the
    loop between two of them costs more than the parsing itself.
    """
    global _parser
    with _parser_lock:  # pools on loops in several threads: still one
        if _parser is None or _parser[0] != os.getpid():
            _parser = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="acompile-parse"))
        return _parser[1]


async def _once(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """Run work(*args) on the parsing thread, once for all the tasks that ask for key at the
    same time on this event loop; the others wait and then read the result with done()."""
    loop = asyncio.get_running_loop()
    waits = _this_loops(_in_progress, dict)
    while (pending := waits.get(key)) is not None:
        await pending.wait()
        result = done()
        if result is not None:
            return result
    event = waits[key] = anyio.Event()
    try:
        with _pacing.quick_switches():
            return await loop.run_in_executor(_parse_thread(), work, *args)
    finally:
        del waits[key]
        event.set()


_described: dict[int, tuple[weakref.ref[Any], str, dict[str, Any]]] = {}


def _described_already(fn: Any) -> dict[str, Any] | None:
    memo = _described.get(id(fn))
    alive: Any = memo[0]() if memo is not None else None
    if memo is None or alive is not fn:
        return None
    return memo[2] if memo[1] == alive.cache_key else None


def _describe(fn: Any) -> dict[str, Any]:
    """The worker's description of fn, built once per function (and again if its source
    changes, which changes its cache key)."""
    key = fn.cache_key
    ref = _triton_source.describe(fn)
    fn_id = id(fn)

    def forget(_: object) -> None:
        _described.pop(fn_id, None)

    _described[fn_id] = (weakref.ref(fn, forget), key, ref)
    return ref


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
_source_memo: OrderedDict[tuple[str, str | None], tuple[list[str], SourceKernel | None]] = OrderedDict()
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


async def _kernel_from_text(text: str, kernel_name: str | None) -> tuple[Any, dict[str, Any]]:
    if "\0" in text:
        raise InvalidSpecError("the kernel source contains a NUL character (\\0)")
    digest = await _digest(text)
    filename = f"<acompile-source-{digest[:16]}>"
    memo = (digest, kernel_name)
    known = _source_memo.get(memo)
    if known is None:
        known = await _once_async(
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


# The source strings each loop's tasks wait for, by key.
_in_flight: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, anyio.Event]] = (
    weakref.WeakKeyDictionary()
)


async def _once_async(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """await work(*args) once for all the tasks that ask for key at the same time; the others
    wait and read the result with done(). If the one doing it is cancelled, another takes over."""
    waits = _this_loops(_in_flight, dict)
    while (pending := waits.get(key)) is not None:
        await pending.wait()
        result = done()
        if result is not None:
            return result
    event = waits[key] = anyio.Event()
    try:
        return await work(*args)
    finally:
        del waits[key]
        event.set()


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
    slots = _this_loops(_probe_slots, lambda: anyio.Semaphore(max(2, os.cpu_count() or 2)))
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


_valid_types: set[str] = set()


def _full_signature(
    fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's full signature (every parameter in order, constexprs as "constexpr") and the
    constexpr values, defaults filled in."""
    if not isinstance(signature, Mapping):
        raise InvalidSpecError(
            f"signature must map parameter names to Triton types, got {type(signature).__name__}"
        )
    if not isinstance(constexprs, Mapping):
        raise InvalidSpecError(f"constexprs must map names to values, got {type(constexprs).__name__}")
    from triton.language import str_to_ty

    params = {p.name: p for p in fn.params}
    for name in [*signature, *constexprs]:
        if not isinstance(name, str):
            raise InvalidSpecError(
                f"signature and constexprs are keyed by parameter names (strings), got {_show(name)}"
            )
        if name not in params:
            raise InvalidSpecError(
                f"{fn.__name__} has no parameter {name!r}; its parameters are {list(params)}"
            )
    both = set(signature) & {k for k, v in signature.items() if v != "constexpr"} & set(constexprs)
    if both:
        raise InvalidSpecError(
            f"{sorted(both)} appear in both signature and constexprs: a parameter is either "
            "a runtime argument (signature) or a compile-time value (constexprs)"
        )
    full: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for name, param in params.items():
        if name in constexprs:
            full[name] = "constexpr"
            constants[name] = constexprs[name]
        elif name in signature and signature[name] != "constexpr":
            ty = signature[name]
            if not isinstance(ty, str) or "\0" in ty:
                raise InvalidSpecError(f"type of {name!r} must be a string such as '*fp32', got {_show(ty)}")
            try:
                if ty not in _valid_types:
                    str_to_ty(ty, None)
                    _valid_types.add(ty)
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSpecError(
                    f"unknown Triton type {_show(ty)} for {name!r}: use e.g. '*fp32' or '*fp16' "
                    "(pointers), 'i32', 'i64', 'u32', 'fp32', 'bf16', 'i1'"
                ) from None
            full[name] = ty
        elif param.is_constexpr and param.has_default:
            full[name] = "constexpr"
            constants[name] = param.default
        elif param.is_constexpr:
            raise InvalidSpecError(
                f"missing constexpr {name!r} of {fn.__name__}: pass constexprs={{{name!r}: ...}}"
            )
        else:
            raise InvalidSpecError(
                f"missing type for parameter {name!r} of {fn.__name__}: add it to signature, "
                f"e.g. signature={{..., {name!r}: {_example_type(name)!r}}}"
            )
    return full, constants


def _normalize_attrs(
    fn: Any, attrs: Mapping[Any, Any] | None, signature: Mapping[str, str]
) -> dict[tuple[int, ...], list[list[Any]]]:
    """Triton keys attributes by parameter path ((0,) for the first); accept names too. Triton
    silently ignores attributes keyed by name, so they are translated here. Each value is a list
    of [name, value] pairs, such as ``[["tt.divisibility", 16]]``."""
    if attrs is None:
        return {}
    if not isinstance(attrs, Mapping):
        raise InvalidSpecError(f"attrs must map parameter names or indices to attributes, got {_show(attrs)}")
    names = list(fn.arg_names)
    result: dict[tuple[int, ...], list[list[Any]]] = {}
    for k, v in attrs.items():
        if isinstance(k, str):
            if k not in names:
                raise InvalidSpecError(
                    f"attrs names {_show(k)}, which is not a parameter of {fn.__name__}; "
                    f"its parameters are {names}"
                )
            path: tuple[int, ...] = (names.index(k),)
        elif isinstance(k, int) and not isinstance(k, bool):
            path = (k,)
        elif isinstance(k, tuple) and k and all(isinstance(i, int) and not isinstance(i, bool) for i in k):
            path = k
        else:
            raise InvalidSpecError(f"attrs keys are parameter names or index tuples, got {_show(k)}")
        if not 0 <= path[0] < len(names) or any(i < 0 for i in path):
            raise InvalidSpecError(
                f"attrs index {_show(k)} is out of range: {fn.__name__} has {len(names)} parameters "
                f"(0 to {len(names) - 1})"
            )
        if signature.get(names[path[0]]) == "constexpr":
            raise InvalidSpecError(
                f"attrs[{_show(k)}]: {names[path[0]]!r} is a constexpr; "
                "attributes apply to runtime parameters"
            )
        result[path] = _attr_pairs(k, v)
    return result


def _attr_pairs(k: Any, v: Any) -> list[list[Any]]:
    wrong = InvalidSpecError(
        f"attrs[{_show(k)}] must be a list of [name, value] pairs such as "
        f"[['tt.divisibility', 16]], got {_show(v)}"
    )
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise wrong
    pairs = []
    for pair in v:
        if (
            isinstance(pair, (str, bytes))
            or not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or "\0" in pair[0]
        ):
            raise wrong
        value = pair[1]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidSpecError(
                f"attrs[{_show(k)}]: the value of {pair[0]!r} must be an int or a string, got {_show(value)}"
            )
        pairs.append([pair[0], value])
    return pairs


_option_names_memo: dict[str, frozenset[str]] = {}


def _option_names(backend: str) -> frozenset[str]:
    names = _option_names_memo.get(backend)
    if names is None:
        if backend == "cuda":
            from triton.backends.nvidia.compiler import CUDAOptions as options_cls
        else:
            from triton.backends.amd.compiler import HIPOptions as options_cls
        names = _option_names_memo[backend] = frozenset(options_cls.__dataclass_fields__)
    return names


def _check_options(target: Target, spec: TritonSpec) -> dict[str, Any]:
    if not isinstance(spec.options, Mapping) or not all(isinstance(k, str) for k in spec.options):
        raise InvalidSpecError(f"options must map option names to values, got {_show(spec.options)}")
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
    known = _option_names(target.backend)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidSpecError(
            f"unknown Triton option(s) {_show(unknown)} for {target}; known: {sorted(known)}"
        )
    warps = options["num_warps"]
    # bool is an int to Python, and True would be a cache key of its own for num_warps=1.
    if not isinstance(warps, int) or isinstance(warps, bool) or warps not in (1, 2, 4, 8, 16, 32):
        raise InvalidSpecError(
            f"num_warps must be a power of two from 1 to 32 (1, 2, 4, 8, 16, 32), got {_show(warps)}"
        )
    stages = options["num_stages"]
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise InvalidSpecError(f"num_stages must be a positive integer, got {_show(stages)}")
    for name, value in options.items():
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidSpecError(f"option {name}={_show(value)} is not a plain value") from None
        if "\\u0000" in text:
            raise InvalidSpecError(f"option {name} contains a NUL character (\\0)")
    return dict(sorted(options.items()))


def _show(value: Any) -> str:
    """A value's repr for a message, short however large the value is."""
    return bounded(repr(value), 200)


def _canonical(name: str, value: Any) -> Any:
    """A JSON form of a constexpr value that tells 1, 1.0 and True apart."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, (tuple, list)):
        return ["tuple", [_canonical(name, v) for v in value]]
    inner = getattr(value, "value", None)
    if type(value).__name__ == "constexpr":
        return _canonical(name, inner)
    cache_key = getattr(value, "cache_key", None)
    if isinstance(cache_key, str):
        return ["obj", type(value).__name__, cache_key]
    if type(value).__module__.startswith("triton.language"):
        return ["triton", type(value).__name__, str(value)]
    raise InvalidSpecError(
        f"constexpr {name}={value!r} ({type(value).__name__}) cannot be part of a cache key: "
        "use ints, floats, bools, strings, tuples of those, or Triton dtypes"
    )


# --- loading --------------------------------------------------------------------------------


class TritonKernel:
    """A compiled Triton kernel: its artifacts, and ``kernel[grid](*args)`` to launch it.

    Attributes:
        name: the kernel's name.
        key: the cache key (hex), the same on every machine for the same request.
        target: the ``Target`` it was compiled for.
        cubin: the binary (bytes; ``hsaco`` for HIP targets).
        asm: every stage Triton produced (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ...).
        metadata: Triton's own metadata (``num_warps``, ``shared``, ...).
        compiled: the ``triton.compiler.CompiledKernel``, built exactly as Triton builds it.

    ``asm`` and ``compiled`` are built on first use: a warm start reads every kernel from the
    cache, and most are only launched (or not used at all) in that process.

    Launching loads the binary onto the current GPU on first use; without a GPU it raises
    ``DeviceUnavailableError``. Pass only the runtime arguments, in the kernel's order: the
    constexprs the kernel was compiled with are filled in.
    """

    def __init__(self, request: TritonRequest, entry: Entry, metadata: Any) -> None:
        self.name = request.name
        self.key = request.key
        self.target = request.target
        self.metadata = metadata
        self.cubin: bytes = entry.blobs[_backend_for(metadata.target).binary_ext]
        self._constants = request.constants
        self._order = list(request.signature)
        # In the instance's dict, so that a copy of it (a TunedKernel) shares Triton's objects
        # and loads the binary once.
        self._triton = _TritonObjects(request, entry, metadata)

    @property
    def asm(self) -> dict[str, Any]:
        """Every stage Triton produced, by extension (text; the binary as bytes)."""
        return self._triton.asm

    @property
    def compiled(self) -> Any:
        """Triton's ``CompiledKernel``, built from the entry the first time it is asked for."""
        return self._triton.compiled

    def __repr__(self) -> str:
        return f"<TritonKernel {self.name} {self.target} key={self.key[:12]}…>"

    @property
    def launcher(self) -> str | None:
        """Whose launcher launches this kernel: ``"acompile"`` (its own, the default where it
        takes the kernel) or ``"triton"`` (Triton's); None until the kernel is loaded."""
        launches = self.__dict__.get("_launches")
        return None if launches is None else launches.launcher

    def load(self) -> None:
        """Load the binary onto the current GPU now (otherwise the first launch does)."""
        if "_launches" in self.__dict__:
            return
        compiled = self.compiled
        try:
            compiled._init_handles()
        except RuntimeError as exc:
            if "active driver" in str(exc) or ("driver" in str(exc).lower() and "0 active" in str(exc)):
                raise DeviceUnavailableError(
                    f"cannot load {self.name}: no GPU or driver here ({exc}); compiled results "
                    "can still be cached and shipped"
                ) from exc
            raise
        self._launches = _Launches(self.name, self._triton.signature, self._constants, compiled)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid](*args)``: grid is 1 to 3 ints, or, as for Triton's JIT, a callable
        given every argument by name (runtime arguments and constexprs) that returns them.

        The launch function takes the runtime arguments, by position or by name, and
        ``stream=`` (default: the current stream of the kernel's GPU). Launch functions are
        kept per grid of ints, so ``kernel[grid]`` in a loop costs one dict look-up.
        """
        try:
            launch = self._launches.by_grid.get(grid)
        except (AttributeError, TypeError):  # not loaded yet, or an unhashable grid (a list)
            launch = None
        if launch is not None:
            return launch
        if callable(grid):
            self.load()
            # Not kept: a callable grid often closes over the caller's tensors.
            return self._launches.with_grid_function(grid)
        gx, gy, gz = _grid3(grid)
        self.load()
        launches = self._launches
        launch = launches.with_grid(gx, gy, gz)
        if isinstance(grid, (int, tuple)):
            by_grid = launches.by_grid
            if len(by_grid) >= _GRIDS_KEPT:
                by_grid.clear()
            by_grid[grid] = launch
        return launch


# Launch functions kept per kernel, one per grid of ints (grids vary with the problem size).
_GRIDS_KEPT = 64


def _grid3(grid: Any) -> tuple[int, int, int]:
    """A grid of 1 to 3 ints as the three dimensions Triton's launcher takes."""
    if type(grid) is tuple:
        size = len(grid)
        if size == 1:
            return (int(grid[0]), 1, 1)
        if size == 2:
            return (int(grid[0]), int(grid[1]), 1)
        if size == 3:
            return (int(grid[0]), int(grid[1]), int(grid[2]))
    elif isinstance(grid, int):
        return (int(grid), 1, 1)
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or not 1 <= len(grid) <= 3:
        raise TypeError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    return _grid3(tuple(grid))


class _Launches:
    """The launch functions of one loaded kernel, and those kept by grid.

    Triton's ``CompiledKernel[grid](*args)`` looks up the driver, the current device and
    stream, the launch hooks and the launcher on every call, and then the launcher takes every
    argument, constexprs included, in the kernel's order. Here everything that cannot change
    between launches is looked up once, when the kernel is loaded, and a launch function
    written for the kernel's own parameter list (generated code: the constexprs are put in their
    places without building a list per call, and a wrong number of arguments gets Python's own
    message naming them) passes them straight to Triton's launcher. What can change stays a
    per-call read: the current stream, and the launch hooks (a profiler may install one at any
    time), which Triton is told of only when there is one.
    """

    def __init__(
        self, name: str, signature: Mapping[str, str], constants: Mapping[str, Any], compiled: Any
    ) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        from acompile._backends import _launcher

        order = tuple(signature)
        self._constant_values = tuple(constants[n] for n in order if n in constants)
        self.by_grid: dict[Any, Callable[..., None]] = {}
        self._name = name
        stream_of = driver.active.get_current_stream
        device = driver.active.get_current_device()  # the GPU _init_handles loaded the kernel onto
        chain = getattr(knobs, "HookChain", _NoHookChain)
        # acompile's launcher where it takes this kernel (see _launcher), else Triton's.
        self._fast = _launcher.kernel_for(compiled, signature, device, stream_of, knobs.runtime, chain)
        self._layout = (order, tuple(n in constants for n in order), self._fast is not None)
        self._bound = (
            name,
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
            compiled.launch_metadata,
            stream_of,
            device,
            knobs.runtime,
            chain,
            _grid3,
            self._fast.launch if self._fast is not None else None,
            *self._constant_values,
        )
        self._makers: dict[bool, Callable[..., Callable[..., None]]] = {}
        self._meta: tuple[tuple[str, Any], ...] | None = None

    @property
    def launcher(self) -> str:
        """Whose launcher launches this kernel: ``"acompile"`` or ``"triton"``."""
        return "acompile" if self._fast is not None else "triton"

    def with_grid(self, gx: int, gy: int, gz: int) -> Callable[..., None]:
        """The launch function for a grid of three ints."""
        launch = self._maker(False)(gx, gy, gz)
        if self._fast is None:
            return launch
        # The launcher's own (C) launch function: the Python one takes what it does not.
        return self._fast.bind(gx, gy, gz, launch, self._name, self._name + "[grid]")  # type: ignore[no-any-return]

    def with_grid_function(self, grid: Callable[..., Any]) -> Callable[..., None]:
        """The launch function for a grid computed from the arguments at each launch."""
        if self._fast is None:
            return self._maker(True)(grid)
        meta = self._meta
        if meta is None:
            # What the grid function is given, by name: each runtime argument's position, or a
            # constexpr's value.
            order, is_constant, _ = self._layout
            runtime = iter(range(len(order)))
            constants = iter(self._constant_values)
            meta = self._meta = tuple(
                (n, (next(constants),) if constant else next(runtime))
                for n, constant in zip(order, is_constant, strict=True)
            )
        return self._fast.bind_grid_function(grid, self._maker(True), meta, self._name, self._name + "[grid]")  # type: ignore[no-any-return]

    def _maker(self, grid_function: bool) -> Callable[..., Callable[..., None]]:
        maker = self._makers.get(grid_function)
        if maker is None:
            namespace: dict[str, Any] = {}
            exec(_launch_code(*self._layout, grid_function), namespace)
            maker = self._makers[grid_function] = namespace["maker"](*self._bound)
        return maker


class _NoHookChain:
    """Stands in for ``triton.knobs.HookChain`` where Triton has none: no hook is one."""

    calls: ClassVar[list[Any]] = []


@functools.lru_cache(maxsize=256)
def _launch_code(
    order: tuple[str, ...], is_constant: tuple[bool, ...], fast: bool, grid_function: bool
) -> CodeType:
    """The compiled source of ``maker(name, launcher, ...)``, which returns the function making
    a launch function for a grid (of three ints, or a grid function). Kernels of the same
    parameter list share it: compiling it costs a fraction of a millisecond, at first launch.
    With ``fast``, a launch with no hook installed goes through acompile's launcher
    (``_l_fast(x, y, z, stream, *runtime arguments)``), else through Triton's."""
    runtime = [n for n, constant in zip(order, is_constant, strict=True) if not constant]
    # The kernel's parameter names make the launch function's, so that errors and keyword
    # arguments read as the kernel does; where one would shadow what the body uses (every
    # other name there starts with "_l_"), positional names stand in.
    if any(n.startswith("_l_") or n == "stream" for n in runtime):
        runtime = [f"_l_arg{i}" for i in range(len(runtime))]
    names, constant_names = iter(runtime), iter(f"_l_c{i}" for i in range(sum(is_constant)))
    args = [next(constant_names) if constant else next(names) for constant in is_constant]
    passed = "".join(f", {a}" for a in args)
    runtime_passed = "".join(f", {n}" for n in runtime)
    params = "".join(f"{n}, " for n in runtime)
    constants = "".join(f", _l_c{i}" for i in range(sum(is_constant)))
    if grid_function:
        meta = ", ".join(f"{n!r}: {a}" for n, a in zip(order, args, strict=True))
        grid_params, grid_line = "_l_grid", f"\n            _l_x, _l_y, _l_z = _l_grid3(_l_grid({{{meta}}}))"
    else:
        grid_params, grid_line = "_l_x, _l_y, _l_z", ""
    if fast:
        plain_launch = f"_l_fast(_l_x, _l_y, _l_z, stream{runtime_passed})"
    else:
        plain_launch = f"_l_run(_l_x, _l_y, _l_z, stream, _l_function, _l_packed, None, None, None{passed})"
    source = f"""
def maker(_l_name, _l_run, _l_function, _l_packed, _l_metadata, _l_stream_of, _l_device, _l_knobs,
          _l_chain, _l_grid3, _l_fast{constants}):
    def make({grid_params}):
        def _l_launch({params}*, stream=None):{grid_line}
            if stream is None:
                stream = _l_stream_of(_l_device)
            _l_enter = _l_knobs.launch_enter_hook
            _l_exit = _l_knobs.launch_exit_hook
            if (_l_enter is None or (_l_enter.__class__ is _l_chain and not _l_enter.calls)) and (
                _l_exit is None or (_l_exit.__class__ is _l_chain and not _l_exit.calls)
            ):
                {plain_launch}
            else:
                _l_md = _l_metadata((_l_x, _l_y, _l_z), stream{passed})
                _l_run(_l_x, _l_y, _l_z, stream, _l_function, _l_packed, _l_md, _l_enter, _l_exit{passed})

        _l_launch.__name__, _l_launch.__qualname__ = _l_name, _l_name + "[grid]"
        return _l_launch

    return make
"""
    return compile(source, "<acompile launch>", "exec")


def _example_type(name: str) -> str:
    """A type to show for a parameter left out of a signature: a pointer for a name that reads
    as one (``x_ptr``), else an integer."""
    return "*fp32" if name.lower().endswith("ptr") else "i32"


async def load(request: TritonRequest, entry: Entry, cache_root: Path) -> TritonKernel:
    """The kernel of an entry. What can be wrong with an entry that passed its checksum (one
    written by something else than a Triton worker) is found here, not at first use (``asm``,
    ``compiled``) or at the first launch: raises ``CorruptEntry``."""
    return TritonKernel(request, entry, _kernel_metadata(entry, request.target))


_metadata_types: dict[tuple[str, ...], Any] = {}
_backends: dict[Any, Any] = {}


class _Absent:
    """What a metadata field that is not there reads as."""


_ABSENT = _Absent()
_INT: frozenset[type] = frozenset({int})
_FLAG: frozenset[type] = frozenset({bool, int})
_TEXT: frozenset[type] = frozenset({str})
_OPTIONAL: frozenset[type] = frozenset({_Absent, type(None)})
# The metadata fields that something after loading reads, with the types (exact: JSON's true is
# no count of warps) it needs: ``CompiledKernel`` (hash, name), the backend's ``pack_metadata``
# (num_warps, num_ctas, shared), ``CompiledKernel._init_handles`` (shared, tmem_size, num_warps,
# warp_size) and the CUDA launcher (the scratch sizes and alignments, the launch flags,
# tensordesc_meta). Triton 3.6 to 3.9 write each of them for CUDA; the last two are read only
# where present. AMD's metadata has fewer (Triton 3.6's no global scratch, no launch_pdl in any):
# for other backends than CUDA, the launcher's fields are checked where present.
# Checked at every load, with the text stages' UTF-8 (see below): ~7 us a kernel,
# measured (0.5 ms for a warm start of 68 kernels that takes ~50 ms), where building the
# CompiledKernel costs ~0.1 ms (which is why that waits for first use).
_FIELD_TYPES: dict[str, frozenset[type]] = {
    "hash": _TEXT,
    "name": _TEXT,
    "num_warps": _INT,
    "num_ctas": _INT,
    "shared": _INT,
    "warp_size": _INT,
    "tmem_size": _OPTIONAL | _INT,
    "tensordesc_meta": _OPTIONAL | frozenset({list}),
}
_CUDA_FIELD_TYPES: dict[str, frozenset[type]] = {
    "global_scratch_size": _INT,
    "global_scratch_align": _INT,
    "profile_scratch_size": _INT,
    "profile_scratch_align": _INT,
    "launch_cooperative_grid": _FLAG,
    "launch_pdl": _FLAG,
}
# A launch of no warps or a negative size fails only on the GPU, as a CUDA error at launch, and
# an alignment under 1 only in the allocator the launcher hands it to. No upper bound on
# num_warps (nor a power of two): with warp specialization it is the total of every partition's.
_FIELD_LEAST = {
    "num_warps": 1,
    "num_ctas": 1,
    "shared": 0,
    "global_scratch_size": 0,
    "global_scratch_align": 1,
    "profile_scratch_size": 0,
    "tmem_size": 0,  # where present
}


def _kernel_metadata(entry: Entry, target: Target) -> Any:
    """Triton's metadata of a kernel, as ``CompiledKernel.__init__`` reads it from its JSON
    file; raises ``CorruptEntry`` where the entry holds no kernel Triton could load for
    ``target`` (the request's), or holds anything that would fail later: a field of the wrong
    type (see ``_FIELD_TYPES``), a text stage that is not UTF-8."""
    from triton.backends.compiler import GPUTarget

    try:
        metadata = json.loads(entry.blobs["json"])
        if type(metadata) is not dict:
            raise TypeError(f"metadata is a JSON {type(metadata).__name__}, not an object")
        t = metadata["target"]
        backend, arch, warp_size = t["backend"], t["arch"], t["warp_size"]
        # The key names the target, so an entry for another one is damage: its binary is not
        # for this GPU, and Triton's backend for it may not even be made (AMD's asserts that
        # the arch is a name). Exact types: JSON's 90.0 or "90" is no CUDA arch.
        if backend != target.backend or type(arch) is not type(target.arch) or arch != target.arch:
            raise ValueError(f"target is {_show(backend)}:{_show(arch)}, not the request's {target}")
        if type(warp_size) is not int:
            raise TypeError(f"target warp_size is {_show(warp_size)}")
        metadata["target"] = GPUTarget(backend, arch, warp_size)
        launcher_fields = _CUDA_FIELD_TYPES.items()
        if backend != "cuda":  # read where present
            launcher_fields = {n: t | _OPTIONAL for n, t in launcher_fields}.items()
        for name, types in [*_FIELD_TYPES.items(), *launcher_fields]:
            value = metadata.get(name, _ABSENT)
            if type(value) not in types:
                if value is _ABSENT:
                    raise KeyError(name)
                raise TypeError(f"{name} is {_show(value)}")
        for name, least in _FIELD_LEAST.items():
            value = metadata.get(name)
            if value is not None and value < least:
                raise ValueError(f"{name} is {value}")
        fields = tuple(sorted(metadata))
        KernelMetadata = _metadata_types.get(fields)
        if KernelMetadata is None:
            # Triton makes a class per kernel; one per field list reads the same and saves a
            # class creation per kernel loaded from the cache.
            KernelMetadata = _metadata_types[fields] = namedtuple("KernelMetadata", fields)
        md: Any = KernelMetadata(**metadata)
        binary = _backend_for(md.target).binary_ext
        if binary not in entry.blobs:
            raise KeyError(binary)
        # The text stages are decoded at first use of .asm; whether they can be is known now.
        # They are ASCII but for a rare comment, and isascii() is a scan in C without a copy:
        # a full decode is paid for only by a stage that is not.
        for ext, blob in entry.blobs.items():
            if ext != binary and not blob.isascii():
                try:
                    blob.decode()
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"the {ext} stage is not UTF-8 text ({exc.reason} at byte {exc.start})"
                    ) from None
    except Exception as exc:
        # Whatever Triton raises making the backend or the metadata of what the entry says
        # (an AssertionError, say) is the entry's doing: a miss, and the kernel is compiled again.
        raise CorruptEntry(f"not a loadable Triton kernel ({type(exc).__name__}: {exc})") from exc
    return md


def _backend_for(target: Any) -> Any:
    """Triton's compiler backend of a ``GPUTarget`` (its binary's extension, its metadata
    packing), made once per target."""
    backend = _backends.get(target)
    if backend is None:
        from triton.compiler.compiler import make_backend

        backend = _backends[target] = make_backend(target)
    return backend


class _TritonObjects:
    """Triton's objects of one cached kernel, each built the first time it is asked for.

    Decoding every text stage (a matmul's LLVM IR alone is most of a megabyte) and building the
    ``CompiledKernel`` cost more than everything else a warm start does per kernel; a process
    that only launches a kernel needs the ``CompiledKernel`` once, and its text stages never.
    Built once even when threads ask at the same moment: a second ``CompiledKernel`` would load
    the binary again. Nothing in the entry can make building fail: ``_kernel_metadata`` checked,
    at load, every field and stage it reads.
    """

    _building = threading.Lock()  # taken only while something is built, the first time

    def __init__(self, request: TritonRequest, entry: Entry, metadata: Any) -> None:
        self._request = request
        self.signature = request.signature
        self._blobs = entry.blobs
        self._metadata = metadata
        self._asm: dict[str, Any] | None = None
        self._compiled: Any = None

    @property
    def asm(self) -> dict[str, Any]:
        asm = self._asm
        if asm is None:
            with self._building:
                if self._asm is None:
                    from triton.compiler.compiler import AsmDict

                    binary = _backend_for(self._metadata.target).binary_ext
                    stages = {ext: b if ext == binary else b.decode() for ext, b in self._blobs.items()}
                    del stages["json"]  # the metadata, not a stage
                    self._asm = AsmDict(stages)
                    self._blobs = {}  # the decoded stages replace the entry's bytes
                asm = self._asm
        return asm

    @property
    def compiled(self) -> Any:
        compiled = self._compiled
        if compiled is None:
            asm = self.asm
            with self._building:
                if self._compiled is None:
                    self._compiled = build_compiled_kernel(self._request, self._metadata, asm)
                compiled = self._compiled
        return compiled


def build_compiled_kernel(request: TritonRequest, metadata: Any, asm: dict[str, Any]) -> Any:
    """Triton's ``CompiledKernel`` from an entry's metadata and stages, attribute for attribute
    as ``CompiledKernel.__init__`` builds it from files (3.6 to 3.9), with no file involved."""
    from triton.compiler import ASTSource, CompiledKernel

    backend = _backend_for(metadata.target)
    ck = CompiledKernel.__new__(CompiledKernel)
    # 3.9's __del__ reads these: set them before anything can fail.
    ck.module = None
    ck._module_pid = None
    ck.function = None
    ck._run = None
    ck.src = ASTSource(request.fn, request.signature, request.constants, request.attrs or None)
    ck.metadata = metadata
    ck.packed_metadata = backend.pack_metadata(metadata)
    ck.hash = metadata.hash
    ck.name = metadata.name
    ck.asm = asm
    ck.metadata_group = {}
    ck.kernel = asm[backend.binary_ext]
    if "_module_pid" not in CompiledKernel.__init__.__code__.co_names:
        del ck._module_pid  # Triton before 3.9 has no such attribute
    return ck
