"""First-call autotune time of a matmul with 18 configs: acompile's autotune against
``@triton.autotune``, each in a fresh process with empty caches.

    python -m acompile._bench.autotune [--size 4096] [--workers N] [--timeline]

Needs an NVIDIA GPU and PyTorch. The kernel is the corpus's ``matmul_kernel`` (fp16), which
acompile compiles as Triton's JIT does for these tensors (unit strides as constants, sizes and
the other strides divisible by 16). Before its clock starts, every side has done the same work:
imported torch, triton and acompile, allocated the inputs on the GPU (so its CUDA context
exists) and synchronized; nothing has touched Triton's driver. Then each side times one
synchronized first call:

- Triton: the first launch of the ``@triton.autotune`` kernel (it compiles and benchmarks one
  config after another).
- acompile, pool already up: ``pool.autotune()`` in a pool entered and ready before the clock, as
  in a server that enters its pool at start-up (every config compiled at once, the longest
  expected first; each benchmarked as it lands while the others compile).
- acompile, the next process: the same on the cache the previous side filled (the stored
  choice, nothing benchmarked).

Each side also reports its whole process, interpreter start to the end of the first call (pool
start included). Each checks its result against ``torch.matmul``. Then the two sides' winners are
timed alternately in one process with ``triton.testing.do_bench`` (what ``@triton.autotune``
measures with), so that a different choice shows whether it is as fast.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from acompile._bench import harness
from acompile._bench.corpus import (
    MATMUL_ATTRS,
    MATMUL_SIG,
    matmul_args,
    matmul_configs,
    matmul_grid,
    matmul_kernel,
)

_VERIFY_ROUNDS = 5
# Triton's JIT compiles an integer argument equal to 1 in as a constant: for contiguous tensors,
# the unit strides. acompile's side does the same, or it would tune a kernel that loads element
# by element, many times slower than the one Triton tunes.
UNIT_STRIDES = {"stride_ak": 1, "stride_bn": 1, "stride_cn": 1}
SIGNATURE = {name: ty for name, ty in MATMUL_SIG.items() if name not in UNIT_STRIDES}
TRITON = "triton @autotune"
POOL_UP = "acompile autotune, pool already up"
NEXT = "acompile, next process (stored choice)"


def _prepare(size: int) -> tuple[Any, Any, Any, Any]:
    """What every side does before its clock: the same imports, the inputs on the GPU, a sync."""
    import torch
    import triton  # noqa: F401

    import acompile  # noqa: F401
    from acompile import _autotune  # noqa: F401

    torch.manual_seed(0)
    a, b = (torch.randn((size, size), device="cuda", dtype=torch.float16) for _ in range(2))
    c = torch.empty((size, size), device="cuda", dtype=torch.float16)
    ref = torch.matmul(a.double(), b.double())
    torch.cuda.synchronize()
    return a, b, c, ref


def _runtime_args(a: Any, b: Any, c: Any) -> tuple[Any, ...]:
    """The arguments of acompile's kernels: the matmul's, less the unit strides compiled in."""
    names = [name for name in matmul_kernel.arg_names if name in MATMUL_SIG]
    return tuple(v for name, v in zip(names, matmul_args(a, b, c), strict=True) if name not in UNIT_STRIDES)


def _check(launch: Any, args: tuple[Any, ...], c: Any, ref: Any) -> float:
    import torch

    c.fill_(float("nan"))
    launch(*args)
    torch.cuda.synchronize()
    err = (torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref)).item()
    assert err < 1e-2, f"wrong result: relative error {err}"
    return float(err)


def _label(config: dict[str, Any]) -> str:
    c = config["constexprs"]
    tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
    return f"{tile} G{c['GROUP_M']} w{config['num_warps']} s{config['num_stages']}"


class _Timeline(logging.Handler):
    """acompile's debug records (configs landing, screened, run in full), stamped from the
    first call's start."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.t0 = time.perf_counter()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.module != "_autotune":
            return
        self.lines.append(f"{time.perf_counter() - self.t0:7.3f} s  {record.getMessage()}")


