"""Jobs and the queue that feeds them to workers.

A ``Job`` is what an executor runs: a worker-side backend module's name, the payload it compiles,
the kernel's name (for messages) and a priority lane. Everything else on it is bookkeeping, set
by the executor that runs it; its outcome is set exactly once, with ``finish()``.

``JobQueue`` has two lanes, urgent first: background work (warm-ups, progressive tiers) waits
behind every request somebody waits for, and ``promote()`` moves a job forward when somebody
starts to.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio

from acompile._errors import AcompileError

URGENT = 0
BACKGROUND = 1
_job_ids = itertools.count(1)


class JobCancelled(AcompileError):
    """Internal: the job was dropped because nobody waits for it any more."""


@dataclass(eq=False)
class Job:
    """One unit of work for one worker; its outcome is set exactly once.

    The job itself is its first four fields: ``backend``, the worker-side module that compiles
    (by name: the worker imports it), ``payload``, what it compiles (picklable), ``name``, the
    kernel's (for messages and stats), and ``lane``, ``URGENT`` or ``BACKGROUND``. The rest is
    the executor's bookkeeping: where and when it ran, and its outcome.
    """

    backend: str
    payload: Any
    name: str
    lane: int = URGENT
    id: int = field(default_factory=lambda: next(_job_ids))
    # new -> queued -> running -> done (running -> queued on a retry or quiesce)
    state: str = "new"
    result: Any = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    worker_pid: int | None = None
    seconds: float = 0.0
    external_kills: int = 0
    abandoned: bool = False
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    ended_at: float = 0.0
    # The scope its worker runs it in, while it runs: abandon() cancels it.
    scope: anyio.CancelScope | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the outcome (the first call wins) and wake whoever awaits ``outcome()``."""
        if self.state == "done":
            return
        self.state = "done"
        self.result, self.error = result, error
        self.done.set()

    def abandon(self) -> None:
        """Nobody waits any more: drop the job if queued, stop its worker if running."""
        if self.state == "queued":
            self.finish(error=JobCancelled(self.name))
        elif self.state == "running" and self.scope is not None:
            self.abandoned = True
            self.scope.cancel()

    async def outcome(self) -> Any:
        """Wait for the job to finish; its result, or raises its error."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class JobQueue:
    """Queued jobs in two lanes (urgent, background); idle workers wait in ``get()``."""

    def __init__(self) -> None:
        self._lanes: tuple[deque[Job], deque[Job]] = (deque(), deque())
        self._waiters: list[anyio.Event] = []

    def __len__(self) -> int:
        return sum(1 for i, lane in enumerate(self._lanes) for job in lane if self._live(job, i))

    @staticmethod
    def _live(job: Job, lane: int) -> bool:
        # A promoted job stays in its old lane until popped: only its current place counts.
        return job.state == "queued" and job.lane == lane

    def put(self, job: Job, *, front: bool = False) -> None:
        """Queue a job at the end of its lane (or at the front: a job put back)."""
        job.state = "queued"
        if front:
            self._lanes[job.lane].appendleft(job)
        else:
            self._lanes[job.lane].append(job)
        self._wake_one()

    def _wake_one(self) -> None:
        # One idle slot per job: waking them all costs every one of them a loop iteration.
        if self._waiters:
            self._waiters.pop(0).set()

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane (its old place is skipped later)."""
        if job.state == "queued" and job.lane != URGENT:
            job.lane = URGENT
            self._lanes[URGENT].append(job)

    def pop(self) -> Job | None:
        """The next live job, urgent lane first, or None."""
        for i, lane in enumerate(self._lanes):
            while lane:
                job = lane.popleft()
                if self._live(job, i):
                    return job
        return None

    async def get(self) -> Job:
        """The next job, waiting for one if none is queued."""
        while True:
            job = self.pop()
            if job is not None:
                return job
            event = anyio.Event()
            self._waiters.append(event)
            try:
                await event.wait()
            except BaseException:
                if event in self._waiters:
                    self._waiters.remove(event)
                elif len(self):
                    self._wake_one()  # chosen for a job, but leaving: pass the turn on
                raise

    def fail_all(self, error: BaseException) -> None:
        """Finish every queued job with ``error``."""
        while (job := self.pop()) is not None:
            job.finish(error=error)
