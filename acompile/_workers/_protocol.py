"""The framed protocol between the pool, its template and its workers.

Each frame is an 8-byte big-endian length followed by that many bytes of body: a pickle, or, for
the reply that ends nearly every job (``Done`` with a ``bytes`` result), that result as it is, after
a tag and the job's id (see ``encode``).

Unpickling runs whatever the pickle names, so who may write a frame decides how it is read:

* A frame from the pool (to a worker or the template) is read with plain pickle. The pool writes
  there, and a forked worker checks that its socket is its pool's (below); code run in a worker
  could still reach another worker's or the template's input (as this user, through ``/proc``),
  but what a forged frame would run there, that code runs already: those processes are this
  user's, as the worker is, and hold nothing of the pool's.
* A frame from a worker or the template is not trusted, though both are this user's processes that
  the pool started: a worker runs code the pool's owner did not write (a Triton kernel given as a
  source string has its top-level code run there when it is compiled; Inductor's jobs run there),
  and that code can write anything to the worker's stream, a forged frame too. The pool reads such
  frames (``decode``, and everything built on it: ``FrameReader.next``, ``MessageReceiver``,
  ``decode_off_loop``) with a restricted unpickler, which rebuilds only what the protocol
  carries: its messages, acompile's errors, plain data (numbers, strings, bytes, tuples, lists,
  dicts, sets) and the built-in exception classes (``_ALLOWED``). A pickle that names anything
  else (``os.system``, ``builtins.eval``, a class of acompile's with side effects, a third-party
  class) is refused before anything it names is called: the frame reads as ``Undecodable``, whose
  text names what was refused, and the job it came with fails with that text (the worker is
  replaced). An ``Error`` must carry an ``AcompileError``: the worker turns whatever a backend
  raised into one, with its class and text (``_main._as_compile_error``), so a third-party
  exception reaches the caller as text.

Nothing from a cache or the network ever goes through these streams, and nothing another user can
write. The pipes are the pool's own, made for the process it started and inherited by nobody else.
The Unix socket forked workers connect back to lives in the pool's work folder, which is this
user's, private, and no link (``_trust``); and both of its ends check the other before they read
anything from it:

* the pool accepts a connection only from a process of this user (the kernel's ``SO_PEERCRED``,
  ``peer_uid``), and reads its first ``HELLO.size`` bytes as they are, never as a pickle: a magic
  that no frame's header can start with, the worker's slot and pid, and the template's token,
  compared in constant time (``Hello.read``). A connection whose first bytes are anything else is
  closed, unread past them.
* a forked worker connects only to a socket in a private folder of this user's, whose listener is
  a process of this user (``SO_PEERCRED`` again); only then does it send its hello (the token) or
  read a frame.

The first frame a process gets is its configuration, a plain ``dict`` (sys.path, cwd, target,
backends to preload, its scratch folders; see ``WorkerPool._start_worker``). Every later frame is
one of the messages below, each a small frozen dataclass whose ``tag`` says what it is (the
three of every job, ``RunJob``, ``Done`` and ``Error``, travel as plain tuples, or ``Done`` as raw
bytes, rebuilt as these classes when read: see ``encode``).

Pool to worker:

* ``RunJob(id, backend, payload)``: compile ``payload`` with the worker-side backend module named
  ``backend``; the worker answers ``Done`` or ``Error`` with the same ``id``.
* ``Exit()``: finish and exit (EOF on the pipe means the same).

Worker to pool:

* ``Ready(pid, preload_s, threads, forked)``: the preload is done. ``threads`` counts native
  threads too: the pool forks only from a template that has one.
* ``Failed(message, traceback)``: the preload raised; the process exits after this.
* ``Done(id, result)``: the backend returned ``result`` (bytes, for a cache entry; plain data for
  a backend of tests).
* ``Error(id, error)``: the backend raised; ``error`` is an ``AcompileError`` (of ``_errors``).
* ``Pause(id)`` and ``Resume(id, seconds)``, around a wait inside job ``id`` that is not its work
  (the pool's late configuration, Triton's hash of its binaries): neither the job's time limit
  nor the compile time the pool remembers for it counts those ``seconds`` (see ``_late.paused``).
* ``Hello(slot, pid, token)``: a forked worker's first bytes on the Unix socket it connected to
  (before its ``Ready``): not a frame but ``HELLO.size`` bytes of its own (``Hello.pack``), read
  before anything on that socket is unpickled; ``token`` proves it was forked by our template.

Pool to template: ``Fork(slot, config)``: fork a worker for ``slot``, with ``config`` merged into
the template's own. Template to pool: ``Forked(slot, pid)`` right after the fork, and
``Exited(pid, status)`` when a worker it forked is gone (it is their parent and reaps them);
``status`` is an exit code, or minus the signal that killed it.

``FrameReader`` splits a byte stream into messages; ``read_message`` drives it on a blocking
file descriptor (the worker, the template: frames from the pool), ``MessageReceiver`` on an anyio
byte stream (the pool: frames from a worker or the template).
"""

