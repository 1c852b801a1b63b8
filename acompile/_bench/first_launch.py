"""First launch of a kernel library from a warm cache, and the host cost of each launch:
acompile's default pool against Triton's JIT.

    acompile bench --first-launch [--repeat 5] [--launches 1000] [--profile]
    (python -m acompile._bench.first_launch; needs an NVIDIA GPU and PyTorch)

Each side runs in fresh processes with caches of its own; the first run fills them, the next
``--repeat`` are measured. Before any clock, both sides do the same: import PyTorch, Triton,
acompile and the kernel library (``acompile._bench.library``), and build every kernel's launch
arguments on the GPU (which also creates the CUDA context). Then the clock starts and:

- acompile enters the default ``CompilePool()``, gets every kernel (``pool.gather``; each must be
  a disk hit) and launches each once;
- Triton calls each ``@triton.jit`` kernel once (its cache warm).

After a synchronize the clock stops: reported as "after set-up", and as "from interpreter start"
(the whole process up to that point). acompile's pool exit follows and is reported on its own.
The set-up is reported in two parts, the same work on both sides: the process's start and
imports (on acompile's side, the event loop's start too), then the launch arguments (and with
them the CUDA context).

Then, in the same process, the host cost of one ``kernel[grid](*args)`` for each kernel: after a
warm-up, ``--launches`` launches in batches with a synchronize between batches (outside the
clock); the median batch's time per launch, on each side.

``--profile`` adds a run of each side under cProfile (not measured) and prints the functions that
took the most time between the clock's start and stop (in that process; workers are not profiled).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import acompile
from acompile._bench import harness, library
from acompile._bench.corpus import acompile_specs

_WARMUP = 20
_BATCH = 50


async def acompile_side(args: argparse.Namespace) -> dict[str, Any]:
    """Pool entry -> every kernel of the library launched once, on the default pool."""
    import torch

    imported = time.time()
    cases = library.cases()
    torch.cuda.synchronize()
    set_up = _set_up(args, imported)
    t1 = time.perf_counter()
    with _profiling(args) as profile:
        async with acompile.CompilePool() as pool:
            kernels = await pool.gather(*acompile_specs(which="library"))
            for case, kernel in zip(cases, kernels, strict=True):
                kernel[case.grid](*case.args)
            torch.cuda.synchronize()
            after, from_start = time.perf_counter() - t1, time.time() - args.t0
            stats = pool.stats()
            t2 = time.perf_counter()
        exit_s = time.perf_counter() - t2
    n, cache = len(cases), stats["cache"]
    problem = None
    if stats["compiled"] or cache["hits_disk"] != n:
        problem = f"compiled {stats['compiled']}, disk hits {cache['hits_disk']} (want 0, {n})"
    launches = {c.spec.name: _launcher(k, c.grid, c.args, {}) for c, k in zip(cases, kernels, strict=True)}
    if args.filling:
        # The run that fills the caches also leaves acompile's launcher built (a build started
        # in this process runs in the background), as Triton's first run leaves its own.
        from acompile._backends import launcher_module

        launcher_module(wait=True)
    return {
        "launcher": {c.spec.name: k.launcher for c, k in zip(cases, kernels, strict=True)},
        **set_up,
        "after_setup_s": after,
        "from_start_s": from_start,
        "exit_s": exit_s,
        "assertion": None if args.filling else problem,
        "host_us": _host_costs(launches, args.launches),
        "profile": profile.get("text"),
    }


def triton_side(args: argparse.Namespace) -> dict[str, Any]:
    """Every kernel of the library launched once through Triton's JIT, its cache warm."""
    import torch

    imported = time.time()
    cases = library.cases()
    torch.cuda.synchronize()
    set_up = _set_up(args, imported)
    t1 = time.perf_counter()
    with _profiling(args) as profile:
        for case in cases:
            case.spec.fn[case.grid](*case.args, **case.keywords())
        torch.cuda.synchronize()
        after, from_start = time.perf_counter() - t1, time.time() - args.t0
    launches = {c.spec.name: _launcher(c.spec.fn, c.grid, c.args, c.keywords()) for c in cases}
    return {
        "grid_us": _grid_costs(cases, args.launches),
        **set_up,
        "after_setup_s": after,
        "from_start_s": from_start,
        "host_us": _host_costs(launches, args.launches),
        "profile": profile.get("text"),
    }


def _set_up(args: argparse.Namespace, imported: float) -> dict[str, float]:
    """The set-up's parts, the same on both sides: the process's start and imports (PyTorch,
    Triton, acompile, the library), then the launch arguments on the GPU (the CUDA context)."""
    return {"imports_s": imported - args.t0, "arguments_s": time.time() - imported}


def _launcher(kernel: Any, grid: Any, args: tuple[Any, ...], keywords: dict[str, Any]) -> Callable[[], Any]:
    """``kernel[grid](*args, **keywords)`` as a library writes it, subscript included."""

    def launch() -> Any:
        return kernel[grid](*args, **keywords)

    return launch


