"""torch.compile served by acompile, for real: torch's CPU build, Inductor's C++ backend and its
graph caches, a real redis-server, real pool workers running the C++ compiler.

Each "machine" is a process of its own with empty Inductor caches (``TORCHINDUCTOR_CACHE_DIR``,
and ``TMPDIR`` where its precompiled headers live, unless the test shares a folder of them) and
an empty acompile cache folder: what it finds, it found in the shared tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import ROOT, RedisServer, asyncio_only, json_shared, subprocess_env
from processes import pool_processes, reaped

import acompile
import acompile.testing

pytestmark = pytest.mark.slow
KEY = "k" * 32
MODEL = str(ROOT / "tests" / "torch_model.py")


def machine(root: Path, name: str, *, headers: Path | None = None) -> dict[str, str]:
    """The environment of a fresh machine: its own Inductor caches and precompiled headers
    (``headers``: a folder shared with other machines, to skip building them again)."""
    home = root / name
    tmp = headers if headers is not None else home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
        "TRITON_CACHE_DIR": str(home / "triton"),
        "TMPDIR": str(tmp),
        "ACOMPILE_CACHE_DIR": str(home / "acompile"),
    }


def serve_options(**options: Any) -> dict[str, str]:
    return {"ACOMPILE_TEST_SERVE": json.dumps(json_shared(**options))}


def compile_in(env: dict[str, str], *, plain: bool = False, timeout: float = 300) -> dict[str, Any]:
    """Compile the small model in a fresh process; its report."""
    args = [sys.executable, MODEL, *(["--plain"] if plain else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=subprocess_env(**env))
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def fx(report: dict[str, Any]) -> dict[str, Any]:
    return report["served"]["caches"]["fx-graph"]


@pytest.fixture(scope="module")
def headers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Precompiled headers for the machines of the tests that are not about them: the first
    machine to need them builds them (5 s on 2 cores), the later ones find them. Those that are
    about them make their own: the fleet's (built by its first machine, served to the others),
    a second machine's (none), the machines' that boot together (built as they do)."""
    return tmp_path_factory.mktemp("headers")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, dict[str, Any], Path]]:
    """A shared tier on a real Redis, filled by a first machine's compile: (the server, that
    machine's report, a folder of precompiled headers the later machines may share)."""
    import shutil
    import socket

    if shutil.which("redis-server") is None:
        if os.environ.get("ACOMPILE_REQUIRE_REDIS"):
            pytest.fail("redis-server is required here (ACOMPILE_REQUIRE_REDIS is set) but not installed")
        pytest.skip("redis-server is not installed (CI installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = RedisServer(port)
    server.start()
    root = tmp_path_factory.mktemp("fleet")
    headers = root / "headers"
    try:
        env = machine(root, "first", headers=headers)
        first = compile_in({**env, **serve_options(shared_cache=server.url, signing_key=KEY, workers=2)})
        yield server, first, headers
    finally:
        server.stop()


def test_the_first_machine_compiles_and_publishes_what_it_built(
    fleet: tuple[RedisServer, dict[str, Any], Path],
) -> None:
    _, first, _ = fleet
    assert first["ok"] and first["active"]
    assert first["inductor"].get("fxgraph_cache_miss") == 1
    assert fx(first)["puts"] == 1 and fx(first)["misses"] == 1
    served = first["served"]
    # Its C++ kernels were built where Inductor builds them, in its own threads (their
    # compilers are processes already: the pool's workers would add only a hop and a lower
    # priority), and published.
    assert served["cpp"]["local_builds"] >= 1 and served["cpp"]["builds"] == 0
    # Published: every output built but the precompiled header.
    assert 1 <= served["cpp"]["puts"] <= served["cpp"]["local_builds"]
    assert served["jobs"]["sent"] == 0
    assert served["errors"] == 0
    assert served["pool"]["cache"]["shared_writes"] >= served["cpp"]["puts"] + 1


def test_a_second_machine_is_served_from_the_first_ones_shared_tier(
    fleet: tuple[RedisServer, dict[str, Any], Path], tmp_path: Path
) -> None:
    """Empty local caches everywhere, precompiled headers included: the graph, its AOTAutograd
    entry and every C++ output come from the shared tier; nothing is compiled."""
    server, _, _ = fleet
    second = compile_in(
        {**machine(tmp_path, "second"), **serve_options(shared_cache=server.url, signing_key=KEY)}
    )
    assert second["ok"]
    assert second["inductor"].get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second["inductor"]
    assert second["aot_autograd"].get("autograd_cache_hit") == 1
    assert fx(second)["hits"]["shared"] == 1
    # Nothing compiled: no C++ build on the pool or here, and each output a build asked for
    # (the graph's kernel library at least) came from the shared tier. How many outputs that is
    # depends on the CPU (one vector-ISA probe or two; the precompiled header only where a build
    # needs it), so it is not counted.
    cpp = second["served"]["cpp"]
    assert cpp["builds"] == 0 and cpp["local_builds"] == 0
    assert cpp["hits"]["shared"] >= 1 and sum(cpp["hits"].values()) == cpp["hits"]["shared"]
    assert second["served"]["pool"]["workers"]["started"] == 0 or second["served"]["jobs"]["sent"] == 0


def test_without_a_gpu_serving_starts_no_worker_beside_the_compile(tmp_path: Path, headers: Path) -> None:
    """Without a GPU, torch.compile hands the pool nothing to compile (its C++ builds run in
    Inductor's threads): serve()'s own pool starts no worker to compete with it for the CPU,
    and still serves the graph and the C++ outputs through its tiers. Asked for (wait_ready),
    the workers start."""
    env = {**machine(tmp_path, "cpu", headers=headers), **serve_options(workers=2)}
    report = compile_in({**env, "ACOMPILE_TEST_WAIT": "0"})
    served = report["served"]
    assert report["ok"] and fx(report)["puts"] == 1, served
    assert 1 <= served["cpp"]["puts"] <= served["cpp"]["local_builds"]
    assert served["pool"]["workers"]["started"] == 0, served["pool"]["workers"]
    asked = compile_in({**machine(tmp_path, "asked", headers=headers), **serve_options(workers=2)})
    assert asked["served"]["pool"]["workers"]["started"] == 2, asked["served"]["pool"]["workers"]


def test_forged_and_damaged_shared_entries_are_refused_counted_and_compiled_again(
    fleet: tuple[RedisServer, dict[str, Any], Path], tmp_path: Path
) -> None:
    """The fleet's entries copied to another database, each changed: a signature that does not
    verify (forged), or a verified value whose entry is damaged. Every one is refused and
    counted; the machine compiles what it needs and its outputs are right."""
    server, _, headers = fleet
    import redis

    from acompile._cache import SharedTier

    client: Any = server.client()
    copy = redis.Redis(port=server.port, db=1)
    url = server.url[: -len("/0")] + "/1"

    async def copy_each_changed() -> tuple[int, int]:
        # The fleet's tier, and the copy's, as a holder of the signing key writes them.
        fleet_tier = SharedTier.connect_later(server.url, KEY.encode())
        copy_tier = SharedTier.connect_later(url, KEY.encode())
        forged = damaged = 0
        try:
            await fleet_tier.open()
            await copy_tier.open()
            for i, name in enumerate(sorted(client.keys(f"acompile:{fleet_tier.namespace}:*"))):
                if i % 2:
                    value = client.get(name)
                    copy.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # the signature no longer verifies
                    forged += 1
                else:
                    key = name.decode().rsplit(":", 1)[1]
                    entry = await fleet_tier.get(key)
                    assert entry is not None
                    body = bytearray(entry)
                    body[-1] ^= 1  # signed anew over a damaged entry: only its checksum says so
                    assert await copy_tier.set(key, bytes(body))
                    damaged += 1
        finally:
            await fleet_tier.close()
            await copy_tier.close()
        return forged, damaged

    forged, damaged = anyio.run(copy_each_changed)
    assert forged and damaged
    third = compile_in(
        {**machine(tmp_path, "third", headers=headers), **serve_options(shared_cache=url, signing_key=KEY)}
    )
    assert third["ok"]
    cache = third["served"]["pool"]["cache"]
    assert cache["shared_rejected"] >= 1 and cache["shared_corrupt"] >= 1
    assert third["inductor"].get("fxgraph_cache_miss") == 1  # compiled again, here
    assert fx(third)["hits"]["shared"] == 0


def test_an_unreachable_shared_tier_is_a_miss_and_the_compile_goes_on(tmp_path: Path, headers: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once this is closed
    report = compile_in(
        {
            **machine(tmp_path, "alone", headers=headers),
            **serve_options(shared_cache=f"redis://127.0.0.1:{port}/0", signing_key=KEY),
        }
    )
    assert report["ok"] and report["active"]
    assert fx(report)["misses"] == 1
    assert report["served"]["pool"]["cache"]["shared_errors"] >= 1
    assert "Traceback" not in report["stderr"]


# Four machines: one compiles, and more than one waits for its entry (each machine a torch
# process of its own, with its pool's template: eight cost twice as long on 2 cores, and showed
# no more).
MACHINES = 4


def test_machines_booting_together_on_an_empty_shared_tier_compile_the_graph_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = serve_options(shared_cache=redis_server.url, signing_key=KEY, workers=1)
    headers = tmp_path / "headers"
    args = [sys.executable, MODEL]
    processes = [
        subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(**machine(tmp_path, f"m{i}", headers=headers), **env),
        )
        for i in range(MACHINES)
    ]
    reports = []
    with reaped(processes):
        for process in processes:
            out, err = process.communicate(timeout=600)
            assert process.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in reports)
    compiled = sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in reports)
    assert compiled == 1, [r["inductor"] for r in reports]
    assert sum(fx(r)["hits"]["fleet"] + fx(r)["hits"]["shared"] for r in reports) == MACHINES - 1


