"""The lifecycle benchmark: job round trip, quiesce / wake-up / shutdown, memory per idle worker.

    python -m acompile.cli bench --lifecycle [--workers N] [--target cuda:90] [--json PATH]

Run by ``acompile bench`` after the compile rows (or alone with ``--lifecycle`` or
``--only lifecycle``); the results go into the same JSON under ``"lifecycle"``. Every *group*
below runs in its own fresh Python process (``python -c`` entry of this module) with a fresh,
empty ``TRITON_CACHE_DIR`` and ``ACOMPILE_CACHE_DIR`` (``cold_start_memo`` alone reuses the
acompile cache of ``wake``), so no group inherits workers, a warmed interpreter or a cache from
another. Modules (acompile, and Triton where the group preloads it) are imported before any clock.

This module is also a worker-side backend (``setup``, ``preload``, ``compile`` below): the
``noop_acompile`` and ``shutdown`` groups pass ``"acompile._bench.lifecycle"`` to the pool's private
``CompilePool._run(backend_module, payload, name)``, so a job costs the pool's own machinery and
nothing else. Its module level imports only the standard library, so a worker imports it in
well under a millisecond.

Groups (N = ``--workers``; C = 4 N concurrent callers):

``noop_acompile``
    ``CompilePool(workers=N, preload=(), target=..., cache_dir=empty)``; ``_run`` of a job whose
    ``compile(payload)`` returns ``payload``. After a warm-up (every worker started and has imported
    the backend), 1000 sequential round trips (p50 / p99), then 20000 jobs from C callers at once
    (jobs/s). The three no-op groups run 3 times each, interleaved, each time in a fresh process
    (on a small VM the round-trip latency of one process can be twice that of the next, the
    same code): the figures are medians over the runs, and every run is kept.
    Also the CPU time of the benchmark's own process (the event loop) and of all its descendant
    processes (workers, template) per job, and the memory of the idle bare workers.
``noop_anyio``
    The same figures for ``anyio.to_process.run_sync`` of a module-level no-op function with a
    ``CapacityLimiter(N)`` (its workers are started by the warm-up).
``noop_process_pool``
    The same for ``concurrent.futures.ProcessPoolExecutor(N)`` with a *spawn* context through
    ``loop.run_in_executor``.
``wake``
    ``CompilePool(workers=N, target=..., cache_dir=empty)``, Triton preloaded (the default
    ``preload=("triton",)``). Cold start to ready: clock before the pool is entered, stopped when
    ``wait_ready()`` returns. Memory per idle worker and of the template (``pool._workers._template``)
    from ``/proc/<pid>/smaps_rollup`` (Rss, Pss, Private_*) right after ``wait_ready()``, and again
    after compiles. A warm compile: one ``activation_kernel`` spec of the corpus with a distinct
    ``ACT`` constexpr (every ``ACT`` >= 4 takes the same leaky-ReLU branch: identical code to
    compile, distinct cache keys, so every request is a real compile), sequentially, after N
    concurrent compiles have warmed every worker. Then 5 cycles of: ``await pool.quiesce()``
    (timed); polling (every 0.2 ms) until ``stats()["workers"]["alive"] == 0`` and until every
    worker pid has exited (zombie or gone) and is gone from the process table (psutil);
    ``await pool.wakeup()`` (timed: wake-up to ready); the first compile after the wake-up, then N
    compiles at once (every worker of the new epoch has compiled) and one more, timed (the
    control: the same compile on the same, now warm, workers). Then 3 cycles of a cache miss on
    a quiesced pool (quiesce, wait until gone, compile: it wakes the pool by itself). Leaving the
    pool is timed too.
``cold_start_memo``
    A fresh process entering a pool on the acompile cache ``wake`` left (its toolchain memo, i.e.
    Triton's key of its own binaries, is there): cold start to ready as a restarted server sees it.
``shutdown``
    Leaving ``async with`` (i) with every worker idle, (ii) with every worker busy in a job that
    sleeps for 120 s (``{"mode": "sleep"}`` payload of this backend); 3 pools each, Triton
    preloaded, N workers; afterwards no process of the pool (template, workers) may be left.
``memory_spawned``
    ``CompilePool(workers=1, fork_workers=False)``: cold start to ready of one worker started as
    a fresh interpreter, and its memory; then an ``anyio.to_process`` worker that has imported
    Triton and compiled one kernel of the corpus (what a compile worker costs without acompile).

Every latency is ``time.perf_counter()`` in the benchmark's process around the awaited call.
Sanity checks (every no-op result equals its payload, every compile was a real compile, no
process left behind) are reported as ``assertion`` and make ``acompile bench`` exit 1.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

BACKEND = "acompile._bench.lifecycle"
GROUPS = (
    "noop_acompile",
    "noop_anyio",
    "noop_process_pool",
    "wake",
    "cold_start_memo",
    "shutdown",
    "memory_spawned",
)
_NOOP_GROUPS = ("noop_acompile", "noop_anyio", "noop_process_pool")
# cold_start_memo enters a pool on the acompile cache that wake filled.
_CACHE_FROM = {"cold_start_memo": "wake"}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD_ENTRY = (
    "import sys; from acompile._bench.lifecycle import _child_main; sys.exit(_child_main(sys.argv[1:]))"
)
CYCLES = 5
MISS_CYCLES = 3
SHUTDOWN_REPS = 3
NOOP_REPEATS = 3
SLEEP_JOB_S = 120.0
POLL_S = 0.0002


# -- the worker-side backend (imported by acompile's workers) ------------------------------------


def setup(config: dict[str, Any]) -> None:
    """Nothing to set up: this backend does no work."""


def preload(config: dict[str, Any]) -> None:
    """Nothing to preload."""


def compile(payload: Any) -> Any:
    """Return ``payload`` at once; ``{"mode": "sleep", "seconds": s}`` sleeps first (a long job)."""
    if isinstance(payload, dict) and payload.get("mode") == "sleep":
        time.sleep(float(payload["seconds"]))
    return payload


def _noop(payload: Any) -> Any:
    """The function anyio.to_process and ProcessPoolExecutor run."""
    return payload


def _anyio_compile_probe(target: str) -> int:
    """In an anyio worker: import Triton, compile one kernel of the corpus; return the pid."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    from acompile._bench.corpus import compile_spec
    from acompile._targets import parse_target

    compile_spec(_activation_specs(4, 1)[0], parse_target(target).to_triton())
    return os.getpid()


