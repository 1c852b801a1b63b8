"""Build outputs that acompile serves to another compiler's user (Inductor's C++ outputs, a JIT
library's modules): whether one is whole, how it is put where its library loads it, and the CPU
a build for the machine that builds (``-march=native``) is for. One policy for every served
output, used by ``_torch`` and ``_jit`` alike.

And the files a command writes at a path its user names (``--json`` reports, ``--record``): never
through a link another user placed there, never into another user's file (``own_file_problem``,
``write_own_file``)."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import platform
import stat
import struct

from acompile import _files

# What a whole output of each kind starts with (an ELF object or library; GCC's precompiled
# header; clang's).
_OUTPUT_MAGIC = {".so": (b"\x7fELF",), ".o": (b"\x7fELF",), ".gch": (b"gpch",), ".pch": (b"CPCH",)}


def output_problem(path: str, data: bytes) -> str | None:
    """Why ``data`` is not a whole output for ``path``, or None. A compiler writes its output in
    place: one killed part-way leaves a start of it (or nothing), which is never served."""
    if not data:
        return f"{os.path.basename(path)} is empty"
    suffix = os.path.splitext(path)[1]
    magic = _OUTPUT_MAGIC.get(suffix)
    if magic is not None and not data.startswith(magic):
        return f"{os.path.basename(path)} does not start as a {suffix} file does"
    if data.startswith(b"\x7fELF") and not _whole_elf(data):
        return f"{os.path.basename(path)} is cut short (its section table lies past its end)"
    return None


def _whole_elf(data: bytes) -> bool:
    """Whether an ELF file holds the section header table its header points to (the linker
    writes it last): a file cut short does not."""
    if len(data) < 16 or data[4] not in (1, 2):
        return len(data) >= 16  # not a class this reads: taken as it is
    order = "<" if data[5] == 1 else ">"
    wide = data[4] == 2  # ELFCLASS64: 8-byte offsets, a 64-byte header
    if len(data) < (64 if wide else 52):
        return False
    shoff: int = struct.unpack_from(order + ("Q" if wide else "I"), data, 0x28 if wide else 0x20)[0]
    shentsize, shnum = struct.unpack_from(order + "HH", data, 0x3A if wide else 0x2E)
    return bool(shoff + shentsize * shnum <= len(data))


def write_output(path: str, data: bytes) -> None:
    """Put an output where its library loads it: whole, or not at all, and only in a folder of
    this user's that nobody else may write (Inductor's default cache folder is in the shared
    /tmp, where another user may have made it, or a folder in it, first). An identical file
    already there is left alone (a library that loaded it keeps its mapping). Raises ``OSError``
    otherwise: the caller leaves the build to the library."""
    folder, name = os.path.split(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(dfd)
        # Group-writable is allowed: a umask of 002 (a user's private group, a team's folder)
        # makes such folders so, and the libraries write their own builds there all the same.
        if info.st_uid != os.getuid() or info.st_mode & 0o002:
            raise PermissionError(
                f"{folder} is not this user's alone (uid {info.st_uid}): nothing is put there"
            )
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            fd = -1
        if fd >= 0:
            with os.fdopen(fd, "rb") as existing:
                same = os.fstat(fd).st_size == len(data) and existing.read() == data
            if same:
                return
        _files.write_whole(name, data, mode=0o755, dir_fd=dfd)
    finally:
        os.close(dfd)


@functools.cache
def cpu_identity() -> str:
    """This CPU's model and instruction-set flags, as the kernel reports them (a digest)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()


# How many links in a row a path given for a command's output may go through (Linux's own bound).
_MAX_LINKS = 40


def _owner(uid: int) -> str:
    """A user, as a message names them."""
    try:
        import pwd

        return f"another user ({pwd.getpwuid(uid).pw_name}, uid {uid})"
    except (ImportError, KeyError):
        return f"another user (uid {uid})"


def _followed(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """The file ``path`` names once this user's links at its end are followed, and why it may
    not be written (a link of another user's on the way), or None."""
    current = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        try:
            info = os.lstat(current)
        except OSError:
            # Nothing there, or a path that cannot name a file (a file on its way): nothing to
            # follow; the command's own checks, or its write, say what is wrong.
            return current, None
        if not stat.S_ISLNK(info.st_mode):
            return current, None
        if info.st_uid != os.getuid():
            return (
                current,
                f"{current} is a link placed by {_owner(info.st_uid)}: nothing is written through it",
            )
        current = os.path.abspath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return current, f"{path} goes through more than {_MAX_LINKS} links"


def own_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a command may not write the file at ``path`` for its user: a link another user placed
    there (or on the way through this user's links), or a file another user owns; None
    otherwise (a file of this user's, or none yet: written as ``write_own_file`` does)."""
    final, problem = _followed(path)
    if problem is not None:
        return problem
    try:
        info = os.stat(final)
    except OSError:
        return None  # none yet, or none that can be looked at: the write says why
    if stat.S_ISREG(info.st_mode) and info.st_uid != os.getuid():
        return f"{final} is a file of {_owner(info.st_uid)}: nothing is written into it"
    return None


def write_own_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a command's output (a report) at ``path``, which its user named: through this user's
    links, never another user's, and never into a file another user owns (each checked on the
    file opened, so that one put there after a check is refused as well). Raises
    ``PermissionError`` saying which, or ``OSError``."""
    final, problem = _followed(path)
    if problem is not None:
        raise PermissionError(problem)
    try:
        # O_NOFOLLOW: a link put at the file's name since it was looked at is not followed.
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(
                f"{final} is a link put there as it was written: nothing is written through it"
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            if info.st_uid != os.getuid():
                raise PermissionError(
                    f"{final} is a file of {_owner(info.st_uid)}'s: nothing is written into it"
                )
            os.ftruncate(fd, 0)  # only now: another user's file is left as it was
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
