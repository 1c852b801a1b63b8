"""Worker processes: start, preload, dispatch one job at a time, cancel, replace, quiesce.

``WorkerPool`` is the process half of ``CompilePool``: it knows nothing of kernels or caches. It
runs a fixed number of slots; each slot owns at most one worker process at a time, takes jobs from
a shared two-lane queue, and replaces its worker whenever the worker dies, passes its memory
limit, runs past the job time limit, or runs a job nobody waits for any more (the only way to stop
a compiler is to stop its process).

Workers are forked from a *template*: a process that did a worker's whole preload once (see
``acompile._worker.Template``); a forked worker is ready in milliseconds. Where no template can be
had (it has threads, or fails), workers start as fresh interpreters (``python -m
acompile._worker``) through anyio's process API, which take a second to preload.

The slots run in *epochs*: ``quiesce()`` ends the current one (its workers are stopped, running
jobs go back to the front of the queue), and new work, ``wakeup()`` or a waiting job starts the
next. The template outlives epochs, so waking is a matter of forks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
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
    CompileTimeoutError,
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
# Signals that say "killed from outside" (an operator, an OOM killer, a chaos test) rather than
# "the compiler crashed": a job whose worker dies of one is retried once on a fresh worker.
_EXTERNAL = frozenset({-signal.SIGKILL, -signal.SIGTERM, -signal.SIGHUP, -signal.SIGINT, -signal.SIGQUIT})
_TOP_N = 10
# Starts that fail for a lasting reason (the preload raised, the worker exited with a status)
# this many times in a row, or for any reason this many times, with no worker alive: the queued
# jobs fail with the reason instead of waiting for a worker that will not come.
_HARD_START_FAILURES = 2
# A worker stopped by a signal (SIGSTOP) this long is replaced; its job is retried.
_STOPPED_LIMIT = 5.0
_START_FAILURES = 12


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
    state: str = "queued"  # queued -> running -> done (running -> queued on a retry or quiesce)
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
            self.abandoned = True
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

    def put(self, job: Job, *, front: bool = False) -> None:
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
            try:
                await event.wait()
            except BaseException:
                if event in self._waiters:
                    self._waiters.remove(event)
                elif len(self):
                    self._wake_one()  # chosen for a job, but leaving: pass the turn on
                raise

    def fail_all(self, error: BaseException) -> None:
        while (job := self.pop()) is not None:
            job.finish(error=error)


# --- workers ----------------------------------------------------------------------------------


class _WorkerBase:
    pid: int
    stderr_path: str

    def __init__(self, receive: anyio.abc.ByteReceiveStream, send: anyio.abc.ByteSendStream) -> None:
        self._reader = BufferedByteReceiveStream(receive)
        self._send = send
        self.exited = anyio.Event()
        self.stop_cause: str | None = None
        self.idle_scope: anyio.CancelScope | None = None
        self.started = time.monotonic()
        self.stopped_since: float | None = None

    async def send_bytes(self, data: bytes) -> None:
        await self._send.send(data)

    async def receive(self) -> Any:
        header = await self._reader.receive_exactly(_protocol.HEADER_SIZE)
        body = await self._reader.receive_exactly(_protocol.decode_length(header))
        return _protocol.decode(body)


class _SpawnedWorker(_WorkerBase):
    """A worker started as a fresh interpreter; its pipes are its stdin and stdout."""

    def __init__(self, process: anyio.abc.Process, stderr_path: str) -> None:
        assert process.stdin is not None and process.stdout is not None
        super().__init__(process.stdout, process.stdin)
        self.process = process
        self.pid = process.pid
        self.stderr_path = stderr_path

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def signal_kill(self) -> None:
        if self.process.returncode is None:
            _kill_group(self.pid)

    async def wait_exit(self) -> None:
        await self.process.wait()
        self.exited.set()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.process.aclose()


class _ForkedWorker(_WorkerBase):
    """A worker forked by the template; it talks over a Unix socket it connected to us."""

    def __init__(self, connection: _Connection, pid: int, stderr_path: str) -> None:
        reader, stream = connection
        super().__init__(reader, stream)
        self.stream = stream
        self.pid = pid
        self.stderr_path = stderr_path
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def set_exited(self, code: int) -> None:
        self._returncode = code
        self.exited.set()

    async def wait_exit(self) -> None:
        await self.exited.wait()  # the template says when

    def signal_kill(self) -> None:
        # The template reaps its children and tells us; until then the pid is still this one's.
        if not self.exited.is_set():
            _kill_group(self.pid)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


async def _stop(worker: _SpawnedWorker | _ForkedWorker) -> int | None:
    """Stop a worker now and wait until it is gone; returns its exit status."""
    with anyio.CancelScope(shield=True):
        worker.signal_kill()
        with anyio.move_on_after(5):
            await worker.wait_exit()
        # Whatever ended the worker (a kill from outside, a crash), the compilers it started are
        # still in its process group: they go with it. The group's id cannot be reused by another
        # process while any of them lives.
        _kill_group(worker.pid)
        await worker.close()
    return worker.returncode


def _kill_group(pid: int) -> None:
    """SIGKILL the process group that worker pid leads (it and every compiler it started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        # Not a group of ours (the pid was never a group leader): the process alone.
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _close(stream: anyio.abc.AsyncResource) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except OSError:
            pass


def _stderr_tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _STDERR_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


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


def _sample_all(pids: list[int]) -> list[tuple[int | None, bool]]:
    return [(_rss(pid), _is_stopped(pid)) for pid in pids]


def _rss(pid: int) -> int | None:
    """Resident memory of a process in bytes (Linux), or None."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (state T in /proc/PID/stat; Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The name is in parentheses and may hold spaces: the state follows the last ")".
            return f.read().rpartition(b")")[2].split()[0] == b"T"
    except (OSError, IndexError):
        return False


# --- the template -----------------------------------------------------------------------------


class _UnixConnection(anyio.abc.ByteStream):
    """A forked worker's connection, on asyncio's transport-based streams.

    Not anyio's UNIX socket stream: that one waits on a raw socket with a reader callback that
    sets a future, and a cancellation (a deadline, an abandoned job, the pool leaving) delivered
    in the same loop iteration as the worker's reply or EOF makes that callback set a cancelled
    future: asyncio logs an InvalidStateError "in callback". Transports have no such window.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            data = await self._reader.read(max_bytes)
        except OSError as exc:
            raise anyio.BrokenResourceError from exc
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        if self._writer.is_closing():
            raise anyio.BrokenResourceError
        try:
            self._writer.write(item)
            await self._writer.drain()
        except OSError as exc:
            raise anyio.BrokenResourceError from exc

    async def send_eof(self) -> None:
        self._writer.write_eof()

    async def aclose(self) -> None:
        self._writer.close()  # its transport closes the socket; nothing to wait for
        await anyio.lowlevel.checkpoint()


class _UnixListener:
    """The Unix socket forked workers connect back to (accepts through asyncio's sock_accept,
    which, unlike a raw reader callback, ignores a readiness that arrives after cancellation)."""

    def __init__(self, address: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.socket.bind(address)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise

    async def accept(self) -> _UnixConnection:
        loop = asyncio.get_running_loop()
        connection, _ = await loop.sock_accept(self.socket)
        reader, writer = await asyncio.open_unix_connection(sock=connection)
        return _UnixConnection(reader, writer)

    async def aclose(self) -> None:
        self.socket.close()
        await anyio.lowlevel.checkpoint()


_Connection = tuple[BufferedByteReceiveStream, _UnixConnection]


class _Template:
    """The process workers are forked from, and the Unix socket they connect back to."""

    def __init__(self, process: anyio.abc.Process, address: str) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.pid = process.pid
        self.address = address
        self.token = secrets.token_hex(16)
        self._reader = BufferedByteReceiveStream(process.stdout)
        self._stdin = process.stdin
        self.forked: dict[int, tuple[anyio.Event, list[int]]] = {}
        self.connections: dict[int, tuple[anyio.Event, list[_Connection]]] = {}
        self.workers: dict[int, _ForkedWorker] = {}
        self.early_exits: dict[int, int] = {}
        self.lost = anyio.Event()
        self.stopped_since: float | None = None

    async def receive(self) -> Any:
        header = await self._reader.receive_exactly(_protocol.HEADER_SIZE)
        return _protocol.decode(await self._reader.receive_exactly(_protocol.decode_length(header)))

    async def listen(self) -> None:
        """The template's reports: which pid a fork got, and which workers exited."""
        try:
            while True:
                message = await self.receive()
                if message[0] == "forked":
                    _, slot, pid = message
                    waiting = self.forked.get(slot)
                    if waiting is not None:
                        waiting[1].append(pid)
                        waiting[0].set()
                elif message[0] == "exited":
                    _, pid, code = message
                    worker = self.workers.pop(pid, None)
                    if worker is not None:
                        worker.set_exited(code)
                    else:
                        self.early_exits[pid] = code
        except (
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ):
            pass
        finally:
            # Without the template, its workers die too (parent-death signal): tell their slots,
            # and that their jobs are not to blame.
            self.lost.set()
            for worker in self.workers.values():
                worker.stop_cause = worker.stop_cause or "template"
                worker.set_exited(-signal.SIGKILL)

    async def serve_connections(self, listener: _UnixListener) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def close_when_lost() -> None:
                    await self.lost.wait()  # its forks are over: so is their listener
                    tg.cancel_scope.cancel()

                tg.start_soon(close_when_lost)
                while True:
                    stream = await listener.accept()
                    tg.start_soon(self._introduce, stream)
        finally:
            # Shielded: closing must happen even as the pool's cancellation arrives.
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _introduce(self, stream: _UnixConnection) -> None:
        try:
            with anyio.fail_after(30):
                reader = BufferedByteReceiveStream(stream)
                header = await reader.receive_exactly(_protocol.HEADER_SIZE)
                hello = _protocol.decode(await reader.receive_exactly(_protocol.decode_length(header)))
        except Exception:
            # A worker killed right after it connected, or a stranger: that connection is lost,
            # nothing else (the fork that waits for it sees the worker exit).
            await _close(stream)
            return
        except BaseException:
            await _close(stream)
            raise
        if not (isinstance(hello, tuple) and hello[:1] == ("hello",) and hello[3] == self.token):
            await _close(stream)  # not one of ours
            return
        _, slot, _pid, _ = hello
        waiting = self.connections.get(slot)
        if waiting is None:
            await _close(stream)  # its fork was given up (quiesce, shutdown)
            return
        # The reader goes along: what it buffered past the hello is the worker's next message.
        waiting[1].append((reader, stream))
        waiting[0].set()

    async def fork(self, slot: int, config: dict[str, Any]) -> tuple[int, _Connection]:
        """Fork a worker for slot and wait until it has connected back.

        Raises ``_TransientStartError`` when the template is gone or the worker dies before it
        connects (both are worth another try), ``WorkerStartError`` when it never connects.
        """
        if self.lost.is_set():
            raise _TransientStartError("the template process is gone")
        forked: tuple[anyio.Event, list[int]] = (anyio.Event(), [])
        connected: tuple[anyio.Event, list[_Connection]] = (anyio.Event(), [])
        self.forked[slot] = forked
        self.connections[slot] = connected
        returned = False
        try:
            config = dict(config, address=self.address, token=self.token)
            try:
                await self._stdin.send(_protocol.encode(("fork", slot, config)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise _TransientStartError("the template process is gone") from exc
            with anyio.fail_after(30):
                await _first_of(forked[0], self.lost)
                if not forked[1]:
                    raise _TransientStartError("the template process died before it forked a worker")
                pid = forked[1][0]
                while not connected[0].is_set():
                    if pid in self.early_exits:
                        code = self.early_exits.pop(pid)
                        raise _TransientStartError(
                            f"a forked worker {_describe_exit(code)} before it connected"
                        )
                    if self.lost.is_set():
                        raise _TransientStartError("the template process died while a worker started")
                    with anyio.move_on_after(0.05):
                        await connected[0].wait()
            returned = True
            return pid, connected[1][0]
        except TimeoutError:
            raise WorkerStartError("a forked worker did not connect within 30 s") from None
        finally:
            self.forked.pop(slot, None)
            self.connections.pop(slot, None)
            if connected[1] and not returned:
                # Connected after this fork was given up: nobody will use the stream.
                for _, stream in connected[1]:
                    await _close(stream)


async def _first_of(*events: anyio.Event) -> None:
    """Wait until any of events is set."""
    if any(event.is_set() for event in events):
        return
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


class _TransientStartError(WorkerStartError):
    """Internal: a start that failed for a reason that may not happen again (the process was
    killed from outside, the template it forked from died). The slot tries again at once, with
    back-off; queued jobs wait instead of failing."""


# --- the pool ---------------------------------------------------------------------------------


@dataclass
class PoolStats:
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
        self.job_seconds.append(seconds)
        if len(self.slowest) < _TOP_N:
            heapq.heappush(self.slowest, (seconds, name))
        elif seconds > self.slowest[0][0]:
            heapq.heapreplace(self.slowest, (seconds, name))

    def restart(self, cause: str) -> None:
        self.restarts[cause] = self.restarts.get(cause, 0) + 1


class WorkerPool:
    """A fixed number of worker slots fed from one queue.

    ``run()`` is started in the owner's task group and runs until that group is cancelled; it
    kills every worker (and the template) on the way out, whatever cancelled it.
    """

    def __init__(
        self,
        size: int,
        config: dict[str, Any],
        workdir: str,
        *,
        memory_limit: int | None = None,
        max_compile_seconds: float | None = None,
        preload_timeout: float = 120.0,
        use_template: bool = True,
    ) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got workers={size}")
        self.size = size
        self.config = config
        self.workdir = workdir
        self.memory_limit = memory_limit
        self.max_compile_seconds = max_compile_seconds
        self.preload_timeout = preload_timeout
        self.use_template = use_template and hasattr(os, "fork") and sys.platform.startswith("linux")
        self.queue = _JobQueue()
        self.stats = PoolStats()
        self.busy = 0
        self.alive: dict[int, _SpawnedWorker | _ForkedWorker] = {}
        self.last_activity = time.monotonic()
        self._ready = [anyio.Event() for _ in range(size)]
        self._start_error: WorkerStartError | None = None
        self._hard_start_failures = 0  # in a row, pool-wide, for a lasting reason
        self._closed = False
        self._spawn_lock = anyio.Lock()
        self._config_ready = anyio.Event()
        self._config_ready.set()
        self._config_hook: Callable[[], Awaitable[dict[str, Any]]] | None = None
        self._config_started = False
        self._awake = False
        self._wake = anyio.Event()
        self._epoch_scope: anyio.CancelScope | None = None
        self._template: _Template | None = None
        self._template_failed = False
        self._templates_started = 0
        self._template_lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None

    # -- the caller's side -------------------------------------------------------------------

    @property
    def awake(self) -> bool:
        return self._awake

    def submit(self, job: Job) -> Job:
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._start_error is not None and not self.alive:
            raise self._start_error
        self.queue.put(job)
        self.wakeup()  # a request on a quiesced pool wakes it
        return job

    def prepare_config_with(self, hook: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Complete the workers' configuration with what ``hook()`` returns, computed when the
        workers first start (not before: a pool whose requests all hit the cache never needs
        it). Workers start meanwhile and import their backends; they get the configuration
        when it is complete."""
        self._config_hook = hook
        self._config_ready = anyio.Event()

    async def _prepare_config(self) -> None:
        assert self._config_hook is not None
        try:
            self.config.update(await self._config_hook())
        except Exception as exc:
            # Not fatal: each worker then computes what it needs itself, at some cost.
            logger.warning("cannot prepare the workers' configuration here (%s); workers will", exc)
        self._config_ready.set()

    def wakeup(self) -> None:
        """Start the workers (if they are not running); ``wait_ready()`` waits for them."""
        if not self._awake and not self._closed:
            self._awake = True
            self._ready = [anyio.Event() for _ in range(self.size)]
            self._wake.set()

    def quiesce(self) -> None:
        """Stop every worker now; running jobs go back to the front of the queue. Returns at
        once: the workers are stopped by their slots, in a few milliseconds."""
        if self._awake:
            self._awake = False
            if self._epoch_scope is not None:
                self._epoch_scope.cancel()

    async def wait_ready(self) -> None:
        self.wakeup()
        for event in list(self._ready):
            await event.wait()
            if self._start_error is not None:
                raise self._start_error

    # -- the slots -----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watch_memory)
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    if self._config_hook is not None and not self._config_started:
                        self._config_started = True
                        tg.start_soon(self._prepare_config)
                    await self._epoch()
                    if self.queue and not self._closed:
                        # Work arrived (or was put back) while the epoch ended: start again.
                        self.wakeup()
        finally:
            self._closed = True
            self._awake = False
            self.queue.fail_all(PoolClosedError("the pool shut down before this job ran"))
            template, self._template = self._template, None
            if template is not None:
                await _stop_template(template)

    async def _epoch(self) -> None:
        ready = self._ready
        with anyio.CancelScope() as scope:
            self._epoch_scope = scope
            if not self._awake:  # quiesced before it began
                return
            async with anyio.create_task_group() as tg:
                for slot in range(self.size):
                    tg.start_soon(self._slot, slot)
        self._epoch_scope = None
        for event in ready:
            event.set()  # nobody waits for an epoch that ended

    async def _slot(self, slot: int) -> None:
        failures = 0
        while True:
            try:
                worker = await self._start_worker(slot)
            except WorkerStartError as exc:
                failures += 1
                await self._start_failed(slot, exc, failures)
                continue
            failures = 0
            self._hard_start_failures = 0
            self._start_error = None
            self._ready[slot].set()
            cause = "stopped"  # by quiesce() or shutdown, unless _serve says otherwise
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch, worker)
                    cause = await self._serve(worker)
                    tg.cancel_scope.cancel()
            finally:
                self.alive.pop(worker.pid, None)
                self.stats.worker_rss.pop(worker.pid, None)
                code = await _stop(worker)
                logger.debug("worker pid %d stopped (%s, %s)", worker.pid, cause, _describe_exit(code))
                self.stats.restart(cause)

    async def _start_failed(self, slot: int, exc: WorkerStartError, failures: int) -> None:
        """A start failed: try again, with back-off; fail the queued jobs only when starts keep
        failing for a reason that will not go away (a preload that raises, a broken install)."""
        transient = isinstance(exc, _TransientStartError)
        if not transient:
            self._hard_start_failures += 1
        self.stats.restart("start_failed")
        # Kills from outside may stop: queued jobs wait for them to (their callers' deadlines
        # bound the wait), with the back-off below keeping the retries cheap.
        give_up = self._hard_start_failures >= _HARD_START_FAILURES and not self.alive
        if give_up:
            error = exc if not transient else WorkerStartError(str(exc))
            if self._start_error is None:
                logger.error("workers cannot start: %s", exc)
            self._start_error = error
            # Nothing can run until a worker starts: fail what waits instead of hanging it.
            self.queue.fail_all(error)
            self._ready[slot].set()
        else:
            reason = str(exc).splitlines()[0]
            logger.warning("worker %d failed to start (%s); starting it again", slot, reason)
        if transient and failures == 1:
            await anyio.lowlevel.checkpoint()  # a kill from outside: back to full size at once
        else:
            base = 0.05 if transient else 0.25
            await anyio.sleep(min(base * 2 ** (failures - 1), 2.0 if transient else 10.0))

    async def _start_worker(self, slot: int) -> _SpawnedWorker | _ForkedWorker:
        stderr_path = os.path.join(self.workdir, f"worker-{slot}.stderr")
        # Read-write (the worker reads its own tail back) and append-only (after the worker
        # truncates it at a job's start, writes land at the new end, not at the old offset).
        os.close(os.open(stderr_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600))
        slot_config = {
            "triton_cache_dir": os.path.join(self.workdir, f"triton-{slot}"),
            "scratch_dir": os.path.join(self.workdir, f"scratch-{slot}"),
            "stderr_path": stderr_path,
        }
        template = await self._get_template() if self.use_template else None
        t0 = time.perf_counter()
        worker: _SpawnedWorker | _ForkedWorker
        if template is not None:
            pid, connection = await template.fork(slot, slot_config)
            worker = _ForkedWorker(connection, pid, stderr_path)
            template.workers[pid] = worker
            if pid in template.early_exits:
                worker.set_exited(template.early_exits.pop(pid))
            self.stats.forked += 1
        else:
            worker = await self._spawn(stderr_path)
        self.alive[worker.pid] = worker
        try:
            if isinstance(worker, _SpawnedWorker):
                await self._config_ready.wait()  # the worker imports its backends meanwhile
                await worker.send_bytes(_protocol.encode(dict(self.config, **slot_config)))
            with anyio.fail_after(self.preload_timeout):
                reply = await worker.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            self.alive.pop(worker.pid, None)
            code = await _stop(worker)
            tail = await anyio.to_thread.run_sync(_stderr_tail, stderr_path)
            error = _TransientStartError if code in _EXTERNAL else WorkerStartError
            raise error(f"worker process {_describe_exit(code)} during preload\n{tail}".rstrip()) from exc
        except TimeoutError:
            self.alive.pop(worker.pid, None)
            await _stop(worker)
            raise WorkerStartError(
                f"a worker did not finish its preload within preload_timeout={self.preload_timeout:g} s"
            ) from None
        except BaseException:
            self.alive.pop(worker.pid, None)
            await _stop(worker)
            raise
        if reply[0] != "ready":
            self.alive.pop(worker.pid, None)
            await _stop(worker)
            raise WorkerStartError(f"worker preload failed: {reply[1]}")
        self.stats.started += 1
        self.stats.preload_s.append(time.perf_counter() - t0)
        logger.debug("worker pid %d ready in %.3f s", worker.pid, time.perf_counter() - t0)
        return worker

    def _command(self, *extra: str) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env["ACOMPILE_PARENT_PID"] = str(os.getpid())
        env["ACOMPILE_WORKER_NICE"] = str(self.config.get("nice", 0))
        env["ACOMPILE_PARENT_NICE"] = str(os.nice(0))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        return [sys.executable, "-m", "acompile._worker", *extra, *self.config.get("preload", ())], env

    async def _open(self, command: list[str], env: dict[str, str], stderr_path: str) -> anyio.abc.Process:
        stderr_fd = os.open(stderr_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
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
                    process = await anyio.open_process(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr_fd,
                        cwd=self.config["cwd"],
                        env=env,
                        # Its own process group: stopping it stops the compilers it started
                        # (ptxas, nvcc, cc1plus) too, and a terminal's Ctrl-C is ours to handle.
                        start_new_session=True,
                    )
                _lower_priority(process.pid, self.config.get("nice", 0))
                try:
                    await anyio.lowlevel.checkpoint()
                except BaseException:
                    # Cancelled right after the start: nobody else knows this process yet.
                    with anyio.CancelScope(shield=True):
                        _kill_group(process.pid)
                        await process.wait()
                        await process.aclose()
                    raise
        finally:
            os.close(stderr_fd)
        return process

    async def _spawn(self, stderr_path: str) -> _SpawnedWorker:
        command, env = self._command()
        return _SpawnedWorker(await self._open(command, env, stderr_path), stderr_path)

    async def _get_template(self) -> _Template | None:
        """The template to fork from, started (or started again) if need be; None where
        workers must start afresh (no template can be had)."""
        async with self._template_lock:
            if self._template is not None and not self._template.lost.is_set():
                return self._template
            if self._template_failed:
                return None
            try:
                self._template = await self._start_template()
            except _TransientStartError:
                # Killed from outside while it preloaded: the slot tries again, and so will this.
                self._template = None
                raise
            except WorkerStartError as exc:
                logger.warning(
                    "cannot start a template to fork workers from (%s); starting each worker afresh", exc
                )
                self._template_failed = True
                self._template = None
            return self._template

    async def _keep_template(self, template: _Template) -> None:
        """When the template dies while the pool runs, start another in the background: a
        later wake-up (or a replacement worker) then costs a fork, not a preload."""
        await template.lost.wait()
        failures = 0
        while not self._closed:
            current = self._template
            if current is not None and current is not template and not current.lost.is_set():
                return  # a slot started one already; it has a keeper of its own
            try:
                await self._get_template()
                return
            except WorkerStartError:
                failures += 1
                await anyio.sleep(min(0.05 * 2**failures, 2.0))

    async def _start_template(self) -> _Template:
        assert self._tg is not None
        stderr_path = os.path.join(self.workdir, "template.stderr")
        self._templates_started += 1
        address = os.path.join(self.workdir, f"workers-{self._templates_started}.sock")
        listener = _UnixListener(address)
        command, env = self._command("--template")
        try:
            process = await self._open(command, env, stderr_path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            raise
        template = _Template(process, address)
        try:
            await self._config_ready.wait()
            await template._stdin.send(
                _protocol.encode(
                    dict(self.config, triton_cache_dir=os.path.join(self.workdir, "triton-template"))
                )
            )
            with anyio.fail_after(self.preload_timeout):
                reply = await template.receive()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await _stop_template(template)
            if isinstance(exc, (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError)):
                code = template.process.returncode
                tail = await anyio.to_thread.run_sync(_stderr_tail, stderr_path)
                error = _TransientStartError if code in _EXTERNAL else WorkerStartError
                raise error(
                    f"the template process {_describe_exit(code)} during preload\n{tail}".rstrip()
                ) from exc
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(
                    "the template did not finish its preload within "
                    f"preload_timeout={self.preload_timeout:g} s"
                ) from None
            raise
        if reply[0] != "ready":
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await _stop_template(template)
            raise WorkerStartError(f"template preload failed: {reply[1]}")
        threads = reply[1].get("threads", 1)
        if threads != 1:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            await _stop_template(template)
            raise WorkerStartError(
                f"the template has {threads} threads after its preload; forking it is unsafe"
            )
        self._tg.start_soon(template.listen)
        self._tg.start_soon(template.serve_connections, listener)
        self._tg.start_soon(self._keep_template, template)
        logger.debug("template pid %d ready in %.3f s", template.pid, reply[1].get("preload_s", 0.0))
        return template

    async def _next_job(self, worker: _SpawnedWorker | _ForkedWorker) -> Job | None:
        """The next job, or None if the worker died while it waited for one."""
        if worker.exited.is_set():
            return None
        try:
            with anyio.CancelScope() as worker.idle_scope:  # cancelled by _watch if it dies
                return await self.queue.get()
        finally:
            worker.idle_scope = None
        return None

    @staticmethod
    async def _watch(worker: _SpawnedWorker | _ForkedWorker) -> None:
        await worker.wait_exit()
        if worker.idle_scope is not None:
            worker.idle_scope.cancel()

    async def _serve(self, worker: _SpawnedWorker | _ForkedWorker) -> str:
        """Run jobs on one worker until it must be replaced; returns why."""
        while True:
            job = await self._next_job(worker)
            if job is None:
                code = worker.returncode
                logger.warning("idle worker pid %d %s; replacing it", worker.pid, _describe_exit(code))
                return "killed" if code in _EXTERNAL else "crash"
            try:
                message = _protocol.encode(("job", job.id, job.backend, job.payload))
            except Exception as exc:
                # Something in the request does not pickle: that request fails, nothing else.
                job.finish(error=_unsendable_error(job, exc))
                self.stats.jobs_failed += 1
                continue
            job.state = "running"
            job.worker_pid = worker.pid
            job.started_at = time.perf_counter()
            self.busy += 1
            self.last_activity = time.monotonic()
            reply = None
            timed_out = False
            t0 = time.perf_counter()
            try:
                with anyio.CancelScope() as scope:
                    job._scope = scope
                    if self.max_compile_seconds is not None:
                        scope.deadline = anyio.current_time() + self.max_compile_seconds
                    try:
                        await worker.send_bytes(message)
                        reply = await worker.receive()
                    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                        reply = None
                # Cancelled by the deadline, not by a caller: the compile ran too long.
                timed_out = scope.cancelled_caught and not job.abandoned
            except BaseException:
                # The epoch ended (quiesce) or the pool is shutting down: the job goes back to
                # the front of the queue; shutdown fails what is left there.
                if job.state == "running":
                    self.queue.put(job, front=True)
                raise
            finally:
                self.busy -= 1
                job.ended_at = time.perf_counter()
                job._scope = None
                job.seconds = time.perf_counter() - t0
                self.last_activity = time.monotonic()
            if job.abandoned:
                # Every waiter left while it ran: stop the compiler by stopping its process.
                job.finish(error=JobCancelled(job.name))
                self.stats.jobs_cancelled += 1
                return "abandoned"
            if timed_out:
                job.finish(error=_timeout_error(job, self.max_compile_seconds or 0.0))
                self.stats.jobs_failed += 1
                logger.warning(
                    "%s ran past max_compile_seconds=%s; stopping its worker",
                    job.name,
                    self.max_compile_seconds,
                )
                return "timeout"
            if reply is None:
                return await self._lost_during(job, worker)
            kind, job_id, value = reply
            if job_id != job.id:
                raise RuntimeError(f"worker answered job {job_id} while running job {job.id}")
            self.stats.record_job(job.name, job.seconds)
            if kind == "done":
                self.stats.jobs_done += 1
                job.finish(result=value)
            else:
                self.stats.jobs_failed += 1
                job.finish(error=value)

    async def _lost_during(self, job: Job, worker: _SpawnedWorker | _ForkedWorker) -> str:
        """The worker died while it ran job: retry or fail the job; returns the restart cause."""
        code = await _stop(worker)
        # An exit nobody could report in time (its template stopped) came from outside too.
        cause = worker.stop_cause or ("killed" if code in _EXTERNAL or code is None else "crash")
        if cause == "template":
            # The template it was forked from died, and took it along: not this job's doing,
            # and not counted against it.
            self.stats.jobs_retried += 1
            logger.warning(
                "worker pid %d went with its template while compiling %s; retrying it", worker.pid, job.name
            )
            self.queue.put(job, front=True)
            return "killed"
        if cause == "killed" and job.external_kills == 0:
            # Not the job's fault: once more, on a fresh worker, ahead of everything else.
            job.external_kills += 1
            self.stats.jobs_retried += 1
            logger.warning(
                "worker pid %d %s while compiling %s; retrying it", worker.pid, _describe_exit(code), job.name
            )
            self.queue.put(job, front=True)
            return cause
        tail = await anyio.to_thread.run_sync(_stderr_tail, worker.stderr_path)
        job.finish(error=_crash_error(job, code, tail, cause, self.memory_limit))
        self.stats.jobs_failed += 1
        logger.error("worker pid %d %s while compiling %s", worker.pid, _describe_exit(code), job.name)
        return cause

    async def _watch_memory(self) -> None:
        """Measure every worker's memory (for stats) and stop any that passes the limit, or
        that has been stopped by a signal (SIGSTOP, SIGTSTP) for longer than _STOPPED_LIMIT:
        a stopped worker never answers, and its job is better retried on a fresh one."""
        interval = 0.2 if self.memory_limit is not None else 1.0
        while True:
            await anyio.sleep(interval)
            workers = list(self.alive.values())
            template = self._template
            if template is not None and not template.lost.is_set():
                # A stopped template forks nothing: replace it as a stopped worker is replaced.
                stopped = await anyio.to_thread.run_sync(_is_stopped, template.pid)
                now = time.monotonic()
                template.stopped_since = (template.stopped_since or now) if stopped else None
                if template.stopped_since is not None and now - template.stopped_since >= _STOPPED_LIMIT:
                    logger.warning(
                        "the template pid %d has been stopped by a signal; replacing it", template.pid
                    )
                    _kill_group(template.pid)
            if not workers:
                continue
            samples = await anyio.to_thread.run_sync(_sample_all, [w.pid for w in workers])
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
                self.stats.worker_rss[worker.pid] = rss
                if self.memory_limit is not None and rss > self.memory_limit and worker.stop_cause is None:
                    worker.stop_cause = "memory"
                    logger.warning(
                        "worker pid %d uses %d MiB, past the limit of %d MiB; stopping it",
                        worker.pid,
                        rss >> 20,
                        self.memory_limit >> 20,
                    )
                    worker.signal_kill()


async def _stop_template(template: _Template) -> None:
    """Stop the template: at EOF it kills and reaps every worker it forked, then exits; once it
    has exited, none of them is left."""
    with anyio.CancelScope(shield=True):
        try:
            await template._stdin.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        with anyio.move_on_after(2):
            await template.process.wait()
        if template.process.returncode is None:
            _kill_group(template.pid)
            with anyio.move_on_after(5):
                await template.process.wait()
        await template.process.aclose()


def _short(backend: str) -> str:
    return backend.rsplit(".", 1)[-1].lstrip("_")


def _unsendable_error(job: Job, exc: Exception) -> CompileError:
    return CompileError(
        f"cannot send {job.name!r} to a worker: {type(exc).__name__}: {exc}",
        kernel=job.name,
        backend=_short(job.backend),
        log=str(exc),
    )


def _timeout_error(job: Job, limit: float) -> CompileTimeoutError:
    return CompileTimeoutError(
        f"compiling {job.name!r} took longer than max_compile_seconds={limit:g}; its worker was stopped",
        kernel=job.name,
        backend=_short(job.backend),
    )


def _crash_error(job: Job, code: int | None, tail: str, cause: str, memory_limit: int | None) -> CompileError:
    if cause == "memory":
        what = f"passed the pool's memory limit of {(memory_limit or 0) >> 20} MiB and was stopped"
    elif cause == "killed":
        what = f"{_describe_exit(code)} twice (killed from outside; retried once)"
    else:
        what = _describe_exit(code)
    return WorkerCrashedError(
        f"the worker compiling {job.name!r} {what}",
        exit_code=code,
        cause=cause,
        kernel=job.name,
        backend=_short(job.backend),
        stderr_tail=tail,
    )
