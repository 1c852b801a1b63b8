"""The disk tier: one file per entry, published atomically, shared by any number of processes.

Layout: ``<root>/v1/<key[:2]>/<key>``. A writer writes the whole entry to a private temporary
file in the same folder and renames it over the final name, so a reader (in this process or
another) sees either no entry or a whole one, never a torn one. ``get`` moves bytes, which the
layer above verifies; ``get_entry`` reads *and* verifies on the thread, so that a warm start
spends nothing on the event loop per entry but handing the result over.

Each read and each write is one blocking call on a daemon thread of this module, which owns its
file from open to close (and a writer its temporary file, removed on any failure). A caller may
therefore stop waiting at any moment, cancelled or past a deadline, and leak nothing: the thread
finishes by itself. A call stuck in the kernel (a hung network filesystem) is abandoned, never
joined, so it cannot hang the pool's exit or the interpreter's.

Entry reads (a warm start asks for every kernel at once) share a queue that two threads take
in order, each reading and verifying one entry after the other, instead of one thread hop per
entry; the loop is woken once for whatever they finished meanwhile, and one timer bounds them all
(``DISK_DEADLINE``). The entry keeps the bytes it was read in: its blobs are copied out of them
only when asked for, its binaries at once (``Blobs``).

Whatever sits at an entry's path is read with ``read_state`` (``_layout``): a FIFO, a device, a
folder, a link or a file over ``MAX_ENTRY_BYTES`` is refused unread, a damaged entry (a miss), and
the fresh compile's publication replaces it (a folder there is removed first).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import logging
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.os
import anyio

from acompile._cache import _entry
from acompile._cache._entry import CorruptEntry, Entry
from acompile._cache._layout import (
    LIB,
    LOGS,
    MAX_ENTRY_BYTES,
    RUN,
    TOOLCHAIN,
    RefusedFile,
    clear_way,
    entries_dir,
    entry_folders,
    human_bytes,
    is_key,
    open_limited,
    read_at,
    read_state,
    toolchain_dir,
    write_state,
)
from acompile._errors import UntrustedFolderError
from acompile._trust import check_folder, own_folder

logger = logging.getLogger("acompile")

# How long a disk read or write may take before it is abandoned. A whole entry (tens of KB to a
# few MB) comes from a local disk in milliseconds and from a healthy network filesystem in well
# under a second; past this the filesystem is hung or drowning, and a compile is the better bet.
DISK_DEADLINE = 2.0
# After a read or write past the deadline, the disk is left alone this long: every request would
# otherwise wait out the deadline again, and each stuck call holds a thread.
DISK_BACKOFF = 30.0

# A disk that is full (or read-only) says so with any of these: one warning for all of them.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}

_T = TypeVar("_T")


def default_cache_dir() -> Path:
    """``$ACOMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/acompile``, else ``~/.cache/acompile``."""
    explicit = os.environ.get("ACOMPILE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "acompile"


class _DaemonThreads(Executor):
    """Up to ``max_threads`` daemon threads, started as needed and kept.

    ``ThreadPoolExecutor``'s threads (asyncio's default executor, and anyio's workers) are joined
    when the interpreter exits: one read stuck on a hung filesystem would hang the process's exit
    after the pool has long returned. These are never joined. Past ``max_threads`` busy (stuck)
    threads, calls wait in line, and their callers' deadlines still hold.
    """

    def __init__(self, max_threads: int) -> None:
        self._max = max_threads
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a call that no queued call has claimed yet
        self._unclaimed = 0  # queued calls that found no idle thread

    def prestart(self, count: int) -> None:
        """Start idle threads until ``count`` exist (blocking: ``Thread.start`` waits for the
        thread to run, a wait that belongs on a thread, not on the event loop)."""
        while True:
            with self._lock:
                if self._threads >= min(count, self._max):
                    return
                self._threads += 1
                self._idle += 1
            threading.Thread(target=self._serve, name="acompile-disk", daemon=True).start()

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._serve, name="acompile-disk", daemon=True).start()
            else:
                self._unclaimed += 1
            self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _serve(self) -> None:
        while True:
            future, call = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, call  # the result belongs to the caller, not to an idle thread
            with self._lock:
                if self._unclaimed:
                    self._unclaimed -= 1
                else:
                    self._idle += 1


_threads = _DaemonThreads(16)


def _readers() -> int:
    """How many threads share the entry reads: two, whatever the machine. Reading an entry and
    verifying it (SHA-256) release the interpreter's lock, so two threads read a warm start while
    the loop keys and loads what they read, and keep up with it; each thread more is one more
    that takes the lock back after each of its system calls (on a 16-CPU host, four made a warm
    start slower than two)."""
    return 2


_HEX = frozenset("0123456789abcdef")


def _read_file(path: str | Path) -> bytes | None:
    """An entry file's bytes, or None where there is none (blocking). Raises ``RefusedFile``
    for anything but a regular file of at most ``MAX_ENTRY_BYTES``, ``OSError``."""
    return read_state(path, MAX_ENTRY_BYTES)


def _read_entry(path: str, key: str) -> Entry | None:
    """The verified entry at path, or None where there is none, its binaries copied out (see
    ``Blobs.copy_out_binaries``); a Triton kernel's text stages are read from the file when first
    asked for (``_entry.read_entry_at``). Raises ``CorruptEntry``, ``RefusedFile`` or
    ``OSError``."""
    opened = open_limited(path, MAX_ENTRY_BYTES)
    if opened is None:
        return None
    fd, size = opened
    try:
        return _entry.read_entry_at(functools.partial(read_at, fd), size, key, _EntryFile(path, key))
    finally:
        os.close(fd)


class _EntryFile:
    """The file of an entry read in part: its other blobs are read from it when first asked for
    (blocking, wherever they are asked for: the text stages of a kernel, read by whoever looks
    at them)."""

    __slots__ = ("key", "path")

    def __init__(self, path: str, key: str) -> None:
        self.path = path
        self.key = key

    def read(self, pending: Mapping[str, tuple[int, int, bytes]]) -> dict[str, bytes]:
        """Each pending blob, checked against its digest; raises ``CorruptEntry`` where the file
        no longer holds it (removed, or replaced by an entry with other bytes there). A file
        whose own blobs do not match its own digests is damaged, and removed."""
        low = min(start for start, _, _ in pending.values())
        high = max(end for _, end, _ in pending.values())
        try:
            opened = open_limited(self.path, MAX_ENTRY_BYTES)
            chunk = b""
            if opened is not None:
                fd, _ = opened
                try:
                    chunk = read_at(fd, low, high - low)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise CorruptEntry(f"its file cannot be read again ({exc})") from None
        found: dict[str, bytes] = {}
        for name, (start, end, digest) in pending.items():
            blob = chunk[start - low : end - low]
            if len(blob) == end - start and hashlib.sha256(blob).digest() == digest:
                found[name] = blob
        if len(found) == len(pending):
            return found
        # Not where they were: the file was replaced (a fresh compile's publication has other
        # bytes in places) or damaged. Read what is there now, whole and checked.
        try:
            data = read_state(self.path, MAX_ENTRY_BYTES)
        except OSError as exc:
            raise CorruptEntry(f"its file cannot be read again ({exc})") from None
        if data is None:
            raise CorruptEntry("its file was removed after the entry was read")
        try:
            now = _entry.decode(data, self.key)
        except CorruptEntry as exc:
            self._remove_damaged(data)
            raise CorruptEntry(f"its file is damaged ({exc}) and was removed") from None
        for name, (_, _, digest) in pending.items():
            if name not in found:
                there = now.blobs.get(name)
                if there is None or hashlib.sha256(there).digest() != digest:
                    raise CorruptEntry(f"its file was replaced by one whose {name} differs")
                found[name] = there
        return found

    def _remove_damaged(self, data: bytes) -> None:
        """Remove the entry's file if it still holds ``data`` (another process may have put a
        good one there meanwhile), and its folder is one (never through a link put at it)."""
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(os.path.dirname(self.path)).st_mode) and (
                read_state(self.path, MAX_ENTRY_BYTES) == data
            ):
                os.remove(self.path)


def read_entry(root: str | os.PathLike[str], key: str) -> Entry | None:
    """The verified entry ``key`` of the cache folder ``root``, or None where there is none or
    it is damaged (blocking: for processes without an event loop, such as a pool's workers)."""
    if not is_key(key):
        return None
    try:
        return _read_entry(os.path.join(entries_dir(Path(root)), key[:2], key), key)
    except (CorruptEntry, OSError):
        return None


class ReadTimeout(Exception):
    """An entry read that did not answer within ``DISK_DEADLINE`` (a hung filesystem): its
    thread is left to finish alone."""


class _EntryReader:
    """The entry reads of one event loop, taken in order by up to ``_readers()`` disk threads.

    A read is queued, and a thread job is started only while fewer than that many run: a warm
    start's reads all go to the same few threads (started off the loop by ``GuardedDisk.open``),
    each taking the next read as it finishes one. Results come back together: a thread wakes the
    loop only when no hand-over is pending already.

    A read not answered within ``DISK_DEADLINE`` fails with ``ReadTimeout``: one timer watches
    every read of the loop (they end in about the order they were asked), rather than a timer
    and a cancel scope per read, which cost a warm start more than the read's hand-over.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()  # the two lists and the two counts: shared with threads
        self._queue: deque[tuple[str, str, asyncio.Future[Entry | None]]] = deque()
        self._threads = 0
        self._results: list[tuple[asyncio.Future[Entry | None], Entry | None, Exception | None]] = []
        self._handing_over = False
        # The reads asked, oldest first, with their deadlines (the loop's clock); on the loop only.
        self._watched: deque[tuple[float, asyncio.Future[Entry | None]]] = deque()
        self._watchdog: asyncio.TimerHandle | None = None

    def read(self, path: str, key: str) -> asyncio.Future[Entry | None]:
        """Queue a read (on the loop); the future holds the entry, None, the read's error, or
        ``ReadTimeout``."""
        future: asyncio.Future[Entry | None] = self.loop.create_future()
        with self._lock:
            self._queue.append((path, key, future))
            start = self._threads < _readers()
            self._threads += start
        if start:
            _threads.submit(self._work)
        self._forget_answered()
        deadline = self.loop.time() + DISK_DEADLINE
        self._watched.append((deadline, future))
        if self._watchdog is None:
            self._watchdog = self.loop.call_at(deadline, self._expire)
        return future

    def _forget_answered(self) -> None:
        """Drop the answered reads at the head of the watch list (it would hold their entries)."""
        watched = self._watched
        while watched and watched[0][1].done():
            watched.popleft()

    def _expire(self) -> None:
        """On the loop, at the oldest read's deadline: fail the reads past theirs."""
        self._watchdog = None
        self._forget_answered()
        now = self.loop.time()
        while self._watched:
            deadline, future = self._watched[0]
            if deadline > now:
                self._watchdog = self.loop.call_at(deadline, self._expire)
                return
            self._watched.popleft()
            if not future.done():
                future.set_exception(ReadTimeout(f"no answer within {DISK_DEADLINE:g} s"))

    def _work(self) -> None:
        """A disk thread's part: read and verify entries until the queue is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    self._threads -= 1
                    return
                path, key, future = self._queue.popleft()
            entry: Entry | None = None
            error: Exception | None = None
            try:
                entry = _read_entry(path, key)
            except Exception as exc:
                error = exc
            with self._lock:
                self._results.append((future, entry, error))
                wake, self._handing_over = not self._handing_over, True
            if wake:
                try:
                    self.loop.call_soon_threadsafe(self._hand_over)
                except RuntimeError:
                    pass  # the loop is closed: nobody waits for these any more

    def _hand_over(self) -> None:
        """On the loop: settle the reads that are done."""
        with self._lock:
            done, self._results = self._results, []
            self._handing_over = False
        for future, entry, error in done:
            if future.done():
                continue  # its caller stopped waiting (cancelled, or past the deadline)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(entry)
        self._forget_answered()


_read = aiofiles.os.wrap(_read_file)
# A full disk (ENOSPC, EDQUOT, EFBIG) fails part-way: write_state removes the partial file.
_write = aiofiles.os.wrap(write_state)
_run = aiofiles.os.wrap(lambda call: call())


class DiskTier:
    name = "disk"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.entries = entries_dir(self.root)
        self._entries = str(self.entries)
        self._reader: _EntryReader | None = None

    def path(self, key: str) -> Path:
        self._check_key(key)
        return self.entries / key[:2] / key

    @staticmethod
    def _check_key(key: str) -> None:
        if len(key) < 3 or not _HEX.issuperset(key):
            raise ValueError(f"not a cache key: {key!r}")

    def make_or_check(self) -> None:
        """Create the folder, private to this user, or check the one there (blocking: call from
        a thread): it and the folders in it must be this user's and no other user's to write,
        since its entries hold code this process runs (``acompile._trust``). A link or a file
        where a folder of entries goes is removed (``_repair_subfolders``).

        Raises ``UntrustedFolderError`` naming the folder and its owner, ``OSError`` if the folder
        cannot be created.
        """
        # The path the user gave may go through links of theirs: resolved once, then checked.
        root = own_folder(self.root, "the cache folder", resolve=True)
        entries = own_folder(root / self.entries.name, "the cache folder's entries folder")
        for sub in (LIB, LOGS, TOOLCHAIN, RUN):
            if os.path.lexists(root / sub):
                check_folder(root / sub, "a folder of the cache folder")
        _repair_subfolders(entries)

    def check(self) -> None:
        """Raise ``UntrustedFolderError`` unless the folder, as it is, is one ``prepare`` would
        accept (blocking): for what reads it to vouch for it (an export signs its entries) or
        removes files in it (prune). Makes nothing; a link at a folder of it is refused, never
        followed. A missing folder passes: it holds nothing."""
        try:
            root = own_folder(self.root, "the cache folder", resolve=True, make=False)
        except FileNotFoundError:
            return
        for sub in (self.entries.name, LIB, LOGS, TOOLCHAIN, RUN):
            if os.path.lexists(root / sub):
                check_folder(root / sub, "a folder of the cache folder")

    def writable(self) -> bool:
        """Whether entries can be published here (blocking). Asks the kernel, so a read-only
        mount or an immutable folder says no even to root, who ignores permission bits."""
        return os.access(self.entries, os.W_OK)

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run a blocking call about this folder on the tier's daemon threads: a caller that
        stops waiting (cancelled, or past a deadline) abandons it instead of joining it."""
        result: _T = await _run(fn, executor=_threads)
        return result

    async def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None where there is none. Raises ``OSError`` (``RefusedFile``
        for a FIFO, a device, a folder or a link at its path, or a file over ``MAX_ENTRY_BYTES``)."""
        data: bytes | None = await _read(self.path(key), executor=_threads)
        return data

    async def get_entry(self, key: str) -> Entry | None:
        """The verified entry, or None where there is none: read and checked on a disk thread
        (see ``_EntryReader``). Raises ``CorruptEntry`` for a damaged entry, ``OSError``
        (``RefusedFile``) as ``get``, and ``ReadTimeout`` past ``DISK_DEADLINE``."""
        self._check_key(key)
        loop = asyncio.get_running_loop()
        reader = self._reader
        if reader is None or reader.loop is not loop:
            reader = self._reader = _EntryReader(loop)
        return await reader.read(os.path.join(self._entries, key[:2], key), key)

    def abandon_reads(self) -> None:
        """Leave the entry reads in progress to their threads (a hung filesystem holds them):
        the next ones start on threads of their own."""
        self._reader = None

    async def set(self, key: str, data: bytes) -> None:
        """Publish an entry atomically. Raises ``OSError``; a cancelled caller leaves the
        publication to finish (or fail, and clean up) on its thread."""
        await _write(self.path(key), data, executor=_threads)

    async def delete(self, key: str) -> None:
        try:
            await aiofiles.os.remove(self.path(key))
        except FileNotFoundError:
            pass

    async def close(self) -> None:
        pass

    def iter_paths(self) -> Iterator[Path]:
        """Every entry file (blocking: for the command line and threads). A link among the
        entries' folders is not followed: what it leads to is not the cache folder's."""
        for sub in entry_folders(self.root):
            for path in sorted(sub.iterdir()):
                if not path.name.startswith("."):
                    yield path


def _repair_subfolders(entries: Path) -> None:
    """Remove what sits where a folder of entries goes (``v1/<xx>``) and is not a folder: a link
    would lead reads and writes out of the cache folder, and a file would fail every write of its
    entries. The entries' writer makes the folder afresh (blocking: one listing of ``entries``)."""
    with os.scandir(entries) as found:
        wrong = [
            Path(item.path)
            for item in found
            if len(item.name) == 2 and _HEX.issuperset(item.name) and not item.is_dir(follow_symlinks=False)
        ]
    for path in wrong:
        try:
            clear_way(path)
        except OSError as exc:  # gone meanwhile, or not ours to remove: its entries are misses
            logger.debug("cannot remove %s: %s", path, exc)


class GuardedDisk:
    """The disk tier as the chain uses it: ``DiskTier``'s files, with every fault a miss.

    The disk never fails a compile and never holds up a request or the pool's exit for long:

    - a read-only folder serves the entries it holds; new results stay in the memory tier;
    - a publication that fails (a full disk: ENOSPC, EDQUOT, EFBIG; EROFS) is logged once, and
      the partial temporary file is removed;
    - a read or a write that does not answer within ``DISK_DEADLINE`` (a hung network
      filesystem) is abandoned: a read is a miss, a write is left to finish on its own thread;
      the disk is then left alone for ``DISK_BACKOFF``.

    ``counts``: ``disk_writes``, ``disk_write_errors``, ``disk_write_timeouts``, ``disk_timeouts``.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.files = DiskTier(root)
        self.counts: Counter[str] = Counter()
        # False for a folder this process cannot write to: compiles are kept in memory only.
        self.writable = True
        # False when the folder did not answer at start (a hung filesystem): nothing else in it
        # (the toolchain's memo) is worth waiting for either.
        self.answered = True
        self._stalled_until = 0.0
        self._private_memo: Path | None = None
        self._memo = toolchain_dir(self.root)  # asked for by every request
        self._warned: set[str] = set()

    @property
    def root(self) -> Path:
        """The cache folder."""
        return self.files.root

    @property
    def memo_dir(self) -> Path:
        """Where backends remember the toolchain's identity: in the cache folder, or in a
        private temporary folder when the cache folder did not answer."""
        return self._private_memo or self._memo

    def stats(self) -> dict[str, Any]:
        """``disk_writes`` for ``stats()["cache"]``."""
        return {"disk_writes": self.counts["disk_writes"]}

    async def open(self) -> None:
        """Prepare the folder: one that cannot be created or written to is used read-only (with
        one warning), one that does not answer is skipped. Raises ``UntrustedFolderError`` for a
        folder another user controls."""
        with anyio.move_on_after(DISK_DEADLINE, shield=True) as scope:
            why = await self.files.call(self._prepare)
        if scope.cancelled_caught:
            self.answered = False
            self._stall()
            self._private_memo = Path(
                await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="acompile-toolchain-"))
            )
            why = f"it did not answer within {DISK_DEADLINE:g} s"
        if why is not None:
            self.writable = False
            self._warn_once(
                "read-only",
                "cache folder %s cannot be written by this process (%s): serving the entries it "
                "holds, read-only; new compiles are kept in memory only",
                self.root,
                why,
            )

    def _prepare(self) -> str | None:
        """None where entries can be published, else why not (blocking). Raises
        ``UntrustedFolderError``: a folder another user controls is never used, read-only or not."""
        # The readers of a warm start's batch, started here rather than by the loop's first read.
        _threads.prestart(_readers())
        try:
            self.files.make_or_check()
        except UntrustedFolderError:
            raise
        except OSError as exc:
            return str(exc)
        return None if self.files.writable() else "not writable"

    async def close(self) -> None:
        """Remove what ``open()`` made outside the cache folder (shielded: clean-up)."""
        if self._private_memo is not None:
            memo, self._private_memo = self._private_memo, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(memo, ignore_errors=True))

    async def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None for a miss (absent, or too slow). Raises ``CorruptEntry``
        where something unreadable sits at its path (a FIFO, an I/O error)."""
        data: bytes | None = await self._guarded_read(key, self.files.get)
        return data

    async def get_entry(self, key: str) -> Entry | None:
        """The verified entry, or None for a miss (absent, or too slow), read and checked off
        the event loop. Raises ``CorruptEntry`` for a damaged entry, or where something
        unreadable sits at its path."""
        if self._stalled():
            return None
        # Bounded by the reads' own deadline (``ReadTimeout``). Not shielded: the caller's
        # cancellation (its own deadline, the pool's exit) abandons the read at once; the thread
        # finishes, and closes the file, alone.
        try:
            return await self.files.get_entry(key)
        except ReadTimeout:
            self._timed_out(key)
            return None
        except RefusedFile as exc:
            raise CorruptEntry(str(exc)) from exc
        except OSError as exc:
            raise CorruptEntry(f"cannot read: {exc}") from exc

    async def _guarded_read(self, key: str, read: Callable[[str], Awaitable[_T]]) -> _T | None:
        if self._stalled():
            return None
        result: _T | None = None
        # Not shielded: the caller's cancellation (its own deadline, the pool's exit) abandons
        # the read at once, as the deadline does; the thread finishes, and closes the file, alone.
        with anyio.move_on_after(DISK_DEADLINE) as scope:
            try:
                result = await read(key)
            except RefusedFile as exc:
                raise CorruptEntry(str(exc)) from exc
            except OSError as exc:
                raise CorruptEntry(f"cannot read: {exc}") from exc
        if scope.cancelled_caught:
            self._timed_out(key)
            return None
        return result

    def _timed_out(self, key: str) -> None:
        """A read past ``DISK_DEADLINE``: a miss, and the disk left alone for ``DISK_BACKOFF``."""
        self.counts["disk_timeouts"] += 1
        self._stall()
        self.files.abandon_reads()
        self._warn_once(
            "read-timeout",
            "disk cache read of %s… did not answer within %g s (a hung filesystem?); compiling "
            "it instead, and leaving %s alone for %g s",
            key[:16],
            DISK_DEADLINE,
            self.root,
            DISK_BACKOFF,
        )

    async def set(self, key: str, data: bytes) -> bool:
        """Publish an entry; True where it was. Never raises for the disk's sake (the caller
        has its result)."""
        if not self.writable or self._stalled():
            return False
        if len(data) > MAX_ENTRY_BYTES:
            # It would be refused when read: never written, it costs a compile next time, as now.
            self._warn_once(
                "write-too-large",
                "cache entry %s… is %s, over the %s bound on an entry: kept in memory only",
                key[:16],
                human_bytes(len(data)),
                human_bytes(MAX_ENTRY_BYTES),
            )
            return False
        # Shielded: an entry cut off by a cancellation would only cost a recompile next time,
        # but a moment is cheap. Bounded: a hung filesystem must not hold up the pool's exit;
        # the write is then left to finish (or fail, and clean up) on its own thread.
        with anyio.move_on_after(DISK_DEADLINE, shield=True) as scope:
            try:
                await self.files.set(key, data)
            except OSError as exc:
                self.counts["disk_write_errors"] += 1
                # A full or read-only disk costs a recompile next time, never this compile.
                kind = "full" if exc.errno in _DISK_FULL else f"error-{exc.errno}"
                self._warn_once(
                    f"write-{kind}",
                    "cannot write cache entry %s… to %s (%s); results are kept in memory",
                    key[:16],
                    self.root,
                    exc,
                )
                return False
        if scope.cancelled_caught:
            self.counts["disk_write_timeouts"] += 1
            self._stall()
            self._warn_once(
                "write-timeout",
                "disk cache write of %s… did not finish within %g s (a hung filesystem?); left to "
                "finish in the background",
                key[:16],
                DISK_DEADLINE,
            )
            return False
        self.counts["disk_writes"] += 1
        return True

    async def delete(self, key: str) -> None:
        """Remove an entry; a fault is ignored (the entry is then replaced when compiled)."""
        if not self.writable or self._stalled():
            return
        with anyio.move_on_after(DISK_DEADLINE, shield=True):
            try:
                await self.files.delete(key)
            except OSError as exc:
                logger.debug("cannot remove cache entry %s…: %s", key[:16], exc)

    def _stall(self) -> None:
        self._stalled_until = time.monotonic() + DISK_BACKOFF

    def _stalled(self) -> bool:
        return self._stalled_until > 0 and time.monotonic() < self._stalled_until

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        """Each kind of disk trouble is a WARNING the first time in a pool, DEBUG after that."""
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        logger.log(level, message, *args)
