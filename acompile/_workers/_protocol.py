"""The framed protocol between the pool, its template and its workers.

Each frame is an 8-byte big-endian length followed by that many bytes of pickle. Pickle is safe
here because every end is this package's own process on a private pipe or socket; nothing from a
cache or the network ever goes through it.

The first frame a process gets is its configuration, a plain ``dict`` (sys.path, cwd, target,
backends to preload, its scratch folders; see ``WorkerPool._start_worker``). Every later frame is
one of the messages below, each a small frozen dataclass whose ``tag`` says what it is (the
three of every job, ``RunJob``, ``Done`` and ``Error``, travel as plain tuples, rebuilt as these
classes when read: see ``encode``).

Pool to worker:

* ``RunJob(id, backend, payload)``: compile ``payload`` with the worker-side backend module named
  ``backend``; the worker answers ``Done`` or ``Error`` with the same ``id``.
* ``Exit()``: finish and exit (EOF on the pipe means the same).

Worker to pool:

* ``Ready(pid, preload_s, threads, forked)``: the preload is done. ``threads`` counts native
  threads too: the pool forks only from a template that has one.
* ``Failed(message, traceback)``: the preload raised; the process exits after this.
* ``Done(id, result)``: the backend returned ``result`` (bytes, for a cache entry).
* ``Error(id, error)``: the backend raised; ``error`` is a picklable ``AcompileError``.
* ``Pause(id)`` and ``Resume(id, seconds)``, around a wait inside job ``id`` that is not its work
  (the pool's late configuration, Triton's hash of its binaries): neither the job's time limit
  nor the compile time the pool remembers for it counts those ``seconds`` (see ``_late.paused``).
* ``Hello(slot, pid, token)``: a forked worker's first frame on the Unix socket it connected to
  (before its ``Ready``); ``token`` proves it was forked by our template.

Pool to template: ``Fork(slot, config)``: fork a worker for ``slot``, with ``config`` merged into
the template's own. Template to pool: ``Forked(slot, pid)`` right after the fork, and
``Exited(pid, status)`` when a worker it forked is gone (it is their parent and reaps them);
``status`` is an exit code, or minus the signal that killed it.

``FrameReader`` splits a byte stream into messages; ``read_message`` drives it on a blocking
file descriptor (the worker, the template), ``MessageReceiver`` on an anyio byte stream (the pool).
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio.abc
import anyio.to_thread

HEADER = struct.Struct(">Q")
HEADER_SIZE = HEADER.size
# Larger than any artifact we expect (a 100 MB result must pass), small enough to catch a
# desynchronised stream before it allocates the machine's memory.
MAX_MESSAGE = 1 << 34
# One read's most: a 100 MB result arrives in pieces this size.
_CHUNK = 1 << 20
# Frames at least this large are decoded on a thread (the pool's side).
_DECODE_INLINE_MAX = 256 * 1024


class Tag(enum.Enum):
    """What a message is."""

    JOB = "job"
    EXIT = "exit"
    READY = "ready"
    FAILED = "failed"
    DONE = "done"
    ERROR = "error"
    FORK = "fork"
    FORKED = "forked"
    EXITED = "exited"
    HELLO = "hello"
    PAUSE = "pause"
    RESUME = "resume"


@dataclass(frozen=True)
class RunJob:
    """Pool to worker: compile ``payload`` with the backend module ``backend``."""

    tag: ClassVar[Tag] = Tag.JOB
    id: int
    backend: str
    payload: Any


@dataclass(frozen=True)
class Exit:
    """Pool to worker or template: finish and exit."""

    tag: ClassVar[Tag] = Tag.EXIT


@dataclass(frozen=True)
class Ready:
    """Worker or template to pool: the preload is done."""

    tag: ClassVar[Tag] = Tag.READY
    pid: int
    preload_s: float
    threads: int = 1
    forked: bool = False


@dataclass(frozen=True)
class Failed:
    """Worker or template to pool: the preload raised; the process exits."""

    tag: ClassVar[Tag] = Tag.FAILED
    message: str
    traceback: str


@dataclass(frozen=True)
class Done:
    """Worker to pool: job ``id`` returned ``result``."""

    tag: ClassVar[Tag] = Tag.DONE
    id: int
    result: Any


@dataclass(frozen=True)
class Error:
    """Worker to pool: job ``id`` raised ``error``."""

    tag: ClassVar[Tag] = Tag.ERROR
    id: int
    error: BaseException


@dataclass(frozen=True)
class Pause:
    """Worker to pool: job ``id`` waits for something that is not its work."""

    tag: ClassVar[Tag] = Tag.PAUSE
    id: int


@dataclass(frozen=True)
class Resume:
    """Worker to pool: job ``id``'s wait is over; it lasted ``seconds`` (the worker's clock)."""

    tag: ClassVar[Tag] = Tag.RESUME
    id: int
    seconds: float


@dataclass(frozen=True)
class Fork:
    """Pool to template: fork a worker for ``slot``."""

    tag: ClassVar[Tag] = Tag.FORK
    slot: int
    config: dict[str, Any]


@dataclass(frozen=True)
class Forked:
    """Template to pool: the worker for ``slot`` has pid ``pid``."""

    tag: ClassVar[Tag] = Tag.FORKED
    slot: int
    pid: int


@dataclass(frozen=True)
class Exited:
    """Template to pool: the forked worker ``pid`` is gone, with ``status``."""

    tag: ClassVar[Tag] = Tag.EXITED
    pid: int
    status: int


@dataclass(frozen=True)
class Hello:
    """Forked worker to pool, first on its socket: who it is, and the template's token."""

    tag: ClassVar[Tag] = Tag.HELLO
    slot: int
    pid: int
    token: str


