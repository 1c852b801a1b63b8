"""The cache folder's layout, spelled out once::

    <root>/v1/<xx>/<key>        entries (the disk tier), <xx> the key's first two characters
    <root>/lib/<key>.so|.o      native libraries and objects, loaded or linked from their path
    <root>/logs/                compiler logs too long for an error message
    <root>/toolchain/           the toolchain's identity, remembered once per machine
    <root>/run/                 a host pool's socket (acompile.inductor.serve(host_pool=True))
    <root>/costs.json           compile times per kernel, which the pool orders its queue by
    <root>/costs.json.lock      held (flock) while a process merges its times into costs.json
    .<name>.<pid>.<token>.tmp   a writer's temporary file, next to the file it becomes

Every name that starts with "." is a temporary file: readers skip it, and ``prune`` removes one a
dead writer left behind (older than ``STALE_TEMP_S``).

Every file of the folder is read with ``read_state`` and written with ``write_state``, which hold
whatever sits at a file's path at arm's length. A crash, a damaged disk or a slip of the hand can
leave anything there: a FIFO (whose open() would wait forever for a writer, on a thread that
cannot be abandoned), a device, a folder, a link, or a file of gigabytes (sparse: no disk, but a
read of it is that much memory). So a read opens without blocking and without following a link,
and refuses anything but a regular file no larger than its kind of file ever is (``MAX_*_BYTES``);
the caller takes a refusal as a miss. A write goes to a fresh temporary file (``O_EXCL``: never
through a link) renamed over the final name, which replaces a FIFO, a device or a link without
opening it; a folder there is removed first. Nothing is ever written through a link, so none
planted in the folder can lead a write out of it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from acompile import _files

logger = logging.getLogger("acompile")

# The entries' folder is named for the layout's version: a change of layout starts a new folder
# instead of misreading the old one.
ENTRIES = "v1"
LIB = "lib"
LOGS = "logs"
TOOLCHAIN = "toolchain"
RUN = "run"
# Temporary files older than this are left over from a writer that died.
STALE_TEMP_S = 3600.0

# The largest file of each kind that is read; anything larger is damaged (or not acompile's), and
# refused unread. Each is far above what acompile writes, and small enough that a few reads of a
# refused size at once (a warm start reads on two threads) cost no host its memory.
# An entry: a Triton kernel's is tens of KB to a few MB (its IRs, PTX and cubin), a C++ library's
# tens of KB; the largest seen is a torch.compile precompiled header of 26 MB. One larger is kept
# in memory only (``GuardedDisk.set``).
MAX_ENTRY_BYTES = 256 << 20
# The toolchain's memo (``toolchain/*.json``): 150 bytes to 2 KB of JSON.
MAX_MEMO_BYTES = 64 << 10

# O_NONBLOCK: open() of a FIFO returns at once instead of waiting for a writer (it is then refused
# as not a regular file); it changes nothing for regular files. O_NOFOLLOW: a link is refused
# (ELOOP), not followed out of the folder.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

# \Z, not $: "$" also matches before a final newline, and "<key>\n" is not a key.
_KEY_RE = re.compile(r"\A[0-9a-f]{64}\Z")


def is_key(name: str) -> bool:
    """Whether ``name`` is a cache key (64 lowercase hex digits), hence a valid entry file name."""
    return _KEY_RE.match(name) is not None


def entries_dir(root: Path) -> Path:
    """The folder of the disk tier's entries."""
    return root / ENTRIES


