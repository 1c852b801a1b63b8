"""One pool for every process of a host: ``serve(host_pool=True)``, ``acompile run --host-pool``.

A model server's ranks (vLLM's tensor-parallel workers, a training job's processes) each compile
the same graphs; with a pool each, a host of eight ranks runs eight pools' workers at once
("32 * 8 workers all competing"). With the host pool, the first served process of the host
starts a pool server (``python -m acompile._torch._hostpool``, a session of its own); every
served process of the host, that one included, sends its compile jobs to it over a Unix socket,
and keeps its own cache tiers (the jobs' results land in Inductor's caches of the process that
asked). The server stops once no process has been connected for ``IDLE_EXIT`` seconds.

**Trust.** The socket lives in ``<cache folder>/run/``, a folder of this user's that no one else
may write (checked, never chmod-ed into shape); both ends check the other's user id
(``SO_PEERCRED``) before anything else. A client's job payload reaches only the server's own
workers, as any payload does; a reply is unpickled only by the client that asked, from a server
of its own user. One server per Python environment (its path, acompile's and torch's versions
name the socket): a job's functions unpickle where they were pickled.

**Frames.** Each message is a 4-byte length, a JSON header, then ``header["size"]`` bytes: the
client's ``run`` (id, name, payload) and ``cancel`` (id); the server's ``hello`` (its pid and
size) and, per job, ``done`` (the worker's reply) or ``error`` (an acompile error, by class name).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from acompile import _errors, _files
from acompile._errors import AcompileError, PoolClosedError, PoolError
from acompile._trust import own_folder
from acompile._version import __version__
from acompile._workers import URGENT, ExecutorStats, Job, JobCancelled, idle_stats, run_job

if TYPE_CHECKING:
    from acompile._workers import Executor, Opening, WorkerSettings

logger = logging.getLogger("acompile")

RUN_FOLDER = "run"
# The jobs a client sends, by the worker module that runs them: torch.compile's (Inductor's Triton
# compiles, C++ builds) and the JIT libraries' ninja builds (``acompile._jit``, the layer above,
# names its own; only these run here).
TORCH_JOBS = "acompile._torch._worker"
JOB_MODULES = frozenset({TORCH_JOBS, "acompile._jit._worker"})
# How long the server stays up with no process connected.
IDLE_EXIT = 60.0
# How long a process waits for a server it started to listen.
START_TIMEOUT = 60.0
# The server says something to every process this often (a ping when it has nothing else to
# say); a process that hears nothing for SILENCE_LIMIT takes the server for gone.
HEARTBEAT = 2.0
SILENCE_LIMIT = 10.0
# After the server could not be started again, jobs run in their own process this long.
_RETRY_AFTER = 30.0
_LOST = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError)
_LENGTH = struct.Struct(">I")
_MAX_HEADER = 1 << 20


class HostPoolError(PoolError):
    """The host's pool cannot be used (its folder is not this user's, its server does not come)."""


# --- the folder and the socket -----------------------------------------------------------------


def run_folder(cache_root: Path) -> Path:
    """``<cache_root>/run``, this user's and nobody else's to write (made so if absent). Raises
    ``UntrustedFolderError`` naming the folder and its owner otherwise: a socket in a folder
    another user can write could be theirs."""
    return own_folder(cache_root / RUN_FOLDER, "the host pool's folder")


def socket_name() -> str:
    """The server's socket for this Python environment (its interpreter, acompile's and torch's
    versions): a job pickled here unpickles there."""
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "none"
    digest = hashlib.sha256(f"{sys.executable}\0{__version__}\0{torch_version}".encode()).hexdigest()[:12]
    return f"pool-{digest}.sock"


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


# --- frames -------------------------------------------------------------------------------------


async def send_frame(stream: anyio.abc.ByteSendStream, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(dict(header, size=len(body)), separators=(",", ":")).encode()
    await stream.send(_LENGTH.pack(len(head)) + head + body)


async def receive_frame(reader: BufferedByteReceiveStream) -> tuple[dict[str, Any], bytes]:
    (length,) = _LENGTH.unpack(await reader.receive_exactly(_LENGTH.size))
    if length > _MAX_HEADER:
        raise ValueError(f"a frame header of {length} bytes")
    header = json.loads(await reader.receive_exactly(length))
    if not isinstance(header, dict) or not isinstance(header.get("size"), int) or header["size"] < 0:
        raise ValueError("a malformed frame header")
    body = await reader.receive_exactly(header["size"]) if header["size"] else b""
    return header, body


def _error_frame(job_id: int, exc: BaseException) -> dict[str, Any]:
    frame = {"op": "error", "id": job_id, "error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, _errors.CompileError):
        # Whose failure it is (a JIT library's build tells its compiler's from the pool's by
        # it) and what the compiler said.
        frame.update(backend=exc.backend, log=exc.log)
    return frame


def _rebuilt(header: dict[str, Any], name: str) -> AcompileError:
    """An acompile error from a server's ``error`` frame (by class name; never unpickled)."""
    cls = getattr(_errors, str(header.get("error")), None)
    message = str(header.get("message", "the host pool failed the job"))
    if isinstance(cls, type) and issubclass(cls, _errors.CompileError):
        backend = str(header.get("backend") or "inductor")
        if issubclass(cls, _errors.WorkerCrashedError):
            return cls(message, exit_code=None, kernel=name, backend=backend)
        return cls(message, kernel=name, backend=backend, log=str(header.get("log") or ""))
    if isinstance(cls, type) and issubclass(cls, AcompileError):
        return cls(message)
    return PoolError(message)


