"""The parts of Inductor that acompile serves through, found and checked once, and the patches
that put them in and take them out.

These are private API of torch: they move between releases. ``find()`` checks each one it needs
(that it exists, with the shape this code expects) on the torch it runs on, and refuses a torch
outside the range tested (``SUPPORTED``) or missing any of them: the caller then warns once and
leaves Inductor as it was. The seams:

* ``torch._inductor.remote_cache``: the five ``Remote*Cache`` classes and their
  ``backend_override_cls`` (every release since 2.6);
* the switches that turn those caches on: ``fx_graph_remote_cache``, ``autotune_remote_cache``,
  ``bundled_autotune_remote_cache`` (Inductor's config), ``enable_remote_autograd_cache``
  (functorch's), ``automatic_dynamic_remote_pgo`` (dynamo's), set as the process-wide default of
  each (its config entry's ``env_value_default``: torch 2.12 and later keep values set in code per
  thread, and torch.compile runs on threads of its own);
* ``torch._inductor.async_compile``: ``AsyncCompile.process_pool`` and ``use_process_pool``, and
  the module function ``get_compile_threads`` (consulted wherever Inductor decides to compile in
  parallel);
* ``torch._inductor.codecache._worker_compile_cpp(lock_path, builders)`` (2.8 and later) and
  ``torch._inductor.cpp_builder.CppBuilder.build``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acompile._torch._served import Served

# The torch releases this was tested on (inclusive): 2.8 is the first whose seams all have the
# shapes used here (a three-argument Triton job, _worker_compile_cpp over a list of builders).
SUPPORTED = ((2, 8), (2, 14))


class Unsupported(Exception):
    """This torch cannot be served (the message says why: its release, or the seam missing)."""


@dataclass(frozen=True)
class Seams:
    version: str
    remote_cache: ModuleType
    async_compile: ModuleType
    codecache: ModuleType
    cpp_builder: ModuleType
    inductor_config: Any
    functorch_config: Any
    dynamo_config: Any


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string (``"2.13.0+cpu"``), or None."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def find() -> Seams:
    """Import and check every seam; raises ``Unsupported``."""
    import torch

    version = str(torch.__version__)
    found = release(version)
    low, high = SUPPORTED
    if found is None or not low <= found <= high:
        raise Unsupported(
            f"torch {version} is outside the releases acompile serves "
            f"({low[0]}.{low[1]} to {high[0]}.{high[1]})"
        )
    try:
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._inductor import async_compile, codecache, cpp_builder, remote_cache
    except Exception as exc:
        raise Unsupported(f"torch {version}: cannot import Inductor ({type(exc).__name__}: {exc})") from exc
    seams = Seams(
        version,
        remote_cache,
        async_compile,
        codecache,
        cpp_builder,
        inductor_config,
        functorch_config,
        dynamo_config,
    )
    missing = [what for what, ok in _checks(seams) if not ok]
    if missing:
        raise Unsupported(f"torch {version} lacks what acompile serves through: {', '.join(missing)}")
    return seams


def _checks(s: Seams) -> list[tuple[str, bool]]:
    from acompile._torch._caches import KINDS

    checks = [
        (
            f"remote_cache.{name}.backend_override_cls",
            hasattr(getattr(s.remote_cache, name, None), "backend_override_cls"),
        )
        for name in KINDS
    ]
    checks.append(("remote_cache.RemoteCacheBackend", hasattr(s.remote_cache, "RemoteCacheBackend")))
    for config, names in (
        (
            s.inductor_config,
            ("fx_graph_remote_cache", "autotune_remote_cache", "bundled_autotune_remote_cache"),
        ),
        (s.functorch_config, ("enable_remote_autograd_cache",)),
        (s.dynamo_config, ("automatic_dynamic_remote_pgo",)),
    ):
        entries = getattr(config, "_config", {})
        checks += [
            (f"config.{name} (a default for every thread)", hasattr(entries.get(name), "env_value_default"))
            for name in names
        ]
    compiler = getattr(s.async_compile, "AsyncCompile", None)
    checks += [
        ("AsyncCompile.process_pool", callable(getattr(compiler, "process_pool", None))),
        ("AsyncCompile.use_process_pool", callable(getattr(compiler, "use_process_pool", None))),
        (
            "async_compile.get_compile_threads",
            callable(getattr(s.async_compile, "get_compile_threads", None)),
        ),
        (
            "codecache._worker_compile_cpp(lock_path, builders)",
            _parameters(s.codecache, "_worker_compile_cpp") == 2,
        ),
        (
            "cpp_builder.CppBuilder.build",
            callable(getattr(getattr(s.cpp_builder, "CppBuilder", None), "build", None)),
        ),
        ("codecache.LOCK_TIMEOUT", hasattr(s.codecache, "LOCK_TIMEOUT")),
    ]
    return checks


def _parameters(module: ModuleType, name: str) -> int:
    fn = getattr(module, name, None)
    try:
        return len(inspect.signature(fn).parameters) if callable(fn) else -1
    except (TypeError, ValueError):
        return -1


class Patches:
    """Attributes set on torch's modules and classes, each undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(owner, type) and name in owner.__dict__:
            old = owner.__dict__[name]  # the descriptor itself (a staticmethod stays one)
        else:
            old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def default(self, config: Any, name: str, value: Any) -> None:
        """A torch config's process-wide default: what every thread reads where the thread's
        own setting says nothing (torch 2.12 and later keep what code sets per thread, so a
        setting made here would not reach the thread that compiles). Where the environment
        set a default (``TORCHINDUCTOR_...``), this one replaces it while served."""
        entry = config._config[name]
        old = entry.env_value_default
        entry.env_value_default = value
        self._undo.append(lambda: setattr(entry, "env_value_default", old))

    def call(self, undo: Callable[[], None]) -> None:
        """Something to run when the patches are undone."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def gpu_backend() -> bool:
    """Whether Triton has a GPU backend here (Inductor's autotune caches are keyed by its hash,
    and its bundled autotune cache fails a compile on a machine without one)."""
    try:
        from torch.utils._triton import triton_hash_with_backend

        return isinstance(triton_hash_with_backend(), str)
    except Exception:
        return False


def pgo_job() -> bool:
    """Whether dynamo's remote PGO cache has a job to key its entries by (it does nothing
    without one)."""
    try:
        import torch.compiler.config as compiler_config

        return bool(getattr(compiler_config, "job_id", None)) or bool(os.environ.get("TORCH_COMPILE_JOB_ID"))
    except Exception:
        return False


def install(seams: Seams, served: Served) -> Patches:
    """Serve Inductor through ``served`` until the returned patches are undone."""
    from acompile._torch import _caches
    from acompile._torch._jobs import ServedProcessPool
    from acompile._torch._served import SERVED_SUFFIXES

    patches = Patches()
    # The caches: every remote cache over acompile's tiers, and every one switched on (the
    # bundled autotune cache only where Triton has a GPU backend; PGO's only with a job id).
    for name, kind in _caches.KINDS.items():
        patches.set(getattr(seams.remote_cache, name), "backend_override_cls", _caches.backend_class(kind))
    switches = [
        (seams.inductor_config, "fx_graph_remote_cache", True),
        (seams.inductor_config, "autotune_remote_cache", True),
        (seams.inductor_config, "bundled_autotune_remote_cache", gpu_backend()),
        (seams.functorch_config, "enable_remote_autograd_cache", True),
        (seams.dynamo_config, "automatic_dynamic_remote_pgo", pgo_job()),
    ]
    for config, name, on in switches:
        if on:
            patches.default(config, name, True)
    # Inductor keeps its AOTAutograd remote cache for the process (made before serving: none).
    aot_cache = _aot_remote_cache()
    if aot_cache is not None:
        aot_cache.cache_clear()
        patches.call(aot_cache.cache_clear)
    _caches.activate(served)
    patches.call(lambda: _caches.activate(None))

    # Triton compiles: on the pool, also where the engine set compile_threads=1.
    compiler = seams.async_compile.AsyncCompile
    from torch._inductor.runtime import compile_tasks

    triton_job = getattr(compile_tasks, "_worker_compile_triton", None)
    executor = ServedProcessPool(served, getattr(compiler, "_get_ready", None), triton_job)
    threads = seams.async_compile.get_compile_threads

    def process_pool() -> Any:
        return executor

    # Inductor clears its pool's cache at a fork and at shutdown_compile_workers(): a no-op here.
    process_pool.cache_clear = lambda: None  # type: ignore[attr-defined]
    patches.set(compiler, "process_pool", staticmethod(process_pool))
    patches.set(compiler, "use_process_pool", staticmethod(lambda *_: served.parallel()))
    patches.set(seams.async_compile, "get_compile_threads", lambda: max(threads(), served.host.size, 2))

    # C++ builds: outputs from the tiers, builds on the pool.
    compile_cpp = seams.codecache._worker_compile_cpp
    builder_class = seams.cpp_builder.CppBuilder
    build = builder_class.build

    def build_locally(builders: Any) -> None:
        for builder in builders:
            if not os.path.exists(builder.get_target_file_path()):
                build(builder)

    def served_compile_cpp(lock_path: str, cpp_builders: Any, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs or not isinstance(cpp_builders, (list, tuple)) or not cpp_builders:
            return compile_cpp(lock_path, cpp_builders, *rest, **kwargs)
        served.build(lock_path, cpp_builders, build_locally)
        return None

    def served_build(builder: Any) -> None:
        # Direct callers (the vector-ISA probes): the output from the tiers, else built here.
        if served.fetch_output([builder]):
            return
        build(builder)
        if builder.get_target_file_path().endswith(SERVED_SUFFIXES):
            served.count("cpp_local_builds")  # a probe's library (not a header's preprocessing)
        served.publish_output([builder])

    patches.set(seams.codecache, "_worker_compile_cpp", served_compile_cpp)
    patches.set(builder_class, "build", served_build)
    return patches


def _aot_remote_cache() -> Any:
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    except ImportError:
        return None
    getter = AOTAutogradCache.__dict__.get("get_remote_cache")
    fn = getattr(getter, "__func__", getter)
    return fn if hasattr(fn, "cache_clear") else None
