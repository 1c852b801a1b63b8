"""The farm's connection to Ray is a process of its own: what the pool's process survives.

The pool's process never imports Ray; a process it starts holds the connection (see
``acompile._farm._broker``). These tests check what that is for, against real clusters
(``ray.cluster_utils.Cluster``, or the one ``RayFarm("local")`` starts), with real Triton compiles
or the fake backend's jobs, and real SIGKILLs. Where a test must watch the pool's process itself
(is it alive, what did it import, what is left after it), the pool runs in a child Python
(``_DRIVER``), which says what it sees on its standard output and waits on its standard input
for the test's word.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from conftest import ROOT, TARGET, subprocess_env

import acompile

pytest.importorskip("ray")
from ray.cluster_utils import Cluster
from ray_clusters import ray_cluster

# The fake backend (jobs that sleep) is imported by the workers on the nodes from the tests folder.
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": str(ROOT / "tests")}}
BROKER = "acompile._farm._broker"
# How soon after the head's death a pool learns that its farm is lost (docs/farm.md).
LOST_WITHIN = 14.0

_DRIVER = r"""
import json, sys, time
import anyio, psutil, acompile
from acompile._workers import Job
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel

args = json.loads(sys.argv[1])

def say(word, value=None):
    print(word, json.dumps(value), flush=True)

def ray_modules():
    return sorted(m for m in sys.modules if m.split(".")[0] == "ray")

def local_pids():
    return {p.pid for p in psutil.Process().children(recursive=True)}

async def one(pool, i, results):
    payload = {"name": f"k{i}", "action": "sleep", "seconds": args["seconds"], "pid": True}
    try:
        pid = await pool.executor.run(Job("fake_backend", payload, f"k{i}"))
        results[i] = {"ok": True, "where": "here" if pid in local_pids() else "farm", "at": time.time()}
    except acompile.AcompileError as exc:
        results[i] = {"ok": False, "error": type(exc).__name__, "message": str(exc), "at": time.time()}
    say("ENDED", i)

lag = [0.0]

async def watch_the_loop():
    # How late the event loop runs a task that asks to wake every 0.1 s, at worst.
    while True:
        start = time.perf_counter()
        await anyio.sleep(0.1)
        lag[0] = max(lag[0], time.perf_counter() - start - 0.1)