def test_on_a_torch_it_does_not_serve_it_warns_once_and_leaves_inductor_as_it_was(
    tmp_path: Path, headers: Path
) -> None:
    code = f"""
import warnings, json, sys
import torch
torch.__version__ = "2.99.0"
sys.argv = ["torch_model"]
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch_model
from acompile import inductor
from torch._inductor import remote_cache
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with inductor.serve(cache_dir={str(tmp_path / "ac")!r}) as first:
        report = torch_model.run()
        untouched = remote_cache.RemoteFxGraphCache.backend_override_cls is None
    with inductor.serve(cache_dir={str(tmp_path / "ac")!r}) as second:
        pass
warned = [str(w.message) for w in caught if issubclass(w.category, inductor.UnsupportedTorchWarning)]
print(json.dumps({{"ok": report["ok"], "active": [first.active, second.active], "warned": warned, "untouched": untouched, "pool": first.pool is None}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(**machine(tmp_path, "old", headers=headers)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["active"] == [False, False] and report["untouched"] and report["pool"]
    assert len(report["warned"]) == 1 and "2.99.0" in report["warned"][0], report["warned"]


@pytest.mark.anyio
async def test_serve_says_what_is_wrong_with_its_arguments(cache_dir: Path) -> None:
    from acompile import inductor

    with pytest.raises(TypeError, match="running CompilePool"):
        inductor.serve("redis://127.0.0.1:1/0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"serve\(\): .*wrokers"):
        inductor.serve(wrokers=2)
    with pytest.raises(TypeError, match="host_pool must be True or False, got 'yes'"):
        inductor.serve(host_pool="yes")  # type: ignore[arg-type]
    async with acompile.CompilePool(1, cache_dir=cache_dir, preload=("inductor",), prestart=False) as pool:
        with pytest.raises(TypeError, match="host_pool applies to serve's own pool"):
            inductor.serve(pool, host_pool=True)
        with pytest.raises(TypeError, match="takes no pool options"):
            inductor.serve(pool, workers=2)


def test_a_shared_tier_without_a_signing_key_is_refused_unless_the_user_says_it_is_unsafe(
    tmp_path: Path,
) -> None:
    import acompile
    from acompile import inductor

    with pytest.raises(ValueError, match="signing_key"):
        inductor.serve(shared_cache="redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="unsafe_trust_unsigned=True"):
        inductor.serve(shared_cache=acompile.SharedCache("redis://127.0.0.1:1/0"))
    # The user's own choice: allowed, and said in its name.
    inductor.serve(shared_cache=acompile.SharedCache("redis://127.0.0.1:1/0", unsafe_trust_unsigned=True))
    # The name it had before SharedCache: the same, and a warning naming the new form (one
    # release, then gone).
    with pytest.warns(DeprecationWarning, match=r"SharedCache\(url, unsafe_trust_unsigned=True\)"):
        inductor.serve(shared_cache="redis://127.0.0.1:1/0", unsafe_unsigned_shared_cache=True)
    with pytest.raises(TypeError, match="unsafe_unsigned_shared_cache must be True or False"):
        inductor.serve(shared_cache="redis://127.0.0.1:1/0", unsafe_unsigned_shared_cache="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="an unsigned tier is trusted or not"):
        inductor.serve(
            shared_cache="redis://127.0.0.1:1/0",
            unsafe_unsigned_shared_cache=True,
            unsafe_unsigned_host_code=False,
        )
    with pytest.raises(TypeError, match="give unsafe_trust_unsigned=True to the SharedCache"):
        inductor.serve(
            shared_cache=acompile.SharedCache("redis://127.0.0.1:1/0"),
            unsafe_unsigned_shared_cache=True,
        )


def test_compile_pools_arguments_from_before_shared_cache_still_work_and_name_the_new_form(
    tmp_path: Path,
) -> None:
    import acompile

    with pytest.warns(DeprecationWarning, match=r"SharedCache\(url, signing_key=\.\.\., fleet_wait=\.\.\.\)"):
        pool = acompile.CompilePool(
            1, target="cuda:90", cache_dir=tmp_path, shared_cache="redis://127.0.0.1:1/0",
            signing_key=KEY, fleet_wait=5,
        )  # fmt: skip
    assert pool.shared_cache is not None and pool.shared_cache.signed and pool.shared_cache.fleet_wait == 5.0
    with pytest.warns(
        DeprecationWarning, match=r"SharedCache\(url, unsafe_trust_unsigned=\.\.\.\) \(.*torch"
    ):
        pool = acompile.CompilePool(
            1, target="cuda:90", cache_dir=tmp_path, shared_cache="redis://127.0.0.1:1/0",
            unsafe_unsigned_host_code=True,
        )  # fmt: skip
    assert pool.shared_cache is not None and pool.shared_cache.trusted and not pool.shared_cache.signed


def test_a_stall_of_the_shared_tier_during_a_served_compile_fails_nothing(
    fleet: tuple[RedisServer, dict[str, Any], Path], tmp_path: Path
) -> None:
    """The Redis server stopped (SIGSTOP) for a second as the compile begins: reads in that
    second are misses, the compile goes on."""
    server, _, headers = fleet
    assert server.process is not None
    env = {
        **machine(tmp_path, "stalled", headers=headers),
        **serve_options(shared_cache=server.url, signing_key=KEY),
    }
    process = subprocess.Popen(
        [sys.executable, MODEL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**env),
    )
    with reaped([process]):
        time.sleep(0.5)  # the process imports torch (seconds): the stall covers its first reads
        server.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.0)
        finally:
            server.process.send_signal(signal.SIGCONT)
        out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"]


# -- in this process: a pool an async program owns --------------------------------------------------


@pytest.fixture
def fresh_inductor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inductor's caches, on disk and in memory, empty for this test."""
    import torch
    from torch._inductor.utils import fresh_cache

    folder = tmp_path / "inductor"
    folder.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    torch._dynamo.reset()
    with fresh_cache(dir=str(folder)):
        yield
    torch._dynamo.reset()


