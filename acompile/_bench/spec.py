"""One compile request of a benchmark's kernels: the corpus's (``corpus``), the kernel library's
(``library``) and a user's corpus module's (``acompile bench --corpus FILE.py|MODULE[:NAME]``)
are all lists of ``Spec``.

``Spec`` is the one name of the benchmark that users' code imports: a corpus module may list its
compile requests as ``Spec``s (``from acompile._bench.spec import Spec``) or as plain dicts with
the same fields. ``examples/bench_corpus.py`` is such a module.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import triton


@dataclasses.dataclass(frozen=True)
class Spec:
    """One compile request: a JIT function plus everything needed to compile it.

    ``name``: unique within the corpus, e.g. ``"add_fp32_b1024_w4"`` (the report's errors and
    cubin digests are keyed by it). ``fn``: a ``@triton.jit`` function. ``signature``: the Triton
    type of each runtime (non-constexpr) parameter, e.g. ``{"x_ptr": "*fp16", "n": "i32"}``.
    ``constexprs``: the value of each ``tl.constexpr`` parameter (those with a default may be left
    out). ``num_warps`` and ``num_stages``: Triton's launch options.
    """

    name: str
    fn: triton.JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object] = dataclasses.field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
