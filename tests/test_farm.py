"""The compile farm against a real Ray cluster on this machine: two nodes of one CPU each.

Nothing is mocked: the cluster is ``ray.cluster_utils.Cluster`` (a GCS and a raylet per node, as
``ray start`` makes them), the farm's workers are Ray actors on those nodes, and the kernels are
compiled by Triton there. Each cluster is shut down by its fixture, whatever the tests did, and
the fixture then checks that none of its processes (GCS, raylets, Ray workers) is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from conftest import ROOT, TARGET, run_python, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel, broken_kernel, scale_add_kernel, slow_to_compile_kernel
from processes import until

import acompile
from acompile._workers import Job

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray_clusters import ray_cluster  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: the farm awaits Ray's object references as asyncio futures, the same on
    uvloop, and one loop's run of these tests is what a 2-core machine's budget allows."""
    return "asyncio"


# The fake backend (jobs that sleep) is imported by the workers on the nodes from the tests folder.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": str(ROOT / "tests")}}
FAKE = "fake_backend"


# The name tests/test_attacks_sockets.py imports; the clusters' helpers live in ray_clusters.py.
_cluster = ray_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    for made, _ in _cluster({"num_cpus": 1}, {"num_cpus": 1}):
        yield made


def _specs(n: int = 6) -> list[acompile.TritonSpec]:
    blocks = [64, 128, 256, 512, 1024, 2048]
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in blocks]
    specs += [acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": b}, num_warps=8) for b in blocks]
    return specs[:n]


async def slow_compile(pool: acompile.CompilePool) -> None:
    """A real Triton compile of tens of seconds (on 2 cores)."""
    await pool.triton(
        slow_to_compile_kernel, signature={"x_ptr": "*fp32", "out_ptr": "*fp32"}, constexprs={"N": 400}
    )


def _direct_children() -> list[str]:
    """The command lines of this process's own children (local workers would be among them;
    the farm's are the raylets' children)."""
    found = []
    for child in psutil.Process().children():
        try:
            found.append(" ".join(child.cmdline()))
        except psutil.Error:
            pass
    return found


def _farm_worker_pids() -> list[int]:
    """The Ray worker processes that host the farm's actors (under this process: the cluster's
    raylets are its children; other pools on the machine are not ours to count)."""
    return [p.pid for p in _descendants() if "ray::FarmWorker" in _cmdline(p)]


def _node_workers() -> set[int]:
    """The acompile workers on the cluster's nodes: forked by the template of a farm actor."""
    found = set()
    for actor in _descendants():
        if "ray::FarmWorker" not in _cmdline(actor):
            continue
        try:
            for template in actor.children():
                found.update(w.pid for w in template.children() if "acompile._workers._main" in _cmdline(w))
        except psutil.Error:
            pass  # gone while we looked
    return found


def _descendants() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if _cmdline(p)]


