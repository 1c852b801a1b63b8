"""Compile farms: a pool's jobs on a Ray cluster, behind the same ``await``.

* ``_farm``: ``RayFarm``, the public description of a farm (imports nothing of Ray);
* ``_executor``: ``FarmExecutor``, the executor on the pool's side: connecting, placing actors
  on nodes, the queue, cancellation, retries, toolchain checks;
* ``_actor``: ``FarmWorker``, the Ray actor on each node, which runs jobs in a local worker pool
  of one;
* ``_split``: ``SplitExecutor``, urgent jobs on local workers and background jobs on a farm.

``open_executor()`` is what ``CompilePool`` calls; it imports Ray, and only then.
"""

from __future__ import annotations

import logging
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


async def open_executor(farm: RayFarm, memo_dir: Path, **config: Any) -> Executor | None:
    """Connect to ``farm`` and return its executor; None where the farm cannot be reached and
    the user asked for a local fallback (after one warning). ``config`` is what the farm's
    workers need of the pool (see ``_executor.connect``).

    Raises ``FarmUnreachableError`` (no fallback asked for) and ``BackendUnavailableError``
    when Ray is not installed.
    """
    try:
        from acompile._farm import _executor
    except ImportError as exc:
        raise BackendUnavailableError('a RayFarm needs Ray: pip install "acompile[ray]"') from exc
    try:
        return await _executor.connect(farm, memo_dir=memo_dir, **config)
    except FarmUnreachableError as exc:
        if not farm.local_fallback:
            raise
        logger.warning("%s; compiling on this machine's workers instead (local_fallback=True)", exc)
        return None
