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
import functools
import hashlib
import itertools
import json
import logging
import os
import signal
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

from acompile import _errors, _files, _linux
from acompile._errors import AcompileError, PoolError
from acompile._trust import own_folder
from acompile._version import __version__
from acompile._workers import URGENT, Job, LinkedExecutor, LinkLost, Policy, Reply, checked_count

if TYPE_CHECKING:
    from acompile._workers import Executor, Link, Opening, WorkerSettings

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
# How long a process waits for a server that took its connection to say hello (it does so as it
# accepts). One that does not: stopped by a signal, it is replaced (see _take_over); running yet
# mute (hung), the process compiles on its own workers, and tries again later.
HELLO_TIMEOUT = 3.0
# How long a stopped server that was killed to be replaced may take to be gone.
_KILL_WAIT = 5.0
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
    return peer_credentials(sock)[1]


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


# Starts the command it is given in a session of its own (it serves the host: it outlives the
# process that started it), says its process id, and exits.
_DETACH = (
    "import subprocess, sys; print(subprocess.Popen("
    "sys.argv[1:], start_new_session=True, close_fds=True, stdout=subprocess.DEVNULL).pid)"
)
# Linux's limit for the path of a Unix socket (sun_path), its terminating NUL included.
_SOCKET_PATH_MAX = 108


def _frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(dict(header, size=len(body)), separators=(",", ":")).encode()
    return _LENGTH.pack(len(head)) + head + body


