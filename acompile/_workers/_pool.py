"""``WorkerPool``: the local executor. Worker processes on this machine, fed from one queue.

``WorkerPool`` is the process half of ``CompilePool``: it knows nothing of kernels or caches. It
is the skeleton every executor shares (``_slots.SlotExecutor``: the slots and their epochs, the
queue, the start-failure policy, the retry of a job whose worker was killed from outside, the
idle timer) over *local runners* (``LocalRunners``): each slot's runner is one worker process,
which takes jobs from the shared queue (``_queue``: urgent before background, the longest
expected first; a job for an idle worker is sent to it from the submitter's task, without
waiting for the slot's) and is replaced whenever the worker dies, passes its memory limit, runs
past the job time limit, or runs a job nobody waits for any more (the only way to stop a compiler
is to stop its process). A slot takes jobs as soon as its worker is ready, whatever the other
slots are doing.

Workers are forked from a *template* (``_template``): a process that did a worker's whole preload
once; a forked worker is ready in milliseconds. Where no template can be had (it has threads, or
fails), workers start as fresh interpreters (``acompile._workers._main``, through ``_BOOT``) through anyio's
process API, which take a second to preload.

The template outlives the skeleton's epochs (``quiesce()`` stops every worker, ``wakeup()`` starts
them again), so waking is a matter of forks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel

# Resolved here, at import: anyio imports its subprocess module on first use, which would be on
# the event loop, in the pool's start (~5 ms).
from anyio import open_process

try:
    # anyio imports its asyncio backend at the first anyio call made in a running loop: in a plain
    # asyncio program (asyncio.run, a server framework), that is the pool's start, and ~10 ms of
    # the loop on 2 cores. A private module: without it, the pool only pays that once.
    import anyio._backends._asyncio
except ImportError:  # pragma: no cover - another anyio's layout
    pass

from acompile._errors import (
    CompileError,
    CompileTimeoutError,
    WorkerCrashedError,
    WorkerStartError,
)
from acompile._sizing import usable_cpus
from acompile._trust import own_folder
from acompile._workers import _bytecode, _protocol
from acompile._workers._config import BackendConfig, WorkerConfig
from acompile._workers._process import (
    EXTERNAL,
    ForkedWorker,
    SpawnedWorker,
    Worker,
    cpu_waits,
    describe_exit,
    is_stopped,
    kill_group,
    lower_priority,
    raise_priority,
    sample_all,
    short_backend,
    stderr_tail,
    stop,
)
from acompile._workers._queue import Job, JobCancelled, Taker
from acompile._workers._settings import WorkerSettings
from acompile._workers._slots import SlotExecutor, TransientStartError
from acompile._workers._template import Template, UnixListener, stop_template

logger = logging.getLogger("acompile")

# The worker imports acompile before it reads its configuration (and the parent's sys.path):
# it must find the same acompile the parent runs.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A pool process's first statement makes it a process group of its own: stopping the group stops
# the compilers it started (ptxas, nvcc, cc1plus) too, and a terminal's Ctrl-C, which goes to the
# caller's group, is the caller's to handle. A group, not a session: where the kernel schedules
# sessions as groups (autogroup, on in most distributions' kernels), a session of its own would
# compete with the caller's session as an equal, whatever the policy of the tasks inside, and
# SCHED_IDLE workers would still take a CPU from the caller's event loop for milliseconds at a
# time. In the caller's session they yield to it at once.
_BOOT = "import os; os.setpgid(0, 0); from acompile._workers._main import main; main()"
# How long a worker that started before the pool's late configuration waits for it at most.
_LATE_CONFIG_WAIT = 10.0
# What a worker says around a wait inside a job that is not the job's work (_pause).
_PAUSES = (_protocol.Pause, _protocol.Resume)
# A worker stopped by a signal (SIGSTOP) this long is replaced; its job is retried.
_STOPPED_LIMIT = 5.0
# How often idle-policy workers are checked for starvation, how long they must have starved
# before they get a share, and the nice value they get then.
_STARVATION_CHECK_S = 0.5
_STARVED_SECONDS = 2.0
_STARVED_NICE = 5
# How long a worker's stream may stay open after the worker exited before the pool closes it.
_EXITED_GRACE = 1.0
# What a worker's stream raises when the worker is gone.
_STREAM_ENDED = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)


# --- the pool ---------------------------------------------------------------------------------


class WorkerPool(SlotExecutor["LocalRunners"]):
    """The local executor: a fixed number of worker slots on this machine, fed from one queue.

    Implements ``Executor`` (``SlotExecutor`` over ``LocalRunners``). ``serve()`` is started in
    the owner's task group and runs until that group is cancelled; it kills every worker (and the
    template) on the way out, whatever cancelled it. Jobs run one at a time per worker; a job
    nobody waits for any more has its worker stopped (``cancel()``).
    """

    def __init__(
        self,
        size: int,
        settings: WorkerSettings,
        workdir: str,
        *,
        bytecode_dir: str | None = None,
        bytecode_helpers: str = "",
        sys_path: tuple[str, ...] | None = None,
        cwd: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got workers={size}")
        self.settings = settings
        config: WorkerConfig = {
            # The owner's, as it gives them (a pool's at its entry), else this process's now.
            "sys_path": list(sys_path if sys_path is not None else sys.path),
            "cwd": cwd if cwd is not None else os.getcwd(),
            "target": settings.target,
            "preload": list(settings.preload),
            "nice": settings.nice,
            "bytecode_dir": bytecode_dir,
            "bytecode_helpers": bytecode_helpers,
        }
        runners = functools.partial(
            LocalRunners,
            config=config,
            workdir=workdir,
            memory_limit=settings.memory_limit,
            max_compile_seconds=settings.max_compile_seconds,
            use_template=settings.fork_workers,
        )
        super().__init__(
            size, runners, preload_timeout=settings.preload_timeout, idle_timeout=settings.idle_timeout
        )

    @staticmethod
    def make_workdir(prefix: str) -> str:
        """A new work folder for a pool (blocking): in the temporary folder, as ``mkdtemp`` makes
        one (this user's, mode 700, a name nobody can guess, made where nothing was), reached
        through no link, under folders no other user can swap it in (``_trust``: ``/tmp`` is
        sticky). Raises ``UntrustedFolderError`` where the temporary folder is not such a place."""
        folder = tempfile.mkdtemp(prefix=prefix, dir=os.path.realpath(tempfile.gettempdir()))
        try:
            own_folder(folder, "the pool's work folder", make=False)
            # And the folders above it: resolved, then checked.
            own_folder(folder, "the pool's work folder", resolve=True, make=False)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            raise
        return folder

    @property
    def config(self) -> WorkerConfig:
        """The workers' configuration (what each worker is started with)."""
        return self.runners.config

    @property
    def workdir(self) -> str:
        """The pool's work folder: the workers' stderr files, the template's socket."""
        return self.runners.workdir

    @property
    def memory_limit(self) -> int | None:
        """The resident memory (bytes) past which a worker is stopped, if any."""
        return self.runners.memory_limit

    @property
    def max_compile_seconds(self) -> float | None:
        """How long a job may run before its worker is stopped, if at all."""
        return self.runners.max_compile_seconds

    @property
    def use_template(self) -> bool:
        """Whether workers are forked from a template (else each starts as a fresh interpreter)."""
        return self.runners.use_template

    @property
    def alive(self) -> dict[int, Worker]:
        """The worker processes alive, ready or preloading, by process id."""
        return self.runners.alive

    def prepare_config_with(self, hook: Callable[[], Awaitable[BackendConfig]]) -> None:
        """See ``LocalRunners.prepare_config_with``."""
        self.runners.prepare_config_with(hook)


class LocalRunners:
    """Worker processes on this machine for a ``SlotExecutor``'s slots (implements ``Runners``):
    the template they are forked from, spawning where there is none, the workers' configuration,
    and the watches of their memory, of signals that stop them, and of CPU starvation."""

    def __init__(
        self,
        executor: SlotExecutor[LocalRunners],
        *,
        config: WorkerConfig,
        workdir: str,
        memory_limit: int | None,
        max_compile_seconds: float | None,
        use_template: bool,
    ) -> None:
        self.executor = executor
        self.config = config
        self.workdir = workdir
        self.memory_limit = memory_limit
        self.max_compile_seconds = max_compile_seconds
        self.preload_timeout = executor.preload_timeout
        self.use_template = use_template and hasattr(os, "fork") and sys.platform.startswith("linux")
        self.alive: dict[int, Worker] = {}
        self.template: Template | None = None
        self._spawn_lock = anyio.Lock()
        self._config_hook: Callable[[], Awaitable[BackendConfig]] | None = None
        self._prepared: WorkerConfig = {}  # what the hook returned
        self._config_started = False
        self._preloading_template: int | None = None  # a template's pid until it is ready
        self._template_failed = False
        self._templates_started = 0
        self._template_lock = anyio.Lock()

    # -- the Runners interface ---------------------------------------------------------------

    def live(self) -> int:
        """The worker processes alive, ready or preloading."""
        return len(self.alive)

    def encode(self, job: Job) -> None:
        """Encode ``job`` once, as its worker receives it (a retry sends the same frame); raises
        ``CompileError`` when something in the request does not pickle."""
        if job.frame is None:
            try:
                job.frame = _protocol.encode(_protocol.RunJob(job.id, job.backend, job.payload))
            except Exception as exc:
                raise _unsendable_error(job, exc) from exc

    async def start(self, slot: int) -> LocalRunner:
        """Start a worker for ``slot`` (forked from the template, or afresh) and wait for its
        preload; raises ``TransientStartError`` or ``WorkerStartError``."""
        if self._config_hook is not None and not self._config_started:
            # Not before the workers first start: a pool whose requests all hit the cache never
            # needs it.
            self._config_started = True
            self.executor.start_soon(self._prepare_config)
        return LocalRunner(self, await self._start_worker(slot))

    async def watch(self) -> None:
        """The workers' memory and stopped state, and under the idle policy, their starvation."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_memory)
            if self.config.get("nice") == "idle" and sys.platform.startswith("linux"):
                tg.start_soon(self._watch_starvation)

    async def close(self) -> None:
        """Stop the template (the workers' slots stopped them already)."""
        template, self.template = self.template, None
        if template is not None:
            await stop_template(template)

    # -- starting workers ----------------------------------------------------------------------

    def _work_folder(self) -> str:
        """The work folder, checked (blocking): this user's, private, no link; made again if
        something removed it (a /tmp cleaner). Raises ``UntrustedFolderError`` (another user's
        folder in its place, say) and ``OSError``."""
        own_folder(self.workdir, "the pool's work folder")
        return self.workdir

    def prepare_config_with(self, hook: Callable[[], Awaitable[BackendConfig]]) -> None:
        """Complete the workers' configuration with what ``hook()`` returns, computed when the
        workers first start (not before: a pool whose requests all hit the cache never needs
        it). Nothing waits for it: a template preloads, workers are forked or spawned and take
        jobs meanwhile (the first time on a machine, Triton's hash of its binaries takes longer
        than a worker's start). A worker started after the hook returned gets its result in its
        configuration; one started before reads it when a job needs it (``_late.prepared``),
        from the file written here once the hook is over (``{}`` if it failed: the worker then
        computes what it needs itself)."""
        self._config_hook = hook
        self.config["late_config"] = os.path.join(self.workdir, "late-config.json")
        # A worker that finds no file by then (it could not be written, a cleaner removed it)
        # computes what it needs itself rather than wait any longer.
        self.config["late_config_timeout"] = min(self.preload_timeout, _LATE_CONFIG_WAIT)

    async def _prepare_config(self) -> None:
        assert self._config_hook is not None
        try:
            # Bounded as a preload is: a hook that hangs (Triton's hash of its binaries on a
            # stalled file system) must not hold every worker's start.
            with anyio.fail_after(self.preload_timeout):
                # A BackendConfig's keys are WorkerConfig's too (it is its base).
                self._prepared = cast("WorkerConfig", dict(await self._config_hook()))
            self.config.update(self._prepared)
        except TimeoutError:
            logger.warning(
                "the workers' configuration took more than preload_timeout=%g s here; workers will "
                "compute what they need themselves",
                self.preload_timeout,
            )
        except Exception as exc:
            # Not fatal: each worker then computes what it needs itself, at some cost.
            logger.warning(
                "cannot prepare the workers' configuration here (%s); workers will compute what they "
                "need themselves",
                exc,
            )
        try:
            # Bounded: a write that hangs (a stalled file system) must not hold this task.
            with anyio.fail_after(self.config["late_config_timeout"]):
                path, prepared = self.config["late_config"], self._prepared
                write = functools.partial(self._write_late_config, path, prepared)
                await anyio.to_thread.run_sync(write, abandon_on_cancel=True)
        except (OSError, TypeError, ValueError, TimeoutError) as exc:
            # The workers that started without it wait until late_config_timeout, then compute
            # what they need themselves.
            logger.warning("cannot hand the workers their configuration (%s)", exc)
        # Workers started from now on have all there is in their configuration: none looks for
        # the file (where the hook failed and the file could not be written, each would wait
        # late_config_timeout for it).
        self._prepared = {**self._prepared, "late_config": ""}
        self.config["late_config"] = ""

    def _write_late_config(self, path: str, prepared: WorkerConfig) -> None:
        self._work_folder()
        _bytecode.write_whole(path, json.dumps(prepared).encode())  # a worker never reads half

    def _stderr_file(self, name: str) -> str:
        """A new, empty fd-2 file for a worker or the template in the work folder (made again
        if something removed it: a /tmp cleaner). Read-write (the worker reads its own tail
        back) and append-only (after the worker truncates it at a job's start, writes land at
        the new end, not at the old offset). Made anew, never opened as it was found: whatever
        is at its name (the last worker's file, a link to a file of ours) is removed, not
        truncated or followed. Raises ``WorkerStartError`` where it cannot be made (the work
        folder is not this user's alone, say): that start fails, and is tried again, as any
        other."""
        path = os.path.join(self.workdir, name)
        try:
            self._work_folder()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC
            os.close(os.open(path, flags, 0o600))
        except OSError as exc:
            raise WorkerStartError(
                f"cannot make the worker's stderr file {path}: {exc.strerror or exc}"
            ) from exc
        return path

    async def _start_worker(self, slot: int) -> Worker:
        stderr_path = self._stderr_file(f"worker-{slot}.stderr")
        slot_config: WorkerConfig = {
            "triton_cache_dir": os.path.join(self.workdir, f"triton-{slot}"),
            "scratch_dir": os.path.join(self.workdir, f"scratch-{slot}"),
            "stderr_path": stderr_path,
        }
        template = await self._get_template() if self.use_template else None
        t0 = time.perf_counter()
        worker: Worker
        if template is not None:
            # What the hook computed, if it is over; if not, the worker reads it later (late_config).
            pid, connection = await template.fork(slot, {**slot_config, **self._prepared})
            worker = ForkedWorker(connection, pid, stderr_path)
            template.adopt(worker)
            self.executor.counters.forked += 1
        else:
            worker = await self._spawn(stderr_path)
        self.alive[worker.pid] = worker
        try:
            if isinstance(worker, SpawnedWorker):
                await worker.send_bytes(_protocol.encode(dict(self.config, **slot_config)))
            with anyio.fail_after(self.preload_timeout):
                reply = await worker.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            self.alive.pop(worker.pid, None)
            code = await stop(worker)
            tail = await anyio.to_thread.run_sync(stderr_tail, stderr_path)
            error = start_error(code, tail)
            raise error(f"worker process {describe_exit(code)} during preload\n{tail}".rstrip()) from exc
        except TimeoutError:
            self.alive.pop(worker.pid, None)
            await stop(worker)
            raise WorkerStartError(
                f"a worker did not finish its preload within preload_timeout={self.preload_timeout:g} s"
                + _starved(self.config)
            ) from None
        except BaseException:
            self.alive.pop(worker.pid, None)
            await stop(worker)
            raise
        if not isinstance(reply, _protocol.Ready):
            self.alive.pop(worker.pid, None)
            await stop(worker)
            raise WorkerStartError(f"worker preload failed: {_failure(reply)}")
        self.executor.counters.started += 1
        self.executor.counters.preload_s.append(time.perf_counter() - t0)
        logger.debug("worker pid %d ready in %.3f s", worker.pid, time.perf_counter() - t0)
        return worker

    def _command(self, *extra: str) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env["ACOMPILE_PARENT_PID"] = str(os.getpid())
        env["ACOMPILE_WORKER"] = "1"  # imports only what its backends use (acompile._lazy)
        env["ACOMPILE_WORKDIR"] = self.workdir  # removed by the process if this one is killed
        env["ACOMPILE_WORKER_NICE"] = str(self.config.get("nice", 0))
        env["ACOMPILE_PARENT_NICE"] = str(os.nice(0))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # Only what this pool says (not what this process's own environment may hold).
        env.pop(_bytecode.ENV, None)
        env.pop(_bytecode.HELPERS_ENV, None)
        if bytecode_dir := self.config.get("bytecode_dir"):
            # Their imports' bytecode, in the cache, where the installation has none (_bytecode).
            env[_bytecode.ENV] = bytecode_dir
            if "--template" in extra and self.config.get("bytecode_helpers"):
                env[_bytecode.HELPERS_ENV] = self.config["bytecode_helpers"]
        return [sys.executable, "-c", _BOOT, *extra, *self.config.get("preload", ())], env

    async def _open(self, command: list[str], env: dict[str, str], stderr_path: str) -> anyio.abc.Process:
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        stderr_fd = os.open(stderr_path, flags, 0o600)  # made by _stderr_file a moment ago
        try:
            # Starting a process blocks the loop until the child has exec'd (a few ms). One at a
            # time, with the loop's other work in between: sixteen slots starting in the same
            # loop iteration would otherwise stall it for all sixteen.
            async with self._spawn_lock:
                # Shielded: a cancellation that lands inside open_process (a pool left within
                # milliseconds) would lose the process object with the child already running,
                # and nobody would reap it. The start takes milliseconds; the check below
                # handles the cancellation.
                with anyio.CancelScope(shield=True):
                    process = await open_process(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr_fd,
                        cwd=self.config["cwd"],
                        env=env,
                        # Not a session of its own: see _BOOT.
                    )
                lower_priority(process.pid, self.config.get("nice", 0))
                try:
                    await anyio.lowlevel.checkpoint()
                except BaseException:
                    # Cancelled right after the start: nobody else knows this process yet.
                    with anyio.CancelScope(shield=True):
                        kill_group(process.pid, unreaped=True)
                        await process.wait()
                        await process.aclose()
                    raise
        finally:
            os.close(stderr_fd)
        return process

    async def _spawn(self, stderr_path: str) -> SpawnedWorker:
        command, env = self._command()
        return SpawnedWorker(await self._open(command, env, stderr_path), stderr_path)

    async def _get_template(self) -> Template | None:
        """The template to fork from, started (or started again) if need be; None where
        workers must start afresh (no template can be had)."""
        async with self._template_lock:
            if self.template is not None and not self.template.lost.is_set():
                return self.template
            lost, self.template = self.template, None
            if lost is not None:
                # Usually dead already; one whose stream broke may still run: it goes now.
                await stop_template(lost, at_once=True)
            if self._template_failed:
                return None
            try:
                self.template = await self._start_template()
            except TransientStartError:
                # Killed from outside while it preloaded: the slot tries again, and so will this.
                self.template = None
                raise
            except WorkerStartError as exc:
                logger.warning(
                    "cannot start a template to fork workers from (%s); starting each worker afresh", exc
                )
                self._template_failed = True
                self.template = None
            return self.template

    async def _keep_template(self, template: Template) -> None:
        """When the template dies while the pool runs, start another in the background: a
        later wake-up (or a replacement worker) then costs a fork, not a preload."""
        await template.lost.wait()
        failures = 0
        while not self.executor.closed:
            current = self.template
            if current is not None and current is not template and not current.lost.is_set():
                return  # a slot started one already; it has a keeper of its own
            try:
                await self._get_template()
                return
            except WorkerStartError:
                failures += 1
                await anyio.sleep(min(0.05 * 2**failures, 2.0))

    async def _start_template(self) -> Template:
        stderr_path = self._stderr_file("template.stderr")  # the work folder checked: ours alone
        self._templates_started += 1
        address = os.path.join(self.workdir, f"workers-{self._templates_started}.sock")
        try:
            listener = UnixListener(address)
        except OSError as exc:
            raise WorkerStartError(
                f"cannot listen for forked workers at {address}: {exc.strerror or exc}"
            ) from exc
        command, env = self._command("--template")
        try:
            process = await self._open(command, env, stderr_path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            raise
        template = Template(process, address)
        self._preloading_template = process.pid
        try:
            # Sent at once, without waiting for the configuration hook (Triton's hash of its own
            # binaries, computed in this process): the template's preload overlaps it, and each
            # worker it forks gets the hook's result with its fork (_start_worker).
            await template.stdin.send(
                _protocol.encode(
                    dict(self.config, triton_cache_dir=os.path.join(self.workdir, "triton-template"))
                )
            )
            with anyio.fail_after(self.preload_timeout):
                reply = await template.receive()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await stop_template(template, at_once=True)
            if isinstance(exc, (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError)):
                code = template.process.returncode
                tail = await anyio.to_thread.run_sync(stderr_tail, stderr_path)
                error = start_error(code, tail)
                raise error(
                    f"the template process {describe_exit(code)} during preload\n{tail}".rstrip()
                ) from exc
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(
                    "the template did not finish its preload within "
                    f"preload_timeout={self.preload_timeout:g} s" + _starved(self.config)
                ) from None
            raise
        finally:
            self._preloading_template = None
        if not isinstance(reply, _protocol.Ready):
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await stop_template(template, at_once=True)
            raise WorkerStartError(f"template preload failed: {_failure(reply)}")
        threads = reply.threads
        if threads != 1:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await stop_template(template)
            raise WorkerStartError(
                f"the template has {threads} threads after its preload; forking it is unsafe"
            )
        self.executor.start_soon(template.listen)
        self.executor.start_soon(template.serve_connections, listener)
        self.executor.start_soon(self._keep_template, template)
        logger.debug("template pid %d ready in %.3f s", template.pid, reply.preload_s)
        return template

    async def _watch_starvation(self) -> None:
        """Give idle-policy workers a share of the CPU once other work starves them.

        Under ``SCHED_IDLE`` a worker runs only on a CPU nobody else wants. Where the machine's
        other work (other processes at normal priority, in the same container or cgroup, where
        the kernel does not group sessions apart) keeps every CPU busy, the template would not
        finish its preload and jobs would not run until that work ends. When the pool's
        processes have waited for a CPU for most of ``_STARVED_SECONDS`` while running almost
        not at all, they (and their compilers) move to nice +5, as do the workers started
        later: slower for the event loop's wake-ups, but compiling. It is logged, once, and not
        undone for the pool's life. From then on, a pool process still under the idle policy
        (one that was starting, and applied it to itself only after the switch) is moved too.
        """
        last: dict[int, tuple[float, int, int]] = {}
        last_together: tuple[float, int] | None = None
        starved_since: float | None = None
        cpus = await anyio.to_thread.run_sync(usable_cpus)  # reads the cgroup's quota files
        while True:
            await anyio.sleep(_STARVATION_CHECK_S)
            pids = [worker.pid for worker in self.alive.values()]
            template = self.template
            pid: int | None
            if template is not None and not template.lost.is_set():
                pids.append(template.pid)
            elif self._preloading_template is not None:
                pids.append(self._preloading_template)
            if self.config.get("nice") != "idle":
                await anyio.to_thread.run_sync(raise_priority, pids, _STARVED_NICE)
                continue
            samples, ran_together = await anyio.to_thread.run_sync(cpu_waits, pids)
            now = time.monotonic()
            starved = False
            for pid, (ran, waited) in zip(pids, samples, strict=True):
                before = last.get(pid)
                if before is not None:
                    span = now - before[0]
                    ran_s, waited_s = (ran - before[1]) / 1e9, (waited - before[2]) / 1e9
                    starved = starved or (waited_s > 0.5 * span and ran_s < 0.25 * waited_s)
            if last_together is not None and starved:
                # Waiting behind each other is not starvation: more workers than CPUs, all busy,
                # each waits most of the time. Starved is when the pool as a whole gets less
                # than half the CPUs it could use.
                span = now - last_together[0]
                usable = min(len(pids), cpus)
                starved = (ran_together - last_together[1]) / 1e9 < 0.5 * usable * span
            last = {pid: (now, *sample) for pid, sample in zip(pids, samples, strict=True)}
            last_together = (now, ran_together)
            starved_since = (starved_since or now) if starved else None
            if starved_since is not None and now - starved_since >= _STARVED_SECONDS:
                logger.warning(
                    "the pool's workers waited %.0f s for a CPU under worker_nice='idle' (other work "
                    "keeps every CPU busy); running them at nice +5 from now on",
                    now - starved_since + _STARVATION_CHECK_S,
                )
                self.config["nice"] = _STARVED_NICE
                await anyio.to_thread.run_sync(raise_priority, pids, _STARVED_NICE)

    async def _watch_memory(self) -> None:
        """Measure every worker's memory (for stats) and stop any that passes the limit, or
        that has been stopped by a signal (SIGSTOP, SIGTSTP) for longer than _STOPPED_LIMIT:
        a stopped worker never answers, and its job is better retried on a fresh one."""
        interval = 0.2 if self.memory_limit is not None else 1.0
        template_stopped: tuple[int, float] | None = None  # (its pid, stopped since)
        while True:
            await anyio.sleep(interval)
            workers = list(self.alive.values())
            # A stopped template forks nothing, ready or still starting (it would hold every
            # request for preload_timeout): it is replaced as a stopped worker is.
            template = self.template
            pid: int | None
            if template is not None and not template.lost.is_set():
                pid, starting = template.pid, False
            else:
                pid, starting = self._preloading_template, True
            if pid is None or not await anyio.to_thread.run_sync(is_stopped, pid):
                template_stopped = None
            elif template_stopped is None or template_stopped[0] != pid:
                template_stopped = (pid, time.monotonic())
            elif time.monotonic() - template_stopped[1] >= _STOPPED_LIMIT:
                logger.warning(
                    "the template pid %d has been stopped by a signal%s; replacing it",
                    pid,
                    " while it started" if starting else "",
                )
                kill_group(pid, unreaped=True)
                template_stopped = None
            if not workers:
                continue
            samples = await anyio.to_thread.run_sync(sample_all, [w.pid for w in workers])
            now = time.monotonic()
            for worker, (rss, stopped) in zip(workers, samples, strict=True):
                if stopped:
                    worker.stopped_since = worker.stopped_since or now
                    if now - worker.stopped_since >= _STOPPED_LIMIT and worker.stop_cause is None:
                        worker.stop_cause = "killed"  # from outside: its job is retried once
                        logger.warning(
                            "worker pid %d has been stopped by a signal for %.0f s; replacing it",
                            worker.pid,
                            now - worker.stopped_since,
                        )
                        worker.signal_kill()
                else:
                    worker.stopped_since = None
                if rss is None:
                    continue
                self.executor.counters.worker_rss[worker.pid] = rss
                if self.memory_limit is not None and rss > self.memory_limit and worker.stop_cause is None:
                    worker.stop_cause = "memory"
                    logger.warning(
                        "worker pid %d uses %d MiB, past the limit of %d MiB; stopping it",
                        worker.pid,
                        rss >> 20,
                        self.memory_limit >> 20,
                    )
                    worker.signal_kill()


class LocalRunner:
    """One worker process serving a slot (implements ``Runner``).

    Jobs reach the worker without the slot's task: a submitter starts a job on the idle worker
    through the worker's ``Taker`` (``_start``), and a reply, as it arrives, finishes its job and
    starts the next queued one (``_finish``, called by the worker's connection: a job's round
    trip is one loop iteration for the reply and one step of its caller's task).
    """

    def __init__(self, runners: LocalRunners, worker: Worker) -> None:
        self.runners = runners
        self.executor = runners.executor
        self.worker = worker
        # A submitter starts its job on this worker, if idle, through the taker (put()).
        self.taker = Taker(self._start)

    async def serve(self) -> str:
        """Run jobs on the worker until it must be replaced; returns why."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            cause = await self._serve()
            tg.cancel_scope.cancel()
        return cause

    async def stop(self, cause: str) -> None:
        """Stop the worker (and the compilers it started) and forget it."""
        worker = self.worker
        self.executor.queue.withdraw(self.taker)
        if worker.deadline is not None:
            worker.deadline.cancel()
        self.runners.alive.pop(worker.pid, None)
        self.executor.counters.worker_rss.pop(worker.pid, None)
        code = await stop(worker)
        logger.debug("worker pid %d stopped (%s, %s)", worker.pid, cause, describe_exit(code))

    def _take_next(self) -> None:
        """The idle worker's next job: the first queued one, started now, or else the next one
        submitted (the taker waits in the queue for it; ``put()`` starts it through
        ``_start``)."""
        if not self.executor.awake:
            return  # the epoch ends: the slot's task is cancelled where it waits
        queue = self.executor.queue
        job = queue.pop()
        if job is None:
            queue.offer(self.taker)
        elif not self._start(job):
            queue.put(job, front=True)  # the worker is gone: the slot sees its end next

    def _start(self, job: Job) -> bool:
        """Send ``job`` to the worker and mark it running there; False if the worker cannot
        take it (it is gone, or the epoch ends): the job stays queued. Called from the slot
        (``_take_next``) or, as ``taker.deliver``, in a submitter's task (``JobQueue.put``)."""
        worker = self.worker
        if not self.executor.awake or worker.exited.is_set() or worker.job is not None:
            return False
        assert job.frame is not None
        try:
            sent = worker.send_nowait(job.frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        if not sent:
            self.executor.start_soon(self._send, worker, job.frame)
        worker.job = job
        # Nobody waits for it any more: stopping its process is the only way to stop a compiler
        # (the slot sees the end of its stream, and the job's flag).
        self.executor.job_started(job, worker.pid, worker.signal_kill)
        limit = self.runners.max_compile_seconds
        if limit is not None and worker.deadline is None:
            # One timer per worker, not per job: it looks at the job running when it fires.
            worker.deadline = asyncio.get_running_loop().call_later(limit, self._check_deadline)
        return True

    @staticmethod
    async def _send(worker: Worker, frame: bytes) -> None:
        """Send a job's frame to a worker that cannot take it without waiting (a spawned one)."""
        try:
            await worker.send_bytes(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the worker is gone: its slot sees its end

    def _check_deadline(self) -> None:
        """The worker's timer: stop it if its job has run past ``max_compile_seconds`` (its slot
        sees the end of its stream, and the flag), else look again when the job would."""
        worker = self.worker
        limit = self.runners.max_compile_seconds
        assert limit is not None
        worker.deadline = None
        job = worker.job
        if job is None:
            return  # idle: set again at its next job
        now = time.perf_counter()
        left = limit - self._counted(job, now)
        if left > 0 and worker.paused_at is not None:
            # Paused: nothing counts until the pause has lasted as long as it may.
            left += max(0.0, self._pause_limit() - job.paused - (now - worker.paused_at))
        if left > 0:
            worker.deadline = asyncio.get_running_loop().call_later(left, self._check_deadline)
        else:
            worker.timed_out = True
            worker.signal_kill()

    def _counted(self, job: Job, now: float) -> float:
        """How much of the running ``job``'s time until ``now`` is its own: what its worker
        spent waiting for something else (``_late.paused``: the pool's late configuration, a
        hash of Triton's binaries) is not, up to how long such a wait may take (preloading, and
        the late configuration's wait), so that a wait that hangs still ends in the limit."""
        paused = job.paused
        if self.worker.paused_at is not None:
            paused += now - self.worker.paused_at
        return now - job.started_at - min(paused, self._pause_limit())

    def _pause_limit(self) -> float:
        """The longest a job's pauses count for (``_counted``)."""
        return self.runners.preload_timeout + float(self.runners.config.get("late_config_timeout", 0.0))

    def _end_job(self) -> Job | None:
        """The job the worker ran, now that it is over (answered, lost or put back), or None
        if it ran none."""
        worker = self.worker
        job, worker.job = worker.job, None
        if job is None:
            return None
        self.executor.job_ended(job, max(0.0, self._counted(job, time.perf_counter())))
        worker.paused_at = None
        return job

    async def _watch(self) -> None:
        """Take an exited worker out of the queue at once; if its stream stays open (a process
        it forked holds it), close it, so that its slot sees the end."""
        await self.worker.wait_exit()
        self.executor.queue.withdraw(self.taker)
        await anyio.sleep(_EXITED_GRACE)
        await self.worker.close()

    async def _serve(self) -> str:
        """Run jobs on the worker until it must be replaced; returns why.

        This task waits for what ``_finish`` does not take: the end of the worker's stream (its
        death, idle or not), a reply to a job nobody waits for or that ran out of time, a big
        reply to decode on a thread. Where a worker cannot call ``_finish`` itself (a spawned
        one), every reply comes here and this task calls it.
        """
        worker, executor = self.worker, self.executor
        worker.answer_with(self._finish)
        self._take_next()
        while True:
            try:
                reply = await worker.receive()
            except _STREAM_ENDED:
                reply = None
            except BaseException:
                # The epoch ended (quiesce) or the pool is shutting down: the running job goes
                # back to the front of the queue; shutdown fails what is left there.
                executor.queue.withdraw(self.taker)
                job = self._end_job()
                if job is not None:
                    executor.put_back(job)
                raise
            if reply is not None and self._finish(reply):
                continue
            job = self._end_job()
            if job is None:
                executor.queue.withdraw(self.taker)
                if reply is not None:
                    logger.error("idle worker pid %d sent %s; replacing it", worker.pid, _described(reply))
                    return "crash"
                code = await stop(worker)
                logger.warning("idle worker pid %d %s; replacing it", worker.pid, describe_exit(code))
                return "killed" if code in EXTERNAL else "crash"
            if job.abandoned:
                # Every waiter left while it ran: its worker was stopped (job.stopper).
                job.finish(error=JobCancelled(job.name))
                return "abandoned"
            if worker.timed_out:
                limit = self.runners.max_compile_seconds or 0.0
                executor.fail(job, _timeout_error(job, limit, self.runners.config))
                logger.warning("%s ran past max_compile_seconds=%s; stopping its worker", job.name, limit)
                return "timeout"
            if reply is None:
                return await self._lost_during(job)
            # Not the reply to this job: the worker (or the stream) is broken; the job fails, as
            # if the worker crashed running it, and the worker is replaced.
            problem = f"the worker sent {_described(reply)} instead of the reply to {job.name!r}"
            logger.error("worker pid %d: %s; replacing it", worker.pid, problem)
            executor.fail(job, _protocol_error(job, problem))
            return "crash"

    def _pause(self, job: Job | None, message: _protocol.Pause | _protocol.Resume) -> bool:
        """A worker's ``Pause`` or ``Resume`` of its running job (``_counted``); False for one
        that is not about the job it runs (a broken stream: the slot's task deals with it)."""
        if job is None or message.id != job.id:
            return False
        worker = self.worker
        now = time.perf_counter()
        if isinstance(message, _protocol.Pause):
            worker.paused_at = now
        elif worker.paused_at is not None:
            # The worker's own measure of its wait (this side reads its messages late when busy),
            # never more than the job has run.
            seconds = message.seconds if message.seconds >= 0 else 0.0  # NaN too
            job.paused = min(job.paused + seconds, now - job.started_at)
            worker.paused_at = None
        return True

    def _finish(self, reply: Any) -> bool:
        """Finish the job the worker runs with its ``reply`` and start the worker's next job;
        False (nothing done) for anything but the awaited reply to a job somebody still waits
        for, within its time: the slot's task deals with that."""
        job = self.worker.job
        if type(reply) in _PAUSES:
            return self._pause(job, reply)
        if (
            job is None
            or job.abandoned
            or self.worker.timed_out
            or not isinstance(reply, (_protocol.Done, _protocol.Error))
            or reply.id != job.id
        ):
            return False
        self._end_job()
        if isinstance(reply, _protocol.Done):
            self.executor.reply(job, result=reply.result)
        else:
            self.executor.reply(job, error=reply.error)
        self._take_next()
        return True

    async def _lost_during(self, job: Job) -> str:
        """The worker died while it ran job: retry or fail the job; returns the restart cause."""
        try:
            return await self._retry_or_fail(job)
        except BaseException:
            self.executor.put_back(job)  # the epoch ended meanwhile (quiesce, shutdown)
            raise

    async def _retry_or_fail(self, job: Job) -> str:
        worker, executor = self.worker, self.executor
        code = await stop(worker)
        # An exit nobody could report in time (its template stopped) came from outside too.
        cause = worker.stop_cause or ("killed" if code in EXTERNAL or code is None else "crash")
        if job.abandoned:
            job.finish(error=JobCancelled(job.name))  # its caller left meanwhile: no retry
            return cause
        if cause == "template":
            # The template it was forked from died, and took it along: not this job's doing,
            # and not counted against it.
            logger.warning(
                "worker pid %d went with its template while compiling %s; retrying it", worker.pid, job.name
            )
            executor.retry(job, spend=False)
            return "killed"
        if cause == "killed" and executor.retry(job):
            # Not the job's fault: once more, on a fresh worker, ahead of everything else.
            logger.warning(
                "worker pid %d %s while compiling %s; retrying it", worker.pid, describe_exit(code), job.name
            )
            return cause
        tail = await anyio.to_thread.run_sync(stderr_tail, worker.stderr_path)
        # Cancelled instead if its caller left while the tail was read.
        executor.fail(job, _crash_error(job, code, tail, cause, self.runners.memory_limit))
        if not job.abandoned:
            logger.error("worker pid %d %s while compiling %s", worker.pid, describe_exit(code), job.name)
        return cause


def start_error(code: int | None, tail: str) -> type[WorkerStartError]:
    """The error of a pool process that died while it started: transient (retried) when it came
    from outside: killed by a signal, or a Ctrl-C that reached it while its interpreter started
    (a new process is in the caller's process group until its first statement: Python then
    fails its start with status 1 and a KeyboardInterrupt)."""
    if code in EXTERNAL or (code == 1 and "KeyboardInterrupt" in tail):
        return TransientStartError
    return WorkerStartError


def _failure(reply: Any) -> str:
    """What a process that did not say ``Ready`` said instead."""
    if isinstance(reply, _protocol.Failed):
        return reply.message
    return f"unexpected message {reply!r}"


def _unsendable_error(job: Job, exc: Exception) -> CompileError:
    return CompileError(
        f"cannot send {job.name!r} to a worker: {type(exc).__name__}: {exc}",
        kernel=job.name,
        backend=short_backend(job.backend),
        log=str(exc),
    )


def _described(message: Any) -> str:
    """A message from a worker, for a log line: what it is, not what it holds."""
    if isinstance(message, _protocol.Undecodable):
        return f"a message that cannot be read here ({message.error})"
    return f"an unexpected {type(message).__name__}"


def _protocol_error(job: Job, problem: str) -> CompileError:
    backend = short_backend(job.backend)
    return WorkerCrashedError(problem, exit_code=None, kernel=job.name, backend=backend, stderr_tail="")


def _starved(config: WorkerConfig) -> str:
    """What a timeout's message adds when the workers run under SCHED_IDLE: the likely cause on a
    busy machine, and the way out."""
    if config.get("nice") != "idle":
        return ""
    return (
        " (workers run with worker_nice='idle': on a machine whose CPUs are busy with other work "
        "they get only the CPU time nobody else wants; worker_nice=5, the default, gives them a share)"
    )


def _timeout_error(job: Job, limit: float, config: WorkerConfig) -> CompileTimeoutError:
    return CompileTimeoutError(
        f"compiling {job.name!r} took longer than max_compile_seconds={limit:g}; its worker was "
        f"stopped{_starved(config)}",
        kernel=job.name,
        backend=short_backend(job.backend),
    )


def _crash_error(job: Job, code: int | None, tail: str, cause: str, memory_limit: int | None) -> CompileError:
    if cause == "memory":
        what = f"passed the pool's memory limit of {(memory_limit or 0) >> 20} MiB and was stopped"
    elif cause == "killed":
        what = f"{describe_exit(code)} twice (killed from outside; retried once)"
    else:
        what = describe_exit(code)
    return WorkerCrashedError(
        f"the worker compiling {job.name!r} {what}",
        exit_code=code,
        cause=cause,
        kernel=job.name,
        backend=short_backend(job.backend),
        stderr_tail=tail,
    )


# The name the executor interface knows it by.
LocalExecutor = WorkerPool
