"""``SlotExecutor``: the one skeleton under every executor, local or on a farm.

An executor runs a fixed number of *slots*. Each slot owns at most one *runner* at a time (a
worker process on this machine, a Ray actor on a farm's node), which takes jobs from the
executor's one queue (``_queue``) until it must be replaced and says why; the slot then stops it,
counts the cause (``stats()["workers"]["restarts"]``) and starts another. What every executor
keeps is written here once:

* the caller's side (the ``Executor`` protocol): submit, run, cancel, promote, quiesce, wakeup,
  wait_ready, stats, serve, and ``hold_dispatch`` for a batch;
* epochs: ``quiesce()`` ends the current one (every runner is stopped, running jobs go back to
  the front of the queue); new work, ``wakeup()`` or a job left waiting starts the next;
* the start-failure policy. A start that fails for a reason from outside
  (``TransientStartError``: a process killed while it preloaded, an actor's node lost) is tried
  again at once, then with a back-off of up to 2 s, and the queued jobs wait for it. A start that
  fails for a lasting reason (a preload that raises, one that runs past ``preload_timeout``)
  backs off up to 10 s. The executor gives up only while no runner is alive: after two lasting
  failures in a row, or after failures from outside for ``preload_timeout`` seconds in which no
  runner was ready. The queued jobs, and new ones, then fail with the error that stopped it,
  which names the cause. Its slots go on trying meanwhile, and the first runner that starts
  clears the error;
* the retry of a job whose runner was killed from outside while it ran: once more, at the front
  of the queue; a second loss fails it (``retry()``);
* the idle timer (``idle_timeout``): the executor quiesces after that long without work.

What differs between kinds of runner is behind two small interfaces: ``Runners`` starts a runner
for a slot, ``Runner`` serves jobs until it must be replaced. ``WorkerPool`` (``_pool``) is this
skeleton over worker processes; the farm's executor is the same skeleton over Ray actors.
"""

from __future__ import annotations

import heapq
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from acompile._errors import CompileError, PoolClosedError, PoolError, WorkerStartError
from acompile._workers._executor import ExecutorStats, run_job
from acompile._workers._queue import Job, JobCancelled, JobQueue

__all__ = ("NoRoom", "PoolStats", "Runner", "Runners", "SlotExecutor", "TransientStartError")

logger = logging.getLogger("acompile")

_TOP_N = 10
# Starts that fail for a lasting reason this many times in a row, with no runner alive, stop the
# executor (the queued jobs fail with the reason instead of waiting for a runner that will not
# come). Failures from outside stop it only once no runner has started for preload_timeout.
_LASTING_FAILURES = 2


@dataclass
class PoolStats:
    """An executor's counters and recent measurements (``SlotExecutor.counters``)."""

    started: int = 0
    forked: int = 0
    restarts: dict[str, int] = field(default_factory=dict)
    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    jobs_retried: int = 0
    preload_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    job_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    slowest: list[tuple[float, str]] = field(default_factory=list)  # a min-heap of the top N
    worker_rss: dict[int, int] = field(default_factory=dict)

    def record_job(self, name: str, seconds: float) -> None:
        """Count a finished job's duration (and keep it if among the slowest)."""
        self.job_seconds.append(seconds)
        if len(self.slowest) < _TOP_N:
            heapq.heappush(self.slowest, (seconds, name))
        elif seconds > self.slowest[0][0]:
            heapq.heapreplace(self.slowest, (seconds, name))

    def restart(self, cause: str) -> None:
        """Count a runner stopped (or not started) for ``cause``."""
        self.restarts[cause] = self.restarts.get(cause, 0) + 1

    def snapshot(self, size: int, alive: int, busy: int, awake: bool, queued: int) -> ExecutorStats:
        """An executor's ``stats()`` from these counters and its current state."""
        rss = {pid: round(resident / 2**20, 1) for pid, resident in self.worker_rss.items()}
        return {
            "workers": {
                "size": size,
                "alive": alive,
                "busy": busy,
                "awake": awake,
                "started": self.started,
                "forked": self.forked,
                "restarts": dict(self.restarts),
                "rss_mib": rss,
                "mean_rss_mib": round(statistics.fmean(rss.values()), 1) if rss else None,
            },
            "jobs": {
                "queued": queued,
                "running": busy,
                "done": self.jobs_done,
                "failed": self.jobs_failed,
                "cancelled": self.jobs_cancelled,
                "retried": self.jobs_retried,
            },
            "job_seconds": list(self.job_seconds),
            "slowest": list(self.slowest),
        }


