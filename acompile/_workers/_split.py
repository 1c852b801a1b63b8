"""``SplitExecutor``: urgent jobs on one executor (this machine's workers), background jobs on
another (a farm).

``CompilePool(workers=Split(N, RayFarm(...)))`` asks for both: a server's on-demand compiles (the
urgent lane: somebody waits for each) stay on N local workers, where no network sits between the request
and the compiler and a cluster's trouble cannot delay them, while warm-ups, progressive best
tiers and every other background job go to the farm. A background job somebody starts to wait for
is promoted where it is queued (on the farm): moving it would lose its place.
"""

from __future__ import annotations

import weakref
from typing import Any

import anyio

from acompile._workers._executor import Executor, ExecutorStats, combined_stats, run_job
from acompile._workers._queue import URGENT, Job


class SplitExecutor:
    """Implements ``Executor`` over two: ``local`` for urgent jobs, ``farm`` for the rest."""

    def __init__(self, local: Executor, farm: Executor) -> None:
        self.local = local
        self.farm = farm
        self._where: weakref.WeakKeyDictionary[Job, Executor] = weakref.WeakKeyDictionary()

    def submit(self, job: Job) -> None:
        """Queue ``job`` on the local workers if urgent, else on the farm."""
        executor = self.local if job.lane == URGENT else self.farm
        executor.submit(job)
        self._where[job] = executor

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result (cancelled, the job is cancelled where it is)."""
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` on the executor it was given to."""
        executor = self._where.get(job)
        if executor is not None:
            executor.cancel(job)

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane of the executor that holds it."""
        executor = self._where.get(job)
        if executor is not None:
            executor.promote(job)

    def quiesce(self) -> None:
        """Release both: the local workers and the farm's."""
        self.local.quiesce()
        self.farm.quiesce()

    def wakeup(self) -> None:
        """Start both."""
        self.local.wakeup()
        self.farm.wakeup()

    async def wait_ready(self) -> None:
        """Wait for both (at once); raises what either raises."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.local.wait_ready)
            tg.start_soon(self.farm.wait_ready)

    def stats(self) -> ExecutorStats:
        """Both executors' figures added up (workers, jobs, restarts by cause, durations)."""
        return combined_stats(self.local.stats(), self.farm.stats())

    async def serve(self) -> None:
        """Serve both until cancelled; each stops its own on the way out."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.local.serve)
            tg.start_soon(self.farm.serve)
