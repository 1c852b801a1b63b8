"""Jobs, the queue that orders them, and the hand-off of a job to an idle worker.

A ``Job`` is what an executor runs: a worker-side backend module's name, the payload it compiles,
the kernel's name (for messages), a priority lane and the seconds it is expected to take.
Everything else on it is bookkeeping, set by the executor that runs it; its outcome is set
exactly once, with ``finish()``.

``JobQueue`` orders the jobs nobody runs yet, in two lanes: urgent first (background work, such as
warm-ups and progressive tiers, waits behind every request somebody waits for; ``promote()``
moves a job forward when somebody starts to). Within a lane, the longest expected job goes first:
a long compile started last would run alone while every other worker idles, and the storm would
end with it. Longest first alone starves a short job under a steady stream of longer ones (each
arrives after it and goes before it), so jobs age:

* **Due.** A job queued at ``a`` and expected to take ``e`` is due once the time is past
  ``a + 2e + L``, ``L`` being then the longest expected time among the last 100 jobs queued (the
  most a running job is expected to hold its worker). A short job is due soon, a long one late:
  the long jobs of a stream do not crowd out the short ones by being due early.
* **The order.** A free worker takes, in its lane: a job put back (its worker was lost or
  quiesced); else the due job that was due first; else the longest expected job.
* **Batches.** Jobs queued during one ``hold()`` (a ``gather``) are a batch, and keep longest first
  among themselves: when a batch's job is due and a longer one of its batch is still queued, the
  longer one runs in its turn, and the job's due time moves back by the longer one's expected
  time. A storm that arrives as one batch therefore runs longest first to its end, however long
  it runs; a job arriving after it still ages past it.
* **The bound.** Once due, a job is passed only by jobs put back and by jobs due before it (each
  of which may run a longer job of its batch instead, as above), and a job of a batch by the
  longer jobs of its batch. A due job outside a batch with none of these ahead of it is taken by
  the next worker to free up: it starts within the time the running jobs have left, and, when
  they take what they were expected to, ends within ``3e + 2L`` after it was queued (a 0.05 s job
  in a stream of jobs up to 0.6 s: 1.35 s, where longest first alone ran it after the whole
  stream). In general, a job due at ``d`` starts by ``d + (R + Q) / W`` with ``W`` workers, ``R``
  the work still running at ``d`` and ``Q`` that of the jobs that pass it: no worker idles while
  it waits.
* **Lanes stay strict.** A background job never goes before an urgent one, due or not: nobody
  waits for it, and the moment somebody does, ``promote()`` moves it to the urgent lane, where it
  ages from then on.

Each queued job is in its lane's order (longest first), in its lane's due order, and in its
batch's order (a job put back: in its lane's list of those): three heaps, whose stale entries (a
job taken through another one, cancelled or promoted) are dropped when they come to the top, or
when a heap has doubled since it was last rebuilt without them. ``put()`` and ``pop()`` cost
O(log n), amortized, with no pass over the queue per job.

A worker with nothing to do waits in the queue as a ``Taker``: in ``get()``, or without waiting,
``offer()``ed. ``put()`` gives a job straight to the taker that waited last (its process ran most
recently, so its pages and caches are the warmest), in the caller's own task: the taker's
``deliver`` sends the job to its worker on the spot. Only jobs that find every worker busy wait in
the queue, and only they are ordered.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from typing import Any

import anyio

from acompile._errors import AcompileError

URGENT = 0
BACKGROUND = 1
_job_ids = itertools.count(1)
# A job is due once it has waited _AGING times its expected time, plus the longest expected time
# among the last _RECENT jobs queued (the module's docstring).
_AGING = 2.0
_RECENT = 100
# A lane's heaps are rebuilt without their stale entries once they hold this many, or twice what
# they held after the last rebuild.
_ROOM = 64


class JobCancelled(AcompileError):
    """Internal: the job was dropped because nobody waits for it any more."""


@dataclass(eq=False)
class Job:
    """One unit of work for one worker; its outcome is set exactly once.

    The job itself is its first five fields: ``backend``, the worker-side module that compiles
    (by name: the worker imports it), ``payload``, what it compiles (picklable), ``name``, the
    kernel's (for messages and stats), ``lane``, ``URGENT`` or ``BACKGROUND``, and
    ``expected_seconds``, what the submitter expects it to take (the queue runs long jobs first,
    and a job that waited past its bound, which grows with it, before them; 0 when nobody knows).
    The rest is the executor's bookkeeping: where and when it ran, and its outcome.
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
    # The queue's: which of its entries are the job's (0: none, taken), when it is due, its batch.
    _ticket: int = field(default=0, init=False, repr=False)
    _due: float = field(default=0.0, init=False, repr=False)
    _batch: int = field(default=0, init=False, repr=False)

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


