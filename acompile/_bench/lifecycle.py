"""The lifecycle section of ``acompile bench --lifecycle``: job round trip, quiesce / wake-up /
shutdown, memory per idle worker. Each group runs in a fresh process with empty caches.

The no-op groups run a job that returns its payload (this module is the worker-side backend) on
``CompilePool(preload=())``, ``anyio.to_process`` and ``ProcessPoolExecutor`` (spawn): round trips
one at a time, then jobs/s from 4 N callers. ``wake``: cold start, memory per idle worker, then 5
cycles of quiesce / wake-up with a real compile after each (``activation_kernel`` with a fresh
``ACT`` >= 4: the same code under distinct keys). ``shutdown``: leaving the pool while its
workers preload, idle, then busy in a 120 s job.
``spawned``: a worker with ``fork_workers=False`` and an anyio worker that compiled a kernel.
``fairness``: 2 workers, a steady stream of 80 jobs that sleep 0.3-0.6 s (6 in flight, each caller
sending its next as its last ends), and a 0.05 s job sent 1 s in: how long it took, against the
longest job's time (the queue's aging, ``acompile._workers._queue``).

Its module level imports only the standard library: a worker imports it in well under a ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from acompile._bench import harness

BACKEND = "acompile._bench.lifecycle"
GROUPS = ("noop_acompile", "noop_anyio", "noop_process_pool", "wake", "shutdown", "spawned", "fairness")


# -- the worker-side backend (imported by acompile's workers) ------------------------------------


def setup(config: dict[str, Any]) -> None:
    """Nothing to set up: this backend does no work."""


def preload(config: dict[str, Any]) -> None:
    """Nothing to preload."""


def compile(payload: Any) -> Any:
    """Return ``payload`` at once; ``{"sleep": s}`` sleeps first (a long job)."""
    if isinstance(payload, dict):
        time.sleep(float(payload["sleep"]))
    return payload


def _compile_one(target: str) -> int:
    """In an anyio worker: import Triton, compile one kernel of the corpus; return the pid."""
    from acompile._bench.corpus import compile_spec, gpu_target, specs

    harness.quiet_warnings()
    compile_spec(specs()[0], gpu_target(target))
    return os.getpid()


# -- measuring -----------------------------------------------------------------------------------


def memory(pids: list[int]) -> dict[str, float] | None:
    """Mean Rss, Pss and private memory of processes in MiB, from /proc/<pid>/smaps_rollup."""
    seen = []
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = {k.strip(): int(v.split()[0]) for k, _, v in (x.partition(":") for x in text.splitlines()[1:])}
        seen.append((kb["Rss"], kb["Pss"], kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)))
    if not seen:
        return None
    mean = [round(sum(m[i] for m in seen) / len(seen) / 1024, 1) for i in range(3)]
    return {"rss_mib": mean[0], "pss_mib": mean[1], "private_mib": mean[2]}


def _running(pids: list[int]) -> list[int]:
    """Those of pids still running (zombies hold no memory and run nothing: they count as gone)."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    return [pid for pid in pids if alive(pid)]


def _pool_pids(pool: Any) -> tuple[list[int], int | None]:
    """The pool's live worker pids and its template's pid (the local runners', read only)."""
    workers = pool.executor
    template = workers.runners.template
    return sorted(workers.alive), (template.pid if template is not None else None)


async def _noop_calls(call: Any, workers: int) -> dict[str, Any]:
    import anyio

    jobs, callers = 20000, 4 * workers

    async def caller(indices: Any) -> None:
        for i in indices:
            if await call(i) != i:
                raise AssertionError(f"a no-op job returned something else than {i}")

    for n in (max(200, 50 * callers), jobs):  # the warm-up starts every worker, then timed
        indices = iter(range(n))
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(callers):
                tg.start_soon(caller, indices)
        wall = time.perf_counter() - t0
    latencies = []
    for i in range(1000):
        t = time.perf_counter()
        await call(i)
        latencies.append(time.perf_counter() - t)
    return {"round_trip": harness.latency(latencies), "jobs_per_s": jobs / wall}


