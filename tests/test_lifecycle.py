"""The pool's life: crashes, limits, quiesce and wake-up, the template, shutdown, orphans.

Real worker processes and real signals throughout; only the compiler is fake (fake_backend).
"""

from __future__ import annotations

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
from fake_backend import local_executor
from processes import forked_and_fresh, gone, template_pids, until, worker_pids

import acompile
from acompile._workers import Job, SlotExecutor
from acompile.testing import run_job

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


def pool(cache_dir: Path, workers: int = 2, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target="cuda:90", cache_dir=cache_dir, preload=(), **kw)  # type: ignore[arg-type]


@forked_and_fresh
async def test_a_job_whose_worker_is_killed_from_outside_is_retried_once(
    cache_dir: Path, tmp_path: Path, fork_workers: bool
) -> None:
    release = tmp_path / "release"
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            result: list[object] = []

            async def job() -> None:
                payload = {"name": "slow", "action": "hold", "until": str(release), "pid": True}
                result.append(await run_job(p, FAKE, payload, "slow"))

            tg.start_soon(job)
            await until(lambda: p.stats()["workers"]["busy"] == 1)
            [victim] = worker_pids()
            os.kill(victim, signal.SIGKILL)
            release.touch()  # the killed worker cannot answer any more; its replacement can
        assert len(result) == 1 and result[0] != victim
        stats = p.stats()
        assert stats["jobs"]["retried"] == 1 and stats["workers"]["restarts"] == {"killed": 1}


@forked_and_fresh
async def test_a_job_killed_twice_fails_with_a_clear_error(cache_dir: Path, fork_workers: bool) -> None:
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:

            async def killer() -> None:
                for kills in range(2):
                    # Running on a worker: the first time, or again after its retry (the counter
                    # goes up before the job is dispatched anew).
                    await until(
                        lambda kills=kills: (
                            p.stats()["jobs"]["retried"] == kills and p.stats()["workers"]["busy"] == 1
                        )
                    )
                    [pid] = worker_pids()
                    os.kill(pid, signal.SIGKILL)

            tg.start_soon(killer)
            with anyio.fail_after(30), pytest.raises(acompile.WorkerCrashedError) as info:
                await run_job(p, FAKE, {"name": "victim", "action": "sleep", "seconds": 600}, "victim")
        err = info.value
        assert err.cause == "killed" and err.exit_code == -signal.SIGKILL and err.kernel == "victim"
        assert "SIGKILL twice" in str(err)


@forked_and_fresh
async def test_an_idle_worker_that_dies_is_replaced_at_once(cache_dir: Path, fork_workers: bool) -> None:
    async with pool(cache_dir, workers=2, fork_workers=fork_workers) as p:
        await p.wait_ready()
        victim = worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        # Replaced without a request asking for it.
        await until(lambda: victim not in worker_pids() and len(worker_pids()) == 2, seconds=30)
        assert p.stats()["workers"]["restarts"] == {"killed": 1}
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 1}, "e") == 1


@forked_and_fresh
async def test_a_worker_past_its_memory_limit_fails_its_job_and_is_replaced(
    cache_dir: Path, fork_workers: bool
) -> None:
    async with pool(cache_dir, workers=1, memory_limit="200MiB", fork_workers=fork_workers) as p:
        await p.wait_ready()
        [hog] = worker_pids()
        with anyio.fail_after(60), pytest.raises(acompile.WorkerCrashedError) as info:
            await run_job(
                p, FAKE, {"name": "hog", "action": "alloc", "megabytes": 600, "seconds": 600}, "hog"
            )
        assert info.value.cause == "memory" and "memory limit of 200 MiB" in str(info.value)
        await until(lambda: gone(hog))
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 2}, "e") == 2
        assert p.stats()["workers"]["restarts"] == {"memory": 1}


@forked_and_fresh
async def test_max_compile_seconds_stops_a_compiler_that_never_returns(
    cache_dir: Path, fork_workers: bool
) -> None:
    async with pool(cache_dir, workers=1, max_compile_seconds=0.5, fork_workers=fork_workers) as p:
        await p.wait_ready()
        [stuck] = worker_pids()
        # Generous: this only tells a hang from the limit at work.
        with (
            anyio.fail_after(30),
            pytest.raises(acompile.CompileTimeoutError, match=r"max_compile_seconds=0\.5"),
        ):
            await run_job(p, FAKE, {"name": "ptxas-hang", "action": "sleep", "seconds": 3600}, "ptxas-hang")
        await until(lambda: gone(stuck))
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 3}, "e") == 3
        assert p.stats()["workers"]["restarts"] == {"timeout": 1}