_widths = iter(range(40, 1000))


def compile_here() -> bool:
    """torch.compile of a graph this process has not compiled yet (in this thread)."""
    import torch_model

    return bool(torch_model.run(next(_widths))["ok"])


@pytest.mark.anyio
async def test_an_async_program_serves_torch_compile_through_its_own_pool_and_quiesces_it(
    cache_dir: Path, fresh_inductor: None, tmp_path: Path
) -> None:
    """The pool of an async server serves torch.compile run off its loop: the graph and the C++
    outputs go through the pool's tiers, the C++ builds run in Inductor's own threads (no job
    for the workers, none in the trace), and a quiesce leaves no worker running."""
    from acompile import inductor

    trace = tmp_path / "trace.json"
    async with acompile.CompilePool(2, cache_dir=cache_dir, preload=("inductor",), trace=trace) as pool:
        await pool.wait_ready()
        async with inductor.serve(pool) as serving:
            assert await anyio.to_thread.run_sync(compile_here)
            stats = await anyio.to_thread.run_sync(serving.stats)
        assert stats["cpp"]["local_builds"] >= 1 and stats["cpp"]["builds"] == 0, stats
        assert 1 <= stats["cpp"]["puts"] <= stats["cpp"]["local_builds"], stats
        # Served from its set-up's thread to the compiling one (torch 2.12+ keeps settings made
        # in code per thread): the graph went through the pool's tiers.
        assert stats["caches"]["fx-graph"]["gets"] == 1 and stats["caches"]["fx-graph"]["puts"] == 1
        assert pool.stats()["jobs"]["done"] == 0 and stats["jobs"]["sent"] == 0
        await pool.quiesce()
        await anyio.sleep(0.2)
        assert not [p for p in pool_processes() if "--template" not in " ".join(p.cmdline())]
    spans = [
        e for e in json.loads(trace.read_text())["traceEvents"] if "(torch.compile)" in e.get("name", "")
    ]
    assert spans == []


