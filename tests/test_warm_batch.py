"""A gather's requests arriving together: their functions' Triton keys computed in one job of the
parse thread, and entries that say which of their blobs are text, so that no reader scans them."""

from __future__ import annotations

import hashlib
import json
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, run_python
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel

import acompile
from acompile._backends import _triton_once
from acompile._cache import Entry, _entry, decode_entry

pytestmark = pytest.mark.anyio


def specs() -> list[acompile.TritonSpec]:
    adds = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128)]
    return [*adds, *(acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128))]


class _CountingExecutor:
    """The parse thread's executor, counting the jobs handed to it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.jobs = inner, 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.jobs += 1
        return self.inner.submit(fn, *args, **kwargs)


def forget_keys() -> None:
    for fn in (add_kernel, scale_add_kernel):
        fn.hash = None  # as in a fresh process: Triton's key not computed yet


async def test_a_gathers_functions_are_keyed_in_one_job_of_the_parse_thread(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm start's requests name a few functions: each one's Triton key is computed once, on
    the parse thread, in the order the specs name them, all in one job (the thread goes from one
    to the next without a trip through the event loop), and every request is a disk hit."""
    from triton.runtime.jit import JITFunction

    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        await p.gather(*specs())  # the disk cache, filled
    forget_keys()
    keyed: list[tuple[str, str]] = []
    getter = JITFunction.cache_key.fget
    assert getter is not None

    def cache_key(fn: Any) -> str:
        if fn.hash is None:
            keyed.append((fn.__name__, threading.current_thread().name))
        key: str = getter(fn)
        return key

    monkeypatch.setattr(JITFunction, "cache_key", property(cache_key))
    counting = _CountingExecutor(_triton_once.parse_thread())
    monkeypatch.setattr(_triton_once, "parse_thread", lambda: counting)
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        counting.jobs = 0  # the pool's entry starts the thread with a job of its own
        kernels = await p.gather(*specs())
        stats = p.stats()
    assert [k.name for k in kernels] == ["add_kernel"] * 2 + ["scale_add_kernel"] * 2
    assert stats["cache"]["hits_disk"] == 4 and stats["compiled"] == 0
    # scale_add_kernel's helper (_scaled) is keyed inside its caller's key.
    names = [name for name, _ in keyed if name != "_scaled"]
    assert names == ["add_kernel", "scale_add_kernel"]
    assert all(thread.startswith("acompile-parse") for _, thread in keyed), keyed
    assert counting.jobs == 1


