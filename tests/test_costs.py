"""The cost model's file, as a damaged, hostile or shared folder leaves it, and its first guess.

``costs.json`` is read by every pool on the folder before its first compile, and written behind
every compile: nothing in it may fail a compile, stall a thread or stop a pool, and processes
that share it keep each other's records.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._cache import (
    COSTS_FILE,
    COSTS_LOCK_FILE,
    COSTS_MAX_BYTES,
    COSTS_MAX_RECORDS,
    CompileCosts,
    CostFeatures,
    GuardedDisk,
    _costs,  # its write, made to fail (a full disk) by one test
)

pytestmark = pytest.mark.anyio

HUGE = "1" + "0" * 400  # a JSON number no float holds
GOOD = '[0.7,"family",1000,4,3,1700000000]'
NONSENSE = {
    "size_huge": f'[0.2,"family",{HUGE},4,3,1700000000]',
    "stages_huge": f'[0.2,"family",1000,4,{HUGE},1700000000]',
    "warps_huge": f'[0.2,"family",1000,{HUGE},3,1700000000]',
    "at_huge": f'[0.2,"family",1000,4,3,{HUGE}]',
    "seconds_huge": f'[{HUGE},"family",1000,4,3,1700000000]',
    "size_negative": '[0.2,"family",-2000,4,3,1700000000]',
    "size_more_negative": '[0.2,"family",-5000,4,3,1700000000]',
    "size_zero": '[0.2,"family",0,4,3,1700000000]',
    "seconds_nan": '[NaN,"family",1000,4,3,1700000000]',
    "seconds_inf": '[Infinity,"family",1000,4,3,1700000000]',
    "seconds_negative": '[-1.0,"family",1000,4,3,1700000000]',
    "at_nan": '[0.2,"family",1000,4,3,NaN]',
    "family_not_text": "[0.2,[1],1000,4,3,1700000000]",
    "tiles_huge": f'[0.2,"family",1000,4,3,1700000000,{HUGE}]',
    "dots_huge": f'[0.2,"family",1000,4,3,1700000000,1,{HUGE}]',
    "dots_negative": '[0.2,"family",1000,4,3,1700000000,1,-1]',
    "fields_too_many": '[0.2,"family",1000,4,3,1700000000,1,1,1]',
}


def features(
    key: str, family: str = "family", size: int = 1000, warps: int = 4, stages: int = 3
) -> CostFeatures:
    return CostFeatures(key=key, family=family, size=size, num_warps=warps, num_stages=stages)


def write_rows(folder: Path, rows: dict[str, str]) -> None:
    text = ",".join(f'"{key}":{row}' for key, row in rows.items())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / COSTS_FILE).write_text('{"format":1,"records":{' + text + "}}")


def stored(folder: Path) -> dict[str, Any]:
    records: dict[str, Any] = json.loads((folder / COSTS_FILE).read_text())["records"]
    return records


async def opened(folder: Path) -> GuardedDisk:
    disk = GuardedDisk(folder)
    await disk.open()
    return disk


async def test_rows_that_make_no_sense_are_ignored_and_not_written_back(tmp_path: Path) -> None:
    write_rows(tmp_path, {"good": GOOD, **NONSENSE})
    costs = CompileCosts(await opened(tmp_path))
    assert await costs.expect(features("good")) == pytest.approx(0.7)
    for key in NONSENSE:  # guessed from the family's sensible record, never raised
        guess = await costs.expect(features(key))
        assert guess == pytest.approx(0.7)
    assert costs.record(features("new"), 1.5)
    await costs.save()
    assert set(stored(tmp_path)) == {"good", "new"}


async def test_a_save_merging_a_file_with_a_huge_number_neither_raises_nor_keeps_it(tmp_path: Path) -> None:
    # More rows than are kept, so that the save sorts them by time: one time is 10**400.
    rows = {f"{i:016x}": '[0.1,"family",100,4,3,1700000000]' for i in range(COSTS_MAX_RECORDS + 50)}
    write_rows(tmp_path, {**rows, "huge": f'[0.1,"family",100,4,3,{HUGE}]'})
    costs = CompileCosts(await opened(tmp_path))
    assert costs.record(features("new"), 1.0)
    await costs.save()  # never raises: it runs behind the pool, in its task group
    kept = stored(tmp_path)
    assert len(kept) == COSTS_MAX_RECORDS
    assert "new" in kept and "huge" not in kept


async def test_a_save_that_cannot_write_gives_up_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_costs, "write_state", full)
    costs = CompileCosts(await opened(tmp_path))
    assert await costs.expect(features("k")) > 0
    assert costs.record(features("k"), 1.0)
    await costs.save()
    assert not (tmp_path / COSTS_FILE).exists()


async def test_a_folder_in_place_of_the_file_is_removed_and_replaced(tmp_path: Path) -> None:
    (tmp_path / COSTS_FILE).mkdir()  # a rename cannot replace a folder: it is removed first
    (tmp_path / COSTS_FILE / "inside").write_text("{}")
    costs = CompileCosts(await opened(tmp_path))
    assert await costs.expect(features("k")) > 0
    assert costs.record(features("k"), 1.0)
    await costs.save()
    assert set(stored(tmp_path)) == {"k"}


async def test_nonsense_times_and_features_are_not_recorded(tmp_path: Path) -> None:
    costs = CompileCosts(await opened(tmp_path))
    assert not costs.record(features("nan"), float("nan"))
    assert not costs.record(features("negative"), -1.0)
    assert not costs.record(features("size", size=-2000), 1.0)
    assert await costs.expect(features("k", size=-2000)) > 0  # a guess, not ZeroDivisionError
    assert await costs.expect(features("k", stages=10**400, warps=10**400)) > 0
    assert not (tmp_path / COSTS_FILE).exists()


async def test_a_pool_on_a_folder_with_a_nonsense_row_compiles_and_drops_it(cache_dir: Path) -> None:
    write_rows(cache_dir, {"aaaaaaaaaaaaaaaa": '[0.2,"f",-2000,4,3,1700000000]'})
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir) as pool:
        kernel = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
    assert set(stored(cache_dir)) == {kernel.key[:16]}


async def test_a_fifo_in_place_of_the_file_blocks_nothing_and_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / COSTS_FILE
    os.mkfifo(path)
    costs = CompileCosts(await opened(tmp_path))
    try:
        with anyio.fail_after(5):
            await costs.expect(features("k"))
            assert costs.record(features("k"), 1.5)
            await costs.save()
        assert stat.S_ISREG(os.stat(path).st_mode)
        assert await CompileCosts(await opened(tmp_path)).expect(features("k")) == pytest.approx(1.5)
    finally:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            # Wake a reader stuck in open(): a writer that closes at once.
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


async def test_a_file_too_large_is_not_read_and_is_replaced(tmp_path: Path) -> None:
    filler = {f"{i:016x}": '[0.1,"family",100,4,3,1700000000]' for i in range(COSTS_MAX_BYTES // 40)}
    write_rows(tmp_path, {"k": '[9.0,"family",1000,4,3,1800000000]', **filler})
    assert (tmp_path / COSTS_FILE).stat().st_size > COSTS_MAX_BYTES
    costs = CompileCosts(await opened(tmp_path))
    assert await costs.expect(features("k")) != pytest.approx(9.0)
    assert costs.record(features("new"), 1.0)
    await costs.save()
    assert set(stored(tmp_path)) == {"new"}


async def test_a_load_cancelled_with_its_request_is_done_again_by_the_next(tmp_path: Path) -> None:
    write_rows(tmp_path, {"k": GOOD})
    costs = CompileCosts(await opened(tmp_path))
    with anyio.move_on_after(0):  # the first request is cancelled while the file loads
        await costs.expect(features("k"))
    assert await costs.expect(features("k")) == pytest.approx(0.7)


CHILD = """
import sys, anyio
from acompile._cache import CompileCosts, CostFeatures, GuardedDisk