def stop_host_server(server: Any) -> None:
    """Stop a host pool server a test started (it would stop a minute after its last process
    left), and its workers with it."""
    import psutil

    if server is not None and server.is_running():
        children = server.children(recursive=True)
        server.terminate()
        server.wait(30)
        psutil.wait_procs(children, timeout=10)


@asyncio_only
@pytest.mark.anyio
async def test_a_pool_on_the_hosts_pool_runs_its_jobs_there_and_leaves_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``CompilePool(workers=HostPool(1))``: the pool's jobs run on the host's server, counted
    in the pool's stats, and leaving it closes the link (no error), removes the pool's work
    folder and leaves the server to the host (it ends on its own, idle)."""
    import tempfile

    import psutil

    from acompile._torch import HostPool, HostPoolExecutor

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    caplog.set_level("WARNING", logger="acompile")
    pool = acompile.CompilePool(
        HostPool(1), cache_dir=tmp_path / "cache", preload=("inductor",), prestart=False
    )
    server = None
    try:
        async with pool:
            executor = pool.executor
            assert isinstance(executor, HostPoolExecutor)
            server = psutil.Process(executor.server_pid)
            with anyio.fail_after(120):
                await pool.wait_ready()
            assert list((tmp_path / "tmp").glob("acompile-*"))  # the pool's work folder, while it runs
            with pytest.raises(acompile.CompileError, match="runs no jobs of 'fake_backend'"):
                await acompile.testing.run_job(pool, "fake_backend", {"name": "x", "action": "pid"}, "x")
            assert pool.stats()["jobs"]["failed"] == 1  # the pool's own stats saw it
        assert not list((tmp_path / "tmp").glob("acompile-*"))
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        assert server.is_running()  # the host's, not the pool's
    finally:
        stop_host_server(server)


# asyncio only: a worker killed under its job, and the retry, are shown on both loops in
# test_faults.py; here it is what torch.compile sees of it (6 s of compiling in each run). C++
# builds go to workers where the pool is the host's (elsewhere they run in Inductor's threads).
@asyncio_only
@pytest.mark.anyio
async def test_a_worker_killed_while_it_builds_a_kernel_costs_a_retry_not_the_compile(
    tmp_path: Path, fresh_inductor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of the host's pool SIGKILLed while its C++ compiler runs: that build is retried
    on a fresh worker, torch.compile never knows (Inductor's own pool fails every kernel in
    flight)."""
    import tempfile

    import psutil

    from acompile import inductor
    from acompile._torch import HostPool

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    killed: list[int] = []

    def kill_a_building_worker(server: psutil.Process) -> None:
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for proc in server.children(recursive=True):
                try:
                    if any("cc1plus" in c.name() for c in proc.children(recursive=True)):
                        proc.kill()
                        killed.append(proc.pid)
                        return
                except psutil.Error:
                    pass
            time.sleep(0.01)

    pool = acompile.CompilePool(
        HostPool(2), cache_dir=tmp_path / "cache", preload=("inductor",), prestart=False
    )
    server = None
    try:
        async with pool:
            server = psutil.Process(pool.executor.server_pid)  # type: ignore[attr-defined]
            with anyio.fail_after(120):
                await pool.wait_ready()
            async with inductor.serve(pool) as serving:
                killer = threading.Thread(target=kill_a_building_worker, args=(server,))
                killer.start()
                assert await anyio.to_thread.run_sync(compile_here)
                killer.join()
                stats = await anyio.to_thread.run_sync(serving.stats)
            assert killed, "no worker was seen building"
            assert stats["cpp"]["builds"] >= 1 and stats["cpp"]["local_builds"] == 0, stats
            assert pool.stats()["jobs"]["failed"] == 0
    finally:
        stop_host_server(server)


