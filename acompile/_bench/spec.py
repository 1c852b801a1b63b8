"""One compile request of a benchmark's kernels: the corpus's (``corpus``) and the kernel
library's (``library``) are both lists of ``Spec``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import triton


@dataclasses.dataclass(frozen=True)
class Spec:
    """One compile request: a JIT function plus everything needed to compile it."""

    name: str  # unique, e.g. "add_fp32_b1024_w4"
    fn: triton.JITFunction
    signature: dict[str, str]  # runtime (non-constexpr) params only -> triton type string
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