def _cmdline(proc: psutil.Process) -> str:
    try:
        return "" if proc.status() == psutil.STATUS_ZOMBIE else " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def test_importing_acompile_never_imports_ray() -> None:
    out = run_python(
        "import sys, acompile\n"
        "farm = acompile.RayFarm('auto', workers=2)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_an_unreachable_farm_fails_fast_unless_a_local_fallback_is_asked_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket_listening_nowhere() as address:
        start = time.perf_counter()
        with pytest.raises(acompile.FarmUnreachableError, match=address):
            async with acompile.CompilePool(
                target=TARGET, workers=acompile.RayFarm(address), cache_dir=tmp_path
            ):
                pass
        assert time.perf_counter() - start < 30
        farm = acompile.RayFarm(address, local_fallback=True, connect_timeout=4)
        with caplog.at_level(logging.WARNING, logger="acompile"):
            async with acompile.CompilePool(
                target=TARGET, workers=acompile.Split(1, farm), cache_dir=tmp_path, preload=()
            ) as pool:
                job = Job(FAKE, {"name": "k", "action": "pid"}, "k")
                pid = await pool.executor.run(job)
                # A local worker ran it: a process of ours, not of a cluster.
                assert pid in {p.pid for p in psutil.Process().children(recursive=True)}
    warnings = [r for r in caplog.records if "local_fallback" in r.getMessage()]
    assert len(warnings) == 1 and address in warnings[0].getMessage()
    assert not ray.is_initialized()


class socket_listening_nowhere:
    """An address on this machine where nothing listens (a port bound, never listened on)."""

    def __enter__(self) -> str:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


@pytest.fixture
def mixed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[str]]]:
    """A head without CPUs, a node like this process, and a node whose ptxas is another
    release (a wrapper that reports another version and runs the real one)."""
    from triton import knobs

    real = knobs.nvidia.ptxas.path
    ptxas = tmp_path_factory.mktemp("ptxas") / "ptxas"
    ptxas.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        '  echo "ptxas: NVIDIA (R) Ptx optimizing assembler"\n'
        '  echo "Cuda compilation tools, release 99.9, V99.9.1"\n'
        "  exit 0\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    ptxas.chmod(ptxas.stat().st_mode | stat.S_IEXEC)
    yield from _cluster(
        {"num_cpus": 0},
        {"num_cpus": 1, "resources": {"same": 1}},
        {"num_cpus": 1, "resources": {"other": 1}, "env": {"TRITON_PTXAS_PATH": str(ptxas)}},
    )


async def test_a_node_with_another_ptxas_is_refused_by_name(
    mixed_cluster: tuple[Cluster, list[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, (same, other) = mixed_cluster
    # Only the other node offers what this farm asks for: nothing can compile, and it says why.
    farm = acompile.RayFarm(cluster.address, resources={"other": 1})
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path) as pool:
        with pytest.raises(acompile.FarmToolchainError, match=r"99\.9") as refused:
            await pool.wait_ready()
        with pytest.raises(acompile.FarmToolchainError):
            await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
    assert other[:12] in str(refused.value)
    # Both nodes: the other one is refused (a warning names it) and the farm compiles on the other.
    farm = acompile.RayFarm(cluster.address)
    with caplog.at_level(logging.WARNING, logger="acompile"):
        async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path) as pool:
            kernels = await pool.gather(*_specs(4))
            stats = farm.stats()
    assert all(k.cubin for k in kernels)
    assert list(stats["refused"]) == [other]
    assert set(stats["nodes"]) == {same}
    assert any(other[:12] in r.getMessage() and "ptxas" in r.getMessage() for r in caplog.records)


async def test_a_corpus_compiled_on_the_farm_equals_a_local_compile_byte_for_byte(
    cluster: Cluster, tmp_path: Path
) -> None:
    farm = acompile.RayFarm(cluster.address)
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path / "farm") as pool:
        remote = await pool.gather(*_specs(12))
        with pytest.raises(acompile.CompileError) as remote_error:
            await pool.triton(
                broken_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64}
            )
        stats, farm_stats = pool.stats(), farm.stats()
        children = _direct_children()
    # Work ran on both nodes, and no local worker was started.
    assert stats["workers"]["started"] == 2 and stats["workers"]["forked"] == 0
    assert len(farm_stats["nodes"]) == 2
    assert all(node["done"] >= 1 for node in farm_stats["nodes"].values()), farm_stats
    assert not [c for c in children if "acompile._workers" in c], children

    async with acompile.CompilePool(target=TARGET, workers=1, cache_dir=tmp_path / "local") as pool:
        local = await pool.gather(*_specs(12))
        with pytest.raises(acompile.CompileError) as local_error:
            await pool.triton(
                broken_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64}
            )
    for r, loc in zip(remote, local, strict=True):
        assert (r.key, r.cubin, r.asm["ptx"], r.metadata) == (
            loc.key,
            loc.cubin,
            loc.asm["ptx"],
            loc.metadata,
        )
    # The farm's results went to the disk tier under the same keys: a local pool finds them there.
    async with acompile.CompilePool(
        target=TARGET, workers=1, cache_dir=tmp_path / "farm", prestart=False
    ) as pool:
        tiers = [(await pool.compile_with_tier(spec))[1] for spec in _specs(12)]
        assert pool.stats()["workers"]["started"] == 0
    assert tiers == ["disk"] * 12
    # A remote compile error is the local one: class, message, compiler log, worker traceback.
    r_err, l_err = remote_error.value, local_error.value
    assert type(r_err) is type(l_err)
    assert (r_err.args, r_err.kernel, r_err.backend, r_err.log) == (
        l_err.args,
        l_err.kernel,
        l_err.backend,
        l_err.log,
    )
    assert "undefined_name" in r_err.log and "Traceback" in r_err.worker_traceback


