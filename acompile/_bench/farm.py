"""The farm benchmark: a compile farm on Ray against the local pool, on the same corpus.

``acompile bench --farm ADDRESS [--nodes N] [--workers W] [--limit K] [--noops J] [--json PATH]``

``ADDRESS`` is a Ray cluster (``auto``, ``HOST:PORT``), or ``cluster``: a cluster of ``--nodes``
nodes of one CPU each started on this machine for the run (``ray.cluster_utils.Cluster``, as
``ray start`` makes them) and shut down after it. Both sides run in this process, one after the
other, with the same number of workers (``--workers``, default: the farm's size) and empty
caches; each side is entered and ``wait_ready()`` before its clocks start (the entry is timed
apart), so both do the same work inside the clocks.

Per side:

- ``noop round trip``: ``J`` jobs that compile nothing, one at a time (p50, p90): what one job
  costs on its way there and back. The farm's *per-job overhead* is its p50 less the local p50.
- ``noop throughput``: ``J`` such jobs submitted at once: jobs per second, and the CPU per job of
  the pool's side of the work: this process's (the pool's), and on the farm's side, that of the
  pool's connection process too (``python -m acompile._farm._broker``, a child of this process,
  which holds the connection to Ray and does most of the farm's work per job), each and together
  (``driver_cpu_ms_per_job``: what the pool's side spends to feed one job, the farm's ceiling
  for many nodes). Ray's own processes of a cluster started here are the cluster's, not counted.
- ``corpus``: the corpus compiled cold, all at once: time to the first result and to the last,
  kernels per second; the farm's kernels are checked against the local ones byte for byte.

The printed projection scales these to a farm of ``nodes × cores`` workers; docs/farm.md says
what it assumes. This module is also the worker-side backend of the no-op jobs (``setup``,
``preload``, ``compile``): the workers on the nodes import it by name.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from acompile._bench import harness

_NOOP = "acompile._bench.farm"
# The module the pool's connection process to Ray runs (``acompile._farm._remote`` starts it).
_CONNECTION = "acompile._farm._broker"


# -- the worker-side backend of the no-op jobs --------------------------------------------------


def setup(config: dict[str, Any]) -> None:
    """Nothing to configure: a no-op job needs nothing."""


def preload(config: dict[str, Any]) -> None:
    """Nothing to preload."""


def compile(payload: dict[str, Any]) -> bytes:
    """A job that compiles nothing: its cost is the trip there and back."""
    return bytes(payload["size"])


# -- the measurements ---------------------------------------------------------------------------


def _connection_processes() -> list[Any]:
    """The pool's connection processes to Ray: this process's children that run the connection
    module (one while a pool with a farm is entered, none on the local side). Not its other
    children: workers compile, and a cluster started here (``cluster``) runs Ray's own daemons."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            if _CONNECTION in child.cmdline():
                found.append(child)
        except psutil.Error:
            pass  # ended meanwhile
    return found


def _cpu_seconds(processes: list[Any]) -> float:
    """The CPU seconds (user and system, every thread) ``processes`` have used so far. The kernel
    counts them in clock ticks (10 ms): hundreds of jobs make that small per job."""
    import psutil

    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue  # ended: what it used is lost with it (the benchmark's pool does not end it)
        total += times.user + times.system
    return total