async def main():
    farm = acompile.RayFarm(
        args["address"], workers=2, local_fallback=args["fallback"], runtime_env=args.get("runtime_env")
    )
    pool = acompile.CompilePool(
        target=args["target"], workers=farm, cache_dir=args["cache_dir"], preload=tuple(args["preload"])
    )
    async with pool, anyio.create_task_group() as watching:
        watching.start_soon(watch_the_loop)
        with anyio.fail_after(120):
            await pool.wait_ready()
        say("READY", ray_modules())
        if args["mode"] == "corpus":
            blocks = [64, 128, 256, 512]
            specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in blocks]
            specs += [acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": b}) for b in blocks]
            with anyio.fail_after(300):
                kernels = await pool.gather(*specs)
            say("CORPUS", {"cubins": [len(k.cubin) for k in kernels], "farm": farm.stats()})
        elif args["mode"] == "storm":
            results = {}
            async with anyio.create_task_group() as tg:
                for i in range(args["jobs"]):
                    tg.start_soon(one, pool, i, results)
            say("STORM", results)
        say("SERVING", ray_modules())
        await anyio.to_thread.run_sync(sys.stdin.readline)
        say("LAG", lag[0])
        watching.cancel_scope.cancel()
    say("LEFT", ray_modules())

anyio.run(main)
"""


class Driver:
    """A pool in a child Python (``_DRIVER``): its words, line by line, and the test's to it.
    ``env``: more of the child's environment (its connection process inherits it)."""

    def __init__(self, env: dict[str, str] | None = None, **args: Any) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(**(env or {})),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.heard: list[str] = []
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, word: str, seconds: float) -> Any:
        """The value the driver says with ``word`` next (its other words are kept in ``heard``)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the pool did not say {word} within {seconds} s: {self.heard}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"the pool's process ended (status {self.process.wait()}) before saying {word}: {self.heard}"
                )
            self.heard.append(line)
            said, _, value = line.partition(" ")
            if said == word:
                return json.loads(value)

    def tell(self, line: str = "") -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def _command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _left(processes: list[psutil.Process], seconds: float) -> list[str]:
    """Those of ``processes`` still alive after ``seconds`` (a live process is waited for)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for proc in processes:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {_command_line(proc)[:80]}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_a_local_farm_serves_a_corpus_and_leaves_no_ray_process(tmp_path: Path) -> None:
    """``RayFarm("local")`` starts a cluster that lives as long as the pool: the corpus compiles
    on it, and leaving the pool ends every process of it (and the connection process)."""
    driver = Driver(
        address="local",
        fallback=False,
        target=TARGET,
        cache_dir=str(tmp_path),
        preload=["triton"],
        mode="corpus",
    )
    try:
        driver.expect("READY", 180)
        corpus = driver.expect("CORPUS", 300)
        driver.expect("SERVING", 10)
        started = driver.descendants()
        lines = [_command_line(p) for p in started]
        driver.tell()  # leave
        driver.expect("LEFT", 60)
        assert driver.process.wait(30) == 0
    finally:
        driver.close()
    assert all(corpus["cubins"]) and len(corpus["cubins"]) == 8
    assert sum(node["done"] for node in corpus["farm"]["nodes"].values()) == 8, corpus["farm"]
    # While it served, the cluster it started ran, under its connection process.
    assert any("gcs_server" in line for line in lines) and any("raylet" in line for line in lines), lines
    assert any(BROKER in line for line in lines), lines
    assert not _left(started, 10)


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    for made, _ in ray_cluster({"num_cpus": 2}, {"num_cpus": 2}):
        yield made


# Ray ends a process connected to a cluster whose head has been gone this long: its
# gcs_rpc_server_reconnect_timeout_s, 60 s unless set. The head-kill test sets it for its pools'
# processes (and so their connection processes) to this, to see a pool outlive Ray's verdict
# without waiting out the default; it stays well above LOST_WITHIN, so that the connection
# process reports the loss itself first, as it does under the default.
RAY_RECONNECT_S = 30
# How long after Ray ended a process connected to the lost head (the witness below) the pools'
# processes must still be alive: Ray's verdict reaches each connected process at its own
# RAY_RECONNECT_S, counted from when it noticed the head gone (within a second or two of the
# witness).
AFTER_VERDICT_S = 5

