"""Serving a program that knows nothing of acompile: ``acompile run -- python serve.py``.

``acompile run`` puts the serving options in ``ACOMPILE_SERVE_TORCH`` (JSON: ``serve()``'s
keyword arguments) and runs the command. acompile registers an extension of torch (the entry
point group ``torch.backends``, which torch loads as it is imported, since 2.5): the module
``_acompile_autoload``, outside this package, which imports nothing more where the variable is
not set. Where it is, it imports ``acompile.inductor`` and calls ``autoload`` here: in every
Python process of that command that imports torch, it waits for Inductor's compiler to be
imported (``torch._inductor.compile_fx``, the first thing any torch.compile or engine does with
Inductor), then serves torch.compile for the rest of the process.

It never fails the import of torch (torch would fail with it): any problem is one warning, and
the process runs as it would without acompile. It does nothing in acompile's own workers, or in
Inductor's compile workers.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV = "ACOMPILE_SERVE_TORCH"
# Imported by every path into Inductor's compiler (torch.compile's backend, vLLM's and SGLang's
# own compile passes, AOT compilation), after codecache and async_compile.
TRIGGER = "torch._inductor.compile_fx"

logger = logging.getLogger("acompile")
_started = threading.Event()
_start_lock = threading.Lock()
# What serves torch.compile: ``acompile.inductor.serve``, which ``acompile.inductor`` hands in
# as it is imported (``serve_with``): it is the layer above this one, which this module does not
# import. It is always here by the time ``autoload`` runs: the entry point imports
# ``acompile.inductor`` first.
_serve_torch: Callable[..., Any] | None = None
_triggers: tuple[str, ...] = ()


def serve_with(serve: Callable[..., Any], triggers: Sequence[str] = ()) -> None:
    """Serve torch.compile with ``serve`` (``acompile.inductor.serve``) once the variable asks;
    ``triggers``: further modules whose import starts serving (other JIT libraries' build
    modules: a program may build a FlashInfer module before Inductor's compiler is imported)."""
    global _serve_torch, _triggers
    _serve_torch = serve
    _triggers = tuple(triggers)


def autoload() -> None:
    """torch's extension entry point: called once, as torch is imported. Never raises."""
    try:
        text = os.environ.get(ENV)
        if not text or os.environ.get("ACOMPILE_WORKER") == "1" or _in_inductor_worker():
            return
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"{ENV} must hold a JSON object of serve() options, got {text[:80]!r}")
        from acompile._cache import with_shared_cache_fields

        options = with_shared_cache_fields(options)
        for name in (TRIGGER, *_triggers):
            after_import(name, lambda: _serve(options))
    except Exception as exc:
        logger.warning("acompile: not serving torch.compile in this process (%s)", exc)


class _OnePrefix(logging.Formatter):
    """acompile's own messages start "acompile: " (for a log that mixes libraries); the lines of
    ``acompile run -v`` say it already, with the process."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        return text.replace("]: acompile: ", "]: ", 1)


def _in_inductor_worker() -> bool:
    """Inductor's own compile workers import torch too (with this process's environment)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return any("torch._inductor.compile_worker" in arg for arg in argv)


