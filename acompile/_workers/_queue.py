"""Jobs, the queue that orders them, and the hand-off of a job to an idle worker.

A ``Job`` is what an executor runs: a worker-side backend module's name, the payload it compiles,
the kernel's name (for messages), a priority lane and the seconds it is expected to take.
Everything else on it is bookkeeping, set by the executor that runs it; its outcome is set
exactly once, with ``finish()``.

``JobQueue`` orders the jobs nobody runs yet: two lanes, urgent first (background work, such as
warm-ups and progressive tiers, waits behind every request somebody waits for; ``promote()``
moves a job forward when somebody starts to), and within a lane the longest expected job first.
Longest first is what keeps a storm's end short: a long compile started last would run alone
while every other worker idles.

A worker with nothing to do waits in the queue as a ``Taker``: in ``get()``, or without waiting,
``offer()``ed. ``put()`` gives a job straight to the taker that waited last (its process ran most
recently, so its pages and caches are the warmest), in the caller's own task: the taker's
``deliver`` sends the job to its worker on the spot. Only jobs that find every worker busy wait in
the queue, and only they are ordered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
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

    The job itself is its first five fields: ``backend``, the worker-side module that compiles
    (by name: the worker imports it), ``payload``, what it compiles (picklable), ``name``, the
    kernel's (for messages and stats), ``lane``, ``URGENT`` or ``BACKGROUND``, and
    ``expected_seconds``, what the submitter expects it to take (the queue runs long jobs first;
    0 when nobody knows). The rest is the executor's bookkeeping: where and when it ran, and its
    outcome.
    """

    backend: str
    payload: Any
    name: str
    lane: int = URGENT
    expected_seconds: float = 0.0
    id: int = field(default_factory=lambda: next(_job_ids))
    # new -> queued -> running -> done (running -> queued on a retry or quiesce)
    state: str = "new"
    result: Any = None
    error: BaseException | None = None
    # asyncio's own event (the pool runs on asyncio only): anyio's costs a backend lookup per job.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    worker_pid: int | None = None
    seconds: float = 0.0
    # What its worker spent waiting for something that was not its work (``_late.paused``):
    # not in ``seconds``.
    paused: float = 0.0
    external_kills: int = 0
    abandoned: bool = False
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    ended_at: float = 0.0
    # What stops it where it runs, while it runs (its executor sets it): abandon() calls it.
    stopper: Callable[[], None] | None = field(default=None, repr=False)
    # The job as its executor sends it, encoded once when submitted (a retry sends it again).
    frame: bytes | None = field(default=None, repr=False)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the outcome (the first call wins) and wake whoever awaits ``outcome()``."""
        if self.state == "done":
            return
        self.state = "done"
        self.result, self.error = result, error
        self.done.set()

    def abandon(self) -> None:
        """Nobody waits any more: drop the job if queued, stop it where it runs if running.

        A job handed to a worker whose task has not yet caught up has no stopper: the flag
        alone tells that task to stop the worker as soon as it does.
        """
        if self.state == "queued":
            self.finish(error=JobCancelled(self.name))
        elif self.state == "running":
            self.abandoned = True
            if self.stopper is not None:
                self.stopper()

    async def outcome(self) -> Any:
        """Wait for the job to finish; its result, or raises its error."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Taker:
    """An idle worker's place in the queue: ``deliver(job)`` hands it a job (and returns False
    when the worker can no longer take one: the job stays queued, and the taker is woken without
    it); ``job`` is the job it got, ``event`` wakes its slot."""

    def __init__(self, deliver: Callable[[Job], bool]) -> None:
        self.deliver = deliver
        self.job: Job | None = None
        self.event = anyio.Event()