async def test_ray_workers_sigkilled_mid_storm_lose_no_job(cluster: Cluster, tmp_path: Path) -> None:
    farm = acompile.RayFarm(cluster.address, runtime_env=RUNTIME_ENV)
    jobs = 40
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        await pool.wait_ready()
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            job = Job(FAKE, {"name": f"k{i}", "action": "sleep", "seconds": 0.15, "value": i}, f"k{i}")
            results[i] = await pool.executor.run(job)

        async def kill_twice() -> None:
            for _ in range(2):
                await until(
                    lambda: pool.stats()["workers"]["busy"] == 2 and len(_farm_worker_pids()) == 2, 60
                )
                await anyio.sleep(0.05)
                victim = _farm_worker_pids()[0]
                os.kill(victim, signal.SIGKILL)
                # Back to size (a new actor, preloaded) before the next kill.
                await until(lambda v=victim: v not in _farm_worker_pids(), 10)
                await until(lambda: pool.stats()["workers"]["alive"] == 2, 60)

        async with anyio.create_task_group() as tg:
            for i in range(jobs):
                tg.start_soon(one, i)
            tg.start_soon(kill_twice)
        stats = pool.stats()
    assert results == {i: i for i in range(jobs)}
    assert stats["workers"]["restarts"].get("killed", 0) == 2, stats["workers"]
    assert stats["jobs"]["retried"] >= 1 and stats["jobs"]["failed"] == 0
    assert stats["workers"]["alive"] == 2


async def test_cancelling_a_running_compile_frees_its_ray_worker_within_a_second(
    cluster: Cluster, tmp_path: Path
) -> None:
    farm = acompile.RayFarm(cluster.address)
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path) as pool:
        await pool.wait_ready()
        actors = set(_farm_worker_pids())
        before = _node_workers()
        with anyio.move_on_after(30) as scope:
            async with anyio.create_task_group() as tg:
                # Cancelled by its only caller while it compiles.
                tg.start_soon(slow_compile, pool)
                await until(lambda: pool.stats()["jobs"]["running"] == 1, 20)
                await anyio.sleep(0.5)
                cancelled_at = time.perf_counter()
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught
        await until(lambda: pool.stats()["jobs"]["running"] == 0 and before - _node_workers(), 1.0)
        freed = time.perf_counter() - cancelled_at
        # The actor was not replaced: its local pool stopped the compiling worker and forked another.
        await until(lambda: len(_node_workers()) == 2, 5)
        assert set(_farm_worker_pids()) == actors
        assert pool.stats()["jobs"]["cancelled"] == 1
        # And it compiles the next request.
        kernel = await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
        assert kernel.cubin
    assert freed < 1.0