def entry_folders(root: Path) -> list[Path]:
    """The folders of entries (``<root>/v1/<xx>``), sorted (blocking); none where the entries'
    folder is missing. A link among them is left out: what it leads to is not the cache folder's."""
    try:
        with os.scandir(entries_dir(root)) as found:
            return sorted(Path(item.path) for item in found if item.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def lib_dir(root: Path) -> Path:
    """The folder of native libraries and objects."""
    return root / LIB


def lib_path(root: Path, key: str, output: str) -> Path:
    """Where the native backends publish the ``output`` (``"so"`` or ``"o"``) of entry ``key``."""
    return root / LIB / f"{key}.{output}"


def logs_dir(root: Path) -> Path:
    """The folder of compiler logs too long for an error message."""
    return root / LOGS


def toolchain_dir(root: Path) -> Path:
    """The folder where backends remember the toolchain's identity."""
    return root / TOOLCHAIN


class RefusedFile(OSError):
    """What sits at a file's path is not to be read: not a regular file (a FIFO, a device, a
    folder, a link), or larger than its kind of file ever is."""


def open_state(path: str | os.PathLike[str]) -> int | None:
    """A descriptor of the regular file at ``path`` (blocking; the caller closes it), or None
    where there is none. Raises ``RefusedFile`` for anything but a regular file. Opened without
    blocking and without following a link."""
    opened = _open_regular(path)
    return None if opened is None else opened[0]


def _open_regular(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``open_state``'s descriptor, with the file's size."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile(f"not a regular file (a link): {os.fspath(path)}") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        # A FIFO or a device would never end (or never start) a read; a folder cannot be read.
        raise RefusedFile(f"not a regular file: {os.fspath(path)}")
    return fd, info.st_size


def open_limited(path: str | os.PathLike[str], limit: int) -> tuple[int, int] | None:
    """A descriptor of the regular file at ``path`` and its size (blocking; the caller closes
    the descriptor), or None where there is none. Raises ``RefusedFile`` for anything but a
    regular file of at most ``limit`` bytes. Opened as ``open_state`` opens it."""
    opened = _open_regular(path)
    if opened is None:
        return None
    fd, size = opened
    if size > limit:
        os.close(fd)
        raise RefusedFile(
            f"{human_bytes(size)}, over the {human_bytes(limit)} bound on this kind of file: "
            f"{os.fspath(path)}"
        )
    return opened


def read_at(fd: int, start: int, length: int) -> bytes:
    """Up to ``length`` bytes of ``fd`` from ``start`` (fewer only at the file's end), in one
    system call where the filesystem allows (some network and FUSE filesystems return short
    reads: read on)."""
    data = os.pread(fd, length, start)
    if len(data) < length and data:
        parts, got = [data], len(data)
        while got < length:
            more = os.pread(fd, length - got, start + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def read_state(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The bytes of the file at ``path`` (blocking), or None where there is none. Raises
    ``RefusedFile`` for anything but a regular file of at most ``limit`` bytes, ``OSError`` where
    the file cannot be read. Opened as ``open_state`` opens it; read whole, in one allocation of
    its size, with as few system calls as can be (open, stat, read, close): a warm start reads
    dozens of entries on threads, and each call there is a hand-over of the interpreter's lock."""
    opened = open_limited(path, limit)
    if opened is None:
        return None
    fd, size = opened
    try:
        # One byte more than the file holds: a file that grew meanwhile says so.
        data = read_at(fd, 0, size + 1)
    finally:
        os.close(fd)
    if len(data) > size:
        # The files of the folder are replaced whole, never written in place: not one of them.
        raise RefusedFile(f"it grew while it was read: {os.fspath(path)}")
    return data


def write_state(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` with ``data``, atomically (blocking): a reader sees the old
    file or the new one, never part of one. Makes the folder it goes in (mode 700), and clears
    the way (``clear_way``) where a folder sits at ``path``, or a file at its folder's. Raises
    ``OSError``; a failed write (a full disk) leaves nothing behind."""
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        # Something that is not a folder (nor a link to one: the cache folder may be the user's
        # link to theirs) where the folder goes.
        clear_way(folder)
        folder.mkdir(mode=0o700)
    try:
        # The rename replaces a FIFO, a device or a link without opening it, never a folder: a
        # folder there is cleared, and the write made again.
        _files.write_whole(path, data)
    except IsADirectoryError:
        clear_way(path)
        _files.write_whole(path, data)


def clear_way(path: Path) -> None:
    """Remove what sits at ``path``, where a file of the cache folder (or one of its folders)
    goes (blocking): a link itself, never what it leads to; a folder with all it holds, but only
    one of this user's (the cache folder and its folders are, ``acompile._trust``). Logged: it is
    damage, or someone's mistake. Raises ``OSError`` (``PermissionError`` for a folder of
    another user's)."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        logger.warning("removed %s from the cache folder: %s, not what goes there", path, _kind(info))
        return
    if info.st_uid != os.getuid():
        raise PermissionError(errno.EPERM, f"a folder of another user's where a file goes: {path}")
    # Never through a link: rmtree removes the links it finds, not what they lead to.
    shutil.rmtree(path)
    logger.warning("removed the folder %s from the cache folder: a file goes there", path)


def _kind(info: os.stat_result) -> str:
    """What a file is, in words: ``"a link"``, ``"a FIFO"``."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        return "a link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def is_temp(path: Path) -> bool:
    """Whether ``path`` names a writer's temporary file."""
    return path.name.startswith(".")


def plural(n: int, one: str, many: str | None = None) -> str:
    """``"1 entry"``, ``"2 entries"``: how reports about a folder count what it holds."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def human_bytes(n: float) -> str:
    """A size as people read it: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = [
    "ENTRIES",
    "LIB",
    "LOGS",
    "MAX_ENTRY_BYTES",
    "MAX_MEMO_BYTES",
    "STALE_TEMP_S",
    "TOOLCHAIN",
    "RefusedFile",
    "clear_way",
    "entries_dir",
    "entry_folders",
    "human_bytes",
    "is_key",
    "is_temp",
    "lib_dir",
    "lib_path",
    "logs_dir",
    "plural",
    "read_state",
    "toolchain_dir",
    "write_state",
]
