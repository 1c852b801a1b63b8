"""The GPU path: kernels compiled by the pool launch and compute the right thing.

These need an NVIDIA GPU, its driver and PyTorch (for device memory); they skip themselves where
any is missing (CI has no GPU). The last test is the opposite: what a machine *without* a GPU
says when asked to launch.
"""

from __future__ import annotations

import json
import struct
import textwrap
from pathlib import Path

import anyio
import pytest
import triton
import triton.language as tl
from conftest import gpu_available, run_python
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel
from test_native import KERNELS as SAXPY_KERNELS
from test_native import SAXPY_SO as SAXPY_HOST

import acompile

pytestmark = pytest.mark.anyio


def torch_cuda():  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


@pytest.mark.gpu
async def test_a_pool_kernel_launches_and_matches_tritons_own_jit(cache_dir: Path) -> None:
    torch = torch_cuda()
    n = 1_000_003
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    ours = torch.empty_like(x)
    theirs = torch.empty_like(x)
    async with acompile.CompilePool(2, cache_dir=cache_dir) as pool:  # target: the local GPU
        assert pool.target is not None and pool.target.backend == "cuda"
        k = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 1024})
        k[(triton_cdiv(n, 1024),)](x, y, ours, n)
        scaled = await pool.triton(scale_add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 512})
        out2 = torch.empty_like(x)
        scaled[lambda meta: (triton_cdiv(n, meta["BLOCK"]),)](x, y, out2, n)
    add_kernel[(triton_cdiv(n, 1024),)](x, y, theirs, n, BLOCK=1024)
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, x + y)
    torch.testing.assert_close(out2, x * 3 + y)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@pytest.mark.gpu
async def test_every_library_kernel_launched_by_the_pool_computes_what_tritons_jit_does(
    cache_dir: Path,
) -> None:
    torch = torch_cuda()
    from acompile._backends import launcher_module, launcher_problem
    from acompile._bench import library
    from acompile._bench.corpus import acompile_specs

    assert launcher_module(wait=True) is not None, launcher_problem()
    # Two identical sets of arguments (the same seed): some kernels write their inputs in place.
    ours, theirs = library.cases(seed=1), library.cases(seed=1)
    async with acompile.CompilePool(2, cache_dir=cache_dir) as pool:
        kernels = await pool.gather(*acompile_specs(which="library"))
    for kernel, mine, jit in zip(kernels, ours, theirs, strict=True):
        kernel[mine.grid](*mine.args)
        jit.spec.fn[jit.grid](*jit.args, **jit.keywords())
    # acompile's launcher launched every one of them (not Triton's, its fallback).
    assert {k.name: k.launcher for k in kernels} == {k.name: "acompile" for k in kernels}
    torch.cuda.synchronize()
    for mine, jit in zip(ours, theirs, strict=True):
        for a, b in zip(mine.outputs, jit.outputs, strict=True):
            assert not a.isnan().any(), mine.spec.name
            torch.testing.assert_close(a, b, msg=lambda m, name=mine.spec.name: f"{name}: {m}")


