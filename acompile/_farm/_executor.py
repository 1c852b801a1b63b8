"""``FarmExecutor``: the executor that runs a pool's jobs on a Ray cluster (the driver's side).

It keeps the local executor's rules (``acompile._workers._executor``) with Ray actors in place of
worker processes. ``size`` slots each own one ``FarmWorker`` actor at a time, placed on a node by
the farm itself (hard node affinity, spread by each node's capacity), and take jobs from the
same two-lane queue the local pool uses, so lanes, promotion and longest-first ordering are the
same. A slot sends its actor one job at a time and awaits the Ray object reference on the pool's
own event loop.

- Cancellation: a job nobody waits for is cancelled with ``ray.cancel``; the actor's local pool
  stops the worker that runs it (and its compilers). If the actor has not let go of it within
  ``_CANCEL_GRACE`` seconds, the actor is killed and replaced.
- Crash containment: an actor (or its node) that dies mid-job costs that job one retry, on
  another actor, ahead of everything queued; a second loss fails it with
  ``WorkerCrashedError``. The slot starts a replacement actor, so the farm returns to size.
  Idle actors are watched too (a call pending on each fails when it dies) and replaced at once;
  a job sent to an actor that was dead already never ran, and that loss is not its retry.
- Toolchain: each actor reports what enters the cache key on its node (acompile's version,
  Triton's toolchain). A node that differs from this process is refused: its actor is stopped,
  the node is named in a warning and in ``RayFarm.stats()["refused"]``, and no actor is placed
  there again. When every node is refused, ``FarmToolchainError`` fails the queued jobs and
  ``wait_ready()``.
- Connecting (``connect()``) is bounded by the farm's ``connect_timeout``: the address is resolved
  and its port probed before ``ray.init``, whose own retries would otherwise last minutes. The
  farm's own calls to the cluster's head are bounded, in daemon threads: with the head gone,
  neither leaving the pool nor this process's exit waits for it.

Ray is imported by this module; ``acompile`` imports it only when a pool with a farm is entered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from acompile._errors import (
    CompileError,
    FarmToolchainError,
    FarmUnreachableError,
    PoolClosedError,
    WorkerCrashedError,
    WorkerStartError,
)
from acompile._farm._actor import FarmWorker, node_toolchain
from acompile._workers import Job, JobCancelled, run_job
from acompile._workers._executor import ExecutorStats
from acompile._workers._pool import PoolStats
from acompile._workers._process import short_backend
from acompile._workers._queue import JobQueue, Taker

if TYPE_CHECKING:
    from acompile._farm._farm import FarmStats, NodeStats, RayFarm

logger = logging.getLogger("acompile")
T = TypeVar("T")

# How long a cancelled job may keep its actor before the actor is killed and replaced. The
# actor's local pool stops the worker in milliseconds; more means the actor is not answering.
_CANCEL_GRACE = 0.8
# How long an actor may take to stop its local pool when the farm releases it.
_STOP_GRACE = 2.0
# How often a slot with no node to go to looks again (nodes join, or a refused one's share frees).
_ROOM_POLL = 2.0
# Calls to the cluster's head that the farm makes on its own (listing nodes, killing an actor,
# disconnecting) give up after this long: with the head gone, Ray's wait for it to come back.
_CALL_LIMIT = 3.0
# How long the cluster's port is retried before the farm is declared unreachable.
_PROBE_SECONDS = 3.0
# Starts that fail this many times in a row with no actor alive fail the queued jobs.
_HARD_START_FAILURES = 2
# How many times a job may be put back because its actor was dead before the job reached it.
_SPARES = 3
# How long after a worker's death the cluster's head records it (same host: tens of ms), with
# the clocks' skew: a death recorded within this of a job's sending may have come first.
_DEATH_NOTICE = 0.5
# Ray's errors that mean "the actor, its process or its node is gone": the job is retried.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.OwnerDiedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
)


@dataclass
class _Node:
    """A node as the farm sees it: where it is, how many actors it can take, what they did."""

    node_id: str
    address: str
    capacity: int
    actors: int = 0
    busy: int = 0
    counts: Counter[str] = field(default_factory=Counter)


class FarmExecutor:
    """Runs jobs on a Ray cluster; implements ``acompile._workers.Executor``.

    Built by ``connect()`` (which also connects this process to the cluster); ``serve()`` runs in
    the pool's task group and, on the way out, stops every actor and disconnects from the
    cluster if it connected.
    """

    def __init__(
        self,
        farm: RayFarm,
        actor_config: dict[str, Any],
        toolchain: dict[str, Any],
        nodes: list[_Node],
        *,
        owns_connection: bool,
        preload_timeout: float,
        idle_timeout: float | None,
    ) -> None:
        self.farm = farm
        self.actor_config = actor_config
        self.toolchain = toolchain
        self.nodes = {node.node_id: node for node in nodes}
        capacity = sum(node.capacity for node in nodes)
        self.size = farm.workers or max(1, capacity)
        self.owns_connection = owns_connection
        self.preload_timeout = preload_timeout
        self.idle_timeout = idle_timeout
        self.queue = JobQueue()
        self.counters = PoolStats()
        self.refused: dict[str, str] = {}
        self._spared: weakref.WeakKeyDictionary[Job, int] = weakref.WeakKeyDictionary()
        self.alive: dict[int, _Node] = {}  # by slot
        self.busy = 0
        self.last_activity = time.monotonic()
        options: dict[str, Any] = {"num_cpus": farm.num_cpus, "max_restarts": 0}
        if farm.resources:
            options["resources"] = farm.resources
        if farm.runtime_env is not None:
            # On the actors, not the connection: it holds when the process was connected already.
            options["runtime_env"] = farm.runtime_env
        self._actor_class: Any = ray.remote(**options)(FarmWorker)
        self._ready = [anyio.Event() for _ in range(self.size)]
        self._start_error: WorkerStartError | FarmToolchainError | None = None
        self._hard_start_failures = 0
        self._closed = False
        self._awake = False
        self._wake = anyio.Event()
        self._epoch_scope: anyio.CancelScope | None = None

    # -- the caller's side -------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job`` (waking the farm if quiesced); raises ``PoolClosedError`` after
        shutdown, and the error that stopped the farm when no actor can run it."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._start_error is not None and not self.alive:
            raise self._start_error
        self.queue.put(job)
        self.wakeup()

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result, or raise its error; cancelled, the job is
        dropped or stopped where it runs."""
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job``: drop it if queued; if running, its slot cancels it on its
        actor."""
        job.abandon()

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane."""
        self.queue.promote(job)

    def wakeup(self) -> None:
        """Start the actors (if they are not running)."""
        if not self._awake and not self._closed:
            self._awake = True
            self._ready = [anyio.Event() for _ in range(self.size)]
            self._wake.set()

    def quiesce(self) -> None:
        """Release every actor (their CPUs go back to the cluster); running jobs go back to
        the front of the queue. New work or ``wakeup()`` places actors again."""
        if self._awake:
            self._awake = False
            if self._epoch_scope is not None:
                self._epoch_scope.cancel()

    async def wait_ready(self) -> None:
        """Wake up and wait until every slot has a preloaded actor; raises the error that
        stops the farm (``FarmToolchainError``, ``WorkerStartError``) if none can run."""
        self.wakeup()
        for event in list(self._ready):
            await event.wait()
            if self._start_error is not None and not self.alive:
                raise self._start_error

    def stats(self) -> ExecutorStats:
        """``CompilePool.stats()``'s ``workers`` (actors) and ``jobs``; resident memory is not
        measured on remote nodes."""
        return self.counters.snapshot(self.size, len(self.alive), self.busy, self._awake, len(self.queue))

    def farm_stats(self) -> FarmStats:
        """What ``RayFarm.stats()`` returns while (and after) this executor serves."""
        nodes: dict[str, NodeStats] = {}
        for node in self.nodes.values():
            if node.actors or sum(node.counts.values()):
                nodes[node.node_id] = {
                    "address": node.address,
                    "workers": node.actors,
                    "busy": node.busy,
                    "done": node.counts["done"],
                    "failed": node.counts["failed"],
                    "cancelled": node.counts["cancelled"],
                    "lost": node.counts["lost"],
                }
        return {
            "address": self.farm.address,
            "connected": not self._closed,
            "size": self.size,
            "nodes": nodes,
            "refused": dict(self.refused),
            "restarts": dict(self.counters.restarts),
            "queued": len(self.queue),
        }

    # -- the slots -----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the slots (in epochs, as the local pool does) until cancelled; then stop every
        actor, fail the jobs left queued, and disconnect from the cluster if we connected."""
        try:
            async with anyio.create_task_group() as tg:
                if self.idle_timeout is not None:
                    tg.start_soon(self._quiesce_when_idle, self.idle_timeout)
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    await self._epoch()
                    if self.queue and not self._closed:
                        self.wakeup()
        finally:
            self._closed = True
            self._awake = False
            self.queue.fail_all(PoolClosedError("the pool shut down before this job ran"))
            if self.owns_connection:
                # Bounded: without the cluster's head, ray.shutdown waits for it.
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CALL_LIMIT):
                    await _off_loop(ray.shutdown)

    async def _epoch(self) -> None:
        ready = self._ready
        with anyio.CancelScope() as scope:
            self._epoch_scope = scope
            if self._awake:
                async with anyio.create_task_group() as tg:
                    for slot in range(self.size):
                        tg.start_soon(self._slot, slot)
        self._epoch_scope = None
        for event in ready:
            event.set()

    async def _slot(self, slot: int) -> None:
        failures = 0
        while True:
            node = await self._place()
            if node is None:
                if not self._accepted():
                    self._no_node(slot)
                    return
                # Every accepted node is full (a node refused or lost took its share): the farm
                # runs smaller until a node has room again.
                self._ready[slot].set()
                await anyio.sleep(_ROOM_POLL)
                continue
            actor = self._actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ).remote(self.actor_config)
            node.actors += 1
            cause = "stopped"  # by quiesce() or shutdown, unless said otherwise below
            try:
                try:
                    with anyio.fail_after(self.preload_timeout):
                        hello = await actor.start.remote()
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    failures += 1
                    cause = "start_failed"
                    await self._start_failed(slot, node, exc, failures)
                    continue
                mismatch = _differences(self.toolchain, hello["toolchain"])
                if mismatch:
                    cause = "refused"
                    self._refuse(node, hello, mismatch)
                    continue
                failures = 0
                self._hard_start_failures = 0
                self.counters.started += 1
                self.alive[slot] = node
                self._ready[slot].set()
                cause = await self._serve(actor, node, hello["pid"])
            finally:
                self.alive.pop(slot, None)
                node.actors -= 1
                self.counters.restart(cause)
                with anyio.CancelScope(shield=True):
                    await _stop_actor(actor, graceful=cause in ("stopped", "refused"))

    def _accepted(self) -> list[_Node]:
        """The live nodes that are not refused."""
        return [n for n in self.nodes.values() if n.node_id not in self.refused and n.capacity > 0]

    async def _place(self) -> _Node | None:
        """The node for a new actor: the accepted node with the most room (its capacity as Ray
        reports it, less our actors there); None when none has room."""
        await self._refresh_nodes()
        candidates = [n for n in self._accepted() if n.actors < n.capacity]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (n.actors / n.capacity, n.actors))

    async def _refresh_nodes(self) -> None:
        """Nodes that joined or left since the last look (a replacement goes to a live node)."""
        try:
            # Bounded: with the cluster's head unreachable, Ray's calls wait for it.
            with anyio.fail_after(_CALL_LIMIT):
                nodes = await _off_loop(_alive_nodes, self.farm)
        except (Exception, TimeoutError) as exc:
            logger.debug("cannot list the farm's nodes (%s); keeping the last list", exc)
            return
        alive = {n.node_id for n in nodes}
        for node in nodes:
            known = self.nodes.get(node.node_id)
            if known is None:
                self.nodes[node.node_id] = node
            else:
                known.capacity = node.capacity
        for node_id, node in self.nodes.items():
            if node_id not in alive:
                node.capacity = 0

    def _refuse(self, node: _Node, hello: dict[str, Any], mismatch: str) -> None:
        reason = (
            f"node {node.address} ({hello['host']}, id {node.node_id[:12]}) has another toolchain than this "
            f"process ({mismatch}); its results would not match their cache keys, so it is not used"
        )
        if node.node_id not in self.refused:
            self.refused[node.node_id] = reason
            logger.warning("%s", reason)

    def _no_node(self, slot: int) -> None:
        """No node may run this slot's actor (all refused, or none offers what a worker needs):
        with no actor alive anywhere, the farm cannot compile at all, and says why."""
        if not self.alive:
            if self.refused:
                self._start_error = FarmToolchainError(
                    "no node of the farm compiles with this process's toolchain: "
                    + "; ".join(self.refused.values())
                )
            else:
                wanted = {"CPU": self.farm.num_cpus, **self.farm.resources}
                self._start_error = WorkerStartError(
                    f"no node of the Ray cluster at {self.farm.address!r} offers what a farm worker "
                    f"needs ({wanted})"
                )
            self.queue.fail_all(self._start_error)
        self._ready[slot].set()

    async def _start_failed(self, slot: int, node: _Node, exc: BaseException, failures: int) -> None:
        self._hard_start_failures += 1
        reason = f"a farm worker on {node.address} failed to start: {type(exc).__name__}: {exc}"
        if self._hard_start_failures >= _HARD_START_FAILURES and not self.alive:
            if self._start_error is None:
                logger.error("%s", reason)
            self._start_error = WorkerStartError(reason)
            self.queue.fail_all(self._start_error)
            self._ready[slot].set()
        else:
            logger.warning("%s; starting another", reason.splitlines()[0])
        await anyio.sleep(min(0.25 * 2 ** (failures - 1), 10.0))

    async def _serve(self, actor: Any, node: _Node, pid: int) -> str:
        """Run jobs on one actor until it must be replaced; returns why.

        The actor is watched meanwhile, idle or not (as the local pool watches its idle
        workers): one that dies waiting for work is replaced at once, so the next request does
        not find it dead.
        """
        taker = Taker(lambda job: True)
        watch = _Watch(actor)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run, lambda: self.queue.withdraw(taker))
            try:
                cause = await self._serve_jobs(actor, node, pid, taker, watch)
            finally:
                tg.cancel_scope.cancel()
        return cause

    async def _serve_jobs(self, actor: Any, node: _Node, pid: int, taker: Taker, watch: _Watch) -> str:
        while True:
            try:
                job = await self.queue.get(taker)
            except BaseException:
                if taker.job is not None:  # handed to us as we were leaving: pass it on
                    self.queue.put(taker.job, front=True)
                raise
            if watch.dead_since is not None:
                if job is not None and job.state != "done":
                    self.queue.put(job, front=True)  # it never ran here: its retry is not spent
                logger.warning("the farm worker on %s died while idle; replacing it", node.address)
                return "killed"
            if job is None or job.state == "done":
                continue  # cancelled between being handed to us and now
            cause = await self._run(actor, node, pid, job, watch)
            if cause is not None:
                return cause

    async def _run(self, actor: Any, node: _Node, pid: int, job: Job, watch: _Watch) -> str | None:
        """Run one job on ``actor``; returns None to keep the actor, or why it is replaced."""
        job.state = "running"
        job.worker_pid = pid
        job.started_at = time.perf_counter()
        sent_at, sent_wall = time.monotonic(), time.time()
        try:
            ref = actor.run.remote(job.backend, job.payload, job.name)
        except Exception as exc:
            # Something in the request does not serialize: that request fails, nothing else.
            self.counters.jobs_failed += 1
            job.finish(error=_remote_failure(job, exc, "cannot send"))
            return None
        self.busy += 1
        node.busy += 1
        self.last_activity = time.monotonic()
        reply: tuple[str, Any] | None = None
        lost: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                job.stopper = scope.cancel
                if job.abandoned:
                    scope.cancel()
                try:
                    reply = await ref
                except _LOST as exc:
                    lost = exc
                except ray.exceptions.RayError as exc:
                    reply = ("error", _remote_failure(job, exc, "failed to run"))
        except BaseException:
            # The epoch ended (quiesce) or the pool is shutting down: the actor is stopped by
            # the slot; the job goes back to the front of the queue.
            ray.cancel(ref)
            if job.state == "running":
                self.queue.put(job, front=True)
            raise
        finally:
            self.busy -= 1
            node.busy -= 1
            job.stopper = None
            job.ended_at = time.perf_counter()
            job.seconds = job.ended_at - job.started_at
            self.last_activity = time.monotonic()
        if job.abandoned and reply is None and lost is None:
            return await self._cancel(ref, node, job)
        if lost is not None:
            if await self._dead_before(actor, watch, sent_at, sent_wall) and self._spare(job):
                # The actor was gone before the job reached it (or may have been): the job never
                # ran, and its one retry is for a worker that dies running it.
                logger.warning(
                    "the farm worker on %s died before or as %s reached it; sending it again",
                    node.address,
                    job.name,
                )
                node.counts["lost"] += 1
                self.counters.jobs_retried += 1
                self.queue.put(job, front=True)
                return "killed"
            return self._lost(node, job, lost)
        assert reply is not None
        status, value = reply
        self.counters.record_job(job.name, job.seconds)
        if status == "done":
            self.counters.jobs_done += 1
            node.counts["done"] += 1
            job.finish(result=value)
        else:
            self.counters.jobs_failed += 1
            node.counts["failed"] += 1
            job.finish(error=value)
        return None

    async def _cancel(self, ref: Any, node: _Node, job: Job) -> str | None:
        """Every waiter left while the job ran: cancel it on its actor, whose local pool stops
        the worker (and its compilers). An actor that does not let go in time is replaced."""
        ray.cancel(ref)
        job.finish(error=JobCancelled(job.name))
        self.counters.jobs_cancelled += 1
        node.counts["cancelled"] += 1
        with anyio.move_on_after(_CANCEL_GRACE) as grace:
            try:
                await ref
            except Exception:
                pass  # TaskCancelledError: what we asked for
        if grace.cancelled_caught:
            logger.warning("the farm worker on %s kept running %s; replacing it", node.address, job.name)
            return "abandoned"
        return None

    async def _dead_before(self, actor: Any, watch: _Watch, sent_at: float, sent_wall: float) -> bool:
        """Whether ``actor`` was (or may have been) dead before a job was sent to it: its watch
        had noticed, or the cluster's head recorded its death less than ``_DEATH_NOTICE`` after
        the job was sent (the head learns of a death that long after it, so it cannot tell
        "just before" from "just after"; both are given the benefit of the doubt)."""
        if watch.dead_since is not None and watch.dead_since <= sent_at:
            return True
        try:
            with anyio.fail_after(_CALL_LIMIT):
                ended = await _off_loop(_actor_end_time, actor)
        except (Exception, TimeoutError) as exc:
            logger.debug("cannot ask when a farm worker died (%s)", exc)
            return False
        return ended is not None and ended < sent_wall + _DEATH_NOTICE

    def _spare(self, job: Job) -> bool:
        """Whether a job lost with an actor that was already dead may go back to the queue
        without counting against its retry (a few times: never a loop)."""
        spared = self._spared.get(job, 0)
        if spared >= _SPARES:
            return False
        self._spared[job] = spared + 1
        return True

    def _lost(self, node: _Node, job: Job, exc: BaseException) -> str:
        """The actor (or its node) died while it ran ``job``: once more elsewhere, else fail."""
        node.counts["lost"] += 1
        summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if job.external_kills == 0:
            job.external_kills += 1
            self.counters.jobs_retried += 1
            logger.warning("the farm worker on %s died compiling %s; retrying it", node.address, job.name)
            self.queue.put(job, front=True)
        else:
            self.counters.jobs_failed += 1
            job.finish(
                error=WorkerCrashedError(
                    f"the farm worker compiling {job.name!r} died twice (on {node.address}: {summary})",
                    exit_code=None,
                    cause="killed",
                    kernel=job.name,
                    backend=short_backend(job.backend),
                    log=str(exc),
                )
            )
        return "killed"

    async def _quiesce_when_idle(self, after: float) -> None:
        """Release the actors after ``after`` seconds without work (``idle_timeout``)."""
        while True:
            idle_for = time.monotonic() - self.last_activity
            if idle_for < after or not self._awake:
                await anyio.sleep(after - idle_for if self._awake else after)
                continue
            if self.busy == 0 and not self.queue:
                self.quiesce()
            self.last_activity = time.monotonic()


class _Watch:
    """Notices an actor's death whenever it happens, with a call that returns only then."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.dead_since: float | None = None  # time.monotonic() when noticed

    async def run(self, on_death: Callable[[], None]) -> None:
        try:
            await self.actor.watch.remote()
        except _LOST:
            pass
        except ray.exceptions.RayError as exc:
            logger.debug("watching a farm worker: %s", exc)
            return  # not a death; the job's own call will tell
        self.dead_since = time.monotonic()
        on_death()


