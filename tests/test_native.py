"""CUDA C++ through NVRTC and nvcc, and C++ through the system compiler: real compilers."""

from __future__ import annotations

import ctypes
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from conftest import gpu_available, run_python, subprocess_env

import acompile
from acompile.testing import run_job

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
    from acompile._backends._driver import _kernel_arg

    assert isinstance(_kernel_arg(0, ctypes.c_float(2.0)), ctypes.c_float)
    with pytest.raises(TypeError, match=r"ctypes.c_int32\(n\)"):
        _kernel_arg(1, 42)


# gcc prints each #error with its source line: ~4 MB of log in a fraction of a second.
FLOOD = "\n".join(f"#error flood {i} " + "x" * 2000 for i in range(1000)) + "\n"


def _bounded_error(err: acompile.CompileError) -> None:
    from acompile._errors import TEXT_LIMIT

    for text in (err.args[0], err.log, err.stderr_tail, err.worker_traceback):
        assert len(text) <= TEXT_LIMIT
    assert len(str(err)) <= 2 * TEXT_LIMIT + 100
    assert len(pickle.dumps(err)) < 5 * TEXT_LIMIT


async def test_a_flood_of_compiler_errors_is_cut_and_the_whole_log_saved(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.CppCompileError) as info:
            await p.cpp(FLOOD, name="flood")
        err = info.value
        assert err.kernel == "flood" and err.backend == "cpp" and err.line == 1
        _bounded_error(err)
        assert "characters cut" in err.log and "flood 0 " in err.log and "flood 999 " in err.log
        assert err.log_path is not None and err.log_path in str(err)
        saved = Path(err.log_path)
        assert saved.parent == cache_dir / "logs"
        whole = await anyio.Path(saved).read_text()
        assert len(whole) > 2_000_000 and whole.count("flood") >= 2000
        # The pool goes on.
        assert (await p.cpp(CPP)).path.exists()


def test_every_text_of_a_compile_error_is_bounded_however_it_is_set() -> None:
    big = "a" * 10_000_000 + "THE END"
    err = acompile.CUDACompileError(big, kernel="k", backend="cuda", log=big, stderr_tail=big)
    err.worker_traceback = big
    _bounded_error(err)
    assert err.log.endswith("THE END") and err.log.startswith("aaa") and "characters cut" in err.log
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is acompile.CUDACompileError and again.log == err.log and again.kernel == "k"


