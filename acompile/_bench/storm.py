"""The fault storm: a compile storm while random pool processes are SIGKILLed.

``acompile bench --storm`` (or ``python -m acompile._bench.storm``): real Triton compiles of the
benchmark corpus (each spec with several ``num_warps``, so every job is a distinct compile) into
an empty cache folder, on the default pool but for the worker count, while a killer SIGKILLs a
random process of the pool (a worker, the template, a worker still starting) every 50–300 ms,
every other kill once the pool is back at full size.
It prints how many jobs succeeded, what failed and why, how long the pool took to return to
full size after the last kill, then quiesce, wake-up and shutdown times, and any process left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

import anyio


def _pool_processes() -> list[Any]:
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "acompile._worker" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            pass
    return found


async def storm(jobs: int, workers: int, kills: int, target: str, seed: int) -> dict[str, Any]:
    import acompile
    from acompile._bench.corpus import corpus

    rng = random.Random(seed)
    specs = [
        acompile.TritonSpec(s.fn, signature=s.signature, constexprs=s.constexprs, num_warps=w)
        for w in (1, 2, 4, 8)
        for s in corpus()
    ][:jobs]
    killed: list[str] = []
    recoveries: list[float] = []
    outcomes: list[BaseException | None] = []
    with tempfile.TemporaryDirectory(prefix="acompile-storm-") as cache_dir:
        t0 = time.perf_counter()
        async with acompile.CompilePool(workers, target=target, cache_dir=cache_dir) as pool:

            async def one(spec: Any) -> None:
                try:
                    await pool.compile(spec)
                    outcomes.append(None)
                except acompile.AcompileError as exc:
                    outcomes.append(exc)

            async def killer() -> None:
                while len(killed) < kills and len(outcomes) < len(specs):
                    if len(killed) % 2 == 0:
                        # Every other kill lands on a pool at full size (a worker or the template
                        # at random); the others at any moment, starting processes included.
                        while pool.stats()["workers"]["alive"] < workers:  # noqa: ASYNC110
                            await anyio.sleep(0.005)
                    await anyio.sleep(rng.uniform(0.05, 0.3))
                    victims = _pool_processes()
                    if victims:
                        victim = rng.choice(victims)
                        try:
                            template = victim.ppid() == os.getpid() and "--template" in victim.cmdline()
                            victim.send_signal(signal.SIGKILL)
                        except Exception:
                            continue
                        killed.append("template" if template else "worker")
                        tg.start_soon(recovered, time.perf_counter())

            async def recovered(since: float) -> None:
                # From this kill to the next moment the pool is at full size again. First the
                # pool notices the death (a process still starting was not counted: no drop).
                with anyio.move_on_after(0.5):
                    while pool.stats()["workers"]["alive"] == workers:  # noqa: ASYNC110 - no event for it
                        await anyio.sleep(0.001)
                while pool.stats()["workers"]["alive"] < workers:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
                recoveries.append(time.perf_counter() - since)

            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                for spec in specs:
                    tg.start_soon(one, spec)
            storm_s = time.perf_counter() - t0
            t = time.perf_counter()
            await pool.quiesce()
            quiesce_s = time.perf_counter() - t
            t = time.perf_counter()
            await pool.wakeup()
            await pool.wait_ready()
            wakeup_s = time.perf_counter() - t
            t = time.perf_counter()
        shutdown_s = time.perf_counter() - t
        left = [p.pid for p in _pool_processes()]
    failed = [e for e in outcomes if e is not None]
    return {
        "jobs": len(specs),
        "workers": workers,
        "succeeded": len(outcomes) - len(failed),
        "failed": [f"{type(e).__name__}: {str(e).splitlines()[0]}" for e in failed],
        "kills": {
            "total": len(killed),
            "template": killed.count("template"),
            "worker": killed.count("worker"),
        },
        "storm_s": round(storm_s, 3),
        # Kill to full size again; kills that land while the pool recovers share one recovery.
        "back_to_full_size_s": {
            "median": round(statistics.median(recoveries), 3) if recoveries else None,
            "max": round(max(recoveries), 3) if recoveries else None,
        },
        "quiesce_ms": round(quiesce_s * 1e3, 2),
        "wakeup_ms": round(wakeup_s * 1e3, 1),
        "shutdown_ms": round(shutdown_s * 1e3, 1),
        "processes_left": left,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acompile bench --storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=24, help="SIGKILLs during the storm (default: 24)")
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    result = anyio.run(storm, args.jobs, args.workers, args.kills, args.target, args.seed)
    json.dump(result, sys.stdout, indent=2)
    print()
    ok = result["succeeded"] >= result["jobs"] - 2 and not result["processes_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