def _actor_end_time(actor: Any) -> float | None:
    """Blocking: when the cluster's head marked ``actor`` dead (Unix time), None if alive."""
    from ray._private import state

    # A handle's id is not public; the actor table is the head's own record of its death.
    info = state.actors(actor_id=actor._actor_id.hex())
    ended = info.get("EndTime") if info else None
    return ended / 1000 if ended else None


async def _stop_actor(actor: Any, *, graceful: bool) -> None:
    """Stop an actor: let it stop its local pool (so its template, worker and compilers are
    gone when this returns), then kill it. A dead or unresponsive actor is just killed."""
    if graceful:
        with anyio.move_on_after(_STOP_GRACE):
            try:
                await actor.stop.remote()
            except ray.exceptions.RayError:
                pass
    try:
        # In a thread, bounded: it is a call to the cluster's head, which may not answer.
        with anyio.move_on_after(_CALL_LIMIT):
            await _off_loop(ray.kill, actor)
    except Exception as exc:  # already gone, or the connection is
        logger.debug("killing a farm worker: %s", exc)


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread of its own, awaited; cancelling the wait abandons it.

    For Ray's blocking calls, which wait for the cluster's head as long as it takes: an abandoned
    call in one of anyio's worker threads would hold up this process's exit (Python joins those
    threads), a daemon thread does not.

    The outcome is handed over on the loop's own thread, where the future may have been
    cancelled meanwhile (the awaiter left): then it is dropped. Setting it from this thread
    would race that cancellation and raise ``InvalidStateError`` in the thread. A loop that is
    closed by then (the process is leaving) gets nothing.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # abandoned by its awaiter
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def call() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    threading.Thread(target=call, name="acompile-farm", daemon=True).start()
    return await future


