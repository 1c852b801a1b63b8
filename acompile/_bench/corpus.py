"""A fixed corpus of Triton kernels used to benchmark the compile service.

Every entry of :func:`corpus` is one distinct compile request (JIT function +
runtime signature + constexpr values + launch options).  The kernels only use
long-stable ``triton.language`` features so the corpus compiles on Triton 3.6
through 3.9.  :func:`compile_spec` is the plain sequential ``triton.compile``
baseline that the service is compared against; :class:`Outcome` checks what a
row produced.  ``matmul_kernel`` is the one matmul: the corpus compiles it over
tile configurations, and the autotune benchmark tunes it (``matmul_configs``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import triton
import triton.language as tl

# ---------------------------------------------------------------------------
# Elementwise kernels.  All of them treat their inputs as flat arrays of
# ``n`` elements, one BLOCK-sized chunk per program, math done in fp32 and the
# result cast to the output pointer's element type.
# ---------------------------------------------------------------------------


# out = x + y
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


# out = x * y
@triton.jit
def mul_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * y).to(out_ptr.dtype.element_ty), mask=mask)


# out = alpha * x + y  (BLAS axpy with a runtime fp32 scalar)
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


# out = min(max(x, lo), hi) with runtime fp32 bounds
@triton.jit
def clamp_kernel(x_ptr, out_ptr, lo, hi, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x, lo), hi)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# out = act(x); ACT picks relu(0) / gelu-tanh(1) / silu(2) / sigmoid(3) / leaky relu(4)
@triton.jit
def activation_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ACT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        y = tl.maximum(x, 0.0)
    elif ACT == 1:
        # tanh(u) written as 2 * sigmoid(2u) - 1 to stay on basic ops
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    elif ACT == 2:
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 3:
        y = 1.0 / (1.0 + tl.exp(-x))
    else:
        y = tl.where(x > 0, x, 0.01 * x)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# out[r, c] = relu(x[r, c] + bias[c]) -- fused bias add + relu on a row-major matrix
@triton.jit
def bias_relu_kernel(x_ptr, bias_ptr, out_ptr, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.maximum(x + b, 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# out = silu(gate) * up   (SwiGLU gating)
@triton.jit
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# out = cond != 0 ? x : y
@triton.jit
def select_kernel(cond_ptr, x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(cond_ptr + offs, mask=mask, other=0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, tl.where(c != 0, x, y), mask=mask)


# out = x converted to out's dtype (pure cast / copy)
@triton.jit
def cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


# out = x * scale where kept, 0 elsewhere; keep-mask from a home-made integer hash
@triton.jit
def dropout_hash_kernel(x_ptr, out_ptr, n, seed, p, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = (offs + seed).to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x45D9F3B
    h = h ^ (h >> 16)
    h = h * 0x45D9F3B
    h = h ^ (h >> 16)
    r = (h & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(r >= p, x / (1.0 - p), 0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


# out = x * scale + shift with per-channel scale/shift (inference batchnorm, NCHW-flat)
@triton.jit
def affine_channel_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, n, hw, channels, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ch = (offs // hw) % channels
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + ch, mask=mask, other=1.0).to(tl.float32)
    b = tl.load(shift_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * s + b).to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Row-wise reductions over a row-major (n_rows, n_cols) matrix, one row per
# program; BLOCK is a power of two >= n_cols.
# ---------------------------------------------------------------------------


# out[r] = sum(x[r, :])
@triton.jit
def row_sum_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(x, axis=0))


# out[r] = max(x[r, :])
@triton.jit
def row_max_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
    tl.store(out_ptr + row, tl.max(x.to(tl.float32), axis=0))


# out[r] = argmax(x[r, :])
@triton.jit
def row_argmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
    tl.store(out_ptr + row, tl.argmax(x.to(tl.float32), axis=0))


# out[r, :] = softmax(x[r, :])
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# out[r, :] = log_softmax(x[r, :])
@triton.jit
def log_softmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    y = z - tl.log(tl.sum(tl.exp(z), axis=0))
    tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# Online softmax for rows longer than one block: two passes over BLOCK-sized chunks
@triton.jit
def softmax_looped_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row * stride
    m = tl.full((BLOCK,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        s = tl.where(m_new == -float("inf"), 0.0, s)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) / total
        tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# LayerNorm forward: y = (x - mean) * rstd * w + b, also writes mean and rstd
@triton.jit
def layernorm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    stride,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = d * rstd * w + b
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w
@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * stride + cols,
        (x * rstd * w).to(y_ptr.dtype.element_ty),
        mask=mask,
    )


# Fused residual add + RMSNorm: h = x + res (written back to res), y = rmsnorm(h) * w
@triton.jit
def add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = x + r
    tl.store(res_ptr + row * stride + cols, h.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * stride + cols,
        (h * rstd * w).to(y_ptr.dtype.element_ty),
        mask=mask,
    )


# out[r] = population variance of x[r, :] (two-pass)
@triton.jit
def row_var_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(mask, x - mean, 0.0)
    tl.store(out_ptr + row, tl.sum(d * d, axis=0) / n_cols)


# out[c] = sum over rows of x[:, c]; a BLOCK_R x BLOCK_C tile walks down the rows
@triton.jit
def col_sum_kernel(x_ptr, out_ptr, n_rows, n_cols, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cols < n_cols)


# Per-row cross-entropy loss: logsumexp(x[r, :]) - x[r, target[r]]
@triton.jit
def cross_entropy_kernel(logits_ptr, target_ptr, loss_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    t = tl.load(target_ptr + row)
    picked = tl.sum(tl.where(cols == t, x, 0.0), axis=0)
    tl.store(loss_ptr + row, lse - picked)


# Inclusive prefix sum of each row via tl.cumsum
@triton.jit
def cumsum_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.cumsum(x, axis=0)
    tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Matmul-style kernels.
# ---------------------------------------------------------------------------


# C = act(A @ B) with fully strided operands and grouped ("super-grouping") tile order
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
    ACT: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    elif ACT == 2:
        acc = acc / (1.0 + tl.exp(-acc))
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(
        c_ptrs,
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


# Single-head attention forward (optionally causal), one BLOCK_M query tile per program
@triton.jit
def attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    seq_len,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
        mask=offs_m[:, None] < seq_len,
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    end_n = seq_len
    if CAUSAL:
        end_n = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_n[:, None] < seq_len
        k = tl.load(
            k_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = offs_n[None, :] < seq_len
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=offs_m[:, None] < seq_len,
    )


# ---------------------------------------------------------------------------
# Data movement and miscellaneous kernels.
# ---------------------------------------------------------------------------


# out = x^T for a row-major (M, N) matrix, one BLOCK_M x BLOCK_N tile per program
@triton.jit
def transpose_kernel(x_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask)
    tl.store(out_ptr + rn[None, :] * M + rm[:, None], tile, mask=mask)


# out[r, :] = table[idx[r], :]  (embedding lookup)
@triton.jit
def embedding_kernel(idx_ptr, table_ptr, out_ptr, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    idx = tl.load(idx_ptr + row).to(tl.int64)
    v = tl.load(table_ptr + idx * dim + cols, mask=mask)
    tl.store(out_ptr + row * dim + cols, v, mask=mask)


# Rotary position embedding on (seq, HALF*2) rows: rotate pairs (x[i], x[i + HALF])
@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride, HALF: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + row * stride + d).to(tl.float32)
    x2 = tl.load(x_ptr + row * stride + HALF + d).to(tl.float32)
    c = tl.load(cos_ptr + row * HALF + d).to(tl.float32)
    s = tl.load(sin_ptr + row * HALF + d).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride + d, (x1 * c - x2 * s).to(ty))
    tl.store(out_ptr + row * stride + HALF + d, (x1 * s + x2 * c).to(ty))


# Strided 2D copy: out[i, j] = x[i * sx0 + j * sx1] into a contiguous output
@triton.jit
def strided_copy_kernel(x_ptr, out_ptr, M, N, sx0, sx1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    v = tl.load(x_ptr + rm[:, None] * sx0 + rn[None, :] * sx1, mask=mask)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], v, mask=mask)


# Global sum with one atomic add per program
@triton.jit
def atomic_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr, tl.sum(x, axis=0))


# Adam optimizer step, updates param / exp_avg / exp_avg_sq in place
@triton.jit
def adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, bc1, bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr * (m / bc1) / (tl.sqrt(v / bc2) + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


# ---------------------------------------------------------------------------
# Corpus description.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One compile request: a JIT function plus everything needed to compile it."""

    # unique, e.g. "add_fp32_b1024_w4"
    name: str
    fn: triton.JITFunction
    # runtime (non-constexpr) params only -> triton type string
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3


