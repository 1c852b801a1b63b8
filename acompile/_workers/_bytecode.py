"""Where worker processes keep the bytecode of what they import, when the installation has none.

A worker is a fresh interpreter that imports Triton (about 200 modules). Python reads each from
its ``__pycache__`` file when there is one, and otherwise compiles the source again, in every
process. Installations without those files are common: ``uv`` does not compile bytecode unless
asked (``--compile-bytecode``), container images set ``PYTHONDONTWRITEBYTECODE=1`` so that none
is ever written, and a read-only ``site-packages`` cannot take it. There, each worker's imports
cost two to three times as much (on a 16-core host: 0.27-0.37 s instead of 0.12-0.15 s for
Triton and the worker's own modules), and a pool's start, on the path of every cold compile,
with them.

So when Triton's package has no bytecode next to its source, the pool starts its workers with
``PYTHONPYCACHEPREFIX`` set to a folder in the cache's toolchain folder (and without
``PYTHONDONTWRITEBYTECODE``): the first workers compile the sources and write the files there,
and every later worker, on this machine and cache folder, reads them. Python checks each file
against its source (modification time and size), so an upgraded package is compiled again; a
file two workers write at once is renamed into place whole. Nothing is written next to the
installation's sources. The folder can be removed at any time.

Left alone: an installation that has its bytecode (a prefix would make Python ignore it), a
process that chose a prefix itself (``PYTHONPYCACHEPREFIX``, ``-X pycache_prefix``), and a cache
folder that cannot be written.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

FOLDER = "bytecode"
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
    """The folder to give workers as ``PYTHONPYCACHEPREFIX``, or None to leave their imports as
    the installation has them (see the module's docstring). Blocking: call it in a thread."""
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


def worker_environment(env: dict[str, str], folder: str | None) -> None:
    """Point a worker's environment ``env`` at ``folder`` (from ``folder_for_workers``)."""
    if folder:
        env["PYTHONPYCACHEPREFIX"] = folder
        env.pop("PYTHONDONTWRITEBYTECODE", None)


__all__ = ["FOLDER", "folder_for_workers", "lacks_bytecode", "worker_environment"]
