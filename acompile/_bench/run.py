"""The compile benchmark: acompile against the usual ways of compiling a corpus of Triton kernels.

    acompile bench [--workers N] [--target cuda:90] [--json PATH] [--only ROW,...] [--limit K]
                   [--corpus default|library|FILE.py[:NAME]|MODULE[:NAME]]
                   [--lifecycle] [--tiers] [--storm ...] [--first-launch ...] [--autotune ...]

Every row compiles the same specs (the corpus, or its first K) cold, in its own fresh process
with empty Triton and acompile caches; the corpus (hence Triton) is imported before the clock.
``--corpus library`` compiles the kernel library of ``acompile._bench.library`` instead;
``--corpus FILE.py`` or ``--corpus MODULE`` (a dotted name, importable from the current folder)
compiles a corpus module of your own: its ``SPECS`` (a list) or ``specs()`` (a function returning
one), or the attribute ``:NAME`` names (a list, or a function returning one). Each item is an
``acompile._bench.spec.Spec`` or a dict with its fields: ``name`` (unique), ``fn`` (a
``@triton.jit`` function), ``signature`` (each runtime parameter's Triton type), ``constexprs``,
and optionally ``num_warps`` and ``num_stages``. ``examples/bench_corpus.py`` is one. The module
is imported and checked before any row runs, then again in each row's process.

- ``sequential``: ``triton.compile`` of each spec in turn (no loop: lag n/a).
- ``threads``: ``anyio.to_thread.run_sync`` with a ``CapacityLimiter(N)``, all awaited at once.
- ``process_pool``: ``ProcessPoolExecutor(N)`` (spawn) through ``run_in_executor``; starting it
  is timed; each compile returns its whole asm dict.
- ``anyio_to_process``: ``anyio.to_process.run_sync`` with a limiter of N; worker start timed.
- ``acompile_cold``: ``CompilePool(N)`` entered inside the clock (worker start and preload timed),
  on a cache folder with nothing in it: the first pool ever on the machine.
- ``acompile_new_kernels``: the same, on a cache folder that holds what ``acompile_cold``'s pool
  left besides kernels (its ``toolchain`` folder: Triton's key, its workers' bytecode), as any pool
  after the first on a machine finds it: a server restarted with new kernels. None of the corpus
  is in it.
- ``acompile_warm_pool``: the pool entered and ``wait_ready()`` returned before the clock.
- ``warm_acompile``: a fresh process, the default pool (workers prestarted, as users get it) on
  the cache ``acompile_cold`` filled; fails unless every kernel is a disk hit (none compiled).
- ``warm_triton``: a fresh process on the Triton cache ``sequential`` filled (all cache hits).

The two warm rows run ``--warm-repeat`` times each (default 5), taking turns (acompile, Triton,
acompile, ...), each time in a fresh process; the report prints every sample and sets the
medians side by side (of an even count, the lower middle run; one sample of a 50 ms start
varies by a quarter from run to run on a 16-core host). Their JSON rows are the runs of median
time, with ``samples_s`` added.

The report prints the bound no scheduler can beat: max(the sequential row's time / workers, its
longest single compile, the first left out as it carries Triton's one-time costs), and each
parallel row's time as a multiple of it. The longest compile is the median of three: the
sequential row compiles that kernel twice more, alone, after its clock (one sample of a
1.5-2 s compile varies by 15% or more from run to run on a 16-core host, and every ratio with
it). The cold-storm target adds the pool's start: a cold row's time <= 1.15 x (start + bound),
start being the time from the row's clock to its first job running. For acompile_cold and
acompile_new_kernels that is the pool's count of running jobs, polled every 2 ms until it turns
(in a storm, at the first worker ready); for process_pool and anyio_to_process, the moment the
first worker began a compile, as the worker stamped it.

Async rows record event-loop lag (a task sleeping 1 ms in a loop: how late it wakes), and the
full (generation 2) garbage collections CPython ran meanwhile, which stop the loop too (``full
GC``: how many, the longest pause). Every row's
cubins are compared with the sequential row's (``cubin≠seq``). ``cpu s`` counts the row's
process and the workers it reaped; ``load`` is the load average before the row. ``--lifecycle``,
``--tiers``, ``--storm``, ``--first-launch`` and ``--autotune`` run the other sections.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from acompile._bench import harness

ROWS = tuple("sequential threads process_pool anyio_to_process acompile_cold acompile_new_kernels".split())
ROWS += ("acompile_warm_pool",)
_STORMS = len(ROWS)  # the rows of the table (the others: warm starts)
ROWS += ("warm_acompile", "warm_triton")  # fresh processes on the caches the rows above filled
# The rows the report sets against the bound.
_AGAINST_BOUND = tuple(
    "acompile_cold acompile_new_kernels acompile_warm_pool process_pool anyio_to_process".split()
)
# The rows whose clock includes their pool's start, and that measure it (``first_running_s``).
_STARTED = ("acompile_cold", "acompile_new_kernels", "process_pool", "anyio_to_process")
# The cold-storm target: a cold row's wall time at most this multiple of start + bound.
TARGET = 1.15
_WARM = ("warm_acompile", "warm_triton")
# A warm-start row reads the cache another row filled; acompile_new_kernels its toolchain folder.
_NEEDS = {
    "warm_acompile": "acompile_cold",
    "warm_triton": "sequential",
    "acompile_new_kernels": "acompile_cold",
}
# Sections with options of their own, run alone: acompile bench --storm --help.
_PASSTHROUGH = {
    "--storm": "storm",
    "--first-launch": "first_launch",
    "--autotune": "autotune",
    "--farm": "farm",
    "--torch": "compile_torch",
    "--jit": "jit",
}


# -- the rows, each run in a fresh process ------------------------------------------------------


def sequential(args: argparse.Namespace) -> dict[str, Any]:
    """``triton.compile`` of every spec in turn; also Triton's warm start (``warm_triton``)."""
    from acompile._bench.corpus import compile_spec, gpu_target, outcome, specs

    stamps = {"imported": time.time()}
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = set(os.listdir(cache)) if cache.is_dir() else set()
    target, first, results, each = gpu_target(args.target), None, [], []
    t0 = time.perf_counter()
    for spec in specs(args.limit, args.corpus):
        t = time.perf_counter()
        try:
            results.append(compile_spec(spec, target).asm["cubin"])
        except Exception as exc:
            results.append(exc)
        each.append(time.perf_counter() - t)
        first = first or time.perf_counter() - t0
    wall = time.perf_counter() - t0
    stamps["ready"] = time.time()
    new = len((set(os.listdir(cache)) if cache.is_dir() else set()) - before)
    bad = args.warm and new
    # After the row: neither its wall time nor its CPU time (the harness leaves them out).
    after, after_cpu = time.perf_counter(), harness.cpu_time()
    longest = [] if args.warm else _longest_compile(specs(args.limit, args.corpus), each, target)
    uncounted = {
        "uncounted_s": time.perf_counter() - after,
        "uncounted_cpu_s": harness.cpu_time() - after_cpu,
    }
    return {
        "wall_s": wall,
        "first_s": first,
        # The longest single compile, the first aside (it carries Triton's one-time set-up).
        "longest_s": statistics.median(longest) if longest else max(each[1:] or each),
        "longest_samples": longest,
        **uncounted,
        "stamps": stamps,
        "assertion": f"{new} new Triton cache entries (want 0)" if bad else None,
        **outcome(results, args.limit, args.corpus),
    }