async def test_max_compile_seconds_counts_from_each_jobs_own_start(cache_dir: Path) -> None:
    """Jobs that each stay within the limit pass, however long their worker has been busy: one
    worker runs three jobs of 0.6 s back to back under a 1 s limit (the limit's clock restarts
    with each job), then a job that runs past it is stopped."""
    async with pool(cache_dir, workers=1, max_compile_seconds=1.0) as p:
        await p.wait_ready()
        with anyio.fail_after(30):
            for i in range(3):
                payload = {"name": f"s{i}", "action": "sleep", "seconds": 0.6, "value": i}
                assert await run_job(p, FAKE, payload, f"s{i}") == i
            with pytest.raises(acompile.CompileTimeoutError):
                await run_job(p, FAKE, {"name": "long", "action": "sleep", "seconds": 3600}, "long")
        await until(lambda: p.stats()["workers"]["restarts"] == {"timeout": 1})


async def test_prestarted_workers_start_after_the_entrys_requests_or_at_the_first_miss(
    cache_dir: Path,
) -> None:
    """Starting a process stalls the event loop for milliseconds and competes for the CPU: a
    warm start's cache hits, made as the pool is entered, come first (on 2 cores, 68 hits took
    5-30 ms longer with the workers starting alongside). The workers start once those requests
    have had _PRESTART_DELAY, or at once for a request that needs one; a pool quiesced before
    then starts none."""
    from acompile._compiler import _PRESTART_DELAY

    async with pool(cache_dir, workers=1) as p:
        t0 = time.monotonic()
        assert p.stats()["workers"]["awake"] is False and not template_pids()
        await until(lambda: p.stats()["workers"]["awake"])
        assert time.monotonic() - t0 >= 0.9 * _PRESTART_DELAY
        await p.wait_ready()
        assert len(worker_pids()) == 1
    async with pool(cache_dir, workers=1) as p:
        job = Job(FAKE, {"name": "e", "action": "echo", "value": 1}, "e")
        local_executor(p).submit(job)  # as a miss does
        assert p.stats()["workers"]["awake"] is True  # at once, not after the delay
        assert await job.outcome() == 1
    for before_quiesce in (0.0, _PRESTART_DELAY):  # the second: as the delayed start fires
        async with pool(cache_dir, workers=1) as p:
            await anyio.sleep(before_quiesce)
            await p.quiesce()
            await anyio.sleep(2 * _PRESTART_DELAY)
            assert p.stats()["workers"]["awake"] is False and not template_pids() and not worker_pids()


async def test_quiesce_stops_the_workers_and_a_request_wakes_them(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=2) as p:
        await p.wait_ready()
        before = worker_pids()
        assert len(before) == 2
        await p.quiesce()
        await until(lambda: all(gone(pid) for pid in before) and not worker_pids())
        assert p.stats()["workers"]["awake"] is False
        # A request wakes the pool by itself.
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": "awake"}, "e") == "awake"
        assert p.stats()["workers"]["awake"] is True
        middle = worker_pids()
        await p.quiesce()
        await p.wait_ready()
        await p.wait_ready()
        # quiesce() returns at once: the last epoch's workers are reaped in the background.
        await until(lambda: len(worker_pids()) == 2 and not set(worker_pids()) & (set(before) | set(middle)))


@forked_and_fresh
async def test_quiesce_puts_running_jobs_back_and_they_still_complete(
    cache_dir: Path, tmp_path: Path, fork_workers: bool
) -> None:
    release = tmp_path / "release"
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            result: list[object] = []

            async def job() -> None:
                payload = {"name": "j", "action": "hold", "until": str(release), "pid": True}
                result.append(await run_job(p, FAKE, payload, "j"))

            tg.start_soon(job)
            await until(lambda: p.stats()["workers"]["busy"] == 1)
            [running] = worker_pids()
            await p.quiesce()
            # The worker that ran it is stopped, the job with it...
            await until(lambda: gone(running))
            release.touch()
        # ...and it ran again, to the end, on a worker started after the quiesce.
        assert len(result) == 1 and result[0] != running
        assert p.stats()["jobs"]["done"] == 1 and p.stats()["jobs"]["failed"] == 0


