"""Real Ray clusters on this machine for the farm's tests, and the processes they leave.

A cluster is ``ray.cluster_utils.Cluster``: a GCS and a raylet per node, as ``ray start`` makes
them, all children of the test's process. Each is shut down however its test ends, and then no
process of it (GCS, raylets, Ray workers) may be left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
from ray.cluster_utils import Cluster


def ray_cluster(*nodes: dict[str, Any]) -> Iterator[tuple[Cluster, list[str]]]:
    """A cluster with a head node and ``nodes`` (``Cluster.add_node``'s arguments, and ``env``:
    what the node's raylet, and the workers it starts, find in their environment), shut down
    however the tests end; with the ids of the nodes added, in order."""
    head, *others = nodes
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        ids = []
        for node in others:
            env = node.pop("env", {})
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)  # the node's raylet, and the workers it starts, inherit it
            try:
                ids.append(cluster.add_node(**node).node_id)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        cluster.wait_for_nodes()
        yield cluster, ids
    finally:
        cluster.shutdown()
        # Every process of the cluster (GCS, raylets, the workers they started) is gone.
        deadline = time.monotonic() + 10
        while (left := ray_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"Ray processes left after the cluster's shutdown: {left}"


def ray_processes() -> list[str]:
    """Ray's processes under this one (a cluster started here is this process's children)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and any(
                n in line for n in ("ray::", "raylet", "gcs_server")
            ):
                found.append(f"{proc.pid} {line[:60]}")
        except psutil.Error:
            pass
    return found
