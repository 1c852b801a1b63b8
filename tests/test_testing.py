"""acompile.testing: ``run_job`` and ``Interposed``, driven through real worker processes (the
fake backend: real processes, fake compiler) and the pool's public surface; only the test of
``promote`` submits a ``Job`` to ``pool.executor`` itself, as the pool does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from processes import until, worker_pids

import acompile
from acompile._workers import BACKGROUND, URGENT, Job
from acompile.testing import Interposed, JobView, run_job

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


def pool(cache_dir: Path, workers: Any) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target="cuda:90", cache_dir=cache_dir, preload=())


def echo(name: str, value: Any) -> dict[str, Any]:
    return {"name": name, "action": "echo", "value": value}


def hold(name: str, tmp_path: Path, **more: Any) -> dict[str, Any]:
    """A job that writes its worker's pid to ``<name>.running`` and runs until ``release`` is."""
    return {
        "name": name,
        "action": "hold",
        "until": str(tmp_path / "release"),
        "running": str(tmp_path / f"{name}.running"),
        "pid": True,
        **more,
    }


# --- run_job ------------------------------------------------------------------------------------


async def test_run_job_runs_a_job_on_a_worker_process_in_either_lane(cache_dir: Path) -> None:
    async with pool(cache_dir, 1) as p:
        assert await run_job(p, FAKE, echo("e", 3), "e") == 3
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p", background=True)
        assert pid != os.getpid() and pid in worker_pids()
        with pytest.raises(acompile.CompileError, match="broken kernel"):
            await run_job(p, FAKE, {"name": "r", "action": "raise"}, "r")
        assert p.stats()["jobs"]["done"] == 2 and p.stats()["jobs"]["failed"] == 1


async def test_run_job_cancelled_drops_its_queued_job_and_stops_its_running_one(
    cache_dir: Path, tmp_path: Path
) -> None:
    async with pool(cache_dir, 1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_job, p, FAKE, hold("running", tmp_path), "running")
            await until(lambda: (tmp_path / "running.running").exists())
            tg.start_soon(run_job, p, FAKE, hold("queued", tmp_path), "queued")
            await until(lambda: p.stats()["jobs"]["queued"] == 1)
            tg.cancel_scope.cancel()
        pid = int((tmp_path / "running.running").read_text())
        await until(lambda: pid not in worker_pids())  # its worker was stopped
        assert p.stats()["jobs"]["queued"] == 0
        # The pool goes on (a new worker), and the queued job never ran anywhere.
        assert await run_job(p, FAKE, echo("after", 1), "after") == 1
        assert not (tmp_path / "queued.running").exists()


# --- Interposed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["function", "coroutine function"])
async def test_a_failure_raised_in_before_is_the_job_s_outcome_and_counted_failed(
    cache_dir: Path, kind: str
) -> None:
    error = acompile.WorkerCrashedError("injected", exit_code=-9, kernel="bad", backend="fake")

    def fail_bad(job: JobView) -> None:
        if job.name == "bad":
            raise error

    async def fail_bad_later(job: JobView) -> None:
        await anyio.lowlevel.checkpoint()
        fail_bad(job)

    spec = Interposed(1, fail_bad if kind == "function" else fail_bad_later)
    async with pool(cache_dir, spec) as p:
        with anyio.fail_after(30):
            with pytest.raises(acompile.WorkerCrashedError) as info:
                await run_job(p, FAKE, echo("bad", 1), "bad")
            assert info.value is error
            assert await run_job(p, FAKE, echo("good", 2), "good") == 2
        jobs = p.stats()["jobs"]
    # The failed job never reached a worker: one job done there, one failed in front of it.
    assert (jobs["done"], jobs["failed"], jobs["queued"]) == (1, 1, 0)
    assert [job.name for job in spec.seen] == ["bad", "good"]


async def test_a_job_whose_caller_leaves_while_before_holds_it_never_reaches_a_worker(
    cache_dir: Path, tmp_path: Path
) -> None:
    entered, gate = anyio.Event(), anyio.Event()
    cancelled: list[str] = []

    async def slow(job: JobView) -> None:
        if job.name != "slow":
            return
        entered.set()
        try:
            await gate.wait()
        except anyio.get_cancelled_exc_class():
            cancelled.append(job.name)
            raise

    spec = Interposed(acompile.LocalWorkers(1), slow)
    async with pool(cache_dir, spec) as p:
        await p.wait_ready()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_job, p, FAKE, hold("slow", tmp_path), "slow")
                await entered.wait()
                assert p.stats()["jobs"]["queued"] == 1  # held in before
                tg.cancel_scope.cancel()
            gate.set()  # a job still held (not dropped) would go on to a worker now
            assert await run_job(p, FAKE, echo("next", 5), "next") == 5
            await anyio.sleep(0.2)
        jobs = p.stats()["jobs"]
    assert cancelled == ["slow"]  # before was stopped, not left to finish
    assert not (tmp_path / "slow.running").exists()  # no worker ever ran it
    assert (jobs["done"], jobs["queued"], jobs["running"], jobs["failed"]) == (1, 0, 0, 0)