Message = RunJob | Exit | Ready | Failed | Done | Error | Pause | Resume | Fork | Forked | Exited | Hello


# The three messages of every job travel as plain tuples, (their index here, *fields): a
# dataclass's pickle names its class and rebuilds its dict, about 1 µs each way, four times a
# job; a tuple's costs a quarter of that. Every other message is pickled as it is.
_BY_WIRE: tuple[type[RunJob] | type[Done] | type[Error], ...] = (RunJob, Done, Error)


def encode(message: Any) -> bytes:
    """One frame holding ``message`` (a message above, or the first frame's configuration)."""
    kind = type(message)
    if kind is RunJob:
        message = (0, message.id, message.backend, message.payload)
    elif kind is Done:
        message = (1, message.id, message.result)
    elif kind is Error:
        message = (2, message.id, message.error)
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _loads(body: bytes | bytearray | memoryview) -> Any:
    message = pickle.loads(body)
    if type(message) is tuple:
        return _BY_WIRE[message[0]](*message[1:])
    return message


class FrameReader:
    """Splits a byte stream into frames, whatever pieces the stream arrives in.

    It does no I/O: a driver asks ``wanted()`` how much to read, ``feed()``s what it read, and
    takes complete frames with ``next()`` (decoded) or ``next_parts()`` (the pickle's pieces, to
    decode elsewhere). Bytes fed past a frame are kept for the next one. Pieces are kept as they
    came, never joined into a growing buffer: a 100 MB result is not copied at every read.
    """

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._have = 0  # bytes in _pieces
        self._length: int | None = None  # the current frame's body length, once its header is in

    def wanted(self) -> int:
        """Bytes still missing from the frame in progress (never more than that)."""
        if self._length is None:
            return max(1, HEADER_SIZE - self._have)
        return max(1, min(_CHUNK, self._length - self._have))

    def feed(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._have += len(data)

    def next_parts(self) -> list[bytes] | None:
        """The next complete frame's body (a pickle) in pieces, or None until more bytes arrive.

        Raises ``ValueError`` when a header announces an impossible length (a desynchronised
        stream).
        """
        if self._length is None:
            if self._have < HEADER_SIZE:
                return None
            (length,) = HEADER.unpack(b"".join(self._take(HEADER_SIZE)))
            if length > MAX_MESSAGE:
                raise ValueError(f"frame of {length} bytes: the stream is out of sync")
            self._length = int(length)
        if self._have < self._length:
            return None
        parts = self._take(self._length)
        self._length = None
        return parts

    def next(self) -> Any | None:
        """The next complete frame, decoded, or None until more bytes arrive (see
        ``next_parts`` for what it raises)."""
        parts = self.next_parts()
        return None if parts is None else decode(parts)

    def _take(self, n: int) -> list[bytes]:
        """The first n buffered bytes (there are at least n), as the pieces they came in."""
        taken: list[bytes] = []
        self._have -= n
        while n:
            piece = self._pieces[0]
            if len(piece) <= n:
                taken.append(self._pieces.popleft())
                n -= len(piece)
            else:  # a read that ran past the frame: the rest is the next frame's
                taken.append(piece[:n])
                self._pieces[0] = piece[n:]
                n = 0
        return taken

    @property
    def partial(self) -> bool:
        """Whether a frame has begun but not ended."""
        return bool(self._have) or self._length is not None


def decode(parts: list[bytes]) -> Any:
    """A frame's body, from its pieces."""
    return _loads(parts[0] if len(parts) == 1 else b"".join(parts))


# --- the worker's and the template's side: blocking file descriptors ------------------------------


def read_message(fd: int) -> Any:
    """The next frame from fd; None on EOF before a frame begins (the other end closed it).

    Reads no byte past the frame, so a caller may ``select()`` on fd between frames. Raises
    ``EOFError`` on EOF inside a frame.
    """
    # A frame usually arrives whole: its header, then its body in one read each.
    header = os.read(fd, HEADER_SIZE)
    if len(header) == HEADER_SIZE:
        (length,) = HEADER.unpack(header)
        if length <= _CHUNK:
            body = os.read(fd, length)
            if len(body) == length:
                return _loads(body)
            header += body
    if not header:
        return None
    reader = FrameReader()
    reader.feed(header)
    while (message := reader.next()) is None:
        chunk = os.read(fd, reader.wanted())
        if not chunk:
            if reader.partial:
                raise EOFError("the stream closed inside a frame")
            return None
        reader.feed(chunk)
    return message


def write_message(fd: int, message: Any) -> None:
    """Write one frame to a blocking fd."""
    view = memoryview(encode(message))
    while view:
        written = os.write(fd, view)
        view = view[written:]


# --- the pool's side: anyio byte streams ----------------------------------------------------------


class MessageReceiver:
    """Frames from an anyio byte stream. Bytes read past a frame stay buffered here, so the
    receiver (not the stream) is what a new owner of the stream takes over."""

    def __init__(self, stream: anyio.abc.ByteReceiveStream) -> None:
        self._stream = stream
        self._reader = FrameReader()
        self._out_of_sync: str | None = None

    async def receive(self) -> Any:
        """The next frame (an ``Undecodable`` if it cannot be read, or where the stream went out
        of sync). Raises ``anyio.EndOfStream`` (or ``anyio.IncompleteRead`` inside a frame) when
        the other end closed, ``anyio.BrokenResourceError`` when it broke or went out of sync."""
        if self._out_of_sync is not None:
            raise anyio.BrokenResourceError(self._out_of_sync)
        while True:
            try:
                parts = self._reader.next_parts()
            except ValueError as exc:
                self._out_of_sync = str(exc)
                return Undecodable(self._out_of_sync)
            if parts is not None:
                break
            try:
                data = await self._stream.receive(max(self._reader.wanted(), 65536))
            except anyio.EndOfStream:
                if self._reader.partial:
                    raise anyio.IncompleteRead from None
                raise
            self._reader.feed(data)
        return await decode_off_loop(parts)


@dataclass(frozen=True)
class Undecodable:
    """Not a message: what the pool's reading gives in place of a frame it cannot unpickle (a
    result whose class raises as it is rebuilt here, bytes that are not a pickle)."""

    error: str


def decode_or_undecodable(parts: list[bytes]) -> Any:
    """``decode(parts)``, or an ``Undecodable`` saying why it failed."""
    try:
        return decode(parts)
    except (Exception, SystemExit) as exc:  # a result whose rebuilding calls exit fails its job
        return Undecodable(f"{type(exc).__name__}: {exc}")


def small(parts: list[bytes]) -> bool:
    """Whether a frame's body is small enough to decode on the event loop."""
    return sum(map(len, parts)) < _DECODE_INLINE_MAX


async def decode_off_loop(parts: list[bytes]) -> Any:
    """A frame's body (or an ``Undecodable``), decoded here if small, else on a thread: a big
    result (a large cubin and its assembly) is copied twice by joining its pieces and unpickling
    it, a millisecond per few megabytes, which is for a thread, not the loop."""
    if small(parts):
        return decode_or_undecodable(parts)
    return await anyio.to_thread.run_sync(decode_or_undecodable, parts)
