"""The worker pool, driven through the fake backend: real processes, fake compiler."""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import importlib.util
import json
import marshal
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from conftest import asyncio_only
from fake_backend import local_executor
from processes import forked_and_fresh, gone, template_pids, until, worker_pids

import acompile
from acompile._workers import Job, JobCancelled, WorkerPool, WorkerSettings
from acompile.testing import run_job

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


def pool(cache_dir: Path, workers: int = 2, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target="cuda:90", cache_dir=cache_dir, preload=(), **kw)  # type: ignore[arg-type]


async def test_jobs_run_in_separate_worker_processes(cache_dir: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    async with pool(cache_dir) as p:
        await p.wait_ready()
        pids: list[int] = []
        async with anyio.create_task_group() as tg:

            async def one() -> None:
                payload = {"name": "s", "action": "hold", "until": str(release), "pid": True}
                pids.append(await run_job(p, FAKE, payload, "s"))

            for _ in range(2):
                tg.start_soon(one)
            await until(lambda: p.stats()["jobs"]["running"] == 2)
            release.touch()
        # Two jobs at once on a pool of two: two worker processes, neither of them this one.
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert p.stats()["workers"]["alive"] == 2


async def test_worker_sees_parent_cwd_sys_path_and_environment(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACOMPILE_TEST_VALUE", "from-the-parent")
    extra = str(tmp_path / "extra-path")
    monkeypatch.syspath_prepend(extra)
    async with pool(cache_dir, workers=1) as p:
        seen = await run_job(p, FAKE, {"name": "e", "action": "env", "var": "ACOMPILE_TEST_VALUE"}, "e")
    assert seen["cwd"] == str(tmp_path)
    assert extra in seen["sys_path"]
    assert seen["env"] == "from-the-parent"


@pytest.mark.parametrize("fork_workers", [True, False], ids=["forked", "spawned"])
async def test_a_worker_imports_only_what_its_jobs_use_and_the_rest_on_first_use(
    cache_dir: Path, fork_workers: bool
) -> None:
    # The pool's side of acompile (the pool, the cache tiers, the public namespace) is most of
    # the library: a worker that imported it would pay for it at every start.
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        loaded, errors, compiler, env = await run_job(p, FAKE, {"name": "m", "action": "modules"}, "m")
    assert "acompile._workers._main" in loaded
    for parent_side in ("acompile._compiler", "acompile._workers._pool", "acompile._cache._chain"):
        assert parent_side not in loaded
    assert (errors, compiler) == ("acompile._errors", "acompile._compiler")
    assert env is None  # the processes a worker starts are not workers


def _source_only_package(site: Path, name: str, value: int) -> Path:
    """A package installed as source files only, as uv installs (without --compile-bytecode)."""
    source = site / name / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text(f"VALUE = {value}\n")
    return source


def _plant_bytecode(source: Path, code: str, cached: str, *, hash_based: bool = False) -> None:
    """Bytecode of ``code`` at ``cached``, with the header of ``source``, which Python checks
    before it runs a bytecode file instead of its source: its modification time and size, or
    (``hash_based``: as acompile writes its workers' files) the hash of its bytes."""
    import importlib._bootstrap_external as external

    compiled = compile(code, str(source), "exec")
    if hash_based:
        source_hash = importlib.util.source_hash(source.read_bytes())
        data = external._code_to_hash_pyc(compiled, source_hash, True)  # type: ignore[attr-defined]
    else:
        stat = source.stat()
        data = external._code_to_timestamp_pyc(compiled, stat.st_mtime, stat.st_size)  # type: ignore[attr-defined]
    Path(cached).parent.mkdir(parents=True, exist_ok=True)
    Path(cached).write_bytes(bytes(data))


@pytest.mark.parametrize("fork_workers", [True, False], ids=["forked", "spawned"])
async def test_where_the_installation_has_no_bytecode_workers_keep_it_in_the_cache_and_read_it_next_time(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork_workers: bool
) -> None:
    # Without bytecode beside its sources (and with PYTHONDONTWRITEBYTECODE=1, as images set it),
    # every worker would compile Triton's sources again. Here the heavy package is one made of
    # source files only; the check is the one made for Triton.
    from acompile._workers import _bytecode

    source = _source_only_package(tmp_path / "site", "sourceonly", 42)
    compiled = _source_only_package(tmp_path / "site", "compiled", 7)
    beside = importlib.util.cache_from_source(str(compiled))
    _plant_bytecode(compiled, "VALUE = 8\n", beside)  # the installation's own bytecode, marked
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(_bytecode, "_HEAVY", "sourceonly")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    job = {"name": "i", "action": "import", "module": "sourceonly"}
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        value, cached, dont_write = await run_job(p, FAKE, job, "i")
        other = await run_job(p, FAKE, {**job, "module": "compiled"}, "c")
    folder = cache_dir / "toolchain" / _bytecode.FOLDER
    ours = folder / cached.lstrip(os.sep)
    assert (value, dont_write) == (42, True)  # left as it was: the folder is written anyway
    assert cached == importlib.util.cache_from_source(str(source))
    assert os.path.isfile(ours)  # noqa: ASYNC240 (a test's check)
    assert not os.path.exists(source.parent / "__pycache__")  # noqa: ASYNC240 (nothing beside the sources)
    # Bytecode beside its source is read from there, and not written again.
    assert other == (8, beside, True)
    assert not os.path.exists(folder / beside.lstrip(os.sep))  # noqa: ASYNC240 (a test's check)

    # The next pool's workers read the file in the cache. Proof: bytecode of other code, put in
    # its place with the header of the same source (the hash of its bytes), is what they run.
    _plant_bytecode(source, "VALUE = 43\n", str(ours), hash_based=True)
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        assert await run_job(p, FAKE, job, "i") == (43, cached, True)


def _compiled_in(folder: Path, source: Path) -> bool:
    """Whether ``folder`` holds whole, current bytecode of ``source``, as the workers' loader
    reads it (the source's hash in its header; code of that file)."""
    import marshal

    from acompile._workers import _bytecode

    ours = folder / importlib.util.cache_from_source(str(source)).lstrip(os.sep)
    if not ours.is_file():
        return False
    data = ours.read_bytes()
    if data[:16] != _bytecode._header(source.read_bytes()):
        return False
    return marshal.loads(data[16:]).co_filename == str(source)


def _slow_package(site: Path, name: str, files: int) -> Path:
    """A source-only package whose modules take a helper seconds to compile."""
    init = _source_only_package(site, name, 1)
    for n in range(files):
        (init.parent / f"huge{n}.py").write_text(
            "".join(f"def f{i}(x):\n    return [x + {i} for _ in range(3)]\n" for i in range(60000))
        )
    return init


def _helpers_of_templates() -> list[psutil.Process]:
    from acompile._workers import BYTECODE_HELPER_NAME

    found = []
    for template in template_pids():
        with contextlib.suppress(psutil.Error):
            found += [c for c in psutil.Process(template).children() if c.name() == BYTECODE_HELPER_NAME]
    return found


async def test_the_first_template_on_a_cache_folder_compiles_the_heavy_package_with_helpers(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first pool on a folder pays the compile of the heavy package's sources (Triton's:
    # ~0.15 s of a template's start on a 16-core host); helpers forked by the template share
    # it. On a machine of two CPUs there are none: here the count is set to two. The pool
    # preloads Triton (helpers are for a pool that does); the heavy package is a stand-in.
    from acompile._workers import _bytecode

    site = tmp_path / "site"
    init = _source_only_package(site, "sourceonly", 42)
    package = init.parent
    # Modules the job never imports: only a helper can have compiled them.
    (package / "big.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(3000)))
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "leaf.py").write_text("VALUE = 5\n")
    (package / "broken.py").write_text("def (:\n")  # does not compile: its importer will say so
    modules = [init, package / "big.py", package / "sub" / "__init__.py", package / "sub" / "leaf.py"]
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(_bytecode, "_HEAVY", "sourceonly")
    monkeypatch.setattr(_bytecode, "helpers_for", lambda cpus: 2)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    folder = cache_dir / "toolchain" / _bytecode.FOLDER
    job = {"name": "i", "action": "import", "module": "sourceonly"}
    kw = {"target": "cuda:90", "cache_dir": cache_dir, "preload": ("triton",)}
    async with acompile.CompilePool(1, **kw) as p:  # type: ignore[arg-type]
        assert (await run_job(p, FAKE, job, "i"))[0] == 42
        # Once every helper has ended well, the template leaves a stamp of the sources done.
        await until(lambda: list(folder.glob("helped-*")), seconds=30)
        assert not _helpers_of_templates()  # reaped by the template, not counted as workers
    assert all(_compiled_in(folder, source) for source in modules)
    assert not list(folder.rglob("*broken*"))
    assert not list(folder.rglob("*.tmp"))
    assert not (package / "__pycache__").exists()
    # The next pool's template finds the stamp: nothing compiled again.
    before = {path: path.stat().st_mtime_ns for path in folder.rglob("*.pyc")}
    async with acompile.CompilePool(1, **kw) as p:  # type: ignore[arg-type]
        assert (await run_job(p, FAKE, job, "i"))[0] == 42
    assert {path: path.stat().st_mtime_ns for path in folder.rglob("*.pyc")} == before


async def test_bytecode_helpers_are_only_for_a_pool_that_preloads_triton_and_only_as_it_says(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from acompile._workers import _bytecode

    site = tmp_path / "site"
    _slow_package(site, "sourceonly", 2)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(_bytecode, "_HEAVY", "sourceonly")
    monkeypatch.setattr(_bytecode, "helpers_for", lambda cpus: 2)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    triton = acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir)
    folder, helpers = triton._bytecode_plan()
    assert folder and json.loads(helpers) == {"count": 2, "roots": [str(site / "sourceonly")]}
    # A pool of C++ or CUDA only never imports Triton in its workers: no help for it.
    assert pool(cache_dir)._bytecode_plan() == (folder, "")
    # A value that is not one the pool writes starts nothing (and never fails the template).
    for odd in (
        "",
        "2",
        "{",
        '{"count": 1e400, "roots": ["x"]}',
        '{"count": 2}',
        '{"count": -1, "roots": ["x"]}',
    ):
        assert _bytecode.precompile(str(tmp_path / "odd"), odd) is None, odd
    # Nor does a value left in this process's environment reach its template.
    monkeypatch.setenv(_bytecode.HELPERS_ENV, helpers)
    async with pool(cache_dir, workers=1, fork_workers=True) as p:
        # A template forks its helpers before it preloads: had it any, they would be compiling
        # (for seconds) once its workers are ready.
        await p.wait_ready()
        assert not _helpers_of_templates()
    assert not list(Path(folder).glob("helped-*"))  # noqa: ASYNC240 (a test's check)


def _precompile_in_a_process(
    site: Path, folder: Path, package: str, then: str = "", *, said: list[str] | None = None
) -> list[int]:
    """``_bytecode.precompile`` of two helpers for ``package`` in a fresh process, as a template
    calls it (its SIGTERM handler and death signal set, the pool's work folder, ``workdir``
    beside ``site``, named); runs ``then`` after it, and returns the helpers' pids (and in
    ``said`` what ``then`` printed)."""
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(site)!r})
        from acompile._workers import _bytecode, _main
        _main._die_with_parent(os.getppid(), template=True)
        helping = _bytecode.precompile({str(folder)!r}, _bytecode.helpers_env(2, {package!r}))
        pids = sorted(helping.pids) if helping else []
        print(" ".join(map(str, pids)), flush=True)
    """) + textwrap.dedent(then)
    env = {**os.environ, "ACOMPILE_PARENT_PID": str(os.getpid())}
    env["ACOMPILE_WORKDIR"] = str(site.parent / "workdir")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    first, *rest = out.stdout.splitlines()
    if said is not None:
        said += rest
    return [int(pid) for pid in first.split()]


# As a template reaps its helpers: each end reported, the stamp written once all ended well.
_REAP = """
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        helping.ended(pid, status)
"""


def test_bytecode_helpers_die_with_the_process_that_forked_them(tmp_path: Path) -> None:
    """A template killed while its helpers compile takes them along (and their files are whole
    or absent)."""
    site, folder = tmp_path / "site", tmp_path / "bytecode"
    _slow_package(site, "slowpkg", 6)  # seconds a helper: at it when their parent dies, and after
    then = """
        time.sleep(0.3)  # the helpers are compiling now
        os._exit(0)
    """
    helpers = _precompile_in_a_process(site, folder, "slowpkg", then)
    assert len(helpers) == 2
    deadline = time.monotonic() + 1.5
    while not all(gone(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(gone(pid) for pid in helpers)
    for path in folder.rglob("*.pyc"):  # whole, where written
        assert marshal.loads(path.read_bytes()[16:]).co_filename.startswith(str(site))
    assert not list(folder.glob("helped-*"))  # not done: the next template starts them again


def test_bytecode_helpers_start_only_where_their_work_is_not_done(tmp_path: Path) -> None:
    site, folder = tmp_path / "site", tmp_path / "bytecode"
    init = _source_only_package(site, "pkg", 1)
    largest = init.parent / "largest.py"
    largest.write_text("".join(f"A{i} = {i}\n" for i in range(2000)))
    small = init.parent / "small.py"
    small.write_text("B = 2\n")
    # Helpers stopped before the end (a first template that went early) leave no stamp.
    killed = _REAP.replace("for pid in pids:", "for pid in pids:\n        os.kill(pid, 9)")
    assert len(_precompile_in_a_process(site, folder, "pkg", killed)) == 2
    assert not list(folder.glob("helped-*"))
    # Nor do helpers that could not write their files (a full disk; a file where a folder goes).
    blocker = folder / importlib.util.cache_from_source(str(init)).lstrip(os.sep)
    # (What the killed helpers wrote before the kill, if they got that far, goes first.)
    shutil.rmtree(blocker.parent, ignore_errors=True)
    blocker.parent.parent.mkdir(parents=True, exist_ok=True)
    blocker.parent.write_text("")
    assert len(_precompile_in_a_process(site, folder, "pkg", _REAP)) == 2
    assert not list(folder.glob("helped-*"))
    blocker.parent.unlink()
    assert len(_precompile_in_a_process(site, folder, "pkg", _REAP)) == 2
    assert all(_compiled_in(folder, source) for source in (init, largest, small))
    assert _precompile_in_a_process(site, folder, "pkg", _REAP) == []  # done already
    small.write_text("B = 3\n")  # an upgrade, of any file: compiled again
    assert len(_precompile_in_a_process(site, folder, "pkg", _REAP)) == 2
    assert _compiled_in(folder, small)
    # Where nothing they compiled could be kept (a cache baked read-only into an image; here a
    # folder that cannot be made, which holds for root too), none start.
    (tmp_path / "a-file").write_text("")
    assert _precompile_in_a_process(site, tmp_path / "a-file" / "bytecode", "pkg", _REAP) == []


def test_a_bytecode_helper_stopped_with_sigterm_leaves_the_pools_work_folder(tmp_path: Path) -> None:
    """A helper does not keep the template's SIGTERM handler, which, in a process whose parent
    is not the pool's, would take the pool for dead and remove its work folder."""
    site, folder = tmp_path / "site", tmp_path / "bytecode"
    (tmp_path / "workdir").mkdir()
    _slow_package(site, "slowpkg", 2)  # seconds to compile: at it when signalled
    then = """
        os.kill(pids[0], 15)
        _, status = os.waitpid(pids[0], 0)
        print("workdir", os.path.isdir(os.environ["ACOMPILE_WORKDIR"]), os.WTERMSIG(status), flush=True)
        os._exit(0)
    """
    said: list[str] = []
    assert len(_precompile_in_a_process(site, folder, "slowpkg", then, said=said)) == 2
    assert said == [f"workdir True {signal.SIGTERM.value}"]
    assert (tmp_path / "workdir").is_dir()


def _import_with_the_workers_loader(folder: Path, site: str, module: str) -> str:
    """Import ``module`` from ``site`` in a fresh process through the workers' bytecode loader."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {site!r})
        from acompile._workers import _bytecode
        _bytecode.install({str(folder)!r})
        import {module} as module
        print(module.VALUE)
    """)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_workers_bytecode_is_compiled_again_when_damaged_stale_or_no_file(tmp_path: Path) -> None:
    """The folder outlives reinstalls and full disks: what it holds is checked against the
    source's bytes, and anything that does not read back whole is compiled again."""
    folder, site = tmp_path / "bytecode", tmp_path / "site"
    source = _source_only_package(site, "mod", 1)
    assert _import_with_the_workers_loader(folder, str(site), "mod") == "1"
    ours = folder / importlib.util.cache_from_source(str(source)).lstrip(os.sep)
    whole = ours.read_bytes()
    assert not (source.parent / "__pycache__").exists()

    ours.write_bytes(whole[:24])  # a write cut short (a full disk)
    assert _import_with_the_workers_loader(folder, str(site), "mod") == "1"
    assert ours.read_bytes() == whole

    # Another source of the same size and modification time (a deploy that keeps timestamps).
    stat = source.stat()
    source.write_text("VALUE = 2\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _import_with_the_workers_loader(folder, str(site), "mod") == "2"

    ours.unlink()
    os.mkfifo(ours)  # not a file: read, it would block the worker for ever
    assert _import_with_the_workers_loader(folder, str(site), "mod") == "2"
    assert ours.is_file()

    ours.unlink()
    ours.mkdir()  # a folder where the file goes: compiled each time, never a failed start
    assert _import_with_the_workers_loader(folder, str(site), "mod") == "2"
    ours.rmdir()

    # A sys.path entry that climbs (/../..) still writes inside the folder, never beside the source.
    shutil.rmtree(folder)
    climbing = "/.." * 8 + str(site)
    assert _import_with_the_workers_loader(folder, climbing, "mod") == "2"
    assert [p.name for p in folder.rglob("*.pyc")] == [ours.name]
    assert not (source.parent / "__pycache__").exists()


def test_a_bytecode_folder_that_cannot_be_written_to_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache baked read-only into an image (simulated: this test may run as root, whom a
    # read-only mode does not stop).
    from acompile._workers import _bytecode

    _source_only_package(tmp_path / "site", "sourceonly", 1)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    (tmp_path / "memo" / _bytecode.FOLDER).mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK and access(path, mode))
    found = _bytecode.folder_for_workers(tmp_path / "memo", "sourceonly")
    assert found == str(tmp_path / "memo" / _bytecode.FOLDER)
    (tmp_path / "not-a-folder").write_text("")  # nothing to read, nothing can be made there
    assert _bytecode.folder_for_workers(tmp_path / "not-a-folder", "sourceonly") is None


async def test_an_installation_with_its_bytecode_or_a_chosen_prefix_is_left_as_it_is(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from acompile._workers import _bytecode

    source = _source_only_package(tmp_path / "site", "compiled", 7)
    assert compileall.compile_dir(source.parent, quiet=1)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(_bytecode, "_HEAVY", "compiled")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    job = {"name": "i", "action": "import", "module": "compiled"}
    async with pool(cache_dir, workers=1) as p:
        assert await run_job(p, FAKE, job, "i") == (7, importlib.util.cache_from_source(str(source)), True)
    assert not (cache_dir / "toolchain" / _bytecode.FOLDER).exists()

    # A prefix the user chose holds, even for sources without bytecode.
    mine = tmp_path / "my-prefix"
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(mine))
    shutil.rmtree(source.parent / "__pycache__")
    async with pool(cache_dir, workers=1) as p:
        assert Path((await run_job(p, FAKE, job, "i"))[1]).is_relative_to(mine)
    assert not (cache_dir / "toolchain" / _bytecode.FOLDER).exists()


async def test_a_worker_connecting_as_the_accept_is_cancelled_is_accepted_by_the_next_one(
    tmp_path: Path,
) -> None:
    """A forked worker's connection that arrives in the same step of the loop as the
    cancellation of the accept waiting for it (a pool quiesced or left as its workers come up)
    stays for the next accept: it is neither lost nor accepted into the cancelled wait, which
    asyncio's sock_accept does (InvalidStateError in the loop, and the connection leaks)."""
    from acompile._workers._template import UnixListener

    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    address = str(tmp_path / "workers.sock")
    listener = UnixListener(address)
    clients: list[socket.socket] = []
    accepted = []
    try:
        for _ in range(20):
            scope = anyio.CancelScope()

            async def accept_until_cancelled(scope: anyio.CancelScope = scope) -> None:
                with scope:
                    accepted.append(await listener.accept())

            async with anyio.create_task_group() as tg:
                tg.start_soon(accept_until_cancelled)
                await anyio.wait_all_tasks_blocked()  # it waits for a connection now
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.connect(address)  # the listening socket is readable from here on
                clients.append(client)
                # Runs first in the loop's next step, the one whose poll sees the connection.
                loop.call_soon(scope.cancel)
            if len(accepted) < len(clients):
                with anyio.fail_after(5):
                    accepted.append(await listener.accept())
    finally:
        loop.set_exception_handler(None)
        for connection in accepted:
            await connection.aclose()
        for client in clients:
            client.close()
        await listener.aclose()
    assert errors == []
    assert len(accepted) == len(clients) == 20


async def test_output_on_stdout_does_not_corrupt_the_protocol(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        assert await run_job(p, FAKE, {"name": "p", "action": "print"}, "p") == "printed"
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 42}, "e") == 42


