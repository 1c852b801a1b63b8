"""First-call autotune time of a matmul with 18 configs: acompile's parallel autotune against
``@triton.autotune``, each in a fresh process with empty caches.

    python -m acompile._bench.autotune [--size 4096] [--workers N] [--warmup 10] [--repeats 50]

Needs an NVIDIA GPU and PyTorch. The kernel is the corpus's ``matmul_kernel`` (fp16). Each side
times one first call, synchronized: acompile entering ``CompilePool(workers)`` plus
``autotune()`` (every config compiled at once, then benchmarked one by one with CUDA events, L2
flushed before each launch); Triton the first launch of the ``@triton.autotune`` kernel (compile
and benchmark one config after another). Then acompile's side runs again in another fresh process
on the same cache: the stored choice is found, nothing compiled. Every side checks its result
against ``torch.matmul``.
"""

from __future__ import annotations

import argparse
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


def _inputs(size: int) -> tuple[Any, Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    a, b = (torch.randn((size, size), device="cuda", dtype=torch.float16) for _ in range(2))
    c = torch.empty((size, size), device="cuda", dtype=torch.float16)
    return a, b, c, torch.matmul(a.double(), b.double())


def _check(launch: Any, a: Any, b: Any, c: Any, ref: Any) -> float:
    import torch

    c.fill_(float("nan"))
    launch(*matmul_args(a, b, c))
    torch.cuda.synchronize()
    err = (torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref)).item()
    assert err < 1e-2, f"wrong result: relative error {err}"
    return float(err)


async def acompile_side(args: argparse.Namespace) -> dict[str, Any]:
    """``pool.autotune`` of the matmul's configs (or the stored choice, on a warm cache)."""
    import torch

    import acompile
    from acompile._autotune import autotune

    a, b, c, ref = _inputs(args.size)
    t1 = time.perf_counter()
    async with acompile.CompilePool(args.workers, cache_dir=args.cache) as pool:
        kernel = await autotune(
            pool, matmul_kernel, matmul_configs(), signature=MATMUL_SIG, attrs=MATMUL_ATTRS,
            args=matmul_args(a, b, c), grid=matmul_grid, key={"M": args.size, "dtype": "fp16"},
            warmup=args.warmup, repeats=args.repeats,
        )  # fmt: skip
        torch.cuda.synchronize()
        first = time.perf_counter() - t1
        r = kernel.tuning
        return {
            "first_call_s": first, "compile_s": r.compile_seconds, "bench_s": r.bench_seconds,
            "source": r.source, "chosen": r.config, "error": _check(kernel[matmul_grid], a, b, c, ref),
            "workers": pool.stats()["workers"]["size"], "device": torch.cuda.get_device_name(),
        }  # fmt: skip


def triton_side(args: argparse.Namespace) -> dict[str, Any]:
    """The first launch of the ``@triton.autotune`` kernel."""
    import torch
    import triton

    a, b, c, ref = _inputs(args.size)
    tuned = triton.autotune(configs=matmul_configs(), key=["M", "N", "K"])(matmul_kernel)
    t1 = time.perf_counter()
    tuned[matmul_grid](*matmul_args(a, b, c))
    torch.cuda.synchronize()
    first, best = time.perf_counter() - t1, tuned.best_config
    chosen = {"constexprs": best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    return {
        "first_call_s": first, "compile_s": None, "bench_s": None, "source": "benchmark", "chosen": chosen,
        "error": _check(tuned[matmul_grid], a, b, c, ref), "workers": 1,
        "device": torch.cuda.get_device_name(),
    }  # fmt: skip


CHILDREN = {"acompile": acompile_side, "triton": triton_side}


def main(argv: list[str] | None = None) -> int:
    """Run the three sides and print the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(prog="acompile bench --autotune", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="M = N = K (a multiple of 16)")
    parser.add_argument("--workers", type=int, default=None, help="acompile's workers (default: CPUs)")
    parser.add_argument("--warmup", type=int, default=10, help="acompile: warm-up launches per config")
    parser.add_argument("--repeats", type=int, default=50, help="acompile: timed launches per config")
    args = parser.parse_args(argv)
    if args.size % 16:
        parser.error("--size must be a multiple of 16 (the kernel's divisibility hints assume it)")
    folder = Path(tempfile.mkdtemp(prefix="acompile-bench-autotune-"))
    options = {**vars(args), "cache": str(folder / "acompile")}
    results = {}
    for name, side in (
        ("triton @autotune", "triton"),
        ("acompile autotune", "acompile"),
        ("acompile, next process", "acompile"),
    ):
        sub = folder / name.replace(" ", "_")
        results[name] = r = harness.run_child("autotune", side, options, sub, harness.child_env(sub), 1800)
        if "crashed" in r:
            print(f"{name}: CRASHED {r['crashed']}\n{r.get('log_tail', '')}")
            return 1
    print(
        f"first-call autotune of a {args.size}^3 fp16 matmul, {len(matmul_configs())} configs, "
        f"on {r['device']}:"
    )
    rows = []
    for name, r in results.items():
        c = r["chosen"]["constexprs"]
        w, st = r["chosen"]["num_warps"], r["chosen"]["num_stages"]
        chosen = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} G{c['GROUP_M']} w{w} s{st}"
        cells = [harness.fmt(r[k]) for k in ("first_call_s", "compile_s", "bench_s")]
        rows.append([name, *cells, r["source"], f"{chosen} (rel. err {r['error']:.1e})"])
    print(harness.table(["side", "first call s", "compile s", "bench s", "source", "chosen"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