async def acompile_side(args: argparse.Namespace) -> dict[str, Any]:
    """``pool.autotune`` of the matmul's configs in a pool that is up before the clock starts."""
    import torch

    import acompile
    from acompile._autotune import autotune

    a, b, c, ref = _prepare(args.size)
    runtime = _runtime_args(a, b, c)
    stamps = {"imported": time.time()}
    counts = {k: getattr(args, k) for k in ("warmup", "repeats") if getattr(args, k) is not None}
    async with acompile.CompilePool(args.workers, cache_dir=args.cache) as pool:
        await pool.wait_ready()
        logger = logging.getLogger("acompile")
        logger.setLevel(logging.DEBUG)
        timeline = _Timeline()
        logger.addHandler(timeline)
        t1 = timeline.t0
        kernel = await autotune(
            pool, matmul_kernel, matmul_configs(), signature=SIGNATURE, constexprs=UNIT_STRIDES,
            attrs=MATMUL_ATTRS, args=runtime, grid=matmul_grid,
            key={"M": args.size, "dtype": "fp16"}, **counts,
        )  # fmt: skip
        torch.cuda.synchronize()
        first = time.perf_counter() - t1
        stamps["ready"] = time.time()
        logger.removeHandler(timeline)
        r = kernel.tuning
        chosen_ms = r.timings.get(r.index) if r.index is not None else None
        result = {
            "first_call_s": first, "compile_s": r.compile_seconds, "bench_s": r.bench_seconds,
            "source": r.source, "chosen": r.config, "chosen_ms": chosen_ms,
            "error": _check(kernel[matmul_grid], runtime, c, ref), "workers": pool.stats()["workers"]["size"],
            "device": torch.cuda.get_device_name(), "stamps": stamps, "timeline": timeline.lines,
            "trials": [[_label(t.config), t.median_ms, t.launches, t.skipped] for t in r.trials],
        }  # fmt: skip
        if getattr(args, "triton_choice", None):
            result["verify"] = await _time_winners(pool, args.triton_choice, r.config, a, b, c)
        return result


async def _time_winners(
    pool: Any, theirs: dict[str, Any], ours: dict[str, Any], a: Any, b: Any, c: Any
) -> Any:
    """Median of each winner's ``do_bench`` medians over alternating rounds, in milliseconds."""
    import anyio
    import triton.testing

    import acompile

    kernels = []
    for config in (theirs, ours):
        spec = acompile.TritonSpec(
            matmul_kernel, SIGNATURE, {**UNIT_STRIDES, **config["constexprs"]}, num_warps=config["num_warps"],
            num_stages=config["num_stages"], attrs=MATMUL_ATTRS,
        )  # fmt: skip
        kernels.append((await pool.compile(spec))[matmul_grid])
    args = _runtime_args(a, b, c)

    def rounds() -> list[list[float]]:
        times: list[list[float]] = [[], []]
        for _ in range(_VERIFY_ROUNDS):
            for k, launch in enumerate(kernels):
                times[k].append(
                    float(triton.testing.do_bench(lambda launch=launch: launch(*args), return_mode="median"))
                )
        return times

    theirs_ms, ours_ms = await anyio.to_thread.run_sync(rounds)
    return {"triton_pick_ms": statistics.median(theirs_ms), "acompile_pick_ms": statistics.median(ours_ms)}