async def test_a_stderr_flood_never_hangs_and_its_tail_travels_with_the_error(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        with anyio.fail_after(60):
            assert await run_job(p, FAKE, {"name": "f", "action": "flood", "megabytes": 50}, "f") == "flooded"
            with pytest.raises(acompile.CompileError) as info:
                await run_job(
                    p, FAKE, {"name": "flooder", "action": "flood", "megabytes": 2, "fail": True}, "flooder"
                )
    err = info.value
    assert "the last words of the compiler" in err.stderr_tail
    assert len(err.stderr_tail) <= 64 * 1024
    assert "the last words of the compiler" in str(err)


async def test_a_failed_jobs_tail_is_its_own_output_not_that_of_the_job_before_it(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        with anyio.fail_after(60):
            said = {"name": "a", "action": "say", "words": "left behind by the job before"}
            assert await run_job(p, FAKE, said, "a") == "said"
            assert await run_job(p, FAKE, {"name": "q", "action": "echo", "value": 1}, "q") == 1
            with pytest.raises(acompile.CompileError) as info:
                await run_job(
                    p, FAKE, {"name": "b", "action": "say", "words": "said by this job", "fail": True}, "b"
                )
    assert "said by this job" in info.value.stderr_tail
    assert "left behind" not in info.value.stderr_tail


async def test_large_results_come_back_whole(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        data = await run_job(p, FAKE, {"name": "b", "action": "big", "bytes": 100 * 1024 * 1024}, "b")
    assert len(data) == 100 * 1024 * 1024 and data[:1] == b"\x01" and data[-1:] == b"\x01"


async def test_an_exception_in_the_compiler_is_a_compile_error_with_the_worker_traceback(
    cache_dir: Path,
) -> None:
    async with pool(cache_dir, workers=1) as p:
        with pytest.raises(acompile.CompileError) as info:
            await run_job(p, FAKE, {"name": "k1", "action": "raise", "message": "bad tile"}, "k1")
        assert info.value.kernel == "k1"
        assert "bad tile" in str(info.value) and "bad tile" in info.value.log
        assert "fake_backend.py" in info.value.worker_traceback
        # The worker survived: same process answers the next job.
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 1}, "e") == 1
        assert p.stats()["workers"]["restarts"] == {}


async def test_an_unpicklable_result_fails_that_job_only(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        with pytest.raises(acompile.CompileError, match="pickle"):
            await run_job(p, FAKE, {"name": "u", "action": "unpicklable"}, "u")
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 2}, "e") == 2