async def main(folder, tag, count):
    disk = GuardedDisk(folder)
    await disk.open()
    costs = CompileCosts(disk)
    for i in range(count):
        costs.record(CostFeatures(f"{tag}{i}", "family", 1000, 4, 3), 1.0)
        await costs.save()

anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


def test_processes_saving_at_once_lose_no_record(tmp_path: Path) -> None:
    count = 400
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), tag, str(count)], env=subprocess_env())
        for tag in "ab"
    ]
    assert [child.wait(timeout=120) for child in children] == [0, 0]
    assert set(stored(tmp_path)) == {f"{tag}{i}" for tag in "ab" for i in range(count)}


async def test_a_stuck_lock_holder_delays_a_save_a_moment_only(tmp_path: Path) -> None:
    costs = CompileCosts(await opened(tmp_path))
    await costs.expect(features("k"))
    held = os.open(tmp_path / COSTS_LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # a holder that never lets go
        assert costs.record(features("k"), 1.5)
        started = time.monotonic()
        await costs.save()
        assert time.monotonic() - started < 2.0
    finally:
        os.close(held)
    assert stored(tmp_path)["k"][0] == pytest.approx(1.5)


def triton_payload(
    key: str, warps: int = 4, stages: int = 3, source: str = "def matmul(...): ...", **constexprs: int
) -> dict[str, Any]:
    return {
        "key": key,
        "name": "matmul",
        "constexprs": constexprs,
        "options": {"num_warps": warps, "num_stages": stages},
        "kernel": {"source": source},
        "key_parts": {"kernel": source},
    }


# Two kernels of the same size, never compiled: one multiplies matrices, one adds vectors.
MATMUL_SOURCE = """def matmul(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        acc += tl.dot(tl.load(a_ptr + k), tl.load(b_ptr + k))
    tl.store(c_ptr, acc)
"""
ADD_SOURCE = """def vadd(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    for k in range(0, K, BLOCK):
        tl.store(c_ptr + offsets, tl.load(a_ptr + offsets) + tl.load(b_ptr + offsets))
    tl.store(c_ptr, 0.0)
"""


async def test_a_kernel_never_compiled_with_a_dot_product_is_expected_longer(tmp_path: Path) -> None:
    """The first guess, before any compile of either was measured: the matrix multiply (the long
    compile of Triton) ahead of the elementwise kernel of the same size, whatever is asked first;
    and the guess holds for the next process, which reads the dot products from the file."""
    matmul = CostFeatures.of(triton_payload("mm", source=MATMUL_SOURCE, BLOCK=64), "matmul")
    vadd = CostFeatures.of(triton_payload("va", source=ADD_SOURCE, BLOCK=64), "vadd")
    assert (matmul.dots, vadd.dots) == (1, 0)
    assert abs(matmul.size - vadd.size) < 40
    for first, second in ((matmul, vadd), (vadd, matmul)):
        costs = CompileCosts(await opened(tmp_path / first.key))
        guesses = {first: await costs.expect(first), second: await costs.expect(second)}
        assert guesses[matmul] > 2 * guesses[vadd]
    # A record keeps the count: a new kernel with a dot is guessed from the rate they taught.
    costs = CompileCosts(await opened(tmp_path / "saved"))
    costs.record(matmul, 3.0)
    costs.record(vadd, 0.3)
    await costs.save()
    assert stored(tmp_path / "saved")["mm"][7] == 1
    again = CompileCosts(await opened(tmp_path / "saved"))
    other = CostFeatures.of(triton_payload("mm2", source=MATMUL_SOURCE + "# another\n", BLOCK=64), "m2")
    assert await again.expect(other) > 1.0


async def test_a_small_tile_is_never_guessed_a_sliver_of_its_kin(tmp_path: Path) -> None:
    """Part of a compile does not grow with its tiles: a config 64 times smaller than a measured
    one of its family is expected to take more than a tenth of its time, not 1/16th."""
    big = CostFeatures.of(triton_payload("big", BLOCK_M=256, BLOCK_N=64, BLOCK_K=64), "matmul")
    small = CostFeatures.of(triton_payload("small", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32), "matmul")
    costs = CompileCosts(await opened(tmp_path))
    costs.record(big, 3.0)
    assert 0.3 < await costs.expect(small) < 3.0


async def test_bigger_tiles_of_a_kernel_are_expected_longer_with_or_without_a_record(tmp_path: Path) -> None:
    small = CostFeatures.of(triton_payload("small", BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), "matmul")
    big = CostFeatures.of(triton_payload("big", BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), "matmul")
    assert small.family == big.family
    for first, second in ((small, big), (big, small)):  # whichever is asked first
        costs = CompileCosts(await opened(tmp_path))
        one, two = await costs.expect(first), await costs.expect(second)
        by_features = dict(zip((first, second), (one, two), strict=True))
        assert by_features[big] > by_features[small]
    # Once the small one was measured, the big one is guessed from it, longer.
    costs = CompileCosts(await opened(tmp_path))
    costs.record(small, 2.0)
    assert await costs.expect(big) > 2.0
    # More warps share a tile: shorter; more stages unroll it more: longer.
    wide = CostFeatures.of(triton_payload("wide", warps=8, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), "matmul")
    deep = CostFeatures.of(triton_payload("deep", stages=5, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), "matmul")
    assert await costs.expect(wide) < 2.0 < await costs.expect(deep)
    # Tile sizes are kept in the file, for the next process's guesses.
    await costs.save()
    again = CompileCosts(await opened(tmp_path))
    assert await again.expect(big) == pytest.approx(await costs.expect(big))
