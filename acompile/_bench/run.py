"""The compile benchmark: acompile against the usual ways of compiling a corpus of Triton kernels.

    python -m acompile._bench.run [--workers N] [--target cuda:90] [--json PATH]
                                  [--only ROW[,ROW]] [--limit K] [--lifecycle] [--tiers]

A plain run runs every row below, then the lifecycle section (``acompile._bench.lifecycle``: no-op
job round trip and throughput, quiesce / wake-up / shutdown, memory per idle worker), written
into the same JSON under ``"lifecycle"``. ``--lifecycle`` (or ``--only lifecycle``) runs that
section alone; ``--lifecycle --only ROW`` runs it and ROW.

``--tiers`` (or ``--only tiers``) runs the cache-tier section (``acompile._bench.tiers``: hit
latency by tier, memory / disk / Redis, and warm start of the corpus from each tier, against
Triton's file cache and its Redis remote cache; it starts a private ``redis-server``), written
into the JSON under ``"tiers"``. A plain run does not include it. Alone, ``--tiers`` runs only
that section; with ``--only`` or ``--lifecycle`` it runs those too.

Every row compiles the same spec list (``corpus()``, or its first ``--limit K`` entries) for the
same target, cold. Each row runs in its own fresh Python process (``python -c`` entry of this
module), with a fresh, empty ``TRITON_CACHE_DIR`` and a fresh, empty ``ACOMPILE_CACHE_DIR`` set in
its environment before it starts, so no row inherits a warmed interpreter, a warmed Triton
(its one-time libtriton.so hash, MLIR set-up) or a cache from another row. In every row process
the corpus module (hence Triton) is imported before the clock starts; everything after that is
timed. The orchestrating process never imports Triton. Before the first row the Triton binaries
are read once so that every row, not only the first, finds them in the OS page cache.

Rows (wall = seconds from the clock start until every result is back in the row's process):

``sequential``
    ``triton.compile`` (``corpus.compile_spec``) of every spec, one after the other, blocking, in
    a fresh process: the first compile pays Triton's one-time costs, as it does in real life. No
    event loop runs, so loop lag is n/a.
``threads``
    ``anyio.to_thread.run_sync(compile_spec, ...)`` with a ``CapacityLimiter(N)``, every spec
    awaited at once from an asyncio event loop (the compiles share the row process and its GIL).
``process_pool``
    ``concurrent.futures.ProcessPoolExecutor(N)`` with a *spawn* context (the row process has
    imported Triton, so fork is unsafe), awaited through ``loop.run_in_executor``. The clock
    includes creating the executor and starting its processes; the worker compiles a spec by its
    index in the corpus and returns the whole ``compiled.asm`` dict (ttir ... ptx, cubin), so a
    realistic payload crosses the process boundary. Shutdown is timed separately.
``anyio_to_process``
    ``anyio.to_process.run_sync`` of the same worker function with a ``CapacityLimiter(N)``; the
    clock includes anyio starting its worker processes.
``acompile_cold``
    ``CompilePool(workers=N, prestart=True)`` over an empty cache: the clock starts *before* the
    pool is entered, so worker start and preload are included; it stops when ``pool.gather()``
    has returned every kernel. Leaving the pool (shutdown) is timed separately.
``acompile_warm_pool``
    The same, but the pool is entered and ``wait_ready()`` has returned before the clock starts
    (preloaded workers, empty cache): the cost of the compiles alone.
``warm_acompile`` (warm start)
    A fresh process (empty Triton cache) opens ``CompilePool(prestart=False)`` on the disk cache
    the ``acompile_cold`` row filled, and gathers every spec. Reported: pool entry -> all kernels
    returned, and interpreter start -> all kernels returned (measured from just before the
    orchestrator starts the process, with the child's wall-clock stamp; ``psutil``'s process
    create time is only accurate to the boot time's whole second, so it is not used). The row
    fails unless ``pool.stats()`` shows only disk hits, no compile and no worker started.
``warm_triton`` (Triton's own warm start)
    A fresh process with ``TRITON_CACHE_DIR`` pointing at the cache the ``sequential`` row filled
    calls ``compile_spec`` for every spec (all Triton cache hits; the row checks that no new cache
    entry appeared). Reported: the first kernel, all kernels, and interpreter start -> all.

Async rows also measure event-loop lag while the clock runs: a probe task loops on
``await anyio.sleep(0.001)`` and records (actual - requested) sleep; p99 and max are reported.
The idle lag of an empty loop on this machine is given as the floor. Every row checks that it
produced a kernel (a non-empty cubin) for every spec and counts failures, and compares each
cubin's digest to the ``sequential`` row's (``cubin≠seq``: how many differ). ``cpu s`` is the
CPU time of the row's process and every process it started and reaped (its workers), ``load``
the 1-minute load average just before the row: on a shared machine, a high load before a row
means its wall time is not trustworthy.

Triton's UserWarnings (``TRITON_DEFAULT_FP_FUSION`` is unset ...) are silenced in the benchmark's
own processes; the environment is left as it is, so every row compiles with the same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

ROWS = (
    "sequential",
    "threads",
    "process_pool",
    "anyio_to_process",
    "acompile_cold",
    "acompile_warm_pool",
    "warm_acompile",
    "warm_triton",
)
TABLE_ROWS = ROWS[:6]
# A warm-start row reads the cache another row filled.
_NEEDS = {"warm_acompile": "acompile_cold", "warm_triton": "sequential"}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD_ENTRY = "import sys; from acompile._bench.run import _child_main; sys.exit(_child_main(sys.argv[1:]))"


# -- helpers shared by the row processes and their workers ---------------------------------------


def _quiet_warnings() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"triton(\..*)?$")
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")


@functools.cache
def _specs(limit: int | None) -> list[Any]:
    from acompile._bench.corpus import corpus

    specs = corpus()
    return specs[:limit] if limit else specs


@functools.cache
def _gpu_target(target: str) -> Any:
    from acompile._targets import parse_target

    return parse_target(target).to_triton()


def _compile_index(index: int, target: str, limit: int | None) -> dict[str, Any]:
    """The worker function of the process rows: compile spec ``index`` and return its asm dict."""
    _quiet_warnings()
    from acompile._bench.corpus import compile_spec

    spec = _specs(limit)[index]
    compiled = compile_spec(spec, _gpu_target(target))
    return {"name": spec.name, "asm": dict(compiled.asm.items())}


def _digest(cubin: Any) -> str | None:
    if not isinstance(cubin, (bytes, bytearray)) or not cubin:
        return None
    return hashlib.sha256(cubin).hexdigest()[:16]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _LagProbe:
    """Samples event-loop lag: how late ``await anyio.sleep(0.001)`` comes back."""

    PERIOD = 0.001

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        import anyio

        while True:
            t = time.perf_counter()
            await anyio.sleep(self.PERIOD)
            self.samples.append(time.perf_counter() - t - self.PERIOD)

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "p50_ms": _ms(_percentile(self.samples, 0.50)),
            "p99_ms": _ms(_percentile(self.samples, 0.99)),
            "max_ms": _ms(max(self.samples) if self.samples else None),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@contextlib.asynccontextmanager
async def _probing() -> AsyncIterator[_LagProbe]:
    import anyio

    probe = _LagProbe()
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe.run)
        try:
            yield probe
        finally:
            tg.cancel_scope.cancel()


class _Outcome:
    """What a row produced: one digest or one error per spec, in spec order."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.digests: list[str | None] = [None] * len(names)
        self.errors: list[str | None] = [None] * len(names)

    def set(self, i: int, cubin: Any = None, error: BaseException | str | None = None) -> None:
        if error is None:
            self.digests[i] = _digest(cubin)
            if self.digests[i] is None:
                error = "no cubin in the result"
        if error is not None:
            text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.errors[i] = text.strip().splitlines()[0][:300] if text.strip() else repr(error)

    def report(self) -> dict[str, Any]:
        failed = {n: e for n, e in zip(self.names, self.errors, strict=True) if e is not None}
        return {
            "specs": len(self.names),
            "ok": len(self.names) - len(failed),
            "failed": len(failed),
            "errors": dict(list(failed.items())[:10]),
            "digests": dict(zip(self.names, self.digests, strict=True)),
        }