def _host_costs(launches: dict[str, Callable[[], Any]], count: int) -> dict[str, float]:
    """Microseconds of host time per launch, for each kernel: the median batch of ``count``
    launches (the GPU drained between batches, so a full launch queue never blocks a batch)."""
    import torch

    costs = {}
    for name, launch in launches.items():
        for _ in range(_WARMUP):
            launch()
        per_launch = []
        for _ in range(max(1, count // _BATCH)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(_BATCH):
                launch()
            per_launch.append((time.perf_counter() - t) / _BATCH)
        torch.cuda.synchronize()
        costs[name] = statistics.median(per_launch) * 1e6
    return costs


def _grid_costs(cases: list[library.Case], count: int) -> dict[str, float]:
    """Microseconds per call of each kernel's grid function alone (the library's code, which
    both sides call at every launch), for the kernels whose grid is one."""
    costs = {}
    for case in cases:
        if callable(case.grid):
            meta = {**dict(zip(case.spec.signature, case.args, strict=True)), **case.spec.constexprs}
            grid = case.grid
            t = time.perf_counter()
            for _ in range(count):
                grid(meta)
            costs[case.spec.name] = (time.perf_counter() - t) / count * 1e6
    return costs


@contextlib.contextmanager
def _profiling(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """cProfile around the body when ``args.profile``; the top functions land in the dict."""
    found: dict[str, str] = {}
    if not args.profile:
        yield found
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield found
    finally:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        found["text"] = text.getvalue()


CHILDREN = {"acompile": acompile_side, "triton": triton_side}


def main(argv: list[str] | None = None) -> int:
    """Run both sides ``--repeat`` times each and print the medians."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        import torch  # noqa: F401  (the imports are part of interpreter start, not of the launch)

        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(
        prog="acompile bench --first-launch", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--launches", type=int, default=1000, help="per kernel, for the host cost")
    parser.add_argument("--profile", action="store_true", help="add a profiled run of each side")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.launches < _BATCH:
        parser.error(f"--repeat must be at least 1 and --launches at least {_BATCH}")
    folder = Path(tempfile.mkdtemp(prefix="acompile-first-launch-"))
    names = [s.name for s in library.specs()]
    print(
        f"first launch of {len(names)} library kernels from a warm cache, fresh process, "
        f"median of {args.repeat}; machine: {harness.machine()['cpu_count']} CPUs"
    )
    medians: dict[str, dict[str, float]] = {}
    host: dict[str, dict[str, float]] = {}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in CHILDREN}
    envs = {side: harness.child_env(folder / side) for side in CHILDREN}
    # The sides take turns, run by run, so that a machine getting busier or quieter (the page
    # cache, another process) weighs on both alike. The first run of each fills its caches; a
    # profiled one, last, is not measured.
    for i in range(args.repeat + 1 + args.profile):
        for side in CHILDREN:
            options = {
                "t0": time.time(),
                "launches": args.launches,
                "filling": i == 0,
                "profile": i > args.repeat,
            }
            r = harness.run_child("first_launch", side, options, folder / side / str(i), envs[side], 600)
            if "crashed" in r or r.get("assertion"):
                print(f"  {side}: FAILED {r.get('crashed') or r['assertion']}\n{r.get('log_tail', '')}")
                return 1
            runs[side].append(r)
    for side in CHILDREN:
        measured = runs[side][1 : args.repeat + 1]
        medians[side] = {
            key: statistics.median(r[key] for r in measured) * 1000
            for key in ("imports_s", "arguments_s", "after_setup_s", "from_start_s", "exit_s")
            if key in measured[0]
        }
        host[side] = {n: statistics.median(r["host_us"][n] for r in measured) for n in names}
        if runs[side][-1].get("profile"):
            print(f"--- profile, {side} (an extra run) ---\n{runs[side][-1]['profile']}")
    ours, theirs = medians["acompile"], medians["triton"]
    print(
        f"  acompile (default pool)  after set-up {ours['after_setup_s']:8.1f} ms   "
        f"from interpreter start {ours['from_start_s']:8.1f} ms   (then pool exit {ours['exit_s']:.1f} ms)"
    )
    print(
        f"  Triton JIT (warm cache)  after set-up {theirs['after_setup_s']:8.1f} ms   "
        f"from interpreter start {theirs['from_start_s']:8.1f} ms"
    )
    print(
        f"  acompile / Triton: after set-up {ours['after_setup_s'] / theirs['after_setup_s']:.2f}x, "
        f"from interpreter start {ours['from_start_s'] / theirs['from_start_s']:.2f}x"
    )
    measured_runs = {side: runs[side][1 : args.repeat + 1] for side in CHILDREN}
    whole = {side: [r["from_start_s"] * 1000 for r in measured_runs[side]] for side in CHILDREN}
    paired = [a - t for a, t in zip(whole["acompile"], whole["triton"], strict=True)]
    print(
        "  from interpreter start, run by run (the sides take turns), ms: "
        f"acompile {', '.join(f'{v:.0f}' for v in whole['acompile'])}; "
        f"Triton {', '.join(f'{v:.0f}' for v in whole['triton'])}; "
        f"acompile minus Triton, turn by turn: median {statistics.median(paired):+.0f} ms"
    )
    print(
        "  set-up, the same on both sides (start and imports; launch arguments and CUDA context): "
        f"acompile's processes {ours['imports_s']:.1f} + {ours['arguments_s']:.1f} ms, "
        f"Triton's {theirs['imports_s']:.1f} + {theirs['arguments_s']:.1f} ms"
    )
    print(
        f"\nhost cost of one kernel[grid](*args), µs (median of batches of {_BATCH}, "
        f"{args.launches} launches):"
    )
    rows = []
    grid_us = runs["triton"][1]["grid_us"]
    launchers = runs["acompile"][1]["launcher"]
    for n in names:
        ours_us, theirs_us = host["acompile"][n], host["triton"][n]
        grid = f"{grid_us[n]:.2f}" if n in grid_us else "-"
        ratio = f"{ours_us / theirs_us:.2f}x"
        rows.append([n, f"{ours_us:.2f}", f"{theirs_us:.2f}", ratio, grid, launchers[n]])
    print(harness.table(["kernel", "acompile", "Triton JIT", "ratio", "of which grid fn", "launcher"], rows))
    print(
        "(grid fn: the library's grid function alone, which both sides call at every launch; "
        "launcher: whose launcher acompile used)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
