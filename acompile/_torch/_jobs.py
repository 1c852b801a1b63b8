"""The process pool Inductor submits its compile jobs to while served.

Inductor's ``AsyncCompile`` sends each Triton kernel to ``process_pool().submit(
_worker_compile_triton, load_kernel, extra_env, extra_config)`` (two, three or four arguments
depending on the torch release; this takes whatever comes) and waits on the future it gets. While
served, ``process_pool()`` is this executor: each job runs Inductor's own function on a pool
worker, so the kernels are the ones Inductor would have built, in the Triton cache Inductor
reads, with acompile's containment (a killed worker costs a retry of its job), cancellation,
quiesce and traces.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from acompile._torch._served import Served


class ServedProcessPool(concurrent.futures.Executor):
    """What ``AsyncCompile.process_pool()`` returns while served."""

    def __init__(
        self,
        served: Served,
        ready_probe: Callable[..., Any] | None = None,
        triton_job: Callable[..., Any] | None = None,
    ) -> None:
        self._served = served
        # Inductor asks its pool whether it is warm with a no-op job; the pool answers at once.
        self._ready_probe = ready_probe
        # Inductor's Triton compile job (compile_tasks._worker_compile_triton): fanned out.
        self._triton_job = triton_job

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if fn is self._ready_probe:
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(fn(*args, **kwargs))
            return done
        name = job_name(fn, args)
        future = self._served.submit_job(fn, args, kwargs, name, raw_errors=False)
        if fn is self._triton_job and args and not future.done():
            self._served.fan_out(fn, args, kwargs, name)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The pool's own life is its owner's (``async with``), not Inductor's."""

    # Inductor's SubprocPool has these; callers that find them on the pool they got call them.
    def wakeup(self) -> None:
        """The pool's workers start on demand."""

    def quiesce(self) -> None:
        """Quiescing is the pool's owner's: ``await pool.quiesce()``."""


def job_name(fn: Callable[..., Any], args: Sequence[Any]) -> str:
    """A job's name for errors, stats and traces: the kernel's, where the job names it (a
    kernel name, or a ``functools.partial`` of a loader whose first argument is one)."""
    if args:
        first = args[0]
        if isinstance(first, str):
            return first
        inner = getattr(first, "args", None)
        if isinstance(inner, tuple) and inner and isinstance(inner[0], str):
            return inner[0]
    return str(getattr(fn, "__name__", "inductor job"))