@pytest.mark.gpu
async def test_a_launch_takes_arguments_as_the_kernel_names_them_and_says_what_is_wrong(
    cache_dir: Path,
) -> None:
    torch = torch_cuda()
    import triton

    n = 10_000
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    async with acompile.CompilePool(1, cache_dir=cache_dir) as pool:
        k = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 1024})
    grid = (triton_cdiv(n, 1024),)
    assert k[grid] is k[grid]  # one launch function per grid, kept
    with pytest.raises(
        TypeError, match=r"add_kernel\[grid\]\(\) missing 2 required positional arguments: 'out_ptr' and 'n'"
    ):
        k[grid](x, y)
    with pytest.raises(
        TypeError, match=r"add_kernel\[grid\]\(\) takes 4 positional arguments but 5 were given"
    ):
        k[grid](x, y, out, n, 1024)
    with pytest.raises(TypeError, match="grid must be an int or a tuple of 1 to 3 ints"):
        k[(1, 1, 1, 1)]
    k[grid](x, y, out_ptr=out, n=n)  # by name, as Triton's JIT takes them
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)

    # On a stream of the caller's, and seen by a launch hook installed after the first launch.
    seen: list[str] = []

    def hook(metadata: object) -> None:
        seen.append(metadata.get()["name"])  # type: ignore[attr-defined]

    side = torch.cuda.Stream()
    out.zero_()
    torch.cuda.synchronize()
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        with torch.cuda.stream(side):
            k[lambda meta: (triton_cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, n)
        k[grid](x, y, out, n, stream=side.cuda_stream)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    side.synchronize()
    assert seen == ["add_kernel", "add_kernel"]
    assert torch.equal(out, x + y)


@pytest.mark.gpu
async def test_a_fresh_process_launches_from_the_disk_cache(cache_dir: Path) -> None:
    torch_cuda()
    async with acompile.CompilePool(1, cache_dir=cache_dir) as pool:
        await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 1024})
    script = textwrap.dedent(
        f"""
        import time
        t0 = time.perf_counter()
        import json, anyio, torch, acompile
        from kernels_for_tests import add_kernel, ADD_SIG

        async def main():
            t1 = time.perf_counter()
            async with acompile.CompilePool(1, cache_dir={str(cache_dir)!r}, prestart=False) as pool:
                k, tier = await pool.compile_with_tier(acompile.TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": 1024}}))
                n = 4096
                x = torch.arange(n, device="cuda", dtype=torch.float32)
                y = torch.ones(n, device="cuda", dtype=torch.float32)
                out = torch.empty_like(x)
                t2 = time.perf_counter()
                k[(n // 1024,)](x, y, out, n)
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                ok = bool(torch.equal(out, x + 1))
                print(json.dumps({{"tier": tier, "ok": ok, "started": pool.stats()["workers"]["started"],
                                   "pool_entry_to_launched_s": t3 - t1, "first_launch_s": t3 - t2,
                                   "process_start_to_launched_s": t3 - t0}}))

        anyio.run(main)
        """
    )
    out = await anyio.to_thread.run_sync(run_python, script)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tier"] == "disk" and result["ok"] and result["started"] == 0
    print("fresh-process launch from the disk cache:", result)


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
async def test_launching_without_a_gpu_says_so(cache_dir: Path) -> None:
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir) as pool:
        k = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
    with pytest.raises(acompile.DeviceUnavailableError, match="no GPU"):
        k[(1,)](0, 0, 0, 64)
    with pytest.raises(acompile.DeviceUnavailableError):
        k.load()


async def test_a_pool_without_a_target_on_a_machine_without_a_gpu_says_what_to_do(cache_dir: Path) -> None:
    if gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(acompile.DeviceUnavailableError, match="target='cuda:90'"):
        async with acompile.CompilePool(1, cache_dir=cache_dir):
            pass


