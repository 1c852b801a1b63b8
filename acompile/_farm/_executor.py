"""``FarmExecutor``: the executor that runs a pool's jobs on a Ray cluster (the driver's side).

It is the skeleton every executor shares (``acompile._workers.SlotExecutor``: the slots and their
epochs, the two-lane queue, the start-failure policy, the retry of a job whose worker was lost,
the idle timer) over Ray actors in place of worker processes (``_Actors``). Each slot owns one
``FarmWorker`` actor at a time, placed on a node by the farm itself (hard node affinity, spread
by each node's capacity); it sends its actor one job at a time and awaits the Ray object
reference on the pool's own event loop.

- Starting: an actor that dies while it starts or preloads (its process killed, its node lost)
  is a failure from outside: another actor is started at once, on any node with room, and the
  queued jobs wait for it. A start that fails for a lasting reason (the actor's preload raises,
  runs past ``preload_timeout``, Ray cannot create it) backs off. The farm gives up only while no
  actor is alive, after two lasting failures in a row or ``preload_timeout`` seconds in which no
  actor started: the queued jobs and new ones then fail with a ``WorkerStartError`` that names
  the last cause, until an actor starts again.
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

Ray is imported by this module, which runs only in the farm's connection process
(``_broker``): the pool's own process never imports Ray (``_remote`` talks to that process).
"""

from __future__ import annotations

import asyncio
import functools
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
    PoolError,
    WorkerCrashedError,
    WorkerStartError,
)
from acompile._farm._actor import FarmWorker, node_toolchain
from acompile._workers import (
    Job,
    JobCancelled,
    NoRoom,
    SlotExecutor,
    Taker,
    TransientStartError,
    short_backend,
)

if TYPE_CHECKING:
    from acompile._farm._farm import FarmStats, NodeStats, RayFarm
    from acompile._workers import WorkerSettings

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
# And those that mean it while an actor starts: its node went before Ray could place it there.
_LOST_AT_START = (*_LOST, ray.exceptions.ActorUnschedulableError)


@dataclass
class _Node:
    """A node as the farm sees it: where it is, how many actors it can take, what they did."""

    node_id: str
    address: str
    capacity: int
    actors: int = 0
    busy: int = 0
    counts: Counter[str] = field(default_factory=Counter)


class FarmExecutor(SlotExecutor["_Actors"]):
    """Runs jobs on a Ray cluster; implements ``acompile._workers.Executor`` (``SlotExecutor``
    over Ray actors).

    Built by ``connect()`` (which also connects this process to the cluster); ``serve()`` runs in
    the pool's task group and, on the way out, stops every actor and disconnects from the
    cluster if it connected.
    """

    def __init__(
        self,
        farm: RayFarm,
        settings: WorkerSettings,
        toolchain: dict[str, Any],
        nodes: list[_Node],
        *,
        owns_connection: bool,
    ) -> None:
        size = farm.workers or max(1, sum(node.capacity for node in nodes))
        actors = functools.partial(
            _Actors,
            farm=farm,
            settings=settings,
            toolchain=toolchain,
            nodes=nodes,
            owns_connection=owns_connection,
        )
        super().__init__(
            size, actors, preload_timeout=settings.preload_timeout, idle_timeout=settings.idle_timeout
        )
        self.farm = farm

    def farm_stats(self) -> FarmStats:
        """What ``RayFarm.stats()`` returns while (and after) this executor serves."""
        nodes: dict[str, NodeStats] = {}
        for node in self.runners.nodes.values():
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
            "connected": not self.closed,
            "size": self.size,
            "nodes": nodes,
            "refused": dict(self.runners.refused),
            "restarts": dict(self.counters.restarts),
            "queued": len(self.queue),
        }


