"""Time to first launch from a warm cache, in a fresh process: acompile against Triton's JIT.

    python -m acompile._bench.first_launch [--repeat 5]     (needs an NVIDIA GPU and PyTorch)

For each side, a cache is filled once; then, --repeat times, a fresh interpreter imports
PyTorch, Triton and the kernel (``add_kernel`` of the corpus), and launches it once (module load
included), then synchronizes. Reported: the median time from just after the imports to the launch
completed, and from interpreter start. acompile's side opens the default ``CompilePool()`` on
its disk cache; Triton's side calls the ``@triton.jit`` kernel with its own cache warm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import acompile
from acompile._bench import harness
from acompile._bench.corpus import add_kernel

_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


async def acompile_side(args: argparse.Namespace) -> dict[str, Any]:
    """A launch through the default ``CompilePool()`` (workers prestarted) on the disk cache."""
    t1 = time.perf_counter()
    async with acompile.CompilePool() as pool:
        kernel, tier = await pool.compile_with_tier(acompile.TritonSpec(add_kernel, _SIG, {"BLOCK": 1024}))
        return {"tier": tier, **_launch(lambda *a: kernel[(4,)](*a), t1, args.t0)}


def triton_side(args: argparse.Namespace) -> dict[str, Any]:
    """A launch of the ``@triton.jit`` kernel on Triton's warm cache."""
    t1 = time.perf_counter()
    return {"tier": "triton cache", **_launch(lambda *a: add_kernel[(4,)](*a, BLOCK=1024), t1, args.t0)}


def _launch(launch: Any, t1: float, t0: float) -> dict[str, float]:
    import torch

    x, y = torch.ones(4096, device="cuda"), torch.ones(4096, device="cuda")
    out = torch.empty_like(x)
    launch(x, y, out, 4096)
    torch.cuda.synchronize()
    after, from_start = time.perf_counter() - t1, time.time() - t0
    assert bool((out == 2).all()), "wrong result"
    return {"after_imports_s": after, "from_start_s": from_start}


CHILDREN = {"acompile": acompile_side, "triton": triton_side}


def main(argv: list[str] | None = None) -> int:
    """Run both sides ``--repeat`` times each and print the medians."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        import torch  # noqa: F401  (the imports are part of interpreter start, not of the launch)

        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(prog="acompile bench --first-launch", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="acompile-first-launch-"))
    print(f"time to first launch from a warm cache, fresh process, median of {args.repeat}:")
    for side in CHILDREN:
        env = harness.child_env(folder / side)
        runs = []
        for i in range(args.repeat + 1):  # the first fills the cache
            r = harness.run_child("first_launch", side, {"t0": time.time()}, folder / side / str(i), env, 300)
            if "crashed" in r:
                print(f"  {side}: CRASHED {r['crashed']}\n{r.get('log_tail', '')}")
                return 1
            runs.append(r)
        after = statistics.median(r["after_imports_s"] for r in runs[1:]) * 1000
        start = statistics.median(r["from_start_s"] for r in runs[1:]) * 1000
        print(
            f"  {side:9s} after imports {after:8.1f} ms   from interpreter start {start:8.1f} ms"
            f"   ({runs[1]['tier']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