@pytest.mark.gpu
async def test_saxpy_through_nvrtc_cubin_and_the_driver_api(cache_dir: Path) -> None:
    import ctypes

    torch = torch_cuda()
    n = 1 << 20
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = 2.5 * x + y
    async with acompile.CompilePool(1, cache_dir=cache_dir, preload=("cuda",)) as pool:
        module = await pool.cuda(SAXPY_KERNELS, name_expressions=["scale<float>"])
    module["saxpy"]((n + 255) // 256, 256, ctypes.c_float(2.5), x, y, ctypes.c_int32(n))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)
    module["scale<float>"]((n + 255) // 256, 256, y, ctypes.c_float(2.0), ctypes.c_int32(n))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, 2 * expected)


@pytest.mark.gpu
async def test_saxpy_through_an_nvcc_shared_library(cache_dir: Path) -> None:
    import ctypes
    import shutil

    torch = torch_cuda()
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    n = 1 << 20
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = 0.5 * x + y
    async with acompile.CompilePool(1, cache_dir=cache_dir, preload=("cuda",)) as pool:
        lib = await pool.cuda(SAXPY_HOST, output="so")
    lib.saxpy_host.argtypes = [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    assert lib.saxpy_host(0.5, x.data_ptr(), y.data_ptr(), n) == 0
    torch.testing.assert_close(y, expected)


@pytest.mark.gpu
async def test_pytorch_profiler_sees_pool_kernels_by_name(cache_dir: Path) -> None:
    """In a fresh interpreter that leaves with os._exit: PyTorch's profiler (kineto's CUPTI
    callbacks) frees a buffer twice in the CUDA runtime's exit handler, now and then, and glibc
    aborts the process after every test has passed (a core dump's backtrace:
    libkineto::CuptiCallbackApi's release under cuDevicePrimaryCtxRelease, from exit()). That is
    PyTorch's, not this library's; the test process must not pay for it."""
    torch_cuda()
    script = textwrap.dedent(
        f"""
        import json, os, sys, warnings
        import anyio, torch
        from torch.profiler import ProfilerActivity, profile
        import acompile
        from kernels_for_tests import ADD_SIG, add_kernel

        async def main():
            n = 1 << 16
            x = torch.randn(n, device="cuda")
            y = torch.randn(n, device="cuda")
            out = torch.empty_like(x)
            async with acompile.CompilePool(1, cache_dir={str(cache_dir)!r}) as pool:
                k = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={{"BLOCK": 1024}})
            k[(n // 1024,)](x, y, out, n)  # load outside the profile
            torch.cuda.synchronize()
            # The profiler's first session in a process may start CUPTI too late to see a
            # kernel: one session to warm it up, then the one that counts.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the profiler's notes about cycles
                for _ in range(2):
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(3):
                            k[(n // 1024,)](x, y, out, n)
                        torch.cuda.synchronize()
            return sorted({{e.name for e in prof.events()}})

        names = anyio.run(main)
        print(json.dumps(names), flush=True)
        sys.stderr.flush()
        os._exit(0)
        """
    )
    out = await anyio.to_thread.run_sync(run_python, script)
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert any("add_kernel" in name for name in names), names[:40]


@triton.jit
def _scalars_kernel(out_i, out_f, a, b, c, d, e, f, g, h, p, q, r, s):
    tl.store(out_i + 0, a.to(tl.int64))
    tl.store(out_i + 1, b.to(tl.int64))
    tl.store(out_i + 2, c.to(tl.int64))
    tl.store(out_i + 3, d.to(tl.int64))
    tl.store(out_i + 4, e.to(tl.int64))
    tl.store(out_i + 5, f.to(tl.int64))
    tl.store(out_i + 6, g.to(tl.int64))
    tl.store(out_i + 7, h.to(tl.int64, bitcast=True))
    tl.store(out_f + 0, p.to(tl.float64))
    tl.store(out_f + 1, q.to(tl.float64))
    tl.store(out_f + 2, r.to(tl.float64))
    tl.store(out_f + 3, s.to(tl.float64))


_SCALARS_SIG = {
    "out_i": "*i64", "out_f": "*fp64",
    "a": "i8", "b": "i16", "c": "i32", "d": "i64", "e": "u8", "f": "u16", "g": "u32", "h": "u64",
    "p": "fp16", "q": "bf16", "r": "fp32", "s": "fp64",
}  # fmt: skip
# Triton 3.6's launcher takes an i8 as an unsigned byte (0 to 255): the comparison with it uses 5.
_SCALARS = (5, -300, -70_000, -(2**40), 200, 60_000, 4_000_000_000, 2**63 + 5, 1.5, -2.5, 3.25, 1e300)


@pytest.mark.gpu
async def test_acompiles_launcher_passes_every_scalar_kind_as_tritons_does(cache_dir: Path) -> None:
    torch = torch_cuda()
    from acompile._backends import launcher_module, launcher_problem

    assert launcher_module(wait=True) is not None, launcher_problem()
    async with acompile.CompilePool(1, cache_dir=cache_dir) as pool:
        k = await pool.triton(_scalars_kernel, signature=_SCALARS_SIG)
    k.load()
    assert k.launcher == "acompile"
    # Loaded through acompile's launcher, the kernel class's subscript is its method of C.
    assert type(acompile.TritonKernel.__dict__["__getitem__"]).__name__ == "method_descriptor"
    ours_i, ours_f = (
        torch.zeros(8, dtype=torch.int64, device="cuda"),
        torch.zeros(4, dtype=torch.float64, device="cuda"),
    )
    theirs_i, theirs_f = torch.zeros_like(ours_i), torch.zeros_like(ours_f)
    k[(1,)](ours_i, ours_f, *_SCALARS)
    k.compiled[(1, 1, 1)](theirs_i, theirs_f, *_SCALARS)  # Triton's own launcher
    torch.cuda.synchronize()
    assert torch.equal(ours_i, theirs_i) and torch.equal(ours_f, theirs_f)
    assert ours_i.tolist() == [5, -300, -70_000, -(2**40), 200, 60_000, 4_000_000_000, 2**63 + 5 - 2**64]
    assert ours_f.tolist() == [1.5, -2.5, 3.25, 1e300]
    k[(1,)](
        ours_i,
        ours_f,
        -128,
        -(2**15),
        -(2**31),
        -(2**63),
        255,
        2**16 - 1,
        2**32 - 1,
        2**64 - 1,
        -0.0,
        1e38,
        -1e-30,
        -1e-300,
    )
    torch.cuda.synchronize()
    assert ours_i.tolist() == [-128, -(2**15), -(2**31), -(2**63), 255, 2**16 - 1, 2**32 - 1, -1]
    # bf16: the float32's high half, as Triton's launcher takes it (truncated, not rounded).
    as_f32 = struct.unpack("<f", struct.pack("<f", 1e38))[0]
    bf16 = struct.unpack(
        "<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", as_f32))[0] & 0xFFFF0000)
    )[0]
    assert ours_f.tolist() == [-0.0, bf16, struct.unpack("<f", struct.pack("<f", -1e-30))[0], -1e-300]


