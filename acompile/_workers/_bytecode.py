"""Where worker processes keep the bytecode of what they import, when the installation has none.

A worker is a fresh interpreter that imports Triton (about 200 modules). Python reads each from
its ``__pycache__`` file when there is one, and otherwise compiles the source again, in every
process. Installations without those files are common: ``uv`` does not compile bytecode unless
asked (``--compile-bytecode``), container images set ``PYTHONDONTWRITEBYTECODE=1`` so that none
is ever written, and a read-only ``site-packages`` cannot take it. There, each worker's imports
cost two to three times as much (on a 16-core host: 0.27-0.37 s instead of 0.12-0.15 s for
Triton and the worker's own modules), and a pool's start, on the path of every cold compile,
with them.

So when Triton's package has no bytecode beside its source, the pool names a folder in the
cache's toolchain folder to its workers (``ACOMPILE_BYTECODE``), and each worker imports Python
source files through a loader (``install``) that reads a module's bytecode from its usual
place, or else from that folder, and writes what it compiles to that folder only. The first
workers compile the sources and write the files; every later worker on this machine and cache
folder reads them. Each file there is checked against its source's hash at every import, so a
changed source is compiled again (whatever its timestamp); a damaged file is compiled again too,
and a file two workers write at once is renamed into place whole. Nothing is written beside the
installation's sources, and the bytecode an installation has is still used (which
``PYTHONPYCACHEPREFIX`` would not do: with it, Python looks in the prefix only, and the standard
library's own files would be compiled again). The folder can be removed at any time.

Left alone: an installation that has Triton's bytecode, and a process that chose a prefix itself
(``PYTHONPYCACHEPREFIX``, ``-X pycache_prefix``). A folder that cannot be written to (a cache
baked read-only into an image) is read, not written.

Whoever can write the cache folder can put code in the workers this way, as they could put
kernels in the disk tier: keep a cache folder writable only by the users of its pools.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import marshal
import os
import secrets
import stat
import sys
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

FOLDER = "bytecode"
ENV = "ACOMPILE_BYTECODE"
HELPERS_ENV = "ACOMPILE_BYTECODE_HELPERS"  # how many processes help a template (precompile)
# The package whose imports make most of a worker's start. A worker's other imports (acompile's
# own, the standard library's) are few and usually compiled already.
_HEAVY = "triton"


def lacks_bytecode(package: str) -> bool:
    """Whether ``package`` is installed from source files without their bytecode beside them
    (blocking: a look along sys.path and one stat)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return False
    try:
        cached = importlib.util.cache_from_source(origin)
    except NotImplementedError:  # an interpreter without a bytecode cache tag
        return False
    return not os.path.exists(cached)


def folder_for_workers(memo_dir: Path, package: str | None = None) -> str | None:
    """The folder for the workers' bytecode, or None to leave their imports as the installation
    has them (see the module's docstring). Blocking: call it in a thread."""
    if sys.pycache_prefix is not None or os.environ.get("PYTHONPYCACHEPREFIX"):
        return None
    if not lacks_bytecode(package or _HEAVY):
        return None
    folder = memo_dir / FOLDER
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    # A folder that cannot be written to (a cache baked read-only into an image) is still read:
    # the loader's writes there fail quietly.
    if not folder.is_dir() or not os.access(folder, os.R_OK | os.X_OK):
        return None
    return str(folder)


class _Loader(importlib.machinery.SourceFileLoader):
    """A source file's loader that keeps its bytecode in ``folder`` where none is beside the
    source. The files it writes there are checked against their source's hash (PEP 552), not its
    modification time and size: the folder outlives reinstalls, and a file deployed with its
    timestamp kept and its size unchanged must not run its old bytecode. A file there that is
    damaged (a write cut short by a full disk), of another Python, not a regular file, or of
    another source is compiled again and replaced."""

    folder = ""

    def get_code(self, fullname: str) -> CodeType | None:
        source_path = self.get_filename(fullname)
        beside = importlib.util.cache_from_source(source_path)
        if os.path.exists(beside):
            return super().get_code(fullname)  # the installation's own, checked as Python does
        ours = _path_in(self.folder, beside)
        source = self.get_data(source_path)
        header = _header(source)
        data = _read_regular_file(ours)
        if data is not None and data[:16] == header:
            try:
                code = marshal.loads(memoryview(data)[16:])
            except (EOFError, ValueError, TypeError):
                code = None
            if isinstance(code, CodeType) and code.co_filename == source_path:
                return code
        return _compile_into(ours, source, source_path)

    def set_data(self, path: str, data: Buffer, *, _mode: int = 0o666) -> None:
        """Never beside the installation's sources (the standard loader writes there when their
        bytecode is stale)."""


# PEP 552 flags: a hash-based file, checked against its source at every import.
_CHECKED_HASH = (0b11).to_bytes(4, "little")


def _path_in(folder: str, beside: str) -> str:
    """Where ``folder`` keeps the bytecode Python would keep at ``beside``."""
    return os.path.join(folder, os.path.normpath(beside).lstrip(os.sep))


def _header(source: bytes) -> bytes:
    return importlib.util.MAGIC_NUMBER + _CHECKED_HASH + importlib.util.source_hash(source)


