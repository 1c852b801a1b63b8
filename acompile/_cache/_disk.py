"""The disk tier: one file per entry, published atomically, shared by any number of processes.

Layout: ``<root>/v1/<key[:2]>/<key>``. A writer writes the whole entry to a private temporary
file in the same folder and renames it over the final name, so a reader (in this process or
another) sees either no entry or a whole one, never a torn one. Entries are verified by the
layer above; the tier itself only moves bytes, through aiofiles, off the event loop.

Each read and each write is one blocking call on a daemon thread of this module, which owns its
file from open to close (and a writer its temporary file, removed on any failure). A caller may
therefore stop waiting at any moment, cancelled or past a deadline, and leak nothing: the thread
finishes by itself. A call stuck in the kernel (a hung network filesystem) is abandoned, never
joined, so it cannot hang the pool's exit or the interpreter's.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.os

LAYOUT = "v1"

_T = TypeVar("_T")

# O_NONBLOCK: open() of a FIFO at an entry's path returns at once instead of waiting for a writer
# (it is then refused as not a regular file). It changes nothing for regular files.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


def default_cache_dir() -> Path:
    """``$ACOMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/acompile``, else ``~/.cache/acompile``."""
    explicit = os.environ.get("ACOMPILE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "acompile"


class NotAnEntryFile(OSError):
    """Something other than a regular file (a FIFO, a device, a folder) sits at an entry's path."""


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


def _read_file(path: Path) -> bytes | None:
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            # A FIFO or a device would never end (or never start) a read.
            raise NotAnEntryFile(f"not a regular file: {path}")
        return f.read()


def _write_file(final: Path, data: bytes) -> None:
    final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name[:16]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        # A full disk (ENOSPC, EDQUOT, EFBIG) fails part-way: the partial file goes too.
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_read = aiofiles.os.wrap(_read_file)
_write = aiofiles.os.wrap(_write_file)
_run = aiofiles.os.wrap(lambda call: call())


class DiskTier:
    name = "disk"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.entries = self.root / LAYOUT

    def path(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key[:2] / key

    def prepare(self) -> None:
        """Create the folder, private to this user (blocking: call from a thread).

        Raises ``OSError`` if the folder cannot be created; a folder that exists but cannot be
        made private (someone else's, or read-only) is used as it is.
        """
        self.entries.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(self.root, 0o700)
        except OSError:
            pass  # a shared folder made by someone else, or a read-only one: use what we may

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
        """The entry's bytes, or None where there is none. Raises ``OSError`` (``NotAnEntryFile``
        for a FIFO, a device or a folder at its path)."""
        data: bytes | None = await _read(self.path(key), executor=_threads)
        return data

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
        """Every entry file (blocking: for the command line and threads)."""
        if not self.entries.is_dir():
            return
        for sub in sorted(self.entries.iterdir()):
            if sub.is_dir():
                for path in sorted(sub.iterdir()):
                    if not path.name.startswith("."):
                        yield path