async def test_a_key_that_fails_ahead_fails_its_own_requests_as_before(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys computed ahead are a head start, not a new way to fail: a function whose key
    raises is tried again by its requests, which raise it themselves; the others are served."""
    from triton.runtime.jit import JITFunction

    forget_keys()
    tries: list[str] = []
    getter = JITFunction.cache_key.fget
    assert getter is not None

    def cache_key(fn: Any) -> str:
        if fn is scale_add_kernel:
            tries.append(threading.current_thread().name)
            raise RuntimeError("this function's key cannot be computed")
        key: str = getter(fn)
        return key

    monkeypatch.setattr(JITFunction, "cache_key", property(cache_key))
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        with pytest.raises(BaseException) as caught:
            await p.gather(*specs())
        # The same request alone raises the same error.
        with pytest.raises(RuntimeError, match="key cannot be computed"):
            await p.compile(specs()[2])
    assert "key cannot be computed" in repr(caught.value)
    # Once ahead (the gather's job), then by the gather's requests (the second request of the
    # function tries too when the first one's failure has not cancelled it yet), once by the
    # lone request: each on the parse thread.
    assert 3 <= len(tries) <= 4 and all(t.startswith("acompile-parse") for t in tries), tries
    monkeypatch.undo()
    forget_keys()


class _Halt(BaseException):
    """Not an ``Exception``: what a key computation may raise all the same (``SystemExit``)."""


async def test_a_key_that_raises_a_base_exception_ahead_leaves_no_other_function_waiting(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first function's key raises something that is not an ``Exception``: its requests
    raise it, and the functions after it in the same job are still handed back to their
    requests, so that a later request for one of them on this loop is served, not left
    waiting for ever."""
    from triton.runtime.jit import JITFunction

    forget_keys()
    getter = JITFunction.cache_key.fget
    assert getter is not None
    halting = [True]

    def cache_key(fn: Any) -> str:
        if fn is add_kernel and halting[0]:
            raise _Halt("add_kernel's key")
        key: str = getter(fn)
        return key

    monkeypatch.setattr(JITFunction, "cache_key", property(cache_key))
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        with pytest.raises(BaseException) as caught:
            await p.gather(*specs(), return_exceptions=True)
    assert "add_kernel's key" in repr(caught.value)
    halting[0] = False
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        with anyio.fail_after(60):
            kernel = await p.compile(specs()[2])
    assert kernel.name == "scale_add_kernel"
    monkeypatch.undo()
    forget_keys()


async def test_a_kernel_whose_code_calls_sys_exit_as_it_is_read_fails_its_requests_not_the_pool(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's code raises SystemExit while Triton reads it (its key, on acompile's parse
    thread, where a thread's exit ends nothing): that kernel's requests fail with an error
    naming it, the others are served, and the same pool serves the next gather. (Carried to the
    request as it is, asyncio stopped the event loop for it, and every later request on the
    pool was cancelled.)"""
    from triton.runtime.jit import JITFunction

    forget_keys()
    getter = JITFunction.cache_key.fget
    assert getter is not None
    exiting = [True]

    def cache_key(fn: Any) -> str:
        if fn is add_kernel and exiting[0]:
            raise SystemExit(3)
        key: str = getter(fn)
        return key

    monkeypatch.setattr(JITFunction, "cache_key", property(cache_key))
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        with anyio.fail_after(120):
            results = await p.gather(*specs(), return_exceptions=True)
            assert [type(r).__name__ for r in results] == ["InvalidSpecError"] * 2 + ["TritonKernel"] * 2
            assert "SystemExit(3)" in str(results[0]), results[0]
            assert isinstance(results[0].__cause__, SystemExit)
            with pytest.raises(acompile.InvalidSpecError, match=r"raised SystemExit\(3\)"):
                await p.compile(specs()[0])
            exiting[0] = False
            again = await p.gather(*specs())
    assert [k.name for k in again] == ["add_kernel"] * 2 + ["scale_add_kernel"] * 2
    monkeypatch.undo()
    forget_keys()


def test_a_gather_as_the_interpreter_shuts_down_fails_each_request_and_leaves_none_waiting(
    cache_dir: Path,
) -> None:
    """A pool serving from a thread of its own after the main thread has returned (the
    interpreter shutting down): the parse thread takes no new job, so there is no head start;
    each request of the gather meets that itself, and a request after it fails too, rather
    than wait for ever (which would also keep the process from exiting)."""
    code = textwrap.dedent(f"""
        import threading
        import anyio, acompile
        from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel

        specs = [acompile.TritonSpec(fn, ADD_SIG, {{"BLOCK": 64}}) for fn in (add_kernel, scale_add_kernel)]

        started = threading.Event()

        async def serve():
            async with acompile.CompilePool(1, target="{TARGET}", cache_dir={str(cache_dir)!r}, prestart=False) as p:
                started.set()
                threading.main_thread().join()
                try:
                    await p.gather(*specs)
                except BaseException as exc:
                    print("gather:", type(exc).__name__, flush=True)
                try:
                    with anyio.fail_after(20):
                        await p.compile(specs[1])
                except BaseException as exc:
                    print("compile:", type(exc).__name__, exc, flush=True)

        threading.Thread(target=anyio.run, args=(serve,)).start()
        started.wait()
    """)
    done = run_python(code, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == "gather: RuntimeError", done.stdout + done.stderr[-3000:]
    assert lines[1].startswith("compile: RuntimeError cannot schedule new futures"), lines


class _BadRepr:
    def __repr__(self) -> str:
        raise ValueError("no repr")


@pytest.mark.parametrize("wrong", [5, _BadRepr()], ids=["an int", "an object whose repr fails"])
async def test_a_gather_given_something_that_is_not_a_spec_raises_that_error_plainly(
    cache_dir: Path, wrong: object
) -> None:
    """Not a spec among specs is the caller's mistake, not a compile's failure: the error is
    raised as it is (not inside an exception group), return_exceptions or not, and the pool
    goes on serving."""
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        for return_exceptions in (True, False):
            with pytest.raises((TypeError, ValueError)) as caught:
                await p.gather(*specs(), wrong, return_exceptions=return_exceptions)  # type: ignore[call-overload]
            assert type(caught.value) in (TypeError, ValueError)  # not inside a group
            assert "not a compile spec" in str(caught.value) or "no repr" in str(caught.value)
        assert len(await p.gather(*specs())) == 4


def old_format(entry: Entry) -> bytes:
    """The entry as the first format's writer wrote it: no list of text blobs, no digest per
    blob, one checksum over the header and every blob."""
    header = _entry.peek_header(entry.encode())
    for field in ("_end", "_digest", "ascii"):
        header.pop(field)
    header["blobs"] = [row[:2] for row in header["blobs"]]
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.sha256(head)
    for name in entry.blobs:
        digest.update(entry.blobs[name])
    prefix = _entry._PREFIX.pack(_entry.MAGIC, 1, len(head), digest.digest())
    return b"".join([prefix, head, *entry.blobs.values()])


def test_an_entry_says_which_blobs_are_text_and_a_reader_scans_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer finds once which blobs are ASCII text and records it in the header, which the
    checksum covers: reading the entry, copying its binaries out and checking its text stages
    (as loading a kernel does) scan none of them. An entry written without the record reads as
    before, each blob scanned where asked."""
    text = b"  %7 = fadd float %5, %6 ; an IR line\n" * 1000
    entry = Entry("ab" * 32, "triton", "k", {"llir": text, "cubin": bytes(range(256)), "json": b"{}"}, {})
    scans: list[int] = []
    scan = _entry._isascii

    def counted(view: Any) -> bool:
        scans.append(len(view))
        return scan(view)

    monkeypatch.setattr(_entry, "_isascii", counted)
    for data, scanned in ((entry.encode(), []), (old_format(entry), [len(text), 256, 2])):
        found = decode_entry(data, entry.key)
        assert isinstance(found.blobs, _entry.Blobs)
        found.blobs.copy_out_binaries()
        assert [_entry.blob_isascii(found.blobs, n) for n in found.blobs] == [True, False, True]
        assert dict(found.blobs) == dict(entry.blobs)
        # The new format: nothing scanned; the old one: each blob once.
        assert scans == scanned
        scans.clear()


def with_ascii(entry: Entry, ascii: Any) -> bytes:
    """The entry with ``ascii`` as its header's list of text blobs, whatever it says, under valid
    checksums: what anyone who can write the cache folder can write."""
    header = _entry.peek_header(entry.encode())
    for field in ("_end", "_digest"):
        header.pop(field)
    header["ascii"] = ascii
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = _entry._PREFIX.pack(_entry.MAGIC, _entry.VERSION, len(head), hashlib.sha256(head).digest())
    return b"".join([prefix, head, *entry.blobs.values()])


@pytest.mark.parametrize(
    "ascii", ["llir", [1, "llir"], ["nothing", "such"], {"llir": True}, None, ["cubin", "cubin", "json"]]
)
def test_a_header_list_of_text_blobs_that_is_not_one_or_names_others_reads_the_blobs_as_they_are(
    ascii: Any,
) -> None:
    """A text-blob list that is not a list of names is not taken (each blob is scanned where
    asked); names of no blob are ignored; a blob named twice is named once. The entry loads."""
    entry = Entry(
        "ab" * 32, "triton", "k", {"llir": b"text\n", "cubin": bytes(range(256)), "json": b"{}"}, {}
    )
    found = decode_entry(with_ascii(entry, ascii), entry.key)
    taken = isinstance(ascii, list) and all(isinstance(x, str) for x in ascii)
    expected = [n in ascii for n in entry.blobs] if taken else [True, False, True]
    assert [_entry.blob_isascii(found.blobs, n) for n in found.blobs] == expected
    assert dict(found.blobs) == dict(entry.blobs)


async def test_a_kernel_whose_entry_calls_a_stage_that_is_not_utf8_text_still_launches_and_reads(
    cache_dir: Path,
) -> None:
    """An entry whose header lists as ASCII a text stage that is not even UTF-8 (written under a
    valid checksum, by hand or by a writer with a bug): the header is taken at its word, so the
    stage is not checked at load; building the kernel's ``CompiledKernel`` (its first launch)
    and reading ``.asm`` must not fail on it. The bytes that are not text read as U+FFFD."""
    from acompile._cache._layout import entries_dir

    spec = specs()[0]
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        key = (await p.compile(spec)).key
    path = entries_dir(cache_dir) / key[:2] / key
    genuine = decode_entry(path.read_bytes(), key)
    blobs = dict(genuine.blobs)
    blobs["llir"] += b"; \xff\xfe\n"
    forged = Entry(key, genuine.backend, genuine.name, blobs, genuine.meta)
    path.write_bytes(with_ascii(forged, [n for n in blobs if n != "cubin"]))
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        kernel = await p.compile(spec)
        assert p.stats()["cache"]["hits_disk"] == 1
    assert kernel.compiled.kernel == blobs["cubin"]
    assert kernel.asm["llir"].endswith("; \ufffd\ufffd\n")
    assert kernel.asm["ptx"] == blobs["ptx"].decode()


async def test_a_disk_entry_of_the_first_format_is_a_hit_read_whole(cache_dir: Path) -> None:
    """A cache folder filled before entries had a digest per blob: its entries are still hits,
    read and checked whole (one checksum over everything), every stage there at once."""
    from acompile._cache._layout import entries_dir

    spec = specs()[0]
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        key = (await p.compile(spec)).key
    path = entries_dir(cache_dir) / key[:2] / key
    genuine = decode_entry(path.read_bytes(), key)
    path.write_bytes(old_format(genuine))
    async with acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False) as p:
        kernel = await p.compile(spec)
        assert p.stats()["cache"]["hits_disk"] == 1
    path.unlink()  # nothing left to read: every stage came with the entry
    assert kernel.asm["llir"] == genuine.blobs["llir"].decode()
    assert kernel.compiled.kernel == genuine.blobs["cubin"]
