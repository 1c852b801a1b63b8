"""The disk tier when the disk misbehaves: read-only, full, hung, or damaging large entries.

Each fault is made for real where the machine allows it: a read-only bind mount (root ignores
permission bits, not a read-only mount), a tiny tmpfs that fills up, a FIFO at an entry's path
(whose open() blocks in the kernel, as a read from a hung network filesystem does). Whatever the
disk does, a request gets its kernel, and leaving the pool does not wait for the disk.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from conftest import TARGET, Mounts, asyncio_only, fill, run_python
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._cache import (
    DiskTier,
    _layout,  # its read flags, made blocking (a hung filesystem) by two tests
    decode_entry,
)
from acompile._cache._entry import peek_header

pytestmark = pytest.mark.anyio


def pool(cache_dir: Path, workers: int = 1, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


def spec(block: int) -> acompile.TritonSpec:
    return acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})


def entry_path(cache_dir: Path, key: str) -> Path:
    return DiskTier(cache_dir).path(key)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "acompile" and r.levelno >= logging.WARNING]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if not p.is_dir())


# --- 1. a read-only cache folder --------------------------------------------------------------------


async def test_a_read_only_cache_folder_serves_its_hits_and_compiles_into_memory(
    tmp_path: Path, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "cache"
    async with pool(source, prestart=False) as p:  # an earlier run filled the folder
        cached = await p.compile(spec(64))
    before = {p: p.read_bytes() for p in files_under(source)}
    read_only = tmp_path / "read-only"
    mounts.read_only(source, read_only)
    with pytest.raises(OSError) as refused:
        (read_only / "probe").write_bytes(b"")
    assert refused.value.errno == errno.EROFS  # truly read-only, even for root

    caplog.set_level(logging.DEBUG, "acompile")
    async with pool(read_only) as p:
        hit, hit_tier = await p.compile_with_tier(spec(64))
        new, new_tier = await p.compile_with_tier(spec(128))
        again, again_tier = await p.compile_with_tier(spec(128))
        other, other_tier = await p.compile_with_tier(spec(256))
    assert (hit_tier, new_tier, again_tier, other_tier) == ("disk", "compile", "memory", "compile")
    assert hit.cubin == cached.cubin and again is new and new.cubin and other.cubin
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert "read-only" in warned[0] and str(read_only) in warned[0]
    assert {p: p.read_bytes() for p in files_under(source)} == before


async def test_an_empty_read_only_cache_folder_compiles_into_memory(
    tmp_path: Path, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    read_only = tmp_path / "read-only"
    mounts.read_only(empty, read_only)
    caplog.set_level(logging.DEBUG, "acompile")
    async with pool(read_only, preload=()) as p:
        _, tier = await p.compile_with_tier(spec(64))
        _, tier_again = await p.compile_with_tier(spec(64))
    assert (tier, tier_again) == ("compile", "memory")
    assert len(warnings_of(caplog)) == 1, warnings_of(caplog)


# --- 2. a full disk ------------------------------------------------------------------------------------


async def test_a_full_disk_fails_no_compile_and_leaves_no_temporary_file(
    tmp_path: Path, mounts: Mounts, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    mounts.tmpfs(cache_dir, "2m")
    caplog.set_level(logging.DEBUG, "acompile")
    async with pool(cache_dir) as p:
        # Room for part of an entry (some tens of KiB), not a whole one: the write starts, then fails.
        fill(cache_dir, leave=8192)
        results = [await p.compile_with_tier(spec(b)) for b in (64, 128)]
        again, again_tier = await p.compile_with_tier(spec(64))
        stats = p.stats()
    assert [tier for _, tier in results] == ["compile", "compile"] and again_tier == "memory"
    assert again is results[0][0] and all(k.cubin for k, _ in results)
    assert stats["compiled"] == 2
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "No space left" in warned[0], warned
    assert files_under(cache_dir / "v1") == []  # no entry, and no partial temporary file either


# --- 3. a read that never returns -------------------------------------------------------------------------


async def test_a_fifo_at_an_entry_path_is_a_miss_and_hangs_nothing(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool(cache_dir, prestart=False) as p:
        good = await p.compile(spec(64))
    path = entry_path(cache_dir, good.key)
    path.unlink()
    os.mkfifo(path)  # nobody ever opens it for writing: open() for reading would block forever
    caplog.set_level(logging.DEBUG, "acompile")
    with anyio.fail_after(60):
        asked = time.monotonic()
        async with pool(cache_dir) as p:
            k, tier = await p.compile_with_tier(spec(64))
            answered = time.monotonic() - asked
            stats = p.stats()
            leaving = time.monotonic()
        left = time.monotonic() - leaving
    assert tier == "compile" and k.cubin == good.cubin and stats["cache"]["disk_corrupt"] == 1
    assert answered < 30 and left < 5  # "did not hang", generously
    assert any("damaged" in m and "not a regular file" in m for m in warnings_of(caplog)), warnings_of(caplog)
    assert decode_entry(path.read_bytes(), good.key).blobs["cubin"] == good.cubin  # the FIFO was replaced


async def test_a_read_stuck_in_the_kernel_is_abandoned_after_a_deadline(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool(cache_dir, prestart=False) as p:
        good = await p.compile(spec(64))
    path = entry_path(cache_dir, good.key)
    path.unlink()
    os.mkfifo(path)
    handle = tmp_path / "fifo"
    os.link(path, handle)  # to release the stuck reader at the end, once the entry is replaced
    # As on a hung network filesystem, open() itself blocks: the cache folder's files are opened
    # without O_NONBLOCK here, so the reader thread sits in the kernel until someone opens the FIFO
    # to write.
    monkeypatch.setattr(_layout, "_READ_FLAGS", os.O_RDONLY | os.O_CLOEXEC)
    caplog.set_level(logging.DEBUG, "acompile")
    try:
        with anyio.fail_after(60):
            asked = time.monotonic()
            async with pool(cache_dir) as p:
                k, tier = await p.compile_with_tier(spec(64))
                answered = time.monotonic() - asked
                stats = p.stats()
                # A second request for it while the thread is still stuck: the memory tier.
                _, tier_again = await p.compile_with_tier(spec(64))
                leaving = time.monotonic()
            left = time.monotonic() - leaving
    finally:
        try:
            os.close(os.open(handle, os.O_WRONLY | os.O_NONBLOCK))  # lets the stuck open() return
        except OSError as exc:
            assert exc.errno == errno.ENXIO  # no reader left: nothing to release
    assert (tier, tier_again) == ("compile", "memory") and k.cubin == good.cubin
    assert stats["cache"]["disk_corrupt"] == 0
    assert answered < 30 and left < 5  # "did not hang", generously
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "did not answer" in warned[0], warned
    # The disk is left alone for a while after that: not even the fresh entry is written.
    assert stat.S_ISFIFO(path.stat().st_mode)


async def test_a_cache_folder_that_hangs_at_start_delays_nothing_for_long(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def hung_prepare(self: DiskTier) -> None:
        with open(fifo, "rb"):  # blocks in the kernel until the test lets it go
            pass

    monkeypatch.setattr(DiskTier, "make_or_check", hung_prepare)
    caplog.set_level(logging.DEBUG, "acompile")
    try:
        with anyio.fail_after(60):
            async with pool(cache_dir) as p:
                k, tier = await p.compile_with_tier(spec(64))
                _, tier_again = await p.compile_with_tier(spec(64))
                leaving = time.monotonic()
            left = time.monotonic() - leaving
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno == errno.ENXIO
    assert (tier, tier_again) == ("compile", "memory") and k.cubin and left < 5
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "did not answer" in warned[0] and "read-only" in warned[0], warned
    # Nothing was written there, not even the toolchain's memo.
    assert not await anyio.Path(cache_dir).exists()


def test_a_read_stuck_in_the_kernel_does_not_hold_up_the_process_exit(cache_dir: Path) -> None:
    # The stuck thread is still in open() when the interpreter exits: it must not be joined.
    script = textwrap.dedent(
        f"""
        import json, os, time, anyio, acompile
        from acompile._cache import DiskTier, _layout
        from kernels_for_tests import add_kernel, ADD_SIG

        async def main():
            spec = acompile.TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": 64}})
            async with acompile.CompilePool(1, target="cuda:90", cache_dir={str(cache_dir)!r}) as p:
                key = (await p.compile(spec)).key
            path = DiskTier({str(cache_dir)!r}).path(key)
            path.unlink()
            os.mkfifo(path)
            _layout._READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC  # open() blocks, as on a hung filesystem
            async with acompile.CompilePool(1, target="cuda:90", cache_dir={str(cache_dir)!r}) as p:
                _, tier = await p.compile_with_tier(spec)
            print(json.dumps({{"tier": tier, "left": time.time()}}), flush=True)

        anyio.run(main)
        """
    )
    out = run_python(script, timeout=120)
    exited = time.time()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tier"] == "compile"
    assert exited - result["left"] < 5  # "did not hang", generously: nobody ever wrote to the FIFO
    assert "did not answer" in out.stderr


# --- 4. integrity of large entries -------------------------------------------------------------------------

# About 1.4 MB of entry (ttir, ttgir, llir, ptx, cubin of a loop unrolled 150 times).
BIG_SOURCE = """
import triton
import triton.language as tl