class _Actors:
    """Ray actors on the cluster's nodes for the farm's slots (implements ``Runners``): where
    each goes, its start and its toolchain's check, and the connection's end."""

    def __init__(
        self,
        executor: SlotExecutor[_Actors],
        *,
        farm: RayFarm,
        settings: WorkerSettings,
        toolchain: dict[str, Any],
        nodes: list[_Node],
        owns_connection: bool,
    ) -> None:
        self.executor = executor
        self.farm = farm
        self.settings = settings
        self.toolchain = toolchain
        self.nodes = {node.node_id: node for node in nodes}
        self.owns_connection = owns_connection
        self.refused: dict[str, str] = {}
        self.alive: dict[int, _Node] = {}  # the ready actors' nodes, by slot
        self._spared: weakref.WeakKeyDictionary[Job, int] = weakref.WeakKeyDictionary()
        options: dict[str, Any] = {"num_cpus": farm.num_cpus, "max_restarts": 0}
        if farm.resources:
            options["resources"] = farm.resources
        if farm.runtime_env is not None:
            # On the actors, not the connection: it holds when the process was connected already.
            options["runtime_env"] = farm.runtime_env
        self._actor_class: Any = ray.remote(**options)(FarmWorker)

    # -- the Runners interface ---------------------------------------------------------------

    def live(self) -> int:
        """The actors ready for jobs (``stats()["workers"]["alive"]``)."""
        return len(self.alive)

    def encode(self, job: Job) -> None:
        """Nothing: Ray serializes a job as it is sent (where that fails, the job fails alone)."""

    async def start(self, slot: int) -> _Actor:
        """Place an actor for ``slot`` on the accepted node with the most room and wait for its
        local pool's preload; a node whose toolchain differs is refused, and the next one
        tried. Raises ``TransientStartError`` (the actor or its node died meanwhile),
        ``WorkerStartError`` (a lasting reason) or ``NoRoom``."""
        while True:
            node = await self._place()
            if node is None:
                # Every accepted node is full (a node refused or lost took its share): the farm
                # runs smaller until a node has room again. Or no node is accepted: nothing can
                # compile, and the error says why.
                raise NoRoom(None if self._accepted() else self._nowhere(), _ROOM_POLL)
            actor = self._actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ).remote(self.settings)
            node.actors += 1
            try:
                with anyio.fail_after(self.executor.preload_timeout):
                    hello = await actor.start.remote()
            except BaseException as exc:
                node.actors -= 1
                with anyio.CancelScope(shield=True):
                    await _stop_actor(actor, graceful=False)
                if isinstance(exc, (ray.exceptions.RayError, TimeoutError)):
                    raise self._start_failure(node, exc) from exc
                raise
            mismatch = _differences(self.toolchain, hello["toolchain"])
            if mismatch:
                node.actors -= 1
                self._refuse(node, hello, mismatch)
                self.executor.counters.restart("refused")
                with anyio.CancelScope(shield=True):
                    await _stop_actor(actor, graceful=True)
                continue
            self.executor.counters.started += 1
            self.alive[slot] = node
            return _Actor(self, slot, actor, node, hello["pid"])

    async def watch(self) -> None:
        """Nothing to watch beside the slots: each actor is watched by its own runner."""

    async def close(self) -> None:
        """Disconnect from the cluster if this executor connected."""
        if self.owns_connection:
            # Bounded: without the cluster's head, ray.shutdown waits for it.
            with anyio.move_on_after(_CALL_LIMIT):
                await _off_loop(ray.shutdown)

    # -- starting actors -----------------------------------------------------------------------

    def _start_failure(self, node: _Node, exc: BaseException) -> WorkerStartError:
        """What a failed start of an actor on ``node`` is: from outside (the actor's process or
        its node died while it started or preloaded), tried again at once, on any node with
        room; or lasting (its start raised, ran past ``preload_timeout``, Ray could not create
        it), which the farm gives up on after two in a row with no actor alive."""
        where = f"a farm worker on {node.address}"
        if isinstance(exc, ray.exceptions.RayTaskError):
            # The actor's start raised (its local pool's preload failed): Ray's error is also an
            # instance of the cause's class, whose message is the one to give.
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            return WorkerStartError(f"{where} failed to start: {type(cause).__name__}: {cause}")
        if isinstance(exc, TimeoutError):
            return WorkerStartError(
                f"{where} did not finish its preload within preload_timeout="
                f"{self.executor.preload_timeout:g} s"
            )
        if isinstance(exc, _LOST_AT_START) and not getattr(exc, "actor_init_failed", False):
            return TransientStartError(f"{where} died as it started: {type(exc).__name__}: {exc}")
        return WorkerStartError(f"{where} failed to start: {type(exc).__name__}: {exc}")

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

    def _nowhere(self) -> PoolError:
        """Why no node may run an actor (all refused, or none offers what a worker needs)."""
        if self.refused:
            return FarmToolchainError(
                "no node of the farm compiles with this process's toolchain: "
                + "; ".join(self.refused.values())
            )
        wanted = {"CPU": self.farm.num_cpus, **self.farm.resources}
        return WorkerStartError(
            f"no node of the Ray cluster at {self.farm.address!r} offers what a farm worker needs ({wanted})"
        )

    def spare(self, job: Job) -> bool:
        """Whether a job lost with an actor that was already dead may go back to the queue
        without counting against its retry (a few times: never a loop)."""
        spared = self._spared.get(job, 0)
        if spared >= _SPARES:
            return False
        self._spared[job] = spared + 1
        return True