async def test_the_idle_timer_quiesces_the_pool(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=2, idle_timeout=0.3) as p:
        await p.wait_ready()
        await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 1}, "e")
        await until(lambda: not p.stats()["workers"]["awake"], seconds=30)
        await until(lambda: not worker_pids())
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 2}, "e") == 2


async def test_workers_are_forked_from_a_thread_free_template(cache_dir: Path) -> None:
    async with acompile.CompilePool(2, target="cuda:90", cache_dir=cache_dir) as p:  # Triton preloaded
        await p.wait_ready()
        [template] = template_pids()
        # The template did a whole Triton preload (import, a first compile) and still has
        # one thread: /proc/<pid>/task lists native threads too.
        assert len(os.listdir(f"/proc/{template}/task")) == 1
        workers = worker_pids()
        assert len(workers) == 2
        for pid in workers:
            assert psutil.Process(pid).ppid() == template
        assert p.stats()["workers"]["forked"] == 2


async def test_a_template_with_threads_is_not_forked_from(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool(cache_dir, workers=1, prestart=False) as p:
        # No public seam: preload= takes only the product's backends.
        local_executor(p).config["preload"] = ["threaded_backend"]
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 4}, "e") == 4
        assert p.stats()["workers"]["forked"] == 0 and p.stats()["workers"]["started"] == 1
    assert any("threads after its preload" in r.message for r in caplog.records)


@forked_and_fresh
async def test_cancelling_during_wake_up_drops_the_request_only(cache_dir: Path, fork_workers: bool) -> None:
    async with pool(cache_dir, workers=1, prestart=False, fork_workers=fork_workers) as p:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                run_job, p, FAKE, {"name": "never", "action": "crash"}, "never"
            )  # would crash if it ran
            await until(lambda: p.stats()["jobs"]["queued"] == 1)
            # No checkpoint since the look: the request still waits for its worker to be ready.
            tg.cancel_scope.cancel()
        await p.wait_ready()
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 5}, "e") == 5
        assert p.stats()["workers"]["restarts"] == {} and p.stats()["jobs"]["failed"] == 0


async def test_a_request_in_flight_when_the_pool_shuts_down_gets_a_clear_error(cache_dir: Path) -> None:
    errors: list[BaseException] = []
    with anyio.fail_after(30):  # the shutdown does not wait for the compile
        async with anyio.create_task_group() as tg:
            async with pool(cache_dir, workers=1) as p:
                await p.wait_ready()

                async def caller() -> None:
                    try:
                        await run_job(p, FAKE, {"name": "long", "action": "sleep", "seconds": 600}, "long")
                    except acompile.PoolClosedError as exc:
                        errors.append(exc)

                tg.start_soon(caller)
                await until(lambda: p.stats()["workers"]["busy"] == 1)
    assert len(errors) == 1 and "shut down" in str(errors[0])


