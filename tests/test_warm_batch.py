"""A gather's requests arriving together: their functions' Triton keys computed in one job of the
parse thread, and entries that say which of their blobs are text, so that no reader scans them."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import TARGET
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
    # Once ahead (the gather), once by the gather's request, once by the lone request.
    assert len(tries) == 3, tries
    monkeypatch.undo()
    forget_keys()


def old_format(entry: Entry) -> bytes:
    """The entry as a writer that did not record its text blobs wrote it (checksum and all)."""
    data = entry.encode()
    header = _entry.peek_header(data)
    for field in ("_end", "_digest", "ascii"):
        header.pop(field)
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.sha256(head)
    for name in entry.blobs:
        digest.update(entry.blobs[name])
    prefix = _entry._PREFIX.pack(_entry.MAGIC, _entry.VERSION, len(head), digest.digest())
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