def triton_side(args: argparse.Namespace) -> dict[str, Any]:
    """The first launch of the ``@triton.autotune`` kernel."""
    import torch
    import triton

    a, b, c, ref = _prepare(args.size)
    stamps = {"imported": time.time()}
    tuned = triton.autotune(configs=matmul_configs(), key=["M", "N", "K"])(matmul_kernel)
    t1 = time.perf_counter()
    tuned[matmul_grid](*matmul_args(a, b, c))
    torch.cuda.synchronize()
    first, best = time.perf_counter() - t1, tuned.best_config
    stamps["ready"] = time.time()
    chosen = {"constexprs": best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    own = getattr(tuned, "configs_timings", None) or {}
    timing = own.get(best)
    return {
        "first_call_s": first, "compile_s": None, "bench_s": None, "source": "benchmark", "chosen": chosen,
        "chosen_ms": (timing[0] if isinstance(timing, (list, tuple)) else timing),
        "error": _check(tuned[matmul_grid], matmul_args(a, b, c), c, ref), "workers": 1,
        "device": torch.cuda.get_device_name(), "stamps": stamps,
    }  # fmt: skip


CHILDREN = {"acompile": acompile_side, "triton": triton_side}


def main(argv: list[str] | None = None) -> int:
    """Run the three sides and print the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(prog="acompile bench --autotune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="M = N = K (a multiple of 16)")
    parser.add_argument("--workers", type=int, default=None, help="acompile's workers (default: CPUs)")
    parser.add_argument("--warmup", type=int, default=None, help="acompile: at most this many warm-ups")
    parser.add_argument("--repeats", type=int, default=None, help="acompile: at most this many timed")
    parser.add_argument("--timeline", action="store_true", help="print acompile's timeline and every config")
    args = parser.parse_args(argv)
    if args.size % 16:
        parser.error("--size must be a multiple of 16 (the kernel's divisibility hints assume it)")
    if need := harness.missing(gpu=True):
        print(f"acompile bench --autotune: needs {need}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="acompile-bench-autotune-"))
    options = {**vars(args), "cache": str(folder / "acompile")}
    results: dict[str, dict[str, Any]] = {}
    for name, side in ((TRITON, "triton"), (POOL_UP, "acompile"), (NEXT, "acompile")):
        sub = folder / "-".join(name.replace(",", "").replace("(", "").replace(")", "").split())
        # The first acompile side also times Triton's winner against its own.
        verify = {"triton_choice": results[TRITON]["chosen"]} if name == POOL_UP else {}
        results[name] = r = harness.run_child(
            "autotune", side, {**options, **verify}, sub, harness.child_env(sub), 1800
        )
        if "crashed" in r:
            print(f"{name}: CRASHED {r['crashed']}\n{r.get('traceback', '')}\n{r.get('log_tail', '')}")
            return 1
    print(
        f"first-call autotune of a {args.size}^3 fp16 matmul, {len(matmul_configs())} configs, on "
        f"{r['device']}, acompile with {r['workers']} workers; clocks start after the same imports, "
        "inputs and CUDA context:"
    )
    rows = []
    for name, r in results.items():
        cells = [
            harness.fmt(r.get(k)) for k in ("first_call_s", "process_to_ready_s", "compile_s", "bench_s")
        ]
        chosen = f"{_label(r['chosen'])}: {harness.fmt(r.get('chosen_ms'), '.4f')} ms"
        rows.append([name, *cells, r["source"], f"{chosen} (rel. err {r['error']:.1e})"])
    header = ["side", "first call s", "whole process s", "compiles land s", "bench s", "source", "chosen"]
    print(harness.table(header, rows))
    ours = results[POOL_UP]
    triton_s = results[TRITON]["first_call_s"]
    print(f"first call: acompile {triton_s / ours['first_call_s']:.2f}x faster than @triton.autotune")
    timed = ours.get("verify")
    if timed:
        print(
            f"the winners timed alternately with triton.testing.do_bench ({_VERIFY_ROUNDS} rounds, "
            f"median): Triton's pick {timed['triton_pick_ms']:.4f} ms, acompile's pick "
            f"{timed['acompile_pick_ms']:.4f} ms"
        )
    if args.timeline:
        print("\nacompile's first call, config by config:")
        print("\n".join(ours["timeline"]))
        trial_rows = [
            [label, harness.fmt(ms, ".4f"), str(n if n is not None else ""), (why or "")[:70]]
            for label, ms, n, why in ours["trials"]
        ]
        print(harness.table(["config", "median ms", "timed launches", "skipped"], trial_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
