# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""First-call autotune time of a matmul with 18 configs: acompile's parallel autotune against
``@triton.autotune``, each in a fresh process with empty caches.

    python -m acompile._bench.autotune [--size 4096] [--workers N] [--warmup 10] [--repeats 50]

Needs an NVIDIA GPU and PyTorch. For each side a fresh interpreter imports PyTorch, Triton and
this module, makes fp16 inputs, and then times one first call (synchronized):

- acompile: entering ``CompilePool(workers)`` (the local GPU's target; workers start and preload)
  plus ``autotune()``: every config compiled at once across the workers, then benchmarked one by
  one with CUDA events (``--warmup`` / ``--repeats`` launches each, L2 flushed before each).
- Triton: the first launch of the ``@triton.autotune`` kernel, which compiles and benchmarks the
  configs one after another (its ``do_bench``: about 25 ms of warm-up and 100 ms of timed launches
  per config).

Then acompile's side runs once more in another fresh process on the same cache: the stored
choice is found and nothing is compiled or benchmarked. Every side checks the chosen kernel's
result against ``torch.matmul``. The last lines are a table: total first-call seconds, the
compile and benchmark parts where known, and the chosen config of each side.

Timing rules in ``/work/.library/device/METHOD.md`` style: the two sides differ in how long they
benchmark each config (acompile counts launches, Triton budgets milliseconds), so the table shows
the compile part of acompile's time on its own, too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C = A @ B, fp16 in, fp32 accumulation, fp16 out; programs grouped along M for L2 reuse."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = acc.to(tl.float16)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, c, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


MATMUL_SIG = {
    "a_ptr": "*fp16",
    "b_ptr": "*fp16",
    "c_ptr": "*fp16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_am": "i32",
    "stride_ak": "i32",
    "stride_bk": "i32",
    "stride_bn": "i32",
    "stride_cm": "i32",
    "stride_cn": "i32",
}

# What Triton's JIT would assume for contiguous tensors whose sizes are multiples of 16: 16-byte
# aligned pointers, and sizes and leading strides divisible by 16. Unit strides are left as
# runtime values (Triton specializes ones; this request does not, for simplicity).
MATMUL_ATTRS = {
    name: [["tt.divisibility", 16]]
    for name in ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm")
}

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): Triton's tutorial configs and
# more; the 128x256x128 one needs more shared memory than an H100 has, and is skipped there.
_SHAPES = [
    (128, 256, 64, 8, 8, 3),
    (64, 256, 32, 8, 4, 4),
    (128, 128, 32, 8, 4, 4),
    (128, 64, 32, 8, 4, 4),
    (64, 128, 32, 8, 4, 4),
    (128, 32, 32, 8, 4, 4),
    (64, 32, 32, 8, 2, 5),
    (32, 64, 32, 8, 2, 5),
    (128, 256, 128, 8, 8, 3),
    (256, 128, 64, 8, 8, 3),
    (64, 64, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 4, 4, 4),
    (256, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 3),
    (128, 64, 64, 8, 4, 3),
    (64, 64, 32, 8, 4, 5),
    (32, 32, 32, 8, 2, 4),
]


def matmul_configs(limit: int | None = None) -> list[triton.Config]:
    """The benchmark's configs as ``triton.Config`` (the first ``limit`` of them)."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, num_warps=w, num_stages=s)
        for bm, bn, bk, gm, w, s in _SHAPES[:limit]
    ]


def matmul_grid(meta: dict[str, Any]) -> tuple[int]:
    return (triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"]),)


def matmul_args(a: Any, b: Any, c: Any) -> tuple[Any, ...]:
    """The runtime arguments of matmul_kernel for C = A @ B, in its order."""
    (m, k), (_, n) = a.shape, b.shape
    return (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))


# --- the two sides, each run in a fresh interpreter -------------------------------------------

_COMMON = """
import time
t0 = time.perf_counter()
import json, torch, triton
from acompile._bench.autotune import (
    MATMUL_ATTRS, MATMUL_SIG, matmul_args, matmul_configs, matmul_grid, matmul_kernel,
)
size = {size}
torch.manual_seed(0)
a = torch.randn((size, size), device="cuda", dtype=torch.float16)
b = torch.randn((size, size), device="cuda", dtype=torch.float16)
c = torch.empty((size, size), device="cuda", dtype=torch.float16)
ref = torch.matmul(a.double(), b.double())
torch.cuda.synchronize()

def check():
    err = (torch.linalg.norm(c.double() - ref) / torch.linalg.norm(ref)).item()
    assert err < 1e-2, f"wrong result: relative error {{err}}"
    return err
"""

_ACOMPILE = (
    _COMMON
    + """