async def _add_kernel_on_acompiles_launcher(cache_dir: Path) -> acompile.TritonKernel:
    """add_kernel (BLOCK 1024) from a pool, on a machine whose launcher is built (awaited)."""
    from acompile._backends import launcher_module, launcher_problem

    assert launcher_module(wait=True) is not None, launcher_problem()
    async with acompile.CompilePool(1, cache_dir=cache_dir) as pool:
        return await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 1024})


@pytest.mark.gpu
async def test_acompiles_launcher_refuses_bad_arguments_by_name_and_launches_nothing(cache_dir: Path) -> None:
    torch = torch_cuda()
    k = await _add_kernel_on_acompiles_launcher(cache_dir)
    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    grid = (triton_cdiv(n, 1024),)
    k[grid](x, y, out, n)
    assert k.launcher == "acompile"
    with pytest.raises(
        ValueError, match=r"argument x_ptr: pointer 0x[0-9a-f]+ is not memory the GPU can access"
    ):
        k[grid](x.cpu(), y, out, n)
    with pytest.raises(
        OverflowError, match=r"argument n: 2147483648 does not fit the kernel's i32 parameter"
    ):
        k[grid](x, y, out, 2**31)
    with pytest.raises(TypeError, match=r"argument n: an integer parameter takes an int, got str"):
        k[grid](x, y, out, "4096")
    with pytest.raises(TypeError, match=r"argument out_ptr: a pointer parameter takes a tensor"):
        k[grid](x, y, object(), n)
    with pytest.raises(TypeError, match="stream must be a CUDA stream handle"):
        k[grid](x, y, out, n, stream="default")
    out.zero_()
    k[(0,)](x, y, out, n)  # an empty grid launches nothing, as in Triton
    torch.cuda.synchronize()
    assert not out.any()
    k[grid](x, y, out, n)  # nothing above left an error behind
    k[lambda meta: (triton_cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, n)
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)


