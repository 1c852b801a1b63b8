"""Build outputs that acompile serves to another compiler's user (Inductor's C++ outputs, a JIT
library's modules): whether one is whole, how it is put where its library loads it, and the CPU
a build for the machine that builds (``-march=native``) is for. One policy for every served
output, used by ``_torch`` and ``_jit`` alike."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
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