# -- programs that know nothing of acompile, and a host's ranks ------------------------------------


def test_a_program_that_knows_nothing_of_acompile_is_served_through_acompile_run(
    tmp_path: Path, headers: Path
) -> None:
    """``acompile run -- python script.py``: the script imports torch and compiles, and never
    names acompile; a second run on an empty Inductor cache takes the graph from acompile's."""
    ac = tmp_path / "acompile"
    command = [sys.executable, "-m", "acompile", "run", "--cache-dir", str(ac), "--workers", "2", "--"]
    reports = []
    for name in ("first", "second"):
        env = subprocess_env(**machine(tmp_path, name, headers=headers))
        done = subprocess.run(
            [*command, sys.executable, MODEL, "--plain"], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = reports
    assert first["ok"] and second["ok"]
    assert first["inductor"].get("fxgraph_cache_miss") == 1
    assert second["inductor"].get("fxgraph_cache_hit") == 1  # from acompile's cache: Inductor's was empty
    listing = subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "stats", "--cache-dir", str(ac)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
    ).stdout
    assert "torch:fx-graph" in listing and "torch:cpp" in listing
    # An entry says what it was keyed by: Inductor's own key of the graph.
    key = re.search(r"^\s+([0-9a-f]{16})\s+torch:fx-graph$", listing, re.MULTILINE).group(1)  # type: ignore[union-attr]
    explained = subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "explain", key, "--cache-dir", str(ac)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
    ).stdout
    assert "pt2:fx-graph-v1::" in explained and "predates" not in explained, explained


