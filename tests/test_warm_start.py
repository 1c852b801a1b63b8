"""A warm start: a fresh pool, every kernel in the disk cache. What each request costs the process
(the memory an entry's read holds, the tasks of the event loop), and what stays as it was: a
request that joined another's read still gets its kernel when that one leaves, an entry's blobs
read as a dict's do, a change of environment still changes the key."""

from __future__ import annotations

import asyncio
import errno
import os
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._cache import DiskTier, Entry, _layout, decode_entry
from acompile._cache._disk import read_entry

pytestmark = pytest.mark.anyio


def pool(cache_dir: Path, workers: int = 1, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)


def entry_path(cache_dir: Path, key: str) -> Path:
    return DiskTier(cache_dir).path(key)


def big_entry() -> Entry:
    """An entry shaped as a kernel's: mostly text (its IRs), a binary, the metadata."""
    text = b"  %7 = fadd float %5, %6 ; an IR line of a few tens of bytes\n" * 40_000  # 2.4 MB
    binary = bytes(range(256)) * 1024  # 256 KB, not ASCII
    return Entry("cd" * 32, "triton", "k", {"llir": text, "cubin": binary, "json": b'{"a": 1}'}, {})


def test_reading_an_entry_from_disk_holds_its_bytes_once(tmp_path: Path) -> None:
    entry = big_entry()
    data = entry.encode()
    path = entry_path(tmp_path, entry.key)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    tracemalloc.start()
    try:
        read = read_entry(tmp_path, entry.key)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read is not None
    # The file's bytes once, and the binary copied out of them (what loading a kernel reads):
    # reading the file whole and then copying every blob out of it held the entry twice.
    binary = len(entry.blobs["cubin"])
    assert peak < len(data) + binary + (256 << 10), (peak, len(data))
    # What it reads as is the entry, blob for blob, in order.
    assert list(read.blobs) == ["llir", "cubin", "json"] and dict(read.blobs) == dict(entry.blobs)
    assert read.encode() == data


def test_an_entrys_blobs_read_and_change_as_a_dicts_do() -> None:
    entry = big_entry()
    read = decode_entry(entry.encode(), entry.key)
    blobs = read.blobs
    assert blobs == entry.blobs and entry.blobs == blobs and len(blobs) == 3 and "llir" in blobs
    assert blobs.get("missing") is None and blobs["json"] == b'{"a": 1}'
    # Replaced, added and removed as in a dict; what it encodes to follows.
    blobs["json"] = b'{"a": 2}'
    blobs["ptx"] = b"// ptx"
    del blobs["llir"]
    assert list(blobs) == ["cubin", "json", "ptx"]
    again = decode_entry(read.encode(), entry.key)
    assert dict(again.blobs) == {"cubin": entry.blobs["cubin"], "json": b'{"a": 2}', "ptx": b"// ptx"}
    assert read.size == sum(len(b) for b in again.blobs.values())


async def test_a_warm_starts_disk_hits_start_no_task_of_the_pools_each(cache_dir: Path) -> None:
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 32 << i}) for i in range(6)]
    async with pool(cache_dir, prestart=False) as p:
        compiled = await p.gather(*specs)
    loop = asyncio.get_running_loop()
    created = 0
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Future[Any]:
        nonlocal created
        created += 1
        return factory(loop, coro, **kw) if factory is not None else asyncio.Task(coro, loop=loop, **kw)

    async with pool(cache_dir, prestart=False) as p:
        await anyio.sleep(0.05)  # the pool's own tasks (its executor's) have started
        loop.set_task_factory(counting)  # type: ignore[arg-type]
        try:
            kernels = await p.gather(*specs)
        finally:
            loop.set_task_factory(factory)
        stats = p.stats()
    assert stats["cache"]["hits_disk"] == len(specs) and stats["compiled"] == 0
    assert [k.cubin for k in kernels] == [k.cubin for k in compiled]
    # The gather's task for each request, and nothing else: each request reads the disk and
    # loads its kernel itself (a task of the pool's per request cost a warm start more than
    # the read itself did).
    assert created == len(specs), created


async def test_a_request_that_joined_a_read_gets_its_kernel_when_the_first_caller_leaves(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    async with pool(cache_dir, prestart=False) as p:
        good = await p.compile(spec)
    path = entry_path(cache_dir, good.key)
    path.unlink()
    os.mkfifo(path)
    handle = tmp_path / "fifo"
    os.link(path, handle)  # to let the stuck reads go at the end
    # As on a hung network filesystem, open() itself blocks: the first caller's read sits in the
    # kernel, and the second caller joins it.
    monkeypatch.setattr(_layout, "_READ_FLAGS", os.O_RDONLY | os.O_CLOEXEC)
    got: dict[str, Any] = {}
    try:
        with anyio.fail_after(60):
            async with pool(cache_dir, prestart=False) as p:

                async def first() -> None:
                    with anyio.move_on_after(0.3) as scope:
                        await p.compile(spec)
                    got["first_left"] = scope.cancelled_caught

                async def second() -> None:
                    await anyio.sleep(0.1)  # the first caller is reading by now
                    got["kernel"], got["tier"] = await p.compile_with_tier(spec)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    tg.start_soon(second)
    finally:
        try:
            os.close(os.open(handle, os.O_WRONLY | os.O_NONBLOCK))  # lets the stuck open()s return
        except OSError as exc:
            assert exc.errno == errno.ENXIO  # no reader left: nothing to let go
    assert got["first_left"]
    # The read never answered: the second caller's kernel was compiled once the disk's deadline
    # passed, as a lone caller's would have been.
    assert got["tier"] == "compile" and got["kernel"].cubin == good.cubin


def test_a_changed_environment_changes_what_keys_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from acompile._backends._triton_env import key_environment

    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    before = key_environment(os.environ)
    assert "TRITON_DEFAULT_FP_FUSION" not in before and key_environment(os.environ) == before
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert key_environment(os.environ) == {**before, "TRITON_DEFAULT_FP_FUSION": "0"}
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    assert key_environment(os.environ)["TRITON_DEFAULT_FP_FUSION"] == "1"
    changed = key_environment(os.environ)
    changed["TRITON_DEFAULT_FP_FUSION"] = "2"  # what a caller does with its answer stays its own
    assert key_environment(os.environ)["TRITON_DEFAULT_FP_FUSION"] == "1"
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    assert key_environment(os.environ) == before
