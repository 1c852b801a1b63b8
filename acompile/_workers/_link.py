"""``LinkedExecutor``: the one client of a helper process that runs a pool's jobs elsewhere.

Two executors send their jobs to a process acompile starts and talks to: a farm's connection
process (``_farm._remote``: Ray is imported there, never in the pool's process) and the host's
pool server (``_torch._hostpool``: one pool for every process of a host). Everything around the
conversation is written here once, and each of them hands in only its ``Link``: how to encode a
request as a frame, how to read the next reply, how to close.

* **Start and hello.** An opener (``reconnect``) starts the helper where it must and returns a
  connected ``Link`` that has said hello (its size, its first figures); it raises an
  ``AcompileError`` saying why not.
* **Frames.** Requests (submit, cancel, promote, quiesce, wakeup, wait for readiness) are encoded
  by the link when they are made and written in order by one task, so that the ``Executor``
  methods stay synchronous; replies are read by another, with a silence limit: a helper that says
  nothing (not even its heartbeat) for ``silence`` seconds is lost as if it had ended, since one
  stopped by a signal keeps its socket open.
* **Jobs in flight.** A table by job id; a reply finishes its job; a job cancelled here is told
  to the helper and ends at once.
* **Loss.** When the helper ends, goes silent or says it lost what it serves, the jobs in flight
  are sent again once to a new connection, where one is made at once (``Policy.at_once``: the
  host's pool, started again by whoever asks first), and otherwise (or the second time) go to the
  local fallback or fail with the loss's error. Until a new connection holds, new jobs go there
  too.
* **Restart with back-off.** New connections are tried ``Policy.first`` seconds after the loss,
  then at doubling intervals up to ``Policy.most``, until one holds.
* **Local fallback.** Where the helper allows it, this machine's workers: the pool's own (under
  a ``Split``), or workers made here at the first need and served here, quiesced again when the
  helper is back.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc

from acompile._errors import AcompileError, CompileError, PoolClosedError
from acompile._workers._executor import Executor, ExecutorStats, combined_stats, idle_stats, run_job
from acompile._workers._queue import Job, JobCancelled

__all__ = ("Link", "LinkLost", "LinkedExecutor", "Policy", "Reply")

logger = logging.getLogger("acompile")


class LinkLost(Exception):
    """The helper went away (or broke the conversation); the text says how."""


@dataclass
class Reply:
    """One reply of a helper, as its link reads it.

    ``kind``: ``"done"`` (``id``, ``value`` the result), ``"error"`` (``id``, ``value`` the
    exception), ``"ran"`` (``id``, ``value`` where and when it ran: ``pid``, ``started_at``,
    ``ended_at``, ``seconds``, ``paused``), ``"ready"`` (``id`` a wait's token, ``value`` its
    error or None), ``"stats"`` (``value`` the helper's ``ExecutorStats``, ``extra`` anything
    more it reports), ``"lost"`` (``value`` the error: the helper lives, what it serves is
    gone), ``"beat"`` (nothing to do: it lives).
    """

    kind: str
    id: int = 0
    value: Any = None
    extra: Any = None


class Link(Protocol):
    """One connection to a helper, made by an opener (see ``LinkedExecutor``)."""

    # What the helper said when it connected: ``size`` (its workers) at least.
    hello: dict[str, Any]
    # Whether the helper has said its workers are ready, where it says so to everyone (then
    # ``wait_ready`` sends nothing, and a ``ready`` reply with id -1 releases every wait).
    ready: bool

    def submit(self, job: Job) -> bytes:
        """The frame that sends ``job``; raises ``CompileError`` for a job it cannot send."""
        ...

    def cancel(self, job_id: int) -> bytes | None:
        """The frame that cancels a job sent (None: nothing to send)."""
        ...

    def promote(self, job_id: int) -> bytes | None: ...

    def quiesce(self) -> bytes | None: ...

    def wakeup(self) -> bytes | None: ...

    def wait_ready(self, token: int) -> bytes | None:
        """The frame that asks for a ``ready`` reply with ``token`` once the helper's workers
        are ready (None: the helper says so to everyone, see ``ready``)."""
        ...

    async def write(self, data: bytes) -> None:
        """Write frames; raises ``LinkLost`` when the helper is gone."""
        ...

    async def tend(self) -> None:
        """What the connection needs done beside the frames while it lasts (read the helper's
        standard error); runs until cancelled."""
        ...

    async def receive(self) -> Reply:
        """The next reply; raises ``LinkLost`` when the helper is gone or sent what cannot be
        read (it is ours: that is as good as its end)."""
        ...

    async def close(self, grace: float) -> None:
        """End the connection (the helper leaves, or is stopped past ``grace`` seconds)."""
        ...


@dataclass(frozen=True)
class Policy:
    """How a ``LinkedExecutor`` meets a loss.

    Attributes:
        silence: seconds without a reply (heartbeats included) after which the helper is lost.
        at_once: try one new connection at once when the helper is lost, and send the jobs in
            flight again to it (once); otherwise they go to the fallback (or fail) at once.
        first, most: the first wait before a new connection is tried (after the attempt made at
            once, if any), and the most between two attempts (each doubles the last).
        close_grace: how long leaving waits for the helper to leave before it is stopped.
        abort_grace: the same, for a helper that was lost.
    """

    silence: float
    at_once: bool
    first: float
    most: float
    close_grace: float
    abort_grace: float


class LinkedExecutor:
    """Implements ``Executor`` over a helper's ``Link``; see the module's docstring.

    Args:
        link: the first connection, made by ``reconnect`` (or as it would).
        reconnect: makes a new connection (after a loss); raises ``AcompileError`` or
            ``OSError`` where it cannot, or returns None where trying is pointless for now
            (the helper's address does not answer).
        policy: how a loss is met.
        lost_error: the error of a loss, from a text that says how it happened.
        local: the pool's own local workers (served by the pool) to fall back to, if any.
        make_local: makes local workers to fall back to (served here), at the first need.
        fallback: whether jobs may fall back to local workers at all.
    """

    def __init__(
        self,
        link: Link,
        reconnect: Callable[[], Awaitable[Link | None]],
        policy: Policy,
        lost_error: Callable[[str], AcompileError],
        *,
        local: Executor | None = None,
        make_local: Callable[[], Executor] | None = None,
        fallback: bool = True,
    ) -> None:
        self.link = link
        self.policy = policy
        self._reconnect_with = reconnect
        self._lost_error = lost_error
        self._may_fall_back = fallback
        self._local = local
        self._make_local = make_local
        self._own_local = False  # whether self._local was made (and is served) here
        self._jobs: dict[int, Job] = {}  # sent to the helper, not ended
        self._moving: dict[int, Job] = {}  # a lost helper's, on their way elsewhere (_lose)
        self._sent_again: set[int] = set()  # jobs sent again once after a loss
        self._ran: dict[int, dict[str, Any]] = {}  # where and when a job ran, before its outcome
        self._tokens = itertools.count()
        self._waiting: dict[int, list[Any]] = {}  # wait_ready() calls: [event, error]
        self._frames: list[bytes] = []  # for the helper, not written yet
        self._written = anyio.Event()
        self._lost: AcompileError | None = None
        self._closed = False
        self._link_closed = False
        self._tg: anyio.abc.TaskGroup | None = None
        # What the helper reports of itself, where it does (a farm's executor), with the counts
        # of the connections lost before (a pool's counts never go back); else counted here.
        self._stats: ExecutorStats | None = link.hello.get("stats")
        self._carried: ExecutorStats | None = None
        self._counts = {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 0, "retried": 0}
        self._seconds: list[float] = []
        self._slowest: list[tuple[float, str]] = []

    # -- the caller's side -------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Send ``job`` to the helper; while it is lost, give it to local workers (where allowed)
        or raise the loss's error. Raises ``PoolClosedError`` after shutdown."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._lost is not None:
            self._fallback_or_raise().submit(job)
            return
        try:
            frame = self.link.submit(job)
        except CompileError as exc:
            self._counts["failed"] += 1
            job.finish(error=exc)  # that request fails, nothing else
            return
        job.state = "running"  # as far as this process can tell: it is the helper's now
        job.started_at = time.perf_counter()
        self._jobs[job.id] = job
        self._counts["running"] += 1
        self._send(frame)

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result, or raise its error; cancelled, the job is
        cancelled where it is."""
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job``: it is cancelled where it runs and ends here at once."""
        if self._jobs.pop(job.id, None) is not None:
            self._ran.pop(job.id, None)
            self._sent_again.discard(job.id)
            self._counts["running"] -= 1
            self._counts["cancelled"] += 1
            self._send(self.link.cancel(job.id))
            job.finish(error=JobCancelled(job.name))
        elif self._moving.pop(job.id, None) is not None:
            # Between a lost helper and where it goes next: it goes nowhere.
            self._sent_again.discard(job.id)
            self._counts["running"] -= 1
            self._counts["cancelled"] += 1
            job.finish(error=JobCancelled(job.name))
        elif self._local is not None:
            self._local.cancel(job)

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane, where it is queued."""
        if job.id in self._jobs:
            self._send(self.link.promote(job.id))
        elif self._local is not None:
            self._local.promote(job)

    def quiesce(self) -> None:
        """Release the helper's workers (and local workers started here for a loss)."""
        if self._lost is None:
            self._send(self.link.quiesce())
        if self._own_local and self._local is not None:
            self._local.quiesce()

    def wakeup(self) -> None:
        """Start the helper's workers (while it is lost, the local workers that replace it)."""
        if self._lost is None:
            self._send(self.link.wakeup())
        elif (local := self._fallback()) is not None:
            local.wakeup()

    async def wait_ready(self) -> None:
        """Wait until the helper's workers are ready; raises what it raises, and, while it is
        lost, waits for the local workers that replace it or raises the loss's error."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._lost is None:
            token = next(self._tokens)
            frame = self.link.wait_ready(token)
            if frame is None and self.link.ready:
                return
            waiting: list[Any] = [anyio.Event(), None]
            self._waiting[token] = waiting
            self._send(frame)
            try:
                await waiting[0].wait()
            finally:
                self._waiting.pop(token, None)
            if waiting[1] is not None:
                raise waiting[1]
            if self._closed:
                raise PoolClosedError("the pool shut down while waiting for its workers")
            if self._lost is None:
                return
        await self._fallback_or_raise().wait_ready()

    def stats(self) -> ExecutorStats:
        """The helper's figures as it last sent them (or as counted here), with those of the
        connections lost before and of local workers started here for a loss."""
        if self._stats is not None:
            stats = self._stats if self._carried is None else combined_stats(self._carried, self._stats)
            stats = self._jobs_as_seen_here(stats)
        else:
            stats = idle_stats(int(self.link.hello.get("size", 1)))
            stats["workers"]["awake"] = self._lost is None
            stats["workers"]["busy"] = self._counts["running"]
            stats["jobs"] = dict(self._counts)  # type: ignore[typeddict-item]
            stats["job_seconds"] = list(self._seconds)
            stats["slowest"] = list(self._slowest)
        if self._own_local and self._local is not None:
            return combined_stats(self._local.stats(), stats)
        return stats

    def _jobs_as_seen_here(self, stats: ExecutorStats) -> ExecutorStats:
        """The helper's figures with its jobs as this process saw them end. The helper reports
        every so often, and its last report outlives it: a farm whose head was lost said 55
        queued, 1 running and 0 failed for 56 jobs that had failed here. So: in flight, the jobs
        sent with no outcome yet, split as the helper last said (running, the rest queued);
        done, failed and cancelled, counted here as each ended (a job failed by a loss
        included); retried, the helper's (a worker lost under a job) and this process's (sent
        again after a loss)."""
        there = stats["jobs"]
        in_flight = max(0, self._counts["running"])
        running = min(there["running"], in_flight)
        jobs = {
            "queued": in_flight - running,
            "running": running,
            "done": self._counts["done"],
            "failed": self._counts["failed"],
            "cancelled": self._counts["cancelled"],
            "retried": there["retried"] + self._counts["retried"],
        }
        return {**stats, "jobs": jobs}  # type: ignore[typeddict-item]

    @property
    def lost(self) -> AcompileError | None:
        """Why the helper is lost now; None while it serves."""
        return self._lost

    # -- the helper's side -------------------------------------------------------------------

    async def serve(self) -> None:
        """Exchange frames with the helper until cancelled; meet each loss (see the module's
        docstring). On the way out, close the connection."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                while True:
                    async with anyio.create_task_group() as connection:
                        connection.start_soon(self._write)
                        connection.start_soon(self.link.tend)
                        error = await self._read()
                        connection.cancel_scope.cancel()
                    if await self._lose(error):
                        continue  # a new connection holds, the jobs in flight sent again
                    await self._reconnect()
        finally:
            self._closed = True
            for jobs in (self._jobs, self._moving):
                for job in jobs.values():
                    job.finish(error=PoolClosedError("the pool shut down before this job ran"))
                self._counts["running"] -= len(jobs)
                jobs.clear()
            for waiting in self._waiting.values():
                waiting[0].set()
            await self.aclose()

    async def aclose(self) -> None:
        """Leave: close the connection (once; shielded). ``serve()`` does it on its way out; an
        executor whose ``serve()`` never ran needs it called."""
        self._closed = True
        await self._close_link(self.policy.close_grace)

    async def _close_link(self, grace: float) -> None:
        if not self._link_closed:
            self._link_closed = True
            with anyio.CancelScope(shield=True):
                await self.link.close(grace)

    def _send(self, frame: bytes | None) -> None:
        """Queue a frame for the helper (written by ``_write``: the callers are not async)."""
        if frame is not None and self._lost is None and not self._closed:
            self._frames.append(frame)
            self._written.set()

    async def _write(self) -> None:
        while True:
            await self._written.wait()
            self._written = anyio.Event()
            frames, self._frames = self._frames, []
            try:
                await self.link.write(b"".join(frames))
            except LinkLost:
                return  # the reader tells why

    async def _read(self) -> AcompileError:
        """Take the helper's replies until it is lost; returns the error that says so."""
        while True:
            try:
                with anyio.fail_after(self.policy.silence):
                    reply = await self.link.receive()
            except LinkLost as exc:
                return self._lost_error(str(exc))
            except TimeoutError:
                return self._lost_error(
                    f"it has not answered for {self.policy.silence:g} s (stopped by a signal, or hung)"
                )
            kind = reply.kind
            if kind == "done":
                self._finish(reply.id, result=reply.value)
            elif kind == "error":
                self._finish(reply.id, error=reply.value)
            elif kind == "ran":
                self._ran[reply.id] = reply.value
                if (job := self._jobs.get(reply.id)) is not None:
                    job.worker_pid = reply.value.get("pid")
            elif kind == "ready":
                for token in [reply.id] if reply.id >= 0 else list(self._waiting):
                    waiting = self._waiting.get(token)
                    if waiting is not None:
                        waiting[1] = reply.value
                        waiting[0].set()
            elif kind == "stats":
                self._stats = reply.value
                self.on_stats(reply)
            elif kind == "lost":
                return reply.value  # type: ignore[no-any-return]

    def on_stats(self, reply: Reply) -> None:
        """What a subclass keeps of a ``stats`` reply beyond the executor's figures."""

    def _finish(self, job_id: int, result: Any = None, error: BaseException | None = None) -> None:
        job = self._jobs.pop(job_id, None)
        ran = self._ran.pop(job_id, None)
        self._sent_again.discard(job_id)
        if job is None:
            return  # cancelled here before it ended there
        if ran is not None:
            job.worker_pid = ran["pid"]
            # perf_counter is the machine's monotonic clock on Linux: the same in both processes.
            job.started_at, job.ended_at = ran["started_at"], ran["ended_at"]
            job.seconds, job.paused = ran["seconds"], ran["paused"]
        else:
            job.ended_at = time.perf_counter()
            job.seconds = job.ended_at - job.started_at
        self._counts["running"] -= 1
        self._counts["failed" if error is not None else "done"] += 1
        self._seconds = [*self._seconds[-99:], job.seconds]
        self._slowest = heapq.nlargest(10, [*self._slowest, (job.seconds, job.name)])
        job.finish(result=result, error=error)

    async def _lose(self, error: AcompileError) -> bool:
        """The helper is lost: where the policy says so, connect again at once and send the jobs
        in flight again (once each); the others go to local workers or fail, and so will later
        ones until a new connection holds. True where a new connection holds now.

        While this runs, the jobs it moves are in ``_moving``: a caller that leaves cancels its
        job there, and a pool that leaves fails them (``serve``'s end)."""
        self._lost = error
        # What was written for the lost helper and not yet sent is its, not the next one's.
        self._frames.clear()
        self._written = anyio.Event()
        if self._stats is not None:
            self._stats = _without_workers(self._stats)
        self._moving = {job.id: job for job in sorted(self._jobs.values(), key=lambda job: job.id)}
        self._jobs.clear()
        self._ran.clear()
        for waiting in self._waiting.values():
            waiting[0].set()
        await self._close_link(self.policy.abort_grace)
        if self.policy.at_once:
            logger.warning("%s; connecting again", error)
            if await self._connect_again():
                for job in [job for job in self._moving.values() if job.id not in self._sent_again]:
                    del self._moving[job.id]
                    self._sent_again.add(job.id)
                    self._jobs[job.id] = job
                    self._counts["retried"] += 1
                    with contextlib.suppress(CompileError):
                        self._send(self.link.submit(job))
        jobs, self._moving = list(self._moving.values()), {}
        self._counts["running"] -= len(jobs)
        local = self._fallback()
        if jobs and local is None:
            logger.error("%s; %d jobs fail", error, len(jobs))
        elif jobs:
            logger.warning("%s; its %d pending jobs go to this machine's workers", error, len(jobs))
        for job in jobs:
            self._sent_again.discard(job.id)
            if local is None:
                self._counts["failed"] += 1
                job.finish(error=error)
                continue
            job.state = "new"
            try:
                local.submit(job)
            except AcompileError as exc:
                job.finish(error=exc)
        return self._lost is None

    async def _connect_again(self) -> bool:
        """One attempt at a new connection; True where it holds (the helper serves again). An
        opener that fails in any way is no connection yet (said at debug level), never the
        end of the pool."""
        try:
            link = await self._reconnect_with()
        except Exception as exc:
            logger.debug("no new connection yet: %s: %s", type(exc).__name__, exc)
            return False
        if link is None:
            return False
        if self._stats is not None:
            self._carried = _carried(self._carried, self._stats)
        self.link = link
        self._link_closed = False
        self._stats = link.hello.get("stats")
        self._lost = None
        if self._own_local and self._local is not None:
            jobs = self._local.stats()["jobs"]
            if jobs["queued"] + jobs["running"] == 0:
                # Idle: released now. Busy with what moved there, it finishes it, and its own
                # idle timer (if any) releases it; it wakes if work comes back to it.
                self._local.quiesce()
        return True

    async def _reconnect(self) -> None:
        """Connect again after a loss: attempts ``policy.first`` seconds apart, doubling to
        ``policy.most``, until one holds; new jobs go to the helper again from then on (jobs
        moved to local workers meanwhile finish there)."""
        lost_at = time.monotonic()
        delay = self.policy.first
        while True:
            await anyio.sleep(delay)
            delay = min(delay * 2, self.policy.most)
            if await self._connect_again():
                break
        waited = time.monotonic() - lost_at
        logger.warning("connected again, %.0f s after the loss: new jobs go there", waited)

    def _fallback(self) -> Executor | None:
        """The local workers that replace a lost helper (started here at the first need, unless
        the pool has its own); None where no fallback is allowed."""
        if not self._may_fall_back:
            return None
        if self._local is None and self._make_local is not None and self._tg is not None:
            self._local = self._make_local()
            self._own_local = True
            self._tg.start_soon(self._local.serve)
        return self._local

    def _fallback_or_raise(self) -> Executor:
        assert self._lost is not None
        local = self._fallback()
        if local is None:
            raise self._lost
        return local


def _carried(before: ExecutorStats | None, lost: ExecutorStats) -> ExecutorStats:
    """What a lost connection's figures add to the next ones': its counts (workers started and
    restarted, jobs done, failed, cancelled, retried, their durations), with ``before`` (the
    connections lost earlier); none of its slots, workers or jobs in flight (gone with it, or
    moved)."""
    workers = dict(_without_workers(lost)["workers"])
    workers["size"] = 0
    jobs = dict(lost["jobs"])
    jobs.update(queued=0, running=0)
    counts: ExecutorStats = {**lost, "workers": workers, "jobs": jobs}  # type: ignore[typeddict-item]
    return counts if before is None else combined_stats(before, counts)


def _without_workers(stats: ExecutorStats) -> ExecutorStats:
    """A lost helper's last figures: none of its workers is alive or busy any more, and none of
    its jobs queued or running there (they moved, or failed)."""
    workers = dict(stats["workers"])
    workers.update(alive=0, busy=0, awake=False)
    jobs = dict(stats["jobs"])
    jobs.update(queued=0, running=0)
    return {**stats, "workers": workers, "jobs": jobs}  # type: ignore[typeddict-item]