async def test_an_unsendable_request_fails_that_job_only(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        with pytest.raises(acompile.CompileError, match="cannot send"):
            await run_job(p, FAKE, {"name": "u", "action": "echo", "value": lambda: None}, "u")
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": 3}, "e") == 3


@forked_and_fresh
@pytest.mark.parametrize("how", ["SIGSEGV", "SIGABRT", "exit"])
async def test_a_crashing_worker_fails_its_job_and_is_replaced(
    cache_dir: Path, tmp_path: Path, how: str, fork_workers: bool
) -> None:
    release = tmp_path / "release"
    payload = (
        {"name": "crasher", "action": "exit", "code": 134}
        if how == "exit"
        else {"name": "crasher", "action": "crash", "signal": how}
    )
    async with pool(cache_dir, workers=2, fork_workers=fork_workers) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            survivor: list[object] = []

            async def other() -> None:
                payload = {"name": "ok", "action": "hold", "until": str(release), "value": "ok"}
                survivor.append(await run_job(p, FAKE, payload, "ok"))

            tg.start_soon(other)
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            # The other job runs on the other worker through the crash, and ends after it.
            with pytest.raises(acompile.WorkerCrashedError) as info:
                await run_job(p, FAKE, payload, "crasher")
            release.touch()
        assert survivor == ["ok"]
        err = info.value
        assert err.kernel == "crasher"
        expected = 134 if how == "exit" else -getattr(signal, how)
        assert err.exit_code == expected, (err.exit_code, str(err))
        if how != "exit":
            assert "about to crash" in err.stderr_tail
        assert await run_job(p, FAKE, {"name": "e", "action": "echo", "value": "after"}, "e") == "after"
        # wait_ready() does not wait for a replacement (its slot was ready once): watch the count.
        await until(lambda: p.stats()["workers"]["alive"] == 2)
        assert p.stats()["workers"]["restarts"] == {"crash": 1}


@forked_and_fresh
async def test_cancelling_a_running_job_stops_its_worker(cache_dir: Path, fork_workers: bool) -> None:
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        async with anyio.create_task_group() as tg:
            # Far longer than the test: only stopping its worker ends it.
            tg.start_soon(run_job, p, FAKE, {"name": "slow", "action": "sleep", "seconds": 600}, "slow")
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            assert worker_pids() == [pid]
            tg.cancel_scope.cancel()
        # The process that ran it is gone, and a fresh one answers.
        await until(lambda: gone(pid))
        new_pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        assert new_pid != pid
        assert p.stats()["workers"]["restarts"] == {"abandoned": 1}
        assert p.stats()["jobs"]["cancelled"] == 1


@forked_and_fresh
async def test_a_job_handed_to_an_idle_worker_and_cancelled_at_once_stops_that_worker(
    cache_dir: Path, fork_workers: bool
) -> None:
    """An idle worker gets a job from the caller's own task; a caller that leaves before the
    worker's slot has seen the job still stops the worker (the job would run for ten minutes)."""
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        executor = local_executor(p)
        job = Job(FAKE, {"name": "slow", "action": "sleep", "seconds": 600}, "slow")
        executor.submit(job)
        assert job.state == "running" and job.worker_pid == pid  # handed over, in this task
        executor.cancel(job)  # before this task yields: the worker's slot has not run yet
        with pytest.raises(JobCancelled), anyio.fail_after(10):
            await job.outcome()
        await until(lambda: gone(pid))
        assert await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p") != pid
        assert p.stats()["workers"]["restarts"] == {"abandoned": 1}
        assert p.stats()["jobs"]["cancelled"] == 1


@forked_and_fresh
async def test_cancelling_a_queued_job_drops_it_without_touching_workers(
    cache_dir: Path, tmp_path: Path, fork_workers: bool
) -> None:
    release = tmp_path / "release"
    async with pool(cache_dir, workers=1, fork_workers=fork_workers) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_job, p, FAKE, {"name": "busy", "action": "hold", "until": str(release)}, "busy")
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            async with anyio.create_task_group() as queued:
                queued.start_soon(
                    run_job, p, FAKE, {"name": "never", "action": "crash"}, "never"
                )  # would crash if it ran
                await until(lambda: p.stats()["jobs"]["queued"] == 1)
                queued.cancel_scope.cancel()
            assert p.stats()["jobs"]["queued"] == 0
            release.touch()
        assert p.stats()["workers"]["restarts"] == {}
        assert p.stats()["jobs"]["done"] == 1 and p.stats()["jobs"]["failed"] == 0


