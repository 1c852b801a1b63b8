"""FlashInfer served by acompile, for real: ``flashinfer-python`` builds its ``silu_and_mul``
module for sm_90a with this machine's nvcc (no GPU is needed to build), ninja runs on the pool's
workers, a real redis-server is the fleet's tier, and FlashInfer loads what acompile wrote.

Each "machine" is a process of its own (``tests/flashinfer_machine.py``) with its own home,
FlashInfer workspace (at another path each time) and acompile cache folder. nvcc runs are counted
by the launcher FlashInfer puts before nvcc (``FLASHINFER_NVCC_LAUNCHER``): every machine has the
same one, so it is part of every key alike.

What FlashInfer needs to build without a GPU, made here as a machine would have it: the cuBLAS
and cuRAND headers it includes (the ``nvidia-cublas`` and ``nvidia-curand`` wheels of the test
environment, on ``CPATH``), libcudart for the link (the CUDA toolkit's, on ``LIBRARY_PATH``) and a
``libcuda.so`` stub for the link (there is no driver: the module does not record it as needed).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, RedisServer, json_shared, subprocess_env

pytestmark = pytest.mark.slow
KEY = "f" * 32
MACHINE = str(ROOT / "tests" / "flashinfer_machine.py")
REQUIRE = os.environ.get("ACOMPILE_REQUIRE_FLASHINFER") == "1"


def _missing(what: str) -> None:
    if REQUIRE:
        pytest.fail(f"{what} ($ACOMPILE_REQUIRE_FLASHINFER is set)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment every machine builds FlashInfer with (see the module's docstring)."""
    # Found, not imported: importing FlashInfer changes this process's environment (it points
    # Triton's Blackwell ptxas at the system's), which other tests of this process must not see.
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        _missing("flashinfer-python is not installed")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _missing("no nvcc on PATH")
    assert nvcc is not None
    headers = glob.glob(
        os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "include", "cublas_v2.h")
    )
    if not headers:
        _missing("the nvidia-cublas wheel's headers are not installed")
    cudart = [
        os.path.dirname(p)
        for p in glob.glob("/usr/local/cuda*/lib64/libcudart.so")
        + glob.glob("/usr/local/cuda*/targets/*/lib/libcudart.so")
    ]
    if not cudart:
        _missing("no CUDA toolkit's libcudart.so under /usr/local")
    folder = tmp_path_factory.mktemp("toolchain")
    (folder / "stub.c").write_text("void cuInit(void) {}\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so"), str(folder / "stub.c")], check=True
    )
    launcher = folder / "launch-and-count"
    launcher.write_text('#!/bin/sh\necho "$$ $*" >> "$NVCC_COUNT"\nexec "$@"\n')
    launcher.chmod(0o755)
    return {
        "CPATH": os.path.dirname(headers[0]),
        "LIBRARY_PATH": os.pathsep.join([cudart[0], str(folder)]),
        "FLASHINFER_CUDA_ARCH_LIST": "9.0",
        "FLASHINFER_NVCC_LAUNCHER": str(launcher),
    }


def machine(root: Path, name: str, toolchain: dict[str, str]) -> dict[str, str]:
    home = root / name
    (home / "home").mkdir(parents=True, exist_ok=True)
    return {
        **toolchain,
        "HOME": str(home / "home"),
        "FLASHINFER_WORKSPACE_BASE": str(home / "workspace"),
        "ACOMPILE_CACHE_DIR": str(home / "acompile"),
        "NVCC_COUNT": str(home / "nvcc-runs"),
    }


