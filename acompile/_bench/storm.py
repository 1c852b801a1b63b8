"""The fault storm: a compile storm while random pool processes are SIGKILLed.

``acompile bench --storm`` (or ``python -m acompile._bench.storm``): real Triton compiles of the
benchmark corpus (each spec with several ``num_warps``, so every job is a distinct compile) into
an empty cache folder, on the default pool but for the worker count, while a killer SIGKILLs a
random process of the pool (a worker, the template, a worker still starting) every 50–300 ms,
every other kill once the pool is back at full size.

What it checks is what the pool promises (docs/reliability.md): no job is lost, a kill of the
template or of a starting worker costs no job, and a job whose own worker is killed under it is
retried once, so the only job that may fail is one whose worker was killed under it twice (a
``WorkerCrashedError`` with ``cause="killed"``). Such jobs are not the pool's doing: the kills come
every 50–300 ms for the first seconds of the storm, while the longest compiles (the corpus's
matmuls and attention kernels, which start first) take longer than that, and a retried job runs at
once, on the replacement worker, where the next kill may land too. So it prints how many jobs
succeeded, how many were killed twice (checked against the kills of workers, two each, and the
pool's count of retries), any other failure (there must be none), jobs lost (none: once no job has
been queued or running for 10 s, a job still without an outcome is lost, and the storm ends), the
kills' pace against the ten longest compiles, how long the pool took to return to full size after a
kill, then quiesce, wake-up and shutdown times, and any process left; it exits 1 where any of that
does not hold.
"""

from __future__ import annotations

import argparse
import itertools
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

from acompile._bench import harness

# How long no job may be queued or running, with jobs still waiting for their outcome, before those
# are counted lost: far longer than a job spends in the pool's front end (its key, the cache
# tiers) before it is queued.
_LOST_AFTER = 10.0


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
    kill_times: list[float] = []
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
                        kill_times.append(time.perf_counter())
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

            async def watchdog() -> None:
                # A job with no outcome that no queue holds and no worker runs is lost: it would
                # hold the storm for ever. Once nothing has been queued or running for
                # _LOST_AFTER seconds, the jobs still waiting are counted lost and the storm ends.
                quiet_since: float | None = None
                while len(outcomes) < len(specs):
                    await anyio.sleep(0.1)
                    now, counts = time.perf_counter(), pool.stats()["jobs"]
                    if counts["queued"] or counts["running"]:
                        quiet_since = None
                    elif quiet_since is None:
                        quiet_since = now
                    elif now - quiet_since >= _LOST_AFTER:
                        tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                tg.start_soon(watchdog)
                for spec in specs:
                    tg.start_soon(one, spec)
            storm_s = time.perf_counter() - t0
            stats = pool.stats()
            t = time.perf_counter()
            await pool.quiesce()
            quiesce_s = time.perf_counter() - t
            t = time.perf_counter()
            await pool.wait_ready()
            await pool.wait_ready()
            wakeup_s = time.perf_counter() - t
            t = time.perf_counter()
        shutdown_s = time.perf_counter() - t
        left = [p.pid for p in _pool_processes()]
    failed = [e for e in outcomes if e is not None]
    # The one failure the pool allows itself: the job's own worker killed under it twice.
    killed_twice = [e for e in failed if isinstance(e, acompile.WorkerCrashedError) and e.cause == "killed"]
    gaps = [b - a for a, b in itertools.pairwise(kill_times)]
    slowest = sorted(seconds for _, seconds in stats["slowest"] if isinstance(seconds, float))
    return {
        "jobs": len(specs),
        "workers": workers,
        "succeeded": len(outcomes) - len(failed),
        "killed_twice": len(killed_twice),
        "failed_otherwise": [
            f"{type(e).__name__}: {str(e).splitlines()[0]}" for e in failed if e not in killed_twice
        ],
        # A job with no outcome that nothing held any more (see watchdog).
        "lost": len(specs) - len(outcomes),
        "retried": stats["jobs"]["retried"],
        "kills": {
            "total": len(killed),
            "template": killed.count("template"),
            "worker": killed.count("worker"),
        },
        # The kills' pace against a long compile's: what makes a job killed twice likely.
        "kills_over_s": round(kill_times[-1] - kill_times[0], 3) if kill_times else None,
        "between_kills_s": {
            "median": round(statistics.median(gaps), 3) if gaps else None,
            "min": round(min(gaps), 3) if gaps else None,
        },
        # The ten longest compiles (matmuls, attention): from the shortest of them to the longest.
        "ten_longest_compiles_s": [round(slowest[0], 3), round(slowest[-1], 3)] if slowest else None,
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


def broken_promises(result: dict[str, Any]) -> list[str]:
    """What of the pool's promise under kills does not hold in ``result``: none when every job
    succeeded or failed only after its worker was killed under it twice, each such job took two of
    the kills of workers and the pool retried it first, no job was lost, and no process is left."""
    broken = []
    if result["lost"]:
        broken.append(f"jobs lost (no outcome): {result['lost']}")
    if result["failed_otherwise"]:
        broken.append(f"jobs failed for another reason than two kills: {len(result['failed_otherwise'])}")
    twice = result["killed_twice"]
    if 2 * twice > result["kills"]["worker"]:
        broken.append(f"jobs killed twice: {twice}, by only {result['kills']['worker']} kills of workers")
    if twice > result["retried"]:
        broken.append(f"jobs killed twice: {twice}, but jobs retried: {result['retried']}")
    if result["processes_left"]:
        broken.append(f"processes left: {result['processes_left']}")
    return broken


def summary(result: dict[str, Any]) -> str:
    """The result in a few lines: where every job went, the kills' pace, and whether the pool's
    promise under kills was kept."""
    twice = result["killed_twice"]
    ten = result["ten_longest_compiles_s"]
    text = (
        f"{result['jobs']} jobs: {result['succeeded']} succeeded, {twice} failed after their own worker was "
        f"killed under them twice (retried once, then WorkerCrashedError), "
        f"{len(result['failed_otherwise'])} failed otherwise, {result['lost']} lost.\n"
        f"{result['kills']['total']} kills ({result['kills']['worker']} of workers) over "
        f"{result['kills_over_s']} s, one every {result['between_kills_s']['median']} s (median); "
        f"the ten longest compiles took {f'{ten[0]}–{ten[1]} s' if ten else 'n/a'} each.\n"
    )
    broken = broken_promises(result)
    verdict = "NOT KEPT: " + "; ".join(broken) if broken else "kept."
    return text + "The pool's promise under kills: " + verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="acompile bench --storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=24, help="SIGKILLs during the storm (default: 24)")
    parser.add_argument("--target", default="cuda:90")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if need := harness.missing(psutil=True):
        print(f"acompile bench --storm: needs {need}", file=sys.stderr)
        return 2
    result = anyio.run(storm, args.jobs, args.workers, args.kills, args.target, args.seed)
    json.dump(result, sys.stdout, indent=2)
    print()
    print(summary(result))
    return 1 if broken_promises(result) else 0


if __name__ == "__main__":
    sys.exit(main())