@triton.jit
def big_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for i in tl.static_range(150):
        acc = acc * 1.0001 + tl.load(x_ptr + offs + i * BLOCK)
    tl.store(out_ptr + offs, acc)
"""


# asyncio only: the subject is the checksum over a large entry (a 5 s compile of the kernel in
# each run), not the loop; damaged entries on uvloop are in test_cache.py.
@asyncio_only
@pytest.mark.slow
async def test_a_damaged_byte_in_the_middle_of_a_large_entrys_binary_is_a_miss(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    big = acompile.TritonSpec(
        BIG_SOURCE, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"BLOCK": 1024}, kernel_name="big_kernel"
    )
    async with pool(cache_dir, preload=()) as p:
        good = await p.compile(big)
    path = entry_path(cache_dir, good.key)
    data = bytearray(path.read_bytes())
    assert len(data) >= 2**20
    header = peek_header(bytes(data))
    offset = header["_end"]
    for name, size, *_ in header["blobs"]:
        if name == "cubin":  # what a warm start reads and checks (its text stages: at .asm)
            data[offset + size // 2] ^= 0x01
        offset += size
    path.write_bytes(bytes(data))
    async with pool(cache_dir, preload=()) as p:
        k, tier = await p.compile_with_tier(big)
        stats = p.stats()
    assert tier == "compile" and stats["cache"]["disk_corrupt"] == 1
    assert k.asm["ptx"] == good.asm["ptx"]
    assert any("does not match its checksum" in m for m in warnings_of(caplog)), warnings_of(caplog)
    assert decode_entry(path.read_bytes(), good.key).blobs["cubin"] == good.cubin  # replaced whole
