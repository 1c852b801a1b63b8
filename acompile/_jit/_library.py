"""The contract a JIT library plugs into, the libraries served, and serving them.

A JIT library is served by one module of this package that defines:

* ``NAME``: the library's name in acompile (``serve(jits=("flashinfer",))``, counts, entries);
* ``MODULE``: the module whose import makes the library servable (its seams live there or
  below); nothing is imported before the program imports it;
* ``SUPPORTED``: the releases whose seams are tested, as text for messages and docs;
* ``install(builds) -> undo``: check the release and its seams (raise ``Unsupported`` with the
  reason where one is missing or changed), swap the library's ninja run for
  ``builds.run(Build(...), run_here, failed)``, and return a function that puts it back.

``builds.run`` does the rest (keys, tiers, fleet single flight, the pool's workers, products
written where the library loads them). A library whose builds are not ninja builds would add a
second kind of build beside ``_ninja.Build``; every library served so far writes a
``build.ninja``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING

from acompile._torch import after_import

if TYPE_CHECKING:
    from acompile._jit._builds import ServedBuilds

logger = logging.getLogger("acompile")

# Each served library, by name: the module of this package that serves it.
LIBRARIES: dict[str, str] = {
    "flashinfer": "acompile._jit._flashinfer",
    "cpp_extension": "acompile._jit._cpp_extension",
}
# The modules whose import starts serving a program served from outside (``acompile run``), as
# Inductor's compiler does for torch.compile: each library's ``MODULE``, written here too so
# that knowing them imports none of the modules above (a test checks that they agree).
TRIGGERS: tuple[str, ...] = ("flashinfer.jit.core", "torch.utils.cpp_extension")


class Unsupported(Exception):
    """A library release acompile cannot serve (a seam missing or changed); the text says which."""


class UnsupportedJitWarning(UserWarning):
    """Warned (once a process and library) where an installed JIT library's release cannot be
    served: that library then builds as it would without acompile."""


def check_names(names: Iterable[str] | None) -> tuple[str, ...]:
    """The libraries to serve: ``None`` for every one acompile serves; else each name checked
    (``ValueError`` naming the ones it knows)."""
    if names is None:
        return tuple(LIBRARIES)
    if isinstance(names, str):
        names = (names,)
    chosen = tuple(names)
    unknown = [n for n in chosen if n not in LIBRARIES]
    if unknown:
        raise ValueError(f"jits: unknown JIT libraries {unknown}; acompile serves {sorted(LIBRARIES)}")
    return chosen


def library(name: str) -> ModuleType:
    return importlib.import_module(LIBRARIES[name])


class JitServing:
    """The served JIT libraries of one ``serve()``: each installed as the program imports it,
    and put back when serving ends."""

    def __init__(self, builds: ServedBuilds, names: tuple[str, ...]) -> None:
        self.builds = builds
        self.names = names
        self.installed: dict[str, Callable[[], None]] = {}
        self.unsupported: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        for name in self.names:
            after_import(library(name).MODULE, functools.partial(self._install, name))

    def _install(self, name: str) -> None:
        with self._lock:
            if self._stopped or name in self.installed or name in self.unsupported:
                return
            try:
                self.installed[name] = library(name).install(self.builds)
            except Unsupported as exc:
                self.unsupported[name] = str(exc)
                warn_once(name, str(exc))
            except Exception as exc:  # never into the library's import
                self.unsupported[name] = f"{type(exc).__name__}: {exc}"
                logger.warning("acompile: %s is not served (%s: %s)", name, type(exc).__name__, exc)
            else:
                logger.info("acompile: serving %s's builds", name)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            installed, self.installed = self.installed, {}
        for undo in installed.values():
            undo()


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(name: str, reason: str) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"{reason}: {name} is not served by acompile and builds as it would without it",
        UnsupportedJitWarning,
        stacklevel=2,
    )
