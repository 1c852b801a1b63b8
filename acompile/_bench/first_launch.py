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

Then, in the same process, the host cost of one ``kernel[grid](*args)`` for each kernel, and for
two no-op kernels (no argument, and 19: 5 tensors, 9 ints, 5 constexprs, as Triton's own launch
benchmark has them; compiled after the clock): after a warm-up, ``--launches`` launches in batches
of 50 written out line by line, as a library writes a launch (no loop or function call around
each), with a synchronize between batches (outside the clock); the median batch's time per
launch, on each side. On acompile's side, each batch is followed by a batch of the driver's
``cuLaunchKernelEx`` alone (a C loop with the arguments packed once: what any launcher must pay),
of packing the arguments alone, of the same driver's call made by a C function called from Python
(the floor of any launch from Python; for a kernel with a grid function, that C function calls the
grid function first, so that the floor holds it as it runs in a launch, between two driver calls)
and of the grid function alone; acompile's cost over the driver's, the median of the differences
batch by batch, is the target's figure (grid functions, the library's own code that both sides run
at every launch, left out); its cost over the floor from Python is printed beside it.

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

import triton
import triton.language as tl

import acompile
from acompile._bench import harness, library
from acompile._bench.corpus import acompile_specs
from acompile._bench.spec import Spec

_BATCH = 50
# The launch host cost's target: acompile's cost over the driver's own call, µs.
_OVER_DRIVER_US = 0.5


@triton.jit
def nop() -> None:
    pass


@triton.jit
def nop_args(
    t1, t2, t3, t4, t5, i1, i2, i3, i4, i5, i6, i7, i8, i9,
    c1: tl.constexpr, c2: tl.constexpr, c3: tl.constexpr, c4: tl.constexpr, c5: tl.constexpr,
) -> None:  # fmt: skip
    pass


def nop_cases() -> list[library.Case]:
    """The two no-op kernels with arguments on the current GPU (needs PyTorch)."""
    import torch

    tensors = tuple(torch.empty(64, device="cuda") for _ in range(5))
    ints = (3, 5, 7, 9, 11, 13, 15, 17, 19)  # none 1 or a multiple of 16: plain i32 for Triton too
    signature = {f"t{i}": "*fp32" for i in range(1, 6)} | {f"i{i}": "i32" for i in range(1, 10)}
    constexprs: dict[str, object] = {f"c{i}": i for i in range(1, 6)}
    return [
        library.Case(Spec("nop", nop, {}, {}), (1,), (), ()),
        library.Case(Spec("nop_19_args", nop_args, signature, constexprs), (1,), (*tensors, *ints), ()),
    ]


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
            # After the clock: the no-op kernels, for the launch cost alone.
            nops = nop_cases()
            nop_kernels = await pool.gather(*(_request(c.spec) for c in nops))
            t2 = time.perf_counter()
        exit_s = time.perf_counter() - t2
    n, cache = len(cases), stats["cache"]
    problem = None
    if stats["compiled"] or cache["hits_disk"] != n:
        problem = f"compiled {stats['compiled']}, disk hits {cache['hits_disk']} (want 0, {n})"
    cases, kernels = [*cases, *nops], [*kernels, *nop_kernels]
    batches = {c.spec.name: _batch(k, c.grid, c.args, {}) for c, k in zip(cases, kernels, strict=True)}
    if args.filling:
        # The run that fills the caches also leaves acompile's launcher built (a build started
        # in this process runs in the background), as Triton's first run leaves its own.
        from acompile._backends import launcher_module

        launcher_module(wait=True)
    for case, kernel in zip(cases, kernels, strict=True):
        kernel[case.grid](*case.args)  # loaded (the launcher known) before the parts are read
    # Launches read tensors' addresses through the bridge to PyTorch once it is imported (on a
    # thread, at the first kernel's load), or built (by the filling run): timed after that.
    from acompile._backends import bridge_problem, wait_for_bridge

    bridge = wait_for_bridge()
    parts = {c.spec.name: p for c, k in zip(cases, kernels, strict=True) if (p := _time_parts(c, k))}
    costs = _host_costs(batches, args.launches, parts)
    return {
        # Read after the launches: a kernel's launcher is known once it is loaded.
        "launcher": {c.spec.name: k.launcher for c, k in zip(cases, kernels, strict=True)},
        "bridge": bridge or bridge_problem() or "not in use",
        **set_up,
        "after_setup_s": after,
        "from_start_s": from_start,
        "exit_s": exit_s,
        "assertion": None if args.filling else problem,
        "host_us": {n: c[0] for n, c in costs.items()},
        # The grid functions timed in this process, which the launches above called.
        "grid_us": _grid_costs(cases, args.launches),
        "driver_us": {n: c[1:] for n, c in costs.items() if len(c) > 1},
        "profile": profile.get("text"),
    }


