"""Progressive and background compiles: a handle now, a kernel when it lands.

``progressive(host, fast_spec, best_spec)`` compiles two versions of a kernel at once: a quick
one as an urgent job and a tuned one in the background lane; its handle launches the fast kernel
as soon as it exists and the best one once it lands. ``background(host, spec, fallback)`` runs
eager code until its kernel is compiled, then the kernel. Both return at once and never block a
launch on a compile.

``host`` is what they need from the pool, handed over by it (``ProgressiveHost``): they reach into nothing
else. Everything they start runs in the pool's own task group: leaving ``async with CompilePool()``
cancels compiles still pending, and their handles record ``PoolClosedError`` (keeping whatever
they launch already).

Thread safety: the compile tasks write a handle only from the event loop's thread, and a swap is
one reference assignment (a tuple of stage and kernel), so a launch from any thread sees either
the old pair or the new one, never a mix. Launch counters take a lock.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from acompile._errors import KernelNotReadyError, PoolClosedError

__all__ = (
    "BackgroundKernel",
    "KernelNotReadyError",
    "ProgressiveHost",
    "ProgressiveKernel",
    "background",
    "progressive",
)

logger = logging.getLogger("acompile")


@dataclass(frozen=True)
class ProgressiveHost:
    """What progressive and background compiles need from a running pool, which hands it over.

    Attributes:
        compile_with_tier: ``await compile_with_tier(spec, background=...)`` -> (kernel, tier).
        start_soon: starts ``fn(*args)`` in the pool's task group (nothing outlives the pool).
        check_spec: raises ``TypeError`` for something that is not a compile spec.
    """

    compile_with_tier: Callable[..., Awaitable[tuple[Any, str]]]
    start_soon: Callable[..., object]
    check_spec: Callable[[Any], object]


class ProgressiveKernel:
    """A kernel that gets better while it is in use; made by ``progressive()``.

    Attributes:
        kernel: ``None`` until a kernel exists, then the fast kernel, then the best one. Read it
            afresh at each launch (or launch through ``handle[grid]``): it is replaced, never
            mutated.
        stage: ``"pending"`` (no kernel yet), ``"fast"``, ``"best"``, or ``"failed"`` (no
            kernel will come: both compiles failed, or the pool shut down first).
        fast_error, best_error: the exception of each compile that failed, else ``None``. A fast
            compile that was still running when the best kernel landed is stopped, without error.

    ``handle[grid](*args, **kwargs)`` launches whichever kernel is current when it is called
    (the launcher returned by ``handle[grid]`` may be kept: each call looks again) and counts
    the launch by stage in ``stats()``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # One reference holds the pair, so that a reader never sees the best stage with the fast
        # kernel (or the reverse): the swap is this single assignment.
        self._current: tuple[str, Any] = ("pending", None)
        self.fast_error: BaseException | None = None
        self.best_error: BaseException | None = None
        self._started = time.monotonic()
        self._seconds: dict[str, float] = {}
        self._tiers: dict[str, str] = {}
        self._fast_done = anyio.Event()
        self._best_done = anyio.Event()
        self._settled = anyio.Event()  # a kernel exists, or none will
        self._fast_scope = anyio.CancelScope()
        self._best_kernel: Any = None
        self._warned = False
        self._lock = threading.Lock()
        self._launches = {"fast": 0, "best": 0, "not_ready": 0}

    def __repr__(self) -> str:
        return f"<ProgressiveKernel {self.name} stage={self.stage}>"

    @property
    def kernel(self) -> Any:
        return self._current[1]

    @property
    def stage(self) -> str:
        return self._current[0]

    async def ready(self) -> Any:
        """Wait until a kernel exists and return it (the fast one, or the best one if it came
        first or the fast compile failed).

        Raises the fast compile's error (a copy) if neither compile produced a kernel:
        ``CompileError``, ``InvalidSpecError``, or ``PoolClosedError`` when the pool shut down.
        """
        await self._settled.wait()
        kernel = self._current[1]
        if kernel is None:
            error = self.fast_error or self.best_error
            assert error is not None
            raise copy.copy(error)
        return kernel

    async def best(self) -> Any:
        """Wait for the best kernel and return it.

        Raises its compile's error (a copy) if it failed; the fast kernel, if any, then stays in
        use. The best compile stays in the background lane while this waits; to move it ahead
        of other background work, ``await pool.compile(best_spec)`` joins the same compile.
        """
        await self._best_done.wait()
        if self.best_error is not None:
            raise copy.copy(self.best_error)
        return self._best_kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            stage, kernel = self._current
            if kernel is None:
                with self._lock:
                    self._launches["not_ready"] += 1
                raise self._not_ready(stage)
            result = kernel[grid](*args, **kwargs)
            with self._lock:
                self._launches[stage] += 1
            return result

        return launch

    def _not_ready(self, stage: str) -> KernelNotReadyError:
        if stage == "failed":
            return KernelNotReadyError(
                f"{self.name}: no kernel to launch, both compiles failed "
                f"(fast: {_first_line(self.fast_error)}; best: {_first_line(self.best_error)})"
            )
        return KernelNotReadyError(
            f"{self.name}: no kernel yet, both compiles are pending; `await handle.ready()` before "
            "the first launch"
        )

    def stats(self) -> dict[str, Any]:
        """Launches by stage and what became of each compile, as plain data.

        ``fast_launches``, ``best_launches``; ``not_ready_launches``: launches refused because no
        kernel existed. ``fast_seconds``, ``best_seconds``: when each kernel landed, in seconds
        after ``progressive()`` (``None`` until then); ``fast_tier``, ``best_tier``: where it came
        from (``"memory"``, ``"disk"``, ``"shared"``, ``"compile"``).
        """
        with self._lock:
            launches = dict(self._launches)
        return {
            "stage": self.stage,
            "fast_launches": launches["fast"],
            "best_launches": launches["best"],
            "not_ready_launches": launches["not_ready"],
            "fast_seconds": self._seconds.get("fast"),
            "best_seconds": self._seconds.get("best"),
            "fast_tier": self._tiers.get("fast"),
            "best_tier": self._tiers.get("best"),
            "fast_error": _first_line(self.fast_error) if self.fast_error else None,
            "best_error": _first_line(self.best_error) if self.best_error else None,
        }

    # -- the compile tasks (in the pool's task group, on the loop's thread) ----------------------

    async def _compile(self, host: ProgressiveHost, spec: Any, stage: str) -> None:
        scope = self._fast_scope if stage == "fast" else anyio.CancelScope()
        try:
            with scope:
                kernel, tier = await host.compile_with_tier(spec, background=stage == "best")
                self._land(stage, kernel, tier)
                return
            # Only the fast compile is cancelled by its own scope: the best kernel landed first.
            self._fail(stage, None)
        except anyio.get_cancelled_exc_class():
            # Only the pool cancels these tasks, and only when it shuts down.
            self._fail(stage, PoolClosedError(f"the pool shut down before the {stage} compile finished"))
            raise
        except Exception as exc:
            # Recorded on the handle, never raised: an exception here would tear down the pool.
            self._fail(stage, exc)

    def _land(self, stage: str, kernel: Any, tier: str) -> None:
        self._seconds[stage] = time.monotonic() - self._started
        self._tiers[stage] = tier
        if stage == "best":
            self._best_kernel = kernel
            self._current = ("best", kernel)
            self._best_done.set()
            # The fast kernel would only be replaced at once: stop its compile if it still runs
            # (the compile goes on if another caller waits for it).
            self._fast_scope.cancel()
        else:
            if self._current[0] != "best":
                self._current = ("fast", kernel)
            self._fast_done.set()
        self._settled.set()

    def _fail(self, stage: str, error: BaseException | None) -> None:
        closed = isinstance(error, PoolClosedError)
        if stage == "best":
            self.best_error = error
            self._best_done.set()
            if not closed and not self._warned:
                self._warned = True
                now = self.stage
                outcome = (
                    "the fast kernel stays in use"
                    if now == "fast"
                    else "the fast kernel will be used when it lands"
                    if not self._fast_done.is_set()
                    else "no kernel is left to launch"
                )
                logger.warning("%s: the best compile failed (%s); %s", self.name, _first_line(error), outcome)
        else:
            self.fast_error = error
            self._fast_done.set()
            if error is not None and not closed:
                logger.debug("%s: the fast compile failed (%s)", self.name, _first_line(error))
        if self._fast_done.is_set() and self._best_done.is_set() and self._current[1] is None:
            self._current = ("failed", None)
            self._settled.set()