async def test_background_work_waits_behind_urgent_work(cache_dir: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    order: list[str] = []
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:

            async def run(name: str, background: bool) -> None:
                await run_job(
                    p, FAKE, {"name": name, "action": "echo", "value": name}, name, background=background
                )
                order.append(name)

            tg.start_soon(
                run_job, p, FAKE, {"name": "first", "action": "hold", "until": str(release)}, "first"
            )
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            for i in range(3):
                tg.start_soon(run, f"warmup{i}", True)
            await until(lambda: p.stats()["jobs"]["queued"] == 3)
            tg.start_soon(run, "urgent", False)
            await until(lambda: p.stats()["jobs"]["queued"] == 4)
            release.touch()
    assert order[0] == "urgent" and sorted(order[1:]) == ["warmup0", "warmup1", "warmup2"]


async def test_leaving_the_pool_stops_every_worker_even_mid_compile(cache_dir: Path) -> None:
    outcome: list[BaseException] = []
    with anyio.fail_after(30):  # leaving does not wait for the 600 s compile to end
        async with pool(cache_dir, workers=2) as p:
            await p.wait_ready()
            pids = worker_pids()
            assert len(pids) == 2

            async def stuck() -> None:
                try:
                    await run_job(p, FAKE, {"name": "hang", "action": "sleep", "seconds": 600}, "hang")
                except BaseException as exc:
                    outcome.append(exc)
                    raise

            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck)
                await until(lambda: p.stats()["jobs"]["running"] == 1)
                tg.cancel_scope.cancel()
    assert len(outcome) == 1
    assert all(gone(pid) for pid in pids)