class TransientStartError(WorkerStartError):
    """Raised by ``Runners.start``: a start that failed for a reason that may not happen again
    (the process was killed from outside, the template it forked from died, an actor's node was
    lost). The slot tries again at once, with
    back-off; queued jobs wait instead of failing."""


class NoRoom(Exception):
    """Raised by ``Runners.start``: no runner can start anywhere now.

    ``error``: why none ever can as things stand (every node refused, none offers what a runner
    needs); while no runner is alive, the executor fails its queued jobs and new ones with it.
    None: every place is taken, and one may free up. Either way the slot counts as ready
    (``wait_ready()`` does not wait for it) and looks again after ``retry_after`` seconds.
    """

    def __init__(self, error: PoolError | None, retry_after: float) -> None:
        super().__init__(str(error) if error is not None else "no room for a runner now")
        self.error = error
        self.retry_after = retry_after


class Runner(Protocol):
    """One started runner of a slot: a worker process, a Ray actor."""

    async def serve(self) -> str:
        """Run jobs from the executor's queue until this runner must be replaced; return why, as
        a restart cause (``"killed"``, ``"crash"``, ``"timeout"``, ``"abandoned"``...). Cancelled
        when the epoch ends: a job it runs then goes back to the queue (``put_back()``)."""
        ...

    async def stop(self, cause: str) -> None:
        """Stop the runner and release what it holds. Called once, shielded, whatever ended
        ``serve()``."""
        ...


class Runners(Protocol):
    """What starts the runners of a ``SlotExecutor``'s slots: one kind of runner."""

    def live(self) -> int:
        """How many runners are alive now (``stats()["workers"]["alive"]``); while any is, failed
        starts do not stop the executor."""
        ...

    def encode(self, job: Job) -> None:
        """Make ``job`` ready to send, once, in its submitter's task. Raises the job's own
        ``CompileError`` when it cannot be sent: that job fails, nothing else does."""
        ...

    async def start(self, slot: int) -> Runner:
        """Start a runner for ``slot`` and return it once it can take jobs. Raises
        ``TransientStartError`` (a fault from outside: tried again at once), ``WorkerStartError``
        (a lasting reason) or ``NoRoom``. Cancelled (the epoch ends), it leaves nothing running."""
        ...

    async def watch(self) -> None:
        """Run beside the slots for as long as the executor serves (watches of the runners'
        resources); return at once where there is nothing to watch."""
        ...

    async def close(self) -> None:
        """Release what outlives epochs (a template, a connection); called once, shielded, when
        the executor stops, after every runner was stopped."""
        ...


R = TypeVar("R", bound=Runners)


