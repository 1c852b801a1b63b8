"""The pool's life: crashes, limits, quiesce and wake-up, the template, shutdown, orphans.

Real worker processes and real signals throughout; only the compiler is fake (fake_backend).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psutil
import pytest
from conftest import subprocess_env

import acompile

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


def pool(cache_dir: Path, workers: int = 2, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target="cuda:90", cache_dir=cache_dir, preload=(), **kw)  # type: ignore[arg-type]


def worker_pids(p: acompile.CompilePool) -> list[int]:
    return list(p._workers.alive)  # type: ignore[union-attr]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def until(predicate: object, seconds: float = 10) -> None:
    with anyio.fail_after(seconds):
        # Processes and counters have no events to wait on: poll them.
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_job_whose_worker_is_killed_from_outside_is_retried_once(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            result: list[object] = []

            async def job() -> None:
                result.append(
                    await p._run(
                        FAKE, {"name": "slow", "action": "sleep", "seconds": 1.0, "value": "done"}, "slow"
                    )
                )

            tg.start_soon(job)
            await until(lambda: p.stats()["workers"]["busy"] == 1)
            os.kill(worker_pids(p)[0], signal.SIGKILL)
        assert result == ["done"]
        stats = p.stats()
        assert stats["jobs"]["retried"] == 1 and stats["workers"]["restarts"] == {"killed": 1}


async def test_a_job_killed_twice_fails_with_a_clear_error(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:

            async def killer() -> None:
                for _ in range(2):
                    await until(lambda: p.stats()["workers"]["busy"] == 1)
                    pid = worker_pids(p)[0]
                    os.kill(pid, signal.SIGKILL)
                    await until(lambda pid=pid: pid not in worker_pids(p))

            tg.start_soon(killer)
            with pytest.raises(acompile.WorkerCrashedError) as info:
                await p._run(FAKE, {"name": "victim", "action": "sleep", "seconds": 30}, "victim")
        err = info.value
        assert err.cause == "killed" and err.exit_code == -signal.SIGKILL and err.kernel == "victim"
        assert "SIGKILL twice" in str(err)


async def test_an_idle_worker_that_dies_is_replaced_at_once(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=2) as p:
        await p.wait_ready()
        victim = worker_pids(p)[0]
        t0 = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        await until(lambda: victim not in worker_pids(p) and len(worker_pids(p)) == 2, seconds=5)
        back_in = time.perf_counter() - t0
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 1}, "e") == 1
    assert back_in < 1.0, f"back to full strength in {back_in:.3f} s"


async def test_a_worker_past_its_memory_limit_fails_its_job_and_is_replaced(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1, memory_limit="200MiB") as p:
        with pytest.raises(acompile.WorkerCrashedError) as info:
            await p._run(FAKE, {"name": "hog", "action": "alloc", "megabytes": 600}, "hog")
        assert info.value.cause == "memory" and "memory limit of 200 MiB" in str(info.value)
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 2}, "e") == 2
        assert p.stats()["workers"]["restarts"] == {"memory": 1}


async def test_max_compile_seconds_stops_a_compiler_that_never_returns(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1, max_compile_seconds=0.5) as p:
        t0 = time.perf_counter()
        with pytest.raises(acompile.CompileTimeoutError, match=r"max_compile_seconds=0\.5"):
            await p._run(FAKE, {"name": "ptxas-hang", "action": "sleep", "seconds": 3600}, "ptxas-hang")
        assert time.perf_counter() - t0 < 5
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 3}, "e") == 3
        assert p.stats()["workers"]["restarts"] == {"timeout": 1}


async def test_quiesce_stops_the_workers_and_a_request_wakes_them(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=2) as p:
        await p.wait_ready()
        before = worker_pids(p)
        t0 = time.perf_counter()
        await p.quiesce()
        quiesce_s = time.perf_counter() - t0
        await until(lambda: all(gone(pid) for pid in before) and not worker_pids(p))
        assert p.stats()["workers"]["awake"] is False
        # A request wakes the pool by itself.
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": "awake"}, "e") == "awake"
        assert p.stats()["workers"]["awake"] is True
        await p.quiesce()
        t1 = time.perf_counter()
        await p.wakeup()
        wake_s = time.perf_counter() - t1
        assert len(worker_pids(p)) == 2 and not set(worker_pids(p)) & set(before)
    assert quiesce_s < 0.05
    print(f"quiesce {quiesce_s * 1000:.2f} ms, wake-up to ready {wake_s * 1000:.1f} ms")


async def test_quiesce_puts_running_jobs_back_and_they_still_complete(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            result: list[object] = []

            async def job() -> None:
                result.append(
                    await p._run(FAKE, {"name": "j", "action": "sleep", "seconds": 0.5, "value": "ok"}, "j")
                )

            tg.start_soon(job)
            await until(lambda: p.stats()["workers"]["busy"] == 1)
            await p.quiesce()
        assert result == ["ok"]


async def test_the_idle_timer_quiesces_the_pool(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=2, idle_timeout=0.3) as p:
        await p.wait_ready()
        await p._run(FAKE, {"name": "e", "action": "echo", "value": 1}, "e")
        await until(lambda: not p.stats()["workers"]["awake"], seconds=5)
        await until(lambda: not worker_pids(p))
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 2}, "e") == 2


async def test_workers_are_forked_from_a_thread_free_template(cache_dir: Path) -> None:
    async with acompile.CompilePool(2, target="cuda:90", cache_dir=cache_dir) as p:  # Triton preloaded
        await p.wait_ready()
        template = p._workers._template  # type: ignore[union-attr]
        assert template is not None
        # The template did a whole Triton preload (import, a first compile) and still has
        # one thread: /proc/<pid>/task lists native threads too.
        assert len(os.listdir(f"/proc/{template.pid}/task")) == 1
        for pid in worker_pids(p):
            assert psutil.Process(pid).ppid() == template.pid
        assert p.stats()["workers"]["forked"] == 2


async def test_a_template_with_threads_is_not_forked_from(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool(cache_dir, workers=1, prestart=False) as p:
        p._workers.config["preload"] = ["threaded_backend"]  # type: ignore[union-attr]
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 4}, "e") == 4
        assert p.stats()["workers"]["forked"] == 0 and p.stats()["workers"]["started"] == 1
    assert any("threads after its preload" in r.message for r in caplog.records)


async def test_cancelling_during_wake_up_drops_the_request_only(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1, prestart=False) as p:
        with anyio.move_on_after(0.001):
            await p._run(FAKE, {"name": "never", "action": "crash"}, "never")  # would crash if it ran
        await p.wait_ready()
        assert await p._run(FAKE, {"name": "e", "action": "echo", "value": 5}, "e") == 5
        assert p.stats()["workers"]["restarts"] == {} and p.stats()["jobs"]["failed"] == 0


async def test_a_request_in_flight_when_the_pool_shuts_down_gets_a_clear_error(cache_dir: Path) -> None:
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        async with pool(cache_dir, workers=1) as p:
            await p.wait_ready()

            async def caller() -> None:
                try:
                    await p._run(FAKE, {"name": "long", "action": "sleep", "seconds": 60}, "long")
                except acompile.PoolClosedError as exc:
                    errors.append(exc)

            tg.start_soon(caller)
            await until(lambda: p.stats()["workers"]["busy"] == 1)
            t0 = time.perf_counter()
        shutdown_s = time.perf_counter() - t0
    assert len(errors) == 1 and "shut down" in str(errors[0])
    assert shutdown_s < 2, f"shutdown took {shutdown_s:.3f} s"
    print(f"shutdown with a busy worker: {shutdown_s * 1000:.1f} ms")


def test_workers_die_with_their_parent_even_by_sigkill(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, os, sys, anyio, acompile

        async def main():
            async with acompile.CompilePool(3, target="cuda:90", cache_dir={str(tmp_path / "cache")!r}, preload=()) as p:
                await p.wait_ready()
                pids = list(p._workers.alive)
                template = p._workers._template
                if template is not None:
                    pids.append(template.pid)
                print(json.dumps(pids), flush=True)
                await anyio.sleep(3600)

        anyio.run(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 4
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.perf_counter()
        deadline = t0 + 5
        while time.perf_counter() < deadline and not all(gone(pid) for pid in pids):
            time.sleep(0.01)
        took = time.perf_counter() - t0
        assert all(gone(pid) for pid in pids), [p for p in pids if not gone(p)]
        assert took < 1.0, f"workers outlived their parent by {took:.3f} s"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_fault_campaign_no_job_lost_under_random_kills(cache_dir: Path) -> None:
    """A storm of jobs while a chaos task SIGKILLs random workers: every job completes or
    fails with a clear error, nothing hangs, the pool ends at full size, no process survives."""
    rng = random.Random(1234)
    jobs = 240
    outcomes: dict[str, int] = {"ok": 0, "killed_twice": 0}
    kills = 0
    t0 = time.perf_counter()
    async with pool(cache_dir, workers=4) as p:
        await p.wait_ready()

        async def one(i: int) -> None:
            payload = {"name": f"job{i}", "action": "sleep", "seconds": rng.uniform(0.005, 0.04), "value": i}
            try:
                assert await p._run(FAKE, payload, f"job{i}") == i
                outcomes["ok"] += 1
            except acompile.WorkerCrashedError as exc:
                assert exc.cause == "killed" and f"job{i}" in str(exc)
                outcomes["killed_twice"] += 1

        async def chaos(stop: anyio.Event) -> None:
            nonlocal kills
            while not stop.is_set():
                await anyio.sleep(rng.uniform(0.02, 0.06))
                alive = worker_pids(p)
                if alive:
                    try:
                        os.kill(rng.choice(alive), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass

        with anyio.fail_after(180):
            stop = anyio.Event()
            async with anyio.create_task_group() as outer:
                outer.start_soon(chaos, stop)
                async with anyio.create_task_group() as tg:
                    for i in range(jobs):
                        tg.start_soon(one, i)
                stop.set()
        await p.wait_ready()
        await until(lambda: len(worker_pids(p)) == 4, seconds=5)
        stats = p.stats()
    took = time.perf_counter() - t0
    print(
        f"fault campaign: {jobs} jobs, {kills} SIGKILLs, {outcomes['ok']} completed, "
        f"{outcomes['killed_twice']} failed (killed twice), {stats['jobs']['retried']} retried, "
        f"restarts {stats['workers']['restarts']}, {took:.1f} s"
    )
    assert kills >= 20
    assert outcomes["ok"] + outcomes["killed_twice"] == jobs
    assert outcomes["ok"] >= jobs * 0.8