def _longest_compile(corpus: list[Any], each: list[float], target: Any) -> list[float]:
    """The longest compile of the sequential pass (the first aside), and two more compiles of
    the same kernel alone, past Triton's cache: three samples, for the bound's median."""
    import triton

    from acompile._bench.corpus import compile_spec

    if len(each) < 2:
        return each
    index = max(range(1, len(each)), key=each.__getitem__)
    samples = [each[index]]
    knobs = triton.knobs.compilation
    always, knobs.always_compile = knobs.always_compile, True
    try:
        for _ in range(2):
            t = time.perf_counter()
            compile_spec(corpus[index], target)
            samples.append(time.perf_counter() - t)
    except Exception:
        return [each[index]]  # the pass failed it too (its row says so)
    finally:
        knobs.always_compile = always
    return samples


async def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """``threads``, ``process_pool`` or ``anyio_to_process`` (``args.row``)."""
    import anyio
    import anyio.to_process

    from acompile._bench.corpus import compile_index, compile_spec, gpu_target, outcome, specs

    n = len(specs(args.limit, args.corpus))
    results: list[Any] = [None] * n
    started: list[float] = []  # when a process worker began each compile (wall clock)
    limiter = anyio.CapacityLimiter(args.workers)
    executor: ProcessPoolExecutor | None = None

    async def one(i: int) -> None:
        try:
            spec, target = specs(args.limit, args.corpus)[i], gpu_target(args.target)
            work = functools.partial(compile_index, i, args.target, args.limit, args.corpus)
            if args.row == "threads":
                asm = (await anyio.to_thread.run_sync(compile_spec, spec, target, limiter=limiter)).asm
            else:
                if executor is not None:
                    out = await asyncio.get_running_loop().run_in_executor(executor, work)
                else:
                    out = await anyio.to_process.run_sync(work, limiter=limiter)
                asm = out["asm"]
                started.append(out["started"])
            results[i] = asm.get("cubin")
        except Exception as exc:
            results[i] = exc

    extra = {}
    async with harness.probing() as lag:
        t0, t0_wall = time.perf_counter(), time.time()
        if args.row == "process_pool":
            # Spawn: this process has imported Triton, so fork is unsafe.
            executor = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        wall = time.perf_counter() - t0
        if started:
            extra["first_running_s"] = min(started) - t0_wall
        if executor is not None:
            t1 = time.perf_counter()
            await anyio.to_thread.run_sync(functools.partial(executor.shutdown, wait=True))
            extra["shutdown_s"] = time.perf_counter() - t1
    row = {"wall_s": wall, "lag": harness.lag_figures(lag), **extra}
    return {**row, **outcome(results, args.limit, args.corpus)}


