"""The worker half of the served torch.compile: Inductor's own compile functions (its Triton
compile, a C++ build), run in a pool worker as Inductor's own compile workers run them.

A payload is a pickle of ``(function, args, kwargs, environment, context)`` made by the process
that owns the pool (``_served.Served.encode_job``), sent on the pool's private pipe; the reply is
``("ok", value)`` or ``("error", exception or None, traceback)``, pickled, for that process alone.
The environment is the submitting process's view of what the function reads (Triton's and
Inductor's cache folders): a worker's own differs (acompile's Triton backend gives each worker a
private Triton cache), and Inductor's result must land where Inductor looks for it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import sys
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acompile._workers import WorkerConfig

# Math libraries start thread pools when they load (OpenBLAS with numpy, which torch imports):
# a template with a second thread cannot fork its workers. Compiling needs none of them.
_QUIET_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_applied: dict[str, Any] = {}


def setup(config: WorkerConfig) -> None:
    for name in _QUIET_THREADS:
        os.environ.setdefault(name, "1")
    if "torch._inductor.runtime.compile_tasks" in sys.modules:
        # A worker just forked from the template (which preloaded the rest): before it says
        # it is ready, not in its first job.
        _import_heuristics()


def _import_heuristics() -> None:
    """Inductor's Triton heuristics, which every Triton job loads: their import asks torch
    whether CUDA is available, which starts a driver thread, so never in the template."""
    with contextlib.suppress(ImportError):
        import torch._inductor.runtime.triton_heuristics  # noqa: F401


def preload(config: WorkerConfig) -> None:
    """Import what a job runs: torch, and Inductor's compile functions and code cache; in the
    template, not Inductor's Triton heuristics (a template with a second thread cannot fork its
    workers: each forked worker imports them in its ``setup``, before it is ready)."""
    import torch
    import torch._inductor.codecache  # noqa: F401
    from torch._inductor.runtime import compile_tasks

    # As Inductor's own compile workers do first thing: Triton's ptxas is torch's where torch
    # ships one. Triton settles its ptxas at its first use in a process, and a worker whose
    # Triton used its own builds other cubins (under other cache keys) than Inductor's.
    set_ptxas = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if set_ptxas is not None:
        set_ptxas()
    if "--template" not in sys.argv:  # a worker started afresh: it forks nothing
        _import_heuristics()
    _install_readers(config.get("torch_cache_root"))


def compile(payload: bytes) -> bytes:
    fn, args, kwargs, env, context = pickle.loads(payload)
    _apply(context)
    try:
        with _environment(env):
            value = fn(*args, **kwargs)
    except Exception as exc:
        return _error(exc)
    try:
        return pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # a result that does not pickle: say so, as Inductor's pool would
        return _error(exc)


def _error(exc: BaseException) -> bytes:
    text = traceback.format_exc()
    try:
        return pickle.dumps(("error", exc, text), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps(("error", None, text), protocol=pickle.HIGHEST_PROTOCOL)


def _apply(context: dict[str, Any]) -> None:
    """What every job of a served pool carries, applied once per worker: torch's key (a hash
    of torch's sources the parent computed; ~1 s to compute again) and the cache folder whose
    entries Inductor's caches read here."""
    key = context.get("torch_key")
    if key and _applied.get("torch_key") != key:
        from torch._inductor import codecache

        setter = getattr(codecache.torch_key, "set", None)
        if setter is not None:
            setter(key if isinstance(key, bytes) else base64.b64decode(key))
        _applied["torch_key"] = key
    root = context.get("cache_root")
    if root and _applied.get("cache_root") != root:
        _install_readers(root)
        _applied["cache_root"] = root


@contextlib.contextmanager
def _environment(env: dict[str, str | None]) -> Iterator[None]:
    """The submitting process's environment for the job (None: unset there), and Triton's
    settings as a fresh process has them; this worker's own, after."""
    saved = {name: os.environ.get(name) for name in env}
    with contextlib.ExitStack() as stack:
        try:
            from triton import knobs

            # Triton's settings follow the environment unless set in code (acompile's Triton
            # backend sets the cache folder and always_compile in code, for its own jobs).
            for group in (knobs.cache, knobs.compilation):
                stack.enter_context(group.scope())
                group.reset()
        except (ImportError, AttributeError):
            pass
        try:
            for name, value in env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _install_readers(root: str | None) -> None:
    """Inductor's autotune cache asks its remote tier from the compile worker (with a parallel
    compile, the worker loads the kernel): here that tier is the pool's disk tier, read-only
    (the parent process writes; the shared tier's entries reach the disk through it)."""
    if not root:
        return
    try:
        from torch._inductor import remote_cache
    except ImportError:
        return
    from acompile._torch import _caches

    reader = _caches.disk_reader(root)
    for cls_name, kind in _caches.KINDS.items():
        cls = getattr(remote_cache, cls_name, None)
        if cls is not None and hasattr(cls, "backend_override_cls"):
            cls.backend_override_cls = _caches.backend_class(kind, reader)


def one_config(load_kernel: Any, index: int) -> Any:
    """Inductor's kernel loader, restricted to config ``index`` (a fanned-out job: Inductor's own
    compile function then compiles that config alone into Triton's cache)."""
    kernel = load_kernel()
    kernel.configs = kernel.configs[index : index + 1]
    return kernel