async def test_with_local_workers_too_urgent_requests_stay_here_and_background_ones_go_to_the_farm(
    cluster: Cluster, tmp_path: Path
) -> None:
    from acompile._workers import BACKGROUND, URGENT

    farm = acompile.RayFarm(cluster.address, runtime_env=RUNTIME_ENV)
    async with acompile.CompilePool(
        acompile.Split(1, farm), target=TARGET, cache_dir=tmp_path, preload=()
    ) as pool:
        urgent, background = [
            await pool.executor.run(Job(FAKE, {"name": "k", "action": "pid"}, "k", lane))
            for lane in (URGENT, BACKGROUND)
        ]
        local = {p.pid for p in psutil.Process().children(recursive=True)}
        on_nodes = _node_workers()
        stats = pool.stats()
    assert urgent not in on_nodes and background in on_nodes
    assert urgent in local
    assert stats["workers"]["size"] == 3 and stats["jobs"]["done"] == 2


def test_warmup_on_the_farm(cluster: Cluster, tmp_path: Path) -> None:
    """``acompile warmup MANIFEST --farm ADDRESS``: another process, a driver of the cluster,
    fills the cache from the farm; a second run finds every kernel there."""
    manifest = str(ROOT / "examples" / "manifest.toml")
    command = [sys.executable, "-m", "acompile.cli", "warmup", manifest, "--cache-dir", str(tmp_path)]
    first = subprocess.run([*command, "--farm", cluster.address], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "14 kernels: 14 compiled, 0 cached, 0 failed" in first.stdout
    second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert "14 kernels: 0 compiled, 14 cached, 0 failed" in second.stdout, second.stdout


async def test_a_farm_no_node_can_host_says_so(cluster: Cluster, tmp_path: Path) -> None:
    farm = acompile.RayFarm(cluster.address, resources={"gpu_compiler": 1})
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        with pytest.raises(acompile.WorkerStartError, match="gpu_compiler"):
            await pool.wait_ready()
        with pytest.raises(acompile.WorkerStartError):
            await pool.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})


async def test_a_call_to_the_cluster_abandoned_by_its_caller_ends_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blocking call to Ray left behind by a deadline (``ray.kill``, ``ray.shutdown``, a slow
    ``ray.init``) ends later in its thread: its result or error is dropped, not raised there."""
    import threading

    from acompile._farm._executor import _off_loop

    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))

    def slow_failure() -> None:
        time.sleep(0.3)
        raise RuntimeError("the call ended after its caller left")

    with anyio.move_on_after(0.05):
        await _off_loop(time.sleep, 0.3)
    with anyio.move_on_after(0.05):
        await _off_loop(slow_failure)
    assert await _off_loop(lambda: 7) == 7
    with pytest.raises(RuntimeError, match="after its caller"):
        await _off_loop(slow_failure)
    await anyio.sleep(0.5)
    assert raised == []


async def test_actors_that_die_idle_are_replaced_and_the_next_request_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    farm = acompile.RayFarm(cluster.address, runtime_env=RUNTIME_ENV)
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        await pool.wait_ready()

        def kill_every_actor() -> set[int]:
            actors = set(_farm_worker_pids())
            assert len(actors) == 2
            for pid in actors:
                os.kill(pid, signal.SIGKILL)
            return actors

        # Nobody asks for anything: the farm notices and returns to size on its own.
        first = kill_every_actor()
        await until(
            lambda: len(set(_farm_worker_pids()) - first) == 2 and pool.stats()["workers"]["alive"] == 2, 60
        )
        # A request sent at once after both die reaches dead actors first: it never ran there,
        # so those losses are not its retry, and it runs on a replacement.
        kill_every_actor()
        job = Job(FAKE, {"name": "k", "action": "pid"}, "k")
        with anyio.fail_after(60):
            pid = await pool.executor.run(job)
        on_nodes = _node_workers()
        stats = pool.stats()
    assert pid in on_nodes
    assert stats["jobs"]["failed"] == 0 and stats["jobs"]["done"] == 1, stats["jobs"]
    assert stats["workers"]["restarts"].get("killed", 0) == 4, stats["workers"]


async def test_a_killed_actor_takes_its_compiling_worker_along_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """However the actor dies (here SIGKILL, as the OOM killer would), the worker of its local
    pool that is inside a long native compile goes too, at once, and so does its reaper."""
    farm = acompile.RayFarm(cluster.address)
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path) as pool:
        await pool.wait_ready()
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow_compile, pool)
                await until(lambda: pool.stats()["jobs"]["running"] == 1, 20)
                await anyio.sleep(1.0)  # inside Triton's passes
                workers = list(_node_workers())
                reapers = _reapers(workers)
                assert len(workers) == 2 and len(reapers) == 2
                for pid in _farm_worker_pids():
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.perf_counter()
                await until(lambda: not [p for p in workers + reapers if _exists(p)], 10)
                gone = time.perf_counter() - killed_at
                scope.cancel()
    # Without it, the compiling worker went on for the rest of its compile (~25 s here).
    assert gone < 5.0


_DRIVER = """
import sys, anyio, acompile
from kernels_for_tests import slow_to_compile_kernel

