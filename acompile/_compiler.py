"""``CompilePool``: the public front end. Requests, single flight, cache look-ups, stats."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import functools
import logging
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

import anyio
import anyio.abc
import anyio.lowlevel

from acompile import _autotune, _linux, _pacing, _progressive
from acompile._autotune import TunedKernel
from acompile._backends import BACKENDS, backend_of, load_launcher_if_built, load_parent, worker_module
from acompile._cache import (
    DEFAULT_FLEET_WAIT,
    CorruptEntry,
    CostFeatures,
    FleetTiers,
    GuardedDisk,
    MemoryTier,
    SharedCache,
    SharedTier,
    Tier,
    TierChain,
    default_cache_dir,
    shared_cache_argument,
)
from acompile._errors import (
    AcompileError,
    CompiledAfterReadyError,
    CompileError,
    DeviceUnavailableError,
    PoolClosedError,
    PoolError,
)
from acompile._farm import RayFarm
from acompile._manifest import Recorder
from acompile._observe import AfterReady, Listener, RequestDone, Tracer
from acompile._progressive import BackgroundKernel, ProgressiveKernel
from acompile._sizing import default_workers
from acompile._targets import Target, local_target, parse_target
from acompile._torch import Portal
from acompile._workers import (
    BACKGROUND,
    DEFAULT_NICE,
    URGENT,
    Executor,
    ExecutorSpec,
    Job,
    JobCancelled,
    LocalWorkers,
    Opening,
    Split,
    WorkerPool,
    WorkerSettings,
    bytecode_plan,
    executor_spec,
    idle_stats,
    opened,
    remove_work_folder,
)

if TYPE_CHECKING:
    from acompile._backends import (
        CppSpec,
        CudaModule,
        CudaSpec,
        ObjectFile,
        ParentBackend,
        Request,
        SharedLibrary,
        TritonKernel,
        TritonSpec,
    )
    from acompile._cache import Entry
    from acompile._observe import Stats
    from acompile._torch import TorchHost
    from acompile._workers import BackendConfig

    # What a compile returns, by spec: TritonSpec -> TritonKernel, CppSpec -> SharedLibrary,
    # CudaSpec -> CudaModule, SharedLibrary or ObjectFile (by its output).
    Spec = TritonSpec | CudaSpec | CppSpec
    Kernel = TritonKernel | CudaModule | SharedLibrary | ObjectFile

logger = logging.getLogger("acompile")


# How long a gather holds its jobs back at most, for the rest of them to arrive (each request's
# cache look-ups come first; 68 requests arrive within 10-30 ms).
_BATCH_WAIT = 0.05
# How long prestarted workers wait, after the pool's entry, for the requests made with it: a
# warm start's cache hits finish first (2 cores: 68 hits in 50 ms, 5-30 ms slower with the
# workers starting alongside). A miss starts them at once.
_PRESTART_DELAY = 0.1


# How many of a gather's requests start in one step of the event loop.
_SPAWN_SLICE = 16


class _Batch:
    """The requests of one ``gather()``, until each has submitted its job or needs none: the
    local executor queues their jobs meanwhile, even with idle workers, so that they start
    longest first rather than in the order their cache look-ups end (with 15 idle workers, the
    first 15 to arrive would start at once, and the longest compile, arriving 16th, would wait
    for one of them). Released when every request has arrived, or after ``_BATCH_WAIT``."""

    def __init__(self, release: Callable[[], None], expected: int) -> None:
        self._release = release
        self._waiting = expected
        self._timer = asyncio.get_running_loop().call_later(_BATCH_WAIT, self.release)

    @classmethod
    def of(cls, executor: Any, expected: int) -> _Batch | None:
        hold = getattr(executor, "hold_dispatch", None)
        if hold is None or expected < 2:
            return None
        return cls(hold(), expected)

    def arrived(self) -> None:
        self._waiting -= 1
        if self._waiting <= 0:
            self.release()

    def release(self) -> None:
        self._timer.cancel()
        self._release()  # idempotent


class _Arrival:
    """One request of a batch: counted once, when its job is submitted or it needs none."""

    def __init__(self, batch: _Batch) -> None:
        self._batch: _Batch | None = batch

    def arrive(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.arrived()


# The batch request a task (and the flight it starts) belongs to, if any.
_arrival: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar("acompile_arrival", default=None)


@dataclass(eq=False)
class _Flight:
    """One compile in progress, shared by every caller that asked for the same key."""

    key: str
    background: bool = False
    job: Job | None = None  # once the flight has queued one
    waiters: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    tier: str = ""
    error: BaseException | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    backend: str = ""
    captured: dict[Any, Any] | None = None  # each listener's capture(), in the first caller's task
    started: float = 0.0  # when its work in the pool's task group began

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


class CompilePool:
    """A pool of compile workers with a cache, used as ``async with CompilePool() as pool:``.

    Args:
        workers: where the compile jobs run. A count of worker processes on this machine;
            ``None`` means one per CPU this process may use (affinity and cgroup quota), keeping
            one for the process itself beyond four. Or an executor spec: ``LocalWorkers(n)``
            (what a count is short for), ``RayFarm(...)`` (a Ray cluster; no local worker), or
            ``Split(urgent, background)``: ``Split(4, RayFarm(...))`` runs the requests
            somebody awaits on 4 local workers and background ones (warm-ups) on the farm. The
            settings below that tune workers (``worker_nice``, ``memory_limit``,
            ``max_compile_seconds``, ``preload_timeout``, ``idle_timeout``, ``fork_workers``,
            ``preload``) are one ``WorkerSettings``, handed whole to the spec: local workers
            and a farm's actors run with them (on a farm's nodes the default and ``worker_nice="idle"`` are 0,
            and its executor, not each actor, quiesces).
        target: the default target of requests, ``"cuda:90"``, ``"cuda:80"`` ...; ``None`` means
            the local GPU (a ``DeviceUnavailableError`` where there is none).
        cache_dir: the disk cache folder; default ``$ACOMPILE_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/acompile``, else ``~/.cache/acompile``. Several processes may share it.
        memory_cache_size: how many loaded kernels the memory tier keeps (LRU).
        prestart: start (and preload) the workers soon after the pool is entered: at the first
            request that misses the cache, or once the requests made with the entry have had
            0.1 s (starting a process stalls the event loop for milliseconds and competes for
            the CPU: a warm start's cache hits come first). With ``False`` they start at the
            first request that misses the cache, so a process whose kernels are all cached
            never starts one.
        preload: the backends each worker imports and warms up before it reports ready
            (``"triton"``); a backend not named here loads at its first job instead.
        worker_nice: how the workers yield the CPU to this process. A number from 0 to 19 is
            added to their nice value: 5 (the default) gives a compiler about a third of a
            nice-0 task's share, so the event loop serving requests goes first, and compiles
            still progress on a machine busy with other work; 0 runs workers at this process's
            priority. ``"idle"``: they run under Linux's ``SCHED_IDLE`` policy, so any other task
            that wants a CPU preempts a compiler at once; they use only the CPU nobody else wants
            (elsewhere: nice 19), and on a machine saturated by other work they are moved to
            nice +5 once seen starving (one warning).
        idle_timeout: quiesce the pool after this many seconds without work (``None``: never);
            the next request wakes it.
        memory_limit: a worker whose resident memory passes this many bytes (or ``"4GiB"``,
            ``"512MiB"``) is stopped; its job fails with ``WorkerCrashedError`` saying so.
        max_compile_seconds: a job that runs longer fails with ``CompileTimeoutError`` and its
            worker is stopped, with every compiler it started (for compilers that never return,
            and workers stopped by a signal); ``None`` for no limit. Callers' own deadlines
            are theirs to set with ``anyio.fail_after``.
        preload_timeout: a worker (or the template workers fork from) that has not finished
            its preload after this many seconds is stopped and started again; a second such
            failure in a row fails the waiting jobs with ``WorkerStartError``.
        fork_workers: fork workers from a preloaded template process (fast start and wake-up);
            ``False`` starts each worker as a fresh interpreter.
        shared_cache: a tier a fleet shares, after memory and disk: an
            ``acompile.SharedCache(where, signing_key=..., unsafe_trust_unsigned=...,
            fleet_wait=...)``, or its ``where`` alone (a URL, ``"redis://host:6379/0"``, or an
            aiocache cache), which is ``SharedCache(where)``: signed with
            ``$ACOMPILE_SIGNING_KEY`` where it is set. A local hit never touches the tier; its
            faults are misses, never errors.
        signing_key, unsafe_unsigned_host_code, fleet_wait: ``SharedCache``'s ``signing_key``,
            ``unsafe_trust_unsigned`` and ``fleet_wait``, given beside a URL: deprecated (a
            ``DeprecationWarning``), removed in 0.3; give a ``SharedCache`` instead.
        record: append every Triton kernel request the pool serves to this warm-up manifest
            (once per distinct request, across runs and across the processes that share the
            file), and every FlashInfer module it serves (``acompile.inductor.serve``);
            ``acompile warmup PATH`` replays it.
        trace: write a Chrome/Perfetto trace of the pool's work to this file when the pool
            closes (see also ``trace()``).
        farm: ``workers=farm`` (``workers=Split(N, farm)`` with ``workers=N`` too): deprecated
            (a ``DeprecationWarning``), removed in 0.3.

    Entering starts the workers in the background and returns at once; ``wait_ready()`` waits
    for their preload. Leaving stops every worker, whatever happens in the body. A pool is
    entered once.
    """

    def __init__(
        self,
        workers: int | ExecutorSpec | None = None,
        *,
        target: str | Target | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        memory_cache_size: int = 1024,
        prestart: bool = True,
        preload: tuple[str, ...] = ("triton",),
        worker_nice: int | Literal["idle"] = DEFAULT_NICE,
        idle_timeout: float | None = None,
        memory_limit: int | str | None = None,
        max_compile_seconds: float | None = 600.0,
        preload_timeout: float = 120.0,
        fork_workers: bool = True,
        shared_cache: SharedCache | Any = None,
        signing_key: str | bytes | None = None,
        unsafe_unsigned_host_code: bool | None = None,
        fleet_wait: float | None = None,
        record: str | os.PathLike[str] | None = None,
        trace: str | os.PathLike[str] | None = None,
        farm: RayFarm | None = None,
    ) -> None:
        # Every argument is checked here, before anything starts: a server learns of a wrong one
        # when it builds its pool, not at entry or at its first request.
        spec = executor_spec(workers)  # a count as LocalWorkers (checked), or a spec
        for name, flag in (("prestart", prestart), ("fork_workers", fork_workers)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if (
            isinstance(memory_cache_size, bool)
            or not isinstance(memory_cache_size, int)
            or memory_cache_size < 0
        ):
            raise ValueError(f"memory_cache_size must be an integer >= 0, got {memory_cache_size!r}")
        if not isinstance(preload, (tuple, list)) or not all(isinstance(name, str) for name in preload):
            raise TypeError(f"preload must be a tuple of backend names such as ('triton',), got {preload!r}")
        shared = shared_cache_argument(shared_cache, signing_key, unsafe_unsigned_host_code, fleet_wait)
        if farm is not None:
            if not isinstance(farm, RayFarm):
                raise TypeError(f"farm must be an acompile.RayFarm or None, got {farm!r}")
            if not (workers is None or isinstance(spec, LocalWorkers)):
                raise TypeError("a farm beside an executor spec: give workers=acompile.Split(urgent, farm)")
            new_form = f"acompile.Split({workers}, farm)" if workers is not None else "farm"
            warnings.warn(
                f"CompilePool's farm= is deprecated and will be removed in 0.3: pass workers={new_form}",
                DeprecationWarning,
                stacklevel=2,
            )
            spec = farm if workers is None else Split(spec, farm)
        cache_dir = _path_argument("cache_dir", cache_dir)
        record = _path_argument("record", record)
        trace = _path_argument("trace", trace)
        # One place chooses the executor: this spec, opened once as the pool is entered.
        self._spec: ExecutorSpec = spec
        # How many local workers it runs (the urgent side's, under a Split), or would by default.
        local = spec.urgent if isinstance(spec, Split) else spec
        count = getattr(local, "count", None)
        self._size = count if isinstance(count, int) else default_workers()
        self._target_arg = target
        self._target: Target | None = parse_target(target) if target is not None else None
        # The tiers after memory, fastest first: adding a tier is adding it here.
        tiers: list[Tier] = []
        self._shared = shared
        if shared is not None:
            fleet = [
                SharedTier.connect_later(
                    place, shared.signing_key, unsafe_unsigned_host_code=shared.unsafe_trust_unsigned
                )
                for place in shared.places
            ]
            tiers.append(fleet[0] if len(fleet) == 1 else FleetTiers(fleet, copy_back=shared.copy_back))
        self._cache = TierChain(
            MemoryTier(memory_cache_size),
            GuardedDisk(Path(cache_dir) if cache_dir is not None else default_cache_dir()),
            tiers,
            fleet_wait=shared.fleet_wait if shared is not None else DEFAULT_FLEET_WAIT,
            write_through=shared is not None and shared.write == "through",
        )
        self._tuner = _autotune.Tuner(self._cache)
        self._prestart = prestart
        self._prestart_scope: anyio.CancelScope | None = None  # made on entry: needs the loop
        # How the workers run, wherever they run: checked here, once, and carried whole (the
        # target and the preloaded modules are set below and at entry).
        settings = WorkerSettings.checked(
            nice=worker_nice,
            idle_timeout=idle_timeout,
            memory_limit=memory_limit,
            max_compile_seconds=max_compile_seconds,
            preload_timeout=preload_timeout,
            fork_workers=fork_workers,
        )
        _check_backends(tuple(preload))
        self._preload = tuple(preload)
        self._settings = settings.replace(
            backends=self._preload,
            preload=tuple(dict.fromkeys(worker_module(name) for name in self._preload)),
        )
        self._recorder = Recorder(Path(record)) if record is not None else None
        self._trace_path = Path(trace) if trace is not None else None
        self._tracer: Tracer | None = Tracer() if trace is not None else None
        self._state = "new"
        self._flights: dict[str, _Flight] = {}
        self._counts: Counter[str] = Counter()
        self._after_ready = AfterReady()
        self._listeners: list[Listener] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._workers: Executor | None = None
        self._queue_seen = (-1.0, False)  # when jobs_queue() last looked, and what it saw
        self._executor_stack = contextlib.AsyncExitStack()  # what the executor holds beyond serve()
        self._workdir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._portal: Portal | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> CompilePool:
        if self._state != "new":
            raise PoolClosedError("a CompilePool is entered once; make a new one")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # Workers, pipes and the write-behind are built on asyncio (uvloop included); on
            # another loop (trio) they would fail later, deep inside, with a less useful message.
            raise PoolError(
                "CompilePool needs an asyncio event loop (asyncio or uvloop): run it with "
                "asyncio.run() or anyio.run(main) (anyio's default backend), not on trio"
            ) from None
        self._state = "starting"
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        try:
            if self._target is None:
                try:
                    self._target = await anyio.to_thread.run_sync(local_target)
                except DeviceUnavailableError as exc:
                    # Only Triton's preload compiles for the pool's target; a pool that serves
                    # torch.compile alone (preload=("inductor",)) runs where there is no GPU,
                    # and a request without a target of its own says so.
                    if "triton" in self._preload:
                        raise DeviceUnavailableError(
                            f"{exc} (a pool that only serves torch.compile needs no target: "
                            'CompilePool(preload=("inductor",)))'
                        ) from exc
            if self._target is not None and self._target.backend == "cuda":
                load_launcher_if_built()  # imported off the first launch, where a GPU driver is
            await self._cache.open()
            for name in self._preload:
                # Imports (in a thread, unless done already) and one-time costs now, not in the
                # first request.
                spec = BACKENDS[name]
                if all(module in sys.modules for module in (spec.parent, spec.requires) if module):
                    backend = load_parent(name)
                else:
                    backend = await anyio.to_thread.run_sync(load_parent, name)
                await backend.setup(self._memo_dir, self._target)
            # The workers' folders: one trip to a thread for both (each trip is a hand-over of
            # the interpreter's lock both ways, and a warm start's clock runs meanwhile).
            bytecode, helpers = await anyio.to_thread.run_sync(self._work_folders)
            workdir = self._workdir
            assert workdir is not None
            settings = self._settings.replace(target=str(self._target) if self._target is not None else "")
            opening = Opening(
                workdir=workdir,
                memo_dir=self._memo_dir,
                cache_root=self._cache.root,
                bytecode_dir=bytecode,
                bytecode_helpers=helpers,
                backend_config=self._worker_config,
                size=self._size,
                stack=self._executor_stack,
                sys_path=tuple(sys.path),
                cwd=os.getcwd(),
            )
            # The one place an executor is chosen: the spec opens its own (a farm that cannot be
            # reached falls back to local workers inside its open, where it allows that).
            self._workers = opened(self._spec, await self._spec.open(settings, opening))
            # A wait on another replica's compile does not count against fleet_wait while this
            # pool's own jobs queue (docs/caching.md, single flight).
            self._cache.busy = self._jobs_queue
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._cache.start(self._tg)  # write-behind runs in the pool's task group
            # Torch's threads reach the pool through this (acompile.inductor.serve(pool)): its pump
            # is one idle task.
            self._portal = Portal(self._loop, self._loop_thread, self._tg.start_soon)
            self._tg.start_soon(self._portal.pump)
            self._tg.start_soon(self._serve_executor, self._workers)
        except BaseException:
            self._state = "closed"
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self._tg.__aexit__(None, None, None)
            await self._remove_workdir()
            raise
        self._state = "running"
        if self._prestart:
            self._prestart_scope = anyio.CancelScope()
            self._tg.start_soon(self._prestart_soon, self._prestart_scope)
        return self

    async def _serve_executor(self, executor: Executor) -> None:
        """The executor's ``serve()``, which runs until the pool's task group is cancelled; one
        that returns (or fails) before that leaves a pool nothing can run on: it is closed, and
        says so, rather than taking requests that would wait for ever."""
        try:
            await executor.serve()
        except Exception:
            logger.exception("the pool's executor (%r) failed; the pool is closed", self._spec)
            self._state = "closed"
            return
        if self._state == "running":
            logger.error("the pool's executor (%r) stopped serving; the pool is closed", self._spec)
            self._state = "closed"

    def _work_folders(self) -> tuple[str | None, str]:
        """Make the workers' work folder (``self._workdir``), and return ``_bytecode_plan()``
        (blocking)."""
        self._workdir = WorkerPool.make_workdir("acompile-")  # set here: removed if what follows fails
        return self._bytecode_plan()

    def _bytecode_plan(self) -> tuple[str | None, str]:
        """Where the workers keep their imports' bytecode (None: where the installation does),
        and the help their first template gets to compile Triton's (only for a pool that
        preloads Triton). Blocking: a look along sys.path, the cgroup's CPU quota."""
        return bytecode_plan(self._memo_dir, "triton" in self._preload)

    async def _prestart_soon(self, scope: anyio.CancelScope) -> None:
        # A miss, wait_ready() or wakeup() start the workers at once; quiesce() before this
        # fires means the caller wants none running.
        with scope:
            await anyio.sleep(_PRESTART_DELAY)
            # Asked again: a quiesce() (or the exit) in the loop iteration that ended the sleep
            # cancels the scope without interrupting this task (its timer had fired already).
            if not scope.cancel_called:
                assert self._workers is not None
                self._workers.wakeup()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        if self._portal is not None:
            self._portal.close()  # torch's threads go on without the pool from now on
        if self._prestart_scope is not None:
            self._prestart_scope.cancel()  # leaving within the delay starts no worker
        assert self._tg is not None
        # Entries on their way to the shared tier or the disk: let them arrive (a warm-up job that
        # ends normally wants all of them there; a failing or cancelled body, a moment).
        await self._cache.drain(30 if exc is None else 2)
        # Whatever the body did, compiles in progress are abandoned and workers stopped now.
        self._tg.cancel_scope.cancel()
        try:
            # The body's own exception is not the task group's business: it propagates as it is
            # once this returns, instead of wrapped in an exception group.
            await self._tg.__aexit__(None, None, None)
        finally:
            for flight in list(self._flights.values()):
                flight.finish(error=PoolClosedError("the pool shut down while compiling"))
            if self._tracer is not None and self._trace_path is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._tracer.write, self._trace_path)
            await self._remove_workdir()

    async def _remove_workdir(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._executor_stack.aclose()  # what the executor held (a host pool's link)
        await self._cache.close()  # every tier (the shared tier's client too), shielded
        if self._workdir is not None:
            workdir, self._workdir = self._workdir, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(remove_work_folder, workdir)  # only if still ours

    @property
    def _memo_dir(self) -> Path:
        # In the cache folder, unless it did not answer at start (a hung filesystem).
        return self._cache.memo_dir

    async def share(self, keys: Iterable[str]) -> tuple[int, int]:
        """Make sure the cache tiers after the disk (the shared tier) hold these entries, found
        on this pool's disk: a kernel served from the local cache never touches the shared tier,
        so a warm-up job on a machine with a warm disk calls this to fill its fleet's tier.

        Returns (entries the tiers held already, entries written to them). A tier's faults are
        counted in ``stats()["cache"]`` (``shared_errors``), never raised; an entry absent from
        the disk is skipped.
        """
        self._check_running()
        found = written = 0

        async def one(key: str) -> None:
            nonlocal found, written
            f, w = await self._cache.spread(key)
            found, written = found + f, written + w

        async with anyio.create_task_group() as tg:
            for key in dict.fromkeys(keys):
                tg.start_soon(one, key)
        return found, written

    async def _worker_config(self) -> BackendConfig:
        extra: BackendConfig = {}
        for name in self._preload:
            backend = load_parent(name)  # imported by __aenter__ already
            extra.update(await backend.worker_config(self._memo_dir))
        return extra

    def _jobs_queue(self) -> bool:
        """Whether jobs of this pool wait for a worker now (read at most every 0.1 s)."""
        now = time.monotonic()
        if now - self._queue_seen[0] >= 0.1:
            workers = self._workers
            self._queue_seen = (now, workers is not None and workers.stats()["jobs"]["queued"] > 0)
        return self._queue_seen[1]

    def _check_running(self) -> None:
        if self._state != "running":
            raise PoolClosedError(
                "the pool is not running: use it inside `async with CompilePool() as pool:`"
                if self._state == "new"
                else "the pool has shut down; make a new CompilePool"
            )

    async def wait_ready(self) -> None:
        """Wait until every worker has started and preloaded, starting them if needed: after
        ``quiesce()``, this wakes the pool (its workers fork again from the template).

        Raises ``WorkerStartError`` if workers cannot start (the message says why).
        """
        await self.executor.wait_ready()

    def mark_ready(self, on_late: Literal["warn", "refuse"] = "warn") -> None:
        """Say that the server is ready: what it serves should be warm by now.

        From then on every compile is counted and named (``stats()["after_ready"]``, the
        ``acompile_compiles_after_ready_total`` metric, one warning per kernel): this pool's
        requests, torch.compile's jobs and the served JIT libraries' builds
        (``acompile.inductor.serve``). ``on_late="warn"`` compiles them anyway, and publishes the
        result to the fleet's tier so that the next replica has it; ``"refuse"`` raises
        ``CompiledAfterReadyError`` from a request (or a served JIT library's build) that would
        compile, while cache hits are served as before. torch.compile's own graphs are counted,
        never refused here: ``torch.compiler.set_stance("fail_on_recompile")`` is torch's
        refusal. May be called again to change ``on_late``; callable from any thread."""
        self._after_ready.mark(on_late)

    @property
    def ready(self) -> bool:
        """Whether ``mark_ready()`` was called."""
        return self._after_ready.ready_at is not None

    def _late(self, backend: str, name: str, *, say: bool = True) -> None:
        """A compile of ``name`` is about to start: counted after ready (named in a warning
        unless the caller names it), or refused. Callable from any thread."""
        if self._after_ready.ready_at is None:
            return
        if self._after_ready.refuses():
            self._after_ready.note(backend, name, say=say, refused=True)
            raise CompiledAfterReadyError(
                f"{name} ({backend}) is not in the cache, and the server said it was ready with "
                "on_late='refuse': warm it up before mark_ready() (the pool's record=, where it "
                "keeps one, names it for the next start)",
                kernel=name.partition("[")[0],
                backend=backend,
            )
        self._after_ready.note(backend, name, say=say)

    def _add_listener(self, listener: Listener) -> None:
        """Tell ``listener`` of every request that misses memory and every job (acompile.metrics)."""
        self._listeners.append(listener)

    def _remove_listener(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    async def quiesce(self) -> None:
        """Stop every worker and return at once; the pool and its cache stay.

        The workers' memory goes back to the system (the template they are forked from stays,
        so waking is fast). Compiles that were running go back to the front of the queue, and a
        pool with work waiting, or asked for more, wakes by itself. For a quiet machine during
        CUDA-graph capture or latency-critical serving.
        """
        if self._prestart_scope is not None:
            self._prestart_scope.cancel()
        self.executor.quiesce()

    @contextlib.asynccontextmanager
    async def trace(self, path: str | os.PathLike[str]) -> AsyncIterator[None]:
        """Trace the pool's work while the block runs, and write it to ``path`` (Chrome trace
        JSON; open it in ui.perfetto.dev): one span per request (tier, kernel, key, constexprs,
        options), its queue wait, its compile on the worker's track, its load."""
        previous, self._tracer = self._tracer, Tracer()
        tracer = self._tracer
        try:
            yield
        finally:
            self._tracer = previous
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(tracer.write, Path(path))

    async def wakeup(self) -> None:
        """Deprecated (removed in 0.3): ``wait_ready()`` does the same."""
        warnings.warn(
            "CompilePool.wakeup() is deprecated and will be removed in 0.3: await pool.wait_ready(), which "
            "starts the workers again after quiesce() and waits for them",
            DeprecationWarning,
            stacklevel=2,
        )
        await self.wait_ready()

    # -- requests --------------------------------------------------------------------------------

    async def triton(
        self,
        fn_or_source: Any,
        *,
        signature: dict[str, str],
        constexprs: dict[str, Any] | None = None,
        kernel_name: str | None = None,
        num_warps: int = 4,
        num_stages: int = 3,
        target: str | Target | None = None,
        attrs: dict[Any, Any] | None = None,
        **options: Any,
    ) -> TritonKernel:
        """Compile a Triton kernel, or take it from the cache; returns a ``TritonKernel``.

        Args:
            fn_or_source: a ``@triton.jit`` function, or Python source text defining one (then
                ``kernel_name`` says which, unless it defines exactly one).
            signature: Triton type of each runtime parameter: ``{"x": "*fp32", "n": "i32"}``.
            constexprs: values of the compile-time parameters: ``{"BLOCK": 1024}``. Constexpr
                parameters with a default may be left out.
            num_warps, num_stages, **options: Triton's compile options (``num_ctas``,
                ``maxnreg``, ``enable_fp_fusion`` ...); unknown names are an error.
            target: ``"cuda:90"`` ...; default: the pool's.
            attrs: Triton's specialisation attributes by parameter name or index, e.g.
                ``{"x": [["tt.divisibility", 16]]}``.

        Raises:
            InvalidSpecError: the request is wrong (before any worker is involved).
            CompileError: Triton rejected the kernel; the error carries its message.
            PoolClosedError: the pool is not running.
        """
        from acompile._backends import TritonSpec

        spec = TritonSpec(
            fn_or_source,
            signature,
            constexprs,
            kernel_name,
            num_warps,
            num_stages,
            target,
            attrs,
            options,
        )
        return await self.compile(spec)

    @overload
    async def cuda(
        self,
        source: str,
        *,
        output: Literal["cubin", "ptx"] = "cubin",
        arch: str | int | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
        name: str | None = None,
    ) -> CudaModule: ...

    @overload
    async def cuda(
        self,
        source: str,
        *,
        output: Literal["so"],
        arch: str | int | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
        name: str | None = None,
    ) -> SharedLibrary: ...

    @overload
    async def cuda(
        self,
        source: str,
        *,
        output: Literal["o"],
        arch: str | int | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
        name: str | None = None,
    ) -> ObjectFile: ...

    @overload
    async def cuda(
        self,
        source: str,
        *,
        output: str,
        arch: str | int | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
        name: str | None = None,
    ) -> CudaModule | SharedLibrary | ObjectFile: ...

    async def cuda(
        self,
        source: str,
        *,
        output: str = "cubin",
        arch: str | int | None = None,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] = (),
        name: str | None = None,
    ) -> CudaModule | SharedLibrary | ObjectFile:
        """Compile CUDA C++ source, or take it from the cache.

        Args:
            output: ``"cubin"`` or ``"ptx"`` (NVRTC, no nvcc or host compiler needed) return a
                ``CudaModule`` whose kernels launch through the CUDA driver API; ``"so"`` (nvcc)
                returns a ``SharedLibrary`` loaded with ctypes; ``"o"`` (nvcc) an ``ObjectFile``
                in the cache folder.
            arch: ``"sm_90"``, ``90``, ``"sm_90a"`` ...; default: the pool's target.
            options: compiler flags (``"-O3"``, ``"--use_fast_math"``, ``"-DTILE=64"`` ...).
            name_expressions: template instantiations to look up after an NVRTC compile
                (``"scale<float>"``): ``module["scale<float>"]`` finds the mangled kernel.
            name: the module's name (in errors and stats); default: the first ``__global__``.

        Raises:
            InvalidSpecError: a wrong argument (before any worker is involved).
            CUDACompileError: the compiler rejected the source; it carries the log, the line
                number and the source line of the first error.
        """
        from acompile._backends import CudaSpec

        return await self.compile(CudaSpec(source, output, arch, options, name_expressions, name))

    async def cpp(
        self,
        source: str,
        *,
        options: Sequence[str] = (),
        include_dirs: Sequence[str] = (),
        name: str | None = None,
    ) -> SharedLibrary:
        """Compile C++ source into a shared library with the system compiler (``$CXX``, else
        ``c++``), or take it from the cache; returns a ``SharedLibrary`` loaded with ctypes.

        Raises ``InvalidSpecError`` for wrong arguments and ``CppCompileError`` (log, line,
        source line) when the compiler rejects the source.
        """
        from acompile._backends import CppSpec

        return await self.compile(CppSpec(source, options, include_dirs, name))

    @overload
    async def compile(self, spec: TritonSpec, *, background: bool = False) -> TritonKernel: ...

    @overload
    async def compile(self, spec: CppSpec, *, background: bool = False) -> SharedLibrary: ...

    @overload
    async def compile(
        self, spec: CudaSpec, *, background: bool = False
    ) -> CudaModule | SharedLibrary | ObjectFile: ...

    @overload
    async def compile(self, spec: Spec, *, background: bool = False) -> Kernel: ...

    async def compile(self, spec: Spec, *, background: bool = False) -> Any:
        """Compile one spec (``acompile.TritonSpec``), or take it from the cache.

        ``background=True`` queues the work behind requests that someone is waiting on (for
        warm-up jobs that should not delay a server's on-demand compiles).
        """
        kernel, _ = await self.compile_with_tier(spec, background=background)
        return kernel

    async def compile_with_tier(self, spec: Spec, *, background: bool = False) -> tuple[Any, str]:
        """Like ``compile()``, and say where the result came from: ``"memory"``, ``"disk"``,
        ``"shared"`` or ``"compile"`` (a worker compiled it for this request or one it joined)."""
        self._check_running()
        backend_name = backend_of(spec)
        backend = load_parent(backend_name)
        # What prepare() starts outside the workers (a source string's probe) is held to the
        # limit the workers are.
        with _linux.under_memory_limit(self._settings.memory_limit):
            request = await backend.prepare(spec, self._target, self._memo_dir)
        kernel = self._cache.loaded(request.key)
        if kernel is not None:
            self._record(request, spec)
            if self._tracer is not None:
                now = time.perf_counter()
                self._tracer.request(request, "memory", now, now, None, (now, now))
            return kernel, "memory"
        self._check_running()  # again: the pool may have closed while the request was prepared
        flight = self._flights.get(request.key)
        if flight is None:
            flight = _Flight(request.key, background=background, backend=backend_name)
            if self._listeners:
                flight.captured = self._capture()
            self._flights[request.key] = flight
            # This caller looks in the local tier itself; the flight goes on in the pool's task
            # group only where that finds nothing to load.
            await self._look_locally(flight, backend, request)
        else:
            self._counts["joined_in_flight"] += 1
            arrival = _arrival.get(None)
            if arrival is not None:
                arrival.arrive()  # its job is another request's
            if flight.background and not background:
                # Someone waits for it now: it must not stay behind the warm-up.
                flight.background = False
                if flight.job is not None and self._workers is not None:
                    self._workers.promote(flight.job)
        flight.waiters += 1
        try:
            if not flight.done.is_set():  # a disk hit is done already: no trip through the loop
                await flight.done.wait()
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.done.is_set():
                # The last caller left: stop the work, and let a later caller start afresh.
                if self._flights.get(flight.key) is flight:
                    del self._flights[flight.key]
                flight.scope.cancel()
        if flight.error is not None:
            if isinstance(flight.error, CompiledAfterReadyError):
                # The record names it, so that the next start warms it up (a refused request
                # must not be refused again at every start).
                self._record(request, spec, after_ready=True)
            # Each caller raises its own copy: one exception object raised in several tasks
            # would collect all their tracebacks.
            # The original, with the traceback of where it happened, is the copy's cause.
            raise copy.copy(flight.error) from flight.error
        self._record(request, spec, after_ready=flight.tier == "compile" and self.ready)
        return flight.result, flight.tier

    def _record(self, request: Request, spec: Spec, *, after_ready: bool = False) -> None:
        """Add a request this pool served (successfully, or refused after ready) to the warm-up
        record, in the background: a failed request would only fail again at every replay."""
        recorder = self._recorder
        if recorder is None or self._state != "running" or backend_of(spec) != "triton":
            return
        assert self._tg is not None
        if recorder.recorded(request.key):
            return
        self._tg.start_soon(self._write_record, recorder, request, spec, after_ready)

    async def _write_record(
        self, recorder: Recorder, request: Request, spec: Spec, after_ready: bool = False
    ) -> None:
        """One entry of the record, off the loop. A record that cannot be written (a folder
        that cannot be made, a full or read-only disk) costs the record, never the pool: one
        warning, and this pool records nothing more."""
        try:
            # Shielded: a request served just before the pool's exit is recorded too (the write
            # is short; the record's lock is waited for _LOCK_WAIT at most).
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    functools.partial(recorder.add, request, spec, after_ready=after_ready)
                )
        except OSError as exc:
            self._record_lost(recorder, exc)

    def _record_module(self, key: str, library: str, fields: dict[str, Any]) -> None:
        """Add a JIT library's module to the warm-up record (blocking: called on the library's
        thread). As for kernels, a record that cannot be written costs the record only."""
        recorder = self._recorder
        if recorder is None:
            return
        try:
            recorder.add_module(key, library, fields)
        except OSError as exc:
            self._record_lost(recorder, exc)

    def _record_lost(self, recorder: Recorder, exc: OSError) -> None:
        if self._recorder is recorder:
            self._recorder = None
            logger.warning(
                "cannot write the warm-up record %s (%s); this pool records nothing more", recorder.path, exc
            )

    async def _look_locally(
        self, flight: _Flight, backend: ParentBackend[Any, Any, Any], request: Request
    ) -> None:
        """The first request for a key reads the local tier (the disk) in its own task, and
        finishes the flight with the kernel for whoever joined meanwhile. A warm start's
        requests are all disk hits, and a task of the pool's for each, with its cancel scope,
        cost them more than their read and load. Where the disk has nothing loadable, the flight
        goes on in the pool's task group (``_fly``), from the tiers after it. A caller cancelled
        meanwhile leaves the flight to such a task where others wait for it."""
        start = time.perf_counter()
        flight.waiters += 1  # this caller, until the flight goes on without it
        try:
            entry = await self._cache.lookup_local(request.key)
            kernel = None
            if entry is not None:
                kernel, loading = await self._load_found(backend, request, entry, self._cache.local.name)
        except Exception as exc:
            flight.waiters -= 1
            self._flight_failed(flight, request, exc)
            return
        except BaseException:
            flight.waiters -= 1
            if not flight.done.is_set():
                if flight.waiters and self._state == "running":
                    assert self._tg is not None
                    self._tg.start_soon(self._fly, flight, backend, request)
                else:
                    self._drop(flight)
                    flight.finish(error=self._abandoned(request))
            raise
        flight.waiters -= 1
        if kernel is None:
            if self._state != "running":
                self._drop(flight)
                flight.finish(error=self._abandoned(request))
                return
            # Nothing loadable on the disk: the other tiers, or a compile (straight away where
            # the disk's entry was rejected, as in _fly).
            assert self._tg is not None
            go_on = functools.partial(self._fly, after_local=entry is None, rejected=entry is not None)
            self._tg.start_soon(go_on, flight, backend, request)
            return
        if self._tracer is not None:
            done = time.perf_counter()
            self._tracer.request(request, self._cache.local.name, start, done, None, (loading, done))
        if self._listeners:
            self._tell(flight, request, self._cache.local.name, start)
        self._cache.keep_loaded(request.key, kernel)
        flight.tier = self._cache.local.name
        flight.finish(kernel)
        self._drop(flight)

    async def _load_found(
        self, backend: ParentBackend[Any, Any, Any], request: Request, entry: Entry, tier: str
    ) -> tuple[Any, float]:
        """The kernel of an entry ``tier`` found, and when its loading began; None for the
        kernel where the backend cannot load the entry (rejected: a miss, as a damaged one is)."""
        # Entries that arrive together (a warm start) become kernels a slice at a time.
        await _pacing.checkpoint()
        loading = time.perf_counter()
        try:
            return await backend.load(request, entry, self._cache.root), loading
        except CorruptEntry as exc:
            # Intact bytes the backend cannot load: a miss, as a damaged entry is.
            self._cache.reject(request.key, tier, exc)
            return None, loading

    def _abandoned(self, request: Request) -> AcompileError:
        """What a flight nobody carries on ends with: the pool's exit, or its last caller gone."""
        if self._state != "running":
            return PoolClosedError("the pool shut down while compiling")
        return JobCancelled(request.name)

    def _drop(self, flight: _Flight) -> None:
        """The flight is over (or abandoned): a later request for its key starts afresh."""
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    def _capture(self) -> dict[Listener, Any]:
        """What each listener keeps of the caller's task (its tracing context), by listener."""
        captured: dict[Listener, Any] = {}
        for listener in self._listeners:
            try:
                captured[listener] = listener.capture()
            except Exception:  # an observer's fault is never the request's
                logger.debug("a listener of the pool failed", exc_info=True)
        return captured

    def _tell(
        self, flight: _Flight, request: Request, tier: str, start: float, error: BaseException | None = None
    ) -> None:
        """The listeners' account of a request that did not come from memory."""
        outcome = "ok" if error is None else "cancelled" if isinstance(error, JobCancelled) else "error"
        job = flight.job if tier == "compile" or error is not None else None
        event = RequestDone(
            backend=flight.backend,
            name=request.name,
            key=request.key,
            tier=tier,
            outcome=outcome,
            error=None if error is None else type(error).__name__,
            start=start,
            end=time.perf_counter(),
            job=job,
            nbytes=0,
            captured=None,
        )
        for listener in self._listeners:
            event.captured = flight.captured.get(listener) if flight.captured else None
            try:
                listener.request_done(event)
            except Exception:  # an observer's fault is never the request's
                logger.debug("a listener of the pool failed", exc_info=True)

    def _flight_failed(self, flight: _Flight, request: Request, exc: Exception) -> None:
        """A flight's work raised ``exc``: every caller raises a copy of it."""
        if self._listeners:
            self._tell(flight, request, flight.tier, flight.started or time.perf_counter(), exc)
        if isinstance(exc, AcompileError) and not isinstance(exc, (JobCancelled, CompiledAfterReadyError)):
            self._counts["failed"] += 1
            # One line (a log record per failure, whole), made of the first lines of the
            # message without the compiler's stderr tail: the error carries all of it.
            text = exc.args[0] if exc.args else str(exc)
            lines = [line.strip() for line in str(text).splitlines() if line.strip()]
            summary = " | ".join(lines[:4])
            if len(summary) > 300 or len(lines) > 4:
                summary = summary[:300] + " ..."
            logger.warning("compile of %s failed: %s", request.name, summary)
        flight.finish(error=exc)
        self._drop(flight)

    async def _fly(
        self,
        flight: _Flight,
        backend: ParentBackend[Any, Any, Any],
        request: Request,
        *,
        after_local: bool = False,
        rejected: bool = False,
    ) -> None:
        """A flight's work in the pool's task group: the byte tiers (those after the local one,
        ``after_local``; none where the local tier's entry was ``rejected``), then a compile."""
        try:
            with flight.scope:
                start = flight.started = time.perf_counter()
                if rejected:
                    entry, tier = None, ""
                else:
                    entry, tier = await self._cache.lookup(request.key, after_local=after_local)
                kernel = None
                if entry is not None:
                    kernel, loading = await self._load_found(backend, request, entry, tier)
                if kernel is None:

                    async def compile() -> bytes:
                        self._late(flight.backend, _variant(request))
                        payload = await backend.payload(request)
                        data: bytes = await self._run(
                            backend.WORKER_MODULE, payload, request.name, flight=flight
                        )
                        return data

                    # Compiled here, or by another replica of the fleet that already was.
                    entry, tier = await self._cache.compile_once(request.key, compile)
                    if tier != "compile":
                        loading = time.perf_counter()
                        try:
                            kernel = await backend.load(request, entry, self._cache.root)
                        except CorruptEntry as exc:
                            # Another replica's compile, not usable here (built against headers
                            # this machine does not have as they were): compiled here instead.
                            self._cache.reject(request.key, tier, exc)
                            entry, tier = await self._cache.compile_once(request.key, compile, fleet=False)
                    if tier == "compile":
                        self._counts["compiled"] += 1
                    loading = time.perf_counter()
                    try:
                        if kernel is None:
                            kernel = await backend.load(request, entry, self._cache.root)
                    except CorruptEntry as exc:
                        # Just compiled here (or by another replica), and not loadable here:
                        # compiling again would make the same. Not kept for the next process.
                        await self._cache.local.delete(request.key)
                        made = "compiled" if tier == "compile" else f"from the {tier} tier"
                        raise CompileError(
                            f"{request.name} {made}, but the result cannot be loaded here "
                            f"({exc}): a compiler and a loader that do not match (a shared "
                            "cache's entry from another installation, or a bug); please report it",
                            kernel=request.name,
                            backend=entry.backend,
                        ) from exc
                if self._tracer is not None:
                    done = time.perf_counter()
                    job = flight.job if tier == "compile" else None
                    self._tracer.request(request, tier, start, done, job, (loading, done))
                if self._listeners:
                    self._tell(flight, request, tier, start)
                self._cache.keep_loaded(request.key, kernel)
                flight.tier = tier
                flight.finish(kernel)
        except Exception as exc:
            self._flight_failed(flight, request, exc)
        except BaseException:
            flight.finish(error=PoolClosedError("the pool shut down while compiling"))
            raise
        finally:
            self._drop(flight)
            if not flight.done.is_set():
                # Cancelled by its last waiter (not by shutdown): nobody is left to tell.
                flight.finish(error=JobCancelled(request.name))

    @property
    def workers(self) -> ExecutorSpec:
        """Where this pool's jobs run, as the executor spec its ``workers=`` argument made
        (``LocalWorkers(8)`` for ``workers=8``)."""
        return self._spec

    @property
    def executor(self) -> Executor:
        """The executor this pool's compile jobs run on, as the pool's ``workers=`` spec opened it:
        worker processes on this machine, a farm's, a split of the two, the host's pool.

        For tests, ``acompile.testing.run_job(pool, module, payload, name)`` runs a job of a
        worker-side module of one's own through it; requests go through ``triton()``,
        ``cuda()`` and ``cpp()``. Raises ``PoolClosedError`` outside ``async with``.
        """
        self._check_running()
        assert self._workers is not None
        return self._workers

    async def _run(
        self,
        backend_module: str,
        payload: Any,
        name: str,
        *,
        background: bool = False,
        flight: _Flight | None = None,
    ) -> Any:
        """Run one job with the named worker-side backend module, uncached, on the executor.

        The job carries the seconds it is expected to take (the cache's cost model), so that
        the longest compiles of a storm start first; its time, once it succeeded, goes back to
        the model. Cancelled before the job finishes, it cancels the job (dropped if queued,
        its worker stopped if running): a request whose last waiter left stops its compile.
        """
        executor = self.executor
        costs = self._cache.costs
        features = CostFeatures.of(payload, name)
        expected = await costs.expect(features)
        arrival = _arrival.get(None)
        if arrival is not None:
            # Counted once this task has submitted the job (run() does so before it waits).
            asyncio.get_running_loop().call_soon(arrival.arrive)
        if flight is not None:
            # Read after the wait, not before: a caller who joined the flight meanwhile made it
            # urgent, and had no job to promote yet. From here to the submit nothing waits, so
            # a later caller finds ``flight.job`` queued, and promotes it.
            background = flight.background
        job = Job(backend_module, payload, name, BACKGROUND if background else URGENT, expected)
        if flight is not None:
            flight.job = job
        try:
            result = await executor.run(job)
        finally:
            if self._listeners:
                self._job_done(flight.backend if flight is not None else _job_backend(job), job)
        if job.seconds > 0 and costs.record(features, job.seconds):
            self._cache.write_behind(costs.save)
        return result

    def _job_done(self, backend: str, job: Job) -> None:
        for listener in self._listeners:
            try:
                listener.job_done(backend, job)
            except Exception:  # an observer's fault is never the job's
                logger.debug("a listener of the pool failed", exc_info=True)

    async def autotune(self, fn: Any, configs: Any = None, **options: Any) -> TunedKernel:
        """Pick the fastest of several configs of a Triton kernel, once per fleet.

        ``await pool.autotune(fn, configs, *, signature, constexprs=None, args, grid, key=None,
        pin=None, warmup=None, repeats=None, reset=None, retune=False, target=None)``: every
        config (``triton.Config`` or ``{"constexprs": ..., "num_warps": ..., "num_stages": ...}``)
        is compiled at once across the pool, and each is benchmarked on the GPU with CUDA events
        (warm-up, repeats, median) on ``args`` as soon as it compiles; the winner comes back as a
        ``TunedKernel`` (a ``TritonKernel`` whose ``tuning`` says what was measured and skipped).
        The choice is stored under the tuning key (the configs' kernel keys and ``key``, e.g. the
        problem shape), so the next process, or another replica through the shared tier, skips
        tuning. ``pin`` (a dict,
        or a JSON file, from the key to a config) forces a choice without benchmarking. Configs
        that fail to compile or to run are skipped and reported. Compiling needs no GPU;
        benchmarking does (``DeviceUnavailableError`` says how to pin instead).
        """
        self._check_running()
        # The pool's Tuner holds its tunings in progress and its choices; records go through
        # the cache chain.
        return await self._tuner.autotune(
            self, self._memo_dir, self._settings.memory_limit, fn, configs, **options
        )

    def progressive(self, fast_spec: Any, best_spec: Any) -> ProgressiveKernel:
        """Serve a kernel at once and make it better while it is in use.

        Returns a ``ProgressiveKernel`` immediately: its ``kernel`` is the fast spec's as soon as
        that compiles (urgent lane), then, atomically, the best spec's when that lands (the
        warm-up lane: a server starts on quick configs and swaps in tuned ones). Launch it with
        ``handle[grid](*args)``; ``await handle.ready()`` / ``await handle.best()`` wait;
        ``handle.stats()`` counts launches per stage. Nothing it starts outlives the pool.
        """
        return _progressive.progressive(self._progressive_host(), fast_spec, best_spec)

    def background(self, spec: Any, fallback: Callable[..., Any]) -> BackgroundKernel:
        """Compile in the background and run ``fallback`` (eager code) until the kernel lands.

        Returns a ``BackgroundKernel`` immediately; ``bk[grid](*args)`` calls ``fallback(*args)``
        until the compiled kernel is ready, then the kernel. It never blocks the caller; a failed
        compile keeps the fallback (``bk.error`` says why).
        """
        return _progressive.background(self._progressive_host(), spec, fallback)

    def torch_host(self) -> TorchHost:
        """What torch.compile served by this pool (``acompile.inductor.serve(pool)``) may use of
        it: its tiers, its executor, a way in from torch's threads. Raises ``PoolClosedError``
        outside ``async with``."""
        from acompile._torch import HostPoolExecutor, TorchHost

        self._check_running()
        assert self._portal is not None and self._workers is not None
        return TorchHost(
            portal=self._portal,
            find=self._cache.find_record,
            store=functools.partial(self._cache.put_record, backend="torch"),
            claim=self._cache.claim,
            release=self._cache.release,
            run=self._run_traced,
            wait_ready=self.wait_ready,
            size=self._workers.stats()["workers"]["size"],
            shared=self._shared is not None,
            trusted=self._shared is not None and self._shared.trusted,
            cache_root=self._cache.root,
            fleet_wait=self._cache.fleet_wait,
            record=self._record_module if self._recorder is not None else None,
            late=self._late,
            is_ready=lambda: self.ready,
            host_pool=isinstance(self.executor, HostPoolExecutor),
        )

    async def _run_traced(self, job: Job) -> Any:
        """A job of torch.compile's (or a served JIT library's build) on the executor, in this
        pool's traces and metrics; torch.compile's counted after ready (a build's is counted by
        ``ServedBuilds``, which may refuse it)."""
        start = time.perf_counter()
        backend = _job_backend(job)
        if backend == "torch":
            self._after_ready.note("torch", job.name)
        try:
            return await self.executor.run(job)
        finally:
            if self._tracer is not None:
                self._tracer.job(job, start, time.perf_counter())
            if self._listeners:
                self._job_done(backend, job)

    def _progressive_host(self) -> _progressive.ProgressiveHost:
        """What progressive and background compiles may use of this pool (it must be running):
        its requests, its task group (nothing they start outlives the pool), its spec check."""
        self._check_running()
        assert self._tg is not None
        return _progressive.ProgressiveHost(self.compile_with_tier, self._tg.start_soon, backend_of)

    @overload
    async def gather(
        self, *specs: TritonSpec, return_exceptions: Literal[False] = False, background: bool = False
    ) -> list[TritonKernel]: ...

    @overload
    async def gather(
        self, *specs: TritonSpec, return_exceptions: Literal[True], background: bool = False
    ) -> list[TritonKernel | AcompileError]: ...

    @overload
    async def gather(
        self, *specs: Spec, return_exceptions: Literal[False] = False, background: bool = False
    ) -> list[Kernel]: ...

    @overload
    async def gather(
        self, *specs: Spec, return_exceptions: bool, background: bool = False
    ) -> list[Kernel | AcompileError]: ...

    async def gather(
        self, *specs: Spec, return_exceptions: bool = False, background: bool = False
    ) -> list[Any]:
        """Compile many specs at once; results in the order given.

        With ``return_exceptions=True`` a failed spec's place holds its exception and the others
        go on; otherwise the first failure cancels the rest and is raised. Something that is
        not a spec is the caller's mistake, not a compile's failure: its ``TypeError`` is
        raised either way.
        """
        results: list[Any] = [None] * len(specs)
        failure: list[BaseException] = []
        await self._prepare_ahead(specs)
        batch = _Batch.of(self._workers, len(specs))

        async def one(i: int, spec: Any) -> None:
            arrival = _Arrival(batch) if batch is not None else None
            _arrival.set(arrival)
            try:
                results[i] = await self.compile(spec, background=background)
            except AcompileError as exc:
                if return_exceptions:
                    results[i] = exc
                else:
                    failure.append(exc)
                    tg.cancel_scope.cancel()
            except Exception as exc:
                # Not a compile's failure (a wrong argument: not a spec): raised as it is, not
                # inside an exception group, whatever return_exceptions says.
                failure.append(exc)
                tg.cancel_scope.cancel()
            finally:
                if arrival is not None:
                    arrival.arrive()  # a hit, or an error: no job of its own coming

        try:
            async with anyio.create_task_group() as tg:
                for i, spec in enumerate(specs):
                    tg.start_soon(one, i, spec)
                    if i % _SPAWN_SLICE == _SPAWN_SLICE - 1:
                        # Starting a task and its first step (the cache look-up) cost 50-80 us of
                        # the loop each: 68 at once held it 3-6 ms. The batch still orders their
                        # jobs together.
                        await anyio.lowlevel.checkpoint()
        finally:
            if batch is not None:
                batch.release()
        if failure:
            raise failure[0]
        return results

    async def _prepare_ahead(self, specs: Sequence[Spec]) -> None:
        """Do what the requests of a ``gather()`` will each wait for while they are prepared,
        for all of them at once, where their backend can (Triton's keys of their functions:
        one job of its parse thread for all, rather than one per function as each request's
        turn on the loop comes), and wait for it before the requests start: the loop, idle
        meanwhile, leaves the thread the interpreter's lock (started beside the requests, the
        keys and the requests' work took turns on it, and a 16-CPU host's warm start of 68
        kernels took 15% longer). Each request still checks its own spec and raises its own
        error; a spec that is not one is left to its request."""
        if self._state != "running":
            return
        by_backend: dict[str, list[Any]] = {}
        for spec in specs:
            try:
                by_backend.setdefault(backend_of(spec), []).append(spec)
            except Exception:  # not a spec (even one whose repr fails): its request says so
                continue
        for name, group in by_backend.items():
            if len(group) < 2 or BACKENDS[name].parent not in sys.modules:
                continue  # one request gains nothing; a backend not loaded yet loads in its requests
            ahead = getattr(load_parent(name), "prepare_ahead", None)
            if ahead is not None:
                for ended in ahead(group):
                    await ended.wait()

    # -- introspection ---------------------------------------------------------------------------

    @property
    def target(self) -> Target | None:
        """The default target of this pool's requests."""
        return self._target

    @property
    def cache_dir(self) -> Path:
        return self._cache.root

    @property
    def shared_cache(self) -> SharedCache | None:
        """The tier the pool shares with a fleet (where, signed or trusted, how long it waits for
        another replica), or None."""
        return self._shared

    def stats(self) -> Stats:
        """A snapshot of the pool, as plain data (cheap; nothing is measured on the call).

        ``workers``: size, alive, busy, awake (False while quiesced), started, forked (from the
        template), restarts by cause (crash, killed, memory, timeout, abandoned, stopped: by
        ``quiesce()`` or shutdown),
        resident memory per worker in MiB (measured every few seconds) and its mean.
        ``jobs``: queued, running, done, failed, cancelled, retried. ``cache``: entries and hits
        by tier. ``compile_seconds``: p50, p90, p99, max of recent jobs; ``slowest``: the ten
        slowest compiles as [name, seconds]. ``after_ready``: whether ``mark_ready()`` was
        called, and what was compiled since (counts by backend, the latest names).
        """
        workers = self._workers
        ex = workers.stats() if workers else idle_stats(self._size)
        cache = self._cache.stats()
        return {
            "state": self._state,
            "target": str(self._target) if self._target else None,
            "workers": ex["workers"],
            "jobs": ex["jobs"],
            "cache": cache,
            "compiled": self._counts["compiled"],
            "failed": self._counts["failed"],
            "compile_seconds": _percentiles(sorted(ex["job_seconds"])),
            "slowest": [[name, round(sec, 4)] for sec, name in sorted(ex["slowest"], reverse=True)],
            "after_ready": self._after_ready.stats(),
        }