async def _side(name: str, pool_args: dict[str, Any], specs: list[Any], noops: int) -> dict[str, Any]:
    import acompile
    from acompile._workers import Job

    row: dict[str, Any] = {"side": name}
    with tempfile.TemporaryDirectory(prefix="acompile-bench-farm-") as cache_dir:
        t0 = time.perf_counter()
        async with acompile.CompilePool(cache_dir=cache_dir, **pool_args) as pool:
            await pool.wait_ready()
            row["ready_s"] = time.perf_counter() - t0
            executor = pool.executor

            def noop(i: int) -> Job:
                return Job(_NOOP, {"name": f"noop{i}", "size": 64}, f"noop{i}")

            await executor.run(noop(-1))  # each side's first job imports the module: not timed
            trips = []
            for i in range(noops):
                start = time.perf_counter()
                await executor.run(noop(i))
                trips.append(time.perf_counter() - start)
            row["noop_p50_ms"] = harness.ms(harness.percentile(trips, 0.5))
            row["noop_p90_ms"] = harness.ms(harness.percentile(trips, 0.9))

            connection = _connection_processes()
            cpu, connection_cpu = time.process_time(), _cpu_seconds(connection)
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(noops):
                    tg.start_soon(executor.run, noop(i))
            elapsed = time.perf_counter() - start
            pool_cpu = time.process_time() - cpu
            connection_cpu = _cpu_seconds(connection) - connection_cpu
            row["noop_per_s"] = round(noops / elapsed, 1)
            row["pool_cpu_ms_per_job"] = harness.ms(pool_cpu / noops)
            row["connection_cpu_ms_per_job"] = harness.ms(connection_cpu / noops) if connection else None
            # Both processes' CPU, added: where they run on two cores at once, the pool's side
            # can feed somewhat more than this says.
            row["driver_cpu_ms_per_job"] = harness.ms((pool_cpu + connection_cpu) / noops)

            first: list[float] = []
            kernels: list[Any] = [None] * len(specs)
            start = time.perf_counter()

            async def one(i: int, spec: Any) -> None:
                kernels[i] = await pool.compile(spec)
                first.append(time.perf_counter() - start)

            async with anyio.create_task_group() as tg:
                for i, spec in enumerate(specs):
                    tg.start_soon(one, i, spec)
            row["corpus_first_s"] = round(min(first), 3)
            row["corpus_all_s"] = round(time.perf_counter() - start, 3)
            row["kernels"] = len(specs)
            row["kernels_per_s"] = round(len(specs) / row["corpus_all_s"], 2)
            stats = pool.stats()
            row["compile_p50_s"] = stats["compile_seconds"].get("p50")
            row["workers"] = stats["workers"]["size"]
            farm = pool_args.get("farm")
            leaving = time.perf_counter()
            if farm is not None:
                row["nodes"] = {
                    n["address"] + f" ({i})": n["done"] for i, n in enumerate(farm.stats()["nodes"].values())
                }
        row["exit_s"] = round(time.perf_counter() - leaving, 3)
        row["cubins"] = [k.cubin for k in kernels]
    return row


def _projection(
    local: dict[str, Any], farm: dict[str, Any], kernels: int, nodes: int, cores: int
) -> dict[str, Any]:
    """Wall time of ``kernels`` cold compiles on ``nodes × cores`` farm workers, from the measured
    figures: the corpus's mean compile time per kernel (local pool), the farm's per-job overhead,
    the CPU per job of the pool's side (its process and its connection process, added), and the
    farm's start (actors placed and preloaded)."""
    workers = nodes * cores
    per_kernel = local["corpus_all_s"] * local["workers"] / local["kernels"]
    overhead = max(0.0, (farm["noop_p50_ms"] - local["noop_p50_ms"]) / 1000)
    driver = farm["driver_cpu_ms_per_job"] / 1000
    waves = math.ceil(kernels / workers)
    compute = waves * (per_kernel + overhead)
    feed = kernels * driver  # the pool's side (its process and its connection) hands out every job
    return {
        "workers": workers,
        "kernels": kernels,
        "per_kernel_s": round(per_kernel, 3),
        "overhead_ms": round(overhead * 1000, 3),
        "start_s": round(farm["ready_s"], 2),
        "estimate_s": round(farm["ready_s"] + max(compute, feed), 2),
        "bound": "driver" if feed > compute else "compile",
        "sequential_s": round(kernels * per_kernel, 1),
    }