def _differences(here: dict[str, Any], there: dict[str, Any], prefix: str = "") -> str:
    """What differs between two toolchain descriptions, as "name: here vs there" (empty if
    nothing does)."""
    out = []
    for name in sorted(here.keys() | there.keys()):
        a, b = here.get(name), there.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _differences(a, b, f"{prefix}{name}.")
            if inner:
                out.append(inner)
        elif a != b:
            out.append(f"{prefix}{name}: {a!r} here, {b!r} there")
    return "; ".join(out)


def _remote_failure(job: Job, exc: BaseException, what: str) -> CompileError:
    """A failure of the farm's own code or of Ray's (not the compiler's): a ``CompileError``
    naming the kernel, with Ray's account of it."""
    return CompileError(
        f"the farm {what} {job.name!r}: {type(exc).__name__}: {str(exc).strip()[:2000]}",
        kernel=job.name,
        backend=short_backend(job.backend),
        log=str(exc),
    )


# --- connecting -------------------------------------------------------------------------------


async def connect(
    farm: RayFarm,
    *,
    target: str,
    backends: list[str],
    preload: list[str],
    nice: int | str,
    memory_limit: int | None,
    max_compile_seconds: float | None,
    preload_timeout: float,
    idle_timeout: float | None,
    memo_dir: Path,
) -> FarmExecutor:
    """Connect this process to the farm's cluster (at most ``farm.connect_timeout`` seconds) and
    build its executor. Raises ``FarmUnreachableError`` naming the address."""
    deadline = time.monotonic() + farm.connect_timeout
    try:
        with anyio.fail_after(farm.connect_timeout):
            # Abandoned on timeout: ray.init cannot be interrupted.
            owns, nodes = await _off_loop(_connect, farm, deadline)
    except TimeoutError:
        raise FarmUnreachableError(
            f"the Ray cluster at {farm.address!r} did not accept a connection within "
            f"{farm.connect_timeout:g} s"
        ) from None
    toolchain = await anyio.to_thread.run_sync(node_toolchain, memo_dir)
    config = {
        "target": target,
        "backends": backends,
        "preload": preload,
        "nice": nice,
        "memory_limit": memory_limit,
        "max_compile_seconds": max_compile_seconds,
        "preload_timeout": preload_timeout,
    }
    executor = FarmExecutor(
        farm,
        config,
        toolchain,
        nodes,
        owns_connection=owns,
        preload_timeout=preload_timeout,
        idle_timeout=idle_timeout,
    )
    farm.executor = executor
    return executor


