"""The executor interface: how ``CompilePool`` has its jobs run, wherever they run.

``CompilePool`` never touches processes. It builds a ``Job`` (a worker-side backend module's
name, a picklable payload, the kernel's name, a priority lane) and gives it to its executor,
which runs it somewhere and sets its outcome: the value the backend returned (bytes, for a cache
entry) or the exception it raised. Nothing in the interface is a path on this machine, so an
executor may run jobs elsewhere (a compile farm); ``WorkerPool`` runs them in worker processes
here (``LocalExecutor`` is the same class). Both are one skeleton, ``_slots.SlotExecutor``, over
their own kind of runner: the rules below, the start-failure policy and the retry of a job whose
worker was killed from outside are written there once.

The rules an executor keeps:

* ``submit()`` queues a job, or raises at once (``PoolClosedError`` after shutdown,
  ``WorkerStartError`` when no worker can start); a queued job's outcome is always set, in the
  end (shutdown fails the jobs left with ``PoolClosedError``).
* ``cancel()`` is for a job nobody waits for any more: a queued job is dropped, a running one
  stopped (the only way to stop a compiler is to stop its process); its outcome becomes
  ``JobCancelled``.
* ``serve()`` runs in the owner's task group until that is cancelled, and leaves nothing
  running behind it, whatever cancelled it.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from acompile._workers._queue import BACKGROUND, URGENT, Job

if TYPE_CHECKING:
    from acompile._observe import JobStats, WorkerStats

__all__ = ("BACKGROUND", "URGENT", "Executor", "ExecutorStats", "idle_stats", "run_job")


class ExecutorStats(TypedDict):
    """What ``Executor.stats()`` returns: ``CompilePool.stats()``'s ``workers`` and ``jobs``,
    and the recent jobs' durations (``job_seconds``) and the slowest as (seconds, name)."""

    workers: WorkerStats
    jobs: JobStats
    job_seconds: list[float]
    slowest: list[tuple[float, str]]


class Executor(Protocol):
    """Runs ``Job``s; see the module's docstring for the rules every executor keeps."""

    def submit(self, job: Job) -> None:
        """Queue ``job``; its outcome is set later (``await job.outcome()``)."""

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result (or raise its error); a caller that leaves
        (cancelled) before it finishes cancels it. ``run_job()`` does this for any executor."""

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job`` any more: drop it, or stop it where it runs."""

    def promote(self, job: Job) -> None:
        """Somebody waits for a queued background job now: move it to the urgent lane."""

    def quiesce(self) -> None:
        """Release the resources jobs run on (returns at once); running jobs are put back and
        run again later. New work, or ``wakeup()``, starts them again."""

    def wakeup(self) -> None:
        """Start the resources jobs run on, if they are not; returns at once."""

    async def wait_ready(self) -> None:
        """Wake up and wait until jobs can run without a start-up cost. Raises
        ``WorkerStartError`` when they cannot run at all."""

    def stats(self) -> ExecutorStats:
        """A cheap snapshot of the executor."""

    async def serve(self) -> None:
        """Run until cancelled (in the owner's task group); stop everything on the way out."""


async def run_job(executor: Executor, job: Job) -> Any:
    """Submit ``job`` to ``executor`` and wait for its outcome. If the caller is cancelled
    first, the job is cancelled too: a request whose last waiter left stops its compile."""
    executor.submit(job)
    try:
        return await job.outcome()
    finally:
        if not job.done.is_set():
            executor.cancel(job)


def idle_stats(size: int) -> ExecutorStats:
    """The stats of an executor of ``size`` workers that has not started."""
    return {
        "workers": {
            "size": size,
            "alive": 0,
            "busy": 0,
            "awake": False,
            "started": 0,
            "forked": 0,
            "restarts": {},
            "rss_mib": {},
            "mean_rss_mib": None,
        },
        "jobs": {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 0, "retried": 0},
        "job_seconds": [],
        "slowest": [],
    }


def combined_stats(local: ExecutorStats, remote: ExecutorStats) -> ExecutorStats:
    """Two executors' figures added up, as one pool's: this machine's workers and a farm's
    (workers, jobs, restarts by cause, durations). Resident memory is the local workers' alone:
    nobody measures a remote node's here."""
    wa, wb = local["workers"], remote["workers"]
    restarts = dict(wa["restarts"])
    for cause, count in wb["restarts"].items():
        restarts[cause] = restarts.get(cause, 0) + count
    ja, jb = local["jobs"], remote["jobs"]
    return {
        "workers": {
            "size": wa["size"] + wb["size"],
            "alive": wa["alive"] + wb["alive"],
            "busy": wa["busy"] + wb["busy"],
            "awake": wa["awake"] or wb["awake"],
            "started": wa["started"] + wb["started"],
            "forked": wa["forked"] + wb["forked"],
            "restarts": restarts,
            "rss_mib": wa["rss_mib"],
            "mean_rss_mib": wa["mean_rss_mib"],
        },
        "jobs": {
            "queued": ja["queued"] + jb["queued"],
            "running": ja["running"] + jb["running"],
            "done": ja["done"] + jb["done"],
            "failed": ja["failed"] + jb["failed"],
            "cancelled": ja["cancelled"] + jb["cancelled"],
            "retried": ja["retried"] + jb["retried"],
        },
        "job_seconds": local["job_seconds"] + remote["job_seconds"],
        "slowest": heapq.nlargest(10, local["slowest"] + remote["slowest"]),
    }
