"""Worker processes, reached through the executor interface.

``CompilePool`` hands its compile jobs to an ``Executor`` (``_executor``); ``WorkerPool``
(``LocalExecutor``) runs them in worker processes on this machine. The modules, each with one job:

* ``_executor``: the ``Executor`` protocol, ``run_job()``, the stats it reports;
* ``_settings``: ``WorkerSettings``, how workers run, one frozen value carried whole to every
  executor and across every process boundary;
* ``_open``: executor specs (``LocalWorkers``, ``Split``; ``acompile.RayFarm`` and the host's
  pool elsewhere) and ``Opening``: ``CompilePool(workers=...)``'s one call that opens one;
* ``_split``: ``SplitExecutor``, urgent jobs on one executor and background jobs on another;
* ``_link``: ``LinkedExecutor``, the one client of a helper process that runs jobs elsewhere (a
  farm's connection process, the host's pool server): frames, jobs in flight, loss, restart;
* ``_queue``: ``Job``, the queue (two lanes, longest expected job first) and the hand-off of jobs to
  idle workers;
* ``_slots``: ``SlotExecutor``, the skeleton every executor shares (slots, epochs, the start-failure
  policy, retries, the idle timer) over a kind of ``Runners``;
* ``_pool``: ``WorkerPool``: the skeleton over worker processes (the template, forks, limits);
* ``_process``: worker process handles, stopping them, their stderr tail;
* ``_template``: the template workers are forked from, and the socket they connect back to;
* ``_protocol``: the framed messages between the pool, the template and the workers;
* ``_main``: what runs in the worker and template processes;
* ``_bytecode``: where workers keep their imports' bytecode when the installation has none.

The process controls children set (a signal at their parent's death, a name) are the base
module ``acompile._linux``: the backends and the front end use them too.
"""

from __future__ import annotations

import typing as _typing

from acompile import _lazy