# -- the rows (each runs in its own process) ----------------------------------------------------


def _row_sequential(args: argparse.Namespace) -> dict[str, Any]:
    from acompile._bench.corpus import compile_spec

    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    target = _gpu_target(args.target)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    first = None
    for i, spec in enumerate(specs):
        t = time.perf_counter()
        try:
            out.set(i, compile_spec(spec, target).asm["cubin"])
        except Exception as exc:
            out.set(i, error=exc)
        seconds[spec.name] = round(time.perf_counter() - t, 4)
        if first is None:
            first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "first_s": first, "lag": None, "spec_seconds": seconds, **out.report()}


async def _row_threads(args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    from acompile._bench.corpus import compile_spec

    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    target = _gpu_target(args.target)
    limiter = anyio.CapacityLimiter(args.workers)

    async def one(i: int) -> None:
        try:
            compiled = await anyio.to_thread.run_sync(compile_spec, specs[i], target, limiter=limiter)
            out.set(i, compiled.asm["cubin"])
        except Exception as exc:
            out.set(i, error=exc)

    async with _probing() as probe:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(specs)):
                tg.start_soon(one, i)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "lag": probe.summary(), **out.report()}


async def _row_process_pool(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import anyio

    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    loop = asyncio.get_running_loop()

    async def one(executor: ProcessPoolExecutor, i: int) -> None:
        try:
            result = await loop.run_in_executor(executor, _compile_index, i, args.target, args.limit)
            out.set(i, result["asm"].get("cubin"))
        except Exception as exc:
            out.set(i, error=exc)

    async with _probing() as probe:
        t0 = time.perf_counter()
        executor = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(specs)):
                    tg.start_soon(one, executor, i)
            wall = time.perf_counter() - t0
        finally:
            t1 = time.perf_counter()
            await anyio.to_thread.run_sync(functools.partial(executor.shutdown, wait=True))
            shutdown = time.perf_counter() - t1
    return {"wall_s": wall, "shutdown_s": shutdown, "lag": probe.summary(), **out.report()}