def _serve(options: dict[str, Any]) -> None:
    # Several imports may start serving (Inductor's compiler, a JIT library's), on two threads
    # at once: one serves.
    with _start_lock:
        if _started.is_set():
            return
        _started.set()
    verbose = os.environ.get("ACOMPILE_RUN_VERBOSE") == "1"
    if verbose and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_OnePrefix(f"acompile [pid {os.getpid()}]: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        if _serve_torch is None:
            raise RuntimeError("acompile.inductor was not imported, and it is what serves")
        serving = _serve_torch(**options)
        serving.__enter__()
    except Exception as exc:
        logger.warning("acompile: not serving torch.compile in this process (%s)", exc)
        return
    if verbose:
        logger.info(
            "serving torch.compile (pool cache folder %s)", serving.pool.cache_dir if serving.pool else "-"
        )

    def leave() -> None:
        # The pool's writes reach the tiers before the process ends (bounded), its workers go.
        serving.__exit__(None, None, None)
        if verbose:
            stats = serving.stats()
            graphs = stats.get("caches", {}).get("fx-graph", {})
            cpp = stats.get("cpp", {})
            logger.info(
                "served: graphs %s read (hits %s), %s written; C++ outputs %s from the tiers, %s built "
                "(%s on the pool, %s here), %s published; %s compile jobs on the pool",
                graphs.get("gets", 0),
                graphs.get("hits"),
                graphs.get("puts", 0),
                sum(cpp.get("hits", {}).values()),
                cpp.get("builds", 0) + cpp.get("local_builds", 0),
                cpp.get("builds", 0),
                cpp.get("local_builds", 0),
                cpp.get("puts", 0),
                stats.get("jobs", {}).get("sent", 0),
            )
            for library, counts in sorted(stats.get("jit", {}).items()):
                logger.info(
                    "served %s: modules from the tiers %s, built on the pool %s, built here %s",
                    library,
                    sum(counts.get("hits", {}).values()),
                    counts.get("builds", 0),
                    counts.get("local_builds", 0) + counts.get("in_process", 0),
                )

    atexit.register(leave)


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` once module ``name`` has been imported (now, if it has been), and once
    every import under way in that thread has ended: on that thread, as the outermost import
    ends (``import flashinfer`` has finished, and everything it imported with it). Never while
    a module is half made: the callbacks start a pool whose threads import, and the caller waits
    for them. Several callbacks may wait for one module (torch.compile's serving and a JIT
    library's), called in the order they came."""
    with _waiting_lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(callback)
            _enter_finder()
            return
        if _initializing(module):
            # Being imported right now, further up this very stack (FlashInfer's ``jit.core``
            # imports torch, whose import calls ``autoload``), or in another thread.
            if _at_end_of_imports([(name, callback)], name):
                return
            # In another thread: at the end of the first import after it has finished.
            _finishing.setdefault(name, []).append(callback)
            _enter_finder()
            return
    _call([callback])


class _EndOfImport(importlib.machinery.ModuleSpec):
    """The spec of the outermost import under way in a thread, while callbacks wait for its end:
    importlib marks a spec done (``_initializing = False``) as the last thing it does to import
    it, the module in ``sys.modules`` (or taken out again, where its code raised)."""

    def __setattr__(self, attr: str, value: object) -> None:
        object.__setattr__(self, attr, value)
        if attr != "_initializing" or value:
            return
        waiting: list[tuple[str, Callable[[], None]]] = self.__dict__.pop("_acompile_waiting", [])
        object.__setattr__(self, "__class__", importlib.machinery.ModuleSpec)
        leaving = sys.exc_info()[1]
        if leaving is not None and not isinstance(leaving, Exception):
            return  # Ctrl-C, SystemExit: the process is leaving, nothing is started
        ready = []
        for name, callback in waiting:
            module = sys.modules.get(name)
            if module is not None and not _initializing(module):
                ready.append(callback)
            elif module is None:  # its import raised: served if a later one succeeds
                with _waiting_lock:
                    _waiting.setdefault(name, []).append(callback)
                    _enter_finder()
        _call(ready)


def _at_end_of_imports(callbacks: list[tuple[str, Callable[[], None]]], under_way: str | None) -> bool:
    """Queue ``callbacks`` (each with the module it waits for) for the end of the outermost
    import under way in this thread; False where there is none (or, with ``under_way``, where
    no import of that module is under way in this thread)."""
    frame: Any = sys._getframe(1)
    outermost = None
    found = under_way is None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_load_unlocked" and code.co_filename == "<frozen importlib._bootstrap>":
            spec = frame.f_locals.get("spec")
            # An import still running (not one in its last steps, not a legacy loader's).
            if (
                isinstance(spec, importlib.machinery.ModuleSpec)
                and getattr(spec, "_initializing", False) is True
            ):
                outermost = spec
                found = found or spec.name == under_way
        frame = frame.f_back
    if outermost is None or not found:
        return False
    if type(outermost) is importlib.machinery.ModuleSpec:
        try:
            outermost.__class__ = _EndOfImport
        except TypeError:
            return False
    elif type(outermost) is not _EndOfImport:
        return False  # a spec class of another finder's: not one to change
    outermost.__dict__.setdefault("_acompile_waiting", []).extend(callbacks)
    return True


def _initializing(module: ModuleType) -> bool:
    """Whether the module's code is still running (an import under way)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _call(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception as exc:  # never into the import
            logger.warning("acompile: not serving in this process (%s)", exc)


def _enter_finder() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _leave_if_done() -> None:
    """Take the finder out once nothing waits (a new list: another thread may be importing)."""
    if not _waiting and not _finishing and _FINDER in sys.meta_path:
        sys.meta_path = [f for f in sys.meta_path if f is not _FINDER]


# Callbacks waiting for a module's import, by the module's name; and for the end of an import
# under way in another thread when they came.
_waiting: dict[str, list[Callable[[], None]]] = {}
_finishing: dict[str, list[Callable[[], None]]] = {}
_waiting_lock = threading.Lock()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lends the real spec of a module that callbacks wait for a loader
    that queues them, once the module has run, for the end of the imports under way."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        # (The import system holds its global lock while it asks finders: callbacks, which start
        # threads that import, never run here.)
        with _waiting_lock:
            finished = [
                n
                for n, m in ((n, sys.modules.get(n)) for n in _finishing)
                if m is None or not _initializing(m)
            ]
            if fullname not in _waiting and not finished:
                return None
        for finder in sys.meta_path:
            if isinstance(finder, _AfterImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if not isinstance(loader, _FILE_LOADERS):
            # A loader of many modules (builtin, frozen, a zip's): not one to change. A module
            # waited for is a file's; the end of another import is waited for at the next one.
            return spec if fullname in _waiting else None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            with _waiting_lock:
                callbacks = [(n, c) for n in finished for c in _finishing.pop(n, [])]
                callbacks += [(fullname, c) for c in _waiting.pop(fullname, [])]
                _leave_if_done()
            # This module's own import is under way (its spec is the outermost one where nothing
            # else is): the callbacks run as the outermost one ends.
            if callbacks and not _at_end_of_imports(callbacks, None):
                _call([c for _, c in callbacks])

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _AfterImport()
# Loaders of one module each, which a wrapped exec_module changes for that module alone.
_FILE_LOADERS = (
    importlib.machinery.SourceFileLoader,
    importlib.machinery.SourcelessFileLoader,
    importlib.machinery.ExtensionFileLoader,
)