def _spec(name, fn, types, warps=4, stages=3, **constexprs) -> Spec:
    """Build a Spec; ``types`` lists the runtime params' types in declaration order."""
    runtime = [a for a in fn.arg_names if a not in constexprs]
    type_list = types.split()
    if len(runtime) != len(type_list):
        raise ValueError(f"{name}: {len(type_list)} types for params {runtime}")
    return Spec(name, fn, dict(zip(runtime, type_list, strict=True)), constexprs, warps, stages)


_ACT_NAMES = ("relu", "gelu", "silu", "sigmoid", "leaky")


def _elementwise() -> list[Spec]:
    s: list[Spec] = []
    for dt, block, w in (
        ("fp32", 1024, 4),
        ("fp16", 1024, 4),
        ("bf16", 2048, 8),
        ("fp32", 4096, 8),
    ):
        p = f"*{dt}"
        name = f"add_{dt}_b{block}_w{w}"
        s.append(_spec(name, add_kernel, f"{p} {p} {p} i32", w, BLOCK=block))
    for dt, block in (("fp32", 1024), ("fp16", 2048)):
        p = f"*{dt}"
        name = f"mul_{dt}_b{block}_w4"
        s.append(_spec(name, mul_kernel, f"{p} {p} {p} i32", BLOCK=block))
    for dt in ("fp32", "bf16"):
        p = f"*{dt}"
        types = f"{p} {p} {p} fp32 i32"
        s.append(_spec(f"axpy_{dt}_b1024_w4", axpy_kernel, types, BLOCK=1024))
    types = "*fp32 *fp32 fp32 fp32 i32"
    s.append(_spec("clamp_fp32_b1024_w4", clamp_kernel, types, BLOCK=1024))
    for act, act_name in enumerate(_ACT_NAMES):
        name = f"act_{act_name}_fp32_b1024_w4"
        types = "*fp32 *fp32 i32"
        s.append(_spec(name, activation_kernel, types, BLOCK=1024, ACT=act))
    for act, dt in ((1, "fp16"), (2, "bf16")):
        name = f"act_{_ACT_NAMES[act]}_{dt}_b2048_w8"
        types = f"*{dt} *{dt} i32"
        s.append(_spec(name, activation_kernel, types, 8, BLOCK=2048, ACT=act))
    types = "*fp16 *fp16 *fp16 i32 i32"
    s.append(_spec("bias_relu_fp16_b1024_w4", bias_relu_kernel, types, BLOCK=1024))
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        types = f"{p} {p} {p} i32"
        s.append(_spec(f"swiglu_{dt}_b1024_w4", swiglu_kernel, types, BLOCK=1024))
    types = "*i8 *fp32 *fp32 *fp32 i32"
    s.append(_spec("select_fp32_b1024_w4", select_kernel, types, BLOCK=1024))
    for src, dst in (("fp32", "fp16"), ("fp32", "bf16"), ("fp16", "fp32")):
        name = f"cast_{src}_to_{dst}_b1024_w4"
        s.append(_spec(name, cast_kernel, f"*{src} *{dst} i32", BLOCK=1024))
    types = "*fp32 *fp32 i32 i32 fp32"
    name = "dropout_hash_fp32_b1024_w4"
    s.append(_spec(name, dropout_hash_kernel, types, BLOCK=1024))
    types = "*fp16 *fp32 *fp32 *fp16 i32 i32 i32"
    name = "affine_channel_fp16_b1024_w4"
    s.append(_spec(name, affine_channel_kernel, types, BLOCK=1024))
    # param, grad (fp16), exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, bc1, bc2
    types = "*fp32 *fp16 *fp32 *fp32 i32 fp32 fp32 fp32 fp32 fp32 fp32"
    s.append(_spec("adam_fp32_b1024_w4", adam_kernel, types, BLOCK=1024))
    return s