async def test_seen_names_each_job_its_worker_module_and_its_lane(cache_dir: Path) -> None:
    spec = Interposed(2)  # no before: it only keeps what it saw
    async with pool(cache_dir, spec) as p:
        assert p.workers is spec
        assert await run_job(p, FAKE, echo("a", 1), "a") == 1
        assert await run_job(p, FAKE, echo("b", 2), "b", background=True) == 2
    assert spec.seen == [JobView("a", FAKE, "urgent"), JobView("b", FAKE, "background")]
    with pytest.raises(TypeError, match="inner must be a count of workers"):
        Interposed(object())  # type: ignore[arg-type]


async def test_a_background_job_promoted_while_in_before_goes_on_urgent(cache_dir: Path) -> None:
    gate = anyio.Event()

    async def wait(job: JobView) -> None:
        await gate.wait()

    spec = Interposed(1, wait)
    async with pool(cache_dir, spec) as p:
        job = Job(FAKE, echo("late", 7), "late", BACKGROUND)
        p.executor.submit(job)
        await anyio.sleep(0.05)
        p.executor.promote(job)  # as a request that starts to wait for it does
        assert job.lane == URGENT
        gate.set()
        with anyio.fail_after(30):
            assert await job.outcome() == 7
    assert spec.seen == [JobView("late", FAKE, "background")]


async def test_the_pool_s_controls_reach_the_inner_workers(cache_dir: Path) -> None:
    async with pool(cache_dir, Interposed(2, lambda job: None)) as p:
        await p.wait_ready()
        assert p.stats()["workers"]["alive"] == 2 and len(worker_pids()) == 2
        await p.quiesce()
        await until(lambda: not worker_pids())
        assert p.stats()["workers"]["awake"] is False
        await p.wait_ready()
        assert p.stats()["workers"]["alive"] == 2


async def test_nothing_is_left_running_after_the_pool_exits_and_every_job_has_an_outcome(
    cache_dir: Path, tmp_path: Path
) -> None:
    entered = anyio.Event()
    stopped: list[str] = []

    async def forever(job: JobView) -> None:
        if job.name != "held":
            return
        entered.set()
        try:
            await anyio.sleep_forever()
        finally:
            stopped.append(job.name)

    outcomes: dict[str, BaseException | object] = {}

    async def caller(name: str, payload: dict[str, Any], p: acompile.CompilePool) -> None:
        try:
            outcomes[name] = await run_job(p, FAKE, payload, name)
        except Exception as exc:
            outcomes[name] = exc

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with pool(cache_dir, Interposed(1, forever)) as p:
                tg.start_soon(caller, "held", echo("held", 1), p)
                await entered.wait()
                tg.start_soon(caller, "running", hold("running", tmp_path), p)
                await until(lambda: (tmp_path / "running.running").exists())
                assert len(worker_pids()) == 1
        # Out of the pool, out of the callers' task group: both callers had an outcome.
    assert stopped == ["held"]
    assert isinstance(outcomes["held"], acompile.PoolClosedError)
    assert isinstance(outcomes["running"], acompile.AcompileError)
    assert worker_pids() == []
    with pytest.raises(acompile.PoolClosedError):
        await run_job(p, FAKE, echo("after", 1), "after")


async def test_a_before_cancelled_by_what_it_awaits_fails_its_job_not_the_pool(cache_dir: Path) -> None:
    # A future another task cancels, awaited in before: that job fails; the executor (and the
    # pool) go on. It ended the executor's serve(), and every later request failed.
    import asyncio

    calls = []

    async def before(job: JobView) -> None:
        calls.append(job.name)
        if len(calls) == 1:
            future = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.05, future.cancel)
            await future

    async with pool(cache_dir, Interposed(1, before)) as p:
        with pytest.raises(acompile.CompileError, match="was cancelled by something it awaited"):
            await run_job(p, FAKE, echo("first", 1), "first")
        assert await run_job(p, FAKE, echo("second", 2), "second") == 2
        assert p.stats()["state"] == "running"