# --- the client (in a served process) ------------------------------------------------------------


class HostPoolClient:
    """A served process's link to the host's pool: ``run(job)`` sends the job there. Used as
    ``async with`` (its reader runs in a task group of its own); a lost server is started again
    and the jobs in flight sent again, once."""

    def __init__(self, cache_root: Path, workers: int | None, idle_exit: float = IDLE_EXIT) -> None:
        self.cache_root = cache_root
        self.workers = workers
        self.idle_exit = idle_exit
        self.size = workers or 1
        self.server_pid: int | None = None
        self._stream: anyio.abc.SocketStream | None = None
        self._send_lock = anyio.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[anyio.Event, list[Any]]] = {}
        self._ready = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._down_until = 0.0

    async def __aenter__(self) -> HostPoolClient:
        """Connect (starting the host's server where none listens); raises ``HostPoolError``
        where that does not happen within ``START_TIMEOUT`` and ``SILENCE_LIMIT``."""
        try:
            await self._connect()
        except (OSError, TimeoutError, ValueError) as exc:
            raise HostPoolError(f"cannot reach the host pool: {type(exc).__name__}: {exc}") from exc
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        if self._stream is not None:
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
        for event, slot in self._waiting.values():
            slot.append(PoolClosedError("the pool serving torch.compile has shut down"))
            event.set()

    async def _connect(self) -> None:
        """Connect to the host's server (started where none listens): bounded, since a server
        that accepts and never answers (stopped by a signal, hung) must not hold anyone."""
        path = await anyio.to_thread.run_sync(self._ensure_server, abandon_on_cancel=True)
        with anyio.fail_after(SILENCE_LIMIT):
            stream = await anyio.connect_unix(path)
            try:
                raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
                if peer_uid(raw) != os.getuid():
                    raise HostPoolError(f"the host pool's socket {path} is served by another user")
                reader = BufferedByteReceiveStream(stream)
                header, _ = await receive_frame(reader)
                if header.get("op") != "hello":
                    raise HostPoolError(f"the host pool at {path} did not say hello")
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                raise
        self._stream = stream
        self._reader = reader
        self.size = int(header.get("workers", self.size))
        self.server_pid = int(header.get("pid", 0)) or None
        if header.get("ready"):
            self._ready.set()

    def _ensure_server(self) -> str:
        """The socket of a listening server, started if none listens (blocking; one process at
        a time, under the folder's lock)."""
        folder = run_folder(self.cache_root)
        path = folder / socket_name()
        lock_path = folder / (path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            if not _files.lock_within(fd, START_TIMEOUT):
                raise HostPoolError(f"{lock_path} stayed locked for {START_TIMEOUT:g} s")
            if _listening(path):
                return str(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a server that died left it
            self._start_server(folder, path)
            while not _listening(path):
                if time.monotonic() > deadline:
                    raise HostPoolError(f"the host pool did not listen at {path} within {START_TIMEOUT:g} s")
                time.sleep(0.05)
            return str(path)
        finally:
            os.close(fd)

    def _start_server(self, folder: Path, path: Path) -> None:
        env = dict(os.environ)
        env.pop("ACOMPILE_SERVE_TORCH", None)  # the server serves; it is not served
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.pathsep.join(sys.path), env.get("PYTHONPATH")]))
        command = [
            sys.executable,
            "-m",
            "acompile._torch._hostpool",
            "--cache-dir",
            str(self.cache_root),
            "--socket",
            str(path),
            "--idle-exit",
            str(self.idle_exit),
        ]
        if self.workers is not None:
            command += ["--workers", str(self.workers)]
        log = os.open(
            folder / (path.stem + ".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600
        )
        try:
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                start_new_session=True,  # it serves the host: it outlives the process that started it
                close_fds=True,
            )
        finally:
            os.close(log)

    async def _read(self) -> None:
        while True:
            if self._stream is None:
                await self._come_back()
                continue
            try:
                # The server says something every HEARTBEAT: silence this long is a server gone
                # or stopped, whose socket still takes connections.
                with anyio.fail_after(SILENCE_LIMIT):
                    header, body = await receive_frame(self._reader)
            except (*_LOST, ValueError, OSError, TimeoutError):
                await self._lost()
                continue
            op = header.get("op")
            if op == "ping":
                continue
            if op == "ready":
                self._ready.set()
                continue
            waiting = self._waiting.get(int(header.get("id", -1)))
            if waiting is None:
                continue
            event, slot = waiting
            slot.append(body if op == "done" else header)
            event.set()

    async def _lost(self) -> None:
        """The server went away (or went silent): start another, and send the jobs in flight
        again (once each). Where that fails, the jobs fail with a ``PoolError`` (the served code
        then runs them in its own process), and later jobs too until the server comes back."""
        logger.warning("the host pool's server went away; starting another")
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        try:
            with anyio.fail_after(START_TIMEOUT + SILENCE_LIMIT):
                await self._connect()
        except Exception as exc:
            self._down_until = time.monotonic() + _RETRY_AFTER
            for event, slot in self._waiting.values():
                slot.append(PoolClosedError(f"the host pool is gone and did not come back: {exc}"))
                event.set()
            logger.warning("the host pool did not come back (%s); compiling here for %g s", exc, _RETRY_AFTER)
            return
        for event, slot in self._waiting.values():
            slot.append("again")
            event.set()

    async def _come_back(self) -> None:
        """Try the host's server again once the back-off after a failed attempt is over."""
        await anyio.sleep(max(0.0, self._down_until - time.monotonic()))
        try:
            with anyio.fail_after(START_TIMEOUT + SILENCE_LIMIT):
                await self._connect()
            logger.warning("the host pool is back")
        except Exception:
            self._down_until = time.monotonic() + _RETRY_AFTER

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def run(self, job: Job) -> Any:
        for attempt in range(2):
            job_id = next(self._ids)
            event = anyio.Event()
            slot: list[Any] = []
            self._waiting[job_id] = (event, slot)
            try:
                await self._send(
                    {"op": "run", "id": job_id, "name": job.name, "module": job.backend}, job.payload
                )
                await event.wait()
            except BaseException:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    if not event.is_set():
                        await self._send({"op": "cancel", "id": job_id})
                raise
            finally:
                self._waiting.pop(job_id, None)
            outcome = slot[0]
            if outcome == "again" and attempt == 0:
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            if isinstance(outcome, dict):
                raise _rebuilt(outcome, job.name)
            if outcome == "again":
                raise PoolError(f"the host pool went away twice while it ran {job.name!r}")
            return outcome
        raise AssertionError("unreachable")

    async def _send(self, header: dict[str, Any], body: bytes = b"") -> None:
        async with self._send_lock:
            if self._stream is None:
                raise PoolError("the host pool is not reachable now")
            try:
                await send_frame(self._stream, header, body)
            except _LOST as exc:
                raise PoolError(f"the host pool went away: {type(exc).__name__}") from exc