async def acompile_row(args: argparse.Namespace) -> dict[str, Any]:
    """``acompile_cold``, ``acompile_new_kernels``, ``acompile_warm_pool`` or ``warm_acompile``
    (``args.row``)."""
    import anyio

    import acompile
    from acompile._bench.corpus import acompile_specs, outcome

    stamps = {"imported": time.time()}
    requests = acompile_specs(args.limit, args.corpus)
    warm_start = args.row == "warm_acompile"
    cache = args.warm_cache if warm_start else os.environ["ACOMPILE_CACHE_DIR"]
    extra: dict[str, Any] = {}
    t_enter = time.perf_counter()
    pool = acompile.CompilePool(args.workers, target=args.target, cache_dir=cache)
    async with harness.probing() as lag:
        # The warm pool's clock starts once its workers are ready; the others' before entry.
        if args.row == "acompile_warm_pool":
            await pool.__aenter__()
            await pool.wait_ready()
            extra["ready_s"] = time.perf_counter() - t_enter
            lag.clear()
        t0 = time.perf_counter()
        if args.row != "acompile_warm_pool":
            await pool.__aenter__()
        extra["enter_s"] = time.perf_counter() - t0
        try:
            # The watch lives inside the pool (entered before it, left after it): the pool's
            # exit never runs in the watch's cancelled scope. No job runs before the gather
            # submits it, so the watch, started here, sees the first one.
            async with anyio.create_task_group() as watch:
                if args.row in _STARTED:
                    watch.start_soon(_first_running, pool, t0, extra)
                results = await pool.gather(*requests, return_exceptions=True)
                wall = time.perf_counter() - t0
                stamps["ready"] = time.time()
                watch.cancel_scope.cancel()
            if warm_start:
                extra["memory_hit_us"] = await _memory_hits(pool, requests)
            stats = pool.stats()
            t1 = time.perf_counter()
        finally:
            await pool.__aexit__(None, None, None)
        extra["shutdown_s"] = time.perf_counter() - t1
    problems = []
    if warm_start:
        n, cache_stats = len(requests), stats["cache"]
        if stats["compiled"] or cache_stats["misses"] or cache_stats["hits_disk"] != n:
            problems.append(
                f"compiled {stats['compiled']}, disk hits {cache_stats['hits_disk']} (want 0, {n})"
            )
    return {
        "wall_s": wall,
        "lag": harness.lag_figures(lag),
        "stats": stats,
        "stamps": stamps,
        "assertion": "; ".join(problems) or None,
        **extra,
        **outcome(results, args.limit, args.corpus),
    }


