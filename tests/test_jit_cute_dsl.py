"""FlashInfer's CuTe DSL kernels served by acompile, for real: FlashInfer's own
``build_and_load_cute_dsl_kernel`` (one ``JitSpecCuteDsl`` a kernel) with a kernel of the tests'
own (``tests/cute_kernel_for_tests.py``), compiled by the real CuTe DSL for sm_90a
(``CUTE_DSL_ARCH``: no GPU is needed to compile, or to load the exported object), a real
redis-server as the fleet's tier.

Each "machine" is a process of its own (``tests/cute_machine.py``) with its own home, FlashInfer
workspace, acompile cache folder, and its own copy of the kernel's module at a path of its own:
the key names a source file by where it is imported from, never by its path. Compiles are
counted by the kernel's module (each call of the compile function FlashInfer was handed).

A CuTe DSL kernel compiles in the program's process, never on the pool: its compile function is
a closure over the caller's objects, which no other process can run (docs/jit.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, RedisServer, json_shared, subprocess_env

pytestmark = pytest.mark.slow
KEY = "c" * 32
MACHINE = str(ROOT / "tests" / "cute_machine.py")
KERNEL = ROOT / "tests" / "cute_kernel_for_tests.py"


@pytest.fixture(scope="module")
def cute_dsl() -> None:
    import importlib.util

    for module, what in (("flashinfer", "flashinfer-python"), ("cutlass", "nvidia-cutlass-dsl")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{what} is not installed")


def machine(root: Path, name: str, add: str = "1.0") -> dict[str, str]:
    """A machine's environment; its copy of the kernel's module is in ``<root>/<name>/code``."""
    home = root / name
    (home / "home").mkdir(parents=True, exist_ok=True)
    code = home / "code"
    code.mkdir(exist_ok=True)
    text = KERNEL.read_text()
    assert "ADD = 1.0  #" in text
    (code / "served_cute_kernel.py").write_text(text.replace("ADD = 1.0  #", f"ADD = {add}  #"))
    return {
        "HOME": str(home / "home"),
        "FLASHINFER_WORKSPACE_BASE": str(home / "workspace"),
        "ACOMPILE_CACHE_DIR": str(home / "acompile"),
        "CUTE_DSL_ARCH": "sm_90a",
        "CODE": str(code),
    }


def build_in(env: dict[str, str], options: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, MACHINE, json.dumps(options), env["CODE"]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    objects = sorted(Path(env["FLASHINFER_WORKSPACE_BASE"]).rglob("add_f32_32.o"))
    report["object"] = str(objects[0]) if objects else None
    return report


def warmup_in(env: dict[str, str], manifest: Path, url: str) -> subprocess.CompletedProcess[str]:
    """``acompile warmup MANIFEST`` on this machine, into the shared tier at ``url``."""
    return subprocess.run(
        [sys.executable, "-m", "acompile", "warmup", str(manifest), "--shared-cache", url, "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(**env, ACOMPILE_SIGNING_KEY=KEY),
    )


def served(url: str, **more: Any) -> dict[str, Any]:
    return json_shared(workers=1, shared_cache=url, signing_key=KEY, jits=["flashinfer"], **more)


def test_a_second_machine_loads_the_kernel_from_the_fleet_without_compiling(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    first = build_in(machine(tmp_path, "first"), served(redis_server.url))
    assert first.get("loaded") == "Function", first
    assert first["compiles"] == 1 and first["jit"]["in_process"] == 1 and first["jit"]["puts"] == 1
    assert first["jit"]["builds"] == 0  # never on the pool: the compile function is the program's
    second_env = machine(tmp_path, "second")
    second = build_in(second_env, served(redis_server.url))
    # Not compiled: the object from the shared tier, where FlashInfer's try_load finds it (its
    # meta.json as this machine's spec expects it), and loaded by FlashInfer.
    assert second.get("loaded") == "Function", second
    assert second["compiles"] == 0 and second["jit"]["in_process"] == 0, second
    assert second["jit"]["hits"]["shared"] == 1
    assert second["object"] and second["object"].startswith(second_env["FLASHINFER_WORKSPACE_BASE"])
    assert Path(second["object"]).read_bytes() == Path(first["object"]).read_bytes()
    # Again on the second machine: FlashInfer's own disk cache answers, acompile is not asked.
    again = build_in(second_env, served(redis_server.url))
    assert again.get("loaded") == "Function" and again["compiles"] == 0, again
    assert sum(((again["jit"] or {}).get("hits") or {}).values()) == 0, again
    # A changed source is another kernel: compiled, never the first one's.
    changed = build_in(machine(tmp_path, "changed", add="2.0"), served(redis_server.url))
    assert changed.get("loaded") == "Function" and changed["compiles"] == 1, changed
    assert changed["jit"]["hits"]["shared"] == 0


def test_machines_booting_together_compile_the_kernel_once(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    """Two machines racing on one kernel: one compiles, the other is served its object. (Two
    show it: each more is another CuTe DSL process on 2 cores, and shows the same.)"""
    envs = [machine(tmp_path, f"m{i}") for i in range(2)]
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
    assert [r.get("loaded") for r in reports] == ["Function"] * 2, reports
    assert sum(r["compiles"] for r in reports) == 1, reports
    assert sum(r["jit"]["hits"]["fleet"] + r["jit"]["hits"]["shared"] for r in reports) == 1


def test_a_forged_kernel_is_refused_and_compiled_again(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    build_in(machine(tmp_path, "first"), served(redis_server.url))
    client: Any = redis_server.client()
    names = client.keys("acompile:*")
    assert names
    for name in names:  # every value's signature no longer verifies
        value = client.get(name)
        client.set(name, value[:-1] + bytes([value[-1] ^ 1]))
    second = build_in(machine(tmp_path, "second"), served(redis_server.url))
    assert second.get("loaded") == "Function" and second["compiles"] == 1, second
    assert second["jit"]["hits"]["shared"] == 0


def test_an_unreachable_tier_is_a_miss_and_the_kernel_is_compiled(tmp_path: Path, cute_dsl: None) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = build_in(machine(tmp_path, "alone"), served(f"redis://127.0.0.1:{port}/0"))
    assert report.get("loaded") == "Function" and report["compiles"] == 1, report


def test_a_kernel_that_does_not_compile_raises_the_librarys_error_and_leaves_no_lease(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    env = machine(tmp_path, "broken")
    path = Path(env["CODE"]) / "served_cute_kernel.py"
    path.write_text(path.read_text().replace("a[tidx] = a[tidx] + ADD", "a[tidx] = a[tidx] + no_such_name"))
    report = build_in(env, served(redis_server.url))
    assert "no_such_name" in report.get("error", ""), report
    assert report["jit"]["failed"] == 1 and report["jit"]["puts"] == 0
    client: Any = redis_server.client()
    assert not [n for n in client.keys("*") if b"lease" in n], client.keys("*")


def test_warmup_compiles_a_kernel_by_its_generator_into_the_fleet_tier(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    """``acompile warmup`` with a ``[[flashinfer]]`` entry whose generator builds a CuTe DSL kernel
    (it returns the kernel, not a spec): compiled on this box without a GPU, in the shared tier;
    a replica then loads it without compiling."""
    env = {k: v for k, v in machine(tmp_path, "builder").items() if k != "CUTE_DSL_ARCH"}
    manifest = Path(env["CODE"]) / "warmup.toml"
    manifest.write_text(
        '[[flashinfer]]\ngenerator = "served_cute_kernel.py:build"\nargs = [32]\ncute_dsl_arch = "sm_90a"\n'
    )

    def warmup() -> subprocess.CompletedProcess[str]:
        return warmup_in(env, manifest, redis_server.url)

    done = warmup()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "served_cute_kernel.py:build: compiled" in done.stdout, done.stdout
    replica = build_in(machine(tmp_path, "replica"), served(redis_server.url))
    assert replica.get("loaded") == "Function" and replica["compiles"] == 0, replica
    assert replica["jit"]["hits"]["shared"] == 1
    # Again, FlashInfer's own cache warm: the kernel is cached, and in the shared tier (a flushed
    # tier is filled again from FlashInfer's cache, as from acompile's).
    client: Any = redis_server.client()
    for flushed in (False, True):
        if flushed:
            client.flushdb()
        again = warmup()
        assert again.returncode == 0 and "served_cute_kernel.py:build: cached" in again.stdout, (
            again.stdout + again.stderr[-2000:]
        )
    replica = build_in(machine(tmp_path, "after-flush"), served(redis_server.url))
    assert replica.get("loaded") == "Function" and replica["compiles"] == 0, replica
    assert replica["jit"]["hits"]["shared"] == 1


def test_a_kernel_in_a_package_warmed_up_by_its_file_is_the_one_a_server_imports(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    """A warm-up manifest names a generator by its file; the server imports the package the file
    is in. The kernel's key names the file by its module's name, the same in both."""
    env = machine(tmp_path, "builder")
    package = Path(env["CODE"]) / "kernels_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (Path(env["CODE"]) / "served_cute_kernel.py").rename(package / "served_cute_kernel.py")
    manifest = Path(env["CODE"]) / "warmup.toml"
    manifest.write_text(
        '[[flashinfer]]\ngenerator = "kernels_pkg/served_cute_kernel.py:build"\nargs = [32]\n'
    )
    done = warmup_in(env, manifest, redis_server.url)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    server = machine(tmp_path, "server")
    (Path(server["CODE"]) / "kernels_pkg").mkdir()
    (Path(server["CODE"]) / "kernels_pkg" / "__init__.py").write_text("")
    (Path(server["CODE"]) / "served_cute_kernel.py").rename(
        Path(server["CODE"]) / "kernels_pkg" / "served_cute_kernel.py"
    )
    report = build_in({**server, "KERNEL_MODULE": "kernels_pkg.served_cute_kernel"}, served(redis_server.url))
    assert report.get("loaded") == "Function" and report["compiles"] == 0, report
    assert report["jit"]["hits"]["shared"] == 1


def test_a_kernel_whose_source_changed_after_the_process_started_is_never_published(
    tmp_path: Path, redis_server: RedisServer, cute_dsl: None
) -> None:
    """The module in memory is the file as it was when imported: compiled as FlashInfer alone
    would (it compiles the module in memory), and never published under the changed file's key."""
    edited = build_in({**machine(tmp_path, "edited"), "EDIT_AFTER_IMPORT": "1"}, served(redis_server.url))
    assert edited.get("loaded") == "Function" and edited["compiles"] == 1, edited
    assert edited["jit"]["unserved"] == 1 and edited["jit"]["puts"] == 0, edited
    assert "changed after this process started" in edited["stderr"]
    fresh = build_in(machine(tmp_path, "fresh"), served(redis_server.url))
    assert fresh["compiles"] == 1 and fresh["jit"]["hits"]["shared"] == 0, fresh


