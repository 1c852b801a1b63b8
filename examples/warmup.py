"""Fill the kernel cache ahead of time, from a machine with or without a GPU.

    python examples/warmup.py [--target cuda:90] [--target cuda:80] [--cache-dir DIR]

The same job as `acompile warmup examples/manifest.toml`, written against the API: build the list
of specs, compile them all at once through the pool, report what was compiled, what was already
cached and what failed. A GPU fleet then starts with every kernel on disk (or, with a shared cache
tier, in Redis) and launches without compiling.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

import acompile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import add_kernel, bias_gelu_kernel, matmul_kernel, softmax_kernel

ELEMENTWISE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
GELU = {"x_ptr": "*fp16", "bias_ptr": "*fp16", "out_ptr": "*fp16", "n": "i32", "cols": "i32"}
SOFTMAX = {"x_ptr": "*fp32", "out_ptr": "*fp32", "stride": "i32", "cols": "i32"}
MATMUL = {
    "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
    "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32",
    "stride_cm": "i32", "stride_cn": "i32",
}  # fmt: skip


def specs(targets: list[str]) -> list[acompile.TritonSpec]:
    out = []
    for target in targets:
        for block in (256, 1024):
            out.append(acompile.TritonSpec(add_kernel, ELEMENTWISE, {"BLOCK": block}, target=target))
        out.append(acompile.TritonSpec(bias_gelu_kernel, GELU, {"BLOCK": 1024}, target=target))
        for block in (1024, 4096):
            out.append(
                acompile.TritonSpec(softmax_kernel, SOFTMAX, {"BLOCK": block}, num_warps=8, target=target)
            )
        for bm, bn, bk in ((64, 64, 32), (128, 128, 32)):
            tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            out.append(acompile.TritonSpec(matmul_kernel, MATMUL, tiles, num_stages=3, target=target))
    return out


async def warm(targets: list[str], cache_dir: Path | None) -> int:
    todo = specs(targets)
    t0 = time.perf_counter()
    # Compiling is this script's whole job: its workers keep this process's priority.
    async with acompile.CompilePool(target=targets[0], cache_dir=cache_dir, worker_nice=0) as pool:
        results = await pool.gather(*todo, return_exceptions=True, background=True)
        stats = pool.stats()
    failed = [(s, r) for s, r in zip(todo, results, strict=True) if isinstance(r, Exception)]
    for spec, err in failed:
        print(f"FAILED {spec.fn.__name__} {spec.target} {spec.constexprs}: {err}", file=sys.stderr)
    cached = stats["cache"]["hits_disk"] + stats["cache"]["hits_memory"]
    print(
        f"{len(todo)} kernels for {', '.join(targets)}: {stats['compiled']} compiled, {cached} cached, "
        f"{len(failed)} failed in {time.perf_counter() - t0:.2f} s (cache: {pool.cache_dir})"
    )
    # Filling the cache is this script's job: a compile that could not be written there (a
    # read-only or full folder; the pool said why in a warning) is a failure too.
    unsaved = stats["compiled"] - stats["cache"]["disk_writes"]
    if unsaved > 0:
        print(f"{unsaved} compiled kernels are not in the cache folder {pool.cache_dir}", file=sys.stderr)
    return 1 if failed or unsaved > 0 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="repeatable; default cuda:90 and cuda:80")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    try:
        return anyio.run(warm, args.target or ["cuda:90", "cuda:80"], args.cache_dir)
    except acompile.UnknownTargetError as exc:
        parser.error(str(exc))  # one line and exit status 2, as the acompile command says it


if __name__ == "__main__":
    sys.exit(main())