@forked_and_fresh
def test_workers_die_with_their_parent_even_by_sigkill(tmp_path: Path, fork_workers: bool) -> None:
    script = textwrap.dedent(
        f"""
        import anyio, acompile

        async def main():
            async with acompile.CompilePool(
                3, target="cuda:90", cache_dir={str(tmp_path / "cache")!r}, preload=(), fork_workers={fork_workers}
            ) as p:
                await p.wait_ready()
                print("ready", p.executor.workdir, flush=True)
                await anyio.sleep(3600)

        anyio.run(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert proc.stdout is not None
        said, workdir = proc.stdout.readline().split()
        assert said == "ready" and os.path.isdir(workdir)
        # Its workers (and the template they were forked from), from the process table.
        pids = [
            child.pid
            for child in psutil.Process(proc.pid).children(recursive=True)
            if "acompile._worker" in " ".join(child.cmdline())
        ]
        assert len(pids) == (4 if fork_workers else 3)
        proc.kill()
        proc.wait(timeout=10)
        # Generous: this tells "they die" from "they stay", not how fast.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
            time.sleep(0.01)
        assert all(gone(pid) for pid in pids), [p for p in pids if not gone(p)]
        # The pool's process could not remove its work folder: the processes it left did.
        while time.monotonic() < deadline and os.path.exists(workdir):
            time.sleep(0.01)
        assert not os.path.exists(workdir), os.listdir(workdir)
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
    t0 = time.monotonic()
    async with pool(cache_dir, workers=4) as p:
        await p.wait_ready()

        async def one(i: int) -> None:
            payload = {"name": f"job{i}", "action": "sleep", "seconds": rng.uniform(0.005, 0.04), "value": i}
            try:
                assert await run_job(p, FAKE, payload, f"job{i}") == i
                outcomes["ok"] += 1
            except acompile.WorkerCrashedError as exc:
                assert exc.cause == "killed" and f"job{i}" in str(exc)
                outcomes["killed_twice"] += 1

        async def chaos(stop: anyio.Event) -> None:
            nonlocal kills
            while not stop.is_set():
                await anyio.sleep(rng.uniform(0.02, 0.06))
                alive = worker_pids()
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
        await until(lambda: len(worker_pids()) == 4, seconds=30)
        stats = p.stats()
    took = time.monotonic() - t0
    print(
        f"fault campaign: {jobs} jobs, {kills} SIGKILLs, {outcomes['ok']} completed, "
        f"{outcomes['killed_twice']} failed (killed twice), {stats['jobs']['retried']} retried, "
        f"restarts {stats['workers']['restarts']}, {took:.1f} s"
    )
    assert kills >= 20
    assert outcomes["ok"] + outcomes["killed_twice"] == jobs
    assert outcomes["ok"] >= jobs * 0.8


async def test_a_template_told_to_exit_goes_at_once_and_leaves_the_work_folder_to_the_pool(
    cache_dir: Path,
) -> None:
    """The pool sends its template Exit before closing its input. A template whose input ends
    without one takes its pool for dead and looks for its re-parenting for 0.5 s before it goes
    (to remove the work folder the dead pool could not): leaving a live pool must not wait for
    that. The bound is loose (leaving an idle pool takes about 10 ms); the look alone is 0.5 s."""
    async with pool(cache_dir, 2) as p:
        await p.wait_ready()
        workdir = p.executor.workdir
        started = time.perf_counter()
    assert time.perf_counter() - started < 0.35
    assert not os.path.exists(workdir)  # noqa: ASYNC240 (the pool removed it as it left)


class _GatedRunners:
    """Runners for a ``SlotExecutor`` whose starts end when the test says so, each start
    finishing shielded: a start whose last step (a worker's ready reply) arrived just before its
    epoch was cancelled. In-process: the subject is the executor's bookkeeping of epochs, which
    no process start can place at that instant on purpose."""

    def __init__(self) -> None:
        self.gates: list[anyio.Event] = []
        self.alive = 0
        self.opened = False  # starts end at once (a test's teardown)

    def live(self) -> int:
        return self.alive

    def encode(self, job: Job) -> None:
        pass

    async def start(self, slot: int) -> _GatedRunner:
        gate = anyio.Event()
        self.gates.append(gate)
        if not self.opened:
            with anyio.CancelScope(shield=True):
                await gate.wait()
        self.alive += 1
        return _GatedRunner(self)

    async def watch(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def open_all(self) -> None:
        self.opened = True
        for gate in self.gates:
            gate.set()


class _GatedRunner:
    def __init__(self, runners: _GatedRunners) -> None:
        self.runners = runners

    async def serve(self) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def stop(self, cause: str) -> None:
        self.runners.alive -= 1


async def test_wait_ready_after_quiesce_and_wakeup_waits_for_the_new_epochs_workers() -> None:
    """quiesce(), wakeup(), wait_ready() in a row, while a worker of the ending epoch finishes its
    start: wait_ready() returns once the new epoch's worker is ready, not at the old one's start
    (which then stops). It did, and a pool said ready with one of its two workers."""
    executor = SlotExecutor(1, lambda _: _GatedRunners(), preload_timeout=60, idle_timeout=None)
    runners = executor.runners
    async with anyio.create_task_group() as tg:
        tg.start_soon(executor.serve)
        executor.wakeup()
        await until(lambda: len(runners.gates) == 1)
        executor.quiesce()
        executor.wakeup()
        runners.gates[0].set()  # the old epoch's start ends now, after its epoch was cancelled
        with anyio.move_on_after(0.5) as early:
            await executor.wait_ready()
        assert early.cancelled_caught, "wait_ready() took the old epoch's start for the new one's"
        await until(lambda: len(runners.gates) == 2 and runners.alive == 0)
        runners.gates[1].set()
        with anyio.fail_after(5):
            await executor.wait_ready()
        assert runners.alive == 1 and executor.stats()["workers"]["alive"] == 1
        tg.cancel_scope.cancel()
    assert runners.alive == 0


async def test_a_wait_ready_before_the_next_epoch_began_outlives_another_quiesce_and_wakeup() -> None:
    """wait_ready() called while the ending epoch still stops its runners, then quiesce() and
    wakeup() again before the next epoch began (another task, the idle timer): the waiter is
    answered by the epoch that starts. It waited for events no epoch would ever set, forever."""
    executor = SlotExecutor(1, lambda _: _GatedRunners(), preload_timeout=60, idle_timeout=None)
    runners = executor.runners
    answered = anyio.Event()

    async def waiter() -> None:
        await executor.wait_ready()
        answered.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(executor.serve)
        executor.wakeup()
        await until(lambda: len(runners.gates) == 1)
        executor.quiesce()
        executor.wakeup()  # the first epoch is still ending: its start finishes shielded
        tg.start_soon(waiter)
        await anyio.sleep(0.05)
        executor.quiesce()
        executor.wakeup()
        runners.gates[0].set()
        await until(lambda: len(runners.gates) == 2)
        runners.gates[1].set()
        with anyio.fail_after(5):
            await answered.wait()
        assert runners.alive == 1
        tg.cancel_scope.cancel()


async def test_a_wait_ready_pending_when_the_pool_closes_raises_instead_of_hanging(cache_dir: Path) -> None:
    """A task outside the pool waits for its workers while the pool shuts down: PoolClosedError,
    at once."""
    p = pool(cache_dir, workers=2, fork_workers=False)
    outcome: list[BaseException | None] = []

    async def waiter() -> None:
        try:
            await p.wait_ready()
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as outside:
        async with p:
            outside.start_soon(waiter)
            await anyio.sleep(0.01)  # waiting for workers that are still starting
        with anyio.fail_after(5):
            await until(lambda: bool(outcome))
    assert isinstance(outcome[0], acompile.PoolClosedError), outcome


async def test_the_idle_timer_does_not_quiesce_a_pool_that_wakes_up_before_its_workers_are_ready() -> None:
    """wakeup() long after the last job, with an idle timer shorter than a worker's start: the
    workers are ready when it returns, and stay up for the idle timeout. The timer counted from
    the last job, quiesced the pool as it woke, and wait_ready() returned with none alive (or
    just after it returned)."""
    # Seconds, not tenths: the check right after the workers are ready must not depend on how
    # late a loaded machine wakes a sleeping task.
    executor = SlotExecutor(2, lambda _: _GatedRunners(), preload_timeout=60, idle_timeout=1.0)
    runners = executor.runners
    async with anyio.create_task_group() as tg:
        tg.start_soon(executor.serve)
        try:
            await anyio.sleep(1.5)  # idle since the executor was made
            executor.wakeup()
            await until(lambda: len(runners.gates) == 2)
            await anyio.sleep(1.5)  # the starts take longer than idle_timeout
            for gate in runners.gates:
                gate.set()
            with anyio.fail_after(5):
                await executor.wait_ready()
            assert runners.alive == 2 and executor.awake
            await anyio.sleep(0.1)
            assert executor.awake, "quiesced as soon as its workers were ready"
            await until(lambda: not executor.awake)  # idle again: the timer quiesces it
            assert len(runners.gates) == 2
        finally:
            runners.open_all()
            tg.cancel_scope.cancel()


@forked_and_fresh
async def test_wakeup_after_an_idle_quiesce_returns_with_every_worker_alive(
    cache_dir: Path, fork_workers: bool
) -> None:
    async with pool(cache_dir, workers=2, idle_timeout=0.2, fork_workers=fork_workers) as p:
        for _ in range(4):
            await until(lambda: not p.stats()["workers"]["awake"], seconds=30)
            await anyio.sleep(0.3)
            with anyio.fail_after(60):
                await p.wait_ready()
            assert p.stats()["workers"]["alive"] == 2


async def test_wakeup_is_wait_ready_and_says_it_is_deprecated(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        await p.quiesce()
        with pytest.warns(DeprecationWarning, match=r"await pool.wait_ready\(\)"):
            with anyio.fail_after(60):
                await p.wakeup()
        assert p.stats()["workers"]["alive"] == 1