# A lane's entries, each with the ticket the job had when queued: an entry whose ticket is no
# longer the job's is stale. The ticket, a sequence number, breaks ties: the first queued first.
_OrderEntry = tuple[float, int, int, Job]  # (-expected seconds, ticket, batch): longest first
_DueEntry = tuple[float, int, Job]  # (due time before L, ticket): first due first
_BatchEntry = tuple[float, int, Job]  # (-expected seconds, ticket): a batch's order


def _live(job: Job, ticket: int) -> bool:
    return job._ticket == ticket and job.state == "queued"


class JobQueue:
    """Queued jobs in two lanes (urgent, background), longest expected first within a lane, a job
    that has waited past its bound before them (see the module's docstring); idle workers wait
    in ``get()`` and are handed jobs by ``put()``."""

    def __init__(self) -> None:
        # Per lane: the jobs put back, as (ticket, job), the last one put back at the end.
        self._back: tuple[list[tuple[int, Job]], list[tuple[int, Job]]] = ([], [])
        self._order: tuple[list[_OrderEntry], list[_OrderEntry]] = ([], [])
        self._due: tuple[list[_DueEntry], list[_DueEntry]] = ([], [])
        self._room = [_ROOM, _ROOM]
        self._batches: dict[int, list[_BatchEntry]] = {}
        self._batch = 0  # the batch that jobs queued now join (one per lane), 0 outside a hold()
        self._batch_ids = itertools.count(1)
        self._tickets = itertools.count(1)
        # The longest expected times among the last _RECENT jobs queued, as (count, seconds), each
        # longer than those after it: the first is L.
        self._recent: deque[tuple[int, float]] = deque()
        self._queued = 0
        self._takers: list[Taker] = []
        self._held = 0

    def __len__(self) -> int:
        back = sum(1 for lane in self._back for ticket, job in lane if _live(job, ticket))
        return back + sum(1 for lane in self._order for _, ticket, _, job in lane if _live(job, ticket))

    def put(self, job: Job, *, front: bool = False) -> None:
        """Give ``job`` to the idle worker that waited last, in the caller's task, or queue it in
        its lane (``front``: a job put back, retried or quiesced, goes before every other of its
        lane)."""
        job.state = "queued"
        if self._held:
            self._push(job, front, batch=0 if front else self._batch + job.lane)
        elif not self._hand_over(job):
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
        arrive (a ``gather``) then start longest first, not in the order they arrive. They are
        one batch, which keeps that order to its end (see the module's docstring)."""
        if not self._held:
            self._batch = 2 * next(self._batch_ids)  # this one for urgent jobs, the next background
        self._held += 1

    def release(self) -> None:
        """End a ``hold()``: the idle workers take the queued jobs, longest first."""
        self._held -= 1
        if self._held == 0:
            self._batch = 0
            while self._takers:
                job = self.pop()
                if job is None:
                    break
                if not self._hand_over(job):
                    self._push(job, True)  # it was next, and stays next
                    break

    def _push(self, job: Job, front: bool, *, batch: int = 0) -> None:
        ticket = next(self._tickets)
        job._ticket = ticket
        if front:
            # Put back: ahead of everything, the last one put back first (as a deque's appendleft).
            job._batch = 0
            self._back[job.lane].append((ticket, job))
            return
        expected = job.expected_seconds
        due = time.perf_counter() + _AGING * expected
        # L: those of the last _RECENT jobs queued that no later one is as long as.
        count = self._queued = self._queued + 1
        recent = self._recent
        while recent and recent[-1][1] <= expected:
            recent.pop()
        recent.append((count, expected))
        if recent[0][0] <= count - _RECENT:
            recent.popleft()
        job._due, job._batch = due, batch
        order = self._order[job.lane]
        heappush(order, (-expected, ticket, batch, job))
        heappush(self._due[job.lane], (due, ticket, job))
        if batch:
            heappush(self._batches.setdefault(batch, []), (-expected, ticket, job))
        if len(order) > self._room[job.lane]:
            self._compact(job.lane)

    def _compact(self, lane: int) -> None:
        """Rebuild ``lane``'s heaps, and the batches', without their stale entries.

        A stale entry leaves a heap when it comes to the top, and some never do: a short job
        taken when due stays in the lane's order under every longer job, for as long as longer
        jobs keep arriving, and would keep the finished job (its result with it) alive. Rebuilt
        only after the heap doubled, the pass costs O(1) a job put, amortized.
        """
        order, due = self._order[lane], self._due[lane]
        order[:] = [entry for entry in order if _live(entry[3], entry[1])]
        due[:] = [entry for entry in due if _live(entry[2], entry[1]) and entry[0] == entry[2]._due]
        heapify(order)
        heapify(due)
        for number, batch in list(self._batches.items()):
            batch[:] = [entry for entry in batch if _live(entry[2], entry[1])]
            if batch:
                heapify(batch)
            else:
                del self._batches[number]
        self._room[lane] = max(_ROOM, 2 * len(order))

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane, where it ages from now (its entries
        in the background lane are stale from now)."""
        if job.state == "queued" and job.lane != URGENT and job._ticket:
            job.lane = URGENT
            self._push(job, front=False)

    def pop(self) -> Job | None:
        """The next job, urgent lane first, or None."""
        job = self._next(URGENT)
        return job if job is not None else self._next(BACKGROUND)

    def _next(self, lane: int) -> Job | None:
        """Take the next job of ``lane``: put back, else due, else the longest."""
        back = self._back[lane]
        while back:
            ticket, job = back.pop()
            if job._ticket == ticket and job.state == "queued":
                job._ticket = 0
                return job
        order = self._order[lane]
        while order:
            _, ticket, number, job = order[0]
            if job._ticket == ticket and job.state == "queued":
                break
            heappop(order)
            if number:
                self._tidy(number)
        else:
            return None
        due = self._due[lane]
        while due:
            when, ticket, waiting = due[0]
            if waiting._ticket == ticket and waiting.state == "queued" and when == waiting._due:
                if when + self._recent[0][1] <= time.perf_counter():
                    return self._take_due(due)
                break
            heappop(due)  # taken through another order, dropped, or due later now
        job._ticket = 0
        heappop(order)
        if number:
            self._tidy(number)
        return job

    def _take_due(self, due: list[_DueEntry]) -> Job:
        """Take the job first due, or, if its batch has a longer job queued, that one in its turn
        (and the job is due later by as long)."""
        _, ticket, job = due[0]
        if job._batch:
            batch = self._batches[job._batch]  # holds the job, live: not tidied away
            while not _live(batch[0][2], batch[0][1]):
                heappop(batch)
            longest = batch[0][2]
            if longest is not job:
                heappop(batch)
                longest._ticket = 0
                if longest.expected_seconds > 0:
                    job._due += longest.expected_seconds
                    heappush(due, (job._due, ticket, job))
                return longest
        heappop(due)
        job._ticket = 0
        return job

    def _tidy(self, number: int) -> None:
        """A job of batch ``number`` left the lane's order (taken or stale): drop the stale first
        entries of the batch's order, and the batch once none of its jobs is queued."""
        batch = self._batches.get(number)
        if batch is not None:
            while batch and not _live(batch[0][2], batch[0][1]):
                heappop(batch)
            if not batch:
                del self._batches[number]

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