async def _row_anyio_to_process(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import anyio.to_process

    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    limiter = anyio.CapacityLimiter(args.workers)

    async def one(i: int) -> None:
        try:
            result = await anyio.to_process.run_sync(
                _compile_index, i, args.target, args.limit, limiter=limiter
            )
            out.set(i, result["asm"].get("cubin"))
        except Exception as exc:
            out.set(i, error=exc)

    async with _probing() as probe:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(specs)):
                tg.start_soon(one, i)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "lag": probe.summary(), **out.report()}


def _acompile_specs(limit: int | None) -> list[Any]:
    import acompile

    return [
        acompile.TritonSpec(s.fn, s.signature, s.constexprs, num_warps=s.num_warps, num_stages=s.num_stages)
        for s in _specs(limit)
    ]


def _acompile_outcome(specs: list[Any], results: list[Any]) -> _Outcome:
    out = _Outcome([s.name for s in specs])
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            out.set(i, error=result)
        else:
            out.set(i, getattr(result, "cubin", None))
    return out


async def _row_acompile(args: argparse.Namespace, *, warm_pool: bool) -> dict[str, Any]:
    import acompile

    specs = _specs(args.limit)
    requests = _acompile_specs(args.limit)
    cache_dir = os.environ["ACOMPILE_CACHE_DIR"]
    extra: dict[str, Any] = {}

    def make_pool() -> Any:
        return acompile.CompilePool(
            workers=args.workers, target=args.target, cache_dir=cache_dir, prestart=True
        )

    if not warm_pool:
        # Pool start is part of the measurement: the probe and the clock start before entry.
        async with _probing() as probe:
            t0 = time.perf_counter()
            async with make_pool() as pool:
                results = await pool.gather(*requests, return_exceptions=True)
                wall = time.perf_counter() - t0
                stats = pool.stats()
                t1 = time.perf_counter()
            extra["shutdown_s"] = time.perf_counter() - t1
    else:
        t_enter = time.perf_counter()
        async with make_pool() as pool:
            await pool.wait_ready()
            extra["ready_s"] = time.perf_counter() - t_enter
            async with _probing() as probe:
                t0 = time.perf_counter()
                results = await pool.gather(*requests, return_exceptions=True)
                wall = time.perf_counter() - t0
            stats = pool.stats()
            t1 = time.perf_counter()
        extra["shutdown_s"] = time.perf_counter() - t1
    out = _acompile_outcome(specs, results)
    return {"wall_s": wall, "lag": probe.summary(), "stats": stats, **extra, **out.report()}


