"""Damaged and planted files in the cache folder: none may hang a pool, swell it, or go unrepaired.

Every read of the folder's state (entries, the toolchain's memo, the compile times) is bounded:
it opens without blocking and without following a link, and refuses what is not a regular file
or is larger than its kind of file ever is. What is refused is a miss, and the next write replaces
it; a folder where a file goes is removed, and a lock file that is a link is never followed.

These are about robustness: the cache folder is this user's (``acompile._trust``), so whatever
sits in it was put there by this user, a crash, or a damaged disk. The tests run as any user.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest
from conftest import TARGET, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._backends import _triton_toolchain, forget_triton
from acompile._cache import COSTS_FILE, COSTS_LOCK_FILE, DiskTier, decode_entry, lib_path, toolchain_dir

pytestmark = pytest.mark.anyio

CPP = r"""
#include <cstdint>
extern "C" int64_t dot(const int64_t* a, const int64_t* b, int64_t n) {
    int64_t s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
"""

# "Did not hang", generously: a pool on this 2-core machine enters and compiles in seconds.
HANG = 60.0


def cpp_pool(cache_dir: Path) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, preload=())


def triton_pool(cache_dir: Path) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir)


def own_folder(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def release_fifos(fifos: list[Path]) -> None:
    """Let a reader stuck in open() of these FIFOs go on (it then reads an empty file)."""
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waits (ENXIO), or the FIFO was replaced already


class PeakRss:
    """The largest resident size of this process while the ``with`` runs, sampled every 5 ms."""

    def __init__(self) -> None:
        self.before = self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, me.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


@pytest.fixture
def fresh_toolchain_memo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget what this process remembered of Triton's toolchain, so that the pool reads its
    memo files from the cache folder again."""
    forget_triton()
    yield
    forget_triton()  # what this test's folders made this process remember


# --- FIFOs at the toolchain's memo files ---------------------------------------------------------------


async def test_fifos_at_the_toolchain_memo_files_do_not_hang_entering_the_pool(
    cache_dir: Path, fresh_toolchain_memo: None
) -> None:
    identity = _triton_toolchain._identity()
    memo = own_folder(toolchain_dir(own_folder(cache_dir)))
    fifos = [memo / f"toolchain-{identity}.json", memo / f"triton-key-{identity}.json"]
    for fifo in fifos:
        os.mkfifo(fifo, 0o600)  # nobody ever opens them to write: a blocking open() never returns
    # Without the fix the reads sit in the kernel on threads nobody can abandon, so fail_after
    # would never fire: past the deadline, the FIFOs are released for the test to end at all.
    watchdog = threading.Timer(HANG, release_fifos, [fifos])
    watchdog.start()
    started = time.monotonic()
    try:
        with anyio.move_on_after(HANG):
            async with triton_pool(cache_dir) as p:
                kernel = await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}))
    finally:
        watchdog.cancel()
        release_fifos(fifos)
    took = time.monotonic() - started
    assert took < HANG / 2, f"entering the pool took {took:.0f} s: it hung on a FIFO"
    assert kernel.cubin
    # Both were computed again and remembered in place of the FIFOs.
    for path in fifos:
        assert stat.S_ISREG(os.lstat(path).st_mode) and path.read_text().startswith("{")


# --- a huge sparse file at an entry's path ---------------------------------------------------------------


async def test_a_huge_sparse_entry_is_a_miss_read_in_no_memory_and_replaced(cache_dir: Path) -> None:
    async with cpp_pool(cache_dir) as p:
        good = await p.cpp(CPP)
    path = DiskTier(cache_dir).path(good.key)
    os.truncate(path, 3 << 30)  # 3 GiB of holes: no disk, but a read of it is 3 GiB of memory
    with PeakRss() as rss:
        with anyio.fail_after(HANG):
            async with cpp_pool(cache_dir) as p:
                lib, tier = await p.compile_with_tier(acompile.CppSpec(CPP))
                stats = p.stats()
    grew = (rss.peak - rss.before) >> 20
    assert grew < 200, f"this process grew by {grew} MiB reading one entry"
    assert tier == "compile" and stats["cache"]["disk_corrupt"] == 1
    assert path.stat().st_size < 1 << 20  # replaced by the fresh compile
    assert decode_entry(path.read_bytes(), good.key).blobs["so"] == lib.path.read_bytes()


# --- a folder where a library goes -----------------------------------------------------------------------


async def test_a_folder_at_a_library_path_is_replaced_by_the_library(cache_dir: Path) -> None:
    async with cpp_pool(cache_dir) as p:
        good = await p.cpp(CPP)
    so = lib_path(cache_dir, good.key, "so")
    so.unlink()
    so.mkdir(mode=0o700)
    (so / "inside").write_bytes(b"a folder that is not empty")  # rmdir() alone cannot remove it
    with anyio.fail_after(HANG):
        async with cpp_pool(cache_dir) as p:
            lib, tier = await p.compile_with_tier(acompile.CppSpec(CPP))
    assert tier == "disk" and stat.S_ISREG(os.lstat(so).st_mode)
    lib.dot.restype = ctypes.c_int64
    a = (ctypes.c_int64 * 2)(1, 2)
    assert lib.dot(a, a, ctypes.c_int64(2)) == 5