class _SocketLink:
    """A connection to the host's server as a ``Link`` (``acompile._workers.LinkedExecutor``):
    frames over its Unix socket."""

    def __init__(
        self, stream: anyio.abc.SocketStream, reader: BufferedByteReceiveStream, hello: dict[str, Any]
    ):
        self.stream = stream
        self.reader = reader
        self.hello = {"size": int(hello.get("workers", 1)), "pid": int(hello.get("pid", 0)) or None}
        self.ready = bool(hello.get("ready"))
        self._names: dict[int, str] = {}  # the jobs sent, for the errors that come back

    def submit(self, job: Job) -> bytes:
        if job.backend not in JOB_MODULES or not isinstance(job.payload, bytes):
            # The server runs only these, whose payloads the served code pickles itself.
            raise _errors.CompileError(
                f"the host pool runs no jobs of {job.backend!r} (only torch.compile's and the JIT "
                "libraries')",
                kernel=job.name,
                backend=job.backend.rsplit(".", 1)[-1].lstrip("_"),
            )
        self._names[job.id] = job.name
        return _frame({"op": "run", "id": job.id, "name": job.name, "module": job.backend}, job.payload)

    def cancel(self, job_id: int) -> bytes:
        self._names.pop(job_id, None)
        return _frame({"op": "cancel", "id": job_id})

    def promote(self, job_id: int) -> None:
        return None  # the server's queue decides what runs first

    def quiesce(self) -> None:
        return None  # the server's workers are the host's: they stop when no process is connected

    def wakeup(self) -> None:
        return None

    def wait_ready(self, token: int) -> None:
        return None  # the server says "ready" to everyone

    async def write(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except (*_LOST, OSError) as exc:
            raise LinkLost(f"its socket does not take frames ({type(exc).__name__})") from exc

    async def tend(self) -> None:
        await anyio.sleep_forever()

    async def receive(self) -> Reply:
        try:
            header, body = await receive_frame(self.reader)
        except (*_LOST, ValueError, OSError) as exc:
            raise LinkLost(f"its socket closed ({type(exc).__name__})") from exc
        op = header.get("op")
        if op == "ready":
            self.ready = True
            return Reply("ready", -1)
        if op in ("done", "error"):
            job_id = int(header.get("id", -1))
            name = self._names.pop(job_id, "job")
            if op == "done":
                return Reply("done", job_id, body)
            return Reply("error", job_id, _rebuilt(header, name))
        return Reply("beat")  # a ping: it lives

    async def close(self, grace: float) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


async def _connect(cache_root: Path, workers: int | None, idle_exit: float) -> _SocketLink:
    """Connect to the host's server (started where none listens), bounded: a server that accepts
    and never answers must not hold anyone. One stopped by a signal (SIGSTOP) is replaced: killed,
    ours and confirmed as the host pool's server, under the folder's lock, and a new one started
    (see ``_take_over``); one that is running yet mute is given up on after ``HELLO_TIMEOUT``.
    Raises ``HostPoolError``."""
    try:
        with anyio.fail_after(START_TIMEOUT + SILENCE_LIMIT):
            ensure = functools.partial(_ensure_server, cache_root, workers, idle_exit)
            path = await anyio.to_thread.run_sync(ensure, abandon_on_cancel=True)
            try:
                return await _hello(path)
            except _Mute as mute:
                take_over = functools.partial(_take_over, cache_root, workers, idle_exit, mute)
                why_not = await anyio.to_thread.run_sync(take_over, abandon_on_cancel=True)
                if why_not is not None:
                    raise HostPoolError(
                        f"the host pool's server (pid {mute.pid}) took the connection but said nothing "
                        f"within {HELLO_TIMEOUT:g} s, and is not replaced: {why_not}"
                    ) from None
                return await _hello(path)  # the new server's
    except (*_LOST, OSError, TimeoutError, ValueError) as exc:
        # A server that dies or closes the connection during the hello (its idle exit racing a
        # new connection, a SIGKILL) is no server: never an error past this.
        raise HostPoolError(f"cannot reach the host pool: {type(exc).__name__}: {exc}") from exc


class _Mute(HostPoolError):
    """The server at ``path`` took a connection and said no hello in time (a ``HostPoolError``
    where it is not replaced)."""

    def __init__(self, path: str, pid: int, inode: int) -> None:
        super().__init__(f"the host pool's server (pid {pid}) at {path} said nothing in {HELLO_TIMEOUT:g} s")
        self.path = path
        self.pid = pid
        self.inode = inode


async def _hello(path: str) -> _SocketLink:
    """A connection to the server at ``path`` that has said hello; raises ``_Mute`` where it
    says nothing within ``HELLO_TIMEOUT``, ``HostPoolError`` where it is not ours or says
    something else."""
    inode = os.stat(path).st_ino  # which socket this is: a replacement's is another
    with anyio.fail_after(SILENCE_LIMIT):
        stream = await anyio.connect_unix(path)
    try:
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        pid, uid = peer_credentials(raw)
        if uid != os.getuid():
            raise HostPoolError(f"the host pool's socket {path} is served by another user")
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(HELLO_TIMEOUT):
                header, _ = await receive_frame(reader)
        except TimeoutError:
            raise _Mute(path, pid, inode) from None
        if header.get("op") != "hello":
            raise HostPoolError(f"the host pool at {path} did not say hello")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return _SocketLink(stream, reader, header)


def _take_over(cache_root: Path, workers: int | None, idle_exit: float, mute: _Mute) -> str | None:
    """Replace a server that did not say hello, where it is stopped by a signal: under the
    folder's lock (one process replaces it; the others find the new one), and only where the
    socket is still the one that process connected to, and the process behind it is this user's
    host pool server for that socket (its command line says so). It is killed (SIGKILL reaches a
    stopped process; its workers end with it), and a new server is started once it is gone: never
    two servers at one socket. Returns None where a server that answers may be there now (the
    new one, or another process's replacement), else why it is not replaced (blocking)."""
    folder = run_folder(cache_root)
    path = Path(mute.path)
    lock_path = folder / (path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        if not _files.lock_within(fd, START_TIMEOUT):
            return f"{lock_path} stayed locked for {START_TIMEOUT:g} s"
        try:
            if os.stat(path).st_ino != mute.inode:
                return None  # replaced meanwhile, by another process
        except FileNotFoundError:
            return None  # gone: whoever asks next starts one
        if not _server_of(mute.pid, path):
            return "the process behind its socket is not this user's host pool server"
        state = _state(mute.pid)
        if state not in ("T", "Z", "X", None):
            # Running, yet mute: hung, or slower than that on a loaded machine. Not killed on a
            # guess: this process compiles on its own workers, and tries the server again later.
            return f"it is running (state {state}), not stopped"
        logger.warning(
            "the host pool's server (pid %d) is stopped by a signal and answers nobody; replacing it",
            mute.pid,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(mute.pid, signal.SIGKILL)
        gone_by = time.monotonic() + _KILL_WAIT
        while not _gone(mute.pid):
            if time.monotonic() > gone_by:
                return f"it was killed, and still there after {_KILL_WAIT:g} s"
            time.sleep(0.02)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # the dead server's
        _start_and_wait(cache_root, workers, idle_exit, folder, path, deadline)
        return None
    finally:
        os.close(fd)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The process id and user id of the other end of a Unix socket (``SO_PEERCRED``: for a
    client, those of the process that made the listening socket)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _server_of(pid: int, path: Path) -> bool:
    """Whether process ``pid`` is this user's host pool server for the socket at ``path``."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    if b"acompile._torch._hostpool" not in argv:
        return False
    return any(a == b"--socket" and b == os.fsencode(path) for a, b in itertools.pairwise(argv))


def _state(pid: int) -> str | None:
    """A process's state letter (``/proc/PID/stat``: R, S, D, T, t, Z ...), None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The name is in parentheses and may hold spaces: the state follows the last ")".
            return f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return None


def _gone(pid: int) -> bool:
    """Whether a process has ended (a zombie has: its socket is closed)."""
    return _state(pid) in (None, "Z", "X")


def _ensure_server(cache_root: Path, workers: int | None, idle_exit: float) -> str:
    """The socket of a listening server, started if none listens (blocking; one process at a
    time, under the folder's lock)."""
    folder = run_folder(cache_root)
    path = folder / socket_name()
    if len(os.fsencode(path)) >= _SOCKET_PATH_MAX:
        # A server could not listen there (Linux's limit for a Unix socket's path): said now,
        # not after the wait for a server that died at once.
        raise HostPoolError(
            f"the host pool's socket path {str(path)!r} is {len(os.fsencode(path))} bytes, over the "
            f"{_SOCKET_PATH_MAX - 1} a Unix socket's path may have: give a shorter cache folder"
        )
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
        _start_and_wait(cache_root, workers, idle_exit, folder, path, deadline)
        return str(path)
    finally:
        os.close(fd)


def _start_and_wait(
    cache_root: Path, workers: int | None, idle_exit: float, folder: Path, path: Path, deadline: float
) -> None:
    """Start a server at ``path`` and wait until it listens (the caller holds the lock)."""
    server = _start_server(cache_root, workers, idle_exit, folder, path)
    while not _listening(path):
        if time.monotonic() > deadline:
            raise HostPoolError(f"the host pool did not listen at {path} within {START_TIMEOUT:g} s")
        if not _linux.pid_alive(server):
            raise HostPoolError(
                f"the host pool's server (pid {server}) ended as it started: {_last_line(folder, path)}"
            )
        time.sleep(0.05)


def _last_line(folder: Path, path: Path) -> str:
    """The last line of the server's log (why it ended), bounded."""
    try:
        with open(folder / (path.stem + ".log"), "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - 4096))
            lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "its log cannot be read"
    return lines[-1] if lines else "it wrote nothing to its log"


def _start_server(cache_root: Path, workers: int | None, idle_exit: float, folder: Path, path: Path) -> int:
    """Start the host's server, detached; its process id."""
    env = dict(os.environ)
    env.pop("ACOMPILE_SERVE_TORCH", None)  # the server serves; it is not served
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.pathsep.join(sys.path), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "acompile._torch._hostpool",
        "--cache-dir",
        str(cache_root),
        "--socket",
        str(path),
        "--idle-exit",
        str(idle_exit),
    ]
    if workers is not None:
        command += ["--workers", str(workers)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
    log = os.open(folder / (path.stem + ".log"), flags, 0o600)
    try:
        # Through a process that starts the server and exits at once (waited for here): the
        # server is the host's, not this process's child, so nobody here leaves it a zombie
        # when it ends, or has to wait for it.
        started = subprocess.run(
            [sys.executable, "-S", "-c", _DETACH, *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            close_fds=True,
            check=True,
            timeout=START_TIMEOUT,
        )
        return int(started.stdout)
    except (subprocess.SubprocessError, ValueError) as exc:
        raise HostPoolError(f"cannot start the host pool's server: {exc}") from exc
    finally:
        os.close(log)


# The host's pool as a LinkedExecutor meets a loss: the server pings every HEARTBEAT (silent for
# SILENCE_LIMIT, it is stopped or hung); a server lost is started again at once by whoever asks
# first, and the jobs in flight are sent again to it, once; where it cannot be, they (and later
# jobs) go to this process's own workers, and the server is tried again after _RETRY_AFTER s.
_POLICY = Policy(
    silence=SILENCE_LIMIT,
    at_once=True,
    first=_RETRY_AFTER,
    most=2 * _RETRY_AFTER,
    close_grace=0.0,
    abort_grace=0.0,
)


class HostPool:
    """The host's pool as an executor spec (``CompilePool(workers=HostPool())``): the pool's jobs
    go to the one pool server of this host (started by the first process that asks), through the
    pool's own queue, traces and stats. Where no server can be had (it does not answer, its
    folder is not ours), or it is lost and cannot be started again, the pool's own local workers
    instead, after one warning.

    Args:
        count: the server's workers, where this process is the one that starts it (None: its
            default); the local workers of a fallback too.
    """

    def __init__(self, count: int | None = None, idle_exit: float = IDLE_EXIT) -> None:
        self.count = checked_count(count)
        if isinstance(idle_exit, bool) or not isinstance(idle_exit, (int, float)) or not 0 < idle_exit < 1e6:
            raise ValueError(f"idle_exit must be a positive number of seconds, got {idle_exit!r}")
        self.idle_exit = float(idle_exit)

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        try:
            link = await _connect(opening.cache_root, self.count, self.idle_exit)
        except HostPoolError as exc:
            # No host pool to be had: this process's own workers compile, started on demand.
            logger.warning("%s; compiling on this process's own workers", exc)
            return opening.fallback_or_local(settings, self.count)

        def local() -> Executor:
            return opening.local_workers(settings, self.count)

        # A lost server's jobs go to the urgent executor under a Split (the pool serves it), else
        # to local workers made then (served, and released again, by the executor).
        executor = HostPoolExecutor(
            link,
            self,
            opening.cache_root,
            local=opening.fallback,
            make_local=None if opening.fallback is not None else local,
        )
        opening.stack.push_async_callback(executor.aclose)  # where serve() never runs
        return executor

    def __repr__(self) -> str:
        return f"HostPool({self.count!r})"


class HostPoolExecutor(LinkedExecutor):
    """The host's pool as the served process's executor: a ``LinkedExecutor`` over the server's
    socket (``serve(host_pool=True)``)."""

    def __init__(
        self,
        link: _SocketLink,
        spec: HostPool,
        cache_root: Path,
        *,
        local: Executor | None,
        make_local: Callable[[], Executor] | None,
    ) -> None:
        async def reconnect() -> Link:
            return await _connect(cache_root, spec.count, spec.idle_exit)

        super().__init__(link, reconnect, _POLICY, _lost, local=local, make_local=make_local)

    @property
    def server_pid(self) -> int | None:
        """The host's server process, as it said at the latest connection."""
        pid = self.link.hello.get("pid")
        return int(pid) if pid else None

    @property
    def size(self) -> int:
        """The host's server's workers."""
        return int(self.link.hello.get("size", 1))


def _lost(what: str) -> PoolError:
    return PoolError(f"the host pool went away: {what}")


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
        bound = os.stat(path).st_ino
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
                # Ours (a process that finds none starts a server), unless a successor's is
                # there now: this server was replaced while it did not answer.
                if os.stat(path).st_ino == bound:
                    os.unlink(path)


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