# Each name, by the module it lives in (and its name there where it differs); see acompile._lazy.
_NAMES: dict[str, str | tuple[str, str]] = {
    "BYTECODE_FOLDER": ("_bytecode", "FOLDER"),
    "BYTECODE_HELPER_NAME": ("_bytecode", "HELPER_NAME"),
    "bytecode_plan": ("_bytecode", "plan"),
    "Executor": "_executor",
    "ExecutorStats": "_executor",
    "idle_stats": "_executor",
    "run_job": "_executor",
    "LocalExecutor": "_pool",
    "WorkerPool": "_pool",
    "remove_work_folder": "_process",
    "short_backend": "_process",
    "BACKGROUND": "_queue",
    "URGENT": "_queue",
    "Job": "_queue",
    "JobCancelled": "_queue",
    "JobQueue": "_queue",
    "Taker": "_queue",
    "NoRoom": "_slots",
    "PoolStats": "_slots",
    "Runner": "_slots",
    "Runners": "_slots",
    "SlotExecutor": "_slots",
    "TransientStartError": "_slots",
    "late_config": ("_late", "prepared"),
    "outside_job_time": ("_late", "paused"),
    "WorkerConfig": "_config",
    "BackendConfig": "_config",
    "JobDone": ("_protocol", "Done"),
    "JobFailed": ("_protocol", "Error"),
    "FrameReader": "_protocol",
    "MessageReceiver": "_protocol",
    "Undecodable": "_protocol",
    "encode_frame": ("_protocol", "encode"),
    "read_message": "_protocol",
    "combined_stats": "_executor",
    "WorkerSettings": "_settings",
    "DEFAULT_NICE": "_settings",
    "ExecutorSpec": "_open",
    "LocalWorkers": "_open",
    "Opening": "_open",
    "Split": "_open",
    "executor_spec": "_open",
    "checked_count": "_open",
    "is_executor_spec": "_open",
    "opened": "_open",
    "SplitExecutor": "_split",
    "Link": "_link",
    "LinkLost": "_link",
    "LinkedExecutor": "_link",
    "Policy": "_link",
    "Reply": "_link",
}
if _typing.TYPE_CHECKING:
    from acompile._workers._bytecode import FOLDER as BYTECODE_FOLDER
    from acompile._workers._bytecode import HELPER_NAME as BYTECODE_HELPER_NAME
    from acompile._workers._bytecode import plan as bytecode_plan
    from acompile._workers._config import BackendConfig as BackendConfig
    from acompile._workers._config import WorkerConfig as WorkerConfig
    from acompile._workers._executor import Executor as Executor
    from acompile._workers._executor import ExecutorStats as ExecutorStats
    from acompile._workers._executor import combined_stats as combined_stats
    from acompile._workers._executor import idle_stats as idle_stats
    from acompile._workers._executor import run_job as run_job
    from acompile._workers._late import paused as outside_job_time
    from acompile._workers._late import prepared as late_config
    from acompile._workers._link import Link as Link
    from acompile._workers._link import LinkedExecutor as LinkedExecutor
    from acompile._workers._link import LinkLost as LinkLost
    from acompile._workers._link import Policy as Policy
    from acompile._workers._link import Reply as Reply
    from acompile._workers._open import ExecutorSpec as ExecutorSpec
    from acompile._workers._open import LocalWorkers as LocalWorkers
    from acompile._workers._open import Opening as Opening
    from acompile._workers._open import Split as Split
    from acompile._workers._open import checked_count as checked_count
    from acompile._workers._open import executor_spec as executor_spec
    from acompile._workers._open import is_executor_spec as is_executor_spec
    from acompile._workers._open import opened as opened
    from acompile._workers._pool import LocalExecutor as LocalExecutor
    from acompile._workers._pool import WorkerPool as WorkerPool
    from acompile._workers._process import remove_work_folder as remove_work_folder
    from acompile._workers._process import short_backend as short_backend
    from acompile._workers._protocol import Done as JobDone
    from acompile._workers._protocol import Error as JobFailed
    from acompile._workers._protocol import FrameReader as FrameReader
    from acompile._workers._protocol import MessageReceiver as MessageReceiver
    from acompile._workers._protocol import Undecodable as Undecodable
    from acompile._workers._protocol import encode as encode_frame
    from acompile._workers._protocol import read_message as read_message
    from acompile._workers._queue import BACKGROUND as BACKGROUND
    from acompile._workers._queue import URGENT as URGENT
    from acompile._workers._queue import Job as Job
    from acompile._workers._queue import JobCancelled as JobCancelled
    from acompile._workers._queue import JobQueue as JobQueue
    from acompile._workers._queue import Taker as Taker
    from acompile._workers._settings import DEFAULT_NICE as DEFAULT_NICE
    from acompile._workers._settings import WorkerSettings as WorkerSettings
    from acompile._workers._slots import NoRoom as NoRoom
    from acompile._workers._slots import PoolStats as PoolStats
    from acompile._workers._slots import Runner as Runner
    from acompile._workers._slots import Runners as Runners
    from acompile._workers._slots import SlotExecutor as SlotExecutor
    from acompile._workers._slots import TransientStartError as TransientStartError
    from acompile._workers._split import SplitExecutor as SplitExecutor
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=True)

__all__ = (
    "BACKGROUND",
    "BYTECODE_FOLDER",
    "BYTECODE_HELPER_NAME",
    "DEFAULT_NICE",
    "URGENT",
    "BackendConfig",
    "Executor",
    "ExecutorSpec",
    "ExecutorStats",
    "FrameReader",
    "Job",
    "JobCancelled",
    "JobDone",
    "JobFailed",
    "JobQueue",
    "Link",
    "LinkLost",
    "LinkedExecutor",
    "LocalExecutor",
    "LocalWorkers",
    "MessageReceiver",
    "NoRoom",
    "Opening",
    "Policy",
    "PoolStats",
    "Reply",
    "Runner",
    "Runners",
    "SlotExecutor",
    "Split",
    "SplitExecutor",
    "Taker",
    "TransientStartError",
    "Undecodable",
    "WorkerConfig",
    "WorkerPool",
    "WorkerSettings",
    "bytecode_plan",
    "checked_count",
    "combined_stats",
    "encode_frame",
    "executor_spec",
    "idle_stats",
    "is_executor_spec",
    "late_config",
    "opened",
    "outside_job_time",
    "read_message",
    "remove_work_folder",
    "run_job",
    "short_backend",
)
