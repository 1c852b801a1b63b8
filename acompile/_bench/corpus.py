"""A fixed corpus of Triton kernels used to benchmark the compile service.

Every entry of :func:`corpus` is one distinct compile request (JIT function +
runtime signature + constexpr values + launch options).  The kernels only use
long-stable ``triton.language`` features so the corpus compiles on Triton 3.6
through 3.9.  :func:`compile_spec` is the plain sequential ``triton.compile``
baseline that the service is compared against; ``outcome`` checks what a
row produced.  ``matmul_kernel`` is the one matmul: the corpus compiles it over
tile configurations, and the autotune benchmark tunes it (``matmul_configs``).
``user_specs`` loads and checks a corpus module of the user's instead (``acompile bench --corpus
FILE.py|MODULE[:NAME]``; ``examples/bench_corpus.py`` is one).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import os
import reprlib
import sys
import time
import traceback
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

from acompile._bench.spec import Spec

# --- the kernels: math in fp32, results cast to the output's element type -------------------
# fmt: off


# out = x + y
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


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


# LayerNorm forward: y = (x - mean) * rstd * w + b, also writes mean and rstd
@triton.jit
def layernorm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, stride, eps,
                     BLOCK: tl.constexpr):
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


# C = act(A @ B) with fully strided operands and grouped ("super-grouping") tile order
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# Single-head attention forward (optionally causal), one BLOCK_M query tile per program
@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seq_len, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < seq_len
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=rows, other=0.0)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    end_n = seq_len
    if CAUSAL:
        end_n = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_n[:, None] < seq_len
        k = tl.load(k_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = offs_n[None, :] < seq_len
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out, mask=rows)


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


# fmt: on
# --- the corpus -----------------------------------------------------------------------------------


def _spec(name, fn, types, warps=4, stages=3, **constexprs) -> Spec:
    """Build a Spec; ``types`` lists the runtime params' types in declaration order."""
    runtime = [a for a in fn.arg_names if a not in constexprs]
    return Spec(name, fn, dict(zip(runtime, types.split(), strict=True)), constexprs, warps, stages)


_ACT_NAMES = ("relu", "gelu", "silu", "sigmoid", "leaky")
# (dtype, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACT, num_warps, num_stages)
_MATMUL_CONFIGS = (
    ("fp16", 128, 128, 64, 8, 0, 8, 3), ("fp16", 128, 64, 32, 8, 0, 4, 4), ("fp16", 64, 128, 32, 4, 1, 4, 3),
    ("fp16", 64, 64, 64, 8, 0, 4, 2), ("bf16", 128, 128, 32, 8, 2, 8, 4), ("bf16", 64, 64, 32, 1, 0, 4, 3),
    ("fp32", 64, 64, 32, 8, 0, 4, 2), ("fp16", 32, 32, 32, 4, 0, 2, 2), ("fp16", 128, 256, 64, 8, 0, 8, 3),
    ("fp16", 64, 256, 32, 8, 1, 4, 4), ("bf16", 128, 64, 64, 8, 0, 4, 3), ("fp32", 32, 64, 32, 4, 2, 4, 3),
    ("fp16", 256, 64, 64, 8, 0, 4, 4),
)  # fmt: skip
# (dtype, BLOCK, num_warps) of the row kernels
_ROWS = (("fp32", 1024, 4), ("fp16", 2048, 8), ("bf16", 4096, 16))