from __future__ import annotations

import builtins
import enum
import hmac
import io
import os
import pickle
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import anyio.abc
import anyio.to_thread

from acompile import _errors
from acompile._errors import AcompileError, CompileError, bounded

if TYPE_CHECKING:
    import socket

    from acompile._workers._config import WorkerConfig

HEADER = struct.Struct(">Q")
HEADER_SIZE = HEADER.size
# Larger than any artifact we expect (a 100 MB result must pass), small enough to catch a
# desynchronised stream before it allocates the machine's memory.
MAX_MESSAGE = 1 << 34
# One read's most: a 100 MB result arrives in pieces this size.
_CHUNK = 1 << 20
# Frames at least this large are decoded on a thread (the pool's side).
_DECODE_INLINE_MAX = 256 * 1024
# A forked worker's hello: the magic, its slot, its pid, the template's token (32 hex digits). As a
# frame's header the magic would announce more than MAX_MESSAGE bytes: a frame sent in its place is
# never taken for a hello, nor a hello for a frame.
HELLO = struct.Struct(">8sIQ32s")
_HELLO_MAGIC = b"ACOMPIL\x01"


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
    config: WorkerConfig


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
    """Forked worker to pool, first on its socket: who it is, and the template's token. Not a
    frame: ``HELLO.size`` bytes that are no pickle (``pack``), so that the pool can check a
    connector before it unpickles anything it sent (``read``)."""

    tag: ClassVar[Tag] = Tag.HELLO
    slot: int
    pid: int
    token: str

    def pack(self) -> bytes:
        return HELLO.pack(_HELLO_MAGIC, self.slot, self.pid, self.token.encode("ascii"))

    @staticmethod
    def read(data: bytes, token: str) -> Hello | None:
        """The hello in ``data``, a connector's first ``HELLO.size`` bytes; None unless they are
        one that carries ``token`` (compared in constant time)."""
        if len(data) != HELLO.size:
            return None
        magic, slot, pid, sent = HELLO.unpack(data)
        if magic != _HELLO_MAGIC or not hmac.compare_digest(sent, token.encode("ascii")):
            return None
        return Hello(slot, pid, token)


def peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a connected Unix socket, as the kernel
    recorded it when that process connected (or, for a listener, when it began listening)."""
    import socket  # here: a spawned worker never needs it

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


Message = RunJob | Exit | Ready | Failed | Done | Error | Pause | Resume | Fork | Forked | Exited


# The three messages of every job travel as plain tuples, (their index here, *fields): a
# dataclass's pickle names its class and rebuilds its dict, about 1 µs each way, four times a
# job; a tuple's costs a quarter of that. Every other message is pickled as it is.
_BY_WIRE: tuple[type[RunJob] | type[Done] | type[Error], ...] = (RunJob, Done, Error)

# A ``Done`` whose result is ``bytes`` (every real backend's: a cache entry, Inductor's pickled
# reply) is no pickle: this tag, the job's id, then the result's bytes. The pool reads it without
# an unpickler, whose set-up alone (about 0.5 µs) would cost more than the rest of the frame's
# reading; no pickle starts with this byte (``encode``'s begin with the PROTO opcode, 0x80).
_BYTES_DONE = b"D"
_JOB_ID = struct.Struct(">Q")
_BYTES_DONE_HEAD = len(_BYTES_DONE) + _JOB_ID.size


def encode(message: Any) -> bytes:
    """One frame holding ``message`` (a message above, or the first frame's configuration)."""
    kind = type(message)
    if kind is RunJob:
        message = (0, message.id, message.backend, message.payload)
    elif kind is Done:
        result = message.result
        if type(result) is bytes and type(message.id) is int and 0 <= message.id < 1 << 64:
            head = HEADER.pack(_BYTES_DONE_HEAD + len(result)) + _BYTES_DONE + _JOB_ID.pack(message.id)
            return b"".join((head, result))  # the result copied once, as a pickle would be
        message = (1, message.id, result)
    elif kind is Error:
        message = (2, message.id, message.error)
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _bytes_done(body: bytes) -> Done:
    (job_id,) = _JOB_ID.unpack_from(body, len(_BYTES_DONE))
    return Done(job_id, body[_BYTES_DONE_HEAD:])


def _loads(body: bytes) -> Any:
    """A frame's message, from a worker or the template: read by the pool, which trusts neither
    (see the module's docstring), with ``_PoolUnpickler``. Raises ``Refused`` for a pickle that
    names anything but what ``_ALLOWED`` holds, or an ``Error`` that carries no acompile error."""
    if body[:1] == _BYTES_DONE:
        return _bytes_done(body)
    message = _PoolUnpickler(io.BytesIO(body)).load()  # BytesIO shares the bytes: no copy
    if type(message) is tuple:
        message = _BY_WIRE[message[0]](*message[1:])
    if type(message) is Error and not isinstance(message.error, AcompileError):
        # What the worker sends is always one (``_main._as_compile_error``); anything else would
        # be raised to the caller as it is.
        raise Refused(
            f"refused an Error that carries a {type(message.error).__name__}, not an acompile error"
        )
    return message


def _loads_from_pool(body: bytes) -> Any:
    """A frame's message, from the pool: read by a worker or the template with plain pickle (only
    the pool writes to their input, and a worker checks that its socket is its pool's)."""
    if body[:1] == _BYTES_DONE:
        return _bytes_done(body)
    message = pickle.loads(body)
    if type(message) is tuple:
        return _BY_WIRE[message[0]](*message[1:])
    return message


class Refused(pickle.UnpicklingError):
    """A frame from a worker or the template that names something the pool does not rebuild from
    such a frame (``_PoolUnpickler``): nothing it names was called."""


def _rebuild_compile_error(cls: Any, message: Any, state: Any) -> CompileError:
    """``_errors._rebuild_compile_error``, which a ``CompileError``'s pickle names (see its
    ``__reduce__``), for a class that is one: a pickle could hand it any class it may name."""
    if not (isinstance(cls, type) and issubclass(cls, CompileError)):
        raise Refused(f"refused to rebuild a {bounded(repr(cls), 200)} as a compile error")
    if type(message) is not str or type(state) is not dict:
        raise Refused("refused a compile error whose message is no str or whose state is no dict")
    return _errors._rebuild_compile_error(cls, message, state)


def _allowed() -> dict[tuple[str, str], Any]:
    """What a frame from a worker or the template may name, by (module, qualified name) as a
    pickle names it, and what the name stands for. Each entry is a class whose rebuilding (its
    ``__new__``, then its ``__init__`` or ``__setstate__`` with the pickle's arguments) only stores
    data, or a function that does only that with what it is given:

    * the protocol's messages: frozen dataclasses of plain fields, no behaviour on rebuilding.
    * acompile's errors (``_errors``), the classes that derive from ``BaseException`` and nothing
      else of that module: their constructors and ``__setattr__`` store (and cut) text. With them
      the rebuilder a ``CompileError``'s pickle names, here checked (``_rebuild_compile_error``).
    * the built-in exceptions that derive from ``Exception`` (a backend's result or an error's
      state may hold one): a built-in exception's constructor stores its arguments. Not the ones
      that derive only from ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``,
      ``GeneratorExit``, ``BaseExceptionGroup``): raised, they stop a program rather than report
      a failure.
    * data types a pickle names rather than spells with an opcode of its own: ``complex``,
      ``slice``, ``range``, and ``set``, ``frozenset``, ``bytearray`` (opcodes of their own since
      protocol 4 or 5, named before): each builds a value from values.

    Never anything that runs code, imports, opens files or libraries, or reaches attributes:
    ``builtins.eval``, ``exec``, ``getattr``, ``__import__``, ``type``, ``os``, ``posix``,
    ``subprocess``, ``ctypes``, ``copyreg``, nor acompile's other classes (a ``SharedLibrary``
    loads a library when it is made; none of them is ever a worker's to send)."""
    allowed: dict[tuple[str, str], Any] = {}

    def allow(value: Any) -> None:
        allowed[value.__module__, value.__qualname__] = value

    for message in (RunJob, Exit, Ready, Failed, Done, Error, Pause, Resume, Fork, Forked, Exited, Hello):
        allow(message)
    for value in vars(_errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, BaseException)
            and value.__module__ == _errors.__name__
        ):
            allow(value)
    allowed[_errors.__name__, _errors._rebuild_compile_error.__qualname__] = _rebuild_compile_error
    for value in vars(builtins).values():
        if isinstance(value, type) and issubclass(value, Exception):
            allow(value)
    for data in (complex, slice, range, set, frozenset, bytearray):
        allow(data)
    return allowed