# Passes over the corpus, each request again (every one a memory hit), for the hit's figure.
_HIT_PASSES = 5


async def _memory_hits(pool: Any, requests: list[Any]) -> list[float]:
    """Microseconds a memory hit of ``await pool.compile(spec)`` takes (the same spec asked
    again: a server's hot path), one figure a pass over ``requests``, after they are all loaded."""
    figures = []
    for _ in range(_HIT_PASSES):
        t = time.perf_counter()
        for spec in requests:
            await pool.compile(spec)
        figures.append((time.perf_counter() - t) / max(1, len(requests)) * 1e6)
    return figures


async def _first_running(pool: Any, t0: float, into: dict[str, Any]) -> None:
    """Put in ``into`` the time from ``t0`` (the row's clock) to the first moment ``pool`` runs a
    job (``first_running_s``): its ``stats()`` polled every 2 ms until then, a few microseconds
    each. In a storm every job waits for a worker, so that is the first worker ready, or later if
    keying the requests took longer (then that is the start the storm pays). Resolution: the
    poll's 2 ms plus the loop's lag."""
    import anyio

    polls = 0
    while True:
        polls += 1
        jobs = pool.stats()["jobs"]
        if jobs["running"] or jobs["done"]:  # done: in case one ran between two polls
            into.update(first_running_s=time.perf_counter() - t0, first_running_polls=polls)
            return
        await anyio.sleep(0.002)


CHILDREN = {"sequential": sequential, "warm_triton": sequential, **dict.fromkeys(ROWS[1:4], baseline)}
CHILDREN |= dict.fromkeys(
    ("acompile_cold", "acompile_new_kernels", "acompile_warm_pool", "warm_acompile"), acompile_row
)


# -- the orchestrator ----------------------------------------------------------------------------