class SlotExecutor(Generic[R]):
    """Implements ``Executor`` with ``size`` slots, each running one runner at a time, that
    ``runners`` (built with this executor) starts. See the module's docstring for the rules.

    ``serve()`` is started in the owner's task group and runs until that group is cancelled; it
    stops every runner on the way out, whatever cancelled it, then ``runners.close()``.

    For the runners, the bookkeeping of a job: ``job_started``, ``job_ended``, ``reply``,
    ``fail``, ``put_back``, ``retry``; ``start_soon`` runs their background work in the
    executor's task group.
    """

    def __init__(
        self,
        size: int,
        runners: Callable[[SlotExecutor[R]], R],
        *,
        preload_timeout: float,
        idle_timeout: float | None,
    ) -> None:
        if size < 1:
            raise ValueError(f"an executor needs at least one worker, got workers={size}")
        self.size = size
        self.preload_timeout = preload_timeout
        self.idle_timeout = idle_timeout
        self.queue = JobQueue()
        self.counters = PoolStats()
        self.busy = 0
        self.last_activity = time.monotonic()
        self._ready = [anyio.Event() for _ in range(size)]
        # The ready events the current (or last) epoch took: set as it ends, so a wakeup needs
        # new ones; events no epoch took yet are the next epoch's, whoever waits for them.
        self._epoch_ready: list[anyio.Event] | None = None
        self._start_error: PoolError | None = None
        self._lasting_failures = 0  # in a row, executor-wide
        # When a runner was last ready (or the epoch began): failures from outside stop the
        # executor once this is preload_timeout ago, at a failure with no runner alive.
        self._last_ready = time.monotonic()
        self._closed = False
        self._awake = False
        self._wake = anyio.Event()
        self._epoch_scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.runners: R = runners(self)

    # -- the caller's side -------------------------------------------------------------------

    @property
    def awake(self) -> bool:
        """False while quiesced (no runner runs, none is starting)."""
        return self._awake

    @property
    def closed(self) -> bool:
        """True once ``serve()`` has ended: nothing is started any more."""
        return self._closed

    def submit(self, job: Job) -> None:
        """Queue ``job`` (waking the executor if quiesced).

        Raises ``PoolClosedError`` after shutdown, and the error that stopped the executor when
        no runner can start (``WorkerStartError``, ``FarmToolchainError``).
        """
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._start_error is not None and not self.runners.live():
            raise self._start_error
        try:
            self.runners.encode(job)
        except CompileError as exc:
            # Something in the request cannot be sent: that request fails, nothing else.
            job.finish(error=exc)
            self.counters.jobs_failed += 1
            return
        self.wakeup()  # a request on a quiesced executor wakes it
        self.queue.put(job)  # to an idle runner, from this task, if one waits

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result, or raise its error; cancelled while it is
        queued or running, the job is dropped or stopped where it runs."""
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job``: drop it if queued; if running, stop it where it runs (and
        count it cancelled, once)."""
        if job.state == "running" and not job.abandoned:
            self.counters.jobs_cancelled += 1
        job.abandon()

    def hold_dispatch(self) -> Callable[[], None]:
        """Queue new jobs even where runners are idle, until the returned function is called
        (once): a batch of requests then starts longest first (see ``JobQueue.hold``)."""
        self.queue.hold()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.queue.release()

        return release

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane."""
        self.queue.promote(job)

    def stats(self) -> ExecutorStats:
        """The ``workers`` and ``jobs`` parts of ``CompilePool.stats()``, and the recent jobs'
        durations."""
        return self.counters.snapshot(self.size, self.runners.live(), self.busy, self._awake, len(self.queue))

    def wakeup(self) -> None:
        """Start the runners (if they are not running); ``wait_ready()`` waits for them."""
        if not self._awake and not self._closed:
            self._awake = True
            if self._ready is self._epoch_ready:
                self._ready = [anyio.Event() for _ in range(self.size)]
            # Woken, the executor is not idle: the idle timer counts from now (it counted from
            # the last job, and quiesced a pool as it woke).
            self.last_activity = time.monotonic()
            self._wake.set()

    def quiesce(self) -> None:
        """Stop every runner now; running jobs go back to the front of the queue. Returns at
        once: the runners are stopped by their slots."""
        if self._awake:
            self._awake = False
            if self._epoch_scope is not None:
                self._epoch_scope.cancel()

    async def wait_ready(self) -> None:
        """Wake up and wait until every slot has a runner ready (or the epoch ended).

        Raises the error that stopped the executor when no runner can start, and
        ``PoolClosedError`` once it has shut down.
        """
        self.wakeup()
        for event in list(self._ready):
            await event.wait()
            if self._start_error is not None:
                raise self._start_error
            if self._closed:
                raise PoolClosedError("the pool shut down before its workers were ready")

    # -- for the runners ---------------------------------------------------------------------

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the executor's task group: a runner's background work, which
        ends with the executor. Raises ``RuntimeError`` when the executor does not serve."""
        if self._tg is None:
            raise RuntimeError("the executor does not serve: start work only from its runners")
        self._tg.start_soon(fn, *args)

    def job_started(self, job: Job, pid: int, stopper: Callable[[], None] | None) -> None:
        """``job`` runs now, in the process ``pid``; ``stopper`` stops it there (``cancel()``)."""
        job.state = "running"
        job.worker_pid = pid
        job.started_at = time.perf_counter()
        job.paused = 0.0  # a retried job starts its count again
        job.stopper = stopper
        self.busy += 1
        self.last_activity = time.monotonic()

    def job_ended(self, job: Job, seconds: float | None = None) -> None:
        """``job`` no longer runs (answered, lost or put back). ``seconds``: its own time, where
        its runner knows better than the clock (waits that were not its work); by default,
        since it started."""
        job.stopper = None
        job.ended_at = time.perf_counter()
        job.seconds = job.ended_at - job.started_at if seconds is None else seconds
        self.busy -= 1
        self.last_activity = time.monotonic()

    def reply(self, job: Job, result: Any = None, error: BaseException | None = None) -> None:
        """``job``'s runner answered: its result, or its own error (a compile error); its time
        is recorded."""
        self.counters.record_job(job.name, job.seconds)
        if error is None:
            self.counters.jobs_done += 1
            job.finish(result=result)
        else:
            self.counters.jobs_failed += 1
            job.finish(error=error)

    def fail(self, job: Job, error: BaseException) -> None:
        """``job`` fails without an answer of its own (its runner crashed under it twice, ran
        past its time, broke its stream): with ``error``, or cancelled if nobody waits for it
        any more."""
        if job.abandoned:
            job.finish(error=JobCancelled(job.name))  # counted by cancel()
            return
        self.counters.jobs_failed += 1
        job.finish(error=error)

    def put_back(self, job: Job) -> None:
        """A running job whose runner stopped before it finished: back to the front of the
        queue, to run again on another runner; or, if nobody waits for it any more, cancelled."""
        if job.state != "running":
            return
        if job.abandoned:
            job.finish(error=JobCancelled(job.name))
        else:
            self.queue.put(job, front=True)

    def retry(self, job: Job, *, spend: bool = True) -> bool:
        """The runner under running ``job`` was lost to something outside the job (killed from
        outside, its template or its node gone): the job goes back to the front of the queue,
        to run on another runner. A job has one such retry (``spend``); a loss that cannot be
        the job's doing (its template died and took its worker, its actor was dead before the
        job reached it) spends none.

        Returns False, and does nothing, when the job's retry is spent already: the caller fails
        it with its own account of the losses (``fail()``). A job nobody waits for any more is
        cancelled instead of retried.
        """
        if spend:
            if job.external_kills:
                return False
            job.external_kills += 1
        if not job.abandoned:
            self.counters.jobs_retried += 1
        self.put_back(job)
        return True

    # -- the slots -----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the slots (in epochs) until cancelled; then stop every runner, fail the jobs left
        in the queue with ``PoolClosedError``, and close the runners."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self.runners.watch)
                if self.idle_timeout is not None:
                    tg.start_soon(self._quiesce_when_idle, self.idle_timeout)
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    await self._epoch()
                    if self.queue and not self._closed:
                        # Work arrived (or was put back) while the epoch ended: start again.
                        self.wakeup()
        finally:
            self._tg = None
            self._closed = True
            self._awake = False
            for event in self._ready:
                event.set()  # wait_ready() raises PoolClosedError
            self.queue.fail_all(PoolClosedError("the pool shut down before this job ran"))
            with anyio.CancelScope(shield=True):
                await self.runners.close()

    async def _epoch(self) -> None:
        ready = self._epoch_ready = self._ready
        try:
            with anyio.CancelScope() as scope:
                self._epoch_scope = scope
                if not self._awake:  # quiesced before it began
                    return
                self._last_ready = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for slot in range(self.size):
                        tg.start_soon(self._slot, slot, ready)
        finally:
            self._epoch_scope = None
            for event in ready:
                event.set()  # nobody waits for an epoch that ended (or the executor's end)

    async def _slot(self, slot: int, ready: list[anyio.Event]) -> None:
        """Keep a runner going in ``slot`` for one epoch, whose ready events are ``ready``: a start
        that ends after its epoch was cancelled (its last step had arrived) must not mark the
        next epoch's slot ready, or wait_ready() returns before that epoch's runner is."""
        failures = 0
        while True:
            try:
                runner = await self.runners.start(slot)
            except NoRoom as exc:
                await self._no_room(slot, exc, ready)
                continue
            except WorkerStartError as exc:
                failures += 1
                await self._start_failed(slot, exc, failures, ready)
                continue
            failures = 0
            self._lasting_failures = 0
            self._start_error = None
            self._last_ready = self.last_activity = time.monotonic()  # idle from now, at most
            ready[slot].set()
            cause = "stopped"  # by quiesce() or shutdown, unless the runner says otherwise
            try:
                cause = await runner.serve()
            finally:
                with anyio.CancelScope(shield=True):
                    await runner.stop(cause)
                self._last_ready = time.monotonic()
                self.counters.restart(cause)

    async def _start_failed(
        self, slot: int, exc: WorkerStartError, failures: int, ready: list[anyio.Event]
    ) -> None:
        """A start failed: try again, with back-off. Give up (fail the queued jobs and new ones)
        only with no runner alive, after starts kept failing for a reason that will not go away
        (a preload that raises, a broken install) or for ``preload_timeout`` seconds."""
        transient = isinstance(exc, TransientStartError)
        if not transient:
            self._lasting_failures += 1
        self.counters.restart("start_failed")
        # Kills from outside may stop: queued jobs wait for them to (their callers' deadlines
        # bound the wait), up to preload_timeout without a ready runner, with the back-off below
        # keeping the retries cheap. Runners still starting do not reset that count (two slots
        # whose starts fail in turn would always see the other's), but one may still succeed:
        # the executor gives up only at a failure with none alive at all.
        lasting = self._lasting_failures >= _LASTING_FAILURES
        too_long = transient and time.monotonic() - self._last_ready >= self.preload_timeout
        if not self.runners.live() and (lasting or too_long):
            error: WorkerStartError
            if not transient:
                error = exc
            elif lasting:
                error = WorkerStartError(str(exc))  # the public class: a transient one is internal
            else:
                error = WorkerStartError(
                    f"no worker started within preload_timeout={self.preload_timeout:g} s: every start "
                    f"was ended from outside (a process killed, a node lost), the last: {exc}"
                )
            if self._start_error is None:
                logger.error("workers cannot start: %s", error)
            self._start_error = error
            # Nothing can run until a runner starts: fail what waits instead of hanging it, and
            # wake wait_ready() (which waits for every slot in turn: another one may still be
            # starting a runner that will fail too).
            self.queue.fail_all(error)
            for event in ready:
                event.set()
        else:
            reason = str(exc).splitlines()[0]
            logger.warning("worker %d failed to start (%s); starting it again", slot, reason)
        if transient and failures == 1:
            await anyio.lowlevel.checkpoint()  # a kill from outside: back to full size at once
        else:
            base = 0.05 if transient else 0.25
            await anyio.sleep(min(base * 2 ** (failures - 1), 2.0 if transient else 10.0))

    async def _no_room(self, slot: int, exc: NoRoom, ready: list[anyio.Event]) -> None:
        """No runner can start anywhere now: the slot counts as ready and looks again later; with
        no runner alive and a reason none ever can, the queued jobs fail with it."""
        if exc.error is not None and not self.runners.live():
            if self._start_error is None:
                logger.error("workers cannot start: %s", exc.error)
            self._start_error = exc.error
            self.queue.fail_all(exc.error)
        ready[slot].set()
        await anyio.sleep(exc.retry_after)

    async def _quiesce_when_idle(self, after: float) -> None:
        """Quiesce after ``after`` seconds without work (``idle_timeout``): a timer on the loop
        that sleeps until then, and looks again."""
        while True:
            idle_for = time.monotonic() - self.last_activity
            if idle_for < after or not self._awake:
                await anyio.sleep(after - idle_for if self._awake else after)
                continue
            # Not while a slot of this epoch is still starting its runner: wait_ready() waits for
            # it, and a start may take longer than the timeout (a fresh interpreter's preload).
            if self.busy == 0 and not self.queue and all(event.is_set() for event in self._ready):
                logger.debug("no work for %.1f s: quiescing", idle_for)
                self.quiesce()
            self.last_activity = time.monotonic()