# A plain Ray driver connected to the cluster, as the pool's process would be if it talked to
# Ray itself: its end is Ray's verdict on a process connected to a lost head.
_WITNESS = r"""
import sys, time
import ray

ray.init(address=sys.argv[1], logging_level="ERROR")
print("UP", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.timeout(420)
def test_a_head_killed_mid_storm_leaves_the_pool_alive_and_every_job_ended(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """The cluster's head (its GCS and raylet) SIGKILLed while two pools run 20 jobs each: Ray
    ends a process connected to it ``RAY_RECONNECT_S`` (30 s) later, as it ends a witness (a
    plain Ray driver with the pools' settings). Each pool's process is alive after that, and
    every job ended: on the farm, or, once the farm is lost, on local workers
    (``local_fallback=True``) or with ``FarmUnreachableError`` naming the address. Meanwhile the
    pool's event loop is never held up."""
    cluster = two_nodes
    ray_env = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(RAY_RECONNECT_S)}
    common = {
        "address": cluster.address,
        "target": TARGET,
        "preload": [],
        "mode": "storm",
        "jobs": 20,
        "seconds": 2.0,
        "runtime_env": RUNTIME_ENV,
    }
    moving = Driver(ray_env, fallback=True, cache_dir=str(tmp_path / "moving"), **common)
    failing = Driver(ray_env, fallback=False, cache_dir=str(tmp_path / "failing"), **common)
    witness = subprocess.Popen(
        [sys.executable, "-c", _WITNESS, cluster.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(**ray_env),
    )
    try:
        for driver in (moving, failing):
            assert driver.expect("READY", 120) == [], "the pool's process imported Ray"
        assert witness.stdout is not None
        assert witness.stdout.readline().strip() == "UP", "the witness did not connect"
        for driver in (moving, failing):
            for _ in range(3):
                driver.expect("ENDED", 60)
        head = cluster.head_node.all_processes
        for kind in ("gcs_server", "raylet"):
            os.kill(head[kind][0].process.pid, signal.SIGKILL)
        killed_at = time.time()
        storms = [driver.expect("STORM", 120) for driver in (moving, failing)]
        modules = [driver.expect("SERVING", 10) for driver in (moving, failing)]
        # Ray's verdict: the witness ended, no sooner than RAY_RECONNECT_S after the head's death.
        witness.wait(RAY_RECONNECT_S + 60)
        verdict_after = time.time() - killed_at
        assert witness.returncode != 0 and verdict_after > RAY_RECONNECT_S - 1, (
            witness.returncode,
            verdict_after,
        )
        time.sleep(AFTER_VERDICT_S)
        ended = [driver.process.poll() for driver in (moving, failing)]
        assert ended == [None, None], f"a pool's process ended after the head was killed: {ended}"
        for driver in (moving, failing):
            driver.tell()  # leave
        lags = [driver.expect("LAG", 30) for driver in (moving, failing)]
        for driver in (moving, failing):
            assert driver.expect("LEFT", 60) == []
            assert driver.process.wait(30) == 0
    finally:
        moving.close()
        failing.close()
        if witness.poll() is None:
            witness.kill()
        witness.communicate()
    assert modules == [[], []]
    # Ray held the loop of a process connected to it for as long as the head was gone (until it
    # ended the process).
    assert max(lags) < 3.0, lags
    moved, failed = ({int(i): r for i, r in storm.items()} for storm in storms)
    assert sorted(moved) == sorted(failed) == list(range(20))
    # With the fallback, every job succeeded: those the farm could not finish on this machine.
    assert all(r["ok"] for r in moved.values()), moved
    assert any(r["where"] == "here" for r in moved.values()), moved
    # Without it, a job the farm could not finish failed with the farm's error, within the bound.
    errors = [r for r in failed.values() if not r["ok"]]
    assert errors, failed
    for r in errors:
        assert r["error"] == "FarmUnreachableError" and cluster.address in r["message"], r
        assert r["at"] - killed_at < LOST_WITHIN + 10, (r, killed_at)


def test_the_pool_s_process_never_imports_ray(tmp_path: Path) -> None:
    """Not when the pool is entered with a farm, nor while jobs run on it, nor after."""
    for cluster, _ in ray_cluster({"num_cpus": 1}):
        driver = Driver(
            address=cluster.address,
            fallback=False,
            target=TARGET,
            cache_dir=str(tmp_path),
            preload=[],
            mode="storm",
            jobs=2,
            seconds=0.1,
            runtime_env=RUNTIME_ENV,
        )
        try:
            ready = driver.expect("READY", 120)
            storm = driver.expect("STORM", 60)
            serving = driver.expect("SERVING", 10)
            driver.tell()
            left = driver.expect("LEFT", 60)
            assert driver.process.wait(30) == 0
        finally:
            driver.close()
        assert all(r["ok"] and r["where"] == "farm" for r in storm.values()), storm
        assert ready == serving == left == []


def test_a_pool_s_process_killed_leaves_no_connection_process_and_no_local_cluster(tmp_path: Path) -> None:
    """The pool's process SIGKILLed while it serves: its connection process ends with it, and so
    does every process of the cluster ``RayFarm("local")`` started."""
    driver = Driver(
        address="local", fallback=False, target=TARGET, cache_dir=str(tmp_path), preload=[], mode="serve"
    )
    try:
        driver.expect("READY", 180)
        started = driver.descendants()
        lines = [_command_line(p) for p in started]
        driver.process.kill()
        driver.process.wait(10)
        left = _left(started, 15)
    finally:
        driver.close()
    assert any(BROKER in line for line in lines) and any("raylet" in line for line in lines), lines
    assert not left


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only, as for the farm's other tests: one loop's run is what a 2-core machine's
    budget allows."""
    return "asyncio"


class listening_silently:
    """An address on this machine that accepts connections (into its backlog) and never answers:
    the port answers a probe, and Ray's connection waits there."""

    def __enter__(self) -> str:
        import socket

        self.sock = socket.socket()
        # On every interface: Ray resolves 127.0.0.1 to this machine's address.
        self.sock.bind(("", 0))
        self.sock.listen(64)
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _brokers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if BROKER in _command_line(p)]