def test_the_dsl_stacks_fingerprint_holds_no_path_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same wheels installed in two environments at other paths: their RECORDs differ in the
    lines of the scripts in bin/ (their first line names the environment's Python) and of the
    installer's own files; the kernels' keys must not."""
    import importlib.metadata

    from acompile._jit import _flashinfer

    def record(venv: str, installer: str) -> str:
        return (
            "torch/__init__.py,sha256=AAAA,100\n"
            f"../../../bin/torchrun,sha256={venv},200\n"
            f"torch-2.13.0.dist-info/INSTALLER,sha256={installer},4\n"
            "torch-2.13.0.dist-info/RECORD,,\n"
        )

    class Dist:
        def __init__(self, text: str) -> None:
            self.metadata = {"Name": "torch"}
            self.version = "2.13.0"
            self.text = text

        def read_text(self, name: str) -> str | None:
            return self.text if name == "RECORD" else '{"url": "file:///somewhere"}'

    stacks = []
    for venv, installer in (("XXXX", "pip"), ("YYYY", "uv")):
        monkeypatch.setattr(
            importlib.metadata, "distributions", lambda v=venv, i=installer: [Dist(record(v, i))]
        )
        _flashinfer._dsl_stack.cache_clear()
        stacks.append(_flashinfer._dsl_stack())
    _flashinfer._dsl_stack.cache_clear()
    assert stacks[0] == stacks[1] and "torch==2.13.0:" in stacks[0]
    # A file of the package itself that differs is another stack.
    monkeypatch.setattr(
        importlib.metadata, "distributions", lambda: [Dist(record("XXXX", "pip").replace("AAAA", "BBBB"))]
    )
    other = _flashinfer._dsl_stack()
    _flashinfer._dsl_stack.cache_clear()
    assert other != stacks[0]


@pytest.mark.parametrize(
    ("entries", "why"),
    [
        ('generator = "m.py:build"\ncute_dsl_arch = "sm90a"\n', 'cute_dsl_arch must read like "sm_90a"'),
        ('generator = "m.py:build"\ncute_dsl_arch = "sm_9"\n', 'cute_dsl_arch must read like "sm_90a"'),
        (
            'generator = "m.py:build"\ncute_dsl_arch = "sm_90a"\n[[flashinfer]]\ngenerator = "m.py:build"\n',
            "flashinfer #2 (m.py:build): needs arch_list",
        ),
    ],
)
def test_a_cute_dsl_warmup_entry_that_cannot_work_is_refused_before_any_work(
    tmp_path: Path, entries: str, why: str
) -> None:
    manifest = tmp_path / "warmup.toml"
    manifest.write_text("[[flashinfer]]\n" + entries)
    env = {
        k: v for k, v in subprocess_env().items() if k not in ("CUTE_DSL_ARCH", "FLASHINFER_CUDA_ARCH_LIST")
    }
    done = subprocess.run(
        [sys.executable, "-m", "acompile", "warmup", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]


def test_a_flashinfer_whose_cute_dsl_seams_changed_is_one_warning_and_its_nvcc_modules_still_served(
    cute_dsl: None,
) -> None:
    """In a process of its own (importing FlashInfer changes the process's environment)."""
    code = """
import json, warnings
import flashinfer.jit.core as core
import flashinfer.jit._cute_dsl_source as source
import flashinfer.jit.cute_dsl_core as cute
from acompile._jit import _library

del source._key_sources  # a release that keys its kernels otherwise
build, ninja = cute.JitSpecCuteDsl.build, core.run_ninja
jits = _library.JitServing(builds=None, names=("flashinfer",))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jits.start()
served = core.run_ninja is not ninja
jits.stop()
print(json.dumps({
    "warned": [str(w.message) for w in caught if issubclass(w.category, _library.UnsupportedJitWarning)],
    "kernels_untouched": cute.JitSpecCuteDsl.build is build,
    "nvcc_served": served,
    "put_back": core.run_ninja is ninja,
}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kernels_untouched"] and report["nvcc_served"] and report["put_back"], report
    assert len(report["warned"]) == 1 and "_cute_dsl_source._key_sources" in report["warned"][0], report
