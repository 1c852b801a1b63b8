"""Package faces: the names a package shares, each imported from the module that defines it.

Outside a package, its names come from its face (``from acompile._cache import Entry``), never
from its private modules. A face is a table, name -> the module it lives in (or the module and
its name there; an empty name there: the submodule itself), and ``face()`` makes the package's
``__getattr__`` and ``__dir__`` from it.

Two ways to load, one table:

* **Eager** (``eager=True``, outside a worker): every module of the table is imported with the
  package, as plain imports would. A pool never imports on its caller's event loop: what the
  pool's side uses is loaded by ``import acompile``.
* **On first use**: in a pool's worker process (started with ``ACOMPILE_WORKER=1``), and for
  faces that are lazy everywhere (the backends, torch.compile's parts: importing acompile must
  not import them). A name is imported the first time it is asked for, with its module alone:
  a worker that takes ``Entry`` from ``acompile._cache`` loads ``_cache._entry`` (22 ms), not
  the tiers, aiocache and asyncio the pool's side of the package needs (65 ms more at every
  worker's start).

A package writes::

    _NAMES = {"Entry": "_entry", "make_key": "_keys", "BYTECODE_FOLDER": ("_bytecode", "FOLDER")}
    if TYPE_CHECKING:
        from acompile._cache._entry import Entry as Entry  # the same names, for type checkers
        ...
    __getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=True)

tests/test_architecture.py checks that the table and the ``TYPE_CHECKING`` imports agree, and
counts the table's modules as the face's imports.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

_IN_WORKER = os.environ.get("ACOMPILE_WORKER") == "1"


def face(
    package: str, names: Mapping[str, str | tuple[str, str]], *, eager: bool
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``'s face over ``names``; with
    ``eager`` and outside a worker, every name is imported now."""
    table = {name: (where, name) if isinstance(where, str) else where for name, where in names.items()}

    def load(name: str) -> Any:
        module, attribute = table[name]
        value = importlib.import_module(f"{package}.{module}")
        if attribute:  # else the name is the submodule itself
            value = getattr(value, attribute)
        # The next use is a plain attribute. Import's own lock makes a race of two threads
        # harmless: both get the same object.
        setattr(sys.modules[package], name, value)
        return value

    def __getattr__(name: str) -> Any:
        # Names with an underscore are submodules (``from acompile._cache import _layout``): the
        # import system asks here first, and finds them itself after this AttributeError.
        if name in table:
            return load(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    if eager and not _IN_WORKER:
        for name in table:
            load(name)
    return __getattr__, __dir__