async def test_an_exception_in_the_body_still_stops_the_workers(cache_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="user code failed"):
        async with pool(cache_dir, workers=2) as p:
            await p.wait_ready()
            raise RuntimeError("user code failed")
    # the autouse fixture checks the process table


async def test_cancelling_the_task_that_owns_the_pool_stops_the_workers(cache_dir: Path) -> None:
    pools: list[acompile.CompilePool] = []
    async with anyio.create_task_group() as tg:

        async def owner() -> None:
            async with pool(cache_dir, workers=2) as p:
                pools.append(p)
                await run_job(p, FAKE, {"name": "hang", "action": "sleep", "seconds": 600}, "hang")

        tg.start_soon(owner)
        await until(lambda: pools and pools[0].stats()["jobs"]["running"] == 1)
        tg.cancel_scope.cancel()
    # the autouse fixture checks the process table


async def test_a_pool_is_used_inside_async_with_and_entered_once(cache_dir: Path) -> None:
    p = pool(cache_dir, workers=1)
    with pytest.raises(acompile.PoolClosedError, match="async with"):
        await run_job(p, FAKE, {"name": "e", "action": "echo"}, "e")
    async with p:
        pass
    with pytest.raises(acompile.PoolClosedError, match="shut down"):
        await run_job(p, FAKE, {"name": "e", "action": "echo"}, "e")
    with pytest.raises(acompile.PoolClosedError, match="entered once"):
        async with p:
            pass


async def test_a_worker_that_cannot_start_is_reported(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A preload that fails: the worker cannot import its backend because PYTHONPATH
    # shadows acompile with a broken package.
    broken = cache_dir.parent / "shadow"
    (broken / "acompile").mkdir(parents=True)
    (broken / "acompile" / "__init__.py").write_text("raise ImportError('shadowed acompile for the test')\n")
    monkeypatch.setattr(sys, "executable", sys.executable)
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
        local_executor(p).config["preload"] = ["module_that_does_not_exist_anywhere"]
        with anyio.fail_after(30):
            with pytest.raises(acompile.WorkerStartError, match="module_that_does_not_exist_anywhere"):
                await p.wait_ready()
            with pytest.raises(acompile.WorkerStartError):
                await run_job(p, FAKE, {"name": "e", "action": "echo"}, "e")


async def test_bad_pool_arguments_are_rejected_up_front(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match="workers"):
        acompile.CompilePool(0, target="cuda:90", cache_dir=cache_dir)
    with pytest.raises(acompile.UnknownTargetError, match="cuda:90"):
        acompile.CompilePool(1, target="cuda90", cache_dir=cache_dir)
    with pytest.raises(ValueError, match="preload"):
        acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=("fortran",))
    for nice in ("low", -1, 20, True):
        with pytest.raises(ValueError, match="worker_nice"):
            acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, worker_nice=nice)  # type: ignore[arg-type]


async def test_job_cancelled_is_internal() -> None:
    assert issubclass(JobCancelled, acompile.AcompileError)


async def test_workers_run_below_the_parent_priority(cache_dir: Path) -> None:
    # The default: nice +5 (a third of a nice-0 task's share: the loop goes first, and compiles
    # still progress on a busy machine), inherited by what workers start (forked workers,
    # compilers). It was SCHED_IDLE, which a busy host starved.
    async with pool(cache_dir, workers=1) as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert psutil.Process(pid).nice() == min(19, psutil.Process().nice() + 5)
    # SCHED_IDLE is there to be asked for.
    async with pool(cache_dir, workers=1, worker_nice="idle") as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    async with pool(cache_dir, workers=1, worker_nice=5) as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert psutil.Process(pid).nice() == psutil.Process().nice() + 5
    async with pool(cache_dir, workers=1, worker_nice=0) as p:
        pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
        assert psutil.Process(pid).nice() == psutil.Process().nice()


