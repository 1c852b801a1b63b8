"""A CuTe DSL kernel of the tests' own, built through FlashInfer's
``build_and_load_cute_dsl_kernel`` as FlashInfer's own CuTe DSL kernels are (one ``JitSpecCuteDsl``
a kernel, keyed by this file's contents). The tests copy this file into each "machine"'s own
folder as ``served_cute_kernel.py``, so that each imports it from another path.

``cute.compile`` needs no GPU where ``CUTE_DSL_ARCH`` names the target (``sm_90a``); FlashInfer's
own CuTe DSL kernels ask the GPU which arch to build for, which this machine has not.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from flashinfer.jit.cute_dsl_core import build_and_load_cute_dsl_kernel

ADD = 1.0  # a test changes it in one machine's copy: a changed source is another kernel
COMPILES: list[str] = []  # each cute.compile this process ran


@cute.kernel
def _add(a: cute.Tensor) -> None:
    tidx, _, _ = cute.arch.thread_idx()
    a[tidx] = a[tidx] + ADD


@cute.jit
def _launch(a: cute.Tensor) -> None:
    _add(a).launch(grid=(1, 1, 1), block=(32, 1, 1))


def build(width: int = 32) -> Any:
    """The kernel for ``width`` float32 values: FlashInfer's disk cache, else acompile's tiers
    where it is served, else compiled here."""
    fake = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (width,), assumed_align=16)

    def compile_it() -> Any:
        COMPILES.append(f"add_f32_{width}")
        return cute.compile(_launch, fake, options="--enable-tvm-ffi")

    return build_and_load_cute_dsl_kernel(
        "acompile_tests", f"add_f32_{width}", compile_it, extra_key_files=(__file__,)
    )
