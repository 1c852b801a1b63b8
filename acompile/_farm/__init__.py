"""Compile farms: a pool's jobs on a Ray cluster, behind the same ``await``.

* ``_farm``: ``RayFarm``, the public description of a farm (imports nothing of Ray);
* ``_remote``: ``RemoteExecutor``, the farm's executor in the pool's process: it starts the
  connection process and drives the farm through its pipes; when the cluster is lost, the jobs
  move to local workers or fail;
* ``_broker``: the connection process, the one process of a pool that imports Ray: it connects
  (``ray.init`` on its main thread), runs the ``FarmExecutor`` and watches the cluster's head;
* ``_executor``: ``FarmExecutor``, the executor in the connection process: connecting, placing
  actors on nodes, the queue, cancellation, retries, toolchain checks;
* ``_actor``: ``FarmWorker``, the Ray actor on each node, which runs jobs in a local worker pool
  of one;
* ``_split``: ``SplitExecutor``, urgent jobs on local workers and background jobs on a farm.

``open_executor()`` is what ``CompilePool`` calls; it starts the connection process, and only
that process imports Ray.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acompile._errors import BackendUnavailableError, FarmUnreachableError
from acompile._farm._farm import FarmStats as FarmStats
from acompile._farm._farm import RayFarm as RayFarm
from acompile._farm._split import SplitExecutor as SplitExecutor

if TYPE_CHECKING:
    from acompile._workers import Executor

__all__ = ("FarmStats", "RayFarm", "SplitExecutor", "open_executor")

logger = logging.getLogger("acompile")


async def open_executor(
    farm: RayFarm,
    memo_dir: Path,
    *,
    local: Executor | None = None,
    make_local: Callable[[], Executor] | None = None,
    **config: Any,
) -> Executor | None:
    """Connect to ``farm`` (through its connection process) and return its executor; None where
    the farm cannot be reached and the user asked for a local fallback (after one warning).
    ``config`` is what the farm's workers need of the pool (see ``_executor.connect``).

    For a farm lost later, with a local fallback, the executor moves its jobs to ``local`` (the
    pool's own local workers) or to the local workers ``make_local()`` makes (at the first need).

    Raises ``FarmUnreachableError`` (no fallback asked for) and ``BackendUnavailableError``
    when Ray is not installed.
    """
    # Looked for, not imported: Ray is imported by the connection process only.
    if importlib.util.find_spec("ray") is None:
        raise BackendUnavailableError('a RayFarm needs Ray: pip install "acompile[ray]"')
    from acompile._farm import _remote

    try:
        return await _remote.connect(farm, memo_dir, config, local=local, make_local=make_local)
    except FarmUnreachableError as exc:
        if not farm.local_fallback:
            raise
        logger.warning("%s; compiling on this machine's workers instead (local_fallback=True)", exc)
        return None