@pytest.mark.gpu
async def test_a_pointer_check_skipped_for_a_known_allocation_still_refuses_what_is_not_gpu_memory(
    cache_dir: Path,
) -> None:
    # The launcher checks a PyTorch tensor's pointer with the driver once per allocation. What it
    # remembers must never let through a CPU tensor, nor a bare int or another object with
    # data_ptr() pointing into memory freed since (allocated and freed here through the driver,
    # outside PyTorch's caching allocator, so that the free is real).
    import ctypes

    torch = torch_cuda()
    k = await _add_kernel_on_acompiles_launcher(cache_dir)
    n = 4096
    grid = (triton_cdiv(n, 1024),)
    y, out = torch.ones(n, device="cuda"), torch.zeros(n, device="cuda")
    driver = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64()
    assert driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(n * 4)) == 0

    class Buffer:
        def data_ptr(self) -> int:
            return pointer.value

    k[grid](Buffer(), y, out, n)
    k[grid](pointer.value, y, out, n)
    torch.cuda.synchronize()
    assert k.launcher == "acompile"
    assert driver.cuMemFree_v2(pointer) == 0
    with pytest.raises(
        ValueError, match=r"argument x_ptr: pointer 0x[0-9a-f]+ is not memory the GPU can access"
    ):
        k[grid](Buffer(), y, out, n)
    with pytest.raises(
        ValueError, match=r"argument x_ptr: pointer 0x[0-9a-f]+ is not memory the GPU can access"
    ):
        k[grid](pointer.value, y, out, n)
    with pytest.raises(ValueError, match="is not memory the GPU can access"):
        k[grid](torch.ones(n), y, out, n)
    # More allocations than it remembers: each still launches, and computes.
    tensors = [torch.full((n,), float(i), device="cuda") for i in range(40)]
    for t in tensors:
        k[grid](t, y, out, n)
        torch.cuda.synchronize()
        assert torch.equal(out, t + 1)
    with pytest.raises(ValueError, match="is not memory the GPU can access"):
        k[grid](torch.ones(n), y, out, n)


@pytest.mark.gpu
async def test_launches_through_the_bridge_to_pytorch_compute_on_views_parameters_and_subclasses(
    cache_dir: Path,
) -> None:
    # The bridge reads an exact tensor's address in C (built here against this PyTorch, on the
    # first kernel's load); views (an offset address), Parameters and subclasses (through their
    # data_ptr()) launch and compute as through Triton's own launcher, and a CPU tensor is
    # still refused by name.
    torch = torch_cuda()
    from acompile._backends import _launcher

    k = await _add_kernel_on_acompiles_launcher(cache_dir)
    n = 4099
    grid = (triton_cdiv(n, 1024),)
    base = torch.randn(n + 7, device="cuda")
    y, out = torch.randn(n, device="cuda"), torch.zeros(n + 3, device="cuda")
    k[grid](base[7:], y, out[3:], n)
    assert k.launcher == "acompile"
    assert await anyio.to_thread.run_sync(_launcher.wait_for_bridge), _launcher.bridge_problem()

    class Marked(torch.Tensor):
        pass

    cases = [
        (base[7:], y, out[3:]),
        (torch.nn.Parameter(base[:n].clone()), y.as_subclass(Marked), out[:n]),
        (base[1 : n + 1], y, out[3:]),
    ]
    for x, b, o in cases:
        o.zero_()
        k[grid](x, b, o, n)
        torch.cuda.synchronize()
        assert torch.equal(o, x.detach() + b), "a launch through the bridge computed something else"
    with pytest.raises(ValueError, match=r"argument y_ptr: pointer 0x[0-9a-f]+ is not memory the GPU"):
        k[grid](base[7:], y.cpu(), out[3:], n)


@pytest.mark.gpu
def test_the_first_launch_bench_runs_both_sides_and_sets_each_launch_against_the_drivers_call(
    tmp_path: Path,
) -> None:
    """`acompile bench --first-launch`, small: every library kernel launched by acompile's
    launcher, each with the driver's call and its floor from Python beside it (for a kernel with
    a grid function, that floor calls the grid function too: tests/test_launcher.py checks it)."""
    torch_cuda()
    import subprocess
    import sys

    from conftest import subprocess_env

    command = [
        sys.executable,
        "-m",
        "acompile.cli",
        "bench",
        "--first-launch",
        "--repeat",
        "1",
        "--launches",
        "100",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=400, env=subprocess_env(), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[-1:] == ["acompile"]}
    for name in ("rms_norm", "gelu", "flash_attention", "matmul_large", "nop", "nop_19_args"):
        assert name in rows, out
    assert rows["nop"][4] == "-" and rows["gelu"][4] != "-"  # the grid fn column: gelu's grid is a function
    assert "launch host cost over the driver's call:" in out
    assert "made from Python (a grid fn called first, where there is one)" in out