def corpus() -> list[Spec]:
    """All specs in a fixed order: elementwise, row reductions, matmuls, attention, data movement."""
    s: list[Spec] = []
    for dt in ("fp32", "fp16", "bf16"):
        for block, w in ((1024, 4), (2048, 8), (4096, 8)):
            s.append(_spec(f"add_{dt}_b{block}_w{w}", add_kernel, f"*{dt} *{dt} *{dt} i32", w, BLOCK=block))
    for dt, block, w, acts in (
        ("fp32", 1024, 4, range(5)),
        ("fp16", 2048, 8, range(5)),
        ("bf16", 2048, 8, range(5)),
    ):
        for act in acts:
            name = f"act_{_ACT_NAMES[act]}_{dt}_b{block}_w{w}"
            s.append(_spec(name, activation_kernel, f"*{dt} *{dt} i32", w, BLOCK=block, ACT=act))
    for dt, block, w in (*_ROWS, ("fp32", 4096, 8), ("fp16", 1024, 4), ("bf16", 8192, 16)):
        s.append(_spec(f"softmax_{dt}_b{block}_w{w}", softmax_kernel, f"*{dt} *{dt} i32 i32", w, BLOCK=block))
    for dt, block, w in (*_ROWS, ("fp16", 8192, 16)):
        p = f"*{dt}"
        types = f"{p} {p} {p} {p} *fp32 *fp32 i32 i32 fp32"
        s.append(_spec(f"layernorm_{dt}_b{block}_w{w}", layernorm_kernel, types, w, BLOCK=block))
        types = f"{p} {p} {p} i32 i32 fp32"
        s.append(_spec(f"rmsnorm_{dt}_b{block}_w{w}", rmsnorm_kernel, types, w, BLOCK=block))
    for dt, block, w in _ROWS:
        types = f"*{dt} *i64 *fp32 i32 i32"
        s.append(_spec(f"cross_entropy_{dt}_b{block}_w{w}", cross_entropy_kernel, types, w, BLOCK=block))
        s.append(
            _spec(f"cumsum_{dt}_b{block // 4}_w4", cumsum_kernel, f"*{dt} *{dt} i32 i32", BLOCK=block // 4)
        )
    for dt, bm, bn, bk, gm, act, w, st in _MATMUL_CONFIGS:
        name = f"matmul_{dt}_{bm}x{bn}x{bk}_g{gm}_a{act}_w{w}_s{st}"
        types = f"*{dt} *{dt} *{dt} i32 i32 i32" + " i32" * 6  # a, b, c, M, N, K, then six strides
        tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        s.append(_spec(name, matmul_kernel, types, w, st, GROUP_M=gm, ACT=act, **tiles))
    for bm, w in ((64, 4), (128, 8)):
        for causal in (False, True):
            name = f"attention_fwd_fp16_{bm}x64_d64_c{int(causal)}_w{w}_s2"
            tiles = {"BLOCK_M": bm, "BLOCK_N": 64, "HEAD_DIM": 64}
            s.append(
                _spec(
                    name,
                    attention_fwd_kernel,
                    "*fp16 *fp16 *fp16 *fp16 i32 fp32",
                    w,
                    2,
                    CAUSAL=causal,
                    **tiles,
                )
            )
    for dt, bm, bn, w in (("fp32", 32, 32, 4), ("fp16", 64, 64, 8), ("bf16", 32, 64, 4)):
        s.append(
            _spec(
                f"transpose_{dt}_{bm}x{bn}_w{w}",
                transpose_kernel,
                f"*{dt} *{dt} i32 i32",
                w,
                BLOCK_M=bm,
                BLOCK_N=bn,
            )
        )
    for dt, block in (("fp16", 1024), ("fp32", 512)):
        s.append(_spec(f"embedding_{dt}_b{block}_w4", embedding_kernel, f"*i32 *{dt} *{dt} i32", BLOCK=block))
    for dt, half in (("fp16", 64), ("bf16", 32)):
        s.append(_spec(f"rope_{dt}_h{half}_w1", rope_kernel, f"*{dt} *fp32 *fp32 *{dt} i32", 1, HALF=half))
    if len({x.name for x in s}) != len(s):
        raise AssertionError("duplicate spec names")
    return s


def compile_spec(spec: Spec, target):
    """Compile ``spec`` for a Triton ``GPUTarget`` with one plain ``triton.compile`` call (the
    baseline); every parameter of the function is typed by the spec or is one of its constexprs."""
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in spec.constexprs else spec.signature[n] for n in spec.fn.arg_names}
    src = ASTSource(fn=spec.fn, signature=sig, constexprs=dict(spec.constexprs))
    return triton.compile(
        src, target=target, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    )