def _run_row(
    name: str, args: argparse.Namespace, root: Path, results: dict[str, Any], turn: int = 0
) -> dict[str, Any]:
    folder = root / (f"{name}-{turn}" if turn else name)
    extra = {}
    if name == "warm_triton":
        extra["TRITON_CACHE_DIR"] = results["sequential"]["triton_cache_dir"]
    env = harness.child_env(folder, **extra)
    if name == "acompile_new_kernels":
        # What a pool leaves in its cache folder besides kernels, from acompile_cold's run.
        from acompile._cache import toolchain_dir

        cold = results.get("acompile_cold", {})
        seen = toolchain_dir(Path(cold.get("acompile_cache_dir", root / "acompile_cold")))
        if "crashed" in cold or not seen.is_dir():
            # Run without it, the row would be acompile_cold again under another name.
            why = "crashed" if "crashed" in cold else f"left no {seen.name} folder"
            return {"crashed": f"it runs on what acompile_cold's pool left, and acompile_cold {why}"}
        shutil.copytree(seen, toolchain_dir(Path(env["ACOMPILE_CACHE_DIR"])), symlinks=True)
    options = {"row": name, "workers": args.workers, "target": args.target, "limit": args.limit}
    options["corpus"] = args.corpus
    options.update(
        warm=name == "warm_triton", warm_cache=results.get("acompile_cold", {}).get("acompile_cache_dir")
    )
    result = harness.run_child("run", name, options, folder, env, args.row_timeout)
    result.update(triton_cache_dir=env["TRITON_CACHE_DIR"], acompile_cache_dir=env["ACOMPILE_CACHE_DIR"])
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A repeated row's runs as one: the run of median time (the lower middle one of an even
    count) with every run's time in ``samples_s``; the first that crashed or failed, if one did."""
    bad = [r for r in runs if "crashed" in r or r.get("failed") or r.get("assertion")]
    if bad:
        return bad[0]
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return {**ordered[(len(ordered) - 1) // 2], "samples_s": [r["wall_s"] for r in runs]}


def _full_gc(lag: dict[str, Any]) -> str:
    """The full collections inside a row's lag window: how many, and the longest pause."""
    if not lag or lag.get("full_gc") is None:
        return "n/a"
    return f"{lag['full_gc']} ({lag['full_gc_max_ms']:.1f} ms)" if lag["full_gc"] else "0"


def against_bound(results: dict[str, dict[str, Any]], workers: int) -> dict[str, Any] | None:
    """The bound (None without a sequential row to take it from), each row's time as a multiple
    of it, and, for a row that measured its start, the cold-storm target's figures: start +
    bound, the row's time as a multiple of that, and whether it is within ``TARGET``."""
    seq = results.get("sequential", {})
    if not seq.get("longest_s") or "crashed" in seq:
        return None
    # No pool of N workers beats this: the work shared evenly, or its longest job alone.
    bound = max(seq["wall_s"] / workers, seq["longest_s"])
    rows: dict[str, dict[str, Any]] = {}
    for name in _AGAINST_BOUND:
        r = results.get(name)
        if r is None or "crashed" in r:
            continue
        rows[name] = row = {"wall_s": r["wall_s"], "wall_over_bound": r["wall_s"] / bound}
        if r.get("first_running_s") is not None:
            plus = r["first_running_s"] + bound
            ratio = r["wall_s"] / plus
            row.update(start_s=r["first_running_s"], start_plus_bound_s=plus)
            # A storm in which a compile failed did not do the work: not met, whatever its time.
            row.update(wall_over_start_plus_bound=ratio, met=ratio <= TARGET and r.get("failed", 0) == 0)
    return {
        "bound_s": bound,
        "sequential_s": seq["wall_s"],
        "workers": workers,
        "longest_s": seq["longest_s"],
        "target": TARGET,
        "rows": rows,
    }


def _verdict(row: dict[str, Any], result: dict[str, Any]) -> str:
    """The cold-storm target's word for a row: met, missed, or failed (a compile failed)."""
    return "met" if row["met"] else "failed" if result.get("failed") else "missed"


def _corpus_label(args: argparse.Namespace) -> str:
    """The corpus as the report names it: a built-in one's name, a module as the user gave it."""
    from acompile._bench.corpus import CORPORA

    given = getattr(args, "corpus_given", args.corpus)
    return f"{given} corpus" if given in CORPORA else f"corpus {given}"


def report(results: dict[str, dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace) -> str:
    """The rows as a table, then the warm starts."""
    from acompile._bench.corpus import differing

    n = next((r["specs"] for r in results.values() if "specs" in r), 0)
    lag = machine["idle_lag"]
    lines = [
        f"acompile compile benchmark: {n} specs ({_corpus_label(args)}), target {args.target}, "
        f"{args.workers} workers",
        f"machine: {machine['cpu_count']} CPUs ({machine['usable_cpus']} usable), {machine['cpu_model']}; "
        f"python {machine['python']}, triton {machine['triton']}, anyio {machine['anyio']}, "
        f"acompile {machine['acompile']}",
        f"idle loop lag floor: p99 {harness.fmt(lag['p99_ms'])} ms, max {harness.fmt(lag['max_ms'])} ms",
        "",
    ]
    seq = results.get("sequential", {})
    header = ["row", "wall s", "speed-up", "lag p99 ms", "lag max ms", "full GC", "ok", "cubin≠seq"]
    header += ["cpu s", "load"]
    rows = []
    for name in ROWS[:_STORMS]:
        r = results.get(name)
        if r is None or "crashed" in r:
            rows += [[name, "CRASHED", *[""] * 8]] if r is not None else []
            continue
        r["cubins_differing_from_sequential"] = differ = differing(r, seq) if name != "sequential" else None
        lag = r.get("lag") or {}
        speed = seq.get("wall_s", 0) / r["wall_s"] if seq.get("wall_s") else None
        cells = [harness.fmt(r["wall_s"]), harness.fmt(speed) + "x", harness.fmt(lag.get("p99_ms"))]
        cells += [harness.fmt(lag.get("max_ms")), _full_gc(lag), f"{r['ok']}/{r['specs']}"]
        cells.append(harness.fmt(differ, "d"))
        rows.append([name, *cells, harness.fmt(r["cpu_s"], ".1f"), harness.fmt(r["loadavg_before"])])
    lines += [harness.table(header, rows), ""] if rows else []
    figures = against_bound(results, args.workers)
    if figures is not None:
        bound = figures["bound_s"]
        against = [f"{name} {row['wall_over_bound']:.2f}x" for name, row in figures["rows"].items()]
        text = f"bound = max(sequential {seq['wall_s']:.2f} s / {args.workers} workers, longest compile "
        samples = seq.get("longest_samples") or []
        of = f" (median of {', '.join(f'{x:.2f}' for x in samples)})" if len(samples) > 1 else ""
        text += f"{seq['longest_s']:.2f} s{of}) = {bound:.2f} s"
        lines.append(text + (f"; {', '.join(against)} the bound" if against else ""))
        started = [(name, row) for name, row in figures["rows"].items() if "start_s" in row]
        if started:
            lines += [
                f"start + bound: the row's start (its clock -> its first job running) + the bound; "
                f"the cold-storm target: wall <= {TARGET:.2f}x start + bound",
                harness.table(
                    ["row", "start s", "start + bound s", "wall s", "wall / (start + bound)", "target"],
                    [
                        [
                            name,
                            f"{row['start_s']:.2f}",
                            f"{row['start_plus_bound_s']:.2f}",
                            f"{row['wall_s']:.2f}",
                            f"{row['wall_over_start_plus_bound']:.2f}x",
                            _verdict(row, results[name]),
                        ]
                        for name, row in started
                    ],
                ),
            ]
        lines.append("")
    for name, label in (("warm_acompile", "acompile"), ("warm_triton", "Triton")):
        r = results.get(name, {})
        if not r or "crashed" in r:
            lines += [f"warm start, {label}: CRASHED: {r['crashed']}"] if r else []
            continue
        first = f"first kernel {r['first_s'] * 1000:.1f} ms, " if r.get("first_s") else ""
        samples = r.get("samples_s") or []
        # An even count's row is the lower of the two middle runs (a run as it was, not a mean).
        middle = "median" if len(samples) % 2 else "lower middle"
        of = f" ({middle} of {', '.join(f'{x * 1000:.1f}' for x in samples)})" if len(samples) > 1 else ""
        lines.append(
            f"warm start, {label} (fresh process): {first}all {r['specs']} kernels "
            f"{r['wall_s'] * 1000:.1f} ms{of}; "
            f"interpreter start -> all {r['process_to_ready_s'] * 1000:.0f} ms (imports done at "
            f"{r['process_to_imported_s'] * 1000:.0f} ms); ok {r['ok']}/{r['specs']}"
            + (f"; ASSERTION FAILED: {r['assertion']}" if r.get("assertion") else "")
        )
    hits = sorted(results.get("warm_acompile", {}).get("memory_hit_us") or [])
    if hits:
        lines.append(
            f"memory hit, `await pool.compile(spec)` of a kernel loaded already (the warm-start process, "
            f"{_HIT_PASSES} passes over the corpus): median {hits[len(hits) // 2]:.1f} us a request "
            f"(passes {', '.join(f'{h:.1f}' for h in hits)}); target <= 20 us on a quiet machine"
        )
    ours, theirs = results.get("warm_acompile", {}), results.get("warm_triton", {})
    if ours.get("wall_s") and theirs.get("wall_s") and "crashed" not in ours and "crashed" not in theirs:
        lines.append(
            f"warm start, acompile / Triton: {ours['wall_s'] / theirs['wall_s']:.3f}x all kernels ready"
            + (" (medians)" if len(ours.get("samples_s") or []) > 1 else "")
            + ", "
            f"{ours['process_to_ready_s'] / theirs['process_to_ready_s']:.2f}x from interpreter start"
        )
    bad = {k: r for k, r in results.items() if r.get("errors")}
    return "\n".join(
        [*lines, *(f"{k}: {r['failed']} failed, e.g. {min(r['errors'].items())}" for k, r in bad.items())]
    )


def main(argv: list[str] | None = None) -> int:
    """``acompile bench``: parse the options, run the rows and sections, print and write JSON."""
    import importlib

    from acompile._sizing import default_workers

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return harness.child_main(CHILDREN, argv)
    for flag, module in _PASSTHROUGH.items():
        if flag in argv:
            argv.remove(flag)
            section_main: Any = importlib.import_module(f"acompile._bench.{module}").main
            return int(section_main(argv))
    from acompile._bench.corpus import CorpusError, resolve_corpus, specs

    sections = ("lifecycle", "tiers", "stores")
    parser = argparse.ArgumentParser(prog="acompile bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=default_workers(), help="default: %(default)s")
    parser.add_argument("--target", default="cuda:90", help="compile target (default: %(default)s)")
    parser.add_argument("--json", default="bench-results/bench.json", help="default: %(default)s")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated, of: {', '.join((*ROWS, *sections))}; a warm row also runs the row "
        "that fills its cache (warm_acompile and acompile_new_kernels: acompile_cold; warm_triton: "
        "sequential)",
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first K specs of the corpus")
    parser.add_argument(
        "--corpus",
        default="default",
        metavar="CORPUS",
        help="the kernels to compile: default (68 requests over 12 kernels); library (the 9 "
        "kernels of a kernel library: norms, softmax, activations, rotary, attention, matmuls); or "
        "a module of your own, FILE.py or MODULE (a dotted name, importable from this folder), "
        "whose SPECS (a list), specs() (a function returning one) or, with FILE.py:NAME or "
        "MODULE:NAME, NAME holds the compile requests: each a dict (name, fn: a @triton.jit "
        "function, signature, constexprs, num_warps, num_stages) or the benchmark's Spec of the "
        "same fields; see examples/bench_corpus.py (default: %(default)s)",
    )
    parser.add_argument(
        "--warm-repeat",
        type=int,
        default=5,
        help="runs of each warm row, taking turns; the report sets their medians side by side (for an "
        "even count, the lower of the two middle runs) (default: %(default)s)",
    )
    parser.add_argument(
        "--row-timeout",
        type=float,
        default=900.0,
        help="seconds before a row is killed (default: %(default)s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the rows' cache folders and logs")
    parser.add_argument(
        "--lifecycle", action="store_true", help="round trip, quiesce/wake-up/shutdown, memory"
    )
    parser.add_argument(
        "--tiers", action="store_true", help="hit latency and warm start by cache tier (Redis)"
    )
    parser.add_argument(
        "--stores",
        action="store_true",
        help="fleet tiers: a second machine warm from an object store, a shared folder and Redis; "
        "1,000 small entries through obstore and aiobotocore; processes booting on an empty store",
    )
    parser.add_argument("--boot-processes", type=int, default=8, help="--stores: processes booting together")
    parser.add_argument(
        "--boot-kernels", type=int, default=200, help="--stores: distinct kernels each asks for"
    )
    parser.add_argument(
        "--redis-server", default=None, help="the redis-server of --tiers and --stores (default: on PATH)"
    )
    for flag in _PASSTHROUGH:
        parser.add_argument(
            flag, action="store_true", help=f"a section run alone: acompile bench {flag} --help"
        )
    args = parser.parse_args(argv)
    for option, value in (
        ("--workers", args.workers),
        ("--limit", args.limit),
        ("--warm-repeat", args.warm_repeat),
    ):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    from acompile._errors import UnknownTargetError
    from acompile._targets import parse_target

    try:
        parse_target(args.target)
    except UnknownTargetError as exc:
        parser.error(f"--target: {exc}")
    # A module of the user's is imported and checked here, before any row; the rows get a file
    # as its absolute path.
    args.corpus_given = args.corpus
    try:
        args.corpus = resolve_corpus(args.corpus)
        specs(None, args.corpus)
    except CorpusError as exc:
        # The one line that matters, without the usage block above it (argparse's own errors).
        print(f"acompile bench: error: --corpus {args.corpus_given}: {exc}", file=sys.stderr)
        return 2
    wanted = [w.strip() for w in (args.only or "").split(",") if w.strip()]
    if unknown := [w for w in wanted if w not in ROWS + sections]:
        parser.error(f"unknown rows {unknown}; rows are: {', '.join(ROWS + sections)}")
    run_sections = {s for s in sections if getattr(args, s) or s in wanted}
    if not wanted and not run_sections:
        wanted, run_sections = list(ROWS), {"lifecycle"}
    if "lifecycle" in run_sections and (need := harness.missing(psutil=True)):
        print(
            f"acompile bench: error: the lifecycle rows need {need}; or leave them out: --only with the "
            "storm and warm rows",
            file=sys.stderr,
        )
        return 2
    wanted += [_NEEDS[w] for w in wanted if w in _NEEDS]
    selected = [r for r in ROWS if r in wanted]

    machine = harness.machine()
    harness.prime_page_cache()
    machine["idle_lag"] = harness.idle_lag()
    root = Path(tempfile.mkdtemp(prefix="acompile-bench-"))
    results: dict[str, dict[str, Any]] = {}
    document: dict[str, Any] = {
        "machine": machine,
        "config": {**vars(args), "rows": selected},
        "rows": results,
    }
    texts, failed = [], []
    try:
        warm = [name for name in selected if name in _WARM]
        turns = [(name, 0) for name in selected if name not in _WARM]
        turns += [(name, turn) for turn in range(args.warm_repeat) for name in warm]
        runs: dict[str, list[dict[str, Any]]] = {}
        for name, turn in turns:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            r = _run_row(name, args, root, results, turn)
            runs.setdefault(name, []).append(r)
            results[name] = _median_run(runs[name]) if name in _WARM else r
            done = r.get("crashed") or f"{r['wall_s']:.2f} s, ok {r['ok']}/{r['specs']}"
            print(f"[bench] {name}: {done}", file=sys.stderr, flush=True)
            if ("crashed" in r or r.get("failed") or r.get("assertion")) and name not in failed:
                failed.append(name)
        if selected:
            texts.append(report(results, machine, args))
            document["bound"] = against_bound(results, args.workers)
        for section in sorted(run_sections):
            bench: Any = importlib.import_module(f"acompile._bench.{section}")
            document[section] = bench.run(root / section, args)
            texts.append(bench.report(document[section]))
            failed += bench.failed(document[section])
    finally:
        if args.keep:
            print(f"[bench] the rows' folders (caches, logs) are kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    document["report"] = text = "\n\n".join(texts)
    print(text)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    from acompile._outputs import write_own_file

    # --json names a file of this user's: never written through another user's link.
    write_own_file(path, json.dumps(document, indent=2, default=str).encode())
    print(f"\nresults written to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