def _connect(farm: RayFarm, deadline: float) -> tuple[bool, list[_Node]]:
    """Blocking: resolve and probe the address, then ``ray.init`` (unless this process is
    connected already). Returns (whether we connected, the live nodes)."""
    owns = False
    if not ray.is_initialized():
        address = farm.address
        if address != "local":
            _probe(address, deadline)
        # From a thread on purpose: on the main thread, ray.init replaces the process's SIGTERM
        # handler with one that exits, which is not a library's call to make in a server. Ray
        # warns that it did not; that warning is ours to drop.
        ray_logger = logging.getLogger("ray._private.worker")
        ray_logger.addFilter(_no_sigterm_warning)
        try:
            ray.init(
                address=None if address == "local" else address,
                namespace="acompile",
                logging_level=logging.WARNING,
                log_to_driver=False,
                include_dashboard=False if address == "local" else None,
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise FarmUnreachableError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from exc
        finally:
            ray_logger.removeFilter(_no_sigterm_warning)
        owns = True
    try:
        nodes = _alive_nodes(farm)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    return owns, nodes


def _no_sigterm_warning(record: logging.LogRecord) -> bool:
    return "SIGTERM handler is not set" not in record.getMessage()


def _probe(address: str, deadline: float) -> None:
    """Check that something listens at the cluster's address before Ray tries (and retries for
    minutes). Raises ``FarmUnreachableError``."""
    from ray._private import services

    if address.startswith("ray://"):
        hostport: str | None = address[len("ray://") :]
    else:
        try:
            hostport = services.canonicalize_bootstrap_address(address)
        except (ConnectionError, ValueError) as exc:
            raise FarmUnreachableError(f"no Ray cluster at {address!r}: {exc}") from exc
    if hostport is None:
        raise FarmUnreachableError(f"no Ray cluster found for address {address!r}")
    host, _, port = hostport.rpartition(":")
    error: OSError | None = None
    # A few seconds of retries (a head node restarting); ray.init needs the rest of the time.
    give_up = time.monotonic() + min(_PROBE_SECONDS, (deadline - time.monotonic()) / 2)
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                return
        except OSError as exc:
            error = exc
        if time.monotonic() + 0.5 >= give_up:
            break
        time.sleep(0.5)
    raise FarmUnreachableError(f"the Ray cluster at {address!r} ({hostport}) does not answer: {error}")


def _alive_nodes(farm: RayFarm) -> list[_Node]:
    """The cluster's live nodes, each with how many of the farm's actors its resources hold."""
    nodes = []
    list_nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
    for info in list_nodes():
        if not info.get("Alive"):
            continue
        resources = info.get("Resources", {})
        wanted = {"CPU": farm.num_cpus, **farm.resources}
        capacity = min(
            (int(resources.get(name, 0) // amount) for name, amount in wanted.items() if amount > 0),
            default=1,
        )
        nodes.append(_Node(info["NodeID"], str(info.get("NodeManagerAddress", "?")), capacity))
    return nodes