async def noop(args: argparse.Namespace) -> dict[str, Any]:
    """The no-op groups: ``args.group`` names the executor."""
    import asyncio
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import anyio
    import anyio.to_process
    import psutil

    import acompile
    from acompile._workers import Job

    if args.group == "noop_acompile":
        async with acompile.CompilePool(args.workers, preload=(), target=args.target) as pool:
            result = await _noop_calls(lambda i: pool.executor.run(Job(BACKEND, i, "noop")), args.workers)
            pids, _template = _pool_pids(pool)
            return {**result, "memory": memory(pids)}
    if args.group == "noop_anyio":
        limiter = anyio.CapacityLimiter(args.workers)
        result = await _noop_calls(
            lambda i: anyio.to_process.run_sync(compile, i, limiter=limiter), args.workers
        )
        return {**result, "memory": memory([p.pid for p in psutil.Process().children()])}
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as executor:
        result = await _noop_calls(lambda i: loop.run_in_executor(executor, compile, i), args.workers)
        return {**result, "memory": memory([p.pid for p in psutil.Process().children()])}


async def wake(args: argparse.Namespace) -> dict[str, Any]:
    """Cold start, memory, then quiesce / wake-up cycles."""
    import anyio

    import acompile
    from acompile._bench.corpus import acompile_specs

    base = next(s for s in acompile_specs() if s.constexprs.get("ACT") == 4)
    acts = iter(range(5, 10**6))
    problems: list[str] = []

    async def compile_new(pool: Any) -> float:
        spec = acompile.TritonSpec(base.fn, base.signature, {**base.constexprs, "ACT": next(acts)})
        t = time.perf_counter()
        _, tier = await pool.compile_with_tier(spec)
        if tier != "compile":
            problems.append(f"a fresh spec came from the {tier} tier")
        return time.perf_counter() - t

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    async with acompile.CompilePool(args.workers, target=args.target) as pool:
        await pool.wait_ready()
        out["cold_ready_s"] = time.perf_counter() - t0
        pids, template = _pool_pids(pool)
        out["memory_worker"], out["memory_template"] = memory(pids), memory([template] if template else [])
        async with anyio.create_task_group() as tg:  # N at once: every worker has compiled
            for _ in range(args.workers):
                tg.start_soon(compile_new, pool)
        out["warm_compile_s"] = min([await compile_new(pool) for _ in range(3)])
        cycles = []
        for _ in range(5):
            await anyio.sleep(0.2)
            pids, _ = _pool_pids(pool)
            t = time.perf_counter()
            await pool.quiesce()
            quiesce = time.perf_counter() - t
            while _running(pids) and time.perf_counter() - t < 15:  # noqa: ASYNC110 (polls the OS)
                await anyio.sleep(0.0002)
            reaped = time.perf_counter() - t
            t = time.perf_counter()
            await pool.wait_ready()
            wakeup = time.perf_counter() - t
            first = await compile_new(pool)
            for _ in range(args.workers):
                await compile_new(pool)
            cycles.append({"quiesce": quiesce, "reaped": reaped, "wakeup": wakeup, "first": first})
            cycles[-1]["again"] = await compile_new(pool)
        pids, template = _pool_pids(pool)
        t = time.perf_counter()
    out["shutdown_s"] = time.perf_counter() - t
    for key in cycles[0]:
        out[f"{key}_ms"] = harness.ms(harness.percentile([c[key] for c in cycles], 0.5))
    if left := _running([*pids, *([template] if template else [])]):
        problems.append(f"processes left after shutdown: {left}")
    return {**out, "assertion": "; ".join(problems[:3]) or None}


