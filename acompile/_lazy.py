"""Package namespaces that a pool's worker processes import on first use.

A pool starts its template and workers with ``ACOMPILE_WORKER=1``. There, importing the worker's
loop or a backend module must not import, with the packages above it, their whole namespaces:
``acompile``'s public names are most of the library (the pool, the cache tiers, anyio and
asyncio), 50-100 ms of every worker's start that its jobs never use. So, in a worker,
``acompile``, ``acompile._workers`` and ``acompile._cache`` import their names at the first one
asked for. Everywhere else the names come with the package: a pool never imports on its
caller's event loop.

A package opts in with::

    if TYPE_CHECKING or _lazy.eager(__name__):
        from ... import ...  # its names, as ever
    else:
        __getattr__ = _lazy.on_first_use(__name__)
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_IN_WORKER = os.environ.get("ACOMPILE_WORKER") == "1"
# Packages whose names were asked for in this worker: their __init__ has run again, eagerly
# (_loaded), or runs now (_loading). One lock for all: a reload may ask another package.
_loaded: set[str] = set()
_loading: set[str] = set()
_lock = threading.RLock()


def eager(package: str) -> bool:
    """Whether ``package`` imports its names now: outside a worker, or once one was used."""
    return not _IN_WORKER or package in _loaded or package in _loading


def on_first_use(package: str) -> Callable[[str], Any]:
    """The ``__getattr__`` (PEP 562) of a package whose names a worker imports at the first
    one asked for: the package's ``__init__`` runs again (a reload), eagerly this time.

    Threads that ask at once wait for the one reload; a reload that fails (out of file
    descriptors, say) raises its error to the caller, and the next use tries again."""

    def __getattr__(name: str) -> Any:
        # Names with an underscore are submodules, which the import system looks for here
        # first (``from acompile._workers import _protocol``): loading the namespace for them
        # would undo the point.
        if not name.startswith("_"):
            with _lock:
                module = sys.modules[package]
                if package not in _loaded and package not in _loading:
                    _loading.add(package)
                    try:
                        importlib.reload(module)
                    finally:
                        _loading.discard(package)
                    _loaded.add(package)
                if name in vars(module):
                    return vars(module)[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