class BackgroundKernel:
    """Eager code now, a compiled kernel once it is ready; made by ``background()``.

    ``bk[grid](*args, **kwargs)`` calls ``fallback(*args, **kwargs)`` (the grid is the kernel's
    business, not the fallback's) until the kernel is ready, then ``kernel[grid](*args,
    **kwargs)``, and returns what it returns. It never waits for the compile. Give the fallback
    the kernel's runtime arguments and the same effect (writing the output buffer the kernel
    writes), so that callers cannot tell which one ran.

    Attributes:
        kernel: ``None`` until the compile lands, then the kernel.
        ready: whether calls go to the kernel now.
        error: the compile's exception if it failed (the fallback then stays for good; one
            warning is logged), ``PoolClosedError`` if the pool shut down first, else ``None``.
        fallback: the eager callable.
    """

    def __init__(self, name: str, fallback: Callable[..., Any]) -> None:
        self.name = name
        self.fallback = fallback
        self.kernel: Any = None
        self.error: BaseException | None = None
        self._started = time.monotonic()
        self._seconds: float | None = None
        self._tier: str | None = None
        self._done = anyio.Event()
        self._lock = threading.Lock()
        self._calls = {"fallback": 0, "kernel": 0}

    def __repr__(self) -> str:
        state = "ready" if self.ready else "failed" if self.error is not None else "pending"
        return f"<BackgroundKernel {self.name} {state}>"

    @property
    def ready(self) -> bool:
        return self.kernel is not None

    async def wait(self) -> Any:
        """Wait for the compile and return the kernel; raises its error (a copy) if it failed,
        or ``PoolClosedError`` if the pool shut down first. Calls never need this: they use the
        fallback meanwhile."""
        await self._done.wait()
        if self.error is not None:
            raise copy.copy(self.error)
        return self.kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            kernel = self.kernel  # read once: a swap between check and call cannot mix them
            if kernel is None:
                result = self.fallback(*args, **kwargs)
                which = "fallback"
            else:
                result = kernel[grid](*args, **kwargs)
                which = "kernel"
            with self._lock:
                self._calls[which] += 1
            return result

        return call

    def stats(self) -> dict[str, Any]:
        """``ready``, ``fallback_calls``, ``kernel_calls``; ``seconds``: when the kernel landed,
        after ``background()``; ``tier``: where it came from; ``error``: its first line."""
        with self._lock:
            calls = dict(self._calls)
        return {
            "ready": self.ready,
            "fallback_calls": calls["fallback"],
            "kernel_calls": calls["kernel"],
            "seconds": self._seconds,
            "tier": self._tier,
            "error": _first_line(self.error) if self.error is not None else None,
        }

    async def _compile(self, host: ProgressiveHost, spec: Any) -> None:
        try:
            kernel, tier = await host.compile_with_tier(spec, background=True)
        except anyio.get_cancelled_exc_class():
            self.error = PoolClosedError("the pool shut down before the background compile finished")
            self._done.set()
            raise
        except Exception as exc:
            self.error = exc
            self._done.set()
            logger.warning(
                "%s: the background compile failed (%s); the fallback stays in use",
                self.name,
                _first_line(exc),
            )
            return
        self._seconds = time.monotonic() - self._started
        self._tier = tier
        self.kernel = kernel
        self._done.set()


