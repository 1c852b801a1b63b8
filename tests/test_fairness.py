"""Fairness: a job does not wait for the whole of a steady stream of longer ones, and a storm
still starts its longest jobs first.

Real worker processes and the fake backend: jobs that sleep, with the time they are expected to
take set on the job as the cost model would set it.
"""

from __future__ import annotations

import gc
import statistics
import weakref
from pathlib import Path

import anyio
import pytest
from fake_backend import local_executor
from processes import until

import acompile
from acompile._workers import BACKGROUND, URGENT, Job, JobQueue

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


@pytest.fixture
def anyio_backend() -> str:
    # What is tested here is the queue's order, which is the same on any loop: one loop is enough.
    return "asyncio"


# A stream of heavier jobs, 0.3 to 0.6 s each in a mixed order, and the cheap job sent into it.
STREAM = [round(0.3 + 0.3 * ((7 * i) % 11) / 10, 2) for i in range(40)]
LONGEST = max(STREAM)
CHEAP = 0.05
# The hand-off, the replies and a loaded 2-core machine, beyond the queue's own bound.
SLACK = 0.4


def sleeper(name: str, seconds: float, lane: int = URGENT) -> Job:
    """A job that sleeps ``seconds``, expected to take as long."""
    return Job(FAKE, {"name": name, "action": "sleep", "seconds": seconds}, name, lane, seconds)


def pool(cache_dir: Path, workers: int = 2) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target="cuda:90", cache_dir=cache_dir, preload=())


async def test_a_cheap_job_sent_into_a_steady_stream_ends_within_twice_the_longest_job(
    cache_dir: Path,
) -> None:
    """2 workers, a stream of 0.3-0.6 s jobs with 6 in flight (each caller sends its next job as
    its last one ends), and a 0.05 s job sent 1 s in. Longest first alone would run it after the
    whole stream: every job that arrives after it is longer. It must end within twice the
    longest job's time (the queue's bound for it: 2 x 0.6 + 3 x 0.05 s) after it was sent."""
    heavy: list[float] = []
    cheap_done = anyio.Event()
    durations = iter(STREAM)  # shared: each caller takes the next one

    async def caller() -> None:
        for i, seconds in enumerate(durations):
            if cheap_done.is_set():
                return  # the test has what it measures: let the stream drain
            job = sleeper(f"heavy{i}", seconds)
            await executor.run(job)
            heavy.append(job.ended_at - job.queued_at)

    async with pool(cache_dir) as p:
        await p.wait_ready()
        executor = local_executor(p)
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(caller)
            await anyio.sleep(1.0)
            queued_then = p.stats()["jobs"]["queued"]
            cheap = sleeper("cheap", CHEAP)
            with anyio.fail_after(60):
                await executor.run(cheap)
            cheap_done.set()
    waited = cheap.ended_at - cheap.queued_at
    # The stream is what the test says it is: both workers busy, longer jobs waiting.
    assert queued_then >= 3, queued_then
    assert waited <= 2 * LONGEST + SLACK, (
        f"the cheap job took {waited:.2f} s (the stream's jobs: median {statistics.median(heavy):.2f} s)"
    )


async def test_a_storm_submitted_at_once_starts_its_longest_jobs_first(cache_dir: Path) -> None:
    """A batch (as a gather submits it) runs longest first from its first job to its last, even
    where it runs long enough for its short jobs to have waited past their own bound: a short
    job that starts before a longer one makes the storm end later."""
    expected = [0.05, 0.4, 0.1, 0.6, 0.2, 0.05, 0.5, 0.3, 0.15, 0.45, 0.1, 0.25]  # 3.15 s on 2 workers
    async with pool(cache_dir) as p:
        await p.wait_ready()
        executor = local_executor(p)
        jobs = [sleeper(f"storm{i}", seconds) for i, seconds in enumerate(expected)]
        release = executor.hold_dispatch()
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(executor.run, job)
            await until(lambda: p.stats()["jobs"]["queued"] == len(jobs))
            release()
    started = [job.expected_seconds for job in sorted(jobs, key=lambda job: job.started_at)]
    assert started == sorted(expected, reverse=True)