# The built-in corpora of ``acompile bench --corpus``: this module's, or the kernel library
# (``acompile._bench.library``: fewer kernels, written as libraries write them). Anything else
# names a user's corpus module (``user_specs``).
CORPORA = ("default", "library")


@functools.cache
def specs(limit: int | None = None, which: str = "default") -> list[Spec]:
    """The specs of corpus ``which`` (one of ``CORPORA``, or a user's module as ``resolve_corpus``
    gives it), or their first ``limit``."""
    if which == "library":
        from acompile._bench.library import specs as library_specs

        chosen = list(library_specs())
    elif which == "default":
        chosen = corpus()
    else:
        chosen = user_specs(which)
    return chosen[:limit] if limit else chosen


# --- a user's corpus module ---------------------------------------------------------------------


class CorpusError(ValueError):
    """A ``--corpus`` module that cannot be used, and why (``acompile bench`` says so before any
    row runs, after the ``--corpus`` value)."""


_FIELDS = tuple(f.name for f in dataclasses.fields(Spec))
_REQUIRED = ("name", "fn", "signature")


def _split(ref: str) -> tuple[str, str | None]:
    """``FILE.py:NAME`` or ``MODULE:NAME`` into the module's part and the attribute's name."""
    where, colon, name = ref.rpartition(":")
    return (where, name) if colon and where and name.isidentifier() else (ref, None)


def _is_file(where: str) -> bool:
    """Whether the module's part names a file rather than a dotted module name."""
    return where.endswith(".py") or os.sep in where or where.startswith(".")


def resolve_corpus(text: str) -> str:
    """``--corpus`` as the rows' processes get it: a built-in corpus's name or a dotted module
    name as given, a file as its absolute path (a row may run in another folder); ``:NAME``
    kept. Raises ``CorpusError`` for a file that is not there."""
    if text in CORPORA:
        return text
    where, name = _split(text)
    if _is_file(where):
        path = Path(where).expanduser()
        if not path.is_file():
            raise CorpusError("no such file" if not path.exists() else "not a file")
        where = str(path.resolve())
    return f"{where}:{name}" if name else where


_IMPORTLIB = str(Path(importlib.__file__).parent)