# -- measuring helpers ---------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest rank, as the compile rows compute it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(seconds: float | None, digits: int = 3) -> float | None:
    return None if seconds is None else round(seconds * 1000, digits)


def _median(values: list[float]) -> float | None:
    return _percentile(values, 0.5) if values else None


def _spread_ms(values: list[float]) -> dict[str, Any]:
    return {
        "median_ms": _ms(_median(values)),
        "min_ms": _ms(min(values)) if values else None,
        "max_ms": _ms(max(values)) if values else None,
        "all_ms": [_ms(v) for v in values],
    }


def _memory(pid: int) -> dict[str, float] | None:
    """Rss, Pss, private and shared memory of a process in MiB, from /proc/<pid>/smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[key.strip()] = int(parts[0])

    def mib(*keys: str) -> float:
        return round(sum(kb.get(k, 0) for k in keys) / 1024, 1)

    return {
        "rss_mib": mib("Rss"),
        "pss_mib": mib("Pss"),
        "private_mib": mib("Private_Clean", "Private_Dirty"),
        "shared_mib": mib("Shared_Clean", "Shared_Dirty"),
        "swap_mib": mib("Swap"),
    }


def _memory_summary(worker_pids: list[int], template_pid: int | None = None) -> dict[str, Any]:
    per = {pid: _memory(pid) for pid in worker_pids}
    seen = [m for m in per.values() if m is not None]
    mean = (
        {k: round(sum(m[k] for m in seen) / len(seen), 1) for k in ("rss_mib", "pss_mib", "private_mib")}
        if seen
        else None
    )
    template = _memory(template_pid) if template_pid is not None else None
    total_pss = round(sum(m["pss_mib"] for m in seen) + (template["pss_mib"] if template else 0.0), 1)
    return {
        "workers": len(worker_pids),
        "measured": len(seen),
        "worker_mean": mean,
        "per_worker": {str(pid): m for pid, m in per.items()},
        "template_pid": template_pid,
        "template": template,
        "total_pss_mib": total_pss,
    }


def _descendants_cpu() -> float:
    """CPU seconds (user + system) of every live descendant of this process."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _exited(pid: int) -> bool:
    """The process has terminated: gone from the table, or a zombie waiting to be reaped."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _left_over(pids: list[int]) -> list[int]:
    """Those of pids still running (zombies count as gone: they hold no memory, run nothing)."""
    return [pid for pid in pids if not _exited(pid)]


def _activation_specs(first_act: int, count: int) -> list[Any]:
    """Corpus specs of ``activation_kernel`` with ``ACT`` = first_act, first_act + 1, ...: every
    ACT >= 4 compiles the same leaky-ReLU code, under a distinct cache key."""
    from acompile._bench.corpus import activation_kernel, corpus

    base = next(s for s in corpus() if s.name == "act_leaky_fp32_b1024_w4")
    if first_act < 4:
        raise ValueError("ACT must be >= 4 to keep the same code")
    return [
        type(base)(
            f"act_leaky_fp32_b1024_w4_act{act}",
            activation_kernel,
            dict(base.signature),
            dict(base.constexprs, ACT=act),
            base.num_warps,
            base.num_stages,
        )
        for act in range(first_act, first_act + count)
    ]


class _Specs:
    """Hands out never-used acompile specs (each one a real compile on an empty cache)."""

    def __init__(self) -> None:
        self.next_act = 4

    def take(self, count: int) -> list[Any]:
        import acompile

        specs = _activation_specs(self.next_act, count)
        self.next_act += count
        return [
            acompile.TritonSpec(
                s.fn, s.signature, s.constexprs, num_warps=s.num_warps, num_stages=s.num_stages
            )
            for s in specs
        ]


async def _concurrent(call: Any, jobs: int, callers: int, problems: list[str]) -> None:
    """``jobs`` calls from ``callers`` tasks at once, each taking the next index when free."""
    import anyio

    indices = iter(range(jobs))
    wrong = 0

    async def caller() -> None:
        nonlocal wrong
        for i in indices:
            if await call(i) != i:
                wrong += 1

    async with anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(caller)
    if wrong:
        problems.append(f"{wrong} of {jobs} no-op results differ from their payload")


async def _measure_noop(call: Any, workers: int, args: Any) -> dict[str, Any]:
    """Warm up, then sequential round trips and throughput of ``call(i) -> i``."""
    problems: list[str] = []
    callers = 4 * workers
    # Warm-up: every worker started (on demand for anyio and the executor) and has imported its
    # function's module; then some sequential calls, unmeasured.
    await _concurrent(call, max(200, 50 * callers), callers, problems)
    for i in range(100):
        await call(i)
    latencies = []
    for i in range(args.sequential):
        t = time.perf_counter()
        result = await call(i)
        latencies.append(time.perf_counter() - t)
        if result != i:
            problems.append(f"sequential call {i} returned {result!r}")
            break
    cpu0, kids0 = time.process_time(), _descendants_cpu()
    t0 = time.perf_counter()
    await _concurrent(call, args.jobs, callers, problems)
    wall = time.perf_counter() - t0
    cpu, kids = time.process_time() - cpu0, _descendants_cpu() - kids0
    return {
        "sequential": {
            "calls": len(latencies),
            "p50_ms": _ms(_percentile(latencies, 0.5), 4),
            "p90_ms": _ms(_percentile(latencies, 0.9), 4),
            "p99_ms": _ms(_percentile(latencies, 0.99), 4),
            "max_ms": _ms(max(latencies), 4),
            "mean_ms": _ms(sum(latencies) / len(latencies), 4),
        },
        "throughput": {
            "jobs": args.jobs,
            "callers": callers,
            "wall_s": wall,
            "jobs_per_s": args.jobs / wall,
            "parent_cpu_s": cpu,
            "parent_cpu_us_per_job": cpu / args.jobs * 1e6,
            "workers_cpu_s": kids,
            "workers_cpu_us_per_job": kids / args.jobs * 1e6,
        },
        "assertion": "; ".join(problems[:5]) or None,
    }


# -- the groups (each runs in its own process) ----------------------------------------------------


def _pool_pids(pool: Any) -> tuple[list[int], int | None]:
    """The pool's live worker pids and its template's pid (private attributes, read only)."""
    workers = pool._workers
    template = workers._template
    return sorted(workers.alive), (template.pid if template is not None else None)


def _check_template_children(template_pid: int | None, worker_pids: list[int], problems: list[str]) -> None:
    import psutil

    if template_pid is None:
        problems.append("no template: workers were not forked")
        return
    children = sorted(p.pid for p in psutil.Process(template_pid).children() if not _exited(p.pid))
    if children != worker_pids:
        problems.append(f"the template's children {children} are not the pool's workers {worker_pids}")


async def _group_noop_acompile(args: Any) -> dict[str, Any]:
    import acompile

    cache = os.environ["ACOMPILE_CACHE_DIR"]
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        workers=args.workers, preload=(), target=args.target, cache_dir=cache
    ) as pool:
        await pool.wait_ready()
        ready = time.perf_counter() - t0

        async def call(i: int) -> Any:
            return await pool._run(BACKEND, i, "noop")

        result = await _measure_noop(call, args.workers, args)
        pids, template = _pool_pids(pool)
        result["memory"] = _memory_summary(pids, template)
        result["stats"] = pool.stats()
    result["ready_s"] = ready
    return result


async def _group_noop_anyio(args: Any) -> dict[str, Any]:
    import anyio
    import anyio.to_process
    import psutil

    limiter = anyio.CapacityLimiter(args.workers)

    async def call(i: int) -> Any:
        return await anyio.to_process.run_sync(_noop, i, limiter=limiter)

    result = await _measure_noop(call, args.workers, args)
    pids = sorted(p.pid for p in psutil.Process().children())
    result["memory"] = _memory_summary(pids)
    return result


async def _group_noop_process_pool(args: Any) -> dict[str, Any]:
    import asyncio
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    loop = asyncio.get_running_loop()
    executor = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    try:

        async def call(i: int) -> Any:
            return await loop.run_in_executor(executor, _noop, i)

        result = await _measure_noop(call, args.workers, args)
        processes: dict[int, Any] = getattr(executor, "_processes", None) or {}
        result["memory"] = _memory_summary(sorted(processes))
    finally:
        executor.shutdown(wait=True)
    return result


async def _wait_gone(pool: Any, pids: list[int], since: float) -> dict[str, float | None]:
    """Poll until the pool counts no live worker and every pid has exited and is reaped."""
    import anyio
    import psutil

    alive0 = exited = gone = None
    while True:
        now = time.perf_counter() - since
        if alive0 is None and pool.stats()["workers"]["alive"] == 0:
            alive0 = now
        if exited is None and all(_exited(pid) for pid in pids):
            exited = now
        if gone is None and not any(psutil.pid_exists(pid) for pid in pids):
            gone = now
        if (alive0 is not None and gone is not None) or now > 15:
            break
        await anyio.sleep(POLL_S)
    return {"alive_zero_s": alive0, "exited_s": exited if exited is not None else gone, "gone_s": gone}


async def _timed_compile(pool: Any, spec: Any, problems: list[str]) -> float:
    t = time.perf_counter()
    kernel, tier = await pool.compile_with_tier(spec)
    seconds = time.perf_counter() - t
    if tier != "compile" or not getattr(kernel, "cubin", None):
        problems.append(f"{spec.name}: tier {tier!r}, cubin {bool(getattr(kernel, 'cubin', None))}")
    return seconds


async def _group_wake(args: Any) -> dict[str, Any]:
    import anyio

    import acompile

    n = args.workers
    problems: list[str] = []
    specs = _Specs()
    cache = os.environ["ACOMPILE_CACHE_DIR"]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    pool = acompile.CompilePool(workers=n, target=args.target, cache_dir=cache)
    all_pids: set[int] = set()
    async with pool:
        out["enter_s"] = time.perf_counter() - t0
        await pool.wait_ready()
        out["cold_ready_s"] = time.perf_counter() - t0
        pids, template = _pool_pids(pool)
        all_pids.update(pids)
        _check_template_children(template, pids, problems)
        out["memory_ready"] = _memory_summary(pids, template)
        # The pool's own view (measured every 2 s): compare with ours.
        with anyio.move_on_after(5):
            while len(pool.stats()["workers"]["rss_mib"]) < n:  # noqa: ASYNC110 (polls the pool)
                await anyio.sleep(0.1)
        out["stats_rss_mib"] = pool.stats()["workers"]["rss_mib"]

        # Warm compiles: every worker compiles once (N at once), then one at a time, timed.
        t = time.perf_counter()
        await pool.gather(*specs.take(n))
        out["first_n_concurrent_s"] = time.perf_counter() - t
        warm = [await _timed_compile(pool, spec, problems) for spec in specs.take(max(5, n))]
        out["warm_compile"] = _spread_ms(warm)
        pids, template = _pool_pids(pool)
        out["memory_after_compiles"] = _memory_summary(pids, template)

        cycles: list[dict[str, Any]] = []
        for _ in range(CYCLES):
            await anyio.sleep(0.2)
            pids, template = _pool_pids(pool)
            all_pids.update(pids)
            forked = pool.stats()["workers"]["forked"]
            t = time.perf_counter()
            await pool.quiesce()
            quiesce = time.perf_counter() - t
            gone = await _wait_gone(pool, pids, t)
            out["memory_quiesced"] = _memory_summary([], template)
            if template is None or _pool_pids(pool)[1] != template or _exited(template):
                problems.append("the template did not survive quiesce()")
            t = time.perf_counter()
            await pool.wakeup()
            wakeup = time.perf_counter() - t
            stats = pool.stats()["workers"]
            if stats["alive"] != n or stats["forked"] - forked != n:
                problems.append(f"after wakeup: alive {stats['alive']}, forked {stats['forked'] - forked}")
            first = await _timed_compile(pool, specs.take(1)[0], problems)
            # The control: the same compile once every worker of this epoch has compiled.
            await pool.gather(*specs.take(n))
            again = await _timed_compile(pool, specs.take(1)[0], problems)
            cycles.append(
                {"quiesce_s": quiesce, **gone, "wakeup_s": wakeup, "first_s": first, "warm_again_s": again}
            )
        out["cycles"] = cycles

        misses = []
        for _ in range(MISS_CYCLES):
            await anyio.sleep(0.2)
            pids, _template = _pool_pids(pool)
            all_pids.update(pids)
            t = time.perf_counter()
            await pool.quiesce()
            await _wait_gone(pool, pids, t)
            misses.append(await _timed_compile(pool, specs.take(1)[0], problems))
        out["miss_on_quiesced"] = _spread_ms(misses)
        await pool.wait_ready()
        pids, template = _pool_pids(pool)
        all_pids.update(pids)
        out["stats"] = pool.stats()
        await anyio.sleep(0.2)
        t = time.perf_counter()
    out["shutdown_s"] = time.perf_counter() - t
    left = _left_over([*sorted(all_pids), *([template] if template else [])])
    if left:
        problems.append(f"processes left after shutdown: {left}")

    def series(key: str) -> list[float]:
        return [c[key] for c in cycles if c.get(key) is not None]

    out["summary"] = {
        key: _spread_ms(series(key))
        for key in ("quiesce_s", "alive_zero_s", "exited_s", "gone_s", "wakeup_s", "first_s", "warm_again_s")
    }
    out["assertion"] = "; ".join(problems[:5]) or None
    return out


async def _group_cold_start_memo(args: Any) -> dict[str, Any]:
    import acompile

    cache = os.environ["ACOMPILE_CACHE_DIR"]
    memo = Path(cache) / "toolchain"
    had_memo = memo.is_dir() and any(memo.iterdir())
    t0 = time.perf_counter()
    async with acompile.CompilePool(workers=args.workers, target=args.target, cache_dir=cache) as pool:
        enter = time.perf_counter() - t0
        await pool.wait_ready()
        ready = time.perf_counter() - t0
        pids, template = _pool_pids(pool)
        t = time.perf_counter()
    shutdown = time.perf_counter() - t
    left = _left_over([*pids, *([template] if template else [])])
    problems = [] if had_memo else [f"no toolchain memo in {memo}"]
    if left:
        problems.append(f"processes left after shutdown: {left}")
    return {
        "enter_s": enter,
        "cold_ready_s": ready,
        "shutdown_s": shutdown,
        "had_memo": had_memo,
        "assertion": "; ".join(problems) or None,
    }


async def _group_shutdown(args: Any) -> dict[str, Any]:
    import anyio

    import acompile

    n = args.workers
    cache = os.environ["ACOMPILE_CACHE_DIR"]
    problems: list[str] = []
    idle: list[float] = []
    busy: list[float] = []
    outcomes: dict[str, int] = {}

    for _ in range(SHUTDOWN_REPS):
        async with acompile.CompilePool(workers=n, target=args.target, cache_dir=cache) as pool:
            await pool.wait_ready()
            await anyio.sleep(0.5)
            pids, template = _pool_pids(pool)
            t = time.perf_counter()
        idle.append(time.perf_counter() - t)
        left = _left_over([*pids, *([template] if template else [])])
        if left:
            problems.append(f"idle shutdown left {left}")

    async def sleeper(pool: Any) -> None:
        try:
            await pool._run(BACKEND, {"mode": "sleep", "seconds": SLEEP_JOB_S}, "sleep")
            name = "returned"
        except Exception as exc:
            name = type(exc).__name__
        outcomes[name] = outcomes.get(name, 0) + 1

    for _ in range(SHUTDOWN_REPS):
        async with anyio.create_task_group() as tg:
            async with acompile.CompilePool(workers=n, target=args.target, cache_dir=cache) as pool:
                await pool.wait_ready()
                for _ in range(n):
                    tg.start_soon(sleeper, pool)
                with anyio.move_on_after(30):
                    while pool.stats()["workers"]["busy"] < n:  # noqa: ASYNC110 (polls the pool)
                        await anyio.sleep(0.01)
                await anyio.sleep(0.2)  # every worker is in time.sleep now
                if pool.stats()["workers"]["busy"] != n:
                    problems.append(f"only {pool.stats()['workers']['busy']} of {n} workers busy")
                pids, template = _pool_pids(pool)
                t = time.perf_counter()
            busy.append(time.perf_counter() - t)
            left = _left_over([*pids, *([template] if template else [])])
            if left:
                problems.append(f"busy shutdown left {left}")
    return {
        "idle": _spread_ms(idle),
        "busy": _spread_ms(busy),
        "busy_job_outcomes": outcomes,
        "assertion": "; ".join(problems[:5]) or None,
    }


async def _group_memory_spawned(args: Any) -> dict[str, Any]:
    import anyio
    import anyio.to_process

    import acompile

    cache = os.environ["ACOMPILE_CACHE_DIR"]
    problems: list[str] = []
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        workers=1, target=args.target, cache_dir=cache, fork_workers=False
    ) as pool:
        await pool.wait_ready()
        ready = time.perf_counter() - t0
        pids, template = _pool_pids(pool)
        if template is not None:
            problems.append("fork_workers=False, yet the pool has a template")
        spawned = _memory_summary(pids)
    # What a compile worker costs without acompile: an anyio worker that compiled one kernel.
    pid = await anyio.to_process.run_sync(_anyio_compile_probe, args.target)
    await anyio.sleep(0.2)
    anyio_worker = _memory_summary([pid])
    return {
        "cold_ready_s": ready,
        "memory_spawned": spawned,
        "memory_anyio_after_compile": anyio_worker,
        "assertion": "; ".join(problems) or None,
    }


_GROUP_FUNCS = {
    "noop_acompile": _group_noop_acompile,
    "noop_anyio": _group_noop_anyio,
    "noop_process_pool": _group_noop_process_pool,
    "wake": _group_wake,
    "cold_start_memo": _group_cold_start_memo,
    "shutdown": _group_shutdown,
    "memory_spawned": _group_memory_spawned,
}


def _child_main(argv: list[str]) -> int:
    """Entry of one group's process: run it, write its result as JSON to ``--out``."""
    import argparse
    import json
    import traceback
    import warnings

    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True, choices=GROUPS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--sequential", type=int, required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"triton(\..*)?$")
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    result: dict[str, Any]
    try:
        t = time.perf_counter()
        import anyio
        import psutil  # noqa: F401  (imported before the clock)

        import acompile  # noqa: F401

        if args.group not in _NOOP_GROUPS:
            _activation_specs(4, 1)  # imports the corpus, hence Triton
        import_s = time.perf_counter() - t
        result = anyio.run(_GROUP_FUNCS[args.group], args)
        result["import_s"] = import_s
    except BaseException as exc:
        result = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