async def _row_warm_acompile(args: argparse.Namespace) -> dict[str, Any]:
    import acompile

    stamps = {"imported": time.time()}
    specs = _specs(args.limit)
    requests = _acompile_specs(args.limit)
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        workers=args.workers, target=args.target, cache_dir=args.warm_cache, prestart=False
    ) as pool:
        t_entered = time.perf_counter()
        results = await pool.gather(*requests, return_exceptions=True)
        wall = time.perf_counter() - t0
        stamps["ready"] = time.time()
        stats = pool.stats()
    out = _acompile_outcome(specs, results)
    n = len(specs)
    problems = []
    if stats["compiled"] != 0 or stats["cache"]["misses"] != 0:
        problems.append(f"compiled {stats['compiled']}, misses {stats['cache']['misses']} (want 0, 0)")
    if stats["cache"]["hits_disk"] != n:
        problems.append(f"disk hits {stats['cache']['hits_disk']} (want {n})")
    if stats["workers"]["started"] != 0:
        problems.append(f"{stats['workers']['started']} workers started (want 0)")
    return {
        "wall_s": wall,
        "enter_s": t_entered - t0,
        "stamps": stamps,
        "stats": stats,
        "assertion": "; ".join(problems) or None,
        **out.report(),
    }


def _row_warm_triton(args: argparse.Namespace) -> dict[str, Any]:
    from acompile._bench.corpus import compile_spec

    stamps = {"imported": time.time()}
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = {p.name for p in cache.iterdir()} if cache.is_dir() else set()
    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    target = _gpu_target(args.target)
    first = None
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        try:
            out.set(i, compile_spec(spec, target).asm["cubin"])
        except Exception as exc:
            out.set(i, error=exc)
        if first is None:
            first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    stamps["ready"] = time.time()
    after = {p.name for p in cache.iterdir()} if cache.is_dir() else set()
    new = len(after - before)
    rest = (wall - first) / (len(specs) - 1) if first is not None and len(specs) > 1 else None
    return {
        "wall_s": wall,
        "first_s": first,
        "rest_each_ms": _ms(rest),
        "stamps": stamps,
        "assertion": f"{new} new Triton cache entries (want 0)" if new else None,
        **out.report(),
    }


_ROW_FUNCS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "sequential": _row_sequential,
    "threads": _row_threads,
    "process_pool": _row_process_pool,
    "anyio_to_process": _row_anyio_to_process,
    "acompile_cold": functools.partial(_row_acompile, warm_pool=False),
    "acompile_warm_pool": functools.partial(_row_acompile, warm_pool=True),
    "warm_acompile": _row_warm_acompile,
    "warm_triton": _row_warm_triton,
}
_ASYNC_ROWS = {
    "threads",
    "process_pool",
    "anyio_to_process",
    "acompile_cold",
    "acompile_warm_pool",
    "warm_acompile",
}


def _child_main(argv: list[str]) -> int:
    """Entry of one row's process: run the row, write its result as JSON to ``--out``."""
    t_start = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", required=True, choices=ROWS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--warm-cache", default=None)
    args = parser.parse_args(argv)
    _quiet_warnings()
    result: dict[str, Any]
    try:
        t = time.perf_counter()
        _specs(args.limit)  # imports the corpus, hence Triton: before every clock
        import_s = time.perf_counter() - t
        func = _ROW_FUNCS[args.row]
        if args.row in _ASYNC_ROWS:
            import anyio

            result = anyio.run(func, args)
        else:
            result = func(args)
        result["import_s"] = import_s
        result["child_start"] = t_start
    except BaseException as exc:
        result = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


# -- the orchestrator ----------------------------------------------------------------------------


def _acompile_version() -> str:
    from acompile._version import __version__

    return __version__


