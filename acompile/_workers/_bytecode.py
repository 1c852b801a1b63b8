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
import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import stat
import sys
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

from acompile import _files

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
        code = _current_code(ours, source, source_path)
        if code is None:
            code = _compile(source, source_path)
            with contextlib.suppress(OSError):  # a folder that cannot be written: compiled each time
                _keep(ours, source, code)
        return code

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


def _current_code(path: str, source: bytes, source_path: str) -> CodeType | None:
    """The code in the bytecode file at ``path`` where it is whole and of this very source
    (its hash in the header, its file name in the code), else None."""
    data = _read_regular_file(path)
    if data is None or data[:16] != _header(source):
        return None
    try:
        code = marshal.loads(memoryview(data)[16:])
    except (EOFError, ValueError, TypeError):
        return None
    return code if isinstance(code, CodeType) and code.co_filename == source_path else None


def _compile(source: bytes, source_path: str) -> CodeType:
    """A source compiled as the import system compiles it."""
    code: CodeType = compile(source, source_path, "exec", dont_inherit=True)
    return code


def _keep(path: str, source: bytes, code: CodeType) -> None:
    """Keep ``code`` (of ``source``) at ``path``, whole or not at all; raises ``OSError``."""
    write_whole(path, _header(source) + marshal.dumps(code))


def plan(memo_dir: Path, helped: bool) -> tuple[str | None, str]:
    """Where a pool's workers keep their imports' bytecode (None: where the installation does),
    and ``HELPERS_ENV``'s value for its first template ("" for no help; ``helped``: the pool
    preloads Triton, whose sources are worth the help). Blocking: a look along sys.path, the
    cgroup's CPU quota."""
    folder = folder_for_workers(memo_dir)
    if folder is None or not helped:
        return folder, ""
    from acompile._sizing import usable_cpus

    return folder, helpers_env(helpers_for(usable_cpus()))


def helpers_for(cpus: int) -> int:
    """How many processes help a template compile the bytecode it lacks (``precompile``): the
    CPUs that the pool's process and the template leave, up to six (a share of Triton's ~150
    files each); none on a machine of two, where the first pool's process hashes Triton's
    binaries at the same time and a helper would only compete with it (measured: 0.55 s to
    a ready template without one, 0.62-0.65 s with one)."""
    return max(0, min(6, cpus - 2))


def helpers_env(count: int, package: str | None = None) -> str:
    """``HELPERS_ENV``'s value for a pool's template: how many helpers, and the package's
    folders as the pool's process finds them (the template looks before it has the pool's
    ``sys.path``); "" for none. Blocking (a look along ``sys.path``): call it in a thread."""
    if count < 1:
        return ""
    try:
        spec = importlib.util.find_spec(package or _HEAVY)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not spec.submodule_search_locations:
        return ""  # not installed, or not a package of source files
    return json.dumps({"count": count, "roots": list(spec.submodule_search_locations)})


# A helper's process name (``ps``, ``/proc/<pid>/comm``): it keeps the template's command line.
HELPER_NAME = "acompile-pyc"


class Helping:
    """A template's helpers (``precompile``) until they are reaped: once every one has ended
    well, ``stamp`` is written, and later templates on the folder start none for the same
    sources; a helper killed (the template stopped early) leaves the work to the next one."""

    def __init__(self, pids: list[int], stamp: str) -> None:
        self.pids = set(pids)
        self.stamp = stamp
        self.failed = False

    def ended(self, pid: int, status: int) -> None:
        """Helper ``pid`` was reaped with wait ``status``."""
        self.pids.discard(pid)
        self.failed = self.failed or not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
        if not self.pids and not self.failed:
            with contextlib.suppress(OSError):
                write_whole(self.stamp, b"")