def _reductions() -> list[Spec]:
    s: list[Spec] = []
    # row kernels: x, out, n_cols, stride
    for dt, block, w in (("fp32", 1024, 4), ("fp16", 4096, 8)):
        name = f"row_sum_{dt}_b{block}_w{w}"
        types = f"*{dt} *fp32 i32 i32"
        s.append(_spec(name, row_sum_kernel, types, w, BLOCK=block))
    types = "*fp32 *fp32 i32 i32"
    s.append(_spec("row_max_fp32_b1024_w4", row_max_kernel, types, BLOCK=1024))
    types = "*fp16 *i32 i32 i32"
    s.append(_spec("row_argmax_fp16_b1024_w4", row_argmax_kernel, types, BLOCK=1024))
    for dt, block, w in (("fp32", 1024, 4), ("fp16", 2048, 8), ("bf16", 4096, 16)):
        name = f"softmax_{dt}_b{block}_w{w}"
        types = f"*{dt} *{dt} i32 i32"
        s.append(_spec(name, softmax_kernel, types, w, BLOCK=block))
    types = "*fp32 *fp32 i32 i32"
    name = "log_softmax_fp32_b1024_w4"
    s.append(_spec(name, log_softmax_kernel, types, BLOCK=1024))
    types = "*fp16 *fp16 i32 i32"
    name = "softmax_looped_fp16_b1024_w4"
    s.append(_spec(name, softmax_looped_kernel, types, BLOCK=1024))
    for dt, block, w in (("fp32", 1024, 4), ("fp16", 4096, 8), ("bf16", 8192, 16)):
        p = f"*{dt}"
        name = f"layernorm_{dt}_b{block}_w{w}"
        types = f"{p} {p} {p} {p} *fp32 *fp32 i32 i32 fp32"
        s.append(_spec(name, layernorm_kernel, types, w, BLOCK=block))
    for dt, block, w in (("fp32", 1024, 4), ("bf16", 4096, 8)):
        p = f"*{dt}"
        name = f"rmsnorm_{dt}_b{block}_w{w}"
        types = f"{p} {p} {p} i32 i32 fp32"
        s.append(_spec(name, rmsnorm_kernel, types, w, BLOCK=block))
    types = "*fp16 *fp16 *fp16 *fp16 i32 i32 fp32"
    name = "add_rmsnorm_fp16_b4096_w8"
    s.append(_spec(name, add_rmsnorm_kernel, types, 8, BLOCK=4096))
    types = "*fp32 *fp32 i32 i32"
    s.append(_spec("row_var_fp32_b2048_w4", row_var_kernel, types, BLOCK=2048))
    types = "*fp32 *fp32 i32 i32 i32"
    name = "col_sum_fp32_r32_c64_w4"
    s.append(_spec(name, col_sum_kernel, types, BLOCK_R=32, BLOCK_C=64))
    types = "*fp32 *i64 *fp32 i32 i32"
    name = "cross_entropy_fp32_b4096_w8"
    s.append(_spec(name, cross_entropy_kernel, types, 8, BLOCK=4096))
    for dt, block in (("fp32", 1024), ("fp16", 256)):
        name = f"cumsum_{dt}_b{block}_w4"
        types = f"*{dt} *{dt} i32 i32"
        s.append(_spec(name, cumsum_kernel, types, BLOCK=block))
    types = "*fp32 *fp32 i32"
    name = "atomic_sum_fp32_b1024_w4"
    s.append(_spec(name, atomic_sum_kernel, types, BLOCK=1024))
    return s


