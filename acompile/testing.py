"""Helpers for tests that drive a ``CompilePool``: run a job of your own worker-side module, and
step in before each job reaches a worker.

``import acompile.testing`` (importing acompile does not import it). Two things, each through a
seam the pool offers anyway, none through its private attributes:

* ``run_job(pool, module, payload, name)`` runs one job of a worker-side module (a fake backend
  whose ``compile(payload)`` does what the test needs: sleep, crash, return its pid) on the
  pool's workers, as a request's compile runs, and returns its result;
* ``Interposed(inner, before)`` is an executor spec, handed in as ``CompilePool(workers=...)``:
  the pool runs its jobs on ``inner`` (a count of local workers, or any spec), and calls
  ``before(job)`` as each one is about to be passed on. A test (a server's too) slows a compile
  down with it, fails one as its compiler would, or counts what was compiled, without a GPU::

      async def slow(job: acompile.testing.JobView) -> None:
          await anyio.sleep(5)

      async with acompile.CompilePool(workers=acompile.testing.Interposed(2, slow)) as pool:
          ...  # every compile now takes 5 s more; the cache hits do not
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel

from acompile import CompileError, PoolClosedError
from acompile._workers import BACKGROUND, URGENT, Job, JobCancelled, executor_spec, opened
from acompile._workers import run_job as _run

if TYPE_CHECKING:
    from acompile import CompilePool, ExecutorSpec
    from acompile._workers import Executor, ExecutorStats, Opening, WorkerSettings

__all__ = ("Interposed", "JobView", "run_job")


async def run_job(
    pool: CompilePool, module: str, payload: Any, name: str, *, background: bool = False
) -> Any:
    """Run one job of ``module`` (a worker-side module, by its import name: it must be importable
    in the workers, which see the pool's ``sys.path``) on the pool's executor, and return what its
    ``compile(payload)`` returned (or raise what it raised, rebuilt in this process).

    It runs as a request's compile does, uncached: queued in the urgent lane, or behind every
    urgent job with ``background=True``; a caller cancelled while the job is queued drops it, and
    one cancelled while it runs stops its worker (which the pool replaces). ``name`` names the job
    in traces and ``stats()["slowest"]``; an error the worker raises names the kernel as the
    payload's ``"name"`` does (a dict payload with one), else ``'?'``. Raises ``PoolClosedError``
    outside the pool's ``async with``.
    """
    return await pool.executor.run(Job(module, payload, name, BACKGROUND if background else URGENT))


@dataclass(frozen=True)
class JobView:
    """A job as ``Interposed``'s ``before`` sees it, and as ``Interposed.seen`` keeps it.

    Attributes:
        name: the job's name: the kernel's for a request (``add_kernel``), the one given to
            ``run_job``.
        module: the worker-side module that compiles it (``acompile._backends._triton_worker``
            for a Triton kernel, a test's fake backend).
        lane: ``"urgent"`` (somebody waits for it) or ``"background"`` (a warm-up, a progressive
            kernel's best tier), as it was submitted.
    """

    name: str
    module: str
    lane: Literal["urgent", "background"]


class Interposed:
    """An executor spec that runs its jobs on another and calls ``before(job)`` as each one is
    about to be passed on to it: ``CompilePool(workers=Interposed(2, before))``.

    ``before`` receives a ``JobView`` and may be a function or a coroutine function:

    * return (after ``await anyio.sleep(5)``, say): the job goes on to ``inner``, and runs there
      as it would have;
    * raise an exception (``acompile.CompileError``, ``acompile.WorkerCrashedError``): that is the
      job's outcome, as if a worker had raised it; the job never reaches ``inner``, and the pool's
      ``stats()["jobs"]["failed"]`` counts it.

    A caller that leaves while its job is still in an async ``before`` (cancelled, or its
    ``anyio.fail_after`` expired) drops the job: ``before`` is cancelled and the job never reaches
    ``inner``, as a queued job is dropped. A function returns before the job goes on, in the
    submitting task: with one, jobs reach ``inner`` in the same step as without ``Interposed``.

    Args:
        inner: where the jobs run: an executor spec (``acompile.LocalWorkers``, ``acompile.Split``,
            ``acompile.RayFarm``) or a count of local workers.
        before: called with each job before it is passed on; None to only keep ``seen``.

    Attributes:
        seen: every job the pool submitted, in order, as ``JobView``s (those failed or dropped in
            ``before`` too); a spec opened by several pools adds theirs to the one list.
    """

    def __init__(self, inner: ExecutorSpec | int, before: Callable[[JobView], object] | None = None) -> None:
        self.inner = executor_spec(inner, "inner")
        self.before = before
        self.seen: list[JobView] = []

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        """Open ``inner`` for the pool being entered, and step in front of it."""
        inner = opened(self.inner, await self.inner.open(settings, opening))
        return InterposedExecutor(inner, self.before, self.seen)

    def __repr__(self) -> str:
        return f"Interposed({self.inner!r}, {self.before!r})"


@dataclass(eq=False)
class _Held:
    """A job in an async ``before``: what cancels it there, and the awaitable ``before`` returned
    (closed unawaited if the job is dropped before its task starts)."""

    scope: anyio.CancelScope
    awaitable: Awaitable[object]
    started: bool = False


class InterposedExecutor:
    """Implements ``Executor`` in front of ``inner``, for ``Interposed`` (its ``open`` builds it).

    Keeps the rules of every executor (``acompile._workers._executor``): a job held in an async
    ``before`` gets an outcome whatever happens (``before``'s error, ``JobCancelled`` when its
    caller leaves, ``PoolClosedError`` at shutdown); ``serve()`` serves ``inner`` and stops every
    ``before`` still running on the way out. ``promote``, ``quiesce``, ``wakeup`` and
    ``wait_ready`` are ``inner``'s; ``stats()`` is ``inner``'s, with the jobs held in ``before``
    counted queued and those ``before`` failed counted failed.
    """

    def __init__(
        self, inner: Executor, before: Callable[[JobView], object] | None, seen: list[JobView]
    ) -> None:
        self.inner = inner
        self._before = before
        self._seen = seen
        self._held: dict[Job, _Held] = {}
        self._failed = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    def submit(self, job: Job) -> None:
        """Call ``before`` on ``job``; pass it on to ``inner`` once that returns (at once for a
        function), or finish it with what ``before`` raised. Raises ``PoolClosedError`` after
        shutdown, and what ``inner.submit`` raises when the job goes on at once."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        view = JobView(job.name, job.backend, "urgent" if job.lane == URGENT else "background")
        self._seen.append(view)
        if self._before is None:
            self.inner.submit(job)
            return
        try:
            outcome = self._before(view)
        except Exception as exc:
            self._fail(job, exc)
            return
        if not inspect.isawaitable(outcome):
            self.inner.submit(job)
            return
        held = self._held[job] = _Held(anyio.CancelScope(), outcome)
        if self._tg is not None:
            self._tg.start_soon(self._pass_on, job, held, name=f"before {job.name}")
        # else: serve() has not started yet; it starts this job's task when it does.

    async def _pass_on(self, job: Job, held: _Held) -> None:
        """Await ``before``'s awaitable for ``job``, then pass the job on, unless it was dropped
        meanwhile (its scope cancelled) or ``before`` raised."""
        if self._held.get(job) is not held:
            _close(held.awaitable)  # dropped before this task ran
            return
        held.started = True
        with held.scope:
            try:
                await held.awaitable
            except Exception as exc:
                if self._held.pop(job, None) is not None:
                    self._fail(job, exc)
                return
            except anyio.get_cancelled_exc_class():
                if held.scope.cancel_called:
                    raise  # dropped (cancel()): the scope ends it
                try:
                    # A cancellation of this task (the pool leaving) is delivered again here.
                    await anyio.lowlevel.checkpoint()
                except anyio.get_cancelled_exc_class():
                    raise
                # ``before`` itself was cancelled (something it awaited was cancelled by
                # another task): the job's failure, not the executor's end.
                if self._held.pop(job, None) is not None:
                    self._fail(
                        job,
                        CompileError(
                            f"before({job.name!r}) was cancelled by something it awaited",
                            kernel=job.name,
                            backend=job.backend.rsplit(".", 1)[-1],
                        ),
                    )
                return
        if self._held.pop(job, None) is None:
            return  # dropped while in before: its outcome is set
        try:
            self.inner.submit(job)
        except Exception as exc:  # PoolClosedError, WorkerStartError: as submit() would raise them
            job.finish(error=exc)

    def _fail(self, job: Job, error: Exception) -> None:
        self._failed += 1
        job.finish(error=error)

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result (cancelled, the job is cancelled where it is)."""
        return await _run(self, job)

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job``: drop it if still in ``before`` (its outcome ``JobCancelled``),
        else cancel it on ``inner``."""
        held = self._held.pop(job, None)
        if held is None:
            self.inner.cancel(job)
            return
        held.scope.cancel()
        if not held.started:
            _close(held.awaitable)
        job.finish(error=JobCancelled(job.name))

    def promote(self, job: Job) -> None:
        """Somebody waits for a background job now: urgent when it goes on, if still in
        ``before``; else promoted on ``inner``."""
        if job in self._held:
            job.lane = URGENT
        else:
            self.inner.promote(job)

    def hold_dispatch(self) -> Callable[[], None]:
        """``inner``'s batch of a ``gather()`` (longest first), where it keeps one."""
        hold: Callable[[], Callable[[], None]] | None = getattr(self.inner, "hold_dispatch", None)
        return hold() if hold is not None else _nothing

    def quiesce(self) -> None:
        """``inner``'s."""
        self.inner.quiesce()

    def wakeup(self) -> None:
        """``inner``'s."""
        self.inner.wakeup()

    async def wait_ready(self) -> None:
        """``inner``'s."""
        await self.inner.wait_ready()

    def stats(self) -> ExecutorStats:
        """``inner``'s figures, with the jobs in ``before`` counted queued and those it failed
        counted failed."""
        stats = self.inner.stats()
        jobs = stats["jobs"]
        return {
            **stats,
            "jobs": {
                **jobs,
                "queued": jobs["queued"] + len(self._held),
                "failed": jobs["failed"] + self._failed,
            },
        }

    async def serve(self) -> None:
        """Serve ``inner`` until cancelled, and run the async ``before`` calls meanwhile; on the
        way out, stop those still running and fail their jobs with ``PoolClosedError``."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for job, held in list(self._held.items()):
                    tg.start_soon(self._pass_on, job, held, name=f"before {job.name}")
                await self.inner.serve()
        finally:
            self._tg = None
            self._closed = True
            held_jobs, self._held = self._held, {}
            for job, held in held_jobs.items():
                if not held.started:
                    _close(held.awaitable)
                job.finish(error=PoolClosedError("the pool shut down before this job ran"))


def _close(awaitable: Awaitable[object]) -> None:
    """Close a coroutine that will never be awaited (no "never awaited" warning for it)."""
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()


def _nothing() -> None:
    pass