def progressive(host: ProgressiveHost, fast_spec: Any, best_spec: Any) -> ProgressiveKernel:
    """Compile a quick version and a tuned version of a kernel; return a handle at once.

    The fast spec is compiled as an urgent job, the best one in the background lane (behind work
    someone waits for). The handle's ``kernel`` is the fast kernel as soon as it exists and the
    best one once it lands; if the fast compile fails, the best kernel is used when it comes; if
    the best one fails, the fast one stays (one warning is logged). See ``ProgressiveKernel``.

    Call it from the event loop's thread, inside ``async with pool`` (the pool checks that it
    runs before it hands ``host`` over). Both compiles run in the pool's task group: leaving the
    pool cancels them (the handle records ``PoolClosedError``).

    Raises:
        TypeError: a spec is not a compile spec.
        RuntimeError: called outside the event loop's thread.

    Errors of the compiles themselves (``CompileError``, ``InvalidSpecError``) are not raised
    here: they are recorded on the handle and raised by ``ready()`` / ``best()``.
    """
    _check_call(host, fast_spec, best_spec)
    handle = ProgressiveKernel(_spec_name(best_spec))
    # Fast first: with one free worker, the urgent job is queued before the background one.
    host.start_soon(handle._compile, host, fast_spec, "fast")
    host.start_soon(handle._compile, host, best_spec, "best")
    return handle


def background(host: ProgressiveHost, spec: Any, fallback: Callable[..., Any]) -> BackgroundKernel:
    """Compile spec in the background lane; return at once a ``BackgroundKernel`` that runs
    ``fallback`` until the kernel is ready, then the kernel (see there). It never blocks.

    Call it from the event loop's thread, inside ``async with pool`` (the pool checks that it
    runs before it hands ``host`` over). The compile runs in the pool's task group: leaving the
    pool cancels it, and the fallback stays in use.

    Raises:
        TypeError: spec is not a compile spec, or fallback is not callable.
        RuntimeError: called outside the event loop's thread.

    A compile that fails is not raised here: the fallback stays, ``.error`` holds it, and
    ``await wait()`` raises it.
    """
    if not callable(fallback):
        raise TypeError(
            f"fallback must be callable (eager code taking the kernel's arguments), got {fallback!r}"
        )
    _check_call(host, spec)
    bk = BackgroundKernel(_spec_name(spec), fallback)
    host.start_soon(bk._compile, host, spec)
    return bk


def _check_call(host: ProgressiveHost, *specs: Any) -> None:
    try:
        anyio.get_current_task()
    except RuntimeError:
        # Starting a task from another thread would corrupt the loop, not fail cleanly.
        raise RuntimeError(
            "call this from the event loop's thread (from a worker thread: anyio.from_thread.run_sync)"
        ) from None
    for spec in specs:
        host.check_spec(spec)  # TypeError now, at the caller's line, rather than on the handle later


def _spec_name(spec: Any) -> str:
    name = getattr(spec, "kernel_name", None) or getattr(spec, "name", None)
    if not name:
        fn = getattr(spec, "fn", None)
        name = getattr(fn, "__name__", None)
    return str(name) if name else type(spec).__name__


def _first_line(error: BaseException | None) -> str:
    if error is None:
        return "none"
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
