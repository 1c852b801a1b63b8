"""A corpus of your own kernels for the compile benchmark:

    acompile bench --corpus examples/bench_corpus.py --workers 2 --only sequential,acompile_cold

``acompile bench --corpus`` takes a ``.py`` file (as here) or an importable module
(``mylib.kernels``), optionally with ``:NAME`` to pick the attribute that holds the compile
requests. Without it the module's ``SPECS`` (a list) is used, else its ``specs()`` (a function
that returns one). Each request is a plain dict, as below, or an
``acompile._bench.spec.Spec`` with the same fields: ``name`` (unique), ``fn`` (a ``@triton.jit``
function), ``signature`` (a Triton type for each runtime parameter), ``constexprs`` (the
compile-time values), and optionally ``num_warps`` (default 4) and ``num_stages`` (default 3).
Every row of the benchmark imports this module again in a fresh process, so building the list
should be cheap and give the same requests each time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_softmax_kernel(x_ptr, out_ptr, stride, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * stride + offs, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a_mask = (rm[:, None] < M) & (rk[None, :] + k < K)
        b_mask = (rk[:, None] + k < K) & (rn[None, :] < N)
        a = tl.load(a_ptr + rm[:, None] * stride_am + (rk[None, :] + k), mask=a_mask, other=0.0)
        b = tl.load(b_ptr + (rk[:, None] + k) * stride_bk + rn[None, :], mask=b_mask, other=0.0)
        acc += tl.dot(a, b)
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# Two configurations of each kernel: every entry is one distinct compile request.
SPECS: list[dict[str, object]] = []
for dtype, block, warps in (("fp32", 1024, 4), ("fp16", 2048, 8)):
    ptr = f"*{dtype}"
    SPECS.append(
        {
            "name": f"scale_add_{dtype}_b{block}",
            "fn": scale_add_kernel,
            "signature": {"x_ptr": ptr, "y_ptr": ptr, "out_ptr": ptr, "alpha": "fp32", "n": "i32"},
            "constexprs": {"BLOCK": block},
            "num_warps": warps,
        }
    )
    SPECS.append(
        {
            "name": f"row_softmax_{dtype}_b{block}",
            "fn": row_softmax_kernel,
            "signature": {"x_ptr": ptr, "out_ptr": ptr, "stride": "i32", "cols": "i32"},
            "constexprs": {"BLOCK": block},
            "num_warps": warps,
        }
    )
for bm, bn, bk, warps, stages in ((64, 64, 32, 4, 3), (128, 64, 32, 4, 4)):
    SPECS.append(
        {
            "name": f"matmul_fp16_{bm}x{bn}x{bk}_w{warps}_s{stages}",
            "fn": matmul_kernel,
            "signature": {
                **dict.fromkeys(("a_ptr", "b_ptr", "c_ptr"), "*fp16"),
                **dict.fromkeys(("M", "N", "K", "stride_am", "stride_bk", "stride_cm"), "i32"),
            },
            "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
            "num_warps": warps,
            "num_stages": stages,
        }
    )
