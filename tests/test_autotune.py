"""Parallel autotuning: real Triton compiles for cuda:90 (no GPU needed), benchmarks faked where
there is no GPU, real ones in the `gpu` tests."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import triton
from conftest import TARGET, RedisServer, asyncio_only, run_python
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile import _autotune
from acompile._autotune import TunedKernel, TuneResult, autotune, pin_key

pytestmark = pytest.mark.anyio
# The tests marked asyncio_only are about autotune's choices, its stored and shared choices and
# its errors, not the event loop: they run on asyncio only. Those with requests and benchmarks
# concurrent on the loop keep both loops.

KEY = {"n": 4096, "dtype": "fp32"}
N = 4096


def pool(cache_dir: Path, workers: int = 2, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)


def add_configs(*blocks: int, num_warps: int = 4) -> list[triton.Config]:
    return [triton.Config({"BLOCK": b}, num_warps=num_warps) for b in blocks]


def add_grid(meta: dict[str, Any]) -> tuple[int]:
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


# Stand-ins for tensors where no GPU is: benchmarking is faked, launching never happens.
FAKE_ARGS = (object(), object(), object(), N)

# Fake times per BLOCK: 256 is the fastest.
FAKE_MS = {64: 0.9, 128: 0.5, 256: 0.2, 512: 0.4, 1024: 0.7}


@pytest.fixture(autouse=True)
def no_gpu_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests not marked `gpu` see no GPU, here or on a GPU machine (where their fake arguments
    could not run); FakeGPU, where a test makes one, replaces this."""
    if request.node.get_closest_marker("gpu") is None and "gpu_info" not in request.node.name:

        def no_gpu(wanted: Any, hint: str) -> Any:
            raise acompile.DeviceUnavailableError(f"no usable GPU here (the test hides it); {hint}")

        monkeypatch.setattr(_autotune, "_gpu_info", no_gpu)