async def main():
    farm = acompile.RayFarm(sys.argv[1])
    async with acompile.CompilePool(target=sys.argv[3], workers=farm, cache_dir=sys.argv[2]) as pool:
        await pool.wait_ready()
        print("READY", flush=True)
        await pool.triton(
            slow_to_compile_kernel, signature={"x_ptr": "*fp32", "out_ptr": "*fp32"}, constexprs={"N": 400}
        )

anyio.run(main)
"""


def test_a_driver_killed_mid_compile_leaves_nothing_compiling_on_the_nodes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The pool's process SIGKILLed while its job compiles on a node: Ray ends the actors (and
    kills their children); the worker inside the compile, and every process of the actor's local
    pool, goes too."""
    from acompile._farm._reaper import marked

    command = [sys.executable, "-c", _DRIVER, cluster.address, str(tmp_path), TARGET]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert driver.stdout is not None
        for line in driver.stdout:
            if "READY" in line:
                break
        time.sleep(1.5)  # the compile is inside Triton's passes on a node
        workers = _node_workers()
        assert len(workers) == 2
        marks = {_mark_of(pid) for pid in workers}
        driver.kill()
        driver.wait(10)
        killed_at = time.perf_counter()
        deadline = killed_at + 15
        while (
            left := [p for m in marks for p in marked(m, set())] + [p for p in workers if _exists(p)]
        ) and (time.perf_counter() < deadline):
            time.sleep(0.05)
        gone = time.perf_counter() - killed_at
    finally:
        driver.kill()
        driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
    assert not left
    assert gone < 10.0  # the time Ray takes to end the actors, and then at once


def _reapers(workers: list[int]) -> list[int]:
    """The reaper of each worker's actor: the process started with the mark the worker carries."""
    marks = {_mark_of(pid) for pid in workers}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if "_reaper.py" in line and any(mark in line for mark in marks):
            found.append(proc.pid)
    return found


def _mark_of(pid: int) -> str:
    """The mark of the actor whose local pool started the process ``pid``."""
    from acompile._farm._reaper import MARK_VARIABLE

    with open(f"/proc/{pid}/environ", "rb") as f:
        for entry in f.read().split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == MARK_VARIABLE.encode():
                return value.decode()
    raise AssertionError(f"process {pid} carries no actor's mark")


