"""Other JIT libraries served by acompile, for real: torch's C++ extensions
(``torch.utils.cpp_extension.load``) built by ninja and the system compiler on the pool's
workers, a real redis-server as the fleet's tier.

Each "machine" is a process of its own (``tests/jit_machine.py``) with its own home, torch
extensions folder and acompile cache folder: what it finds, it found in the shared tier. The
extension's source includes nothing of torch, so that a build takes a second, not the half
minute ``torch/extension.h`` costs; torch's build file, flags and loading are the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Mounts, RedisServer, fill, json_shared, run_python, subprocess_env

pytestmark = pytest.mark.slow
KEY = "j" * 32
MACHINE = str(ROOT / "tests" / "jit_machine.py")
SOURCE = '#include "answer.h"\nextern "C" int answer() { return ANSWER + OFFSET; }\n'


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Path]:
    """The extension's source and its include folder (``answer.h`` defines OFFSET)."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "answer.h").write_text("#define OFFSET 0\n")
    path = tmp_path / "answer.cpp"
    path.write_text(SOURCE)
    return path, include


def machine(root: Path, name: str) -> dict[str, str]:
    home = root / name
    (home / "home").mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home / "home"),
        "TORCH_EXTENSIONS_DIR": str(home / "extensions"),
        "ACOMPILE_CACHE_DIR": str(home / "acompile"),
    }