def precompile(folder: str, value: str) -> Helping | None:
    """Fork the helpers ``value`` (``helpers_env``) asks for: processes that compile every
    source file of the package into ``folder``, the largest first, while this process goes on
    to import it. The first template on a cache folder then finds most of its imports compiled
    instead of compiling each in turn (on a 16-core host, Triton's are ~0.15 s of a template's
    start). None where there is nothing to do: no helpers asked for, not Linux, a folder that
    cannot be written, or a stamp of helpers that compiled these very sources (their paths,
    sizes and modification times) to the end. Each helper dies with the caller
    (``PR_SET_PDEATHSIG``), holds none of its descriptors, and leaves a file whole or not at
    all, as a worker does. The caller reaps them and reports each end to ``Helping.ended``."""
    if not value or not sys.platform.startswith("linux"):
        return None
    try:
        plan = json.loads(value)
        count, roots = int(plan["count"]), [str(root) for root in plan["roots"]]
    except (ValueError, KeyError, TypeError, OverflowError):
        return None
    if count < 1 or not roots:
        return None
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        return None  # read-only (baked into an image): what they compiled would be thrown away
    sources: list[tuple[int, int, str]] = []
    for root in roots:
        for where, folders, files in os.walk(root):
            folders[:] = sorted(name for name in folders if name != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(where, name)
                    with contextlib.suppress(OSError, NotImplementedError):
                        if not os.path.exists(importlib.util.cache_from_source(path)):  # none beside
                            st = os.stat(path)
                            sources.append((st.st_size, st.st_mtime_ns, path))
    if not sources:
        return None
    listing = "\n".join(f"{path} {size} {mtime}" for size, mtime, path in sources)
    fingerprint = hashlib.sha256(importlib.util.MAGIC_NUMBER + listing.encode()).hexdigest()[:24]
    stamp = os.path.join(folder, f"helped-{fingerprint}")
    if os.path.exists(stamp):
        return None
    sources.sort(reverse=True)
    import signal

    pids = []
    caller = os.getpid()
    # SIGTERM waits until a helper has dropped the caller's handler (see _helper).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        for share in range(min(count, len(sources))):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                _helper([path for _, _, path in sources[share::count]], folder, caller)  # never returns
            pids.append(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return Helping(pids, stamp) if pids else None


def _helper(paths: list[str], folder: str, caller: int) -> None:
    code = 0
    try:
        import gc
        import signal

        gc.disable()  # the caller's file objects, finalized here, would close descriptors now ours
        # Not the template's handlers: its SIGTERM handler would clean up after a pool it
        # believes dead (its parent is not the pool's process) and remove the pool's folder.
        # (SIGTERM is blocked from before the fork until now.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.pop("ACOMPILE_WORKDIR", None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        from acompile import _linux

        _linux.signal_at_parent_death(signal.SIGKILL)
        _linux.set_name(HELPER_NAME)
        if os.getppid() != caller:
            return  # the caller died before the signal was set: nobody wants these files now
        # None of the caller's descriptors (its protocol pipes, its stdio): whoever reads them
        # sees their end when the caller goes, not when its helpers do.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for path in paths:
            try:
                with open(path, "rb") as file:
                    source = file.read()
                ours = _path_in(folder, importlib.util.cache_from_source(path))
                if _current_code(ours, source, path) is not None:
                    continue
                compiled = _compile(source, path)
            except Exception:  # a file that does not read or compile is the importer's to report
                continue
            try:
                _keep(ours, source, compiled)
            except OSError:
                code = 1  # not done (a full disk, a file where a folder goes): no stamp
    except BaseException:
        code = 1
    finally:
        os._exit(code)


# Triton's largest module compiles to about 200 KB of bytecode: a file many times that is not one.
_MAX_BYTECODE = 16 << 20


def _read_regular_file(path: str) -> bytes | None:
    """The file's bytes, or None where it is missing, unreadable, a link, not a regular file (a
    FIFO would block the read for ever) or larger than any module's bytecode is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # Checked before the descriptor becomes a file object: open() of a folder's raises.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_BYTECODE:
            return None
        with open(fd, "rb", closefd=False) as file:
            return file.read(_MAX_BYTECODE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_whole(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (``acompile._files``), making its folder: workers
    writing it at once each leave a whole file. A failure raises ``OSError`` and leaves nothing
    (a process killed midway leaves a temporary, which cache prune removes once it is old)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _files.write_whole(path, data, mode=0o644)


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
    "HELPER_NAME",
    "Helping",
    "folder_for_workers",
    "helpers_env",
    "helpers_for",
    "install",
    "lacks_bytecode",
    "plan",
    "precompile",
    "write_whole",
]