class HostPool:
    """The host's pool as an executor spec (``CompilePool(workers=HostPool())``): the pool's jobs
    go to the one pool server of this host (started by the first process that asks), through the
    pool's own queue, traces and stats. Where no server can be had (it does not answer, its
    folder is not ours), the pool's own local workers instead, after one warning.

    Args:
        count: the server's workers, where this process is the one that starts it (None: its
            default); the local workers of a fallback too.
    """

    def __init__(self, count: int | None = None, idle_exit: float = IDLE_EXIT) -> None:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"workers must be a positive integer or None, got {count!r}")
        self.count = count
        self.idle_exit = idle_exit

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        client = HostPoolClient(opening.cache_root, self.count, self.idle_exit)
        try:
            # Left after the pool's task group: the jobs in flight are over by then.
            await opening.stack.enter_async_context(client)
        except HostPoolError as exc:
            # No host pool to be had: this process's own workers compile, started on demand.
            logger.warning("%s; compiling on this process's own workers", exc)
            return opening.local_workers(settings, self.count)
        return HostPoolExecutor(client)

    def __repr__(self) -> str:
        return f"HostPool({self.count!r})"


class HostPoolExecutor:
    """Implements ``Executor`` over a connected ``HostPoolClient``: each job runs in a task of
    ``serve()``'s, which sends it to the server and sets its outcome; cancelling it sends the
    server a cancel. The server keeps the queue of every process of the host, so this one holds
    none: what it reports is its own jobs."""

    def __init__(self, client: HostPoolClient) -> None:
        self.client = client
        self._pending: list[Job] = []
        self._wake = anyio.Event()
        self._scopes: dict[Job, anyio.CancelScope] = {}
        self._counts = {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 0, "retried": 0}
        self._seconds: list[float] = []
        self._slowest: list[tuple[float, str]] = []
        self._closed = False

    def submit(self, job: Job) -> None:
        if self._closed:
            raise PoolClosedError("the pool has shut down")
        job.state = "queued"
        self._pending.append(job)
        self._counts["queued"] += 1
        self._wake.set()

    async def run(self, job: Job) -> Any:
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        scope = self._scopes.get(job)
        if scope is not None:
            scope.cancel()
        elif job in self._pending:
            self._pending.remove(job)
            self._counts["queued"] -= 1
            self._counts["cancelled"] += 1
            job.finish(error=JobCancelled(job.name))

    def promote(self, job: Job) -> None:
        """The server's queue decides what runs first: nothing to move here."""

    def quiesce(self) -> None:
        """The server's workers are the host's: they stop when no process is connected."""

    def wakeup(self) -> None:
        """The server is up while this process is connected."""

    async def wait_ready(self) -> None:
        await self.client.wait_ready()

    def stats(self) -> ExecutorStats:
        stats = idle_stats(self.client.size)
        stats["workers"]["awake"] = True
        stats["workers"]["busy"] = self._counts["running"]
        stats["jobs"] = dict(self._counts)  # type: ignore[typeddict-item]
        stats["job_seconds"] = list(self._seconds)
        stats["slowest"] = sorted(self._slowest, reverse=True)
        return stats

    async def serve(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    pending, self._pending = self._pending, []
                    for job in pending:
                        self._counts["queued"] -= 1
                        self._counts["running"] += 1
                        scope = anyio.CancelScope()
                        self._scopes[job] = scope
                        tg.start_soon(self._run, job, scope)
        finally:
            self._closed = True
            for job in self._pending:
                job.finish(error=PoolClosedError("the pool shut down while compiling"))
            self._pending.clear()

    async def _run(self, job: Job, scope: anyio.CancelScope) -> None:
        job.state = "running"
        job.started_at = time.perf_counter()
        result: Any = None
        error: BaseException | None = None
        answered = False
        try:
            with scope:
                result = await self.client.run(job)
                answered = True
        except Exception as exc:
            error, answered = exc, True
        finally:
            self._scopes.pop(job, None)
            self._counts["running"] -= 1
            job.ended_at = time.perf_counter()
            job.seconds = job.ended_at - job.started_at
            if not answered:
                # Cancelled: by cancel() (nobody waits), or with the pool's task group.
                self._counts["cancelled"] += 1
                gone = JobCancelled(job.name) if scope.cancel_called else None
                job.finish(error=gone or PoolClosedError("the pool shut down while compiling"))
            else:
                self._counts["failed" if error is not None else "done"] += 1
                self._seconds = [*self._seconds[-99:], job.seconds]
                self._slowest = heapq.nlargest(10, [*self._slowest, (job.seconds, job.name)])
                job.finish(result, error)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


# --- the server --------------------------------------------------------------------------------


async def serve(
    open_pool: Callable[..., AbstractAsyncContextManager[Any]],
    cache_root: Path,
    path: Path,
    workers: int | None,
    idle_exit: float,
) -> None:
    """Run the host's pool at ``path`` until no process has been connected for ``idle_exit``.
    ``open_pool`` is ``CompilePool``, handed in by the program (this module is below it)."""
    run_folder(cache_root)
    async with open_pool(workers, cache_dir=cache_root, preload=("inductor",)) as pool:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead server's (the process that started this one holds the lock)
        listener = await anyio.create_unix_listener(path)
        os.chmod(path, 0o600)
        server = _Server(pool, idle_exit)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.become_ready)
                tg.start_soon(server.idle_watch, tg.cancel_scope)
                tg.start_soon(listener.serve, server.handle)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(OSError):
                os.unlink(path)  # ours (a process that finds none starts a server)