def _request(spec: Spec) -> Any:
    return acompile.TritonSpec(
        spec.fn, spec.signature, spec.constexprs, num_warps=spec.num_warps, num_stages=spec.num_stages
    )


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
    cases = [*cases, *nop_cases()]
    batches = {c.spec.name: _batch(c.spec.fn, c.grid, c.args, c.keywords()) for c in cases}
    return {
        **set_up,
        "after_setup_s": after,
        "from_start_s": from_start,
        "host_us": {n: c[0] for n, c in _host_costs(batches, args.launches).items()},
        "profile": profile.get("text"),
    }


def _set_up(args: argparse.Namespace, imported: float) -> dict[str, float]:
    """The set-up's parts, the same on both sides: the process's start and imports (PyTorch,
    Triton, acompile, the library), then the launch arguments on the GPU (the CUDA context)."""
    return {"imports_s": imported - args.t0, "arguments_s": time.time() - imported}


def _batch(kernel: Any, grid: Any, args: tuple[Any, ...], keywords: dict[str, Any]) -> Callable[[], float]:
    """A function launching ``kernel[grid](*args, **keywords)`` ``_BATCH`` times, as a library
    writes it (the subscript included, each launch a line of its own: no loop or call around
    it), and returning the seconds it took."""
    call = "kernel[grid](*args, **keywords)" if keywords else "kernel[grid](*args)"
    return _written_out(call, kernel=kernel, grid=grid, args=args, keywords=keywords)


def _written_out(line: str, **names: Any) -> Callable[[], float]:
    """A function running ``line`` ``_BATCH`` times, written out, and returning the seconds."""
    lines = f"    {line}\n" * _BATCH
    code = f"def batch():\n    t = perf_counter()\n{lines}    return perf_counter() - t\n"
    namespace: dict[str, Any] = {**names, "perf_counter": time.perf_counter}
    exec(code, namespace)
    return namespace["batch"]  # type: ignore[no-any-return]