# (dtype, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACT, num_warps, num_stages)
_MATMUL_CONFIGS = (
    ("fp16", 128, 128, 64, 8, 0, 8, 3),
    ("fp16", 128, 64, 32, 8, 0, 4, 4),
    ("fp16", 64, 128, 32, 4, 1, 4, 3),
    ("fp16", 64, 64, 64, 8, 0, 4, 2),
    ("bf16", 128, 128, 32, 8, 2, 8, 4),
    ("bf16", 64, 64, 32, 1, 0, 4, 3),
    ("fp32", 64, 64, 32, 8, 0, 4, 2),
    ("fp16", 32, 32, 32, 4, 0, 2, 2),
    ("fp16", 128, 256, 64, 8, 0, 8, 3),
    ("fp16", 64, 256, 32, 8, 1, 4, 4),
    ("bf16", 128, 64, 64, 8, 0, 4, 3),
    ("fp32", 32, 64, 32, 4, 2, 4, 3),
    ("fp16", 256, 64, 64, 8, 0, 4, 4),
)


def _matmuls() -> list[Spec]:
    s: list[Spec] = []
    for dt, bm, bn, bk, gm, act, w, st in _MATMUL_CONFIGS:
        p = f"*{dt}"
        name = f"matmul_{dt}_{bm}x{bn}x{bk}_g{gm}_a{act}_w{w}_s{st}"
        # a, b, c, M, N, K, then six strides
        types = f"{p} {p} {p} i32 i32 i32" + " i32" * 6
        tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        s.append(_spec(name, matmul_kernel, types, w, st, GROUP_M=gm, ACT=act, **tiles))
    for causal in (False, True):
        name = f"attention_fwd_fp16_64x64_d64_c{int(causal)}_w4_s2"
        types = "*fp16 *fp16 *fp16 *fp16 i32 fp32"
        tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIM": 64}
        s.append(_spec(name, attention_fwd_kernel, types, 4, 2, CAUSAL=causal, **tiles))
    return s