# The backend a job's worker-side module compiles for (metrics' label).
_JOB_BACKENDS = {
    "acompile._backends._triton_worker": "triton",
    "acompile._backends._native_worker": "native",
    "acompile._torch._worker": "torch",
    "acompile._jit._worker": "jit",
}


def _job_backend(job: Job) -> str:
    return _JOB_BACKENDS.get(job.backend, "other")


def _variant(request: Request) -> str:
    """A request as a warning names it: the kernel and its constexprs (``add_kernel[BLOCK=128]``),
    or its key's first characters."""
    payload = getattr(request, "payload", None)
    constexprs = payload.get("constexprs") if isinstance(payload, dict) else None
    if constexprs:
        text = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in constexprs.items())
        return f"{request.name}[{text[:200]}]"
    return f"{request.name}[{request.key[:12]}]"


def _percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/max of sorted values (nearest rank)."""
    if not values:
        return {}

    def rank(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": values[-1]}


def _path_argument(name: str, value: str | os.PathLike[str] | None) -> Path | None:
    """A path argument as a ``Path``; ``TypeError`` naming the argument for anything else (an
    empty string would be the current folder, which nobody means)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {value!r}")
    if not os.fspath(value).strip():
        raise ValueError(f"{name} is empty; give a folder's path (or leave it out for the default)")
    return Path(value)


def _check_backends(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) to preload: {unknown}; known: {sorted(BACKENDS)}")