def _compile_into(path: str, source: bytes, source_path: str) -> CodeType:
    """Compile a source as the import system does and keep its bytecode at ``path``."""
    code: CodeType = compile(source, source_path, "exec", dont_inherit=True)
    with contextlib.suppress(OSError):  # a folder that cannot be written: compiled each time
        write_whole(path, _header(source) + marshal.dumps(code))
    return code


def helpers_for(cpus: int) -> int:
    """How many processes help a template compile the bytecode it lacks (``precompile``): the
    CPUs that the pool's process and the template leave, up to six (a share of Triton's ~150
    files each); none on a machine of two, where the first pool's process hashes Triton's
    binaries at the same time and a helper would only compete with it."""
    return max(0, min(6, cpus - 2))


def helpers_value(count: int) -> str:
    """``HELPERS_ENV``'s value for a template: how many helpers, for which package."""
    return f"{count}:{_HEAVY}"


def parse_helpers_value(value: str) -> tuple[int, str]:
    count, _, package = value.partition(":")
    return (int(count) if count.isdigit() else 0), package or _HEAVY


def precompile(folder: str, helpers: int, package: str | None = None) -> list[int]:
    """Fork ``helpers`` processes that compile every source file of ``package`` into
    ``folder``, the largest first, while this process goes on to import it: the first process
    on a cache folder (a pool's template) then finds most of its imports compiled instead of
    compiling each in turn (on a 16-core host, Triton's are ~0.15 s of a template's start).
    Only where ``folder`` can be written and lacks the current bytecode of the package's
    largest source file (helpers start there); returns the helpers' pids, for the caller to
    reap. Each helper dies with the caller (``PR_SET_PDEATHSIG``), keeps no
    descriptor of it open, and leaves a file whole or not at all, as a worker does; a file a
    worker and a helper both write is the same file."""
    if helpers < 1 or not hasattr(os, "fork"):
        return []
    try:
        spec = importlib.util.find_spec(package or _HEAVY)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or not spec.submodule_search_locations:
        return []  # not installed where this process looks, or not a package of source files
    roots = list(spec.submodule_search_locations)
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        return []  # read-only (baked into an image): what they compiled would be thrown away
    sources: list[tuple[int, str]] = []
    for root in roots:
        for where, folders, files in os.walk(root):
            folders[:] = [name for name in folders if name != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(where, name)
                    with contextlib.suppress(OSError, NotImplementedError):
                        if not os.path.exists(importlib.util.cache_from_source(path)):
                            sources.append((os.stat(path).st_size, path))  # none beside it
    sources.sort(reverse=True)
    if not sources or _compiled(folder, sources[0][1]):
        # Helpers start with the largest file: where it is compiled, for its current source, an
        # earlier process's helpers did this (a package upgraded since, or a first template
        # stopped before its helpers got far, is compiled again).
        return []
    import signal

    pids = []
    caller = os.getpid()
    # SIGTERM waits until a helper has dropped the caller's handler (see _helper).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        for share in range(min(helpers, len(sources))):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                _helper([path for _, path in sources[share::helpers]], folder, caller)  # never returns
            pids.append(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pids


def _compiled(folder: str, source_path: str) -> bool:
    """Whether ``folder`` holds bytecode of ``source_path``'s current source."""
    try:
        ours = _path_in(folder, importlib.util.cache_from_source(source_path))
        with open(source_path, "rb") as file:
            header = _header(file.read())
    except (OSError, NotImplementedError):
        return False
    existing = _read_regular_file(ours)
    return existing is not None and existing[:16] == header


def _helper(paths: list[str], folder: str, caller: int) -> None:
    code = 0
    try:
        import signal

        # Not the template's handlers: its SIGTERM handler would clean up after a pool it
        # believes dead (its parent is not the pool's process) and remove the pool's folder.
        # (SIGTERM is blocked from before the fork until now.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.pop("ACOMPILE_WORKDIR", None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != caller:
            return  # the caller died before the signal was set: nobody wants these files now
        # The caller's pipes (stdio included): whoever reads them must see their end with it.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, 1 << 16)
        for path in paths:
            try:
                if not _compiled(folder, path):
                    with open(path, "rb") as file:
                        source = file.read()
                    _compile_into(_path_in(folder, importlib.util.cache_from_source(path)), source, path)
            except Exception:  # a file that does not compile is the importer's to report
                pass
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _read_regular_file(path: str) -> bytes | None:
    """The file's bytes, or None where it is missing, unreadable or not a regular file (a FIFO
    would block the read for ever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # Checked before the descriptor becomes a file object: open() of a folder's raises.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as file:
            return file.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def write_whole(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: to a file of this process's own, every byte (a
    short write on a full disk is an error, not a shorter file), then renamed into place, so
    that workers writing it at once each leave a whole file. A failure raises ``OSError`` and
    leaves nothing."""
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def install(folder: str) -> None:
    """Import source files of this process through ``_Loader`` with bytecode in ``folder``:
    called by a worker before its first import of a backend."""
    _Loader.folder = folder
    loaders: list[tuple[Any, list[str]]] = [
        (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        (_Loader, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
    ]
    sys.path_hooks.insert(0, importlib.machinery.FileFinder.path_hook(*loaders))
    sys.path_importer_cache.clear()  # the finders made at start-up, for the standard loader


__all__ = [
    "ENV",
    "FOLDER",
    "HELPERS_ENV",
    "folder_for_workers",
    "helpers_for",
    "helpers_value",
    "install",
    "lacks_bytecode",
    "parse_helpers_value",
    "precompile",
    "write_whole",
]