def _data_movement() -> list[Spec]:
    s: list[Spec] = []
    for dt, bm, bn, w in (("fp32", 32, 32, 4), ("fp16", 64, 64, 8)):
        name = f"transpose_{dt}_{bm}x{bn}_w{w}"
        types = f"*{dt} *{dt} i32 i32"
        s.append(_spec(name, transpose_kernel, types, w, BLOCK_M=bm, BLOCK_N=bn))
    types = "*i32 *fp16 *fp16 i32"
    s.append(_spec("embedding_fp16_b1024_w4", embedding_kernel, types, BLOCK=1024))
    for dt, half in (("fp16", 64), ("bf16", 32)):
        name = f"rope_{dt}_h{half}_w1"
        types = f"*{dt} *fp32 *fp32 *{dt} i32"
        s.append(_spec(name, rope_kernel, types, 1, HALF=half))
    types = "*fp32 *fp32 i32 i32 i32 i32"
    name = "strided_copy_fp32_32x64_w4"
    s.append(_spec(name, strided_copy_kernel, types, BLOCK_M=32, BLOCK_N=64))
    return s


def corpus() -> list[Spec]:
    """All specs in a fixed order: elementwise, reductions, matmuls, data movement."""
    specs = _elementwise() + _reductions() + _matmuls() + _data_movement()
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise AssertionError(f"duplicate spec names: {dupes}")
    return specs


def full_signature(spec: Spec) -> dict[str, str]:
    """ASTSource signature: all params of ``spec.fn``, constexprs as "constexpr"."""
    sig: dict[str, str] = {}
    for name in spec.fn.arg_names:
        if name in spec.constexprs:
            sig[name] = "constexpr"
        elif name in spec.signature:
            sig[name] = spec.signature[name]
        else:
            raise KeyError(f"{spec.name}: no type or constexpr value for param {name!r}")
    extra = (set(spec.signature) | set(spec.constexprs)) - set(sig)
    if extra:
        raise KeyError(f"{spec.name}: unknown params {sorted(extra)}")
    return sig


def compile_spec(spec: Spec, target=None):
    """Compile ``spec`` with one plain ``triton.compile`` call (the baseline)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if target is None:
        target = GPUTarget("cuda", 90, 32)
    src = ASTSource(fn=spec.fn, signature=full_signature(spec), constexprs=dict(spec.constexprs))
    return triton.compile(
        src,
        target=target,
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )


@functools.cache
def specs(limit: int | None = None) -> list[Spec]:
    """The corpus, or its first ``limit`` specs."""
    return corpus()[:limit] if limit else corpus()


def acompile_specs(limit: int | None = None) -> list[Any]:
    """The same specs as ``acompile.TritonSpec`` requests."""
    import acompile

    return [
        acompile.TritonSpec(s.fn, s.signature, s.constexprs, num_warps=s.num_warps, num_stages=s.num_stages)
        for s in specs(limit)
    ]


@functools.cache
def gpu_target(target: str) -> Any:
    """Triton's ``GPUTarget`` for an acompile target string such as ``"cuda:90"``."""
    from acompile._targets import parse_target

    return parse_target(target).to_triton()


