"""Time to first launch from a warm cache, in a fresh process: acompile against Triton's JIT.

    python -m acompile._bench.first_launch [--repeat 5]     (needs an NVIDIA GPU and PyTorch)

For each side, a cache is filled once; then, --repeat times, a fresh interpreter imports
PyTorch, Triton and the kernel, and launches the kernel once (module load included), then
synchronizes. Reported: the median time from just after the imports to the launch completed,
and the whole process from interpreter start. acompile's side opens
``CompilePool(prestart=False)`` on its disk cache; Triton's side calls the ``@triton.jit``
kernel with its own cache warm (``TRITON_CACHE_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_KERNEL = """
import triton, triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)
"""

_ACOMPILE = """
import time
t0 = time.perf_counter()
import json, sys, anyio, torch, acompile
sys.path.insert(0, {folder!r})
from fl_kernel import add_kernel
SIG = {{"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}}

async def main():
    t1 = time.perf_counter()
    async with acompile.CompilePool(1, cache_dir={cache!r}, prestart=False) as pool:
        k, tier = await pool.compile_with_tier(acompile.TritonSpec(add_kernel, SIG, {{"BLOCK": 1024}}))
        x = torch.ones(4096, device="cuda"); y = torch.ones(4096, device="cuda"); out = torch.empty_like(x)
        k[(4,)](x, y, out, 4096)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert bool((out == 2).all()), "wrong result"
        print(json.dumps({{"tier": tier, "after_imports_s": t2 - t1, "from_start_s": t2 - t0}}))

anyio.run(main)
"""

_TRITON = """
import time
t0 = time.perf_counter()
import json, sys, torch, triton
sys.path.insert(0, {folder!r})
from fl_kernel import add_kernel
t1 = time.perf_counter()
x = torch.ones(4096, device="cuda"); y = torch.ones(4096, device="cuda"); out = torch.empty_like(x)
add_kernel[(4,)](x, y, out, 4096, BLOCK=1024)
torch.cuda.synchronize()
t2 = time.perf_counter()
assert bool((out == 2).all()), "wrong result"
print(json.dumps({{"tier": "triton cache", "after_imports_s": t2 - t1, "from_start_s": t2 - t0}}))
"""


def _run(code: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="acompile-first-launch-")
    with open(os.path.join(folder, "fl_kernel.py"), "w") as f:
        f.write(_KERNEL)
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    cache = os.path.join(folder, "acompile")
    sides = {
        "acompile": _ACOMPILE.format(folder=folder, cache=cache),
        "triton JIT": _TRITON.format(folder=folder),
    }
    results: dict[str, list[dict[str, float]]] = {}
    for name, code in sides.items():
        _run(code, env)  # fills the cache
        results[name] = [_run(code, env) for _ in range(args.repeat)]
    print(f"time to first launch from a warm cache, fresh process, median of {args.repeat}:")
    for name, runs in results.items():
        after = statistics.median(r["after_imports_s"] for r in runs) * 1000
        start = statistics.median(r["from_start_s"] for r in runs) * 1000
        tier = runs[0]["tier"]
        print(
            f"  {name:12s} after imports {after:8.1f} ms   from interpreter start {start:8.1f} ms   ({tier})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
