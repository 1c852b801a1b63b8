"""Backends, one module each, imported the first time they are used.

A backend is a worker-side module with ``setup(config)``, ``preload(config)`` and
``compile(payload) -> bytes`` (a cache entry), and a parent-side half that checks and keys
requests and loads results.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from acompile._errors import BackendUnavailableError

_PACKAGES = {"triton": "triton"}


def load_parent(name: str) -> ModuleType:
    """The parent-side module of a backend, with a clear error if its package is missing."""
    package = _PACKAGES.get(name)
    try:
        if package is not None:
            importlib.import_module(package)
        return importlib.import_module(f"acompile._backends._{name}")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {name} backend needs the {package!r} package: pip install {package}"
        ) from exc
