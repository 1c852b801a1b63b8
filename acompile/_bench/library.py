"""A kernel library as such libraries are written, for the benchmarks that launch kernels.

Eleven launches of nine kernels: RMSNorm and LayerNorm forward, a row softmax, GELU, SiLU and
SwiGLU, rotary embedding applied in place to queries and keys, a small flash-attention forward,
and a matmul in three tile configurations (as a library picks one per problem shape). They are
written the way kernel libraries write them (row strides, ``BLOCK_SIZE`` constexprs, helper JIT
functions, a string constexpr, a constexpr size in the middle of the signature, grids that are
tuples or functions of the meta-parameters), so their signatures differ as real ones do.

``specs()`` is the library as compile requests (``acompile bench --corpus library``);
``cases()`` adds real launch arguments built with PyTorch on the GPU (``acompile bench
--first-launch``). Only long-stable ``triton.language`` features are used: the library compiles
with Triton 3.6 through 3.9.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from acompile._bench.spec import Spec

# fmt: off


@triton.jit
def _rms_norm_fwd(Y_ptr, Y_row_stride, X_ptr, X_row_stride, W_ptr, RSTD_ptr, n_cols, eps,
                  BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0).to(tl.int64)
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    X_row = tl.load(X_ptr + row_idx * X_row_stride + col_offsets, mask=mask, other=0)
    X_row_dtype = X_row.dtype
    X_row = X_row.to(tl.float32)
    W_row = tl.load(W_ptr + col_offsets, mask=mask, other=0)
    rstd = tl.rsqrt(tl.sum(X_row * X_row, axis=0) / n_cols + eps)
    tl.store(RSTD_ptr + row_idx, rstd)
    Y_row = (X_row * rstd).to(X_row_dtype) * W_row
    tl.store(Y_ptr + row_idx * Y_row_stride + col_offsets, Y_row, mask=mask)


@triton.jit
def _layer_norm_fwd_fused(X, Y, W, B, Mean, Rstd, stride, N, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    Y += row * stride
    X += row * stride
    _mean = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        _mean += tl.load(X + cols, mask=cols < N, other=0.).to(tl.float32)
    mean = tl.sum(_mean, axis=0) / N
    _var = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + cols, mask=cols < N, other=0.).to(tl.float32)
        x = tl.where(cols < N, x - mean, 0.)
        _var += x * x
    rstd = 1 / tl.sqrt(tl.sum(_var, axis=0) / N + eps)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    for off in range(0, N, BLOCK_SIZE):
        cols = off + tl.arange(0, BLOCK_SIZE)
        mask = cols < N
        w = tl.load(W + cols, mask=mask)
        b = tl.load(B + cols, mask=mask)
        x = tl.load(X + cols, mask=mask, other=0.).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(Y + cols, y, mask=mask)


@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_rows, n_cols,
                   BLOCK_SIZE: tl.constexpr):
    # Persistent: a fixed number of programs, each striding over the rows.
    row_start = tl.program_id(0)
    row_step = tl.num_programs(0)
    for row_idx in tl.range(row_start, n_rows, row_step):
        row_start_ptr = input_ptr + row_idx * input_row_stride
        col_offsets = tl.arange(0, BLOCK_SIZE)
        mask = col_offsets < n_cols
        row = tl.load(row_start_ptr + col_offsets, mask=mask, other=-float("inf")).to(tl.float32)
        numerator = tl.exp(row - tl.max(row, axis=0))
        softmax_output = numerator / tl.sum(numerator, axis=0)
        output_row_start_ptr = output_ptr + row_idx * output_row_stride
        tl.store(output_row_start_ptr + col_offsets, softmax_output, mask=mask)


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def gelu_tanh_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = 0.5 * x * (1 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    tl.store(y_ptr + offsets, y, mask=mask)


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def silu_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, silu(x), mask=mask)


@triton.jit
def _swiglu_forward_kernel(a_ptr, b_ptr, c_ptr, stride, n_cols: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    program_id = tl.program_id(0).to(tl.int64)
    a_ptr += program_id * stride
    b_ptr += program_id * stride
    c_ptr += program_id * stride
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    a_row = tl.load(a_ptr + col_offsets, mask=mask, other=0).to(tl.float32)
    b_row = tl.load(b_ptr + col_offsets, mask=mask, other=0)
    c_row = silu(a_row).cast(b_row.dtype) * b_row
    tl.store(c_ptr + col_offsets, c_row, mask=mask)


@triton.jit
def _rope_forward_kernel(q_ptr, q_row_stride, k_ptr, k_row_stride, cos, cos_row_stride, sin, sin_row_stride,
                         sl, n_qh: tl.constexpr, n_kh: tl.constexpr, hd: tl.constexpr,
                         pad_n_qh: tl.constexpr, pad_n_kh: tl.constexpr, pad_hd: tl.constexpr):
    # One program per (batch, position) row of q and k, rotating all their heads in place.
    pid = tl.program_id(0)
    q_ptr = q_ptr + pid * q_row_stride
    k_ptr = k_ptr + pid * k_row_stride
    cos_row_idx = pid % sl
    cos = cos + cos_row_idx * cos_row_stride
    sin = sin + cos_row_idx * sin_row_stride
    cos_offsets = tl.arange(0, pad_hd // 2)
    cos_mask = cos_offsets < hd // 2
    cos_row = tl.load(cos + cos_offsets, mask=cos_mask, other=0)
    sin_row = tl.load(sin + cos_offsets, mask=cos_mask, other=0)
    first_q = tl.arange(0, pad_n_qh)[:, None] * hd + tl.arange(0, pad_hd // 2)[None, :]
    first_k = tl.arange(0, pad_n_kh)[:, None] * hd + tl.arange(0, pad_hd // 2)[None, :]
    q_mask = (tl.arange(0, pad_n_qh)[:, None] < n_qh) & (tl.arange(0, pad_hd // 2)[None, :] < hd // 2)
    k_mask = (tl.arange(0, pad_n_kh)[:, None] < n_kh) & (tl.arange(0, pad_hd // 2)[None, :] < hd // 2)
    q1 = tl.load(q_ptr + first_q, mask=q_mask, other=0).to(sin_row.dtype)
    k1 = tl.load(k_ptr + first_k, mask=k_mask, other=0).to(sin_row.dtype)
    q2 = tl.load(q_ptr + first_q + hd // 2, mask=q_mask, other=0).to(sin_row.dtype)
    k2 = tl.load(k_ptr + first_k + hd // 2, mask=k_mask, other=0).to(sin_row.dtype)
    tl.store(q_ptr + first_q, q1 * cos_row - q2 * sin_row, mask=q_mask)
    tl.store(q_ptr + first_q + hd // 2, q2 * cos_row + q1 * sin_row, mask=q_mask)
    tl.store(k_ptr + first_k, k1 * cos_row - k2 * sin_row, mask=k_mask)
    tl.store(k_ptr + first_k + hd // 2, k2 * cos_row + k1 * sin_row, mask=k_mask)


@triton.jit
def _attn_fwd(Q, K, V, sm_scale, Out,
              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
              H, N_CTX,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    q_base = Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    k_base = K + off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    o_base = Out + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < N_CTX
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.44269504  # exp(x) = exp2(x * log2(e))
    hi = N_CTX
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_rows = cols[:, None] < N_CTX
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_rows, other=0.)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        valid = cols[None, :] < N_CTX
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        qk = tl.where(valid, qk, -float("inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_rows, other=0.)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_ij
    acc = acc / l_i[:, None]
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=rows)


@triton.jit
def leaky_relu(x):
    return tl.where(x >= 0, x, 0.01 * x)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                  GROUP_SIZE_M: tl.constexpr, ACTIVATION: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_SIZE_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if ACTIVATION == "leaky_relu":
        accumulator = leaky_relu(accumulator)
    c = accumulator.to(c_ptr.dtype.element_ty)
    offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    tl.store(c_ptrs, c, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


# fmt: on
# --- the library's shapes, and its kernels as compile requests ----------------------------------

TOKENS, HIDDEN, INTERMEDIATE = 2048, 4096, 11008  # a 7B-class model's layer, one batch of tokens
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ATTN_BATCH, ATTN_HEADS, ATTN_CTX, ATTN_DIM = 2, 16, 1024, 64
# (name suffix, M, N, K, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, ACTIVATION, warps, stages)
_MATMULS = (
    ("large", 4096, 4096, 4096, 128, 256, 64, 8, "", 8, 3),
    ("small", 512, 512, 4096, 64, 64, 64, 8, "", 4, 4),
    ("leaky", 2048, 11008, 4096, 128, 128, 64, 8, "leaky_relu", 8, 3),
)
_ROW_BLOCK = triton.next_power_of_2(HIDDEN)


def _spec(name: str, fn: Any, types: str, warps: int = 4, stages: int = 3, **constexprs: Any) -> Spec:
    runtime = [a for a in fn.arg_names if a not in constexprs]
    return Spec(name, fn, dict(zip(runtime, types.split(), strict=True)), constexprs, warps, stages)


@functools.cache
def specs() -> tuple[Spec, ...]:
    """The library's kernels as compile requests, one per launch of ``cases()``."""
    rope = {"n_qh": HEADS, "n_kh": KV_HEADS, "hd": HEAD_DIM}
    pads = {"pad_n_qh": HEADS, "pad_n_kh": KV_HEADS, "pad_hd": HEAD_DIM}
    attn = {"HEAD_DIM": ATTN_DIM, "BLOCK_M": 128, "BLOCK_N": 64, "CAUSAL": True}
    result = [
        _spec("rms_norm", _rms_norm_fwd, "*bf16 i32 *bf16 i32 *bf16 *fp32 i32 fp32", 8,
              BLOCK_SIZE=_ROW_BLOCK),
        _spec("layer_norm", _layer_norm_fwd_fused, "*fp16 *fp16 *fp16 *fp16 *fp32 *fp32 i32 i32 fp32", 8,
              BLOCK_SIZE=1024),
        _spec("softmax", softmax_kernel, "*fp32 *fp32 i32 i32 i32 i32", 8, BLOCK_SIZE=_ROW_BLOCK),
        _spec("gelu", gelu_tanh_kernel, "*bf16 *bf16 i32", BLOCK_SIZE=1024),
        _spec("silu", silu_kernel, "*fp16 *fp16 i32", BLOCK_SIZE=2048),
        _spec("swiglu", _swiglu_forward_kernel, "*bf16 *bf16 *bf16 i32", 16, n_cols=INTERMEDIATE,
              BLOCK_SIZE=triton.next_power_of_2(INTERMEDIATE)),
        _spec("rope", _rope_forward_kernel, "*bf16 i32 *bf16 i32 *fp32 i32 *fp32 i32 i32", 4, **rope, **pads),
        _spec("flash_attention", _attn_fwd, "*fp16 *fp16 *fp16 fp32 *fp16" + " i32" * 14, 4, 3, **attn),
    ]  # fmt: skip
    for suffix, _, _, _, bm, bn, bk, gm, act, warps, stages in _MATMULS:
        tiles = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm}
        types = "*fp16 *fp16 *fp16" + " i32" * 9
        result.append(_spec(f"matmul_{suffix}", matmul_kernel, types, warps, stages, **tiles, ACTIVATION=act))
    return tuple(result)