@pytest.mark.anyio
async def test_a_deadline_around_entering_a_pool_with_an_unreachable_farm_fires(tmp_path: Path) -> None:
    """Ray's connection to an address that never answers does not hold up the pool's process:
    the caller's deadline fires on time, and the farm's own bound gives ``FarmUnreachableError``
    naming the address. Either way no connection process is left."""
    with listening_silently() as address:
        farm = acompile.RayFarm(address, connect_timeout=30)
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(3):
                async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()):
                    pass
        assert time.perf_counter() - start < 3 + 3  # its connection process stopped, at most 2 s more
        assert not _brokers()
        farm = acompile.RayFarm(address, connect_timeout=3)
        start = time.perf_counter()
        with pytest.raises(acompile.FarmUnreachableError, match=address):
            async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()):
                pass
        assert time.perf_counter() - start < 3 + 15  # the process's start, then the bound
        assert not _brokers()


@pytest.fixture
def one_node() -> Iterator[Cluster]:
    for made, _ in ray_cluster({"num_cpus": 1}):
        yield made


@pytest.mark.anyio
async def test_a_deadline_around_wait_ready_fires_while_the_head_is_gone_and_a_head_back_is_used(
    one_node: Cluster, tmp_path: Path
) -> None:
    """The head's GCS SIGKILLed under a pool (in this very process, which Ray would end 60 s
    later): the farm cannot place its actors again, and a deadline around ``wait_ready()``
    fires on time; once the farm is lost (within ``LOST_WITHIN``), ``wait_ready()`` and new
    jobs raise ``FarmUnreachableError`` naming the address. A head started again at that
    address is connected to by itself: jobs run on the farm again, the pool's counts go on
    from where they were, and leaving the pool leaves no connection process."""
    from acompile._workers import Job

    def echo(value: int) -> Job:
        return Job("fake_backend", {"name": f"e{value}", "action": "echo", "value": value}, f"e{value}")

    cluster = one_node
    farm = acompile.RayFarm(cluster.address, workers=1, runtime_env=RUNTIME_ENV)
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        with anyio.fail_after(120):
            await pool.wait_ready()
        assert await pool.executor.run(echo(1)) == 1
        os.kill(cluster.head_node.all_processes["gcs_server"][0].process.pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        await pool.quiesce()  # its actor goes: another must be placed, which takes the head
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(3):
                await pool.wait_ready()
        assert time.perf_counter() - start < 4
        with anyio.fail_after(LOST_WITHIN + 10):
            with pytest.raises(acompile.FarmUnreachableError, match=cluster.address):
                await pool.wait_ready()
        assert time.perf_counter() - killed_at < LOST_WITHIN + 5
        with pytest.raises(acompile.FarmUnreachableError, match=cluster.address):
            await pool.executor.run(echo(2))
        assert not farm.stats()["connected"]

        # A new head at the same address (a restarted head node): the farm connects again.
        address = cluster.address
        port = int(address.rsplit(":", 1)[1])
        # On this thread, holding up the pool's loop for a few seconds: Ray sets signal handlers
        # as it starts a node, which only the main thread may do.
        cluster.remove_node(cluster.head_node, allow_graceful=False)
        cluster.add_node(num_cpus=1, gcs_server_port=port)
        assert cluster.address == address
        back_at = time.perf_counter()
        with anyio.fail_after(90):
            while not farm.stats()["connected"]:  # noqa: ASYNC110 - the farm's own state
                await anyio.sleep(0.1)
            await pool.wait_ready()
        assert time.perf_counter() - back_at < 60, "the attempts to connect again were too far apart"
        assert await pool.executor.run(echo(3)) == 3
        assert pool.stats()["jobs"]["done"] == 2  # the first connection's job, and this one
    assert not _brokers()


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_after_the_head_is_lost_the_pools_job_counts_say_what_happened(
    two_nodes: Cluster, tmp_path: Path
) -> None:
    """The head (its GCS and raylet) SIGKILLed during a storm of 20 jobs, with no local fallback:
    once the farm is lost, ``pool.stats()["jobs"]`` counts each job where it ended (done, or
    failed), none queued or running. It said ``queued 55, running 1, failed 0`` for 56 jobs that
    had all failed: the connection process's last report, which outlived it."""
    from acompile._workers import Job

    cluster = two_nodes
    farm = acompile.RayFarm(cluster.address, workers=2, runtime_env=RUNTIME_ENV)
    results: dict[int, str] = {}

    async def one(pool: acompile.CompilePool, i: int) -> None:
        payload = {"name": f"k{i}", "action": "sleep", "seconds": 2.0}
        try:
            await pool.executor.run(Job("fake_backend", payload, f"k{i}"))
            results[i] = "done"
        except acompile.AcompileError as exc:
            results[i] = type(exc).__name__

    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        with anyio.fail_after(120):
            await pool.wait_ready()
        with anyio.fail_after(LOST_WITHIN + 120):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, pool, i)
                while list(results.values()).count("done") < 2:  # noqa: ASYNC110 - no event for it
                    await anyio.sleep(0.1)
                head = cluster.head_node.all_processes
                for kind in ("gcs_server", "raylet"):
                    os.kill(head[kind][0].process.pid, signal.SIGKILL)
        jobs = pool.stats()["jobs"]
        farm_stats = farm.stats()
    done = list(results.values()).count("done")
    failed = len(results) - done
    assert len(results) == 20 and failed >= 1, results
    assert "FarmUnreachableError" in results.values(), results
    assert (jobs["queued"], jobs["running"], jobs["done"], jobs["failed"]) == (0, 0, done, failed), jobs
    assert not farm_stats["connected"] and farm_stats["queued"] == 0, farm_stats
    assert not _brokers()


