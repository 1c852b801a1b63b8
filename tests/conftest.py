from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_backend, kernels for workers

# Tests compile for an explicit target: no GPU is needed (or assumed) for anything but `gpu` tests.
TARGET = "cuda:90"


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _workers() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "acompile._worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.fixture(autouse=True)
def no_worker_left_behind() -> object:
    """Every test ends with no worker process of ours alive: leaving `async with` reaps them."""
    yield
    left = [p for p in _workers() if p.status() != psutil.STATUS_ZOMBIE]
    if left:
        time.sleep(0.5)  # report, but only what is still there after a moment
        left = [p for p in _workers() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"worker processes left alive: {[p.pid for p in left]}"


def gpu_available() -> bool:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (none here)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that imports acompile and the tests' kernels."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update(extra)
    return env


def run_python(code: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run Python code in a fresh interpreter (blocking: from async tests, use a thread)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=subprocess_env()
    )