def test_acompile_run_refuses_what_would_leave_the_program_unserved(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "acompile", "run"]
    env = subprocess_env()
    env.pop("ACOMPILE_SIGNING_KEY", None)
    no_key = subprocess.run(
        [*base, "--shared-cache", "redis://127.0.0.1:1/0", "--", "true"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert no_key.returncode == 2 and "ACOMPILE_SIGNING_KEY" in no_key.stderr
    off = subprocess.run(
        [*base, "--", "true"],
        capture_output=True,
        text=True,
        env=dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
    )
    assert off.returncode == 2 and "TORCH_DEVICE_BACKEND_AUTOLOAD" in off.stderr
    missing = subprocess.run([*base, "--", "no-such-command-here"], capture_output=True, text=True, env=env)
    assert missing.returncode == 127 and "not found" in missing.stderr
    empty = subprocess.run([*base], capture_output=True, text=True, env=env)
    assert empty.returncode == 2
    # A program run by a Python whose environment has no acompile would run unserved.
    bare = Path(sys.base_prefix) / "bin" / "python3"
    # acompile as installed and no more: no PYTHONPATH, not from its own folder.
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    has = subprocess.run([str(bare), "-c", "import acompile"], env=plain, cwd=tmp_path, capture_output=True)
    if bare.exists() and has.returncode:
        other = subprocess.run(
            [*base, "--", str(bare), "-c", "pass"], capture_output=True, text=True, env=plain, cwd=tmp_path
        )
        assert other.returncode == 2 and "no acompile" in other.stderr, other.stderr
        # One with another release of acompile (it may read the options handed to it otherwise).
        dist = tmp_path / "old-site" / "acompile-0.1.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acompile\nVersion: 0.1.0\n")
        (dist / "entry_points.txt").write_text(
            "[torch.backends]\nacompile = acompile._torch._autoload:autoload\n"
        )
        older = subprocess.run(
            [*base, "--", str(bare), "-c", "pass"],
            capture_output=True,
            text=True,
            env=dict(plain, PYTHONPATH=str(dist.parent)),
            cwd=tmp_path,
        )
        assert older.returncode == 2 and "whose acompile is 0.1.0" in older.stderr, older.stderr


def test_the_processes_of_a_host_share_one_pool(tmp_path: Path, headers: Path) -> None:
    """Two served processes (a server's ranks) starting together with host_pool: one pool
    server for the host (started by whichever came first, the other finds it) runs every
    process's compile jobs; none of them starts workers of its own. (Two show it: each more
    is another torch process on 2 cores, and shows the same.)"""
    import psutil

    env = serve_options(host_pool=True, workers=2, cache_dir=str(tmp_path / "acompile"))
    processes = [
        subprocess.Popen(
            [sys.executable, MODEL],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(**machine(tmp_path, f"rank{i}", headers=headers), **env),
        )
        for i in range(2)
    ]
    reports = []
    # A failing rank: the others, and the host's pool (whichever rank started it), end too.
    with reaped(processes, tmp_path):
        try:
            for process in processes:
                out, err = process.communicate(timeout=600)
                assert process.returncode == 0, err[-3000:]
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            servers = {r["served"].get("host_pool", {}).get("pid") for r in reports} - {None}
            for pid in servers:  # it would stop a minute after its last process left
                server = psutil.Process(pid)
                assert "acompile._torch._hostpool" in " ".join(server.cmdline())
                workers = server.children(recursive=True)
                server.terminate()
                server.wait(30)
                psutil.wait_procs(workers, timeout=10)  # they go with it (their parent's death signal)
                assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert all(r["ok"] for r in reports)
    assert len(servers) == 1
    for report in reports:
        assert report["served"]["jobs"]["sent"] >= 1 and report["served"]["jobs"]["run_here"] == 0
        assert report["served"]["pool"]["workers"]["started"] == 0  # its own pool ran none
        # Its jobs went through its pool's queue and stats on their way to the host's pool.
        assert report["served"]["pool"]["jobs"]["done"] == report["served"]["jobs"]["sent"]


# -- warm-up and Mega-Cache artifacts --------------------------------------------------------------


def test_warmup_compiles_a_model_into_the_shared_tier_and_its_artifacts_travel_in_a_bundle(
    redis_server: RedisServer, tmp_path: Path, headers: Path
) -> None:
    """``acompile warmup`` on a ``[[torch]]`` entry fills the shared tier with the model's graph
    (a fresh machine then compiles nothing) and saves its Mega-Cache artifacts, which a signed
    bundle carries to a machine with no shared tier: loaded there, the compile hits."""
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        f'[[torch]]\ncallable = "{ROOT / "tests" / "torch_warm.py"}:warm"\nartifacts = "small"\n'
    )
    signed = {"ACOMPILE_SIGNING_KEY": KEY}
    builder = machine(tmp_path, "builder", headers=headers)
    report_path = tmp_path / "warm.json"
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
            "2",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=subprocess_env(**builder, **signed),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "torch_warm.py:warm: compiled (1 graph, 1 compiled)" in done.stdout, done.stdout
    document = json.loads(report_path.read_text())
    (model,) = document["torch"]
    assert model["artifacts"].get("inductor", 0) >= 1
    assert document["shared"]["torch_missing"] == 0 and document["shared"]["torch_entries"] >= 2

    # A fresh machine on the shared tier: nothing to compile.
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import torch_model, json; print(json.dumps(torch_model.run(width=56)))"
    fresh = machine(tmp_path, "fresh")
    served = subprocess.run(
        [
            sys.executable,
            "-m",
            "acompile",
            "run",
            "--shared-cache",
            redis_server.url,
            "--",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(**fresh, **signed),
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert json.loads(served.stdout.strip().splitlines()[-1])["inductor"].get("fxgraph_cache_hit") == 1

    # The artifacts in a signed bundle, to a machine with no shared tier at all.
    bundle = tmp_path / "model.tar.gz"
    env = subprocess_env(**builder, **signed)
    # Selected by the manifest: its [[torch]] entry brings every torch.compile entry along.
    exported = subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "export", str(bundle), "--manifest", str(manifest)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "exported 0 entries" not in exported.stdout, exported.stdout
    island = machine(tmp_path, "island")
    env = subprocess_env(**island, **signed)
    subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "import", str(bundle)],
        check=True,
        env=env,
        capture_output=True,
    )
    code = f"""
import sys, json; sys.path.insert(0, {str(ROOT / "tests")!r})
import torch_model
from acompile import inductor
with inductor.serve() as serving:
    loaded = inductor.load_artifacts("small")
    missing = inductor.load_artifacts("never-saved")
# Served no more: what hits now is what the artifacts put in Inductor's own caches.
report = torch_model.run(width=56)
print(json.dumps({{"loaded": loaded, "missing": missing, "inductor": report["inductor"], "ok": report["ok"]}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["missing"] is None and result["loaded"].get("inductor", 0) >= 1
    assert result["inductor"].get("fxgraph_cache_hit") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give a folder to another user")
def test_a_served_output_is_never_written_into_a_folder_another_user_owns(tmp_path: Path) -> None:
    """Inductor's default cache folder is in the shared /tmp: another user may have made it (or a
    folder in it) first. A served C++ output is written only into a folder of this user's that
    nobody else may write; elsewhere Inductor builds it as it would without acompile."""
    import pwd

    from acompile._outputs import write_output as _write_output

    nobody = pwd.getpwnam("nobody")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(PermissionError, match="not this user's"):
        _write_output(str(theirs / "kernel.so"), b"\x7fELF...")
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(PermissionError):
        _write_output(str(open_to_all / "kernel.so"), b"\x7fELF...")
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError):
        _write_output(str(linked / "kernel.so"), b"\x7fELF...")
    assert (
        not list(theirs.iterdir())
        and not list(open_to_all.iterdir())
        and not list((tmp_path / "elsewhere").iterdir())
    )
    ours = tmp_path / "ours"
    _write_output(str(ours / "kernel.so"), b"\x7fELF...")
    assert (ours / "kernel.so").read_bytes() == b"\x7fELF..."


@pytest.mark.anyio
async def test_a_large_output_is_published_off_the_compiling_thread_and_a_header_never(
    tmp_path: Path, fresh_inductor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output over a MiB is published from a thread of its own (the build returns before its
    entry is written; ``drain()`` waits for it), and its entry serves a machine that lacks it. A
    precompiled header is never published: it costs its builder a second of CPU to spare
    others a build they would make as Inductor does."""
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    from acompile._torch import _served
    from acompile._torch._served import Served, build_key

    packed_on: list[str] = []
    pack = _served._packed

    def packed(data: bytes, meta: dict[str, Any]) -> Any:
        packed_on.append(threading.current_thread().name)
        return pack(data, meta)

    monkeypatch.setattr(_served, "_packed", packed)
    big = tmp_path / "big.cpp"
    big.write_text('extern "C" { char blob[3 << 20] = {1}; int answer() { return blob[0] + 41; } }\n')
    builder = CppBuilder("big", [str(big)], CppOptions(), str(tmp_path / "out"))
    header = tmp_path / "h.h"
    header.write_text("#include <vector>\n")
    header_builder = CppBuilder(str(header), [str(header)], CppOptions(precompiling=True))
    assert Path(header_builder.get_target_file_path()).suffix == ".gch"
    async with acompile.CompilePool(
        1, cache_dir=tmp_path / "cache", preload=("inductor",), prestart=False
    ) as pool:
        served = Served(pool.torch_host())

        def publish() -> tuple[bool, bool]:
            builder.build()
            header_builder.build()
            served.publish_output([builder])
            served.publish_output([header_builder])
            pending = bool(served._pending)
            served.drain()
            return pending, not [f for f in served._pending if not f.done()]

        pending, drained = await anyio.to_thread.run_sync(publish)
        assert pending and drained
        assert len(packed_on) == 1 and packed_on[0].startswith("acompile-publish"), packed_on
        assert build_key([header_builder]) is None

        def fetched() -> bool:
            target = Path(builder.get_target_file_path())
            whole = target.read_bytes()
            target.unlink()
            return served.fetch_output([builder]) and target.read_bytes() == whole

        assert await anyio.to_thread.run_sync(fetched)
        assert served.counts["cpp_puts"] == 1 and served.counts["errors"] == 0
        served.close()