def _import_error(exc: BaseException) -> str:
    """What importing a corpus module raised, with the place in the user's code where it did."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(("<frozen", _IMPORTLIB)) and f.filename != __file__
    ]
    at = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    return f"importing it raised {type(exc).__name__}: {exc}{at}"


def _import(where: str) -> types.ModuleType:
    """The corpus module: a file loaded under its stem's name with its folder on ``sys.path`` (as
    Python runs a script, so it may import its neighbours, and the workers can import it by
    name), or a dotted name imported with the current folder on ``sys.path`` (as ``python -m``)."""
    if not _is_file(where):
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            return importlib.import_module(where)
        except (Exception, SystemExit) as exc:
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if not missing or not (where == missing or where.startswith(f"{missing}.")):
                raise CorpusError(_import_error(exc)) from None
            # The module itself (or its package) is not there, rather than one it imports.
            builtin = f"; the built-in corpora are {', '.join(CORPORA)}" if "." not in where else ""
            raise CorpusError(f"cannot import it: {exc}{builtin}") from None
    path = Path(where)
    if not path.is_file():
        raise CorpusError("no such file")
    name = path.stem
    if not name.isidentifier():
        raise CorpusError(f"{name!r} is not a module name: name the file as a Python module")
    known = sys.modules.get(name)
    if known is not None:
        if getattr(known, "__file__", None) and Path(known.__file__ or "").resolve() == path.resolve():
            return known
        raise CorpusError(f"its module name {name!r} is an imported module's already: rename the file")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CorpusError("Python cannot load it as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise CorpusError(_import_error(exc)) from None
    return module


def _check(item: object, where: str) -> Spec:
    """One item of a corpus module's list as a ``Spec``, or ``CorpusError`` saying what is wrong
    with it (``where``: which item). A constexpr left out is filled with its default."""
    from triton.runtime.jit import JITFunction

    if isinstance(item, Spec):
        fields = {f: getattr(item, f) for f in _FIELDS}
    elif isinstance(item, Mapping):
        fields = dict(item)
    else:
        raise CorpusError(f"{where} is a {type(item).__name__} ({reprlib.repr(item)}), not a Spec or a dict")
    name = fields.get("name")
    named = f"{where} ({name!r})" if isinstance(name, str) else where
    known = f"a spec's fields are {', '.join(_FIELDS)}"
    if unknown := [k for k in fields if k not in _FIELDS]:
        raise CorpusError(f"{named} has an unknown field {unknown[0]!r}; {known}")
    if missing := [k for k in _REQUIRED if k not in fields]:
        raise CorpusError(f"{named} has no {missing[0]!r}; {known}")
    if not isinstance(name, str) or not name:
        raise CorpusError(f"{where}: name must be a non-empty string, got {reprlib.repr(name)}")
    fn = fields["fn"]
    if not isinstance(fn, JITFunction):
        wrapped = isinstance(getattr(fn, "fn", None), JITFunction)
        hint = " (an @triton.autotune or @triton.heuristics kernel: give its .fn, and one config's values)"
        raise CorpusError(
            f"{named}: fn is a {type(fn).__name__}, not a Triton JIT function (@triton.jit)"
            + (hint if wrapped else "")
        )
    for option, least in (("num_warps", 1), ("num_stages", 0)):
        value = fields.get(option, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CorpusError(f"{named}: {option} must be an int of at least {least}, got {value!r}")
    signature, constants = _parameters(fn, fields["signature"], fields.get("constexprs", {}), named)
    options = {k: fields[k] for k in ("num_warps", "num_stages") if k in fields}
    return Spec(name, fn, signature, constants, **options)


def _parameters(
    fn: Any, signature: object, constexprs: object, named: str
) -> tuple[dict[str, str], dict[str, object]]:
    """A spec's runtime types and constexpr values, checked against ``fn``'s parameters: each
    one is typed or given a value (a constexpr with a default may be left out: it gets it), no
    other name appears, and each type is one Triton knows."""
    from triton.language import str_to_ty

    if not isinstance(signature, Mapping) or not isinstance(constexprs, Mapping):
        wrong = "signature" if not isinstance(signature, Mapping) else "constexprs"
        raise CorpusError(f"{named}: {wrong} must be a dict keyed by parameter names")
    params = {p.name: p for p in fn.params}
    for key in (*signature, *constexprs):
        if key not in params:
            raise CorpusError(
                f"{named}: {fn.__name__} has no parameter {key!r}; its parameters are {list(params)}"
            )
    types: dict[str, str] = {}
    values: dict[str, object] = {}
    for key, param in params.items():
        if key in constexprs:
            values[key] = constexprs[key]
        elif key in signature and not param.is_constexpr:
            ty = signature[key]
            try:
                str_to_ty(ty, None)
            except (KeyError, IndexError, ValueError, TypeError, AttributeError):
                raise CorpusError(
                    f"{named}: unknown Triton type {ty!r} for {key!r} (e.g. '*fp16', 'i32')"
                ) from None
            types[key] = ty
        elif param.is_constexpr and param.has_default:
            values[key] = param.default
        elif param.is_constexpr:
            raise CorpusError(f"{named}: missing constexpr {key!r} of {fn.__name__}: give it in constexprs")
        else:
            raise CorpusError(
                f"{named}: missing type for parameter {key!r} of {fn.__name__}: add it to signature"
            )
    return types, values


def user_specs(ref: str) -> list[Spec]:
    """The specs of a user's corpus module (``resolve_corpus``'s form): its ``:NAME`` attribute,
    else ``SPECS``, else ``specs``; a function is called. Raises ``CorpusError`` for a module that
    does not import, holds no specs, or holds something that is not a list of valid, uniquely
    named specs."""
    where, attribute = _split(ref)
    module = _import(where)
    if attribute is None:
        attribute = next((a for a in ("SPECS", "specs") if hasattr(module, a)), None)
        if attribute is None:
            raise CorpusError(
                "the module has neither SPECS (a list) nor specs() (a function returning one); "
                "or name what holds its specs: --corpus MODULE:NAME"
            )
    elif not hasattr(module, attribute):
        raise CorpusError(f"the module has no attribute {attribute!r}")
    value, label = getattr(module, attribute), attribute
    if callable(value):
        label = f"{attribute}()"
        try:
            value = value()
        except Exception as exc:
            raise CorpusError(f"{label} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(value, (list, tuple)):
        raise CorpusError(f"{label} is a {type(value).__name__}, not a list of specs")
    if not value:
        raise CorpusError(f"{label} is empty: a corpus needs at least one spec")
    chosen = [_check(item, f"item {i} of {label}") for i, item in enumerate(value)]
    places: dict[str, list[int]] = {}
    for i, spec in enumerate(chosen):
        places.setdefault(spec.name, []).append(i)
    for name, indexes in places.items():
        if len(indexes) > 1:
            more = f" and {len(indexes) - 5} more" if len(indexes) > 5 else ""
            items = ", ".join(map(str, indexes[:5])) + more
            raise CorpusError(f"names must be unique: {name!r} is items {items} of {label}")
    return chosen


def acompile_specs(limit: int | None = None, which: str = "default") -> list[Any]:
    """The same specs as ``acompile.TritonSpec`` requests."""
    import acompile

    return [
        acompile.TritonSpec(s.fn, s.signature, s.constexprs, num_warps=s.num_warps, num_stages=s.num_stages)
        for s in specs(limit, which)
    ]


@functools.cache
def gpu_target(target: str) -> Any:
    """Triton's ``GPUTarget`` for an acompile target string such as ``"cuda:90"``."""
    from acompile._targets import parse_target

    return parse_target(target).to_triton()