class JobQueue:
    """Queued jobs in two lanes (urgent, background), longest expected first within a lane;
    idle workers wait in ``get()`` and are handed jobs by ``put()``."""

    def __init__(self) -> None:
        # Each lane is a heap of (order, job); order = (put back?, -expected seconds, sequence).
        self._lanes: tuple[list[tuple[tuple[int, float, int], Job]], ...] = ([], [])
        self._sequence = itertools.count()
        self._takers: list[Taker] = []
        self._held = 0

    def __len__(self) -> int:
        return sum(1 for i, lane in enumerate(self._lanes) for _, job in lane if self._live(job, i))

    @staticmethod
    def _live(job: Job, lane: int) -> bool:
        # A promoted job stays in its old lane until popped: only its current place counts.
        return job.state == "queued" and job.lane == lane

    def put(self, job: Job, *, front: bool = False) -> None:
        """Give ``job`` to the idle worker that waited last, in the caller's task, or queue it in
        its lane by expected time (``front``: a job put back, retried or quiesced, goes before
        every other of its lane)."""
        job.state = "queued"
        if self._held or not self._hand_over(job):
            self._push(job, front)

    def _hand_over(self, job: Job) -> bool:
        """Give ``job`` to the idle worker that waited last; False if none takes it."""
        while self._takers:
            taker = self._takers.pop()
            if taker.deliver(job):
                taker.job = job
                taker.event.set()
                return True
            # Refused: its worker is gone (its exit is known, but its slot has not caught up yet)
            # or the epoch ends. It is out of the queue now, where withdraw() no longer finds it:
            # woken empty-handed here, its slot sees why and replaces the worker; unwoken, it
            # would wait in get() forever, and its slot with it.
            taker.event.set()
        return False

    def hold(self) -> None:
        """Queue what is put, even with idle workers, until ``release()``: many jobs about to
        arrive (a ``gather``) then start longest first, not in the order they arrive."""
        self._held += 1

    def release(self) -> None:
        """End a ``hold()``: the idle workers take the queued jobs, longest first."""
        self._held -= 1
        if self._held == 0:
            while self._takers:
                job = self.pop()
                if job is None:
                    break
                if not self._hand_over(job):
                    self._push(job, front=False)
                    break

    def _push(self, job: Job, front: bool) -> None:
        sequence = next(self._sequence)
        # Put back: ahead of everything, the last one put back first (as a deque's appendleft).
        order = (0, 0.0, -sequence) if front else (1, -job.expected_seconds, sequence)
        heapq.heappush(self._lanes[job.lane], (order, job))

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane (its old place is skipped later)."""
        if job.state == "queued" and job.lane != URGENT:
            job.lane = URGENT
            self._push(job, front=False)

    def pop(self) -> Job | None:
        """The next live job, urgent lane first, or None."""
        for i, lane in enumerate(self._lanes):
            while lane:
                _, job = heapq.heappop(lane)
                if self._live(job, i):
                    return job
        return None

    async def get(self, taker: Taker) -> Job | None:
        """The next job: a queued one, or the one handed to ``taker`` while it waits; None when
        the taker is withdrawn (its worker is gone) or refused a job (``deliver`` returned False;
        the job stays queued for another worker).

        Cancelled while waiting, the taker leaves the queue; a job handed to it in the meantime
        is the caller's to deal with (it is in ``taker.job``).
        """
        job = self.pop()
        if job is not None:
            return job
        taker.job = None
        taker.event = anyio.Event()
        self._takers.append(taker)
        try:
            await taker.event.wait()
        finally:
            if taker in self._takers:
                self._takers.remove(taker)
        return taker.job

    def offer(self, taker: Taker) -> None:
        """Put ``taker`` in the queue without waiting: ``put()`` hands it the next job through
        its ``deliver`` (which must start the job: nobody waits on its event), until it is
        withdrawn. Call it only when the queue is empty (``pop()`` returned None)."""
        self._takers.append(taker)

    def withdraw(self, taker: Taker) -> None:
        """Take ``taker`` out of the queue: its ``get()`` returns what it was handed, or None."""
        if taker in self._takers:
            self._takers.remove(taker)
            taker.event.set()

    def fail_all(self, error: BaseException) -> None:
        """Finish every queued job with ``error``."""
        while (job := self.pop()) is not None:
            job.finish(error=error)