def build_in(
    env: dict[str, str],
    options: dict[str, Any],
    source: tuple[Path, Path],
    answer: int = 42,
    timeout: float = 240,
) -> dict[str, Any]:
    path, include = source
    done = subprocess.run(
        [sys.executable, MACHINE, json.dumps(options), str(path), str(answer), str(include)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def served(url: str, **more: Any) -> dict[str, Any]:
    return json_shared(workers=1, shared_cache=url, signing_key=KEY, jits=["cpp_extension"], **more)


def test_a_second_machine_loads_the_extension_from_the_fleet_without_building(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    first = build_in(machine(tmp_path, "first"), served(redis_server.url), source)
    assert first.get("answer") == 42, first
    assert first["jit"]["builds"] == 1 and first["jit"]["puts"] == 1 and first["jit"]["local_builds"] == 0
    second = build_in(machine(tmp_path, "second"), served(redis_server.url), source)
    assert second.get("answer") == 42, second
    jit = second["jit"]
    # Nothing built: not on the pool, not here; the library came from the shared tier.
    assert jit["builds"] == 0 and jit["local_builds"] == 0 and jit["hits"]["shared"] == 1
    # A third process of the second machine finds it on its own disk.
    third = build_in(machine(tmp_path, "second"), served(redis_server.url), source)
    assert third["jit"]["hits"]["disk"] == 1 and third["jit"]["builds"] == 0


def test_the_key_holds_the_options_and_every_header_the_compiler_read(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    first = build_in(machine(tmp_path, "first"), served(redis_server.url), source, answer=1)
    assert first.get("answer") == 1
    # Another -D: another library (served the first one's, it would answer 1).
    other = build_in(machine(tmp_path, "other"), served(redis_server.url), source, answer=2)
    assert other.get("answer") == 2 and other["jit"]["builds"] == 1
    # The header changed where every machine reads it: a miss, and a build.
    source[1].joinpath("answer.h").write_text("#define OFFSET 100\n")
    changed = build_in(machine(tmp_path, "changed"), served(redis_server.url), source, answer=1)
    assert changed.get("answer") == 101 and changed["jit"]["builds"] == 1
    assert changed["jit"]["hits"]["shared"] == 0


def test_machines_at_once_on_an_empty_tier_build_it_once(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    """Two machines racing on one key: one builds, the other waits for its entry (or finds it).
    (Two show it: each more is another torch process on 2 cores, and shows the same.)"""
    reports: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            reports.append(build_in(machine(tmp_path, name), served(redis_server.url), source))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(f"m{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [r.get("answer") for r in reports] == [42] * 2, reports
    assert sum(r["jit"]["builds"] + r["jit"]["local_builds"] for r in reports) == 1
    # The other waited for the builder's entry (or found it once it was there).
    assert sum(r["jit"]["hits"]["fleet"] + r["jit"]["hits"]["shared"] for r in reports) == 1


def test_a_forged_module_is_refused_counted_and_built_again(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    build_in(machine(tmp_path, "first"), served(redis_server.url), source)
    client: Any = redis_server.client()
    names = client.keys("acompile:*")
    assert names
    for name in names:  # every value's signature no longer verifies
        value = client.get(name)
        client.set(name, value[:-1] + bytes([value[-1] ^ 1]))
    second = build_in(machine(tmp_path, "second"), served(redis_server.url), source)
    assert second.get("answer") == 42
    assert second["cache"]["shared_rejected"] >= 1
    assert second["jit"]["hits"]["shared"] == 0 and second["jit"]["builds"] == 1


def test_an_unsigned_tier_serves_a_library_only_to_a_replica_that_trusts_it(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    """A library is host code: from a tier anyone may write, it is loaded only where the tier's
    owner said to trust it unsigned (``SharedCache(unsafe_trust_unsigned=True)``), and a fleet
    that signs never reads what went to the unsigned namespace."""
    trusting = json_shared(
        workers=1, shared_cache=redis_server.url, unsafe_trust_unsigned=True, jits=["cpp_extension"]
    )
    first = build_in(machine(tmp_path, "first"), trusting, source)
    assert first["jit"]["builds"] == 1
    second = build_in(machine(tmp_path, "second"), trusting, source)
    assert second.get("answer") == 42 and second["jit"]["hits"]["shared"] == 1
    assert second["jit"]["builds"] == 0
    signed = build_in(machine(tmp_path, "signed"), served(redis_server.url), source)
    assert signed.get("answer") == 42 and signed["jit"]["hits"]["shared"] == 0
    assert signed["jit"]["builds"] == 1
    # (Neither signed nor trusted, serve() refuses to start: tests/test_inductor.py.)


def test_an_unreachable_tier_is_a_miss_and_the_build_goes_on(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = build_in(machine(tmp_path, "alone"), served(f"redis://127.0.0.1:{port}/0"), source)
    assert report.get("answer") == 42 and report["jit"]["builds"] == 1


def test_the_hosts_pool_builds_a_library_for_every_process_of_the_host(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """``serve(host_pool=True)`` (``acompile run --host-pool``): a build runs on the host's pool
    (a process of its own, which the server's ranks share), not in the process that asked; and
    a build that fails there is the library's own error, with the compiler's message."""
    import psutil

    options = {"host_pool": True, "workers": 1, "jits": ["cpp_extension"]}
    env = machine(tmp_path, "host")
    try:
        report = build_in(env, options, source)
        assert report.get("answer") == 42, report
        assert report["jit"]["builds"] == 1 and report["jit"]["local_builds"] == 0, report
        broken = tmp_path / "broken.cpp"
        broken.write_text('extern "C" int answer() { return nope; }\n')
        again = machine(tmp_path, "host-again")
        again["ACOMPILE_CACHE_DIR"] = env["ACOMPILE_CACHE_DIR"]  # the same host pool
        failed = build_in(again, options, (broken, source[1]))
        assert "nope" in failed.get("error", "") and failed["jit"]["failed"] == 1, failed
        assert failed["jit"]["local_builds"] == 0, failed
    finally:
        # The host's pool would stop a minute after its last process left: now.
        for server in psutil.process_iter(["cmdline"]):
            if "acompile._torch._hostpool" in " ".join(server.info["cmdline"] or ()) and str(
                tmp_path
            ) in " ".join(server.info["cmdline"]):
                workers = server.children(recursive=True)
                server.terminate()
                server.wait(30)
                psutil.wait_procs(workers, timeout=10)


def test_a_full_cache_disk_costs_the_cache_not_the_library(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path], mounts: Mounts
) -> None:
    """acompile's cache folder on a disk with no room (a tmpfs filled up, for real): a module
    found in the fleet's tier is still written where the library loads it, and one that is not
    there is still built on the pool and loaded; only the disk tier's copies are lost."""
    first = build_in(machine(tmp_path, "first"), served(redis_server.url), source)
    assert first.get("answer") == 42 and first["jit"]["builds"] == 1
    for name, options in (("full-hit", served(redis_server.url)), ("full-build", served(None))):
        env = machine(tmp_path, name)
        cache = Path(env["ACOMPILE_CACHE_DIR"])
        mounts.tmpfs(cache, "1m")
        fill(cache, leave=4096)
        report = build_in(env, options, source)
        assert report.get("answer") == 42, report
        jit = report["jit"]
        if name == "full-hit":
            assert jit["hits"]["shared"] == 1 and jit["builds"] == 0, jit
        else:
            assert jit["builds"] == 1 and jit["local_builds"] == 0, jit
        assert "No space left" in report["stderr"], report["stderr"][-3000:]


def test_a_lock_left_by_a_killed_builder_holds_nobody(tmp_path: Path, source: tuple[Path, Path]) -> None:
    """torch's lock is a file its builder removes: one killed mid-build leaves it, and torch
    alone then waits for it forever. Served, the lock is the kernel's, and the file is none."""
    env = machine(tmp_path, "m")
    folder = Path(env["TORCH_EXTENSIONS_DIR"]) / "answer_ext"
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # what a builder killed mid-build leaves
    report = build_in(env, {"workers": 1, "jits": ["cpp_extension"]}, source, timeout=120)
    assert report.get("answer") == 42 and report["jit"]["builds"] == 1


def test_a_build_that_fails_raises_torchs_own_error_with_the_compilers_message(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    source[0].write_text('extern "C" int answer() { return ANSWER + ; }\n')
    report = build_in(machine(tmp_path, "m"), {"workers": 1, "jits": ["cpp_extension"]}, source)
    assert report["error"].startswith("RuntimeError: Error building extension 'answer_ext'")
    assert "expected primary-expression" in report["error"]
    assert report["jit"]["failed"] == 1 and report["jit"]["puts"] == 0


def build_marked_ready(
    tmp_path: Path, source: tuple[Path, Path], mark: str
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """A machine whose serving says it is ready (``serving.<mark>``) as soon as it is entered,
    before the library builds: its report, and the process."""
    code = f"""
import json, sys
sys.argv = ["x", json.dumps({{"workers": 1, "jits": ["cpp_extension"]}}), {str(source[0])!r}, "42", {str(source[1])!r}]
from acompile import inductor
import jit_machine
real_serve = inductor.serve
def serve(**options):
    serving = real_serve(**options)
    enter = serving.__enter__
    def entered():
        enter()
        serving.{mark}
        return serving
    serving.__enter__ = entered
    return serving
inductor.serve = serve
jit_machine.main()
"""
    env = subprocess_env(**machine(tmp_path, "m"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def test_builds_after_ready_are_counted_and_named(tmp_path: Path, source: tuple[Path, Path]) -> None:
    report, done = build_marked_ready(tmp_path, source, "mark_ready()")
    assert report["answer"] == 42
    assert report["jit"]["after_ready"] == 1 and report["jit"]["built_after_ready"] == ["answer_ext"]
    assert "built module answer_ext after the server said it was ready" in done.stderr


def test_a_server_that_refuses_builds_after_ready_gets_the_named_error(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """``mark_ready(on_late="refuse")``: a build the warm-up missed raises CompiledAfterReadyError
    into the library (naming the module) instead of building on the request path."""
    report, _ = build_marked_ready(tmp_path, source, 'mark_ready(on_late="refuse")')
    assert report.get("error", "").startswith("CompiledAfterReadyError: answer_ext"), report
    assert report["jit"]["after_ready"] == 1 and report["jit"]["builds"] == 0
    assert report["jit"]["local_builds"] == 0


def test_an_unsupported_release_is_one_warning_and_the_library_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    import torch.utils.cpp_extension as ext

    from acompile._jit import _library

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(_library, "_warned", set())
    original = ext._run_ninja_build
    jits = _library.JitServing(builds=None, names=("cpp_extension",))  # type: ignore[arg-type]
    with pytest.warns(_library.UnsupportedJitWarning, match=r"torch 2\.99\.0 is outside"):
        jits.start()
    assert ext._run_ninja_build is original and "cpp_extension" in jits.unsupported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _library.warn_once("cpp_extension", "again")  # once a process
    jits.stop()


def test_a_torch_that_locks_its_builds_itself_is_served_without_a_baton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.14 dropped ``FileBaton`` for a lock the kernel holds (``FileLock``): its builds are
    served all the same, and nothing of a baton is put in (or left) in its place. (A build on
    torch 2.14.1 itself, served and then a hit from the disk tier, was checked by hand.)"""
    import torch.utils.cpp_extension as ext

    from acompile._jit import _cpp_extension

    monkeypatch.delattr(ext, "FileBaton", raising=False)
    monkeypatch.setattr(ext, "FileLock", object(), raising=False)
    original = ext._run_ninja_build
    undo = _cpp_extension.install(builds=None)  # type: ignore[arg-type]
    try:
        assert ext._run_ninja_build is not original
        assert not hasattr(ext, "FileBaton")
    finally:
        undo()
    assert ext._run_ninja_build is original and not hasattr(ext, "FileBaton")
    monkeypatch.delattr(ext, "FileLock")
    with pytest.raises(_cpp_extension.Unsupported, match="neither FileBaton nor FileLock"):
        _cpp_extension.install(builds=None)  # type: ignore[arg-type]


def test_each_library_is_triggered_by_its_own_module() -> None:
    from acompile._jit import _library

    modules = [_library.library(name).MODULE for name in _library.LIBRARIES]
    assert tuple(modules) == _library.TRIGGERS


def test_serving_that_starts_inside_the_import_of_its_trigger_waits_for_that_import_to_end(
    tmp_path: Path,
) -> None:
    """FlashInfer's ``jit.core`` imports torch (through tvm_ffi), and torch's import is where
    ``acompile run`` starts serving: the trigger module is half made then, its import lock held.
    Serving begins once that import has ended (it patches what the module defines at its end),
    and what it starts on other threads may import (a pool's thread imports its backends): it
    used to hang there for good. Here ``pkg.core`` plays ``jit.core``, ``fakelib`` torch,
    ``lib2`` a package the program's package imports after it (FlashInfer's: jinja2), and the
    pool's thread imports both ``user`` (which imports ``fakelib``) and ``lib2``: serving
    starts once ``import pkg`` has ended, on the thread that imported it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import core\nimport lib2\nfrom . import after\n")
    (pkg / "core.py").write_text("import fakelib\nDEFINED_LAST = True\n")
    (pkg / "after.py").write_text("")
    (tmp_path / "lib2").mkdir()
    (tmp_path / "lib2" / "__init__.py").write_text("from . import sub\n")
    (tmp_path / "lib2" / "sub.py").write_text("")
    (tmp_path / "user.py").write_text("import fakelib\n")
    (tmp_path / "fakelib.py").write_text(
        "import sys, threading\n"
        "from acompile._torch._autoload import after_import\n"
        "def serve():\n"
        "    seen = getattr(sys.modules['pkg.core'], 'DEFINED_LAST', False)\n"
        "    whole = hasattr(sys.modules['pkg'], 'after')\n"
        "    t = threading.Thread(target=lambda: (__import__('user'), __import__('lib2')))\n"  # the pool's
        "    t.start(); t.join(10)\n"
        "    print('served', seen, whole, not t.is_alive(), threading.current_thread().name, flush=True)\n"
        "after_import('pkg.core', serve)\n"
    )
    done = run_python("import pkg; print('imported', flush=True)", timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["served", "True", "True", "True", "MainThread", "imported"], done.stdout


def test_serving_waits_for_the_imports_around_its_trigger_and_for_a_trigger_that_failed_once(
    tmp_path: Path,
) -> None:
    """A trigger imported the usual way (its package imports it, then a package of its own):
    serving starts once the program's ``import`` has ended, never inside it. A trigger whose
    import raised is waited for again: the import that succeeds later starts serving, once."""
    (tmp_path / "outer").mkdir()
    (tmp_path / "outer" / "__init__.py").write_text("from . import trig\nimport lib3\nLATE = True\n")
    (tmp_path / "outer" / "trig.py").write_text("")
    (tmp_path / "lib3").mkdir()
    (tmp_path / "lib3" / "__init__.py").write_text("from . import sub\n")
    (tmp_path / "lib3" / "sub.py").write_text("")
    (tmp_path / "flaky.py").write_text(
        "import os\nif not os.path.exists('ok'):\n    raise ImportError('not yet')\n"
    )
    code = """
import sys, threading
from acompile._torch._autoload import after_import

def serve():
    whole = getattr(sys.modules['outer'], 'LATE', False)
    t = threading.Thread(target=lambda: __import__('lib3'))  # the pool's thread
    t.start(); t.join(10)
    print('served', whole, not t.is_alive(), flush=True)

after_import('outer.trig', serve)
after_import('flaky', lambda: print('flaky served', flush=True))
import outer
print('imported', flush=True)
try:
    import flaky
except ImportError:
    print('flaky failed', flush=True)
open('ok', 'w').close()
import flaky
"""
    done = run_python(code, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["served True True", "imported", "flaky failed", "flaky served"], (
        done.stdout
    )


def test_keys_are_the_same_for_a_build_at_other_paths_and_differ_for_a_changed_header(tmp_path: Path) -> None:
    """The full key names files by root and content: the same headers under another
    environment's path give the same key; a changed one gives another."""
    from acompile._jit._ninja import Build, full_parts, relative_name

    copies = []
    for name in ("venv-a", "venv-b"):
        site = tmp_path / name / "site-packages"
        (site / "lib").mkdir(parents=True)
        (site / "lib" / "x.h").write_text("int x;\n")
        copies.append(site)

    def build(site: Path) -> Build:
        return Build("lib", "m", str(tmp_path), "build.ninja", {}, (("site", str(site.resolve())),))

    deps = [relative_name(str(copies[0] / "lib" / "x.h"), build(copies[0]).roots)]
    assert deps == ["<site>/lib/x.h"]
    one = full_parts("direct", build(copies[0]), deps)
    two = full_parts("direct", build(copies[1]), deps)
    assert one == two and one is not None
    (copies[1] / "lib" / "x.h").write_text("int y;\n")
    os.utime(copies[1] / "lib" / "x.h", ns=(1, 1))
    assert full_parts("direct", build(copies[1]), deps) != one
    # A manifest naming a path that climbs out of its root, or a root this machine lacks: no key.
    assert full_parts("direct", build(copies[0]), ["<site>/../../etc/passwd"]) is None
    assert full_parts("direct", build(copies[0]), ["<elsewhere>/x.h"]) is None


def test_the_direct_key_holds_the_compilers_version_and_flags_but_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler named as torch's build files name it (``c++``, found on PATH) that says
    another version gives another key; the same build in another folder gives the same one."""
    import stat

    from acompile._jit import _ninja

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    compiler = bin_dir / "g++"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def say(version: str) -> None:
        compiler.write_text(f"#!/bin/sh\necho 'g++ (Test) {version}'\n")
        compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
        _ninja._identity.cache_clear()

    def key(folder: Path, flags: str = "-O2") -> dict[str, Any]:
        folder.mkdir(exist_ok=True)
        (folder / "a.cpp").write_text("int a;\n")
        (folder / "build.ninja").write_text(
            f"rule cc\n  command = g++ {flags} -c $in -o $out\nbuild a.o: cc {folder}/a.cpp\n"
        )
        build = _ninja.Build("lib", "m", str(folder), "build.ninja", {}, _ninja.standard_roots(str(folder)))
        return _ninja.direct_parts(build, _ninja.read_graph(build))

    say("12.2.0")
    first = key(tmp_path / "one")
    assert key(tmp_path / "two") == first  # another folder, the same build
    assert key(tmp_path / "two", "-O3") != first  # another flag
    say("13.1.0")
    assert key(tmp_path / "one") != first  # another compiler release
    _ninja._identity.cache_clear()


def test_a_program_that_knows_nothing_of_acompile_is_served_through_acompile_run(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """``acompile run -- python script.py``: the script builds a torch extension and never names
    acompile; a second machine (another extensions folder, another home) sharing the cache
    folder builds nothing."""
    cache = tmp_path / "acompile"
    command = [
        sys.executable,
        "-m",
        "acompile",
        "run",
        "-v",
        "--cache-dir",
        str(cache),
        "--workers",
        "1",
        "--",
    ]
    lines = []
    for name in ("first", "second"):
        env = machine(tmp_path, name)
        env.pop("ACOMPILE_CACHE_DIR")
        done = subprocess.run(
            [*command, sys.executable, MACHINE, "{}", str(source[0]), "42", str(source[1])],
            capture_output=True,
            text=True,
            timeout=240,
            env=subprocess_env(**env),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["answer"] == 42
        lines.append([line for line in done.stderr.splitlines() if "served cpp_extension" in line])
    assert lines[0] and "from the tiers 0, built on the pool 1" in lines[0][0], lines
    assert lines[1] and "from the tiers 1, built on the pool 0, built here 0" in lines[1][0], lines


def test_a_pool_limit_is_not_the_librarys_error_the_library_builds_it(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """A job the pool stops (here its time limit, 0.05 s: shorter than any build) is the pool's
    fault, not the compiler's: torch builds the extension itself, and it works."""
    options = {"workers": 1, "jits": ["cpp_extension"], "max_compile_seconds": 0.05}
    report = build_in(machine(tmp_path, "m"), options, source)
    assert report.get("answer") == 42, report
    assert report["jit"]["local_builds"] == 1 and report["jit"]["failed"] == 0
    assert report["jit"]["puts"] == 1  # built here, and still published


def test_headers_are_read_only_as_regular_files(tmp_path: Path) -> None:
    """A manifest naming a FIFO (or one swapped in for a header) is a miss, never a read that
    blocks the library's thread."""
    from acompile._jit._ninja import Build, full_parts

    fifo = tmp_path / "header.h"
    os.mkfifo(fifo)
    build = Build("lib", "m", str(tmp_path), "build.ninja", {}, (("build", str(tmp_path.resolve())),))
    assert full_parts("direct", build, ["<build>/header.h"]) is None
    assert full_parts("direct", build, ["/dev/zero"]) is None


def test_a_build_that_records_no_headers_is_not_published(tmp_path: Path) -> None:
    """Without the compilers' dependency output the key would not hold the headers: such a build
    is not keyed for the fleet (a changed header would be served the old module)."""
    import subprocess as sp

    from acompile._jit._ninja import Build, BuildUnreadable, read_deps, read_graph, standard_roots

    (tmp_path / "a.c").write_text('#include "a.h"\nint a(void) { return A; }\n')
    (tmp_path / "a.h").write_text("#define A 1\n")
    rules = {
        "with": "rule cc\n  command = gcc -MMD -MF $out.d -fPIC -c $in -o $out\n  depfile = $out.d\n  deps = gcc\n",
        "without": "rule cc\n  command = gcc -fPIC -c $in -o $out\n",
    }
    for name, rule in rules.items():
        (tmp_path / "build.ninja").write_text(
            rule + "rule link\n  command = gcc -shared $in -o $out\n"
            f"build {name}.o: cc {tmp_path}/a.c\nbuild {name}.so: link {name}.o\n"
        )
        sp.run(["ninja", "-C", str(tmp_path)], check=True, capture_output=True)
        build = Build("lib", name, str(tmp_path), "build.ninja", {}, standard_roots(str(tmp_path)))
        graph = read_graph(build)
        if name == "with":
            assert str((tmp_path / "a.h").resolve()) in read_deps(build, graph)
        else:
            with pytest.raises(BuildUnreadable, match="recorded no headers"):
                read_deps(build, graph)


def test_the_environment_the_compilers_read_is_in_the_key(tmp_path: Path) -> None:
    from acompile._jit import _ninja

    (tmp_path / "a.cpp").write_text("int a;\n")
    (tmp_path / "build.ninja").write_text(
        f"rule cc\n  command = g++ -c $in -o $out\nbuild a.o: cc {tmp_path}/a.cpp\n"
    )

    # The library's environment (ninja found on its PATH), less the variables tried here.
    base = {k: v for k, v in os.environ.items() if k not in ("NVCC_APPEND_FLAGS", "CPATH")}

    def key(**env: str) -> dict[str, Any]:
        build = _ninja.Build(
            "lib",
            "m",
            str(tmp_path),
            "build.ninja",
            {},
            _ninja.standard_roots(str(tmp_path)),
            {**base, **env},
        )
        return _ninja.direct_parts(build, _ninja.read_graph(build))

    plain = key()
    assert key(NVCC_APPEND_FLAGS="-G") != plain
    # The search paths are not: a box without a GPU warms a fleet up with its own (the headers
    # found through them are keyed by content, in the manifest).
    assert key(CPATH="/opt/a:/opt/b") == key(CPATH="/opt/b") == plain
    assert key(UNRELATED="x") == plain


SLOW_SOURCE = """
#include "answer.h"
constexpr long f() { long s = 0; for (long i = 0; i < 60000000L; i++) s += (i * i) % 7; return s; }
constexpr long v = f();
extern "C" int answer() { return ANSWER + OFFSET + (int)(v % 1); }
"""


def _processes_naming(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid() and " -m pytest" not in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def test_a_server_killed_mid_build_leaves_no_compiler_running(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """ninja runs each command in a process group of its own: a served process SIGKILLed while
    its pool builds must still take the compilers with it (one left would write an old object
    into the folder under the next build)."""
    import signal
    import time

    source[0].write_text(SLOW_SOURCE)
    env = machine(tmp_path, "m")
    options = {"workers": 1, "jits": ["cpp_extension"]}
    options_json = json.dumps(options)
    flags = ["-fconstexpr-loop-limit=2000000000", "-fconstexpr-ops-limit=100000000000"]
    code = (
        "import sys, jit_machine\n"
        f"sys.argv = ['x', {options_json!r}, {str(source[0])!r}, '42 {' '.join(flags)}', {str(source[1])!r}]\n"
        "jit_machine.main()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=subprocess_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not any("cc1plus" in p for p in _processes_naming(str(source[0]))):
            assert child.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "no compiler started"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while (left := _processes_naming(str(tmp_path))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, left
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for line in _processes_naming(str(tmp_path)):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def test_a_build_folder_of_another_user_is_neither_built_on_the_pool_nor_published(
    tmp_path: Path, source: tuple[Path, Path]
) -> None:
    """What comes out of a folder another user may write (objects, a build file they put there)
    is theirs: the library builds as without acompile, and nothing reaches the fleet's tiers."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    env = machine(tmp_path, "m")
    folder = Path(env["TORCH_EXTENSIONS_DIR"]) / "answer_ext"
    folder.mkdir(parents=True)
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    folder.chmod(0o777)
    report = build_in(env, {"workers": 1, "jits": ["cpp_extension"]}, source)
    assert report.get("answer") == 42
    assert report["jit"]["local_builds"] == 1 and report["jit"]["builds"] == 0 and report["jit"]["puts"] == 0
    assert "belongs to another user" in report["stderr"]


def test_a_lock_of_another_user_is_an_error_not_a_wait(tmp_path: Path, source: tuple[Path, Path]) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    env = machine(tmp_path, "m")
    folder = Path(env["TORCH_EXTENSIONS_DIR"]) / "answer_ext"
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    os.chown(folder / "lock", nobody.pw_uid, nobody.pw_gid)
    report = build_in(env, {"workers": 1, "jits": ["cpp_extension"]}, source, timeout=60)
    assert "belongs to another user" in report.get("error", ""), report


def test_a_static_library_the_link_takes_is_in_the_key(
    tmp_path: Path, redis_server: RedisServer, source: tuple[Path, Path]
) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()

    def archive(value: int) -> None:
        (lib / "helper.c").write_text(f"int helper(void) {{ return {value}; }}\n")
        subprocess.run(["gcc", "-fPIC", "-c", str(lib / "helper.c"), "-o", str(lib / "helper.o")], check=True)
        (lib / "libhelper.a").unlink(missing_ok=True)
        subprocess.run(["ar", "rcs", str(lib / "libhelper.a"), str(lib / "helper.o")], check=True)

    source[0].write_text(
        'extern "C" int helper(void);\nextern "C" int answer() { return helper() + ANSWER; }\n'
    )
    code = (
        "import sys, jit_machine\n"
        "from torch.utils import cpp_extension\n"
        "real = cpp_extension.load\n"
        f"cpp_extension.load = lambda *a, **k: real(*a, extra_ldflags=['-L{lib}', '-lhelper'], **k)\n"
        f"sys.argv = ['x', {json.dumps(served(redis_server.url))!r}, {str(source[0])!r}, '0', '']\n"
        "jit_machine.main()\n"
    )
    answers = []
    for name, value in (("first", 100), ("second", 200)):
        archive(value)
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=240,
            env=subprocess_env(**machine(tmp_path, name)),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        answers.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [a.get("answer") for a in answers] == [100, 200], answers
    assert answers[1]["jit"]["builds"] == 1 and answers[1]["jit"]["hits"]["shared"] == 0


def test_a_stopped_build_holds_its_folder_until_its_last_command_is_gone(tmp_path: Path) -> None:
    """A worker killed mid-build (a limit, a cancel): its ninja interrupts the commands, and each
    removes what it left half-written as it dies (a linker does), which could be the module the
    library builds at once in the same folder. The folder's lock is held until the last of them
    is gone, and the library's build takes it first."""
    import signal
    import time

    from acompile._jit._worker import folder_lock

    # The command dies slowly on ninja's interrupt and removes its output as it goes (ninja, which
    # sends its own SIGTERM on to each command's group, exits at once without waiting for it).
    (tmp_path / "build.ninja").write_text(
        "rule slow\n"
        "  command = sh -c 'exec >/dev/null 2>&1; echo part > $out; "
        'trap "sleep 1; rm -f $out; exit 1" INT TERM; touch started; '
        "while :; do sleep 0.05; done'\n"
        "build out.so: slow\n"
    )
    job = {
        "name": "slow",
        "folder": str(tmp_path),
        "build_file": "build.ninja",
        "ninja": "ninja",
        "env": None,
        "products": [],
    }
    code = "import json, sys\nfrom acompile._jit import _worker\n_worker.compile(sys.argv[1].encode())\n"
    worker = subprocess.Popen([sys.executable, "-c", code, json.dumps(job)], env=subprocess_env())
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        with folder_lock(str(tmp_path), 30, pytest.fail) as lock:
            assert lock is not None
            (tmp_path / "out.so").write_text("the library's own build")  # as run_here makes it
        deadline = time.monotonic() + 10
        while _processes_naming(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Nothing of the stopped build was left to remove what the library built.
        assert (tmp_path / "out.so").read_text() == "the library's own build"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert not _processes_naming(str(tmp_path))
