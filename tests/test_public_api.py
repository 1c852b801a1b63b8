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
    "CompiledAfterReadyError",
    "DeviceUnavailableError",
    "FarmToolchainError",
    "FarmUnreachableError",
    "RayFarm",
    "LocalWorkers",
    "Split",
    "ExecutorSpec",
    "Opening",
    "WorkerSettings",
    "SharedCache",
    "InvalidSpecError",
    "PoolClosedError",
    "PoolError",
    "StageUnavailableError",
    "Target",
    "TritonKernel",
    "TritonSpec",
    "UnknownTargetError",
    "UntrustedFolderError",
    "WorkerCrashedError",
    "WorkerStartError",
    "__version__",
    "inductor",
    "load_manifest",
}
# Public modules imported by name (``import acompile.testing``), never with the package: not in
# ``__all__``, but an attribute of it once some code (another test) has imported them.
SUBMODULES = {"testing", "metrics", "asgi"}


def test_all_lists_exactly_the_public_names() -> None:
    assert isinstance(acompile.__all__, tuple)
    assert set(acompile.__all__) == EXPECTED
    for name in acompile.__all__:
        assert getattr(acompile, name) is not None
    public = {n for n in vars(acompile) if not n.startswith("_")} - {"annotations"}
    assert public <= EXPECTED | SUBMODULES, public - EXPECTED - SUBMODULES


def test_acompile_testing_is_its_own_import_with_three_documented_names() -> None:
    # A program that does not test pays nothing for the helpers: importing acompile leaves them out.
    out = run_python("import sys, acompile; print('acompile.testing' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    import acompile.testing

    assert acompile.testing.__all__ == ("Interposed", "JobView", "run_job")
    for name in acompile.testing.__all__:
        obj = getattr(acompile.testing, name)
        assert obj.__doc__ and obj.__doc__.strip(), name


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


def test_in_a_worker_the_namespace_loads_once_for_threads_that_ask_at_once_and_again_after_a_failure() -> (
    None
):
    """A pool's worker (ACOMPILE_WORKER=1) imports each of acompile's names at its first use,
    with its module alone: a backend's threads that ask at once all get them, and a first use
    that fails (out of file descriptors) raises its own error, not a missing name for the rest
    of the process."""
    import subprocess
    import sys

    from conftest import subprocess_env

    script = """
import importlib, sys, threading
real = importlib.import_module
failed = []
def flaky(name, package=None):
    if not failed:
        failed.append(name)
        raise OSError(24, "Too many open files")
    return real(name, package)
importlib.import_module = flaky
import acompile, acompile._workers
try:
    acompile.CompileError
except OSError as exc:
    print("first use:", exc.errno)
assert "acompile._compiler" not in sys.modules
importlib.import_module = real
assert acompile.CompileError.__name__ == "CompileError"
assert "acompile._compiler" not in sys.modules  # its own module, not the namespace
errors = []
barrier = threading.Barrier(8)
def use(i):
    barrier.wait()
    try:
        if i % 2:
            assert acompile.CompilePool.__name__ == "CompilePool"
        else:
            from acompile._workers import Job
            assert Job.__name__ == "Job"
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=use, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("errors:", errors)
try:
    acompile.does_not_exist
except AttributeError as exc:
    print("unknown:", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env=subprocess_env(ACOMPILE_WORKER="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "first use: 24" in out.stdout
    assert "errors: []" in out.stdout, out.stdout
    assert "unknown: module 'acompile' has no attribute 'does_not_exist'" in out.stdout