def nvcc_runs(env: dict[str, str]) -> int:
    path = Path(env["NVCC_COUNT"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def build_in(env: dict[str, str], options: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, MACHINE, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["nvcc"] = nvcc_runs(env)
    report["stderr"] = done.stderr
    return report


def warmup_alone(manifest: Path) -> subprocess.CompletedProcess[str]:
    """``acompile warmup MANIFEST`` on its defaults: a manifest it refuses before any work."""
    return subprocess.run(
        [sys.executable, "-m", "acompile", "warmup", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )


def served(url: str) -> dict[str, Any]:
    return json_shared(workers=1, shared_cache=url, signing_key=KEY, jits=["flashinfer"])


def test_a_second_machine_loads_the_module_from_the_fleet_with_no_nvcc_run(
    tmp_path: Path, redis_server: RedisServer, toolchain: dict[str, str]
) -> None:
    first = build_in(machine(tmp_path, "first", toolchain), served(redis_server.url))
    assert first.get("loaded") is True, first
    assert first["jit"]["builds"] == 1 and first["jit"]["puts"] == 1 and first["nvcc"] >= 1
    second_env = machine(tmp_path, "second", toolchain)
    # Its own search paths (a GPU replica has no wheel headers or stub where the builder had):
    # not part of the key, the headers found through them are.
    second_env["CPATH"] = os.pathsep.join([str(tmp_path / "elsewhere"), toolchain["CPATH"]])
    second_env["LIBRARY_PATH"] = os.pathsep.join(reversed(toolchain["LIBRARY_PATH"].split(os.pathsep)))
    second = build_in(second_env, served(redis_server.url))
    assert second.get("loaded") is True, second
    # Nothing built: no nvcc run, the module from the shared tier, where FlashInfer loads it.
    assert second["nvcc"] == 0 and second["jit"]["builds"] == 0 and second["jit"]["local_builds"] == 0
    assert second["jit"]["hits"]["shared"] == 1
    assert second["library"].startswith(second_env["FLASHINFER_WORKSPACE_BASE"])
    assert Path(second["library"]).read_bytes() == Path(first["library"]).read_bytes()


def test_machines_booting_together_build_the_module_once(
    tmp_path: Path, redis_server: RedisServer, toolchain: dict[str, str]
) -> None:
    """Two machines racing on one module: one runs nvcc, the other none. (Two show it: each
    more is another FlashInfer process on 2 cores, and shows the same.)"""
    envs = [machine(tmp_path, f"m{i}", toolchain) for i in range(2)]
    reports: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(env: dict[str, str]) -> None:
        try:
            reports.append(build_in(env, served(redis_server.url)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(env,)) for env in envs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [r.get("loaded") for r in reports] == [True] * 2, reports
    assert sum(r["jit"]["builds"] + r["jit"]["local_builds"] for r in reports) == 1
    compiles = sum(r["nvcc"] for r in reports)
    builder = next(r for r in reports if r["jit"]["builds"])
    assert compiles == builder["nvcc"] >= 1  # the others ran no nvcc at all


def test_an_unsupported_flashinfer_is_one_warning_and_left_as_it_was(toolchain: dict[str, str]) -> None:
    """In a process of its own: importing FlashInfer changes this process's environment (it
    points Triton's Blackwell ptxas at the system's), which the other tests must not see."""
    code = """
import json, warnings
import flashinfer.jit.core as core
import flashinfer.version
from acompile._jit import _library

flashinfer.version.__version__ = "0.99.0"
original = core.run_ninja
jits = _library.JitServing(builds=None, names=("flashinfer",))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jits.start()
    _library.warn_once("flashinfer", "again")  # once a process
jits.stop()
print(json.dumps({
    "warned": [str(w.message) for w in caught if issubclass(w.category, _library.UnsupportedJitWarning)],
    "untouched": core.run_ninja is original,
    "unsupported": sorted(jits.unsupported),
}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(**toolchain),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["untouched"] and report["unsupported"] == ["flashinfer"]
    assert len(report["warned"]) == 1 and "flashinfer 0.99.0 is outside" in report["warned"][0]


def test_warmup_builds_a_module_into_the_fleet_tier_from_a_box_without_a_gpu(
    tmp_path: Path, redis_server: RedisServer, toolchain: dict[str, str]
) -> None:
    """``acompile warmup`` with a ``[[flashinfer]]`` entry fills the shared tier; a replica then
    loads the module from it with no nvcc run."""
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        "[[flashinfer]]\n"
        'generator = "flashinfer.jit.activation:gen_act_and_mul_module"\n'
        'args = ["silu"]\n'
        'arch_list = "9.0"\n'
    )
    env = {
        k: v for k, v in machine(tmp_path, "builder", toolchain).items() if k != "FLASHINFER_CUDA_ARCH_LIST"
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "acompile",
            "warmup",
            str(manifest),
            "--shared-cache",
            redis_server.url,
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(**env, ACOMPILE_SIGNING_KEY=KEY),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "silu_and_mul: compiled" in done.stdout, done.stdout
    assert nvcc_runs(env) >= 1
    replica = machine(tmp_path, "replica", toolchain)
    report = build_in(replica, served(redis_server.url))
    assert report.get("loaded") is True and report["nvcc"] == 0, report
    assert report["jit"]["hits"]["shared"] == 1 and report["jit"]["builds"] == 0
    # Again: the module is in the builder's cache folder now, and in the shared tier.
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "acompile",
            "warmup",
            str(manifest),
            "--shared-cache",
            redis_server.url,
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(**env, ACOMPILE_SIGNING_KEY=KEY),
    )
    assert again.returncode == 0 and "silu_and_mul: cached" in again.stdout, (
        again.stdout + again.stderr[-2000:]
    )


def test_a_manifest_with_two_arch_lists_is_refused_before_any_work(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        '[[flashinfer]]\ngenerator = "flashinfer.jit.norm:gen_norm_module"\narch_list = "9.0"\n'
        '[[flashinfer]]\ngenerator = "flashinfer.jit.norm:gen_norm_module"\narch_list = "8.0"\n'
    )
    done = warmup_alone(manifest)
    assert done.returncode == 2
    assert "different arch lists ['8.0', '9.0']" in done.stderr, done.stderr


def test_a_record_of_what_a_server_was_served_warms_the_fleet_from_a_box_without_a_gpu(
    tmp_path: Path, redis_server: RedisServer, toolchain: dict[str, str]
) -> None:
    """A server's pool records each FlashInfer module it was served (``record=``, ``acompile
    run --record``): the module's spec, its paths rooted, the generated sources it compiled.
    ``acompile warmup`` remakes each on another box (another workspace path, another home) and
    builds it with FlashInfer served: the same key the server used, here found in the fleet's
    tier with no nvcc run. A record that does not match this box is that entry's failure."""
    record = tmp_path / "served.toml"
    server_env = machine(tmp_path, "server", toolchain)
    # The server knows nothing of acompile: it is served (and recorded) through `acompile run`.
    server = subprocess.run(
        [sys.executable, "-m", "acompile", "run", "-v", "--record", str(record), "--shared-cache",
         redis_server.url, "--workers", "1", "--", sys.executable, MACHINE, "{}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(**server_env, ACOMPILE_SIGNING_KEY=KEY),
    )  # fmt: skip
    assert server.returncode == 0, server.stderr[-3000:]
    assert json.loads(server.stdout.strip().splitlines()[-1]).get("loaded") is True, server.stdout
    assert "served flashinfer: modules from the tiers 0, built on the pool 1" in server.stderr, server.stderr
    text = record.read_text()
    assert text.count("[[flashinfer]]") == 1 and 'module = "silu_and_mul"' in text, text
    assert 'arch_list = "9.0a"' in text
    # The generated source rides along; no path of the server's machine does.
    assert "<flashinfer_workspace>/generated/silu_and_mul.cu" in text and "silu" in text
    assert server_env["HOME"] not in text and server_env["FLASHINFER_WORKSPACE_BASE"] not in text

    box = {k: v for k, v in machine(tmp_path, "box", toolchain).items() if k != "FLASHINFER_CUDA_ARCH_LIST"}

    def warmup(manifest: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "acompile", "warmup", str(manifest), "--shared-cache", redis_server.url,
             "--workers", "1"],
            capture_output=True,
            text=True,
            timeout=300,
            env=subprocess_env(**box, ACOMPILE_SIGNING_KEY=KEY),
        )  # fmt: skip

    done = warmup(record)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "silu_and_mul: cached" in done.stdout, done.stdout
    assert nvcc_runs(box) == 0
    assert any(Path(box["FLASHINFER_WORKSPACE_BASE"]).rglob("generated/silu_and_mul.cu")), "not written"
    # A record of another release, or under a key this box does not make: each entry failed, said
    # why (both in one record: one warm-up process, each entry's failure its own line).
    head, entry = text.split("[[flashinfer]]")
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(
        head
        + "[[flashinfer]]"
        + entry.replace('release = "', 'release = "0.0.', 1)
        + "\n[[flashinfer]]"
        + re.sub(r'key = "[0-9a-f]{64}"', 'key = "' + "0" * 64 + '"', entry)
    )
    done = warmup(wrong)
    said = done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == 1, said
    failed = [line for line in done.stdout.splitlines() if ": FAILED: " in line]
    assert len(failed) == 2, said
    assert "recorded with flashinfer 0.0." in failed[0], said
    assert "not the recorded " + "0" * 64 in failed[1], said


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (('module = "m"', 'module = "../../../tmp/escaped"'), "module must be a module's name"),
        (('module = "m"', 'module = "/tmp/absolute"'), "module must be a module's name"),
        (("device_linking = false", 'device_linking = "false"'), "device_linking must be true or false"),
        (("sources = [", "cflags = ["), "needs its sources"),
        (('cuda_cflags_by_source = { "<pkg_flashinfer>/a.cu" = ["-O3"] }', 'cuda_cflags_by_source = { "a" = "-O3" }'),
         "cuda_cflags_by_source must be a table of lists"),
    ],
)  # fmt: skip
def test_a_hand_edited_record_is_refused_before_any_work(
    tmp_path: Path, change: tuple[str, str], why: str
) -> None:
    """A record names a module's build folder by the module's name: one that is a path (that
    would build outside FlashInfer's workspace), or fields of the wrong shape, refuse the whole
    manifest with exit 2, naming the entry, before anything is imported or built."""
    record = (
        "[[flashinfer]]\n"
        f'key = "{"a" * 64}"\n'
        'module = "m"\nrelease = "0.7.4"\narch_list = "9.0a"\n'
        'sources = ["<pkg_flashinfer>/a.cu"]\n'
        "device_linking = false\n"
        'cuda_cflags_by_source = { "<pkg_flashinfer>/a.cu" = ["-O3"] }\n'
    )
    manifest = tmp_path / "served.toml"
    manifest.write_text(record.replace(*change))
    done = warmup_alone(manifest)
    assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]
    assert not Path("/tmp/escaped").exists() and not Path("/tmp/absolute").exists()
