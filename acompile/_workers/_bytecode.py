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
folder reads them. Python checks each file against its source (modification time and size), so
an upgraded package is compiled again; a file two workers write at once is renamed into place
whole. Nothing is written beside the installation's sources, and the bytecode an installation
has is still used (which ``PYTHONPYCACHEPREFIX`` would not do: with it, Python looks in the
prefix only, and the standard library's own files would be compiled again). The folder can be
removed at any time.

Left alone: an installation that has Triton's bytecode, a process that chose a prefix itself
(``PYTHONPYCACHEPREFIX``, ``-X pycache_prefix``), and a cache folder that cannot be written.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

FOLDER = "bytecode"
ENV = "ACOMPILE_BYTECODE"
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
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    return str(folder)


class _Loader(importlib.machinery.SourceFileLoader):
    """A source file's loader whose bytecode, where none is beside the source, is in ``folder``.

    ``get_code`` (the standard one) asks ``get_data`` for the bytecode at its usual path, checks
    it against the source, and hands what it compiles to ``set_data``."""

    folder = ""

    def _ours(self, path: str) -> str:
        return os.path.join(self.folder, path.lstrip(os.sep))

    def get_data(self, path: str) -> bytes:
        if not path.endswith(importlib.machinery.BYTECODE_SUFFIXES[0]):
            return super().get_data(path)
        try:
            return super().get_data(path)
        except OSError:
            return super().get_data(self._ours(path))

    def set_data(self, path: str, data: Buffer, *, _mode: int = 0o666) -> None:
        # Only bytecode is ever written through a loader; it goes to the folder, never beside
        # the source (the standard set_data makes the missing folders, and gives up silently
        # on a failure, as for an unwritable __pycache__).
        super().set_data(self._ours(path), data, _mode=_mode)


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
    sys.dont_write_bytecode = False  # (PYTHONDONTWRITEBYTECODE) what it writes goes to folder


__all__ = ["ENV", "FOLDER", "folder_for_workers", "install", "lacks_bytecode"]
