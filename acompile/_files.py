"""Writing a file whole or not at all: the one way acompile replaces a file.

Whoever reads a file acompile writes (a cache entry, the toolchain's memo, a worker's bytecode, a
compiler's log, a trace, a bundle, the launcher's library) sees the old file or the new one,
never part of one, and a writer killed midway leaves the old file as it was. So every write goes
to a fresh temporary file beside the target, is renamed over it once whole (``os.replace``, atomic
within a folder), and the temporary is removed on any failure.

The temporary is created with ``O_EXCL | O_NOFOLLOW``: a fresh file or an error, never a file
someone planted at its name, and never written through a link there (not even a dangling one,
which ``O_CREAT`` alone would follow). The rename replaces whatever sits at the target (a link, a
FIFO, a device) without opening it; only a folder there makes it fail.

A temporary's name is ``.<name>.<pid>.<token>.tmp``: hidden (readers of the cache folder skip
names that start with a dot), unique to the process and the call, and recognisable
(``is_temporary``), so that ``prune`` can remove one a killed writer left behind. The target's
name in it is cut short to keep the whole within the 255 bytes a file name may have.

This module imports nothing but the standard library's smallest parts: a worker writes its
bytecode through it before it imports anything else.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from typing import BinaryIO

# O_EXCL: a fresh file or nothing; O_NOFOLLOW: a link at the temporary's name is refused (ELOOP)
# rather than followed; O_CLOEXEC: a process started meanwhile does not inherit the descriptor.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The target's name in a temporary's: with ".", ".<pid>" (up to 7 digits on Linux, 10 anywhere),
# ".<8 hex digits>" and ".tmp", a name of 200 characters stays below 255.
_NAME_BOUND = 200

# The temporaries this module names, and those of older releases (the workers' bytecode writer
# named them without the leading dot).
_TEMPORARY = re.compile(r".+\.[0-9]+\.[0-9a-f]{8}\.tmp")


def temporary_name(name: str) -> str:
    """A fresh temporary file's name for a file called ``name`` (a name, not a path), unique
    to this process and call."""
    return f".{name[:_NAME_BOUND]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def is_temporary(name: str) -> bool:
    """Whether ``name`` (a name, not a path) is a writer's temporary file's."""
    return _TEMPORARY.fullmatch(name) is not None


@contextlib.contextmanager
def writing(
    path: str | os.PathLike[str], *, mode: int = 0o666, fsync: bool = False, dir_fd: int | None = None
) -> Iterator[BinaryIO]:
    """Replace the file at ``path`` with what the block writes to the file it is given, whole
    or not at all (blocking). The folder must exist.

    ``mode`` is the new file's (less the umask), ``fsync`` flushes it to the disk before the
    rename (a bundle that must survive a power cut, not a cache entry the next compile can
    rewrite). With ``dir_fd``, ``path`` is relative to that open folder, which nobody can swap
    for a link while the file is written.

    Raises ``OSError`` (``IsADirectoryError`` where a folder sits at ``path``), or whatever the
    block raised; then the file at ``path`` is as it was and no temporary is left.
    """
    folder, name = os.path.split(os.fspath(path))
    temporary = os.path.join(folder, temporary_name(name))
    fd = os.open(temporary, _CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:
        with open(fd, "wb", closefd=True) as file:
            yield file
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(temporary, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise


def write_whole(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = 0o666,
    fsync: bool = False,
    dir_fd: int | None = None,
) -> None:
    """Replace the file at ``path`` with ``data``, whole or not at all (see ``writing``): every
    byte is written (a short write on a full disk is an error, not a shorter file)."""
    with writing(path, mode=mode, fsync=fsync, dir_fd=dir_fd) as file:
        file.write(data)


def lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``seconds`` for another process
    that holds it: False where it stayed held. Polled (``LOCK_NB``), never a blocking ``flock``,
    which could not be given up. Another ``OSError`` (a filesystem without locks) is raised.
    The lock goes as the file is closed, or as its holder dies."""
    import fcntl
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


__all__ = ["is_temporary", "lock_within", "temporary_name", "write_whole", "writing"]