async def test_pool_processes_stay_in_the_callers_session_each_a_process_group_of_its_own(
    cache_dir: Path,
) -> None:
    """A session of their own would be a scheduling group of its own where the kernel groups
    sessions (autogroup): it would compete with the caller's event loop as an equal whatever the
    workers' policy (the 2-core storm's loop lag p99 was 3.5 ms so, 0.9 ms in the caller's
    session). A process group of their own: stopping one stops its compilers, and a terminal's
    Ctrl-C (sent to the caller's group) is the caller's to handle."""
    async with pool(cache_dir, workers=2) as p:
        pids = {await run_job(p, FAKE, {"name": f"p{i}", "action": "pid"}, f"p{i}") for i in range(4)}
        await p.wait_ready()  # a worker forked a moment ago joins its own group as it starts
        pids.update(worker_pids(), template_pids())
        assert len(pids) >= 3, pids  # two workers and the template, at least
        for pid in pids:
            assert os.getsid(pid) == os.getsid(0), pid
            assert os.getpgid(pid) == pid and pid != os.getpgid(0), pid


def test_families_and_cpu_waits_cover_each_process_and_everything_under_it() -> None:
    """The starvation guard samples every pool process and what it started (compilers, forked
    workers) from one pass over the process table: each pid's family is it and its
    descendants, nobody else's, and a pid that is gone has none."""
    from acompile._workers._process import cpu_waits, families

    # Two trees: a shell with a busy child and a sleeping one, and a lone sleeper.
    tree = psutil.Popen(["sh", "-c", f"{sys.executable} -c 'while True: pass' & sleep 30 & wait"])
    lone = psutil.Popen(["sleep", "30"])
    gone = psutil.Popen(["true"])
    gone.wait()
    try:
        deadline = time.monotonic() + 10
        while len(tree.children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        below = {child.pid for child in tree.children(recursive=True)}
        assert len(below) == 2
        time.sleep(0.3)  # the busy child runs
        tree_family, lone_family, gone_family = families([tree.pid, lone.pid, gone.pid])
        assert tree_family[0] == tree.pid and set(tree_family) == {tree.pid, *below}
        assert lone_family == [lone.pid]
        assert gone_family == []
        samples, together = cpu_waits([tree.pid, lone.pid, gone.pid])
        (tree_ran, _), (lone_ran, _), (gone_ran, gone_waited) = samples
        assert tree_ran > 0.1e9 > lone_ran  # the busy child's CPU time counts for its tree
        assert (gone_ran, gone_waited) == (0, 0)
        assert together == tree_ran + lone_ran  # from the same reads
        # Families that overlap (a tree and a process in it) count each process once together.
        busy = max(below, key=lambda pid: psutil.Process(pid).cpu_times().user)
        (tree_ran, _), (busy_ran, _) = (overlap := cpu_waits([tree.pid, busy]))[0]
        assert busy_ran > 0.1e9 and overlap[1] < tree_ran + busy_ran and overlap[1] >= tree_ran
    finally:
        for process in [*tree.children(recursive=True), tree, lone]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for process in (tree, lone):
            process.wait()


def test_a_process_table_read_while_pids_were_reused_is_walked_once() -> None:
    """A pid reused while the table was read can make its parent map a cycle (A's parent B, B's
    A): each family is still finite, every pid in it once. (In a process of its own: walked
    without end, it would fill memory, not fail.)"""
    code = textwrap.dedent("""
        from acompile._workers import _process
        _process._parent_map = lambda: {100: 200, 200: 100, 300: 100}
        print(sorted(_process.families([100])[0]))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the walk of a parent map with a cycle never ended")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[100, 200, 300]"


@pytest.mark.parametrize("runner", ["anyio.run(main)", "asyncio.run(main())"])
def test_a_pool_imports_nothing_once_acompile_is_imported(runner: str) -> None:
    """Whatever a pool needs is imported with acompile, never on the caller's event loop as the
    pool starts: anyio imports its subprocess module on first use (~5 ms of the loop), and its
    asyncio backend at the first anyio call in a plain asyncio program (~10 ms)."""
    script = (
        "import asyncio, sys, tempfile\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import anyio, acompile\n"
        "from acompile.testing import run_job\n"
        "async def main():\n"
        "    before = set(sys.modules)\n"
        "    async with acompile.CompilePool(1, preload=(), target='cuda:90', cache_dir=tempfile.mkdtemp()) as p:\n"
        "        await run_job(p, 'fake_backend', {'name': 'p', 'action': 'pid'}, 'p')\n"
        "        await asyncio.sleep(0.6)  # the pool's watchers sample its processes\n"
        # Where a GPU driver is and this machine built acompile's launcher, a pool for a CUDA
        # target imports it as it starts, on a thread of its own (see _launcher.load_if_built).
        "    print(sorted(set(sys.modules) - before - {'acompile._launch'}))\n"
        f"{runner}\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_idle_policy_worker_polls_briefly_for_its_next_job_and_one_at_normal_policy_does_not() -> None:
    """A job sent to a sleeping worker waits for it to wake, and one under SCHED_IDLE wakes
    late: such a worker polls its socket for _POLL_SECONDS after each job (on CPU time nothing
    else wanted) before it sleeps. A worker at a normal policy must not (its polling would take
    CPU from the caller's event loop), nor one that has a job waiting already."""
    code = textwrap.dedent("""
        import os, socket, time
        from acompile._workers import _main
        a, b = socket.socketpair()
        def waited(fd):
            t, c = time.perf_counter(), time.thread_time()
            _main._await_next_job(fd)
            return time.perf_counter() - t, time.thread_time() - c
        waited(a.fileno())  # its first call's page faults are no poll's
        normal = waited(a.fileno())
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        idle = waited(a.fileno())
        b.send(b"x")
        ready = waited(a.fileno())
        print(*normal, *idle, *ready, _main._POLL_SECONDS)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    _, normal_cpu, idle_wall, _, _, ready_cpu, poll = map(float, out.stdout.split())
    assert idle_wall >= poll  # nothing came: it polled to the end (wall time: load cannot shorten it)
    # CPU time, which load does not lengthen: next to nothing at a normal policy, or with a job.
    assert normal_cpu < 0.25 * poll and ready_cpu < 0.25 * poll


@pytest.mark.parametrize("nice", [0, "idle"])
async def test_a_preload_that_holds_a_thousand_descriptors_does_not_stop_the_pool(
    tmp_path: Path, nice: int | str
) -> None:
    """The template and its forked workers wait on descriptors numbered past 1023 then (the
    template's wake-up pipe, a worker's socket): with select() the template failed at every
    start and no job ran."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("needs a descriptor limit of 2048")
    workers = WorkerPool(1, WorkerSettings(preload=("many_fds_backend",), nice=nice), str(tmp_path))
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        workers.wakeup()
        with anyio.fail_after(60):
            pids = {await workers.run(Job("many_fds_backend", {}, f"j{i}")) for i in range(3)}
        stats = workers.stats()["workers"]
        tg.cancel_scope.cancel()
    assert len(pids) == 1  # one worker ran all three: nothing crashed or was restarted
    assert stats["forked"] == 1 and not stats["restarts"], stats


def _others_busy_cpus(seconds: float) -> float:
    """How many CPUs processes other than this one and its children kept busy, on average, over
    ``seconds`` (blocking)."""
    import time

    import psutil

    def busy() -> tuple[float, float]:
        total = psutil.cpu_times()
        ours = 0.0
        for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                times = proc.cpu_times()
                ours += times.user + times.system
            except psutil.Error:
                pass
        return total.user + total.system + total.nice, ours

    (all_before, ours_before), started = busy(), time.monotonic()
    time.sleep(seconds)
    all_after, ours_after = busy()
    return max(0.0, (all_after - all_before) - (ours_after - ours_before)) / (time.monotonic() - started)


# asyncio only, as the next test: the subject is the workers' CPU priority, which the pool sets
# from the process table whatever loop it runs on.
@asyncio_only
async def test_more_idle_workers_than_cpus_busy_with_their_own_jobs_are_not_starved(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Six workers per CPU, each compiling: each waits for a CPU most of the time, behind the
    others, with nothing else running. That is not starvation (the pool has every CPU), and the
    workers stay under SCHED_IDLE instead of moving to nice +5 and competing with the loop."""
    from acompile._sizing import usable_cpus

    if usable_cpus() > 4:
        pytest.skip("six workers per CPU: for small machines")
    if _others_busy_cpus(1.0) > 0.25 * usable_cpus():
        # Then the pool rightly sees its workers starved by other work, and moves them to +5.
        pytest.skip("other processes keep this machine's CPUs busy: the test needs them to itself")
    workers = 6 * usable_cpus()
    async with pool(cache_dir, workers=workers, worker_nice="idle") as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(run_job, p, FAKE, {"name": f"b{i}", "action": "burn", "cpu_s": 0.8}, f"b{i}")
        pids = worker_pids()
        assert pids and all(os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in pids)
    assert "running them at nice +5" not in caplog.text


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


# asyncio only: what is shown is the kernel's scheduling of the workers (SCHED_IDLE, then nice
# +5), not the loop; each run takes 6-15 s behind busy loops on 2 cores.
@asyncio_only
async def test_idle_workers_that_other_work_starves_get_a_share_and_their_jobs_run(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two busy loops at normal priority on every CPU, in one cpu cgroup with this process (as
    in a container: the kernel then does not group sessions apart, so SCHED_IDLE workers get
    only scraps of CPU; a 0.3 s computation under SCHED_IDLE took 12 s there). The pool sees
    its processes wait for a CPU and moves them, and the workers forked later, to nice +5: a
    job that needs CPU runs. Whether the template is still preloading when that happens or its
    worker is already burning the job's CPU depends on how fast the preload is; either way the
    job ends and its worker runs at nice +5."""
    group = CPU_CGROUP / f"acompile-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        pytest.skip("needs a cgroup v1 cpu controller it may write to")
    root_procs = CPU_CGROUP / "cgroup.procs"
    loops: list[psutil.Popen] = []
    try:
        (group / "cgroup.procs").write_text(str(os.getpid()))  # children join it too
        loops = [psutil.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        # Preloading Triton takes about a second of CPU: under SCHED_IDLE here, several minutes
        # (a share of about 3/1024 of a CPU). At nice +5, behind the loops, it took 5-10 s, and
        # once more than 30 s in a CI run (everything in this process is slowed by the loops too).
        async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, worker_nice="idle") as p:
            with anyio.fail_after(90):
                await run_job(p, FAKE, {"name": "b", "action": "burn", "cpu_s": 0.5}, "b")
                pid = await run_job(p, FAKE, {"name": "p", "action": "pid"}, "p")
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
            assert psutil.Process(pid).nice() == psutil.Process().nice() + 5
        assert "running them at nice +5" in caplog.text
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        root_procs.write_text(str(os.getpid()))
        group.rmdir()


async def _connection_pair() -> tuple[object, socket.socket]:
    """A forked worker's connection, as the pool holds it, and the worker's end of it."""
    from acompile._workers._template import WorkerConnection

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.get_running_loop()
    _, connection = await loop.create_unix_connection(WorkerConnection, sock=ours)
    return connection, theirs


async def test_a_worker_connection_hands_replies_to_its_handler_in_order_and_the_rest_to_receive() -> None:
    from acompile._workers import encode_frame as encode

    connection, worker = await _connection_pair()
    try:
        worker.sendall(encode("hello"))
        with anyio.fail_after(5):
            assert await connection.receive() == "hello"  # no handler yet: receive() gets it
        taken: list[int] = []

        def handler(message: object) -> bool:
            if isinstance(message, int) and message % 2 == 0:
                taken.append(message)
                return True
            return False

        connection.answer_with(handler)
        # 3 is declined: 4, behind it in the same read, must wait behind it, not overtake it.
        worker.sendall(encode(2) + encode(3) + encode(4))
        with anyio.fail_after(5):
            assert await connection.receive() == 3
            assert await connection.receive() == 4
        assert taken == [2]
        worker.sendall(encode(6))
        await until(lambda: taken == [2, 6], seconds=5)
        # A big message is not decoded on the loop: it goes to receive(), which decodes it on a thread.
        big = [8] * 100_000
        worker.sendall(encode(big))
        with anyio.fail_after(5):
            assert await connection.receive() == big
        assert taken == [2, 6]
        # The worker's end closing inside a frame, then the end itself.
        worker.sendall(encode(10)[:5])
        worker.close()
        with anyio.fail_after(5), pytest.raises(anyio.IncompleteRead):
            await connection.receive()
        with pytest.raises(anyio.IncompleteRead):
            await connection.receive()  # and again: the end stays
    finally:
        worker.close()
        await connection.aclose()


async def test_a_worker_connection_out_of_sync_breaks_and_a_clean_close_ends() -> None:
    from acompile._workers import Undecodable

    connection, worker = await _connection_pair()
    worker.sendall(b"\xff" * 8)  # a header announcing an impossible length
    with anyio.fail_after(5):
        said = await connection.receive()
    assert isinstance(said, Undecodable) and "out of sync" in said.error
    with pytest.raises(anyio.BrokenResourceError):
        await connection.receive()
    worker.close()
    await connection.aclose()
    connection, worker = await _connection_pair()
    worker.close()
    with anyio.fail_after(5), pytest.raises(anyio.EndOfStream):
        await connection.receive()
    with pytest.raises(anyio.BrokenResourceError):
        connection.send_nowait(b"x")
    await connection.aclose()


def test_every_message_reads_back_as_it_was_sent_whole_or_in_pieces() -> None:
    from acompile._workers import _protocol as wire

    messages = [
        {"target": "cuda:90", "preload": ["x"]},
        wire.RunJob(7, "fake_backend", {"name": "k", "value": (1, 2)}),
        wire.Done(7, (b"\x00" * 100, "asm")),
        wire.Done(8, ("a", "tuple", "result")),
        wire.Error(9, acompile.CompileError("broken", kernel="k", backend="fake", log="line 1")),
        wire.Ready(pid=1, preload_s=0.5, threads=1, forked=True),
        wire.Exit(),
        wire.Hello(0, 1, "token"),
    ]
    frames = b"".join(wire.encode(m) for m in messages)

    def same(got: object, sent: object) -> bool:
        if isinstance(sent, wire.Error):
            return type(got) is wire.Error and got.id == sent.id and str(got.error) == str(sent.error)
        return type(got) is type(sent) and got == sent

    # The pool's side, one frame at a time and from any cut of the stream.
    for cut in (1, 3, 8, 9, 50, len(frames)):
        reader = wire.FrameReader()
        got: list[object] = []
        for at in range(0, len(frames), cut):
            reader.feed(frames[at : at + cut])
            while (message := reader.next()) is not None:
                got.append(message)
        assert len(got) == len(messages) and all(map(same, got, messages)), cut
    # The worker's side: pieces as they come (a header split, a body split), and never a byte
    # past its frame, so the next frame is there for the next read.
    ours, theirs = socket.socketpair()
    try:
        pieces = [frames[:3], frames[3:20], frames[20:21], frames[21:]]

        def write_slowly() -> None:
            for piece in pieces:
                theirs.sendall(piece)
                time.sleep(0.02)
            theirs.shutdown(socket.SHUT_WR)

        import threading

        writer = threading.Thread(target=write_slowly)
        writer.start()
        got = [wire.read_message(ours.fileno()) for _ in messages]
        writer.join()
        assert all(map(same, got, messages))
        assert wire.read_message(ours.fileno()) is None  # the end, between frames
    finally:
        ours.close()
        theirs.close()
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(wire.encode(wire.Exit())[:5])
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            wire.read_message(ours.fileno())  # the end inside a frame
    finally:
        ours.close()
        theirs.close()


class _OneWorkerHere:
    """An executor spec of the test's own, as a user would write one: this machine's workers,
    one of them, and a note of what its open() was handed."""

    def __init__(self) -> None:
        self.opened: list[WorkerSettings] = []

    async def open(self, settings: WorkerSettings, opening: Any) -> Any:
        self.opened.append(settings)
        return opening.local_workers(settings, 1)


async def test_an_executor_spec_handed_in_runs_the_pools_jobs_with_its_settings_whole(tmp_path: Path) -> None:
    """``CompilePool(workers=spec)``: the pool opens the spec once as it is entered, hands it
    every worker setting as one checked value, and runs its jobs on what the spec opened."""
    spec = _OneWorkerHere()
    pool = acompile.CompilePool(
        spec,
        target="cuda:90",
        cache_dir=tmp_path,
        preload=(),
        worker_nice=3,
        memory_limit="1GiB",
        max_compile_seconds=7,
        preload_timeout=30,
        idle_timeout=90,
        fork_workers=False,
    )
    assert pool.workers is spec and not spec.opened  # nothing opens before the entry
    async with pool as p:
        pids = {await run_job(p, FAKE, {"name": f"j{i}", "action": "pid"}, f"j{i}") for i in range(3)}
        assert len(pids) == 1  # the spec's one worker ran them all
        assert p.stats()["workers"]["size"] == 1 and p.stats()["jobs"]["done"] == 3
    assert spec.opened == [
        WorkerSettings(
            target="cuda:90",
            backends=(),
            preload=(),
            nice=3,
            memory_limit=1 << 30,
            max_compile_seconds=7.0,
            preload_timeout=30.0,
            idle_timeout=90.0,
            fork_workers=False,
        )
    ]
    assert (
        not psutil.pid_exists(next(iter(pids)))
        or psutil.Process(next(iter(pids))).status() == psutil.STATUS_ZOMBIE
    )


async def test_two_local_pools_of_one_pool_keep_their_workers_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``Split(1, 1)``: two local pools in one pool, each with its template and its worker
    files in a folder of its own (in one folder, the second template's socket was taken by
    the first's, and one worker's stderr file was read for the other's crash)."""
    caplog.set_level("WARNING", logger="acompile")
    async with acompile.CompilePool(
        acompile.Split(1, 1), target="cuda:90", cache_dir=tmp_path, preload=(), fork_workers=True
    ) as p:
        urgent = await run_job(p, FAKE, {"name": "u", "action": "pid"}, "u")
        background = await run_job(p, FAKE, {"name": "b", "action": "pid"}, "b", background=True)
        assert urgent != background
        assert p.stats()["workers"]["forked"] == 2  # each from its own template
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")], caplog.text


class _OpensNothing:
    """A spec whose open returns no executor (a user's slip)."""

    async def open(self, settings: WorkerSettings, opening: Any) -> Any:
        self.workdir = opening.workdir
        return None


class _StopsServing:
    """A spec whose executor's serve() returns at once (a user's executor that ends)."""

    async def open(self, settings: WorkerSettings, opening: Any) -> Any:
        workers = opening.local_workers(settings, 1)

        class Ends:
            def __getattr__(self, name: str) -> Any:
                return getattr(workers, name)

            async def serve(self) -> None:
                return None

        return Ends()


async def test_a_spec_that_opens_no_executor_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    spec = _OpensNothing()
    with (
        anyio.fail_after(20),
        pytest.raises(TypeError, match=r"_OpensNothing.*\.open\(\) returned None, not an executor"),
    ):
        async with acompile.CompilePool(spec, target="cuda:90", cache_dir=tmp_path, preload=()):
            pass
    assert not Path(spec.workdir).exists()  # noqa: ASYNC240 (the pool's work folder went with it)
    with pytest.raises(TypeError, match=r"\.open\(\) returned None"):  # inside a split too
        async with acompile.CompilePool(
            acompile.Split(1, _OpensNothing()), target="cuda:90", cache_dir=tmp_path
        ):
            pass


async def test_an_executor_that_stops_serving_closes_the_pool_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Requests would have waited for ever on an executor nobody serves.
    async with acompile.CompilePool(_StopsServing(), target="cuda:90", cache_dir=tmp_path, preload=()) as p:
        await anyio.sleep(0.1)
        assert p.stats()["state"] == "closed"
        with pytest.raises(acompile.PoolClosedError):
            await run_job(p, FAKE, {"name": "x", "action": "pid"}, "x")
    assert "stopped serving; the pool is closed" in caplog.text