async def shutdown(args: argparse.Namespace) -> dict[str, Any]:
    """Leaving the default pool while its workers preload (just entered), with every worker
    idle, then with every worker busy in a job (which leaving stops): median and worst of 5."""
    import anyio
    import psutil

    import acompile

    out: dict[str, Any] = {}
    problems = []
    for state in ("preloading", "idle", "busy"):
        times = []
        for _ in range(5):
            async with anyio.create_task_group() as tg:
                async with acompile.CompilePool(args.workers, target=args.target) as pool:
                    if state == "preloading":
                        # The template's interpreter has started, and imports Triton meanwhile.
                        with anyio.move_on_after(30):
                            while not psutil.Process().children():  # noqa: ASYNC110 (polls the OS)
                                await anyio.sleep(0.001)
                        await anyio.sleep(0.05)
                        if pool.stats()["workers"]["alive"]:
                            problems.append("a worker was ready before leaving 'while preloading'")
                    else:
                        await pool.wait_ready()
                    busy = args.workers if state == "busy" else 0
                    for _ in range(busy):
                        tg.start_soon(_sleep_job, pool)
                    with anyio.move_on_after(30):
                        while pool.stats()["workers"]["busy"] < busy:  # noqa: ASYNC110
                            await anyio.sleep(0.01)
                    await anyio.sleep(0.2 if state != "preloading" else 0)
                    pids = [p.pid for p in psutil.Process().children(recursive=True)]
                    t = time.perf_counter()
                times.append(time.perf_counter() - t)
            if left := _running(pids):
                problems.append(f"left after shutdown ({state}): {left}")
        out[f"{state}_ms"] = harness.ms(harness.percentile(times, 0.5))
        out[f"{state}_max_ms"] = harness.ms(max(times))
    return {**out, "assertion": "; ".join(problems[:3]) or None}


async def _sleep_job(pool: Any) -> None:
    from acompile._workers import Job

    try:
        await pool.executor.run(Job(BACKEND, {"sleep": 120.0}, "sleep"))
    except Exception:
        pass  # stopped by the shutdown, as meant


async def spawned(args: argparse.Namespace) -> dict[str, Any]:
    """What a compile worker costs without forking: acompile's and anyio's."""
    import anyio
    import anyio.to_process

    import acompile

    t0 = time.perf_counter()
    async with acompile.CompilePool(1, target=args.target, fork_workers=False) as pool:
        await pool.wait_ready()
        ready = time.perf_counter() - t0
        spawned_memory = memory(_pool_pids(pool)[0])
    pid = await anyio.to_process.run_sync(_compile_one, args.target)
    return {"cold_ready_s": ready, "memory_spawned": spawned_memory, "memory_anyio": memory([pid])}


async def fairness(args: argparse.Namespace) -> dict[str, Any]:
    """A cheap job sent 1 s into a steady stream of longer ones, on 2 workers whatever
    ``--workers`` says (a stream that keeps every worker busy is what is measured)."""
    import statistics

    import anyio

    import acompile
    from acompile._workers import Job

    stream = [round(0.3 + 0.3 * ((7 * i) % 11) / 10, 2) for i in range(80)]
    durations = iter(stream)  # shared: each caller takes the next
    waited: list[float] = []

    def sleeper(name: str, seconds: float) -> Job:
        return Job(BACKEND, {"sleep": seconds}, name, expected_seconds=seconds)

    async def caller() -> None:
        for seconds in durations:
            job = sleeper("stream", seconds)
            await pool.executor.run(job)
            waited.append(job.ended_at - job.queued_at)

    async with acompile.CompilePool(2, preload=(), target=args.target) as pool:
        await pool.wait_ready()
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(caller)
            await anyio.sleep(1.0)
            cheap = sleeper("cheap", 0.05)
            await pool.executor.run(cheap)
    cheap_s = cheap.ended_at - cheap.queued_at
    return {
        "cheap_s": cheap_s,
        "longest_s": max(stream),
        "cheap_to_longest": cheap_s / max(stream),
        "stream_jobs": len(stream),
        "stream_mean_s": statistics.fmean(waited),
        "stream_median_s": statistics.median(waited),
        "stream_max_s": max(waited),
    }