async def _run(args: argparse.Namespace, address: str, size: int) -> dict[str, Any]:
    import acompile
    from acompile._bench.corpus import acompile_specs

    specs = acompile_specs(args.limit)
    common = {"target": args.target}
    local = await _side("local", dict(common, workers=size), specs, args.noops)
    farm = acompile.RayFarm(address, workers=size)
    remote = await _side("farm", dict(common, workers=farm), specs, args.noops)
    same = sum(a == b for a, b in zip(local.pop("cubins"), remote.pop("cubins"), strict=True))
    return {
        "machine": harness.machine(),
        "address": address,
        "workers": size,
        "kernels": len(specs),
        "identical_cubins": same,
        "local": local,
        "farm": remote,
        "per_job_overhead_ms": round(remote["noop_p50_ms"] - local["noop_p50_ms"], 3),
        "projections": {
            "16-core host, 1 node": _projection(local, remote, len(specs), 1, 16),
            "100 nodes x 16 cores, 3000 kernels": _projection(local, remote, 3000, 100, 16),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acompile bench --farm", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="a Ray cluster's address, or 'cluster' to start one here")
    parser.add_argument("--nodes", type=int, default=2, help="with 'cluster': nodes of 1 CPU (default 2)")
    parser.add_argument("--workers", type=int, default=None, help="workers a side (default: the nodes')")
    parser.add_argument("--target", default="cuda:90", help="compile target (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first K specs of the corpus")
    parser.add_argument("--noops", type=int, default=200, help="no-op jobs a measurement (default 200)")
    parser.add_argument("--json", default="bench-results/farm.json", help="default: %(default)s")
    args = parser.parse_args(argv)
    if need := harness.missing(ray=True, psutil=True):
        print(f"acompile bench --farm: needs {need}", file=sys.stderr)
        return 2
    harness.quiet_warnings()
    started = time.perf_counter()
    cluster: Any = None  # ray.cluster_utils.Cluster, untyped
    address = args.address
    try:
        if address == "cluster":
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
            for _ in range(args.nodes - 1):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            address = cluster.address
        size = args.workers or args.nodes
        result = anyio.run(_run, args, address, size)
    finally:
        if cluster is not None:
            cluster.shutdown()
    result["process_s"] = round(time.perf_counter() - started, 2)
    _print(result)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    from acompile._outputs import write_own_file

    # --json names a file of this user's: never written through another user's link.
    write_own_file(path, json.dumps(result, indent=2).encode())
    return 0 if result["identical_cubins"] == result["kernels"] else 1


def _print(result: dict[str, Any]) -> None:
    out = sys.stdout
    print(
        f"farm at {result['address']} against the local pool, {result['workers']} workers a side, "
        f"{result['kernels']} kernels",
        file=out,
    )
    columns = (
        "ready_s",
        "noop_p50_ms",
        "noop_p90_ms",
        "noop_per_s",
        "pool_cpu_ms_per_job",
        "connection_cpu_ms_per_job",
        "driver_cpu_ms_per_job",
        "corpus_first_s",
        "corpus_all_s",
        "kernels_per_s",
        "exit_s",
    )
    widths = [max(22, len(c) + 2) for c in columns]  # a name never runs into the one before it
    print(f"{'':8}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)), file=out)
    for side in ("local", "farm"):
        row = result[side]
        cells = (f"{harness.fmt(row[c], '.3f'):>{w}}" for c, w in zip(columns, widths, strict=True))
        print(f"{side:8}" + "".join(cells), file=out)
    print(
        f"per-job overhead of the farm: {result['per_job_overhead_ms']:.3f} ms; identical cubins: "
        f"{result['identical_cubins']}/{result['kernels']}; whole process {result['process_s']} s",
        file=out,
    )
    for name, p in result["projections"].items():
        print(
            f"projection, {name}: {p['kernels']} kernels on {p['workers']} workers ≈ {p['estimate_s']} s "
            f"(start {p['start_s']} s, {p['per_kernel_s']} s a kernel, bound by {p['bound']}; "
            f"sequential {p['sequential_s']} s)",
            file=out,
        )
