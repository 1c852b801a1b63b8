"""torch.compile served where Inductor writes Triton kernels: a GPU (these skip themselves
elsewhere; CI has none). Each compile runs in a fresh process with empty caches."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import subprocess_env
from test_inductor import MODEL, machine, serve_options

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def compile_on_gpu(env: dict[str, str], *, plain: bool = False, threads: int | None = None) -> dict[str, Any]:
    extra = {"ACOMPILE_TEST_DEVICE": "cuda"}
    if threads is not None:
        extra["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    args = [sys.executable, MODEL, *(["--plain"] if plain else [])]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env=subprocess_env(**env, **extra)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def cubins(folder: str) -> set[str]:
    """The machine code of every cubin in a Triton cache folder, by SHA-256 (of its SASS, as
    cuobjdump prints it, where there is cuobjdump: a cubin's debug sections name the folder
    its kernel's source was in; else of the whole file)."""
    import shutil

    tool = shutil.which("cuobjdump")
    found = set()
    for root, _, files in os.walk(folder):
        for name in files:
            if not name.endswith(".cubin"):
                continue
            path = Path(root, name)
            if tool is None:
                found.add(hashlib.sha256(path.read_bytes()).hexdigest())
                continue
            sass = subprocess.run(
                [tool, "-sass", str(path)], capture_output=True, text=True, check=True
            ).stdout
            code = "\n".join(
                line for line in sass.splitlines() if line.strip().startswith(("/*", "Function"))
            )
            found.add(hashlib.sha256(code.encode()).hexdigest())
    return found


def test_served_triton_compiles_build_the_kernels_inductor_builds_also_at_one_compile_thread(
    tmp_path: Path,
) -> None:
    """The engine set compile_threads=1: served, every Triton kernel is compiled on the pool's
    workers (Inductor's own compile function), into the Triton cache Inductor reads, the same
    cubins Inductor builds on its own, and the outputs equal eager's."""
    import shutil

    # The same paths for both, and Inductor's own with its remote caches switched on as served
    # ones are (to a Redis that is not there: it turns them off): a kernel's source names those
    # switches, its file is named by its source, and a cubin's line table names its file.
    # Inductor's own runs its own pool of workers, whose compile function the served jobs run
    # (its in-process compile uses Triton's ptxas, its workers torch's).
    env = machine(tmp_path, "gpu")
    switched = {
        "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    own = compile_on_gpu({**env, **switched}, plain=True)
    theirs = cubins(env["TRITON_CACHE_DIR"])
    for folder in env.values():
        shutil.rmtree(folder, ignore_errors=True)
    served = compile_on_gpu({**machine(tmp_path, "gpu"), **serve_options(workers=4)}, threads=1)
    assert own["ok"] and served["ok"]
    jobs = served["served"]["jobs"]
    assert jobs["sent"] >= 1 and jobs["failed"] == 0 and jobs["run_here"] == 0, jobs
    ours = cubins(env["TRITON_CACHE_DIR"])
    assert theirs and ours == theirs, (len(theirs), len(ours))


def test_a_worker_killed_while_it_compiles_a_triton_kernel_costs_a_retry(tmp_path: Path) -> None:
    """The served process's pool worker SIGKILLed while its ptxas runs: the kernel is compiled
    again on a fresh worker; torch.compile never knows."""
    code = f"""
import json, os, sys, threading, time
import psutil
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch_model
from acompile import inductor
killed = []
def killer():
    me = psutil.Process()
    deadline = time.monotonic() + 300
    while not killed and time.monotonic() < deadline:
        for child in me.children(recursive=True):
            try:
                if child.name() == "ptxas":
                    worker = child.parent()
                    while worker is not None and "acompile._worker" not in " ".join(worker.cmdline()):
                        worker = worker.parent()
                    if worker is not None:
                        worker.kill(); killed.append(worker.pid); return
            except psutil.Error:
                pass
        time.sleep(0.002)
with inductor.serve(workers=2) as serving:
    assert serving.wait_ready(120)
    threading.Thread(target=killer, daemon=True).start()
    report = torch_model.run(device="cuda")
    stats = serving.stats()
print(json.dumps({{"ok": report["ok"], "killed": killed, "retried": stats["pool"]["jobs"]["retried"], "jobs": stats["jobs"]}}))
"""
    env = subprocess_env(**machine(tmp_path, "killed"), TORCHINDUCTOR_COMPILE_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["killed"], report
    assert report["retried"] >= 1 and report["jobs"]["failed"] == 0, report