def _host_costs(
    batches: dict[str, Callable[[], float]], count: int, parts: dict[str, Callable[[], Any]] | None = None
) -> dict[str, list[float]]:
    """Microseconds of host time per launch, for each kernel: the median of batches of
    ``_BATCH`` launches, ``count`` launches in all (the GPU drained between batches, so a full
    launch queue never blocks a batch). With ``parts`` (acompile's side), each batch is
    followed by batches of the driver's call alone (in a C loop, and called from Python, there
    with the grid function called from C first), of packing alone and of the kernel's grid
    function alone (``_time_parts``), and the figures are [launch, driver call, packing, launch
    minus driver call and grid function, driver call from Python (with the grid function), launch
    minus that, grid function]: the differences are the medians of the differences batch by
    batch, so that the parts of each are measured moments apart."""
    import torch

    costs = {}
    for name, batch in batches.items():
        batch()  # a warm-up
        part = (parts or {}).get(name)
        samples = []
        for _ in range(max(1, count // _BATCH)):
            torch.cuda.synchronize()
            launch = batch() / _BATCH
            sample = [launch]
            if part is not None:
                torch.cuda.synchronize()
                driver, packing, from_python, grid = part()
                sample += [driver, packing, launch - driver - grid, from_python, launch - from_python]
                sample.append(grid)
            samples.append(sample)
        torch.cuda.synchronize()
        costs[name] = [statistics.median(s[i] for s in samples) * 1e6 for i in range(len(samples[0]))]
    return costs


def _time_parts(case: library.Case, kernel: Any) -> Callable[[], tuple[float, float, float, float]] | None:
    """For a kernel acompile's launcher launches (None for another): a function timing a batch
    of the driver's call alone in a C loop, a batch of packing the arguments alone, a batch
    of the driver's call alone made from Python (a C function launching arguments packed
    once, called as ``_batch`` calls a launch: the floor of any launch made from Python; for a
    grid function, the same C function calls it first, with its meta built once: the floor of
    any launch through a grid function, the grid function running between two driver calls as
    it does in a launch), and a batch of the kernel's grid function alone (the library's code,
    which any launcher calls at every launch; 0 for a grid of ints), seconds per launch each."""
    import torch

    if kernel.launcher != "acompile":
        return None
    grid, grid_function = case.grid, None
    if callable(grid):
        meta = {**dict(zip(case.spec.signature, case.args, strict=True)), **case.spec.constexprs}
        grid_function = _written_out("grid(meta)", grid=grid, meta=meta)
        grid = grid(meta)
    call = kernel._launches.driver_call(grid, case.args)
    if grid_function is None:
        from_python = _written_out("call()", call=call)
    else:
        from_python = _written_out("call(grid, meta)", call=call, grid=case.grid, meta=meta)

    def parts() -> tuple[float, float, float, float]:
        driver, packing = kernel._launches.time_parts(grid, case.args, _BATCH)
        torch.cuda.synchronize()
        python = from_python() / _BATCH
        return driver, packing, python, grid_function() / _BATCH if grid_function else 0.0

    return parts


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
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="runs of each side, taking turns, at least 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=1000,
        help=f"launches of each kernel for the host cost, at least {_BATCH} (default: %(default)s)",
    )
    parser.add_argument("--profile", action="store_true", help="add a profiled run of each side")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.launches < _BATCH:
        parser.error(f"--launches must be at least {_BATCH} (one batch), got {args.launches}")
    if need := harness.missing(gpu=True):
        print(f"acompile bench --first-launch: needs {need}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="acompile-first-launch-"))
    names = [s.name for s in library.specs()] + ["nop", "nop_19_args"]
    print(
        f"first launch of {len(names) - 2} library kernels from a warm cache, fresh process, "
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
        if side == "acompile":
            driver = {
                n: [statistics.median(r["driver_us"][n][i] for r in measured) for i in range(6)]
                for n in names
                if all(n in r["driver_us"] for r in measured)
            }
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
    grid_us = {
        n: statistics.median(r["grid_us"][n] for r in measured_runs["acompile"])
        for n in runs["acompile"][1]["grid_us"]
    }
    launchers = runs["acompile"][1]["launcher"]
    over_driver: dict[str, float] = {}
    over_python: dict[str, float] = {}
    for n in names:
        ours_us, theirs_us = host["acompile"][n], host["triton"][n]
        grid = f"{grid_us[n]:.2f}" if n in grid_us else "-"
        ratio = f"{ours_us / theirs_us:.2f}x"
        cells = ["-"] * 5
        if n in driver:
            driver_us, pack_us, over, python_us, over_floor, paired_grid_us = driver[n]
            over_driver[n], over_python[n] = over, over_floor
            grid = f"{paired_grid_us:.2f}" if n in grid_us else grid
            cells = [f"{v:.2f}" for v in (driver_us, pack_us)] + [f"{over:+.2f}", f"{python_us:.2f}"]
            cells.append(f"{over_floor:+.2f}")
        rows.append([n, f"{ours_us:.2f}", f"{theirs_us:.2f}", ratio, grid, *cells, str(launchers[n])])
    header = ["kernel", "acompile", "Triton JIT", "ratio", "of which grid fn", "driver call", "packing"]
    print(harness.table([*header, "over driver", "driver from Python", "over it", "launcher"], rows))
    print(
        "(grid fn: the library's grid function alone, which both sides call at every launch (timed in "
        "acompile's process, a batch after each batch of launches); "
        "driver call: cuLaunchKernelEx alone in a C loop, arguments packed once; packing: the "
        "arguments alone (tensors' addresses and pointer checks, ints, floats); over driver: "
        "acompile minus driver call and grid fn, batch by batch (each batch of launches followed by one "
        "of the driver's call alone and one of the grid fn: the median of the differences); driver from "
        "Python: the driver's call "
        "alone, arguments packed once, made by a C function called from Python as a launch is (the floor "
        "of any launch from Python); for a kernel with a grid fn, the same C function calls the grid fn "
        "first (the floor of a launch through it, the grid fn run between two driver calls as in a "
        "launch); over it: acompile minus it, batch by batch; launcher: whose launcher acompile used)"
    )
    bridge = runs["acompile"][1].get("bridge")
    print(
        "tensors' addresses read "
        + ("through acompile's bridge to PyTorch" if bridge is True else f"by data_ptr() ({bridge})")
    )
    if over_driver:
        worst = max(over_driver, key=over_driver.__getitem__)
        print(
            f"launch host cost over the driver's call: {min(over_driver.values()):+.2f} to "
            f"{over_driver[worst]:+.2f} µs ({worst}); target <= {_OVER_DRIVER_US} µs"
        )
        worst = max(over_python, key=over_python.__getitem__)
        print(
            f"launch host cost over the driver's call made from Python (a grid fn called first, where there "
            f"is one): {min(over_python.values()):+.2f} to {over_python[worst]:+.2f} µs ({worst})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