class _Actor:
    """One ready actor serving a slot (implements ``Runner``): one job at a time, cancelled on
    the actor when nobody waits for it, retried elsewhere when the actor dies under it."""

    def __init__(self, actors: _Actors, slot: int, actor: Any, node: _Node, pid: int) -> None:
        self.actors = actors
        self.executor = actors.executor
        self.slot = slot
        self.actor = actor
        self.node = node
        self.pid = pid

    async def serve(self) -> str:
        """Run jobs on the actor until it must be replaced; returns why.

        The actor is watched meanwhile, idle or not (as the local pool watches its idle
        workers): one that dies waiting for work is replaced at once, so the next request does
        not find it dead.
        """
        taker = Taker(lambda job: True)
        watch = _Watch(self.actor)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run, lambda: self.executor.queue.withdraw(taker))
            try:
                cause = await self._serve_jobs(taker, watch)
            finally:
                tg.cancel_scope.cancel()
        return cause

    async def stop(self, cause: str) -> None:
        """Stop the actor: gracefully when it is released (its local pool stops its processes
        first), killed when it failed."""
        self.actors.alive.pop(self.slot, None)
        self.node.actors -= 1
        await _stop_actor(self.actor, graceful=cause == "stopped")

    async def _serve_jobs(self, taker: Taker, watch: _Watch) -> str:
        queue = self.executor.queue
        while True:
            try:
                job = await queue.get(taker)
            except BaseException:
                if taker.job is not None:  # handed to us as we were leaving: pass it on
                    queue.put(taker.job, front=True)
                raise
            if watch.dead_since is not None:
                if job is not None and job.state != "done":
                    queue.put(job, front=True)  # it never ran here: its retry is not spent
                logger.warning("the farm worker on %s died while idle; replacing it", self.node.address)
                return "killed"
            if job is None or job.state == "done":
                continue  # cancelled between being handed to us and now
            cause = await self._run(job, watch)
            if cause is not None:
                return cause

    async def _run(self, job: Job, watch: _Watch) -> str | None:
        """Run one job on the actor; returns None to keep the actor, or why it is replaced."""
        executor, node = self.executor, self.node
        sent_at, sent_wall = time.monotonic(), time.time()
        try:
            ref = self.actor.run.remote(job.backend, job.payload, job.name)
        except Exception as exc:
            # Something in the request does not serialize: that request fails, nothing else.
            executor.fail(job, _remote_failure(job, exc, "cannot send"))
            return None
        executor.job_started(job, self.pid, None)
        node.busy += 1
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
            executor.put_back(job)
            raise
        finally:
            node.busy -= 1
            executor.job_ended(job)
        if job.abandoned and reply is None and lost is None:
            return await self._cancel(ref, job)
        if lost is not None:
            if await self._dead_before(watch, sent_at, sent_wall) and self.actors.spare(job):
                # The actor was gone before the job reached it (or may have been): the job never
                # ran, and its one retry is for a worker that dies running it.
                logger.warning(
                    "the farm worker on %s died before or as %s reached it; sending it again",
                    node.address,
                    job.name,
                )
                node.counts["lost"] += 1
                executor.retry(job, spend=False)
                return "killed"
            return self._lost(job, lost)
        assert reply is not None
        status, value = reply
        if status == "done":
            node.counts["done"] += 1
            executor.reply(job, result=value)
        else:
            node.counts["failed"] += 1
            executor.reply(job, error=value)
        return None

    async def _cancel(self, ref: Any, job: Job) -> str | None:
        """Every waiter left while the job ran: cancel it on its actor, whose local pool stops
        the worker (and its compilers). An actor that does not let go in time is replaced."""
        ray.cancel(ref)
        job.finish(error=JobCancelled(job.name))  # counted by the executor's cancel()
        self.node.counts["cancelled"] += 1
        with anyio.move_on_after(_CANCEL_GRACE) as grace:
            try:
                await ref
            except Exception:
                pass  # TaskCancelledError: what we asked for
        if grace.cancelled_caught:
            logger.warning("the farm worker on %s kept running %s; replacing it", self.node.address, job.name)
            return "abandoned"
        return None

    async def _dead_before(self, watch: _Watch, sent_at: float, sent_wall: float) -> bool:
        """Whether the actor was (or may have been) dead before a job was sent to it: its watch
        had noticed, or the cluster's head recorded its death less than ``_DEATH_NOTICE`` after
        the job was sent (the head learns of a death that long after it, so it cannot tell
        "just before" from "just after"; both are given the benefit of the doubt)."""
        if watch.dead_since is not None and watch.dead_since <= sent_at:
            return True
        try:
            with anyio.fail_after(_CALL_LIMIT):
                ended = await _off_loop(_actor_end_time, self.actor)
        except (Exception, TimeoutError) as exc:
            logger.debug("cannot ask when a farm worker died (%s)", exc)
            return False
        return ended is not None and ended < sent_wall + _DEATH_NOTICE

    def _lost(self, job: Job, exc: BaseException) -> str:
        """The actor (or its node) died while it ran ``job``: once more elsewhere, else fail."""
        self.node.counts["lost"] += 1
        if self.executor.retry(job):
            if not job.abandoned:
                logger.warning(
                    "the farm worker on %s died compiling %s; retrying it", self.node.address, job.name
                )
            return "killed"
        summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.executor.fail(
            job,
            WorkerCrashedError(
                f"the farm worker compiling {job.name!r} died twice (on {self.node.address}: {summary})",
                exit_code=None,
                cause="killed",
                kernel=job.name,
                backend=short_backend(job.backend),
                log=str(exc),
            ),
        )
        return "killed"


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


