"""Kernels the tests compile, with a helper JIT function and a constexpr global."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Tests check that workers rebuild kernels from their source instead of importing this module:
# every import appends the importing process's pid here.
_MARKER = os.environ.get("ACOMPILE_TEST_IMPORT_MARKER")
if _MARKER:
    with open(_MARKER, "a") as f:
        f.write(f"{os.getpid()}\n")

SCALE: tl.constexpr = tl.constexpr(3)


@triton.jit
def _scaled(x):
    return x * SCALE


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def scale_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr = 256):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, _scaled(x) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + undefined_name)  # noqa: F821


ADD_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


@triton.jit
def slow_to_compile_kernel(x_ptr, out_ptr, N: tl.constexpr):
    # N unrolled loads: with N in the hundreds, a compile takes tens of seconds on 2 cores.
    acc = tl.zeros((16,), dtype=tl.float32)
    for i in tl.static_range(N):
        acc += tl.load(x_ptr + i * 16 + tl.arange(0, 16)) * (i + 1)
    tl.store(out_ptr + tl.arange(0, 16), acc)


# A kernel given as a source string, for the tests of what its top-level code may do: ``top`` is
# that code, ``n`` what the kernel adds (another n, another kernel).
SOURCE_SIG = {"x_ptr": "*fp32", "n": "i32"}
_SOURCE = """
import os, sys, subprocess, time
import triton
import triton.language as tl

{top}

@triton.jit
def scaled(x_ptr, n, BLOCK: tl.constexpr = 128):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 3.0 + {n}, mask=m)
"""


def source_text(top: str = "", n: int = 0) -> str:
    return _SOURCE.format(top=top, n=n)
