"""The template: a preloaded process that forks workers, and the Unix socket they connect to.

The template (``acompile._workers._main --template``) does a worker's whole preload once,
then forks a worker for each ``Fork`` request: a forked worker is ready in milliseconds instead of
the second a fresh interpreter needs. Forked workers are the template's children, not ours: it
reaps them and reports each exit (``Exited``); each connects back to the pool's Unix socket and
introduces itself (``Hello``, with a token only our template knows). The socket accepts only
processes of this user, and nothing a connector sends is unpickled before its hello is read and
its token checked (see ``_protocol`` for both ends' checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from acompile._errors import WorkerStartError
from acompile._workers import _protocol
from acompile._workers._config import WorkerConfig
from acompile._workers._process import (
    EXTERNAL,
    ForkedWorker,
    close_quietly,
    describe_exit,
    kill_group,
    stderr_tail,
)
from acompile._workers._slots import TransientStartError

logger = logging.getLogger("acompile")
# How long a connector has to say hello.
_HELLO_TIMEOUT = 30.0


class WorkerConnection(asyncio.Protocol):
    """A forked worker's connection: frames both ways, on asyncio's (or uvloop's) transport.

    Messages are read two ways. ``receive()`` awaits the next one (the hello, the preload's
    ``Ready``, and whatever the pool's handler declines). Once the worker runs jobs, the pool
    sets a handler (``answer_with()``): each small message is offered to it in the loop
    iteration it arrives in, so a job's reply reaches its caller without a task in between; a
    message it declines, a big one (decoded on a thread by ``receive()``), and the end of the
    stream wait for ``receive()``, in the order they came.

    Not anyio's UNIX socket stream: that one waits on a raw socket with a reader callback that
    sets a future, and a cancellation (a deadline, an abandoned job, the pool leaving) delivered
    in the same loop iteration as the worker's reply or EOF makes that callback set a cancelled
    future: asyncio logs an InvalidStateError "in callback". Here the waiter is only ever woken
    if it is still waiting.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._frames = _protocol.FrameReader()
        # Waiting for receive(): (decoded?, the message or its pieces), in arrival order.
        self._inbox: deque[tuple[bool, Any]] = deque()
        self._end: BaseException | None = None  # what receive() raises once the inbox is empty
        self._waiter: asyncio.Future[None] | None = None
        self._handler: Callable[[Any], bool] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        frames = self._frames
        if not frames.partial and len(data) > _protocol.HEADER_SIZE:
            # The common case, a reply that arrived whole and alone: no reassembly.
            (length,) = _protocol.HEADER.unpack_from(data)
            if length == len(data) - _protocol.HEADER_SIZE:
                self._arrived([data[_protocol.HEADER_SIZE :]])
                return
        frames.feed(data)
        try:
            while (parts := self._frames.next_parts()) is not None:
                self._arrived(parts)
        except ValueError as exc:  # a header no worker writes: the stream is out of sync
            self._inbox.append((True, _protocol.Undecodable(str(exc))))
            self._ended(anyio.BrokenResourceError(str(exc)))
            if self._transport is not None:
                self._transport.abort()

    def eof_received(self) -> bool:
        self._ended(anyio.IncompleteRead() if self._frames.partial else anyio.EndOfStream())
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(anyio.BrokenResourceError() if exc is not None else anyio.EndOfStream())
        self._paused = False
        self._wake_drained()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drained()

    def _arrived(self, parts: list[bytes]) -> None:
        handler = self._handler
        if handler is not None and not self._inbox and _protocol.small(parts):
            message = _protocol.decode_or_undecodable(parts)
            if not handler(message):
                self._inbox.append((True, message))
        else:
            self._inbox.append((False, parts))
        self._wake()

    def _ended(self, error: BaseException) -> None:
        if self._end is None:
            self._end = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _wake_drained(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- the pool's side

    def answer_with(self, handler: Callable[[Any], bool]) -> None:
        """Offer each small message to ``handler`` as it arrives; what it returns False for
        (and what it is not offered) waits for ``receive()``."""
        self._handler = handler

    async def receive(self) -> Any:
        """The next message not taken by the handler. Raises ``anyio.EndOfStream`` (or
        ``anyio.IncompleteRead`` inside a frame) when the worker's end closed,
        ``anyio.BrokenResourceError`` when the connection broke."""
        while not self._inbox:
            if self._end is not None:
                raise self._end
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        decoded, item = self._inbox.popleft()
        return item if decoded else await _protocol.decode_off_loop(item)

    def send_nowait(self, item: bytes) -> None:
        """Send without waiting: the transport buffers what the socket does not take at once
        (a job's frame is small; ``send()`` is for what must wait for the reader)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise anyio.BrokenResourceError
        try:
            transport.write(item)
        except (OSError, RuntimeError) as exc:
            raise anyio.BrokenResourceError from exc

    async def send(self, item: bytes) -> None:
        self.send_nowait(item)
        while self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if self._transport is not None:
            self._transport.close()  # closes the socket; nothing to wait for
        await anyio.lowlevel.checkpoint()


class UnixListener:
    """The Unix socket forked workers connect back to.

    It accepts only after waiting for readiness, never in a reader callback: asyncio's
    ``sock_accept`` accepts in its callback, which can run after the waiting task was cancelled
    (the readiness and the cancellation in one step of the loop); the connection it accepted is
    then set on a cancelled future (``InvalidStateError``) and leaks. Here a readiness that comes
    after cancellation leaves the connection in the socket's backlog, and a connection accepted
    is returned.

    A connection from a process of another user (the kernel says whose: ``SO_PEERCRED``) is
    closed as it is accepted, before a byte of it is read: its socket's folder is private, but
    whatever reaches the socket anyway is never trusted."""

    def __init__(self, address: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.socket.bind(address)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise

    async def accept(self) -> Incoming:
        me = os.geteuid()
        while True:
            try:
                connection, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.socket)
                continue
            try:
                connection.setblocking(False)
                uid = _protocol.peer_uid(connection)
            except OSError:
                connection.close()
                continue
            if uid == me:
                return Incoming(connection)
            connection.close()
            logger.warning(
                "refused a connection to the workers' socket %s from a process of uid %d (not this "
                "user's): nothing it sent was read",
                self.socket.getsockname(),
                uid,
            )

    async def aclose(self) -> None:
        self.socket.close()
        await anyio.lowlevel.checkpoint()


class Incoming:
    """A connection accepted from a process of this user, before it has introduced itself: a
    plain socket, from which only the hello is read (never unpickled) until the hello proves the
    connector one of our forked workers (``connect``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock

    async def hello(self) -> bytes:
        """The connector's first ``HELLO.size`` bytes (fewer where it closed first); not a byte
        past them is read here: what follows is the connection's, once made."""
        data = b""
        while len(data) < _protocol.HELLO.size:
            try:
                chunk = self.socket.recv(_protocol.HELLO.size - len(data))
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.socket)
                continue
            if not chunk:
                break
            data += chunk
        return data

    async def connect(self) -> WorkerConnection:
        """The connection, frames both ways (for a connector whose hello was ours)."""
        loop = asyncio.get_running_loop()
        # Shielded: a connection introduced is handed over, to be used (or closed by the caller's
        # cancellation), not dropped half made.
        with anyio.CancelScope(shield=True):
            _, protocol = await loop.create_unix_connection(WorkerConnection, sock=self.socket)
        return protocol

    async def aclose(self) -> None:
        self.socket.close()
        await anyio.lowlevel.checkpoint()


class Template:
    """The process workers are forked from, and the Unix socket they connect back to."""

    def __init__(self, process: anyio.abc.Process, address: str) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.pid = process.pid
        self.address = address
        self.token = secrets.token_hex(16)
        self._receiver = _protocol.MessageReceiver(process.stdout)
        self.stdin = process.stdin
        self.forked: dict[int, tuple[anyio.Event, list[int]]] = {}
        self.connections: dict[int, tuple[anyio.Event, list[WorkerConnection]]] = {}
        self.workers: dict[int, ForkedWorker] = {}
        self.early_exits: dict[int, int] = {}
        self.lost = anyio.Event()

    async def receive(self) -> Any:
        """The template's next message (its ``Ready``, then ``Forked`` and ``Exited``)."""
        return await self._receiver.receive()

    async def listen(self) -> None:
        """The template's reports: which pid a fork got, and which workers exited."""
        try:
            while True:
                message = await self.receive()
                if isinstance(message, _protocol.Forked):
                    waiting = self.forked.get(message.slot)
                    if waiting is not None:
                        waiting[1].append(message.pid)
                        waiting[0].set()
                elif isinstance(message, _protocol.Exited):
                    worker = self.workers.pop(message.pid, None)
                    if worker is not None:
                        worker.set_exited(message.status)
                    else:
                        self.early_exits[message.pid] = message.status
        except (
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ):
            pass
        finally:
            # Without the template, its workers must go too: stop them, tell their slots, and
            # that their jobs are not to blame.
            self.lost.set()
            for worker in list(self.workers.values()):
                self._stop_with_template(worker)
            self.workers.clear()

    def adopt(self, worker: ForkedWorker) -> None:
        """Take a worker forked from this template into its care: its exit is reported (it may
        have been already), and it goes when the template does (at once, if it went already)."""
        if worker.pid in self.early_exits:
            worker.set_exited(self.early_exits.pop(worker.pid))
        elif self.lost.is_set():
            self._stop_with_template(worker)
        else:
            self.workers[worker.pid] = worker

    @staticmethod
    def _stop_with_template(worker: ForkedWorker) -> None:
        # Its parent-death signal is a SIGTERM, which Python handles between bytecodes only: a
        # worker inside a long native call (an LLVM pass) would compile on, orphaned, for as
        # long as that call lasts, and its slot would wait that long for the reply before
        # retrying the job. A SIGKILL cannot be ignored: it is gone, though nobody is left to
        # report its exit.
        kill_group(worker.pid)
        worker.stop_cause = worker.stop_cause or "template"
        worker.set_exited(-signal.SIGKILL)

    async def serve_connections(self, listener: UnixListener) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def close_when_lost() -> None:
                    await self.lost.wait()  # its forks are over: so is their listener
                    tg.cancel_scope.cancel()

                tg.start_soon(close_when_lost)
                while True:
                    incoming = await listener.accept()
                    tg.start_soon(self._introduce, incoming)
        finally:
            # Shielded: closing must happen even as the pool's cancellation arrives.
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _introduce(self, incoming: Incoming) -> None:
        """Hand a connection to the fork that waits for it, once its first bytes are a hello with
        our token; nothing it sent is unpickled before that (see ``_protocol``)."""
        try:
            with anyio.fail_after(_HELLO_TIMEOUT):
                hello = _protocol.Hello.read(await incoming.hello(), self.token)
            # None: not one of ours. No fork waits for its slot: given up (quiesce, shutdown).
            waiting = self.connections.get(hello.slot) if hello is not None else None
            if waiting is None:
                await close_quietly(incoming)
                return
            stream = await incoming.connect()
        except Exception:
            # A worker killed right after it connected, or a stranger that says nothing: that
            # connection is lost, nothing else (the fork that waits for it sees the worker exit).
            await close_quietly(incoming)
            return
        except BaseException:
            await close_quietly(incoming)
            raise
        waiting[1].append(stream)
        waiting[0].set()

    async def fork(self, slot: int, config: WorkerConfig) -> tuple[int, WorkerConnection]:
        """Fork a worker for slot and wait until it has connected back.

        Raises ``TransientStartError`` when the template is gone or the worker is killed before
        it connects (both are worth another try), ``WorkerStartError`` when it never connects
        or ends on its own before it does.
        """
        if self.lost.is_set():
            raise TransientStartError("the template process is gone")
        if not os.path.exists(self.address):  # noqa: ASYNC240 (one stat of a socket's path)
            # Its socket was removed (a /tmp cleaner took the pool's work folder): no worker it
            # forks could connect. It is given up, and a new template listens on a new socket.
            self.lost.set()
            raise TransientStartError(f"the template's socket {self.address} was removed")
        forked: tuple[anyio.Event, list[int]] = (anyio.Event(), [])
        connected: tuple[anyio.Event, list[WorkerConnection]] = (anyio.Event(), [])
        self.forked[slot] = forked
        self.connections[slot] = connected
        returned = False
        pid: int | None = None
        try:
            config = {**config, "address": self.address, "token": self.token}
            try:
                await self.stdin.send(_protocol.encode(_protocol.Fork(slot, config)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise TransientStartError("the template process is gone") from exc
            with anyio.fail_after(30):
                await _first_of(forked[0], self.lost)
                if not forked[1]:
                    raise TransientStartError("the template process died before it forked a worker")
                pid = forked[1][0]
                while not connected[0].is_set():
                    if pid in self.early_exits:
                        code = self.early_exits.pop(pid)
                        pid = None  # reaped: the number may be another process's by now
                        # Killed from outside (or with the template): worth another try. Any
                        # other end is its own failure, counted towards giving up, with what
                        # it said (a socket it would not trust, say).
                        if code in EXTERNAL:
                            raise TransientStartError(
                                f"a forked worker {describe_exit(code)} before it connected"
                            )
                        tail = await anyio.to_thread.run_sync(stderr_tail, config.get("stderr_path", ""))
                        message = f"a forked worker {describe_exit(code)} before it connected\n{tail}"
                        raise WorkerStartError(message.rstrip())
                    if self.lost.is_set():
                        raise TransientStartError("the template process died while a worker started")
                    with anyio.move_on_after(0.05):
                        await connected[0].wait()
            returned = True
            return pid, connected[1][0]
        except TimeoutError:
            raise WorkerStartError("a forked worker did not connect within 30 s") from None
        finally:
            self.forked.pop(slot, None)
            self.connections.pop(slot, None)
            if pid is not None and not returned and self.lost.is_set() and pid not in self.early_exits:
                kill_group(pid)  # forked as the template died: it goes with it, as adopted ones do
            if connected[1] and not returned:
                # Connected after this fork was given up: nobody will use the stream.
                for stream in connected[1]:
                    await close_quietly(stream)


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


async def stop_template(template: Template, *, at_once: bool = False) -> None:
    """Stop the template: at EOF it kills and reaps every worker it forked, then exits; once it
    has exited, none of them is left. ``at_once``: it has forked nothing yet (it is still
    preloading, and would notice EOF only when done): kill it now, leaving costs no preload."""
    with anyio.CancelScope(shield=True):
        if at_once:
            kill_group(template.pid, unreaped=True)
        else:
            if template.process.returncode is None:
                # A template stopped by a signal (SIGSTOP, a debugger) would read its EOF only
                # once continued: leaving would wait the 2 s below, then kill it.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(template.pid, signal.SIGCONT)
            # Exit, then the end: a template that reads the end without an Exit takes its pool
            # for dead, and removes the pool's work folder (the pool does that itself).
            with (
                anyio.move_on_after(1),
                contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
            ):
                await template.stdin.send(_protocol.encode(_protocol.Exit()))
        try:
            await template.stdin.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        with anyio.move_on_after(2):
            await template.process.wait()
        if template.process.returncode is None:
            kill_group(template.pid, unreaped=True)
            with anyio.move_on_after(5):
                await template.process.wait()
        await template.process.aclose()
