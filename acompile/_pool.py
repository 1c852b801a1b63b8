"""Worker processes: start, preload, dispatch one job at a time, cancel, replace.

``WorkerPool`` is the process half of ``CompilePool``: it knows nothing of kernels or caches. It
runs a fixed number of slots inside the caller's task group; each slot owns at most one worker
process at a time, takes jobs from a shared queue, and replaces its worker whenever the worker
dies or a running job is abandoned (the only way to stop a compiler is to stop its process).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.buffered import BufferedByteReceiveStream

from acompile import _protocol
from acompile._errors import (
    AcompileError,
    CompileError,
    PoolClosedError,
    WorkerCrashedError,
    WorkerStartError,
)

logger = logging.getLogger("acompile")

URGENT = 0
BACKGROUND = 1
_STDERR_TAIL = 64 * 1024
_job_ids = itertools.count(1)
# The worker imports acompile before it reads its configuration (and the parent's sys.path):
# it must find the same acompile the parent runs.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class JobCancelled(AcompileError):
    """Internal: the job was dropped because nobody waits for it any more."""


@dataclass(eq=False)
class Job:
    """One unit of work for one worker; its outcome is set exactly once."""

    backend: str
    payload: Any
    name: str
    lane: int = URGENT
    id: int = field(default_factory=lambda: next(_job_ids))
    state: str = "queued"  # queued -> running -> done
    result: Any = None
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    worker_pid: int | None = None
    seconds: float = 0.0
    _scope: anyio.CancelScope | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if self.state == "done":
            return
        self.state = "done"
        self.result, self.error = result, error
        self.done.set()

    def abandon(self) -> None:
        """Nobody waits any more: drop the job if queued, stop its worker if running."""
        if self.state == "queued":
            self.finish(error=JobCancelled(self.name))
        elif self.state == "running" and self._scope is not None:
            self._scope.cancel()

    async def outcome(self) -> Any:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _JobQueue:
    def __init__(self) -> None:
        self._lanes: tuple[deque[Job], deque[Job]] = (deque(), deque())
        self._waiters: list[anyio.Event] = []

    def __len__(self) -> int:
        return sum(1 for i, lane in enumerate(self._lanes) for job in lane if self._live(job, i))

    @staticmethod
    def _live(job: Job, lane: int) -> bool:
        # A promoted job stays in its old lane until popped: only its current place counts.
        return job.state == "queued" and job.lane == lane

    def put(self, job: Job) -> None:
        self._lanes[job.lane].append(job)
        # Wake every idle slot: a woken slot that is cancelled before it pops must not strand
        # the job, and there are only ever as many waiters as workers.
        for event in self._waiters:
            event.set()
        self._waiters.clear()

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane (its old place is skipped later)."""
        if job.state == "queued" and job.lane != URGENT:
            job.lane = URGENT
            self._lanes[URGENT].append(job)

    def pop(self) -> Job | None:
        for i, lane in enumerate(self._lanes):
            while lane:
                job = lane.popleft()
                if self._live(job, i):
                    return job
        return None

    async def get(self) -> Job:
        while True:
            job = self.pop()
            if job is not None:
                return job
            event = anyio.Event()
            self._waiters.append(event)
            await event.wait()

    def fail_all(self, error: BaseException) -> None:
        while (job := self.pop()) is not None:
            job.finish(error=error)