@pytest.mark.anyio
async def test_serving_that_ends_drops_the_large_outputs_not_yet_being_published(
    tmp_path: Path, fresh_inductor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left without its drain (or past it), the outputs queued behind the one being published
    are dropped, so that the process's exit does not wait for them; after the end nothing new
    is published."""
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    from acompile._torch import _served
    from acompile._torch._served import Served

    started: list[str] = []
    publishing = threading.Event()
    pack = _served._packed

    def slow(data: bytes, meta: dict[str, Any]) -> Any:
        started.append(meta["file"])
        publishing.set()
        time.sleep(1.0)
        return pack(data, meta)

    monkeypatch.setattr(_served, "_packed", slow)
    builders = []
    for i in range(3):
        source = tmp_path / f"big{i}.cpp"
        source.write_text(f'extern "C" {{ char blob{i}[2 << 20] = {{{i + 1}}}; }}\n')
        builders.append(CppBuilder(f"big{i}", [str(source)], CppOptions(), str(tmp_path / "out")))
    async with acompile.CompilePool(
        1, cache_dir=tmp_path / "cache", preload=("inductor",), prestart=False
    ) as pool:
        served = Served(pool.torch_host())

        def publish_then_leave() -> float:
            for builder in builders:
                builder.build()
                served.publish_output([builder])
            assert publishing.wait(30)  # the first is being published
            served.close()
            t0 = time.monotonic()
            served.drain(0)
            served.publish_output([builders[0]])  # after the end: nothing
            late = Served(served.host)  # ended before it published anything
            late.close()
            late.publish_output([builders[1]])
            assert late._publisher is None and not late._pending
            threads = [t for t in threading.enumerate() if t.name.startswith("acompile-publish")]
            for thread in threads:
                thread.join(10)
            return time.monotonic() - t0

        left_in = await anyio.to_thread.run_sync(publish_then_leave)
    assert started == ["big0.so"], started
    assert left_in < 2.0, left_in
    assert served.counts["cpp_puts"] == 1


def test_a_build_killed_part_way_is_built_again_and_never_published(tmp_path: Path) -> None:
    """A compiler writes its output in place: a worker killed while the linker ran leaves the
    start of a library. The retry builds every step anew (it skipped a target that existed, and
    published the stub to every machine), and a stub is never published nor served."""
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    from acompile._outputs import output_problem as _output_problem
    from acompile._torch._served import _worker_build

    source = tmp_path / "k.cpp"
    source.write_text('extern "C" int answer() { return 42; }\n')
    builder = CppBuilder("k", [str(source)], CppOptions(), str(tmp_path))
    target = Path(builder.get_target_file_path())
    _worker_build([builder])
    whole = target.read_bytes()
    assert _output_problem(str(target), whole) is None
    for stub in (b"", whole[:16], whole[: len(whole) // 2]):
        assert _output_problem(str(target), stub) is not None
        target.write_bytes(stub)  # what the killed attempt left
        _worker_build([builder])  # the retry
        assert _output_problem(str(target), target.read_bytes()) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give a folder to another user")
@pytest.mark.anyio
async def test_a_cache_folder_another_user_controls_is_refused_at_entry(tmp_path: Path) -> None:
    """A cache folder's entries hold code the process runs (torch.compile's graphs are pickles
    Inductor loads): one another user made first (in /tmp, say), or may write, is refused with
    the folder and its owner named, never chmod-ed into shape and used."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(acompile.UntrustedFolderError, match=r"belongs to nobody"):
        async with acompile.CompilePool(1, cache_dir=theirs, preload=("inductor",), prestart=False):
            pass
    assert (theirs.stat().st_mode & 0o777) == 0o700 and theirs.stat().st_uid == nobody.pw_uid
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(acompile.UntrustedFolderError, match="may be written by other users"):
        async with acompile.CompilePool(1, cache_dir=open_to_all, preload=("inductor",), prestart=False):
            pass
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "v1").mkdir()
    os.chown(mine / "v1", nobody.pw_uid, nobody.pw_gid)  # its entries folder planted
    with pytest.raises(acompile.UntrustedFolderError, match="entries folder"):
        async with acompile.CompilePool(1, cache_dir=mine, preload=("inductor",), prestart=False):
            pass
    inside_theirs = theirs / "cache"  # nobody may rename it away and put theirs in its place
    inside_theirs.mkdir(mode=0o700)
    with pytest.raises(acompile.UntrustedFolderError, match=r"inside .*theirs, which belongs to nobody"):
        async with acompile.CompilePool(1, cache_dir=inside_theirs, preload=("inductor",), prestart=False):
            pass
    shared = tmp_path / "shared"  # writable by a group, no sticky bit
    shared.mkdir()
    shared.chmod(0o775)
    (shared / "cache").mkdir(mode=0o700)
    with pytest.raises(acompile.UntrustedFolderError, match="no sticky bit"):
        async with acompile.CompilePool(1, cache_dir=shared / "cache", preload=("inductor",), prestart=False):
            pass
    shared.chmod(0o1777)  # as /tmp: only a folder's owner may rename it
    async with acompile.CompilePool(1, cache_dir=shared / "cache", preload=("inductor",), prestart=False):
        pass