class _Server:
    def __init__(self, pool: Any, idle_exit: float) -> None:
        self.pool = pool
        self.idle_exit = idle_exit
        self.connections = 0
        self.idle_since = time.monotonic()
        self.ready = anyio.Event()
        self._streams: set[Any] = set()

    async def become_ready(self) -> None:
        await self.pool.wait_ready()
        self.ready.set()
        for send in list(self._streams):
            with contextlib.suppress(Exception):
                await send({"op": "ready"})

    async def idle_watch(self, scope: anyio.CancelScope) -> None:
        while True:
            await anyio.sleep(min(1.0, self.idle_exit / 4))
            if self.connections == 0 and time.monotonic() - self.idle_since > self.idle_exit:
                scope.cancel()
                return

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        """One process's connection: its faults end it, never the server (a probe that connects
        and goes, a process killed mid-frame)."""
        try:
            await self._handle(stream)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError, ValueError):
            pass

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        if peer_uid(raw) != os.getuid():
            await stream.aclose()  # another user's process: nothing is read from it
            return
        self.connections += 1
        lock = anyio.Lock()

        async def send(header: dict[str, Any], body: bytes = b"") -> None:
            async with lock:
                await send_frame(stream, header, body)

        self._streams.add(send)
        jobs: dict[int, anyio.CancelScope] = {}
        try:
            size = self.pool.stats()["workers"]["size"]
            await send({"op": "hello", "pid": os.getpid(), "workers": size, "ready": self.ready.is_set()})
            reader = BufferedByteReceiveStream(stream)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat, send)
                while True:
                    try:
                        header, body = await receive_frame(reader)
                    except (
                        anyio.EndOfStream,
                        anyio.IncompleteRead,
                        anyio.BrokenResourceError,
                        ValueError,
                        OSError,
                    ):
                        break
                    job_id = int(header.get("id", -1))
                    if header.get("op") == "run":
                        scope = anyio.CancelScope()
                        jobs[job_id] = scope
                        module = str(header.get("module", TORCH_JOBS))
                        tg.start_soon(
                            self._run, send, job_id, module, str(header.get("name", "job")), body, scope, jobs
                        )
                    elif header.get("op") == "cancel" and job_id in jobs:
                        jobs[job_id].cancel()
                tg.cancel_scope.cancel()  # its process is gone: so are its jobs
        finally:
            self._streams.discard(send)
            self.connections -= 1
            self.idle_since = time.monotonic()
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    @staticmethod
    async def _heartbeat(send: Any) -> None:
        """A ping to the process every HEARTBEAT: its sign that this server lives."""
        while True:
            await anyio.sleep(HEARTBEAT)
            await send({"op": "ping"})

    async def _run(
        self,
        send: Any,
        job_id: int,
        module: str,
        name: str,
        payload: bytes,
        scope: anyio.CancelScope,
        jobs: dict[int, Any],
    ) -> None:
        try:
            with scope:
                try:
                    if module not in JOB_MODULES:
                        raise PoolError(f"the host pool runs no jobs of {module!r}")
                    result = await self.pool.executor.run(Job(module, payload, name, URGENT))
                except AcompileError as exc:
                    await send(_error_frame(job_id, exc))
                    return
                await send({"op": "done", "id": job_id}, result)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the process that asked went away
        finally:
            jobs.pop(job_id, None)


def main(open_pool: Callable[..., AbstractAsyncContextManager[Any]], argv: list[str] | None = None) -> int:
    """The server's program: ``serve`` with the arguments of its command line."""
    parser = argparse.ArgumentParser(prog="python -m acompile._torch._hostpool")
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--idle-exit", type=float, default=IDLE_EXIT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s acompile host pool: %(message)s")
    anyio.run(serve, open_pool, args.cache_dir, args.socket, args.workers, args.idle_exit)
    return 0


if __name__ == "__main__":
    # Run as a program (python -m), at the top of the package like acompile's own command: the
    # pool's class is named here, never by a module that imports this one.
    from acompile import CompilePool

    sys.exit(main(CompilePool))