# --- a link at the compile times' lock ----------------------------------------------------------------------


async def test_a_link_at_the_costs_lock_creates_nothing_where_it_points(
    cache_dir: Path, tmp_path: Path
) -> None:
    outside = own_folder(tmp_path / "outside") / "planted"
    os.symlink(outside, own_folder(cache_dir) / COSTS_LOCK_FILE)  # dangling: O_CREAT would make its target
    with anyio.fail_after(HANG):
        async with cpp_pool(cache_dir) as p:
            lib = await p.cpp(CPP)
    assert not (outside.exists() or outside.is_symlink())
    # The save went on, under a lock file of its own in place of the link.
    assert lib.key[:16] in (cache_dir / COSTS_FILE).read_text()
    assert stat.S_ISREG(os.lstat(cache_dir / COSTS_LOCK_FILE).st_mode)


# --- a link where a folder of entries goes ------------------------------------------------------------------


async def test_a_link_in_place_of_a_folder_of_entries_is_neither_read_nor_written_through(
    cache_dir: Path, tmp_path: Path
) -> None:
    async with cpp_pool(cache_dir) as p:
        good = await p.cpp(CPP)
    folder = DiskTier(cache_dir).path(good.key).parent
    elsewhere = tmp_path / "elsewhere"
    folder.rename(elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)
    before = {path.name: path.read_bytes() for path in elsewhere.iterdir()}
    with anyio.fail_after(HANG):
        async with cpp_pool(cache_dir) as p:
            _, tier = await p.compile_with_tier(acompile.CppSpec(CPP))
    assert tier == "compile"  # what the link led to was not read
    assert stat.S_ISDIR(os.lstat(folder).st_mode)  # a folder of the cache's own in its place
    assert decode_entry((folder / good.key).read_bytes(), good.key).key == good.key
    assert {path.name: path.read_bytes() for path in elsewhere.iterdir()} == before


def test_an_entry_header_announcing_gigabytes_is_not_read(tmp_path: Path) -> None:
    """``cache stats`` and ``cache explain`` read entries' headers, and may look at a folder of
    another user's: a file whose prefix announces a 2 GiB header is not one, and is not read."""
    import tracemalloc

    from acompile._cache import Entry, read_header

    path = tmp_path / ("ab" * 32)
    # An entry's prefix (magic, format, the header's length, the digest: the layout acompile's
    # cache entries document), here announcing a header of 2 GiB.
    magic_and_format = Entry("ab" * 32, "cpp", "k", {}).encode()[:6]
    with open(path, "wb") as f:
        f.write(magic_and_format + struct.pack(">I", 2 << 30) + bytes(32))
        f.truncate(2 << 30)  # sparse: no disk, all of it readable
    tracemalloc.start()
    try:
        assert read_header(path) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated to read one header"


def test_a_bundle_whose_tar_header_announces_gigabytes_is_refused_unread(tmp_path: Path) -> None:
    """Tar reads an extended (pax) header whole before any member: a few bytes that announce
    3 GB of one are refused as they are met, not read into memory."""
    import subprocess
    import sys
    import tarfile

    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    header.size = 3_000_000_000
    bundle = tmp_path / "bomb.tar"
    bundle.write_bytes(header.tobuf(format=tarfile.USTAR_FORMAT) + b"\0" * 4096)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "acompile",
            "cache",
            "import",
            str(bundle),
            "--cache-dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "an extended header of 3000000000 bytes" in done.stderr


def test_an_export_passes_over_a_fifo_or_a_link_at_an_entry_s_name(tmp_path: Path) -> None:
    """A FIFO at an entry's name made an export wait forever (opened for reading, with no
    writer; no deadline reached the thread), and a link there was followed and read whole (a
    link to /dev/zero: memory without bound). Both are now left out as unreadable, as the cache's
    own readers leave them, and the export ends. In a child process: the old code never returns."""
    script = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        import anyio, acompile
        from acompile._cache import entries_dir
        root = Path(sys.argv[1])
        folder = entries_dir(root) / "ab"
        folder.mkdir(parents=True)
        os.mkfifo(folder / ("ab" + "0" * 62))
        outside = root.parent / "outside"
        outside.write_bytes(b"x" * (1 << 20))
        os.symlink(outside, folder / ("ab" + "1" * 62))
        async def main():
            report = await acompile.export_bundle(root, root.parent / "out.bundle")
            print(sorted(reason.split(":")[0] for _, reason in report.rejected), report.entries)
        anyio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=60, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['cannot read', 'cannot read'] 0", out.stdout