@pytest.mark.anyio
async def test_a_connection_process_stopped_by_a_signal_is_a_lost_cluster(
    one_node: Cluster, tmp_path: Path
) -> None:
    """The connection process SIGSTOPped (a debugger, a frozen cgroup) with jobs running and
    queued: it beats every 2 s, so its silence is noticed within ``LOST_WITHIN``; every job then
    fails with ``FarmUnreachableError`` saying so (none waits forever), and leaving the pool
    kills the stopped process and its group."""
    from acompile._workers import Job

    farm = acompile.RayFarm(one_node.address, workers=1, runtime_env=RUNTIME_ENV)
    outcomes: list[object] = []
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as pool:
        with anyio.fail_after(120):
            await pool.wait_ready()

        async def one(i: int) -> None:
            payload = {"name": f"s{i}", "action": "sleep", "seconds": 60, "value": i}
            try:
                outcomes.append(await pool.executor.run(Job("fake_backend", payload, f"s{i}")))
            except acompile.AcompileError as exc:
                outcomes.append(exc)

        (broker,) = _brokers()
        with anyio.fail_after(LOST_WITHIN + 20):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
                await anyio.sleep(1)
                broker.suspend()
                stopped_at = time.perf_counter()
        assert time.perf_counter() - stopped_at < LOST_WITHIN + 5
        assert len(outcomes) == 3
        for outcome in outcomes:
            assert isinstance(outcome, acompile.FarmUnreachableError), outcome
            assert "has not answered" in str(outcome) and one_node.address in str(outcome), outcome
        assert not farm.stats()["connected"]
        left_at = time.perf_counter()
    assert time.perf_counter() - left_at < 10
    assert not _brokers()