def _machine() -> dict[str, Any]:
    from acompile._sizing import usable_cpus

    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = subprocess.run(
            ["git", "-C", _PACKAGE_ROOT, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        commit = git.stdout.strip() or None
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "triton": version("triton"),
        "anyio": version("anyio"),
        "acompile": _acompile_version(),
        "acompile_commit": commit,
    }


def _prime_page_cache() -> None:
    """Read Triton's binaries once, so the first row does not pay the disk for all rows."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(next(iter(spec.submodule_search_locations)))
    for folder in (root / "_C", root / "backends" / "nvidia" / "bin", root / "backends" / "nvidia" / "lib"):
        if not folder.is_dir():
            continue
        for path in folder.rglob("*"):
            if path.is_file():
                with contextlib.suppress(OSError), open(path, "rb") as f:
                    while f.read(1 << 22):
                        pass


def _idle_lag(seconds: float = 0.5) -> dict[str, Any]:
    import anyio

    async def measure() -> dict[str, Any]:
        async with _probing() as probe:
            await anyio.sleep(seconds)
        return probe.summary()

    return anyio.run(measure)


def run_child(cmd: list[str], env: dict[str, str], folder: Path, timeout: float, what: str) -> dict[str, Any]:
    """Run one measurement in a fresh process and return what it wrote to ``folder/result.json``
    (or why it wrote nothing), with its wall time, the CPU seconds of it and every process it
    started and reaped (its workers), the load average before it, and when it was spawned.

    The process gets a session of its own, so one that hangs is stopped with everything it
    started; its output goes to ``folder/log.txt``, whose tail is kept with the result.
    """
    out, log = folder / "result.json", folder / "log.txt"
    load_before = os.getloadavg()[0]
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as log_file:
        spawned_at = time.time()
        t0 = time.perf_counter()
        child = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
        process_s = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    tail = log.read_text(errors="replace")[-3000:]
    result: dict[str, Any]
    if code is None:
        result = {"crashed": f"timed out after {timeout} s", "log_tail": tail}
    elif not out.exists():
        result = {"crashed": f"{what} process exited {code} without a result", "log_tail": tail}
    else:
        result = json.loads(out.read_text())
        if tail.strip():
            result["log_tail"] = tail
    result["process_s"] = process_s
    result["cpu_s"] = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    result["loadavg_before"] = load_before
    result["spawned_at"] = spawned_at
    return result


def _run_row(name: str, args: argparse.Namespace, root: Path, warm_cache: str | None) -> dict[str, Any]:
    row_dir = root / name
    row_dir.mkdir()
    triton_cache = row_dir / "triton-cache"
    acompile_cache = row_dir / "acompile-cache"
    if name == "warm_triton":
        # Triton's warm start reads the cache the sequential row filled.
        assert warm_cache is not None
        triton_cache = Path(warm_cache)
    triton_cache.mkdir(exist_ok=True)
    acompile_cache.mkdir()
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    env["ACOMPILE_CACHE_DIR"] = str(acompile_cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    out = row_dir / "result.json"
    cmd = [
        sys.executable,
        "-c",
        _CHILD_ENTRY,
        "--row",
        name,
        "--out",
        str(out),
        "--workers",
        str(args.workers),
        "--target",
        args.target,
    ]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if name == "warm_acompile":
        assert warm_cache is not None
        cmd += ["--warm-cache", warm_cache]
    result = run_child(cmd, env, row_dir, args.row_timeout, "row")
    if "stamps" in result:
        # Interpreter start (just before the spawn) -> every kernel ready, on the wall clock.
        result["process_to_ready_s"] = result["stamps"]["ready"] - result["spawned_at"]
        result["process_to_imported_s"] = result["stamps"]["imported"] - result["spawned_at"]
    result["triton_cache_dir"] = str(triton_cache)
    result["acompile_cache_dir"] = str(acompile_cache)
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _report(
    results: dict[str, dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace, n: int
) -> str:
    lines = [
        f"acompile compile benchmark: {n} specs, target {args.target}, {args.workers} workers",
        f"machine: {machine['cpu_count']} CPUs ({machine['usable_cpus']} usable), {machine['cpu_model']}",
        f"python {machine['python']}, triton {machine['triton']}, anyio {machine['anyio']}, "
        f"acompile {machine['acompile']} ({machine['acompile_commit']})",
        f"idle loop lag floor: p99 {_fmt(machine['idle_lag']['p99_ms'], '.2f')} ms, "
        f"max {_fmt(machine['idle_lag']['max_ms'], '.2f')} ms",
        "",
    ]
    seq = results.get("sequential", {})
    seq_wall = seq.get("wall_s")
    seq_digests = seq.get("digests") or {}
    header = (
        f"{'row':<20} {'wall s':>8} {'vs seq':>7} {'lag p99 ms':>11} {'lag max ms':>11} {'ok':>7} "
        f"{'cubin≠seq':>9} {'cpu s':>6} {'load':>5}  notes"
    )
    lines += [header, "-" * len(header)]
    for name in TABLE_ROWS:
        r = results.get(name)
        if r is None:
            continue
        if "crashed" in r:
            lines.append(f"{name:<20} CRASHED: {r['crashed']}")
            continue
        wall = r["wall_s"]
        speed = seq_wall / wall if seq_wall and wall else None
        lag = r.get("lag") or {}
        differ = (
            sum(
                1
                for k, d in (r.get("digests") or {}).items()
                if d and seq_digests.get(k) and d != seq_digests[k]
            )
            if seq_digests and name != "sequential"
            else None
        )
        r["cubins_differing_from_sequential"] = differ
        notes = []
        if r.get("first_s") is not None:
            notes.append(f"first kernel {r['first_s']:.2f} s")
        if r.get("ready_s") is not None:
            notes.append(f"enter+wait_ready {r['ready_s']:.2f} s (untimed)")
        if r.get("shutdown_s") is not None:
            notes.append(f"shutdown {r['shutdown_s']:.2f} s")
        stats = r.get("stats")
        if stats and stats.get("compile_seconds"):
            cs = stats["compile_seconds"]
            notes.append(f"job p50 {cs['p50'] * 1000:.0f} ms, max {cs['max'] * 1000:.0f} ms")
        lines.append(
            f"{name:<20} {wall:>8.2f} {_fmt(speed, '.2f') + 'x' if speed else 'n/a':>7} "
            f"{_fmt(lag.get('p99_ms'), '.2f'):>11} {_fmt(lag.get('max_ms'), '.2f'):>11} "
            f"{str(r['ok']) + '/' + str(r['specs']):>7} {_fmt(differ, 'd'):>9} {r['cpu_s']:>6.1f} "
            f"{r['loadavg_before']:>5.2f}  {', '.join(notes)}"
        )
    lines.append("")
    wa = results.get("warm_acompile")
    if wa is not None:
        if "crashed" in wa:
            lines.append(f"warm start, acompile: CRASHED: {wa['crashed']}")
        else:
            lines.append(
                f"warm start, acompile (fresh process, disk cache of acompile_cold, prestart=False): "
                f"pool entry -> all {wa['specs']} kernels {wa['wall_s'] * 1000:.1f} ms "
                f"(entry {wa['enter_s'] * 1000:.1f} ms); interpreter start -> all "
                f"{wa['process_to_ready_s'] * 1000:.0f} ms (imports done at "
                f"{wa['process_to_imported_s'] * 1000:.0f} ms); whole process {wa['process_s']:.2f} s; "
                f"ok {wa['ok']}/{wa['specs']}; disk hits {wa['stats']['cache']['hits_disk']}, "
                f"compiled {wa['stats']['compiled']}, workers started {wa['stats']['workers']['started']}"
                + (f"; ASSERTION FAILED: {wa['assertion']}" if wa.get("assertion") else "")
            )
    wt = results.get("warm_triton")
    if wt is not None:
        if "crashed" in wt:
            lines.append(f"warm start, Triton: CRASHED: {wt['crashed']}")
        else:
            lines.append(
                f"warm start, Triton (fresh process, TRITON_CACHE_DIR of sequential): first kernel "
                f"{wt['first_s'] * 1000:.1f} ms, all {wt['specs']} {wt['wall_s'] * 1000:.1f} ms "
                f"({_fmt(wt['rest_each_ms'], '.2f')} ms each after the first); interpreter start -> all "
                f"{wt['process_to_ready_s'] * 1000:.0f} ms (imports done at "
                f"{wt['process_to_imported_s'] * 1000:.0f} ms); whole process {wt['process_s']:.2f} s; "
                f"ok {wt['ok']}/{wt['specs']}"
                + (f"; ASSERTION FAILED: {wt['assertion']}" if wt.get("assertion") else "")
            )
    for name, r in results.items():
        if r.get("errors"):
            lines.append(f"{name}: {r['failed']} failed, e.g. {next(iter(r['errors'].items()))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from acompile._sizing import default_workers

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--storm" in argv:
        # The fault storm has options of its own (acompile bench --storm --help).
        from acompile._bench.storm import main as storm_main

        argv.remove("--storm")
        return storm_main(argv)

    parser = argparse.ArgumentParser(prog="acompile bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="workers / threads / processes (default: %(default)s)",
    )
    parser.add_argument("--target", default="cuda:90", help="compile target (default: %(default)s)")
    parser.add_argument(
        "--json", default="bench-results/bench.json", help="where to write the results (default: %(default)s)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated rows to run, of: {', '.join((*ROWS, 'lifecycle', 'tiers'))}",
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first K specs of the corpus")
    parser.add_argument(
        "--row-timeout",
        type=float,
        default=900.0,
        help="seconds before a row is killed (default: %(default)s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the rows' cache folders and logs")
    parser.add_argument(
        "--lifecycle",
        action="store_true",
        help="run the lifecycle section (round trip, quiesce/wake-up/shutdown, memory); alone, "
        "only it (a plain run includes it after the compile rows)",
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="run the cache-tier section (hit latency by tier, warm start from memory, disk and "
        "Redis against Triton's file and Redis caches; starts a private redis-server); alone, only it",
    )
    parser.add_argument(
        "--storm",
        action="store_true",
        help="alone: the fault storm (a compile storm while pool processes are SIGKILLed; "
        "see acompile bench --storm --help)",
    )
    parser.add_argument(
        "--redis-server",
        default=None,
        help="the redis-server executable of --tiers (default: redis-server on PATH)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    selected = [] if args.lifecycle or args.tiers else list(ROWS)
    lifecycle = not args.tiers or args.lifecycle
    tiers = args.tiers
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in ROWS and w not in ("lifecycle", "tiers")]
        if unknown:
            parser.error(f"unknown rows {unknown}; rows are: {', '.join((*ROWS, 'lifecycle', 'tiers'))}")
        lifecycle = args.lifecycle or "lifecycle" in wanted
        tiers = args.tiers or "tiers" in wanted
        # A warm-start row needs the row that fills its cache: run that one too.
        wanted += [_NEEDS[w] for w in wanted if w in _NEEDS]
        selected = [r for r in ROWS if r in wanted]

    from acompile._bench.corpus import __file__ as _corpus_file  # noqa: F401  (fail early if missing)

    machine = _machine()
    _prime_page_cache()
    machine["idle_lag"] = _idle_lag()
    root = Path(tempfile.mkdtemp(prefix="acompile-bench-"))
    results: dict[str, dict[str, Any]] = {}
    lifecycle_section: dict[str, Any] | None = None
    tiers_section: dict[str, Any] | None = None
    n_specs = None
    text = ""
    try:
        for name in selected:
            warm_cache = None
            if name in _NEEDS:
                source = results.get(_NEEDS[name], {})
                warm_cache = source.get(
                    "acompile_cache_dir" if name == "warm_acompile" else "triton_cache_dir"
                )
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            results[name] = _run_row(name, args, root, warm_cache)
            r = results[name]
            n_specs = r.get("specs", n_specs)
            print(
                f"[bench] {name}: "
                + (
                    f"CRASHED {r['crashed']}"
                    if "crashed" in r
                    else f"{r['wall_s']:.2f} s, ok {r['ok']}/{r['specs']}"
                ),
                file=sys.stderr,
                flush=True,
            )
        if selected:
            text = _report(results, machine, args, n_specs or 0)
        if lifecycle:
            from acompile._bench import lifecycle as lifecycle_bench

            lifecycle_section = lifecycle_bench.run(
                root / "lifecycle",
                workers=args.workers,
                target=args.target,
                timeout=args.row_timeout,
                log=sys.stderr,
            )
            lifecycle_text = lifecycle_bench.report(lifecycle_section, machine)
            text = f"{text}\n\n{lifecycle_text}" if text else lifecycle_text
        if tiers:
            from acompile._bench import tiers as tiers_bench

            tiers_section = tiers_bench.run(
                root / "tiers",
                workers=args.workers,
                target=args.target,
                limit=args.limit,
                timeout=args.row_timeout,
                redis_server=args.redis_server,
                log=sys.stderr,
            )
            tiers_text = tiers_bench.report(tiers_section, machine)
            text = f"{text}\n\n{tiers_text}" if text else tiers_text
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(text)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": machine,
        "config": {
            "workers": args.workers,
            "target": args.target,
            "limit": args.limit,
            "rows": selected,
            "lifecycle": lifecycle,
            "tiers": tiers,
            "specs": n_specs,
        },
        "rows": results,
        "lifecycle": lifecycle_section,
        "tiers": tiers_section,
        "report": text,
    }
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"\nresults written to {path}")
    failed = [name for name, r in results.items() if "crashed" in r or r.get("failed") or r.get("assertion")]
    if lifecycle_section is not None:
        from acompile._bench.lifecycle import failed as lifecycle_failed

        failed += lifecycle_failed(lifecycle_section)
    if tiers_section is not None:
        from acompile._bench.tiers import failed as tiers_failed

        failed += tiers_failed(tiers_section)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
