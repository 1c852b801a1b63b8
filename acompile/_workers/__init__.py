"""Worker processes, reached through the executor interface.

``CompilePool`` hands its compile jobs to an ``Executor`` (``_executor``); ``WorkerPool``
(``LocalExecutor``) runs them in worker processes on this machine. The modules, each with one job:

* ``_executor``: the ``Executor`` protocol, ``run_job()``, the stats it reports;
* ``_queue``: ``Job``, the queue (two lanes, longest expected job first) and the hand-off of jobs to
  idle workers;
* ``_pool``: ``WorkerPool``: slots, epochs (quiesce, wake-up), replacing workers;
* ``_process``: worker process handles, stopping them, their stderr tail;
* ``_template``: the template workers are forked from, and the socket they connect back to;
* ``_protocol``: the framed messages between the pool, the template and the workers;
* ``_main``: what runs in the worker and template processes;
* ``_bytecode``: where workers keep their imports' bytecode when the installation has none.
* ``_linux``: the process controls children set (a signal at their parent's death, a name).
"""

from __future__ import annotations

import typing as _typing

from acompile import _lazy

# In a pool's worker process, the names below are imported at the first one used (see
# acompile._lazy); everywhere else, with the package.
if _typing.TYPE_CHECKING or _lazy.eager(__name__):
    from acompile._workers._executor import Executor as Executor
    from acompile._workers._executor import ExecutorStats as ExecutorStats
    from acompile._workers._executor import idle_stats as idle_stats
    from acompile._workers._executor import run_job as run_job
    from acompile._workers._pool import LocalExecutor as LocalExecutor
    from acompile._workers._pool import WorkerPool as WorkerPool
    from acompile._workers._process import remove_work_folder as remove_work_folder
    from acompile._workers._queue import BACKGROUND as BACKGROUND
    from acompile._workers._queue import URGENT as URGENT
    from acompile._workers._queue import Job as Job
    from acompile._workers._queue import JobCancelled as JobCancelled
else:
    __getattr__ = _lazy.on_first_use(__name__)

__all__ = (
    "BACKGROUND",
    "URGENT",
    "Executor",
    "ExecutorStats",
    "Job",
    "JobCancelled",
    "LocalExecutor",
    "WorkerPool",
    "idle_stats",
    "remove_work_folder",
    "run_job",
)