async def connect(farm: RayFarm, settings: WorkerSettings, memo_dir: Path) -> FarmExecutor:
    """Build the farm's executor on this process's connection to its cluster, connecting first
    unless ``_connect`` did (the farm's connection process calls it on its main thread before
    its event loop starts: see ``_broker``); at most ``farm.connect_timeout`` seconds. Each actor
    is started with ``settings``, whole. Raises ``FarmUnreachableError`` naming the address."""
    deadline = time.monotonic() + farm.connect_timeout
    try:
        with anyio.fail_after(farm.connect_timeout):
            # Abandoned on timeout: Ray's calls wait for a head that does not answer.
            owns, nodes = await _off_loop(_connect, farm, deadline)
    except TimeoutError:
        raise FarmUnreachableError(
            f"the Ray cluster at {farm.address!r} did not accept a connection within "
            f"{farm.connect_timeout:g} s"
        ) from None
    toolchain = await anyio.to_thread.run_sync(node_toolchain, memo_dir)
    executor = FarmExecutor(farm, settings, toolchain, nodes, owns_connection=owns)
    farm.executor = executor
    return executor


def _connect(farm: RayFarm, deadline: float, address: str | None = None) -> tuple[bool, list[_Node]]:
    """Blocking: resolve and probe ``address`` (the farm's, by default), then ``ray.init``, unless
    this process is connected already. Returns (whether we connected, the live nodes).

    The connection process (``_broker``) calls it on its main thread: a cluster that ``"local"``
    starts lives only as long as the thread that started it, and Ray ends that thread's process
    when the cluster's head is lost, which is why this is never called in a pool's process.
    """
    owns = False
    if not ray.is_initialized():
        address = address or farm.address
        if address != "local":
            _probe(address, deadline)
        try:
            ray.init(
                # "local" by name: no address at all means the cluster last started on this
                # machine, whoever started it, if one runs.
                address=address,
                namespace="acompile",
                logging_level=logging.WARNING,
                log_to_driver=False,
                include_dashboard=False if address == "local" else None,
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise FarmUnreachableError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from exc
        owns = True
    try:
        nodes = _alive_nodes(farm)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    return owns, nodes


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