CHILDREN = {
    "noop_acompile": noop,
    "noop_anyio": noop,
    "noop_process_pool": noop,
    "wake": wake,
    "shutdown": shutdown,
    "spawned": spawned,
    "fairness": fairness,
}


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every group, each in a fresh process under ``root``: the JSON section."""
    groups = {}
    for group in GROUPS:
        print(f"[bench] lifecycle {group} ...", file=sys.stderr, flush=True)
        options = {"group": group, "workers": args.workers, "target": args.target}
        env = harness.child_env(root / group)
        groups[group] = harness.run_child("lifecycle", group, options, root / group, env, args.row_timeout)
    return {"workers": args.workers, "groups": groups}


def failed(section: dict[str, Any]) -> list[str]:
    """The groups that crashed or whose checks failed."""
    return [f"lifecycle {g}" for g, r in section["groups"].items() if "crashed" in r or r.get("assertion")]


def report(section: dict[str, Any]) -> str:
    """The section as text."""
    g, f = section["groups"], harness.fmt

    def get(group: str, *keys: str) -> Any:
        value: Any = g.get(group, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def mem(m: dict[str, float] | None) -> str:
        return "n/a" if not m else f"{m['rss_mib']:.0f} / {m['pss_mib']:.0f} / {m['private_mib']:.0f} MiB"

    rows = [
        [name, f(get(group, "round_trip", "p50_ms"), ".3f"), f(get(group, "round_trip", "p99_ms"), ".3f"),
         f(get(group, "jobs_per_s"), ",.0f"), mem(get(group, "memory"))]
        for name, group in (("acompile", "noop_acompile"), ("anyio.to_process", "noop_anyio"),
                            ("ProcessPoolExecutor", "noop_process_pool"))
    ]  # fmt: skip
    lines = [
        f"lifecycle, {section['workers']} workers",
        harness.table(["no-op job", "p50 ms", "p99 ms", "jobs/s", "worker RSS / PSS / private"], rows),
        "",
        f"cold start -> ready, Triton preloaded: {f(get('wake', 'cold_ready_s'))} s; warm compile "
        f"{f(get('wake', 'warm_compile_s'), '.0f', 1000)} ms",
        f"quiesce {f(get('wake', 'quiesce_ms'))} ms, all reaped {f(get('wake', 'reaped_ms'))} ms;"
        f" wake-up -> ready {f(get('wake', 'wakeup_ms'))} ms (median of 5); first compile after wake-up / on"
        f" warm workers {f(get('wake', 'first_ms'), '.0f')} / {f(get('wake', 'again_ms'), '.0f')} ms",
        "shutdown (median / worst of 5): "
        + ", ".join(
            f"{state} {f(get('shutdown', f'{state}_ms'))} / {f(get('shutdown', f'{state}_max_ms'))} ms"
            for state in ("preloading", "idle", "busy")
        ),
        f"idle forked worker {mem(get('wake', 'memory_worker'))}, the template "
        f"{mem(get('wake', 'memory_template'))}, a spawned worker (fork_workers=False) "
        f"{mem(get('spawned', 'memory_spawned'))}, anyio's after a compile "
        f"{mem(get('spawned', 'memory_anyio'))}",
        f"fairness (2 workers, {f(get('fairness', 'stream_jobs'), '.0f')} jobs of 0.3-0.6 s, 6 in flight): a "
        f"0.05 s job sent 1 s in ended after {f(get('fairness', 'cheap_s'))} s, "
        f"{f(get('fairness', 'cheap_to_longest'))}x the longest job (target <= 2x); "
        f"the stream's jobs {f(get('fairness', 'stream_mean_s'))} s mean, "
        f"{f(get('fairness', 'stream_median_s'))} s median, "
        f"{f(get('fairness', 'stream_max_s'))} s max",
    ]
    bad = [k.removeprefix("lifecycle ") for k in failed(section)]
    return "\n".join([*lines, *(f"lifecycle {k}: {g[k].get('crashed') or g[k]['assertion']}" for k in bad)])


def main(argv: list[str] | None = None) -> int:
    """The children's entry (``--child``); the section itself runs from ``acompile bench``."""
    return harness.child_main(CHILDREN, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
