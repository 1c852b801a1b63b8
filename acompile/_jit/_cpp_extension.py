"""torch's C++/CUDA extensions (``torch.utils.cpp_extension.load`` and ``load_inline``), served.

torch writes a ``build.ninja`` into the extension's folder (``$TORCH_EXTENSIONS_DIR/<name>``, per
user, Python and torch by default) and runs ninja there through ``_run_ninja_build(build_directory,
verbose, error_prefix)``, a module function every release from 2.8 to 2.14 calls by its global
name. Served, that call is ``ServedBuilds.run``: the library from the tiers, or built on the
pool's workers and published. torch then loads it as always.

torch up to 2.13 guards a build with a ``FileBaton``: a lock *file* created with ``O_EXCL`` that
the builder removes; a builder killed mid-build leaves it, and every later process waits for it
forever. Served, the baton is a lock the kernel holds (``flock`` on that file): a killed
builder's lock goes with its process, and a file left by an unserved process that died is not a
lock at all. torch 2.14 holds such a lock itself (its ``FileLock``): nothing is swapped there.
"""

from __future__ import annotations

import fcntl
import inspect
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from acompile._jit._library import Unsupported
from acompile._jit._ninja import Build, package_roots, package_versions, standard_roots

if TYPE_CHECKING:
    from acompile._jit._builds import ServedBuilds

NAME = "cpp_extension"
MODULE = "torch.utils.cpp_extension"
SUPPORTED = "torch 2.8 to 2.14"
_RELEASES = ((2, 8), (2, 14))


def install(builds: ServedBuilds) -> Callable[[], None]:
    """Serve torch's extension builds through ``builds``; returns the undo. Raises
    ``Unsupported`` on a torch outside ``SUPPORTED`` or one whose seams changed."""
    import importlib

    import torch

    # Its private parts, read and swapped. From the import system's table: this runs as the
    # module finishes its import, before its package has the attribute.
    ext: Any = importlib.import_module(MODULE)

    release = _release(str(torch.__version__))
    if release is None or not _RELEASES[0] <= release <= _RELEASES[1]:
        raise Unsupported(f"torch {torch.__version__} is outside the releases served ({SUPPORTED})")
    original = getattr(ext, "_run_ninja_build", None)
    if original is None or list(inspect.signature(original).parameters)[:3] != [
        "build_directory",
        "verbose",
        "error_prefix",
    ]:
        raise Unsupported(f"torch {torch.__version__}'s cpp_extension._run_ninja_build is not the one served")
    # torch up to 2.13 guards a build with a FileBaton, swapped here; 2.14 takes a lock the
    # kernel holds (its FileLock) already, which needs nothing of acompile's.
    baton = getattr(ext, "FileBaton", None)
    if baton is None and getattr(ext, "FileLock", None) is None:
        raise Unsupported(f"torch {torch.__version__}'s cpp_extension has neither FileBaton nor FileLock")
    extensions_root = _extensions_root()

    def served_run(build_directory: str, verbose: bool, error_prefix: str, *args: Any, **kwargs: Any) -> None:
        def run_here() -> None:
            original(build_directory, verbose, error_prefix, *args, **kwargs)

        if args or kwargs:  # a call this release did not make: torch's own
            run_here()
            return
        folder = os.path.realpath(build_directory)
        roots: tuple[tuple[str, str], ...] = package_roots("torch")
        if extensions_root:
            roots += (("extensions", extensions_root),)
        build = Build(
            library=NAME,
            name=os.path.basename(folder),
            folder=folder,
            build_file="build.ninja",
            parts={"torch": str(torch.__version__), **package_versions("torch")},
            roots=standard_roots(folder, *roots),
            env=dict(os.environ),
            ninja=shutil.which("ninja") or "ninja",
            jobs=ext._get_num_workers(verbose) if hasattr(ext, "_get_num_workers") else None,
        )

        def failed(log: str) -> Exception:
            return RuntimeError(f"{error_prefix}: {log}")

        builds.run(build, run_here, failed)

    ext._run_ninja_build = served_run
    if baton is not None:
        ext.FileBaton = KernelBaton

    def undo() -> None:
        if ext._run_ninja_build is served_run:
            ext._run_ninja_build = original
        if baton is not None and ext.FileBaton is KernelBaton:
            ext.FileBaton = baton

    return undo


class KernelBaton:
    """torch's ``FileBaton``, as a lock the kernel holds: ``flock`` on the lock file. The file may
    outlive its holder (a killed process); the lock never does."""

    def __init__(
        self, lock_file_path: str, wait_seconds: float = 0.1, warn_after_seconds: float | None = None
    ):
        self.lock_file_path = lock_file_path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        while True:
            fd = os.open(self.lock_file_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            mine = os.fstat(fd)
            if mine.st_uid != os.getuid():
                # Another user's lock in a folder they may write: waiting for it could be forever,
                # and what they hold the folder for is theirs to decide.
                os.close(fd)
                raise PermissionError(
                    f"the lock {self.lock_file_path} belongs to another user (uid {mine.st_uid}): the "
                    "extensions folder is not this user's alone (set TORCH_EXTENSIONS_DIR to one that is)"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # The holder before may have removed the file between our open and our lock: this
            # lock is then on a file nobody else will open. Only the file at the path counts.
            try:
                here = os.stat(self.lock_file_path, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                continue
            if (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            self.fd = fd
            return True

    def wait(self) -> None:
        """Until the holder lets go (or dies): then its library is built, or the next one
        to try builds it."""
        try:
            fd = os.open(self.lock_file_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # released already
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        # Removed while still held: a process that opens the path afterwards makes a new lock,
        # and those waiting on this one are let go by the close.
        try:
            os.unlink(self.lock_file_path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _extensions_root() -> str | None:
    """torch's default folder of extensions (``$TORCH_EXTENSIONS_DIR`` or its per-user one)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return os.path.realpath(root)
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = _get_build_directory("acompile_probe", verbose=False)
    except Exception:
        return None
    # _get_build_directory made the probe's folder: its parent is the root.
    try:
        os.rmdir(folder)
    except OSError:
        pass
    return os.path.realpath(os.path.dirname(folder))


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