# --- launches with real arguments ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch of a library kernel: its spec, grid, runtime arguments (device tensors and
    sizes, in the kernel's order) and the tensors it writes."""

    spec: Spec
    grid: tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]
    args: tuple[Any, ...]
    outputs: tuple[Any, ...]

    def keywords(self) -> dict[str, Any]:
        """What a library passes to Triton's JIT besides the runtime arguments."""
        s = self.spec
        return {**s.constexprs, "num_warps": s.num_warps, "num_stages": s.num_stages}


def cases(seed: int = 0) -> list[Case]:
    """Every kernel of ``specs()`` with arguments on the current GPU (needs PyTorch)."""
    import torch

    torch.manual_seed(seed)
    by_name = {s.name: s for s in specs()}

    def randn(*shape: int, dtype: Any) -> Any:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    out: list[Case] = []
    args: tuple[Any, ...]
    x, w = randn(TOKENS, HIDDEN, dtype=torch.bfloat16), randn(HIDDEN, dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(TOKENS, device="cuda")
    args = (y, y.stride(0), x, x.stride(0), w, rstd, HIDDEN, 1e-6)
    out.append(Case(by_name["rms_norm"], (TOKENS,), args, (y, rstd)))

    x, w, b = (randn(*shape, dtype=torch.float16) for shape in ((TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,)))
    y, mean, rstd = torch.empty_like(x), torch.empty(TOKENS, device="cuda"), torch.empty_like(rstd)
    args = (x, y, w, b, mean, rstd, x.stride(0), HIDDEN, 1e-5)
    out.append(Case(by_name["layer_norm"], (TOKENS,), args, (y, mean, rstd)))

    x = randn(TOKENS, HIDDEN, dtype=torch.float32)
    y = torch.empty_like(x)
    programs = min(TOKENS, torch.cuda.get_device_properties(0).multi_processor_count * 4)
    out.append(Case(by_name["softmax"], (programs,), (y, x, x.stride(0), y.stride(0), TOKENS, HIDDEN), (y,)))

    for name, dtype in (("gelu", torch.bfloat16), ("silu", torch.float16)):
        x = randn(TOKENS * HIDDEN, dtype=dtype)
        y, n = torch.empty_like(x), x.numel()

        def elementwise_grid(meta: dict[str, Any], n: int = n) -> tuple[int]:
            return (triton.cdiv(n, meta["BLOCK_SIZE"]),)

        out.append(Case(by_name[name], elementwise_grid, (x, y, n), (y,)))

    a, b = (randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    out.append(Case(by_name["swiglu"], (TOKENS,), (a, b, c, a.stride(0)), (c,)))

    q = randn(1, TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = randn(1, TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    positions = torch.arange(TOKENS, device="cuda", dtype=torch.float32)
    angles = torch.outer(positions, torch.rand(HEAD_DIM // 2, device="cuda"))
    cos, sin = angles.cos(), angles.sin()
    q2, k2 = q.view(TOKENS, -1), k.view(TOKENS, -1)
    args = (q2, q2.stride(0), k2, k2.stride(0), cos, cos.stride(0), sin, sin.stride(0), TOKENS)
    out.append(Case(by_name["rope"], (TOKENS,), args, (q, k)))

    shape = (ATTN_BATCH, ATTN_HEADS, ATTN_CTX, ATTN_DIM)
    q, k, v = (randn(*shape, dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    args = (q, k, v, 1 / math.sqrt(ATTN_DIM), o, *strides, ATTN_HEADS, ATTN_CTX)

    def attention_grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(ATTN_CTX, meta["BLOCK_M"]), ATTN_BATCH * ATTN_HEADS)

    out.append(Case(by_name["flash_attention"], attention_grid, args, (o,)))

    for suffix, m, n, kk, *_ in _MATMULS:
        a, b = randn(m, kk, dtype=torch.float16) / 8, randn(kk, n, dtype=torch.float16) / 8
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        args = (a, b, c, m, n, kk, *a.stride(), *b.stride(), *c.stride())

        def matmul_grid(meta: dict[str, Any], m: int = m, n: int = n) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_SIZE_M"]) * triton.cdiv(n, meta["BLOCK_SIZE_N"]),)

        out.append(Case(by_name[f"matmul_{suffix}"], matmul_grid, args, (c,)))
    return out