def _exists(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _storm_specs(n: int) -> list[acompile.TritonSpec]:
    """``n`` distinct real compiles (up to 48): two kernels, six block sizes, four warp counts."""
    specs = [
        acompile.TritonSpec(kernel, ADD_SIG, {"BLOCK": block}, num_warps=warps)
        for kernel in (add_kernel, scale_add_kernel)
        for block in (64, 128, 256, 512, 1024, 2048)
        for warps in (1, 2, 4, 8)
    ]
    assert len(specs) >= n
    return specs[:n]


def _preloading(actor: int) -> bool:
    """Whether the farm actor ``actor`` is inside its start's preload: its local pool's template
    runs and has forked no worker yet (a worker is forked only once the preload is over, and the
    actor says it is ready only after that)."""
    from processes import is_bytecode_helper

    try:
        templates = [p for p in psutil.Process(actor).children() if "--template" in _cmdline(p)]
        if not templates:
            return False
        workers = [w for t in templates for w in t.children() if _cmdline(w) and not is_bytecode_helper(w)]
    except psutil.Error:
        return False
    return not workers


async def test_actors_killed_while_they_start_or_preload_cost_no_job_of_a_storm(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Forty real compiles sent to a farm whose actors' processes are SIGKILLed six times as they
    start: three as soon as the actor exists (its local pool not begun), three while their
    template preloads Triton; the first two kills leave no actor alive anywhere. A start killed
    from outside is a transient failure: another actor is started, on any node with room, and
    the jobs wait for it. Every job succeeds, none fails, and the farm ends at its full size.
    (The farm used to fail every queued job with WorkerStartError at the second failed start
    with no actor alive.)"""
    farm = acompile.RayFarm(cluster.address)
    specs = _storm_specs(40)
    kills: list[str] = []

    async def kill_actors_as_they_start() -> None:
        seen: set[int] = set()
        while len(kills) < 6:
            for pid in _farm_worker_pids():
                phase = "start" if len(kills) % 2 == 0 else "preload"
                if pid in seen or (phase == "preload" and not _preloading(pid)):
                    continue
                seen.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append(phase)
                break
            await anyio.sleep(0.005)

    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path) as pool:
        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_actors_as_they_start)
                kernels = await pool.gather(*specs, return_exceptions=True)
                tg.cancel_scope.cancel()
            await until(lambda: pool.stats()["workers"]["alive"] == 2, 60)
        stats = pool.stats()
    failed = [k for k in kernels if isinstance(k, BaseException)]
    assert not failed, f"{len(failed)} of {len(specs)} jobs failed: {failed[:3]}"
    assert all(k.cubin for k in kernels)  # type: ignore[union-attr]
    assert kills == ["start", "preload"] * 3, kills
    assert stats["jobs"]["done"] == len(specs) and stats["jobs"]["failed"] == 0, stats["jobs"]
    # Each kill cost a start (or, where a kill landed as the actor became ready, an actor).
    restarts = stats["workers"]["restarts"]
    assert restarts.get("start_failed", 0) + restarts.get("killed", 0) >= len(kills), restarts


async def test_a_farm_whose_actors_all_die_as_they_start_gives_up_after_preload_timeout(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Every actor's process is SIGKILLed as soon as it exists, on both nodes: the farm starts
    actor after actor, and the job waits; only once no actor has been alive for preload_timeout
    (5 s here) does the farm fail it, with a WorkerStartError that says so and names the node and
    Ray's account of the death. The kills stop: the farm, still trying, starts its actors, and
    the next job runs on one."""
    farm = acompile.RayFarm(cluster.address, runtime_env=RUNTIME_ENV)
    killing = anyio.Event()

    async def kill_every_actor() -> None:
        while not killing.is_set():
            for pid in _farm_worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await anyio.sleep(0.005)

    async with acompile.CompilePool(
        target=TARGET, workers=farm, cache_dir=tmp_path, preload=(), preload_timeout=5
    ) as pool:
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_every_actor)
            t0 = time.perf_counter()
            with anyio.fail_after(120), pytest.raises(acompile.WorkerStartError) as failed:
                await pool.executor.run(Job(FAKE, {"name": "k", "action": "pid"}, "k"))
            waited = time.perf_counter() - t0
            killing.set()
        message = str(failed.value)
        assert "preload_timeout=5" in message and "from outside" in message, message
        assert "a farm worker on" in message and "ActorDiedError" in message, message
        assert waited >= 5.0
        assert pool.stats()["workers"]["restarts"]["start_failed"] >= 2
        await until(lambda: pool.stats()["workers"]["alive"] == 2, 60)
        with anyio.fail_after(60):
            pid = await pool.executor.run(Job(FAKE, {"name": "k", "action": "pid"}, "k"))
        assert pid in _node_workers()
