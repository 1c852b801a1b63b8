"""Progressive compiles (a fast kernel now, the best one later) and background compiles (eager
code until the kernel is ready).

Real Triton compiles for cuda:90 show the swaps, the lanes and the shutdown; launching needs a
GPU, so the launch path itself is exercised through its seam: a handle launches whatever object
its pool's ``compile_with_tier`` returned, by ``kernel[grid](*args)``. ``GatedPool`` below is
that seam's other side, the ``ProgressiveHost`` the handles are given by a ``CompilePool`` (its
``compile_with_tier`` and a task group's ``start_soon``), returning fake kernels that record their
launches, each compile finishing when the test opens its gate.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, gpu_available
from kernels_for_tests import ADD_SIG, add_kernel, broken_kernel

import acompile
from acompile._progressive import (
    BackgroundKernel,
    KernelNotReadyError,
    ProgressiveHost,
    ProgressiveKernel,
    background,
    progressive,
)
from acompile.testing import run_job

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"

FAST = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}, num_warps=4)
BEST = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 1024}, num_warps=8, num_stages=4)
BROKEN = acompile.TritonSpec(broken_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64})
no_gpu_here = pytest.mark.skipif(gpu_available(), reason="checks the launch path where no GPU is")


def pool(cache_dir: Path, workers: int = 2) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir)


async def occupy(p: acompile.CompilePool, seconds: float) -> None:
    """Hold a worker with a background job (queued behind urgent work, ahead of later
    background work). Runs in a task group around the pool: a job still running as the pool
    is left ends with the pool's error, which is not the test's."""
    try:
        await run_job(
            p, FAKE, {"name": "blocker", "action": "sleep", "seconds": seconds}, "blocker", background=True
        )
    except acompile.AcompileError:
        pass


async def until_queued(p: acompile.CompilePool, jobs: int) -> None:
    # The pool has no event for "a job was queued"; its stats are cheap to poll.
    with anyio.fail_after(10):
        while p.stats()["jobs"]["queued"] + p.stats()["jobs"]["running"] < jobs:  # noqa: ASYNC110
            await anyio.sleep(0.005)


def add_fallback(calls: list[tuple[Any, ...]]) -> Any:
    def fallback(x: Any, y: Any, out: Any, n: int) -> str:
        calls.append((x, y, out, n))
        return "eager"

    return fallback


# --- with real compiles ------------------------------------------------------------------------


@no_gpu_here
async def test_progressive_returns_at_once_then_fast_then_best(cache_dir: Path) -> None:
    async with anyio.create_task_group() as tg, pool(cache_dir, workers=1) as p:
        # One worker, and a background job ahead of the best compile: the fast (urgent) compile
        # goes first, the best one lands only after the blocker's half second.
        tg.start_soon(occupy, p, 0.5)
        await until_queued(p, 1)
        h = p.progressive(FAST, BEST)
        # Returned at once: nothing is compiled yet (the only worker is held).
        assert h.stage == "pending" and h.kernel is None
        with pytest.raises(KernelNotReadyError, match=r"await handle.ready\(\)"):
            h[(4,)](1, 2, 3, 4)

        seen: list[tuple[str, Any]] = []
        with anyio.fail_after(60):
            while not seen or seen[-1][0] != "best":
                now = (h.stage, h.kernel)
                if not seen or seen[-1][0] != now[0]:
                    seen.append(now)
                await anyio.sleep(0.005)
        assert [stage for stage, _ in seen] == ["pending", "fast", "best"]
        fast_kernel, best_kernel = seen[1][1], seen[2][1]
        assert await h.ready() is best_kernel and await h.best() is best_kernel
        # The same kernels the pool itself hands out for those specs (now from its memory tier).
        assert fast_kernel.key == (await p.compile(FAST)).key
        assert best_kernel.key == (await p.compile(BEST)).key
        assert fast_kernel.metadata.num_warps == 4 and best_kernel.metadata.num_warps == 8
        stats = h.stats()
        assert stats["fast_tier"] == stats["best_tier"] == "compile"
        assert stats["fast_seconds"] < stats["best_seconds"]
        assert stats["not_ready_launches"] == 1

        # The launch goes to the best kernel, which needs a GPU: refused, and not counted.
        with pytest.raises(acompile.DeviceUnavailableError):
            h[(4,)](1, 2, 3, 4)
        assert h.stats()["best_launches"] == 0


@no_gpu_here
async def test_background_runs_the_fallback_until_the_kernel_is_ready(cache_dir: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    async with anyio.create_task_group() as tg, pool(cache_dir, workers=1) as p:
        tg.start_soon(occupy, p, 0.3)
        await until_queued(p, 1)
        bk = p.background(FAST, add_fallback(calls))
        # Returned at once: nothing is compiled yet (the only worker is held).
        assert not bk.ready and bk.kernel is None
        launch = bk[(4,)]
        assert launch("x", "y", "out", 16) == "eager"  # the grid is not the fallback's
        assert calls == [("x", "y", "out", 16)]
        kernel = await bk.wait()
        assert bk.ready and bk.kernel is kernel and isinstance(kernel, acompile.TritonKernel)
        # The kept launcher now takes the kernel's path: a real launch, refused without a GPU.
        with pytest.raises(acompile.DeviceUnavailableError):
            launch(1, 2, 3, 16)
        assert len(calls) == 1
        stats = bk.stats()
        assert stats["ready"] and stats["fallback_calls"] == 1 and stats["kernel_calls"] == 0
        assert stats["error"] is None and stats["tier"] == "compile" and stats["seconds"] > 0.2


async def test_failed_compiles_keep_what_works(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="acompile")
    calls: list[tuple[Any, ...]] = []
    broken_fast = acompile.TritonSpec(broken_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 128})
    async with anyio.create_task_group() as tg, pool(cache_dir, workers=1) as p:
        # Everything queues behind the blocker, then runs urgent lane first: both fast compiles,
        # then the best ones and the background one.
        tg.start_soon(occupy, p, 0.3)
        await until_queued(p, 1)
        keeps_fast = p.progressive(FAST, BROKEN)
        uses_best = p.progressive(broken_fast, BEST)
        keeps_fallback = p.background(BROKEN, add_fallback(calls))
        with pytest.raises(acompile.CompileError, match="undefined_name"):
            await keeps_fast.best()
        assert keeps_fast.stage == "fast" and keeps_fast.kernel is await keeps_fast.ready()
        assert isinstance(keeps_fast.best_error, acompile.CompileError)
        assert keeps_fast.stats()["best_error"].startswith("CompileError: Triton failed to compile")

        assert await uses_best.best() is uses_best.kernel
        assert uses_best.stage == "best" and isinstance(uses_best.fast_error, acompile.CompileError)

        with pytest.raises(acompile.CompileError, match="undefined_name"):
            await keeps_fallback.wait()
        assert isinstance(keeps_fallback.error, acompile.CompileError)
        assert not keeps_fallback.ready
        assert keeps_fallback[(1,)]("x", "y", "out", 1) == "eager"
        assert keeps_fallback.stats()["fallback_calls"] == 1
        assert keeps_fallback.stats()["error"].startswith("CompileError")

        # Asked again, the handles answer the same, without another warning.
        with pytest.raises(acompile.CompileError):
            await keeps_fast.best()
        with pytest.raises(acompile.CompileError):
            await keeps_fallback.wait()
    ours = [r.getMessage() for r in caplog.records if r.name == "acompile" and "in use" in r.getMessage()]
    assert len(ours) == 2, ours
    # One warning each, in the order the two handles hear of the one failed compile (either).
    best, background = sorted(ours, key=lambda m: "background" in m)
    assert "broken_kernel: the best compile failed" in best and "fast kernel stays in use" in best
    assert "broken_kernel: the background compile failed" in background and "fallback stays" in background


async def test_leaving_the_pool_cancels_pending_compiles(cache_dir: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    tasks_before = asyncio.all_tasks()
    async with anyio.create_task_group() as tg, pool(cache_dir, workers=1) as p:
        # The only worker sleeps through the rest of the pool's life: nothing else gets compiled.
        tg.start_soon(occupy, p, 60)
        await until_queued(p, 1)
        h = p.progressive(FAST, BEST)
        bk = p.background(BEST, add_fallback(calls))
        await until_queued(p, 3)  # the blocker, then FAST and BEST (one flight for both BEST)
        assert h.stage == "pending" and not bk.ready
        # Created as the pool leaves: its tasks have not run a step yet when they are cancelled.
        last = p.progressive(FAST, BEST)
    assert asyncio.all_tasks() == tasks_before  # nothing the handles started outlives the pool
    for handle in (h, last):
        assert handle.stage == "failed" and handle.kernel is None
        assert isinstance(handle.fast_error, acompile.PoolClosedError)
        assert isinstance(handle.best_error, acompile.PoolClosedError)
        with pytest.raises(acompile.PoolClosedError):
            await handle.ready()
        with pytest.raises(acompile.PoolClosedError):
            await handle.best()
        with pytest.raises(KernelNotReadyError, match=r"both compiles failed.*PoolClosedError"):
            handle[(1,)](1, 2, 3, 4)
    assert isinstance(bk.error, acompile.PoolClosedError) and not bk.ready
    with pytest.raises(acompile.PoolClosedError):
        await bk.wait()
    assert bk[(1,)]("x", "y", "out", 1) == "eager"  # the fallback keeps working
    with pytest.raises(acompile.PoolClosedError):
        p.progressive(FAST, BEST)
    with pytest.raises(acompile.PoolClosedError):
        p.background(FAST, add_fallback(calls))


async def test_arguments_are_checked_at_the_call(cache_dir: Path) -> None:
    with pytest.raises(acompile.PoolClosedError, match="inside `async with"):
        pool(cache_dir).progressive(FAST, BEST)
    async with pool(cache_dir) as p:
        with pytest.raises(TypeError, match="not a compile spec"):
            p.progressive(FAST, "add_kernel")
        with pytest.raises(TypeError, match="fallback must be callable"):
            p.background(FAST, None)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="event loop's thread"):
            await anyio.to_thread.run_sync(p.progressive, FAST, BEST)
        # A spec that is wrong only on a closer look fails on the handle, not at the call.
        h = p.progressive(FAST, acompile.TritonSpec(add_kernel, {"x_ptr": "*fp99"}))
        with pytest.raises(acompile.InvalidSpecError, match="fp99"):
            await h.best()
        assert await h.ready() is h.kernel and h.stage == "fast"


# --- the launch seam, with fake kernels ---------------------------------------------------------


class FakeKernel:
    """Records launches as ``kernel[grid](*args)`` makes them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.launches: list[tuple[Any, tuple[Any, ...]]] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any) -> str:
            self.launches.append((grid, args))
            return self.name

        return run


