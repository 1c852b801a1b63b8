"""CUDA C++ through NVRTC and nvcc, and C++ through the system compiler: real compilers."""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path

import anyio
import pytest
from conftest import gpu_available, run_python

import acompile

pytestmark = pytest.mark.anyio

KERNELS = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

template <typename T> __global__ void scale(T* x, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""

# The same kernel with a host entry point, for nvcc's shared library (as Inductor builds them).
SAXPY_SO = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" int saxpy_host(float a, const float* x, float* y, int n) {
    saxpy<<<(n + 255) / 256, 256>>>(a, x, y, n);
    return (int)cudaDeviceSynchronize();
}
"""

CPP = r"""
#include <cstdint>
extern "C" int64_t dot(const int64_t* a, const int64_t* b, int64_t n) {
    int64_t s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
"""

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def pool(cache_dir: Path, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(2, target="cuda:90", cache_dir=cache_dir, preload=("cuda",), **kw)  # type: ignore[arg-type]


async def test_nvrtc_compiles_cubin_and_ptx_with_name_expressions(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        module = await p.cuda(KERNELS, name_expressions=["scale<float>"])
        ptx = await p.cuda(KERNELS, output="ptx", arch="sm_80")
    assert isinstance(module, acompile.CudaModule) and module.name == "saxpy"
    assert module.cubin is not None and module.cubin[:4] == b"\x7fELF" and module.ptx is None
    assert module.lowered_names == {"scale<float>": "_Z5scaleIfEvPT_S0_i"}
    assert ptx.ptx is not None and ".target sm_80" in ptx.ptx and ".entry saxpy" in ptx.ptx
    assert module.key != ptx.key


@needs_nvcc
async def test_nvcc_builds_a_shared_library_and_an_object(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        lib = await p.cuda(SAXPY_SO, output="so")
        obj = await p.cuda(SAXPY_SO, output="o", options=["-O3"])
    assert isinstance(lib, acompile.SharedLibrary) and lib.path.parent == cache_dir / "lib"
    assert lib.path.read_bytes()[:4] == b"\x7fELF" and hasattr(lib, "saxpy_host")
    assert isinstance(obj, acompile.ObjectFile) and obj.path.suffix == ".o" and obj.path.stat().st_size > 0


async def test_cpp_builds_a_library_that_runs(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        lib = await p.cpp(CPP, options=["-O2"])
        again, tier = await p.compile_with_tier(acompile.CppSpec(CPP, ("-O2",)))
    lib.dot.restype = ctypes.c_int64
    a = (ctypes.c_int64 * 3)(1, 2, 3)
    b = (ctypes.c_int64 * 3)(4, 5, 6)
    assert lib.dot(a, b, ctypes.c_int64(3)) == 32
    assert again is lib and tier == "memory"


async def test_a_fresh_process_loads_native_results_from_the_disk_cache(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        module = await p.cuda(KERNELS)
        lib = await p.cpp(CPP)
    script = f"""
import json, anyio, acompile

async def main():
    async with acompile.CompilePool(1, target="cuda:90", cache_dir={str(cache_dir)!r}, prestart=False) as p:
        m, t1 = await p.compile_with_tier(acompile.CudaSpec({KERNELS!r}))
        lib, t2 = await p.compile_with_tier(acompile.CppSpec({CPP!r}))
        print(json.dumps([m.key, t1, lib.key, t2, str(lib.path), p.stats()["workers"]["started"]]))

anyio.run(main)
"""
    out = await anyio.to_thread.run_sync(run_python, script)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [module.key, "disk", lib.key, "disk", str(lib.path), 0]


async def test_compiler_errors_name_the_line(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.CUDACompileError) as info:
            await p.cuda("__global__ void broken(int* x) {\n  x[0] = undefined_thing;\n}\n")
        err = info.value
        assert (err.kernel, err.backend, err.line, err.source_line) == (
            "broken",
            "cuda",
            2,
            "x[0] = undefined_thing;",
        )
        assert "undefined_thing" in err.log and "line 2" in str(err)
        with pytest.raises(acompile.CppCompileError) as cpp_info:
            await p.cpp("int f() {\n  return nope;\n}\n", name="f")
        assert cpp_info.value.line == 2 and "nope" in cpp_info.value.log
        if shutil.which("nvcc"):
            with pytest.raises(acompile.CUDACompileError, match="nvcc rejected"):
                await p.cuda("__global__ void k() { int x = ; }", output="so")
        # The pool is none the worse for it.
        assert (await p.cuda(KERNELS)).cubin
        assert p.stats()["workers"]["restarts"] == {}


async def test_wrong_arguments_are_refused_before_any_worker(cache_dir: Path) -> None:
    async with pool(cache_dir, prestart=False) as p:
        cases = [
            (dict(output="fatbin"), "output must be one of"),
            (dict(arch="sm_12"), "unknown CUDA architecture"),
            (dict(arch="volta"), "unknown architecture"),
            (dict(output="so", name_expressions=["scale<float>"]), "name_expressions apply to NVRTC"),
            (dict(options="-O3"), "options must be a list of strings"),
            (dict(name="not a name"), "name must be an identifier"),
        ]
        for kwargs, message in cases:
            with pytest.raises(acompile.InvalidSpecError, match=message):
                await p.cuda(KERNELS, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(acompile.InvalidSpecError, match="non-empty"):
            await p.cpp("   ")
        assert p.stats()["workers"]["started"] == 0


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
async def test_loading_a_module_without_a_gpu_says_so(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        module = await p.cuda(KERNELS)
    with pytest.raises(acompile.DeviceUnavailableError, match="cached and shipped"):
        module["saxpy"]


def test_scalars_must_carry_their_c_type() -> None:
    from acompile._backends._native import _kernel_arg

    assert isinstance(_kernel_arg(0, ctypes.c_float(2.0)), ctypes.c_float)
    with pytest.raises(TypeError, match=r"ctypes.c_int32\(n\)"):
        _kernel_arg(1, 42)