def _in_mount_namespace(setup: str, script: str) -> subprocess.CompletedProcess[str]:
    """Run Python in a private mount namespace after shell commands (mounts) that only it sees."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give a test its own mounts")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m acompile-probe /mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}")
    env = subprocess_env()
    for name in ("CUDA_HOME", "CUDA_PATH"):
        env.pop(name, None)
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_a_full_disk_is_a_compile_error_and_leaves_no_file(tmp_path: Path) -> None:
    full, roomy = tmp_path / "full", tmp_path / "roomy"
    full.mkdir()
    roomy.mkdir()
    script = textwrap.dedent(
        f"""
        import errno, json, os, tempfile, anyio, acompile
        from pathlib import Path

        FULL, ROOMY = Path({str(full)!r}), Path({str(roomy)!r})
        (FULL / "cache").mkdir()
        (FULL / "tmp").mkdir()

        def fill():  # the tmpfs, to its last byte
            with open(FULL / "filler", "ab", buffering=0) as f:
                for chunk in (b"x" * 4096, b"x"):
                    try:
                        while True:
                            f.write(chunk)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC

        async def attempt(cache_dir):
            async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
                try:
                    await p.cpp({CPP!r}, name="dot")
                except acompile.AcompileError as exc:
                    return [type(exc).__name__, str(exc), exc.kernel]
                return ["ok"]

        async def main():
            # The library cannot be published into the cache folder.
            fill()
            print(json.dumps(await attempt(FULL / "cache")))
            # The compiler's own work folder is on the full disk.
            os.environ["TMPDIR"] = tempfile.tempdir = str(FULL / "tmp")
            fill()
            print(json.dumps(await attempt(ROOMY / "cache")))
            left = sorted(str(p.relative_to(FULL)) for p in FULL.rglob("*") if p.is_file())
            print(json.dumps(left))

        anyio.run(main)
        """
    )
    mount = f"mount -t tmpfs -o size=512k acompile-full {full}"
    out = _in_mount_namespace(mount, script)
    assert out.returncode == 0, out.stderr[-3000:]
    publish, work, left = (json.loads(line) for line in out.stdout.splitlines()[-3:])
    assert publish[0] == "CppCompileError" and "the disk is full" in publish[1] and publish[2] == "dot"
    assert work[0] == "CppCompileError" and "the disk is full" in work[1] and work[2] == "dot"
    # No temporary file anywhere on that disk (the cost model's lock file is a permanent one).
    assert left in (["filler"], ["cache/costs.json.lock", "filler"]), (left, work)


def test_cuda_without_the_nvrtc_library_says_what_to_install() -> None:
    import nvidia

    libs = [Path(p) / "cu13" / "lib" for p in nvidia.__path__] + [
        Path(p) / "cuda_nvrtc" / "lib" for p in nvidia.__path__
    ]
    hide = " && ".join(f"mount -t tmpfs -o size=1m acompile-hide {d}" for d in libs if (d / "").is_dir())
    if not hide:
        pytest.skip("NVRTC does not come from a wheel here")
    script = textwrap.dedent(
        f"""
        import anyio, acompile

        async def main():
            async with acompile.CompilePool(1, target="cuda:90", prestart=False, preload=()) as p:
                try:
                    await p.cuda({KERNELS!r})
                except acompile.AcompileError as exc:
                    print(type(exc).__name__, isinstance(exc, ImportError), p.stats()["workers"]["started"])
                    print(exc)

        anyio.run(main)
        """
    )
    out = _in_mount_namespace(hide, script)
    assert out.returncode == 0, out.stderr[-3000:]
    first, message = out.stdout.split("\n", 1)
    assert first == "BackendUnavailableError True 0"
    assert 'pip install "acompile[cuda]"' in message and "NVRTC" in message


async def test_a_worker_failure_with_a_huge_message_is_cut(cache_dir: Path) -> None:
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
        with pytest.raises(acompile.CompileError) as info:
            await run_job(
                p, "fake_backend", {"action": "raise", "message": "m" * 40_000_000, "name": "big"}, "big"
            )
    err = info.value
    assert err.kernel == "big" and "ValueError" in str(err)
    _bounded_error(err)


def test_each_backend_is_one_entry_of_the_registry_and_its_specs_name_it() -> None:
    import importlib
    import importlib.util

    from acompile._backends import BACKENDS, backend_of, load_parent, worker_module

    for name, backend in BACKENDS.items():
        for qualname in backend.spec_classes:
            module, _, cls = qualname.rpartition(".")
            assert getattr(importlib.import_module(module), cls).backend == name
        assert worker_module(name) == backend.worker
        # A parent half names its worker module itself (it never imports the registry that
        # loads it): the two say the same.
        if backend.requires is None or importlib.util.find_spec(backend.requires) is not None:
            assert load_parent(name).WORKER_MODULE == backend.worker, name
    assert [backend_of(s) for s in (acompile.CudaSpec("x"), acompile.CppSpec("x"))] == ["cuda", "cpp"]
    assert backend_of(acompile.TritonSpec(None, {})) == "triton"
    assert load_parent("cuda").WORKER_MODULE == load_parent("cpp").WORKER_MODULE == worker_module("cpp")

    class Impostor:  # named like a spec, but not one: the type decides, not the name
        backend = "cuda"

    Impostor.__name__ = Impostor.__qualname__ = "CudaSpec"
    for thing in (Impostor(), object(), "cuda"):
        with pytest.raises(TypeError, match="not a compile spec"):
            backend_of(thing)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        load_parent("nope")


def test_the_backends_face_imports_each_name_on_first_use_and_no_backend_before() -> None:
    """The rest of acompile takes backend names from ``acompile._backends``, which imports each
    from its module the first time it is asked for: a worker importing a backend's worker half
    imports no other backend, nor the registry, and every name is the one its module defines."""
    code = """
import importlib, sys
import acompile._backends._native_worker
print(sorted(m for m in sys.modules if m.startswith("acompile._backends")))
import acompile._backends as face
for name in face.__all__:
    where = face._NAMES[name]
    module, there = (where, name) if isinstance(where, str) else where
    home = importlib.import_module("acompile._backends." + module)
    assert getattr(face, name) is getattr(home, there), name
try:
    face.nope
except AttributeError as exc:
    print(exc)
from acompile._backends import _launcher
print(_launcher.__name__)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=subprocess_env(ACOMPILE_WORKER="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded, missing, launcher = out.stdout.splitlines()
    assert loaded == str(
        ["acompile._backends", "acompile._backends._logs", "acompile._backends._native_worker"]
    )
    assert missing == "module 'acompile._backends' has no attribute 'nope'"
    assert launcher == "acompile._backends._launcher"


def test_preloading_unknown_backends_names_the_known_ones(cache_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown backend\(s\) to preload: \['nope'\]; known: \['cpp', 'cuda', 'inductor', 'triton'\]",
    ):
        acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=("nope",))