class GatedPool:
    """What the handles use of a CompilePool; each spec's compile waits for its gate."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg
        self.gates: dict[int, tuple[anyio.Event, Any]] = {}
        self.asked: list[tuple[int, bool]] = []  # (BLOCK, background) of each compile asked for
        self.cancelled: list[int] = []

    def host(self) -> ProgressiveHost:
        return ProgressiveHost(self.compile_with_tier, self._tg.start_soon, lambda spec: None)

    def progressive(self, fast_spec: Any, best_spec: Any) -> ProgressiveKernel:
        return progressive(self.host(), fast_spec, best_spec)

    def background(self, spec: Any, fallback: Any) -> BackgroundKernel:
        return background(self.host(), spec, fallback)

    def gate(self, spec: Any, outcome: Any) -> anyio.Event:
        event = anyio.Event()
        self.gates[id(spec)] = (event, outcome)
        return event

    async def compile_with_tier(self, spec: Any, *, background: bool = False) -> tuple[Any, str]:
        block = spec.constexprs["BLOCK"]
        self.asked.append((block, background))
        event, outcome = self.gates[id(spec)]
        try:
            await event.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(block)
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome, "compile"


def compile_error(name: str) -> acompile.CompileError:
    return acompile.CompileError(f"{name} does not compile", kernel=name, backend="fake")


async def test_launches_follow_the_swap_and_are_counted_per_stage() -> None:
    fast, best = FakeKernel("fast"), FakeKernel("best")
    async with anyio.create_task_group() as tg:
        p = GatedPool(tg)
        fast_gate, best_gate = p.gate(FAST, fast), p.gate(BEST, best)
        h = p.progressive(FAST, BEST)
        assert isinstance(h, ProgressiveKernel)
        launch = h[(8, 1)]  # kept across the swaps: each call looks at the handle again
        with pytest.raises(KernelNotReadyError):
            launch(1, 2)
        fast_gate.set()
        assert await h.ready() is fast and h.stage == "fast"
        assert launch(1, 2) == "fast" and h[(2,)](3) == "fast"
        # Launches from other threads count as well.
        await anyio.to_thread.run_sync(lambda: [launch(i) for i in range(100)])
        best_gate.set()
        assert await h.best() is best and h.kernel is best and h.stage == "best"
        assert launch(5) == "best"
    assert p.asked == [(256, False), (1024, True)]  # fast in the urgent lane, best in background
    assert fast.launches[:2] == [((8, 1), (1, 2)), ((2,), (3,))] and len(fast.launches) == 102
    assert best.launches == [((8, 1), (5,))]
    stats = h.stats()
    assert (stats["fast_launches"], stats["best_launches"], stats["not_ready_launches"]) == (102, 1, 1)


async def test_a_best_kernel_that_lands_first_stops_the_fast_compile() -> None:
    fast, best = FakeKernel("fast"), FakeKernel("best")
    async with anyio.create_task_group() as tg:
        p = GatedPool(tg)
        p.gate(FAST, fast)
        p.gate(BEST, best).set()  # say, found in the cache
        h = p.progressive(FAST, BEST)
        assert await h.ready() is best and h.stage == "best"
    assert p.cancelled == [256]
    assert h.stage == "best" and h.kernel is best and h.fast_error is None
    assert h.stats()["fast_seconds"] is None


async def test_a_fast_kernel_that_lands_late_does_not_replace_the_best() -> None:
    # The fast compile returns in the same step the best one lands, before it sees its scope
    # cancelled: the best kernel must stay.
    fast, best = FakeKernel("fast"), FakeKernel("best")
    async with anyio.create_task_group() as tg:
        p = GatedPool(tg)
        fast_gate, best_gate = p.gate(FAST, fast), p.gate(BEST, best)
        h = p.progressive(FAST, BEST)
        await anyio.sleep(0.01)
        best_gate.set()
        fast_gate.set()
        await h.best()
    assert h.stage == "best" and h.kernel is best


async def test_when_both_compiles_fail_nothing_launches(caplog: pytest.LogCaptureFixture) -> None:
    async with anyio.create_task_group() as tg:
        p = GatedPool(tg)
        fast_gate = p.gate(FAST, compile_error("fast"))
        best_gate = p.gate(BEST, compile_error("best"))
        h = p.progressive(FAST, BEST)
        best_gate.set()
        with pytest.raises(acompile.CompileError, match="best does not compile"):
            await h.best()
        assert h.stage == "pending"  # the fast compile may still bring a kernel
        fast_gate.set()
        with pytest.raises(acompile.CompileError, match="fast does not compile"):
            await h.ready()
    assert h.stage == "failed" and h.kernel is None
    with pytest.raises(KernelNotReadyError, match=r"fast does not compile.*best does not compile"):
        h[(1,)](1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "add_kernel: the best compile failed (CompileError: best does not compile); "
        "the fast kernel will be used when it lands"
    ]


async def test_background_calls_the_kernel_once_it_is_ready() -> None:
    kernel = FakeKernel("kernel")
    calls: list[tuple[Any, ...]] = []
    async with anyio.create_task_group() as tg:
        p = GatedPool(tg)
        gate = p.gate(FAST, kernel)
        bk = p.background(FAST, add_fallback(calls))
        assert isinstance(bk, BackgroundKernel)
        launch = bk[(4,)]
        assert [launch(i, i, i, i) for i in range(3)] == ["eager"] * 3
        await anyio.to_thread.run_sync(lambda: [launch(0, 0, 0, 0) for _ in range(50)])
        gate.set()
        assert await bk.wait() is kernel and bk.ready
        assert launch(7, 8, 9, 10) == "kernel"
    assert p.asked == [(256, True)]
    assert len(calls) == 53 and kernel.launches == [((4,), (7, 8, 9, 10))]
    stats = bk.stats()
    assert (stats["fallback_calls"], stats["kernel_calls"]) == (53, 1)