async def test_a_job_sent_after_a_batch_does_not_wait_for_all_of_it(cache_dir: Path) -> None:
    """A batch keeps its own order, but a job that arrives after it ages like any other: it does
    not wait for the whole batch (here 2.8 s on 2 workers), only until it is due and a worker
    frees up. The batch's short job is due before it, and has the batch's longer jobs run in its
    turns: each such turn moves it back, and the late job gets the next."""
    async with pool(cache_dir) as p:
        await p.wait_ready()
        executor = local_executor(p)
        batch = [sleeper(f"batch{i}", 0.5) for i in range(11)] + [sleeper("batch-short", CHEAP)]
        release = executor.hold_dispatch()
        async with anyio.create_task_group() as tg:
            for job in batch:
                tg.start_soon(executor.run, job)
            await until(lambda: p.stats()["jobs"]["queued"] == len(batch))
            release()
            await until(lambda: p.stats()["jobs"]["running"] == 2)
            late = sleeper("late", CHEAP)
            with anyio.fail_after(60):
                await executor.run(late)
            left = sum(job.state != "done" for job in batch)
    waited = late.ended_at - late.queued_at
    assert waited <= 2 * 0.5 + SLACK, f"the late job took {waited:.2f} s"
    assert left >= 4, f"only {left} jobs of the batch were left: the late job waited for it"


async def test_the_queue_takes_a_due_job_first_and_keeps_its_lanes() -> None:
    """The queue alone, on the clock: a job that has waited past its bound goes before longer
    ones of its lane, never before an urgent job, and a job put back still goes first."""
    queue = JobQueue()
    urgent = {name: Job(FAKE, None, name, URGENT, e) for name, e in (("short", 0.01), ("long", 0.05))}
    waiting = Job(FAKE, None, "background", BACKGROUND, 0.01)
    queue.put(waiting)
    queue.put(urgent["short"])
    # Fresh: longest first, urgent first.
    assert queue.pop() is urgent["short"]
    queue.put(urgent["short"])
    await anyio.sleep(0.3)  # both short jobs are due: 0.3 s > 2 x 0.01 + 0.05 s
    queue.put(urgent["long"])
    assert queue.pop() is urgent["short"], "a due job goes before a longer one that is not due"
    assert queue.pop() is urgent["long"], "an urgent job goes before a due background job"
    again = Job(FAKE, None, "put back", BACKGROUND, 0.0)
    queue.put(again, front=True)
    assert queue.pop() is again, "a job put back goes before a due one"
    assert queue.pop() is waiting
    assert queue.pop() is None
    assert len(queue) == 0


async def test_the_queue_keeps_no_job_it_no_longer_holds() -> None:
    """A short job taken when due leaves an entry behind in its lane's longest-first order, under
    the longer jobs; with longer jobs arriving all the time, that entry would never come to the
    top and leave, and the finished job (its result with it) would stay alive. The queue drops
    such entries once they pile up."""
    queue = JobQueue()
    gone: list[weakref.ref[Job]] = []
    for turn in range(30):
        queue.put(Job(FAKE, None, f"long{turn}", URGENT, 0.02))  # one long job always queued
        shorts = [Job(FAKE, None, f"short{turn}.{i}", URGENT, 0.001) for i in range(50)]
        for job in shorts:
            queue.put(job)
        await anyio.sleep(0.03)  # the short jobs are due: 2 x 0.001 + 0.02 s
        for _ in shorts:
            job = queue.pop()
            assert job is not None
            job.finish(result=bytes(1000))
            if job.name.startswith("short"):
                gone.append(weakref.ref(job))
        del job, shorts
    gc.collect()
    alive = sum(ref() is not None for ref in gone)
    assert len(gone) > 1000
    assert alive < 200, f"{alive} of {len(gone)} finished jobs are still alive"
