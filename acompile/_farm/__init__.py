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
  of one.

A ``RayFarm`` is an executor spec (``acompile._workers._open``): ``CompilePool`` opens it with one
call, ``RayFarm.open``, which starts the connection process (``_remote.open_farm``); only that
process imports Ray.
"""

from __future__ import annotations

from acompile._farm._farm import FarmStats as FarmStats
from acompile._farm._farm import RayFarm as RayFarm

__all__ = ("FarmStats", "RayFarm")