_ALLOWED = _allowed()


class _PoolUnpickler(pickle.Unpickler):
    """The pool's unpickler of frames from workers and the template: it rebuilds only what
    ``_ALLOWED`` names. A pickle reaches code only through the names it looks up (its GLOBAL and
    STACK_GLOBAL opcodes, which ``pickle.Unpickler`` looks up here, and the codes of ``copyreg``'s
    extension registry: looked up here too, but for a code already loaded in this process, which
    comes from a cache; the registry is empty unless this process's own code fills it): every
    other opcode builds a str, bytes, number, tuple, list, dict or set, or calls what such a name
    gave. Persistent ids and out-of-band buffers are refused by ``pickle.Unpickler`` itself.

    The frames of every job (tuples of ints, strs and bytes, or raw bytes) name nothing: this is
    never called for them."""

    def find_class(self, module: str, name: str, /) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise Refused(
                f"refused {bounded(f'{module}.{name}', 300)!r}: a frame from a worker may name only "
                "the protocol's messages, acompile's errors and plain data types"
            )
        return found


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
        """The next complete frame, decoded as the pool decodes a worker's (``decode``), or None
        until more bytes arrive (see ``next_parts`` and ``decode`` for what it raises)."""
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
    """A frame's message, from the pieces of its body: the pool's reading of a frame from a worker
    or the template, which rebuilds nothing but the protocol's own (``_loads``). Raises ``Refused``
    (an ``UnpicklingError``) for a frame that names anything else."""
    if len(parts) == 1:
        return _loads(parts[0])
    if parts and parts[0][:1] == _BYTES_DONE and len(parts[0]) >= _BYTES_DONE_HEAD:
        # A big result, in pieces: joined straight into the result, one copy and one allocation
        # (joining the frame, then cutting its head off, holds two such at once: for a result of
        # megabytes, the allocator then maps fresh pages for each, ten times slower).
        (job_id,) = _JOB_ID.unpack_from(parts[0], len(_BYTES_DONE))
        return Done(job_id, b"".join([memoryview(parts[0])[_BYTES_DONE_HEAD:], *parts[1:]]))
    return _loads(b"".join(parts))  # (no parts: an empty frame, which no pickle is)


# --- the worker's and the template's side: blocking file descriptors ------------------------------


def read_message(fd: int) -> Any:
    """The next frame from fd, a frame from the pool (read with plain pickle: see the module's
    docstring); None on EOF before a frame begins (the other end closed it).

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
                return _loads_from_pool(body)
            header += body
    if not header:
        return None
    reader = FrameReader()
    reader.feed(header)
    while (parts := reader.next_parts()) is None:
        chunk = os.read(fd, reader.wanted())
        if not chunk:
            if reader.partial:
                raise EOFError("the stream closed inside a frame")
            return None
        reader.feed(chunk)
    return _loads_from_pool(parts[0] if len(parts) == 1 else b"".join(parts))


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
    pickle that names what the pool does not rebuild from a worker, ``Refused``: ``error`` names
    it; bytes that are not a pickle)."""

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