class FakeGPU:
    """Replaces the GPU parts of the tuner: every screening and every full run is recorded, and
    timed per BLOCK (FAKE_MS, unless ``screen_ms`` or ``full_ms`` say otherwise)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        fail: frozenset[int] = frozenset(),
        screen_ms: dict[int, float] | None = None,
        full_ms: dict[int, float] | None = None,
    ) -> None:
        self.benchmarked: list[tuple[int, int, tuple[int, ...]]] = []
        self.full_runs: list[int] = []
        self.fail = fail
        self.screen_ms = {**FAKE_MS, **(screen_ms or {})}
        self.full_ms = {**self.screen_ms, **(full_ms or {})}
        monkeypatch.setattr(_autotune, "_gpu_info", lambda wanted, hint: (0, "Fake GPU", 90))
        monkeypatch.setattr(_autotune, "_prepare_gpu", lambda device: None)
        monkeypatch.setattr(_autotune, "_benchmark", self.benchmark)

    def benchmark(
        self, kernel: Any, grid: tuple[int, ...], args: Any, reset: Any, device: Any, flush: Any,
        budget: Any, hopeless_ms: float | None,
    ) -> tuple[float, int]:  # fmt: skip
        block = kernel._constants["BLOCK"]
        full = budget.timed_ms == _autotune._FULL_TIMED_MS
        if full:
            self.full_runs.append(block)
        else:
            self.benchmarked.append((block, kernel.metadata.num_warps, grid))
        if block in self.fail:
            raise RuntimeError(f"out of resource: shared memory (fake, BLOCK={block})")
        ms = (self.full_ms if full else self.screen_ms)[block]
        if hopeless_ms is not None and ms > hopeless_ms:
            return ms, 1
        return ms, 250 if full else 25


def tune(p: acompile.CompilePool, configs: list[Any], **kw: Any) -> Any:
    kw.setdefault("signature", ADD_SIG)
    kw.setdefault("grid", add_grid)
    kw.setdefault("key", KEY)
    return autotune(p, add_kernel, configs, **kw)


@pytest.fixture
def compile_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """("asked", constexprs) when CompilePool.compile() is called, ("landed", constexprs) when it
    returns, in order."""
    log: list[tuple[str, dict[str, Any]]] = []
    original = acompile.CompilePool.compile

    async def spy(self: acompile.CompilePool, spec: Any, **kw: Any) -> Any:
        log.append(("asked", dict(spec.constexprs)))
        kernel = await original(self, spec, **kw)
        log.append(("landed", dict(spec.constexprs)))
        return kernel

    monkeypatch.setattr(acompile.CompilePool, "compile", spy)
    yield log


# --- compiling, without a GPU ---------------------------------------------------------------


@asyncio_only
async def test_every_config_is_asked_for_at_once_the_longest_expected_first(
    cache_dir: Path, compile_log: list[tuple[str, dict[str, Any]]]
) -> None:
    configs = add_configs(64, 128, 256, 512)
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.DeviceUnavailableError) as info:
            await tune(p, configs, args=FAKE_ARGS)
        stats = p.stats()
        # All four were asked for before any landed, so both workers had work at the same time,
        # the largest blocks (the longest compiles) first.
        assert compile_log[:4] == [("asked", {"BLOCK": b}) for b in (512, 256, 128, 64)]
        assert stats["compiled"] == 4 and stats["jobs"]["done"] == 4 and stats["failed"] == 0
        kernels = await p.gather(
            *[acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128, 256, 512)]
        )
        assert len({k.key for k in kernels}) == 4
        assert p.stats()["cache"]["hits_memory"] == 4  # the configs' kernels are what pool.triton() gives
    message = str(info.value)
    assert "needs a GPU" in message and "4 configs of add_kernel" in message
    assert "those that compiled are in the cache" in message and "pin=" in message and pin_key(KEY) in message


@asyncio_only
async def test_no_gpu_and_nothing_stored_is_a_clear_error_even_without_args(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.DeviceUnavailableError, match="needs a GPU"):
            await tune(p, add_configs(64, 128))
        # Nothing was stored: asking again is the same error, after cache hits only.
        with pytest.raises(acompile.DeviceUnavailableError):
            await tune(p, add_configs(64, 128))
        assert p.stats()["compiled"] == 2


@asyncio_only
async def test_a_single_config_needs_no_benchmark(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        k = await tune(p, add_configs(128))
    assert isinstance(k, TunedKernel) and isinstance(k, acompile.TritonKernel)
    assert k.tuning.source == "single" and k.tuning.index == 0
    assert k.config == {"constexprs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3}
    assert k.cubin[:4] == b"\x7fELF" and k.name == "add_kernel"


# --- benchmarking (faked here) and the stored choice ----------------------------------------


@asyncio_only
async def test_the_fastest_config_wins_and_its_choice_is_stored(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, compile_log: list[tuple[str, dict[str, Any]]]
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = add_configs(64, 128, 256, 512)
    async with pool(cache_dir) as p:
        k = await tune(p, configs, args=FAKE_ARGS, warmup=3, repeats=7)
        r = k.tuning
        assert isinstance(r, TuneResult)
        assert r.source == "benchmark" and r.index == 2 and r.device == "Fake GPU"
        assert k.config["constexprs"] == {"BLOCK": 256}
        assert k.key == (await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 256})).key
        assert r.timings == {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.4} and r.skipped == {}
        # Each screened once, with its own grid from grid(meta). The leader (within 10% of the
        # best screened) is run in full; so may be one that led before it landed, while the GPU
        # had nothing else to do, but none twice.
        assert sorted(gpu.benchmarked) == [(64, 4, (64,)), (128, 4, (32,)), (256, 4, (16,)), (512, 4, (8,))]
        assert 256 in gpu.full_runs and len(set(gpu.full_runs)) == len(gpu.full_runs)
        for t in r.trials:  # a full run's median where there was one; 1: out after a launch
            assert t.launches in ((250,) if t.config["constexprs"]["BLOCK"] in gpu.full_runs else (1, 25))
        assert "<- chosen" in r.summary() and "BLOCK=256" in r.summary()

        # Asked again: the stored choice, no benchmark, no compile.
        again = await tune(p, configs, args=FAKE_ARGS)
        assert again.tuning.source == "cache" and again.key == k.key and again.tuning.key == r.key
        assert again.tuning.timings == r.timings and again.tuning.device == "Fake GPU"
        # The configs in another order are the same tuning: same key, same winner.
        shuffled = await tune(p, configs[::-1], args=FAKE_ARGS)
        assert shuffled.tuning.source == "cache" and shuffled.tuning.key == r.key
        assert shuffled.tuning.index == 1 and shuffled.key == k.key
        assert shuffled.tuning.timings == {3: 0.9, 2: 0.5, 1: 0.2, 0: 0.4}
        # Another problem key tunes anew.
        other = await tune(p, configs, args=FAKE_ARGS, key={"n": 8192, "dtype": "fp32"})
        assert other.tuning.source == "benchmark" and other.tuning.key != r.key
        # retune=True measures again.
        assert (await tune(p, configs, args=FAKE_ARGS, retune=True)).tuning.source == "benchmark"
        assert len(gpu.benchmarked) == 12 and gpu.full_runs.count(256) == 3
        # Three tunings of four configs; the stored choices and pool.triton() asked for one each.
        assert sum(event == "asked" for event, _ in compile_log) == 3 * 4 + 3
        assert p.stats()["compiled"] == 4  # BLOCK=256 asked directly, and the retunes, were hits


@asyncio_only
async def test_the_leaders_are_run_in_full_and_the_fastest_full_run_wins(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Screened, 512 is within 10% of 256: both lead. Run in full, 512 is the faster.
    gpu = FakeGPU(monkeypatch, screen_ms={512: 0.21}, full_ms={256: 0.25, 512: 0.22})
    async with pool(cache_dir) as p:
        k = await tune(p, add_configs(64, 128, 256, 512), args=FAKE_ARGS)
    r = k.tuning
    assert r.source == "benchmark" and r.index == 3 and k.config["constexprs"] == {"BLOCK": 512}
    assert {256, 512} <= set(gpu.full_runs) and len(gpu.benchmarked) == 4
    assert r.timings == {0: 0.9, 1: 0.5, 2: 0.25, 3: 0.22}
    assert r.trials[2].launches == r.trials[3].launches == 250


async def test_configs_are_benchmarked_while_others_still_compile(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, compile_log: list[tuple[str, dict[str, Any]]]
) -> None:
    from acompile._bench.corpus import MATMUL_ATTRS, MATMUL_SIG, matmul_grid, matmul_kernel

    # A 128x256x64 tile takes seconds to compile, a 32x32x32 one a fraction of that.
    small = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "ACT": 0}, num_warps=2)
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "ACT": 0}, num_warps=8)
    seen: dict[int, list[tuple[str, int]]] = {}

    def benchmark(kernel: Any, *rest: Any) -> tuple[float, int]:
        block = kernel._constants["BLOCK_M"]
        # What the pool had asked for and delivered when this config was benchmarked.
        log = anyio.from_thread.run_sync(lambda: [(event, c["BLOCK_M"]) for event, c in compile_log])
        seen.setdefault(block, log)
        return (0.5 if block == 128 else 1.0), 25

    monkeypatch.setattr(_autotune, "_gpu_info", lambda wanted, hint: (0, "Fake GPU", 90))
    monkeypatch.setattr(_autotune, "_prepare_gpu", lambda device: None)
    monkeypatch.setattr(_autotune, "_benchmark", benchmark)
    args = (object(), object(), object(), 4096, 4096, 4096, 4096, 1, 4096, 1, 4096, 1)
    async with pool(cache_dir) as p:
        k = await autotune(
            p, matmul_kernel, [small, big], signature=MATMUL_SIG, attrs=MATMUL_ATTRS, args=args,
            grid=matmul_grid, key=[4096] * 3,
        )  # fmt: skip
    assert k.tuning.source == "benchmark" and k.tuning.index == 1
    # The longest expected compile was asked for first; the small config was benchmarked while
    # the big one still compiled.
    assert compile_log[:2] == [("asked", big.kwargs), ("asked", small.kwargs)]
    assert seen[32] == [("asked", 128), ("asked", 32), ("landed", 32)]


@asyncio_only
async def test_a_stored_choice_is_used_by_a_fresh_process_without_a_gpu(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeGPU(monkeypatch)
    async with pool(cache_dir) as p:
        winner = await tune(p, add_configs(64, 128, 256, 512), args=FAKE_ARGS)
    assert winner.tuning.source == "benchmark"
    # A fresh interpreter (no fakes, no GPU), with the configs in another order.
    script = textwrap.dedent(
        f"""
        import json, anyio, triton, acompile
        from acompile._autotune import autotune
        from kernels_for_tests import add_kernel, ADD_SIG

        async def main():
            async with acompile.CompilePool(2, target="cuda:90", cache_dir={str(cache_dir)!r}, prestart=False) as p:
                configs = [triton.Config({{"BLOCK": b}}, num_warps=4) for b in (512, 256, 128, 64)]
                k = await autotune(p, add_kernel, configs, signature=ADD_SIG, key={KEY!r},
                                   grid=lambda m: (triton.cdiv(m["n"], m["BLOCK"]),))
                print(json.dumps({{"source": k.tuning.source, "index": k.tuning.index, "key": k.key,
                                   "config": k.config, "started": p.stats()["workers"]["started"],
                                   "ptx": k.asm["ptx"]}}))

        anyio.run(main)
        """
    )
    out = await anyio.to_thread.run_sync(run_python, script)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["source"] == "cache" and result["index"] == 1 and result["key"] == winner.key
    assert result["config"] == winner.config and result["ptx"] == winner.asm["ptx"]
    assert result["started"] == 0  # not one compile: the choice and its kernel came from disk


@asyncio_only
async def test_another_replica_finds_the_choice_in_the_shared_tier(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = add_configs(64, 128, 256)
    async with pool(tmp_path / "replica-a", shared_cache=redis_server.url) as p:
        first = await tune(p, configs, args=FAKE_ARGS)
    assert first.tuning.source == "benchmark" and len(gpu.benchmarked) == 3
    async with pool(tmp_path / "replica-b", shared_cache=redis_server.url, prestart=False) as p:
        second = await tune(p, configs, args=FAKE_ARGS)
        stats = p.stats()
    assert second.tuning.source == "cache" and second.key == first.key and len(gpu.benchmarked) == 3
    assert stats["workers"]["started"] == 0 and stats["cache"]["hits_shared"] >= 1


async def test_concurrent_callers_of_one_tuning_benchmark_once(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = add_configs(64, 128, 256)
    results: list[Any] = []
    async with pool(cache_dir) as p:

        async def one() -> None:
            results.append(await tune(p, configs, args=FAKE_ARGS))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
    assert sorted(r.tuning.source for r in results) == ["benchmark", "cache", "cache"]
    assert len({r.key for r in results}) == 1 and len(gpu.benchmarked) == 3


@asyncio_only
async def test_a_corrupt_stored_choice_is_tuned_again(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = add_configs(64, 256)
    async with pool(cache_dir) as p:
        first = await tune(p, configs, args=FAKE_ARGS)
        await p._cache.put_record(first.tuning.key, "add_kernel", {"choice": b"{not json"}, {})
        # This pool remembers its choice: it does not read the record again.
        assert (await tune(p, configs, args=FAKE_ARGS)).tuning.source == "cache" and len(gpu.benchmarked) == 2
    async with pool(cache_dir) as p:
        again = await tune(p, configs, args=FAKE_ARGS)
        assert again.tuning.source == "benchmark" and again.key == first.key and len(gpu.benchmarked) == 4
        assert "unusable" in caplog.text
    async with pool(cache_dir) as p:
        assert (await tune(p, configs, args=FAKE_ARGS)).tuning.source == "cache"


# --- pinning ----------------------------------------------------------------------------------


@asyncio_only
async def test_pin_forces_a_config_without_benchmark_or_gpu(
    cache_dir: Path, tmp_path: Path, compile_log: list[tuple[str, dict[str, Any]]]
) -> None:
    configs = add_configs(64, 128, 256, 512)
    async with pool(cache_dir) as p:
        by_index = await tune(p, configs, pin={pin_key(KEY): 3})
        assert by_index.tuning.source == "pin" and by_index.tuning.index == 3
        assert by_index.config["constexprs"] == {"BLOCK": 512}
        # Only the pinned config was asked for.
        assert p.stats()["compiled"] == 1 and compile_log == [
            ("asked", {"BLOCK": 512}),
            ("landed", {"BLOCK": 512}),
        ]

        # A config not among them, as a dict; keys may be the key itself where it is hashable.
        custom = {"constexprs": {"BLOCK": 1024}, "num_warps": 8, "num_stages": 2}
        pinned = await tune(p, configs, key=(N, "fp32"), pin={(N, "fp32"): custom})
        assert pinned.tuning.index is None and pinned.config == custom
        assert pinned.metadata.num_warps == 8 and pinned.metadata.num_stages == 2

        # From a file, its keys written as any JSON text of the key.
        table = tmp_path / "pins.json"
        table.write_text(json.dumps({'{"dtype":"fp32","n":4096}': 1, "[1, 2]": 0}))
        from_file = await tune(p, configs, pin=str(table))
        assert from_file.tuning.source == "pin" and from_file.config["constexprs"] == {"BLOCK": 128}
        assert from_file.tuning.as_pin() == {pin_key(KEY): from_file.config}

        # A key the table does not name tunes as usual (here: no GPU).
        with pytest.raises(acompile.DeviceUnavailableError):
            await tune(p, configs, key={"n": 1}, pin=table)


@asyncio_only
async def test_a_pin_wins_over_a_stored_choice(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = add_configs(64, 128, 256)
    async with pool(cache_dir) as p:
        tuned = await tune(p, configs, args=FAKE_ARGS)
        assert tuned.config["constexprs"] == {"BLOCK": 256}
        pinned = await tune(p, configs, args=FAKE_ARGS, pin={pin_key(KEY): 0})
        assert pinned.tuning.source == "pin" and pinned.config["constexprs"] == {"BLOCK": 64}
        # Pinning stores nothing: the tuned choice stays.
        assert (await tune(p, configs, args=FAKE_ARGS)).config["constexprs"] == {"BLOCK": 256}
    assert len(gpu.benchmarked) == 3


@asyncio_only
async def test_configs_map_to_the_same_requests_as_pool_triton_and_duplicates_compile_once(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, compile_log: list[tuple[str, dict[str, Any]]]
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = [
        triton.Config({"BLOCK": 64}, num_warps=8, num_stages=2, maxnreg=128),
        {"constexprs": {"BLOCK": 256}},  # num_warps 4 and num_stages 3, as pool.triton()
        triton.Config({"BLOCK": 256}),  # num_ctas=1 is the default: the same kernel
    ]
    async with pool(cache_dir) as p:
        k = await tune(p, configs, args=FAKE_ARGS, options={"enable_fp_fusion": False})
        assert len(compile_log) == 4 and p.stats()["compiled"] == 2
        assert k.tuning.skipped == {2: "the same kernel as config #1"} and set(k.tuning.timings) == {0, 1}
        assert k.config == {"constexprs": {"BLOCK": 256}, "num_warps": 4, "num_stages": 3}
        first = await p.triton(
            add_kernel,
            signature=ADD_SIG,
            constexprs={"BLOCK": 64},
            num_warps=8,
            num_stages=2,
            maxnreg=128,
            enable_fp_fusion=False,
        )
        second = await p.triton(
            add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 256}, enable_fp_fusion=False
        )
        assert [t.kernel_key for t in k.tuning.trials] == [first.key, second.key, second.key]
        assert p.stats()["compiled"] == 2
        assert k.tuning.trials[0].config == {
            "constexprs": {"BLOCK": 64},
            "num_warps": 8,
            "num_stages": 2,
            "maxnreg": 128,
        }
        # The stored choice, read back, reports the duplicate the same way.
        p2_configs = configs[::-1]
    async with pool(cache_dir, prestart=False) as p:
        again = await tune(p, p2_configs, args=FAKE_ARGS, options={"enable_fp_fusion": False})
    assert again.tuning.source == "cache" and again.tuning.index == 0 and again.key == k.key
    assert again.tuning.skipped == {1: "the same kernel as config #0"} and set(again.tuning.timings) == {0, 2}
    assert len(gpu.benchmarked) == 2


# --- failing configs --------------------------------------------------------------------------


@asyncio_only
async def test_configs_that_fail_to_compile_are_skipped_and_reported(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGPU(monkeypatch)
    configs = [*add_configs(3), *add_configs(64, 128), *add_configs(5)]
    async with pool(cache_dir) as p:
        k = await tune(p, configs, args=FAKE_ARGS)
    r = k.tuning
    assert r.source == "benchmark" and r.index == 2 and k.config["constexprs"] == {"BLOCK": 128}
    assert set(r.skipped) == {0, 3} and all("power of 2" in why for why in r.skipped.values())
    assert isinstance(r.trials[0].error, acompile.CompileError) and r.trials[0].error.log
    assert r.timings == {1: 0.9, 2: 0.5} and {b for b, _, _ in gpu.benchmarked} == {64, 128}
    assert "skipped: compile failed: arange's range must be a power of 2" in r.summary()


@asyncio_only
async def test_only_one_config_compiling_needs_no_gpu(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        k = await tune(p, [*add_configs(3), *add_configs(128), *add_configs(7)])
    assert k.tuning.source == "single" and k.tuning.index == 1 and set(k.tuning.skipped) == {0, 2}


@asyncio_only
async def test_all_configs_failing_is_a_compile_error_listing_each(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.CompileError) as info:
            await tune(p, [*add_configs(3), *add_configs(6, num_warps=8)])
        assert await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})  # the pool goes on
    err = info.value
    text = str(err)
    assert "no config of add_kernel compiled (2 tried)" in text
    assert "#0 BLOCK=3 num_warps=4" in text and "#1 BLOCK=6 num_warps=8" in text
    assert text.count("power of 2") == 2
    assert err.kernel == "add_kernel" and err.backend == "triton" and err.log  # the first failure's details
    assert set(err.failures) == {0, 1}  # type: ignore[attr-defined]
    assert isinstance(err.__cause__, acompile.CompileError)


@asyncio_only
async def test_configs_that_cannot_run_are_skipped_and_reported(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeGPU(monkeypatch, fail=frozenset({256}))
    async with pool(cache_dir) as p:
        k = await tune(p, add_configs(64, 128, 256), args=FAKE_ARGS)
        assert k.tuning.index == 1 and k.tuning.skipped == {
            2: "could not run: RuntimeError: out of resource: shared memory (fake, BLOCK=256)"
        }
        # The skipped config's reason is stored with the choice.
        again = await tune(p, add_configs(64, 128, 256), args=FAKE_ARGS)
        assert again.tuning.source == "cache" and again.tuning.skipped == k.tuning.skipped

    FakeGPU(monkeypatch, fail=frozenset({64, 128}))
    async with pool(cache_dir / "other") as p:
        with pytest.raises(acompile.CompileError, match=r"no config of add_kernel ran \(2 tried\)"):
            await tune(p, add_configs(64, 128), args=FAKE_ARGS)


# --- arguments --------------------------------------------------------------------------------


@asyncio_only
async def test_wrong_arguments_are_invalid_spec_errors_before_any_compile(cache_dir: Path) -> None:
    bad = pytest.raises(acompile.InvalidSpecError)
    async with pool(cache_dir, prestart=False) as p:
        with bad:
            await tune(p, [])
        with pytest.raises(acompile.InvalidSpecError, match="pre_hook"):
            await tune(p, [triton.Config({"BLOCK": 64}, pre_hook=lambda args: None)])
        with pytest.raises(acompile.InvalidSpecError, match="constexprs= also sets"):
            await tune(p, add_configs(64), constexprs={"BLOCK": 128})
        with pytest.raises(acompile.InvalidSpecError, match="config #1"):
            await tune(p, [{"constexprs": {"BLOCK": 64}}, {"constexprs": {"BLOK": 64}}])
        with pytest.raises(acompile.InvalidSpecError, match="num_warps"):
            await tune(p, [{"constexprs": {"BLOCK": 64}, "num_warps": 3}])
        with pytest.raises(acompile.InvalidSpecError, match="JSON"):
            await tune(p, add_configs(64), key={"dtype": object()})
        with pytest.raises(acompile.InvalidSpecError, match="4 runtime arguments"):
            await tune(p, add_configs(64), args=(1, 2))
        with pytest.raises(acompile.InvalidSpecError, match="there are 1 configs"):
            await tune(p, add_configs(64), pin={pin_key(KEY): 5})
        with pytest.raises(acompile.InvalidSpecError, match="pin file"):
            await tune(p, add_configs(64), pin=str(cache_dir / "missing.json"))
        with bad:
            await tune(p, ["BLOCK=64"])
        with bad:
            await tune(p, add_configs(64, 128), repeats=0)
        assert p.stats()["workers"]["started"] == 0


@asyncio_only
async def test_a_triton_autotune_kernel_brings_its_configs(cache_dir: Path) -> None:
    wrapped = triton.autotune(configs=add_configs(64, 128), key=["n"])(add_kernel)
    async with pool(cache_dir) as p:
        k = await autotune(p, wrapped, None, signature=ADD_SIG, grid=add_grid, pin={"null": 1})
    assert k.config["constexprs"] == {"BLOCK": 128} and k.tuning.source == "pin"


@asyncio_only
async def test_outside_the_pool_is_a_pool_closed_error(cache_dir: Path) -> None:
    p = pool(cache_dir)
    with pytest.raises(acompile.PoolClosedError):
        await tune(p, add_configs(64))


# --- the GPU parts, against stand-ins -----------------------------------------------------------


@asyncio_only
async def test_a_callable_grid_at_launch_gets_the_runtime_arguments(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool(cache_dir) as p:
        k = await tune(p, add_configs(64, 256), pin={pin_key(KEY): 1})
    launched: list[tuple[Any, tuple[Any, ...]]] = []

    def fake_subscript(self: Any, grid: Any) -> Any:  # a grid of ints' launch (no GPU here)
        return lambda *args, stream=None: launched.append((grid, args))

    monkeypatch.setattr(acompile.TritonKernel, "load", lambda self: None)
    monkeypatch.setattr(acompile.TritonKernel, "_subscript", fake_subscript)
    metas: list[dict[str, Any]] = []

    def grid(meta: dict[str, Any]) -> tuple[int]:
        metas.append(meta)
        return (triton.cdiv(meta["n"], meta["BLOCK"]),)

    run = k[grid]
    run("x", "y", "out", 1000)
    run("x", "y", "out", 5000)
    k[(7,)]("x", "y", "out", 1)
    assert launched == [
        ((4,), ("x", "y", "out", 1000)),
        ((20,), ("x", "y", "out", 5000)),
        ((7,), ("x", "y", "out", 1)),
    ]
    assert metas[0] == {
        "x_ptr": "x",
        "y_ptr": "y",
        "out_ptr": "out",
        "n": 1000,
        "BLOCK": 256,
        "num_warps": 4,
        "num_stages": 3,
    }


class FakeTorch:
    """Enough of torch.cuda for _benchmark and _gpu_info: a log of calls, and a clock that each
    launch moves on by its duration."""

    def __init__(self, durations: list[float], available: bool = True) -> None:
        self.log: list[str] = []
        self.clock = 0.0
        self.durations = iter(durations)
        log, outer = self.log, self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = 0.0

            def record(self) -> None:
                log.append("record")
                self.t = outer.clock

            def elapsed_time(self, end: Event) -> float:
                return end.t - self.t

        @contextlib.contextmanager
        def device(index: int) -> Iterator[None]:
            log.append(f"device {index}")
            yield

        self.module = types.ModuleType("torch")
        self.module.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
            Event=Event,
            device=device,
            synchronize=lambda: log.append("sync"),
            is_available=lambda: available,
            current_device=lambda: 0,
            get_device_capability=lambda index: (9, 0),
            get_device_name=lambda index: f"Fake H100 #{index}",
        )

    def kernel(self) -> Any:
        outer = self

        class Kernel:
            def __getitem__(self, grid: tuple[int, ...]) -> Any:
                outer.log.append(f"load {grid}")

                def launch(*args: Any) -> None:
                    outer.log.append("launch")
                    outer.clock += next(outer.durations)

                return launch

        return Kernel()


def test_benchmark_warms_up_then_times_each_launch_between_events(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = FakeTorch([100, 1, 100, 100, 5, 1, 3, 2, 4])  # check, probe, two warm-ups, five timed
    monkeypatch.setitem(sys.modules, "torch", torch.module)
    flush = types.SimpleNamespace(zero_=lambda: torch.log.append("flush"))
    budget = _autotune._Budget(25.0, 100.0, warmup=2, repeats=5)
    ms = _autotune._benchmark(
        torch.kernel(), (4,), ("a", 1), lambda: torch.log.append("reset"), (1, "x"), flush, budget, None
    )
    assert ms == (3.0, 5)  # the median of 5, 1, 3, 2, 4
    timed = ["reset", "flush", "record", "launch", "record"]
    assert torch.log == [
        "device 1",
        "load (4,)",
        "reset",
        "launch",
        "sync",
        *["reset", "record", "flush", "record", "launch", "record", "sync"],  # sizes the budgets
        "reset",
        "launch",
        "reset",
        "launch",
        *timed * 5,
        "sync",
    ]


def test_launches_fill_a_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 50 ms launch: one warm-up (budget 25 ms) and the minimum of five timed launches.
    torch = FakeTorch([50] * 8)
    monkeypatch.setitem(sys.modules, "torch", torch.module)
    flush = types.SimpleNamespace(zero_=lambda: None)
    full = _autotune._Budget(25.0, 100.0)
    assert _autotune._benchmark(torch.kernel(), (1,), (), None, (0, "x"), flush, full, None) == (50.0, 5)
    assert torch.log.count("launch") == 1 + 1 + 1 + 5
    # A 2 ms launch: 12 warm-ups and 50 timed, as many as fit in 25 and 100 ms.
    torch = FakeTorch([2] * 64)
    monkeypatch.setitem(sys.modules, "torch", torch.module)
    assert _autotune._benchmark(torch.kernel(), (1,), (), None, (0, "x"), flush, full, None) == (2.0, 50)
    assert torch.log.count("launch") == 1 + 1 + 12 + 50


def test_a_config_much_slower_than_the_best_is_out_after_one_timed_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = FakeTorch([9, 9])
    monkeypatch.setitem(sys.modules, "torch", torch.module)
    flush = types.SimpleNamespace(zero_=lambda: None)
    screen = _autotune._Budget(_autotune._SCREEN_WARMUP_MS, _autotune._SCREEN_TIMED_MS)
    assert _autotune._benchmark(torch.kernel(), (1,), (), None, (0, "x"), flush, screen, 8.0) == (9.0, 1)
    assert torch.log.count("launch") == 2  # the check and the probe


def test_gpu_info_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", FakeTorch([]).module)
    assert _autotune._gpu_info(None, "hint") == (0, "Fake H100 #0", 90)
    assert _autotune._gpu_info(2, "hint") == (2, "Fake H100 #2", 90)
    monkeypatch.setitem(sys.modules, "torch", FakeTorch([], available=False).module)
    with pytest.raises(
        acompile.DeviceUnavailableError, match=re.escape("hint. (PyTorch sees no CUDA device")
    ):
        _autotune._gpu_info(None, "hint")
    monkeypatch.setitem(sys.modules, "torch", None)  # not installed...

    def no_gpu() -> acompile.Target:
        raise acompile.DeviceUnavailableError(
            "no CUDA driver here (fake); pass an explicit target such as ..."
        )

    monkeypatch.setattr(_autotune, "local_target", no_gpu)  # ... and no GPU
    with pytest.raises(
        acompile.DeviceUnavailableError, match=re.escape("hint. (No GPU here: no CUDA driver here (fake).)")
    ):
        _autotune._gpu_info(None, "hint")
    monkeypatch.setattr(_autotune, "local_target", lambda: acompile.Target("cuda", 90))  # ... but a GPU
    with pytest.raises(acompile.BackendUnavailableError, match="install torch"):
        _autotune._gpu_info(None, "hint")


@asyncio_only
async def test_a_gpu_of_another_target_is_refused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeGPU(monkeypatch)
    monkeypatch.setattr(_autotune, "_gpu_info", lambda wanted, hint: (0, "Fake A100", 80))
    async with pool(cache_dir) as p:
        with pytest.raises(
            acompile.DeviceUnavailableError,
            match=re.escape("compiled for cuda:90 and the GPU here (Fake A100) is sm_80"),
        ):
            await tune(p, add_configs(64, 128), args=FAKE_ARGS)


# --- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
async def test_autotune_add_on_the_gpu(cache_dir: Path) -> None:
    import torch

    x, y = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)
    configs = add_configs(128, 256, 512, 1024) + add_configs(1024, num_warps=8)
    key = {"n": x.numel(), "dtype": "fp32"}
    async with acompile.CompilePool(2, cache_dir=cache_dir) as p:  # the local GPU's target
        k = await autotune(
            p, add_kernel, configs, signature=ADD_SIG, args=(x, y, out, x.numel()), grid=add_grid, key=key
        )
        r = k.tuning
        assert r.source == "benchmark" and set(r.timings) == set(range(5)) and not r.skipped
        assert all(0 < ms < 10 for ms in r.timings.values()) and r.device == torch.cuda.get_device_name()
        # The winner is the fastest full run; configs screened only were more than 10% slower.
        assert r.timings[r.index] <= 1.1 * min(r.timings.values())  # type: ignore[index]
        assert r.trials[r.index].launches >= 5  # type: ignore[index, operator]
        out.fill_(float("nan"))
        k[add_grid](x, y, out, x.numel())
        torch.testing.assert_close(out, x + y)
        # Loaded, a tuned kernel's grid functions still get the tuning's meta (no binder is set,
        # not even for a moment: one thread's load beside another's launch).
        assert k._by_grid_function is None
        out.fill_(float("nan"))
        k[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]) * (meta["num_warps"] > 0),)](
            x, y, out, x.numel()
        )
        torch.testing.assert_close(out, x + y)
        again = await autotune(
            p, add_kernel, configs, signature=ADD_SIG, args=(x, y, out, x.numel()), grid=add_grid, key=key
        )
        assert again.tuning.source == "cache" and again.key == k.key


@pytest.mark.gpu
async def test_autotune_matmul_on_the_gpu_with_reset(cache_dir: Path) -> None:
    import torch

    from acompile._bench.corpus import (
        MATMUL_ATTRS,
        MATMUL_SIG,
        matmul_args,
        matmul_configs,
        matmul_grid,
        matmul_kernel,
    )

    torch.manual_seed(0)
    a = torch.randn((512, 384), device="cuda", dtype=torch.float16)
    b = torch.randn((384, 256), device="cuda", dtype=torch.float16)
    c = torch.empty((512, 256), device="cuda", dtype=torch.float16)
    resets = 0

    def reset() -> None:
        nonlocal resets
        resets += 1
        c.fill_(float("nan"))

    async with acompile.CompilePool(4, cache_dir=cache_dir) as p:
        k = await autotune(
            p,
            matmul_kernel,
            matmul_configs(6),
            signature=MATMUL_SIG,
            attrs=MATMUL_ATTRS,
            args=matmul_args(a, b, c),
            grid=matmul_grid,
            key=[512, 256, 384],
            warmup=2,
            repeats=5,
            reset=reset,
        )
    assert k.tuning.source == "benchmark" and len(k.tuning.timings) + len(k.tuning.skipped) == 6
    # Before each launch (the unit tests check the order): each measured config had a check, a
    # sizing launch, and at most 2 warm-ups and 5 timed launches in each of its runs.
    assert 2 * len(k.tuning.timings) <= resets <= 9 * 2 * len(k.tuning.timings)
    c.fill_(float("nan"))
    k[matmul_grid](*matmul_args(a, b, c))
    ref = a.double() @ b.double()
    assert (torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref)).item() < 1e-2