import anyio, acompile
from acompile._autotune import autotune

async def main():
    t1 = time.perf_counter()
    async with acompile.CompilePool({workers}, cache_dir={cache!r}) as pool:
        kernel = await autotune(
            pool, matmul_kernel, matmul_configs(), signature=MATMUL_SIG, attrs=MATMUL_ATTRS,
            args=matmul_args(a, b, c), grid=matmul_grid,
            key={{"M": size, "N": size, "K": size, "dtype": "fp16"}},
            warmup={warmup}, repeats={repeats},
        )
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        c.fill_(float("nan"))
        kernel[matmul_grid](*matmul_args(a, b, c))
        torch.cuda.synchronize()
        r = kernel.tuning
        print(json.dumps({{
            "first_call_s": t2 - t1, "compile_s": r.compile_seconds, "bench_s": r.bench_seconds,
            "source": r.source, "chosen": r.config, "skipped": r.skipped, "error": check(),
            "compiled": pool.stats()["compiled"], "workers": pool.stats()["workers"]["size"],
            "device": torch.cuda.get_device_name(),
        }}))

anyio.run(main)
"""
)

_TRITON = (
    _COMMON
    + """
tuned = triton.autotune(configs=matmul_configs(), key=["M", "N", "K"])(matmul_kernel)
t1 = time.perf_counter()
tuned[matmul_grid](*matmul_args(a, b, c))
torch.cuda.synchronize()
t2 = time.perf_counter()
c.fill_(float("nan"))
tuned[matmul_grid](*matmul_args(a, b, c))
torch.cuda.synchronize()
best = tuned.best_config
print(json.dumps({{
    "first_call_s": t2 - t1, "compile_s": None, "bench_s": None,  # Triton compiles while it benchmarks
    "source": "benchmark", "chosen": {{"constexprs": best.kwargs, "num_warps": best.num_warps,
                                       "num_stages": best.num_stages}},
    "skipped": {{}}, "error": check(), "compiled": len(matmul_configs()), "workers": 1,
    "device": torch.cuda.get_device_name(),
}}))
"""
)


def _run(code: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _label(config: dict[str, Any]) -> str:
    c = config["constexprs"]
    return (
        f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} G{c['GROUP_M']} "
        f"w{config['num_warps']} s{config['num_stages']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", type=int, default=4096, help="M = N = K (a multiple of 16)")
    parser.add_argument("--workers", type=int, default=None, help="acompile's workers (default: CPUs)")
    parser.add_argument("--warmup", type=int, default=10, help="acompile: warm-up launches per config")
    parser.add_argument("--repeats", type=int, default=50, help="acompile: timed launches per config")
    args = parser.parse_args(argv)
    if args.size % 16:
        parser.error("--size must be a multiple of 16 (the kernel's divisibility hints assume it)")
    folder = tempfile.mkdtemp(prefix="acompile-bench-autotune-")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    fields = {"size": args.size, "workers": args.workers, "warmup": args.warmup, "repeats": args.repeats}
    cache = os.path.join(folder, "acompile")
    results = {
        "triton @autotune": _run(
            _TRITON.format(**fields), dict(env, TRITON_CACHE_DIR=os.path.join(folder, "triton"))
        ),
        "acompile autotune": _run(
            _ACOMPILE.format(cache=cache, **fields), dict(env, TRITON_CACHE_DIR=os.path.join(folder, "t1"))
        ),
        "acompile, next process": _run(
            _ACOMPILE.format(cache=cache, **fields), dict(env, TRITON_CACHE_DIR=os.path.join(folder, "t2"))
        ),
    }
    device = results["triton @autotune"]["device"]
    print(f"first-call autotune of a {args.size}^3 fp16 matmul, {len(_SHAPES)} configs, on {device}:")
    print(f"  {'side':24s} {'first call':>11s} {'compile':>9s} {'bench':>9s}  {'source':9s}  chosen")
    for name, r in results.items():
        comp = f"{r['compile_s']:.2f} s" if r["compile_s"] is not None else "-"
        bench = f"{r['bench_s']:.2f} s" if r["bench_s"] is not None else "-"
        print(
            f"  {name:24s} {r['first_call_s']:9.2f} s {comp:>9s} {bench:>9s}  {r['source']:9s}  "
            f"{_label(r['chosen'])}  (rel. err {r['error']:.1e}, {len(r['skipped'])} skipped)"
        )
    ratio = results["triton @autotune"]["first_call_s"] / results["acompile autotune"]["first_call_s"]
    workers = results["acompile autotune"]["workers"]
    print(f"  Triton's first call takes {ratio:.1f}x as long as acompile's ({workers} workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