# -- the orchestrator ----------------------------------------------------------------------------


def _run_group(
    group: str,
    root: Path,
    *,
    workers: int,
    target: str,
    jobs: int,
    sequential: int,
    timeout: float,
    acompile_cache: Path | None,
) -> dict[str, Any]:
    from acompile._bench.run import run_child

    group_dir = root / group
    group_dir.mkdir(parents=True)
    triton_cache = group_dir / "triton-cache"
    triton_cache.mkdir()
    if acompile_cache is None:
        acompile_cache = group_dir / "acompile-cache"
        acompile_cache.mkdir()
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    env["ACOMPILE_CACHE_DIR"] = str(acompile_cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    out = group_dir / "result.json"  # run_child reads it
    cmd = [
        sys.executable, "-c", _CHILD_ENTRY, "--group", group, "--out", str(out), "--workers", str(workers),
        "--target", target, "--jobs", str(jobs), "--sequential", str(sequential),
    ]  # fmt: skip
    result = run_child(cmd, env, group_dir, timeout, "group")
    result["acompile_cache_dir"] = str(acompile_cache)
    return result


def run(
    root: Path,
    *,
    workers: int,
    target: str,
    jobs: int = 20000,
    sequential: int = 1000,
    noop_repeats: int = NOOP_REPEATS,
    timeout: float = 900.0,
    log: Any = None,
) -> dict[str, Any]:
    """Run every group, each in a fresh process under ``root``; returns the JSON section.

    The no-op groups run ``noop_repeats`` times each, interleaved (acompile, anyio, executor,
    acompile, ...), each time in a fresh process: their figures are the medians over those runs,
    and every run is kept under ``runs``.
    """
    groups: dict[str, dict[str, Any]] = {}

    def one(group: str, folder: Path, acompile_cache: Path | None) -> dict[str, Any]:
        if log is not None:
            print(f"[bench] lifecycle {folder.name}/{group} ...", file=log, flush=True)
        r = _run_group(
            group,
            folder,
            workers=workers,
            target=target,
            jobs=jobs,
            sequential=sequential,
            timeout=timeout,
            acompile_cache=acompile_cache,
        )
        if log is not None:
            status = f"CRASHED {r['crashed']}" if "crashed" in r else f"{r['process_s']:.1f} s"
            if "sequential" in r:
                status += (
                    f", p50 {r['sequential']['p50_ms']:.3f} ms, {r['throughput']['jobs_per_s']:,.0f} jobs/s"
                )
            if r.get("assertion"):
                status += f"; ASSERTION FAILED: {r['assertion']}"
            print(f"[bench] lifecycle {folder.name}/{group}: {status}", file=log, flush=True)
        return r

    runs: dict[str, list[dict[str, Any]]] = {g: [] for g in _NOOP_GROUPS}
    for i in range(noop_repeats):
        for group in _NOOP_GROUPS:
            runs[group].append(one(group, root / f"noop-{i + 1}", None))
    for group in _NOOP_GROUPS:
        groups[group] = _combine_noop(runs[group])
    for group in GROUPS:
        if group in _NOOP_GROUPS:
            continue
        source = groups.get(_CACHE_FROM.get(group, ""), {}).get("acompile_cache_dir")
        if group in _CACHE_FROM and source is None:
            groups[group] = {"crashed": f"needs the cache of {_CACHE_FROM[group]}, which did not run"}
            continue
        groups[group] = one(group, root / "groups", Path(source) if source else None)
    return {
        "config": {
            "tree": _tree_state(),
            "workers": workers,
            "target": target,
            "noop_jobs": jobs,
            "noop_callers": 4 * workers,
            "noop_sequential": sequential,
            "noop_repeats": noop_repeats,
            "cycles": CYCLES,
            "shutdown_reps": SHUTDOWN_REPS,
        },
        "groups": groups,
    }


def _combine_noop(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One no-op group's figures over its runs: the median of each, every run kept."""
    bad = [r for r in runs if "crashed" in r]
    if bad:
        return dict(bad[0], runs=runs)
    out: dict[str, Any] = {"runs": runs}
    for part, keys in (
        ("sequential", ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms")),
        ("throughput", ("jobs_per_s", "wall_s", "parent_cpu_us_per_job", "workers_cpu_us_per_job")),
    ):
        out[part] = {key: _median([r[part][key] for r in runs]) for key in keys}
        out[part]["runs"] = {key: [r[part][key] for r in runs] for key in keys}
    # Memory does not depend on the run's luck: the first run's.
    out["memory"] = runs[0].get("memory")
    out["assertion"] = "; ".join(r["assertion"] for r in runs if r.get("assertion")) or None
    out["process_s"] = sum(r.get("process_s", 0.0) for r in runs)
    out["cpu_s"] = sum(r.get("cpu_s", 0.0) for r in runs)
    out["loadavg_before"] = runs[0].get("loadavg_before")
    return out


def _tree_state() -> list[str]:
    """``git status --short`` of the package: what uncommitted code these figures measured."""
    import subprocess

    try:
        git = subprocess.run(
            ["git", "-C", _PACKAGE_ROOT, "status", "--short", "--", "acompile"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return git.stdout.splitlines()


def failed(section: dict[str, Any]) -> list[str]:
    """Groups that crashed or whose sanity checks failed."""
    return [name for name, r in section["groups"].items() if "crashed" in r or r.get("assertion")]


# -- the report ----------------------------------------------------------------------------------


def _f(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def _get(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _verdict(value: float | None, limit: float, *, at_most: bool = True) -> str:
    if value is None:
        return "n/a"
    return "meets" if (value <= limit if at_most else value >= limit) else "MISSES"


def _mem(m: dict[str, Any] | None) -> str:
    if not m:
        return "n/a"
    return f"{m['rss_mib']:.0f}/{m['pss_mib']:.0f}/{m['private_mib']:.0f}"


def report(section: dict[str, Any], machine: dict[str, Any]) -> str:
    g = section["groups"]
    cfg = section["config"]
    n = cfg["workers"]
    lines = [
        f"acompile lifecycle benchmark: {n} workers, target {cfg['target']}; "
        f"no-op: {cfg['noop_sequential']} sequential, {cfg['noop_jobs']} jobs from "
        f"{cfg['noop_callers']} callers",
        f"machine: {machine['cpu_count']} CPUs ({machine['usable_cpus']} usable), {machine['cpu_model']}",
        f"python {machine['python']}, triton {machine['triton']}, anyio {machine['anyio']}, "
        f"acompile {machine['acompile']} ({machine['acompile_commit']})",
        "",
    ]
    crashed = [f"{name}: CRASHED {r['crashed']}" for name, r in g.items() if "crashed" in r]
    na, nb, npp = g.get("noop_acompile", {}), g.get("noop_anyio", {}), g.get("noop_process_pool", {})
    wake, memo = g.get("wake", {}), g.get("cold_start_memo", {})
    shut, spawned = g.get("shutdown", {}), g.get("memory_spawned", {})

    def rt(r: dict[str, Any]) -> str:
        return (
            f"{_f(_get(r, 'sequential', 'p50_ms'), '.3f')} / {_f(_get(r, 'sequential', 'p99_ms'), '.3f')} ms"
        )

    def tp(r: dict[str, Any]) -> str:
        return _f(_get(r, "throughput", "jobs_per_s"), ",.0f", "/s")

    def spread(r: dict[str, Any], part: str, key: str, spec: str) -> str:
        values = _get(r, part, "runs", key) or []
        return "n/a" if not values else " ".join(format(v, spec) for v in values)

    def cpu(r: dict[str, Any]) -> str:
        return (
            f"{_f(_get(r, 'throughput', 'parent_cpu_us_per_job'), '.0f')} + "
            f"{_f(_get(r, 'throughput', 'workers_cpu_us_per_job'), '.0f')} µs"
        )

    s = wake.get("summary", {})
    mem_ready = wake.get("memory_ready", {})
    mean = mem_ready.get("worker_mean")
    rows: list[tuple[str, str, str, str, str, str]] = [
        (
            "no-op round trip p50 / p99",
            rt(na),
            f"anyio {rt(nb)}; PPE {rt(npp)}",
            "anyio 0.07 ms; Inductor 0.3–0.6 ms",
            "≤ 0.07 ms",
            _verdict(_get(na, "sequential", "p50_ms"), 0.07),
        ),
        (
            f"no-op throughput ({cfg['noop_callers']} callers)",
            tp(na),
            f"anyio {tp(nb)}; PPE {tp(npp)}",
            "~4.5k jobs/s",
            "≥ 10k jobs/s",
            _verdict(_get(na, "throughput", "jobs_per_s"), 10000, at_most=False),
        ),
        (
            f"  p50 ms, each of {cfg['noop_repeats']} processes",
            spread(na, "sequential", "p50_ms", ".3f"),
            f"anyio {spread(nb, 'sequential', 'p50_ms', '.3f')}; "
            f"PPE {spread(npp, 'sequential', 'p50_ms', '.3f')}",
            "",
            "",
            "",
        ),
        (
            f"  jobs/s, each of {cfg['noop_repeats']} processes",
            spread(na, "throughput", "jobs_per_s", ".0f"),
            f"anyio {spread(nb, 'throughput', 'jobs_per_s', '.0f')}; "
            f"PPE {spread(npp, 'throughput', 'jobs_per_s', '.0f')}",
            "",
            "",
            "",
        ),
        (
            "  CPU per no-op job: loop + workers",
            cpu(na),
            f"anyio {cpu(nb)}; PPE {cpu(npp)}",
            "",
            "",
            "",
        ),
        (
            "cold start -> ready (Triton preloaded)",
            f"{_f(wake.get('cold_ready_s'), '.2f')} s",
            f"memo warm {_f(memo.get('cold_ready_s'), '.2f')} s; "
            f"1 spawned (fork_workers=False) {_f(spawned.get('cold_ready_s'), '.2f')} s",
            "Inductor 8–9 s to first result",
            "",
            "",
        ),
        (
            "quiesce: await pool.quiesce()",
            f"{_f(_get(s, 'quiesce_s', 'median_ms'), '.3f')} ms",
            f"max {_f(_get(s, 'quiesce_s', 'max_ms'), '.3f')} ms",
            "Inductor <1 ms",
            "≤ 5 ms",
            _verdict(_get(s, "quiesce_s", "median_ms"), 5),
        ),
        (
            "  quiesce -> alive==0 / exited / reaped",
            f"{_f(_get(s, 'alive_zero_s', 'median_ms'), '.1f')} / "
            f"{_f(_get(s, 'exited_s', 'median_ms'), '.1f')} / {_f(_get(s, 'gone_s', 'median_ms'), '.1f')} ms",
            f"max reaped {_f(_get(s, 'gone_s', 'max_ms'), '.1f')} ms",
            "",
            "",
            "",
        ),
        (
            f"wake-up -> ready ({n} preloaded, med of {cfg['cycles']})",
            f"{_f(_get(s, 'wakeup_s', 'median_ms'), '.1f')} ms",
            f"min {_f(_get(s, 'wakeup_s', 'min_ms'), '.1f')}, "
            f"max {_f(_get(s, 'wakeup_s', 'max_ms'), '.1f')} ms",
            "Inductor 10–123 ms re-fork (no preload)",
            "≤ 150 ms (16)",
            _verdict(_get(s, "wakeup_s", "median_ms"), 150),
        ),
        (
            "  1st compile after wake-up / once warm",
            f"{_f(_get(s, 'first_s', 'median_ms'), '.0f')} / "
            f"{_f(_get(s, 'warm_again_s', 'median_ms'), '.0f')} ms",
            f"warm pool before quiesce {_f(_get(wake, 'warm_compile', 'median_ms'), '.0f')} ms; miss on "
            f"quiesced pool (wakes it) {_f(_get(wake, 'miss_on_quiesced', 'median_ms'), '.0f')} ms",
            "",
            "",
            "",
        ),
        (
            f"shutdown, idle / busy (med of {cfg['shutdown_reps']})",
            f"{_f(_get(shut, 'idle', 'median_ms'), '.1f')} / {_f(_get(shut, 'busy', 'median_ms'), '.1f')} ms",
            f"max {_f(_get(shut, 'idle', 'max_ms'), '.1f')} / {_f(_get(shut, 'busy', 'max_ms'), '.1f')} ms; "
            f"after cycles {_f(_ms(wake.get('shutdown_s')), '.1f')} ms",
            "Inductor 0.9–1.3 s (hangs up to 300 s)",
            "≤ 300 ms",
            _verdict(max(_get(shut, "idle", "max_ms") or 0, _get(shut, "busy", "max_ms") or 0) or None, 300),
        ),
        (
            "idle worker RSS/PSS/private MiB (forked)",
            _mem(mean),
            f"template {_mem(mem_ready.get('template'))}; pool total PSS "
            f"{_f(mem_ready.get('total_pss_mib'), '.0f')} MiB",
            "Inductor >1 GB each",
            "",
            "",
        ),
        (
            "  after compiles / bare (preload=())",
            _mem(_get(wake, "memory_after_compiles", "worker_mean")),
            f"bare template {_mem(_get(na, 'memory', 'template'))}; bare worker "
            f"{_mem(_get(na, 'memory', 'worker_mean'))}",
            "",
            "",
            "",
        ),
        (
            "  spawned worker (fork_workers=False)",
            _mem(_get(spawned, "memory_spawned", "worker_mean")),
            "anyio worker after 1 compile "
            f"{_mem(_get(spawned, 'memory_anyio_after_compile', 'worker_mean'))}; "
            f"bare anyio {_mem(_get(nb, 'memory', 'worker_mean'))}, "
            f"PPE {_mem(_get(npp, 'memory', 'worker_mean'))}",
            "(anyio: no reference figure)",
            "",
            "",
        ),
    ]
    header = ("figure", "acompile", "same run, baselines", "anchor", "target", "vs target")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(6)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*header).rstrip())
    lines.append("-" * (sum(widths) + 10))
    lines += [fmt.format(*r).rstrip() for r in rows]
    lines.append("")
    lines.append(
        "PPE = ProcessPoolExecutor(spawn) via run_in_executor; CPU per job = this process's CPU time "
        "+ its descendants' (workers, template) during the throughput run; memory from smaps_rollup "
        "(RSS/PSS/private MiB; PSS shares pages among the processes that map them)."
    )
    lines.append(
        "Anchors and targets are the project's (16 workers on a 16-core host where it says so); with "
        f"{n} workers on {machine['usable_cpus']} CPUs the verdicts are indicative."
    )
    lines.append(
        "groups (fresh process each; wall s / cpu s / load before): "
        + ", ".join(
            f"{name} {r.get('process_s', 0):.1f}/{r.get('cpu_s', 0):.1f}/{r.get('loadavg_before', 0):.2f}"
            for name, r in g.items()
        )
    )
    for name, r in g.items():
        if r.get("assertion"):
            lines.append(f"{name}: ASSERTION FAILED: {r['assertion']}")
    lines += crashed
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m acompile._bench.lifecycle`` is ``acompile bench --lifecycle``."""
    from acompile._bench.run import main as bench_main

    return bench_main(["--lifecycle", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