def compile_index(index: int, target: str, limit: int | None, which: str = "default") -> dict[str, Any]:
    """The worker function of the process-pool baselines: compile spec ``index``, return its
    whole asm dict (a realistic payload crosses the process boundary) and when the worker began
    it (``started``, on the wall clock, which processes of one machine share: the first one is
    the pool's start, as the parent sees it)."""
    started = time.time()
    from acompile._bench.harness import quiet_warnings

    quiet_warnings()
    compiled = compile_spec(specs(limit, which)[index], gpu_target(target))
    return {"asm": dict(compiled.asm.items()), "started": started}


def outcome(results: list[Any], limit: int | None, which: str = "default") -> dict[str, Any]:
    """What a row produced for each spec, in order: a result is a cubin, a kernel with a
    ``cubin`` or an exception. The digest of each cubin, or the first line of what went wrong."""
    digests: dict[str, str] = {}
    errors: dict[str, str] = {}
    for spec, result in zip(specs(limit, which), results, strict=True):
        cubin = getattr(result, "cubin", result)
        if isinstance(cubin, (bytes, bytearray)) and cubin:
            digests[spec.name] = hashlib.sha256(cubin).hexdigest()[:16]
        else:
            error = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else "no cubin"
            lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or [repr(result)]
            # The first line says where; a compiler's last line says why (Triton's CompilationError:
            # "at 5:43:", the source, a caret, then the cause).
            said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            errors[spec.name] = said[:500]
    failed = {"failed": len(errors), "errors": dict(list(errors.items())[:10])}
    return {"specs": len(results), "ok": len(digests), **failed, "digests": digests}


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
