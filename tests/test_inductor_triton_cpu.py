"""The served-Triton path of ``inductor.serve`` without a GPU: Inductor's own
``AsyncCompile.triton`` hands a kernel to the process pool it is given, and while served that is
acompile's pool. The kernel is what Inductor 2.13 writes for a pointwise add on a CUDA device
(its source below, as a torch.compile of ``x + 1`` on an H200 wrote it, trimmed of the metadata
this test does not need); the one fake is the GPU (``tests/fake_cuda_driver.py``: Triton asks for
an active driver before a compile that uses none). Triton compiles it for real, for sm_90,
with its own ptxas.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python

pytestmark = pytest.mark.slow

KERNEL = r"""
import fake_cuda_driver
fake_cuda_driver.install(MARKS)
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.hints import DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 1024},
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, warp_size=32), 'constants': {}, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_add_0', 'mutated_arg_names': [], 'optimize_mem': False, 'no_x_dim': False, 'num_load': 1, 'num_store': 1, 'num_reduction': 0, 'autotune_local_cache': False, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 1024
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = ADD
    tmp2 = tmp0 + tmp1
    tl.store(out_ptr0 + (x0), tmp2, xmask)
"""

PROGRAM = """
import json, os, sys
from acompile import inductor
from torch._inductor.async_compile import AsyncCompile

kernels = json.loads(sys.argv[1])
with inductor.serve(workers=WORKERS, jits=()) as serving:
    # Until the workers are ready Inductor compiles in its own process, as it does while its
    # own pool warms up.
    assert serving.wait_ready(timeout=120)
    compiler = AsyncCompile()
    futures = [compiler.triton("triton_poi_fused_add_0", source) for source in kernels]
    results = [f.future.result(timeout=240) for f in futures]  # the pool's answer (the parent's
    # own half, loading the launchers, needs a GPU)
    stats = serving.stats()
print(json.dumps({
    "pid": os.getpid(),
    "configs": [len(kernel.compile_results) for kernel, _ in results],
    "jobs": stats.get("jobs"),
}))
"""


@pytest.mark.parametrize("workers", [1, 4])
def test_inductors_triton_kernels_compile_on_the_pools_workers(tmp_path: Path, workers: int) -> None:
    """Each kernel Inductor hands its process pool compiles on one of acompile's workers, never
    in the served process; with 4 workers, each further config of a kernel gets a job of its own
    (the fan-out), on the workers too."""
    marks = tmp_path / "compiled-in"
    kernels = [KERNEL.replace("MARKS", repr(str(marks))).replace("ADD", add) for add in ("1.0", "2.0", "3.0")]
    code = f"import sys; sys.argv[1:] = [{json.dumps(json.dumps(kernels))}]\n" + PROGRAM.replace(
        "WORKERS", str(workers)
    )
    done = run_python(code, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Inductor's pointwise heuristics give a 1024-element kernel two configs; both compiled.
    assert report["configs"] == [2, 2, 2], report
    pids = [int(line) for line in marks.read_text().splitlines()]
    assert pids and report["pid"] not in pids, (report, pids)  # never in the served process
    assert report["jobs"]["sent"] == 3 and report["jobs"]["run_here"] == 0, report
    if workers == 1:
        # One job a kernel, both its configs compiled there.
        assert report["jobs"]["configs_fanned_out"] == 0 and len(pids) == 6, (report, pids)
    else:
        # Each kernel's second config got a job of its own, on another worker as it happened.
        assert report["jobs"]["configs_fanned_out"] == 3 and len(set(pids)) >= 2, (report, pids)