def compile_index(index: int, target: str, limit: int | None) -> dict[str, Any]:
    """The worker function of the process-pool baselines: compile spec ``index``, return its
    whole asm dict (a realistic payload crosses the process boundary)."""
    from acompile._bench.harness import quiet_warnings

    quiet_warnings()
    compiled = compile_spec(specs(limit)[index], gpu_target(target))
    return {"asm": dict(compiled.asm.items())}


class Outcome:
    """What a row produced: one cubin digest or one error per spec, in spec order."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.digests: list[str | None] = [None] * len(names)
        self.errors: list[str | None] = [None] * len(names)

    @classmethod
    def of(cls, results: list[Any], limit: int | None) -> Outcome:
        """From ``pool.gather(..., return_exceptions=True)``'s results."""
        out = cls([s.name for s in specs(limit)])
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                out.set(i, error=result)
            else:
                out.set(i, getattr(result, "cubin", None))
        return out

    def set(self, i: int, cubin: Any = None, error: BaseException | str | None = None) -> None:
        if error is None:
            ok = isinstance(cubin, (bytes, bytearray)) and cubin
            self.digests[i] = hashlib.sha256(cubin).hexdigest()[:16] if ok else None
            error = None if ok else "no cubin in the result"
        if error is not None:
            text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.errors[i] = text.strip().splitlines()[0][:300] if text.strip() else repr(error)

    def report(self) -> dict[str, Any]:
        failed = {n: e for n, e in zip(self.names, self.errors, strict=True) if e is not None}
        return {
            "specs": len(self.names),
            "ok": len(self.names) - len(failed),
            "failed": len(failed),
            "errors": dict(list(failed.items())[:10]),
            "digests": dict(zip(self.names, self.digests, strict=True)),
        }


def differing(mine: dict[str, Any], reference: dict[str, Any] | None) -> int | None:
    """How many of a row's cubins differ from the reference row's (None: nothing to compare)."""
    a, b = mine.get("digests") or {}, (reference or {}).get("digests") or {}
    if not a or not b:
        return None
    return sum(1 for k, d in a.items() if d and b.get(k) and d != b[k])


# --- the autotune benchmark's matmul: fp16, C = A @ B --------------------------------------------

MATMUL_SIG = {
    name: "*fp16" if name.endswith("_ptr") else "i32"
    for name in matmul_kernel.arg_names
    if name not in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "ACT")
}
# What Triton's JIT would assume for contiguous tensors whose sizes are multiples of 16: 16-byte
# aligned pointers, and sizes and leading strides divisible by 16.
MATMUL_ATTRS = {
    name: [["tt.divisibility", 16]]
    for name in ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm")
}
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): Triton's tutorial configs and
# more; the 128x256x128 one needs more shared memory than an H100 has, and is skipped there.
_TUNE_SHAPES = (
    (128, 256, 64, 8, 8, 3), (64, 256, 32, 8, 4, 4), (128, 128, 32, 8, 4, 4), (128, 64, 32, 8, 4, 4),
    (64, 128, 32, 8, 4, 4), (128, 32, 32, 8, 4, 4), (64, 32, 32, 8, 2, 5), (32, 64, 32, 8, 2, 5),
    (128, 256, 128, 8, 8, 3), (256, 128, 64, 8, 8, 3), (64, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 4, 4, 4), (256, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3), (128, 64, 64, 8, 4, 3),
    (64, 64, 32, 8, 4, 5), (32, 32, 32, 8, 2, 4),
)  # fmt: skip


def matmul_configs(limit: int | None = None) -> list[triton.Config]:
    """The autotune benchmark's configs as ``triton.Config`` (the first ``limit`` of them)."""
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "ACT": 0}, num_warps=w, num_stages=st
        )
        for bm, bn, bk, gm, w, st in _TUNE_SHAPES[:limit]
    ]


def matmul_grid(meta: dict[str, Any]) -> tuple[int]:
    """The launch grid of ``matmul_kernel``: one program per output tile."""
    return (triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"]),)


def matmul_args(a: Any, b: Any, c: Any) -> tuple[Any, ...]:
    """The runtime arguments of ``matmul_kernel`` for C = A @ B, in its order."""
    (m, k), (_, n) = a.shape, b.shape
    return (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
