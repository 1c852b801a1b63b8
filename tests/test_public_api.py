"""The public surface: one namespace, nothing heavy on import."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_python

import acompile

EXPECTED = {
    "AcompileError",
    "BundleReport",
    "PruneReport",
    "explain_key",
    "export_bundle",
    "import_bundle",
    "prune_cache",
    "Trial",
    "TuneResult",
    "TunedKernel",
    "BackgroundKernel",
    "KernelNotReadyError",
    "ProgressiveKernel",
    "CUDACompileError",
    "CppCompileError",
    "CppSpec",
    "CudaFunction",
    "CudaModule",
    "CudaSpec",
    "ObjectFile",
    "SharedLibrary",
    "BackendUnavailableError",
    "CompileError",
    "CompilePool",
    "CompileTimeoutError",
    "DeviceUnavailableError",
    "FarmToolchainError",
    "FarmUnreachableError",
    "RayFarm",
    "InvalidSpecError",
    "PoolClosedError",
    "PoolError",
    "Target",
    "TritonKernel",
    "TritonSpec",
    "UnknownTargetError",
    "WorkerCrashedError",
    "WorkerStartError",
    "__version__",
    "load_manifest",
}


def test_all_lists_exactly_the_public_names() -> None:
    assert isinstance(acompile.__all__, tuple)
    assert set(acompile.__all__) == EXPECTED
    for name in acompile.__all__:
        assert getattr(acompile, name) is not None
    public = {n for n in vars(acompile) if not n.startswith("_")} - {"annotations"}
    assert public <= EXPECTED | {n for n in public if n.startswith("_")}, public - EXPECTED


def test_every_public_name_has_a_docstring() -> None:
    for name in acompile.__all__:
        obj = getattr(acompile, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_errors_form_one_tree() -> None:
    errors = [getattr(acompile, n) for n in acompile.__all__ if n.endswith("Error")]
    assert all(issubclass(e, acompile.AcompileError) for e in errors)
    assert issubclass(acompile.WorkerCrashedError, acompile.CompileError)
    assert issubclass(acompile.UnknownTargetError, acompile.InvalidSpecError)


def test_importing_acompile_imports_neither_triton_nor_cuda() -> None:
    out = run_python(
        "import sys, json, acompile\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'cuda', 'torch'))))"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_a_compile_error_survives_pickling_with_its_details() -> None:
    import pickle

    err = acompile.WorkerCrashedError("died", exit_code=-11, kernel="k", backend="triton", stderr_tail="tail")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is acompile.WorkerCrashedError
    assert (back.kernel, back.backend, back.exit_code, back.stderr_tail) == ("k", "triton", -11, "tail")
    assert str(back) == str(err)


def test_a_pool_is_made_outside_an_event_loop_and_entered_in_one(tmp_path: Path) -> None:
    """A server builds its pool at import time, before any loop runs, and enters it later."""
    import anyio

    pool = acompile.CompilePool(1, target="cuda:90", cache_dir=tmp_path, preload=())

    async def enter() -> bool:
        async with pool:
            return pool.stats()["workers"]["awake"]

    assert anyio.run(enter) is False  # left within the prestart delay: no worker started