class _WorkerProcess:
    """A started worker: its process, its framed reader, the file that holds its fd 2."""

    def __init__(self, process: anyio.abc.Process, stderr_path: str) -> None:
        self.process = process
        self.pid = process.pid
        self.stderr_path = stderr_path
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._reader = BufferedByteReceiveStream(process.stdout)
        self.started = time.monotonic()

    async def send(self, message: Any) -> None:
        await self._stdin.send(_protocol.encode(message))

    async def send_bytes(self, data: bytes) -> None:
        await self._stdin.send(data)

    async def receive(self) -> Any:
        header = await self._reader.receive_exactly(_protocol.HEADER_SIZE)
        body = await self._reader.receive_exactly(_protocol.decode_length(header))
        return _protocol.decode(body)

    async def kill(self) -> int | None:
        """Stop the process now and reap it; returns its exit status."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    self.process.kill()
                except ProcessLookupError:
                    pass
            with anyio.move_on_after(5):
                await self.process.wait()
            await self.process.aclose()
        return self.process.returncode

    async def stderr_tail(self) -> str:
        def read() -> str:
            try:
                with open(self.stderr_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    size = f.tell()
                    f.seek(max(0, size - _STDERR_TAIL))
                    return f.read().decode("utf-8", "replace")
            except OSError:
                return ""

        return await anyio.to_thread.run_sync(read)


def _lower_priority(pid: int, nice: int) -> None:
    # Right away, so that the worker's start-up (Python, Triton's import) already yields to the
    # process serving requests; the worker applies it too, in case this is refused.
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError:
            pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class PoolStats:
    started: int = 0
    restarts: dict[str, int] = field(default_factory=dict)
    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    preload_s: list[float] = field(default_factory=list)
    job_seconds: list[float] = field(default_factory=list)


class WorkerPool:
    """A fixed number of worker slots fed from one queue.

    ``run()`` is started in the owner's task group and runs until that group is cancelled; it
    kills every worker on the way out, whatever cancelled it.
    """

    def __init__(self, size: int, config: dict[str, Any], workdir: str) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got workers={size}")
        self.size = size
        self.config = config
        self.workdir = workdir
        self.queue = _JobQueue()
        self.stats = PoolStats()
        self.busy = 0
        self.alive: dict[int, _WorkerProcess] = {}
        self._ready = [anyio.Event() for _ in range(size)]
        self._start_error: WorkerStartError | None = None
        self._closed = False
        self._spawn_lock = anyio.Lock()
        self._config_ready = anyio.Event()
        self._config_ready.set()

    # -- the caller's side -------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._start_error is not None and not self.alive:
            raise self._start_error
        self.queue.put(job)
        return job

    def defer_config(self) -> None:
        """Workers may start before their configuration is complete: hold it back until
        ``complete_config()``; they import their backends meanwhile."""
        self._config_ready = anyio.Event()

    def complete_config(self, extra: dict[str, Any]) -> None:
        self.config.update(extra)
        self._config_ready.set()

    async def wait_ready(self) -> None:
        for event in self._ready:
            await event.wait()
            if self._start_error is not None:
                raise self._start_error

    # -- the slots -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for slot in range(self.size):
                    tg.start_soon(self._slot, slot)
        finally:
            self._closed = True
            self.queue.fail_all(PoolClosedError("the pool shut down before this job ran"))

    async def _slot(self, slot: int) -> None:
        failures = 0
        while True:
            try:
                worker = await self._spawn(slot)
            except WorkerStartError as exc:
                failures += 1
                self._start_error = exc
                logger.error("worker %d failed to start: %s", slot, exc)
                # Nothing can run until a worker starts: fail what waits instead of hanging it.
                self.queue.fail_all(exc)
                self._ready[slot].set()
                await anyio.sleep(min(0.25 * 2**failures, 10.0))
                continue
            failures = 0
            self._start_error = None
            self._ready[slot].set()
            try:
                cause = await self._serve(worker)
            finally:
                self.alive.pop(worker.pid, None)
                code = await worker.kill()
            if cause != "abandoned":
                logger.warning("worker %d (pid %d) %s; replacing it", slot, worker.pid, _describe_exit(code))
            self.stats.restarts[cause] = self.stats.restarts.get(cause, 0) + 1

    async def _spawn(self, slot: int) -> _WorkerProcess:
        stderr_path = os.path.join(self.workdir, f"worker-{slot}.stderr")
        env = dict(os.environ)
        env["ACOMPILE_PARENT_PID"] = str(os.getpid())
        env["ACOMPILE_WORKER_NICE"] = str(self.config.get("nice", 0))
        env["ACOMPILE_PARENT_NICE"] = str(os.nice(0))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        config = dict(self.config, triton_cache_dir=os.path.join(self.workdir, f"triton-{slot}"))
        t0 = time.perf_counter()
        # Read-write (the worker reads its own tail back) and append-only (after the worker
        # truncates it at a job's start, writes land at the new end, not at the old offset).
        stderr_fd = os.open(stderr_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            # Starting a process blocks the loop until the child has exec'd (a few ms). One at a
            # time, with the loop's other work in between: sixteen slots starting in the same
            # loop iteration would otherwise stall it for all sixteen.
            async with self._spawn_lock:
                process = await anyio.open_process(
                    [sys.executable, "-m", "acompile._worker", *self.config.get("preload", ())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr_fd,
                    cwd=self.config["cwd"],
                    env=env,
                )
                _lower_priority(process.pid, self.config.get("nice", 0))
                await anyio.lowlevel.checkpoint()
        finally:
            os.close(stderr_fd)
        worker = _WorkerProcess(process, stderr_path)
        self.alive[worker.pid] = worker
        try:
            await self._config_ready.wait()  # the worker imports its backends meanwhile
            config = dict(self.config, triton_cache_dir=config["triton_cache_dir"])
            await worker.send(config)
            reply = await worker.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            code = await worker.kill()
            self.alive.pop(worker.pid, None)
            tail = await worker.stderr_tail()
            raise WorkerStartError(
                f"worker process {_describe_exit(code)} during preload\n{tail}".rstrip()
            ) from exc
        except BaseException:
            self.alive.pop(worker.pid, None)
            await worker.kill()
            raise
        if reply[0] != "ready":
            self.alive.pop(worker.pid, None)
            await worker.kill()
            raise WorkerStartError(f"worker preload failed: {reply[1]}")
        self.stats.started += 1
        self.stats.preload_s.append(time.perf_counter() - t0)
        logger.debug("worker pid %d ready in %.3f s", worker.pid, time.perf_counter() - t0)
        return worker

    async def _serve(self, worker: _WorkerProcess) -> str:
        """Run jobs on one worker until it must be replaced; returns why."""
        while True:
            job = await self.queue.get()
            try:
                message = _protocol.encode(("job", job.id, job.backend, job.payload))
            except Exception as exc:
                # Something in the request does not pickle: that request fails, nothing else.
                job.finish(error=_unsendable_error(job, exc))
                self.stats.jobs_failed += 1
                continue
            job.state = "running"
            job.worker_pid = worker.pid
            self.busy += 1
            reply = None
            t0 = time.perf_counter()
            try:
                with anyio.CancelScope() as scope:
                    job._scope = scope
                    try:
                        await worker.send_bytes(message)
                        reply = await worker.receive()
                    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                        reply = None
            finally:
                self.busy -= 1
                job._scope = None
                job.seconds = time.perf_counter() - t0
            if scope.cancel_called:
                # Every waiter left while it ran: the only way to stop a compiler is to stop
                # its process, so this worker is replaced.
                job.finish(error=JobCancelled(job.name))
                self.stats.jobs_cancelled += 1
                return "abandoned"
            if reply is None:
                code = await worker.kill()
                tail = await worker.stderr_tail()
                job.finish(error=_crash_error(job, code, tail))
                self.stats.jobs_failed += 1
                logger.error(
                    "worker pid %d %s while compiling %s", worker.pid, _describe_exit(code), job.name
                )
                return "crash"
            kind, job_id, value = reply
            if job_id != job.id:
                raise RuntimeError(f"worker answered job {job_id} while running job {job.id}")
            self.stats.job_seconds.append(job.seconds)
            if kind == "done":
                self.stats.jobs_done += 1
                job.finish(result=value)
            else:
                self.stats.jobs_failed += 1
                job.finish(error=value)


def _unsendable_error(job: Job, exc: Exception) -> CompileError:
    short = job.backend.rsplit(".", 1)[-1].lstrip("_")
    return CompileError(
        f"cannot send {job.name!r} to a worker: {type(exc).__name__}: {exc}",
        kernel=job.name,
        backend=short,
        log=str(exc),
    )


def _crash_error(job: Job, code: int | None, tail: str) -> CompileError:
    short = job.backend.rsplit(".", 1)[-1].lstrip("_")
    return WorkerCrashedError(
        f"the worker compiling {job.name!r} {_describe_exit(code)}",
        exit_code=code,
        kernel=job.name,
        backend=short,
        stderr_tail=tail,
    )