def test_a_host_pool_that_does_not_answer_holds_nobody(tmp_path: Path, headers: Path) -> None:
    """The host's pool server stopped (SIGSTOP: its socket still takes connections): a served
    process that starts meanwhile replaces it within seconds (the stopped one is killed, a new
    one started) and compiles there."""
    import psutil

    ac = tmp_path / "acompile"
    # A first served process starts the host's server and leaves (the server stays, for the
    # host's next processes): what it would compile there is not what this test is about.
    start = f"""
import json
from acompile import inductor
with inductor.serve(host_pool=True, workers=2, cache_dir={str(ac)!r}) as serving:
    assert serving.wait_ready(120)
    pid = serving.stats()["host_pool"]["pid"]
print(json.dumps({{"pid": pid}}))
"""
    with reaped([], tmp_path):  # the host's server ends with the test, however it ends
        first = subprocess.run(
            [sys.executable, "-c", start],
            capture_output=True,
            text=True,
            timeout=300,
            env=subprocess_env(**machine(tmp_path, "a", headers=headers)),
        )
        assert first.returncode == 0, first.stderr[-3000:]
        server = psutil.Process(json.loads(first.stdout.strip().splitlines()[-1])["pid"])
        assert "acompile._torch._hostpool" in " ".join(server.cmdline())
        try:
            server.suspend()
            t0 = time.monotonic()
            stopped = compile_in(
                {
                    **machine(tmp_path, "b", headers=headers),
                    **serve_options(host_pool=True, workers=2, cache_dir=str(ac)),
                }
            )
            assert stopped["ok"], stopped
            # Served by a new server: the stopped one was killed, never two at one socket.
            assert stopped["served"]["host_pool"]["pid"] not in (None, server.pid), stopped["served"]
            assert time.monotonic() - t0 < 120
            with contextlib.suppress(psutil.NoSuchProcess):
                assert server.status() == psutil.STATUS_ZOMBIE
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                server.resume()
                server.terminate()
                server.wait(30)


def test_a_host_pool_that_dies_and_cannot_come_back_costs_nothing_but_its_help(
    tmp_path: Path, headers: Path
) -> None:
    """The host's server killed just before a compile, and its folder no longer trusted (so no
    server can start again): the compile finishes on the process's own workers (the local
    fallback), the process's serving goes on (its writes reach its tiers), and the outputs are
    right."""
    ac = tmp_path / "acompile"
    code = f"""
import json, os, signal, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch_model
from acompile import inductor
with inductor.serve(host_pool=True, workers=2, cache_dir={str(ac)!r}) as serving:
    assert serving.wait_ready(120)
    os.chmod({str(ac / "run")!r}, 0o777)  # no server may start there any more
    os.kill(serving.stats()["host_pool"]["pid"], signal.SIGKILL)
    report = torch_model.run()
    stats = serving.stats()
print(json.dumps({{"ok": report["ok"], "jobs": stats["jobs"], "cpp": stats["cpp"], "puts": stats["caches"]["fx-graph"]["puts"], "state": stats["pool"]["state"], "workers": stats["pool"]["workers"]}}))
"""
    env = subprocess_env(**machine(tmp_path, "lost", headers=headers))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    # Its jobs went to workers of its own, started for the fallback, not into its threads.
    assert report["workers"]["started"] >= 1 and report["jobs"]["run_here"] == 0, report
    assert report["puts"] == 1 and report["state"] == "running", report  # serving went on
    assert "unhandled errors" not in done.stderr, done.stderr[-2000:]
