"""examples/server.py, run for real: uvicorn in a subprocess, driven over HTTP as a client would.

Each test starts its own server with its own cache folder, on the event loop the test runs on
(asyncio or uvloop, from the ``anyio_backend`` fixture), and checks what a user of the server
would: answers, their timing, error messages, the record it leaves for the next deploy, and the
process table after shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import psutil
import pytest
from conftest import ROOT, TARGET, asyncio_only, subprocess_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.anyio

# Twelve on-demand compiles, none of them among the server's warm-up variants.
STORM: list[dict[str, Any]] = [
    {"kernel": "add_kernel", "constexprs": {"BLOCK": 64}, "num_warps": 1},
    {"kernel": "add_kernel", "constexprs": {"BLOCK": 128}, "num_warps": 2},
    {"kernel": "add_kernel", "constexprs": {"BLOCK": 2048}, "num_warps": 8},
    {"kernel": "bias_gelu_kernel", "constexprs": {"BLOCK": 256}, "num_warps": 2},
    {"kernel": "bias_gelu_kernel", "constexprs": {"BLOCK": 2048}, "num_warps": 8},
    {"kernel": "softmax_kernel", "constexprs": {"BLOCK": 256}, "num_warps": 2},
    {"kernel": "softmax_kernel", "constexprs": {"BLOCK": 512}, "num_warps": 4},
    {"kernel": "softmax_kernel", "constexprs": {"BLOCK": 2048}, "num_warps": 4},
    {"kernel": "matmul_kernel", "constexprs": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, "num_warps": 4},
    {"kernel": "matmul_kernel", "constexprs": {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}, "num_warps": 4},
    {"kernel": "matmul_kernel", "constexprs": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, "num_warps": 8},
    {"kernel": "matmul_kernel", "constexprs": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32}, "num_warps": 8},
]

# /health must answer in this time whatever is compiling: generous, for a busy 2-core machine.
HEALTH_BOUND_S = 1.0

# A compile that takes seconds (3-6 s on 2 cores; examples/kernels.py: unrolled_kernel), to have
# one in flight when a client hangs up or the server is stopped. Vary STEPS for distinct kernels.
SLOW: dict[str, Any] = {
    "kernel": "unrolled_kernel",
    "constexprs": {"STEPS": 800, "BLOCK": 256},
    "num_warps": 4,
}

# SIGTERM with compiles in flight: the server must be gone within 2 s; the test allows twice that
# for a loaded CI machine (the compiles it stops would take far longer: the test prints both).
SHUTDOWN_BOUND_S = 4.0

# The example's warm-up manifest: its cuda:90 variants are compiled at start-up, its cuda:80 ones
# skipped (another target than the server's).
MANIFEST = ROOT / "examples" / "manifest.toml"

# The server's progressive matmul (examples/server.py: MATMUL_FAST, MATMUL_BEST), as /matmul says.
MATMUL_FAST = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
MATMUL_BEST = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3}


@dataclass
class Server:
    process: anyio.abc.Process
    url: str
    output: list[bytes] = field(default_factory=list)
    first_health: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> str:
        return b"".join(self.output).decode("utf-8", "replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def server_loop(anyio_backend: Any) -> str:
    """The event loop the server runs on: the one this test's client runs on."""
    options = anyio_backend[1] if isinstance(anyio_backend, tuple) else {}
    return "uvloop" if options.get("use_uvloop") else "asyncio"


@contextlib.asynccontextmanager
async def serve(cache_dir: Path, loop: str, **env_vars: str) -> AsyncIterator[Server]:
    """Start the example under uvicorn, wait for its first /health answer, stop it afterwards."""
    port = _free_port()
    env = subprocess_env(ACOMPILE_CACHE_DIR=str(cache_dir), ACOMPILE_TARGET=TARGET, **env_vars)
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "server:app",
        "--app-dir",
        "examples",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        loop,
    ]
    process = await anyio.open_process(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    server = Server(process, f"http://127.0.0.1:{port}")

    drained = anyio.Event()

    async def drain() -> None:
        # Read the server's output as it comes: a full pipe would stall the server.
        assert process.stdout is not None
        async for chunk in process.stdout:
            server.output.append(chunk)
        drained.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            try:
                server.first_health = await _wait_for_health(server)
                yield server
            finally:
                await _stop(process)
                with anyio.move_on_after(2, shield=True):
                    await drained.wait()
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await process.aclose()


async def _wait_for_health(server: Server) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        with anyio.fail_after(60):
            while True:
                if server.process.returncode is not None:
                    raise AssertionError(f"the server exited with {server.process.returncode}:\n{server.log}")
                try:
                    response = await client.get("/health")
                except httpx.TransportError:
                    await anyio.sleep(0.05)
                    continue
                assert response.status_code == 200, response.text
                answer: dict[str, Any] = response.json()
                return answer


async def _stop(process: anyio.abc.Process) -> None:
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
            with anyio.move_on_after(15):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def client_of(server: Server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=60)


async def post_compile(client: httpx.AsyncClient, body: Any) -> httpx.Response:
    return await client.post("/compile", json=body)


async def wait_until_settled(client: httpx.AsyncClient, deadline: float = 60) -> dict[str, Any]:
    """Poll /health until the start-up work is over: warm-up and replay finished, and the
    progressive matmul at its last stage. Returns that answer."""
    with anyio.fail_after(deadline):
        while True:
            health: dict[str, Any] = (await client.get("/health")).json()
            if health["warmup"]["state"] != "running" and health["matmul"]["stage"] in ("best", "failed"):
                return health
            await anyio.sleep(0.05)


def replay_of(health: dict[str, Any]) -> dict[str, Any]:
    """The warm-up's entry for the record of the previous run: the source that is not the
    example's manifest (each source's entry is under its path)."""
    (entry,) = [e for path, e in health["warmup"]["sources"].items() if path != str(MANIFEST)]
    return entry


def restarts(health: dict[str, Any]) -> dict[str, int]:
    """Workers replaced, by cause, less the one the progressive matmul may cause: if the tuned
    kernel lands before the fast one (rare: the fast compile is smaller and starts first), the
    fast compile is stopped, and the worker running it is replaced ("abandoned")."""
    counts: dict[str, int] = dict(health["pool"]["workers"]["restarts"])
    matmul = health["matmul"]
    if matmul["stage"] == "best" and matmul["fast_tier"] is None and counts.get("abandoned") == 1:
        del counts["abandoned"]
    return counts


def recorded_keys(record: Path) -> list[str]:
    """The cache keys a record holds, in order (a comment line above each entry)."""
    return re.findall(r"^# key: ([0-9a-f]{64})$", record.read_text(), re.MULTILINE)


@pytest.mark.timeout(180)
async def test_health_answers_at_once_while_warmup_and_compiles_run(tmp_path: Path, server_loop: str) -> None:
    async with serve(tmp_path / "cache", server_loop) as server:
        # The server answered before its warm-up finished: start-up does not wait for it.
        assert server.first_health["warmup"]["state"] == "running", server.first_health

        latencies: list[float] = []
        answers: list[dict[str, Any]] = []
        results: dict[int, httpx.Response] = {}
        storm_over = anyio.Event()

        async with client_of(server) as client:

            async def poll_health() -> None:
                # Every 50 ms until the storm is over, and a few times after.
                after = 3
                while after:
                    t0 = time.perf_counter()
                    response = await client.get("/health")
                    latencies.append(time.perf_counter() - t0)
                    assert response.status_code == 200, response.text
                    answers.append(response.json())
                    if storm_over.is_set():
                        after -= 1
                    await anyio.sleep(0.05)

            async def compile_one(i: int) -> None:
                results[i] = await post_compile(client, STORM[i])

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(poll_health)
                async with anyio.create_task_group() as storm:
                    for i in range(len(STORM)):
                        storm.start_soon(compile_one, i)
                storm_seconds = time.perf_counter() - t0
                storm_over.set()

            # Once the storm is over, the warm-up (and the tuned matmul) finish too: wait for
            # them, still answering.
            health = await wait_until_settled(client)

    failed = {i: r.text for i, r in results.items() if r.status_code != 200}
    assert not failed, f"{failed}\n{server.log}"
    compiled = [results[i].json() for i in range(len(STORM))]
    assert all(c["tier"] == "compile" and c["cubin_bytes"] > 0 for c in compiled), compiled
    assert len({c["key"] for c in compiled}) == len(STORM)

    worst = max(latencies)
    summary = (
        f"{len(latencies)} /health answers during a {storm_seconds:.2f} s storm of {len(STORM)} compiles: "
        f"max {worst * 1000:.1f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; "
        f"server-side compile seconds {sorted(c['seconds'] for c in compiled)}"
    )
    print(summary)
    assert worst < HEALTH_BOUND_S, summary
    # The answers came while compiles were running, not only before or after them.
    assert any(a["pool"]["jobs"]["running"] > 0 for a in answers), summary
    assert health["warmup"]["state"] == "done", health
    assert replay_of(health)["state"] == "none", health  # a fresh cache folder: no record yet
    stats = health["pool"]
    # The progressive matmul compiled its two versions (the fast one only if the tuned one had
    # not landed first: then the fast compile is stopped).
    matmul = health["matmul"]
    progressive = [matmul["fast_tier"], matmul["best_tier"]].count("compile")
    assert matmul["best_tier"] == "compile", matmul
    assert stats["compiled"] == len(STORM) + health["warmup"]["total"] + progressive, stats
    assert stats["failed"] == 0 and restarts(health) == {}, stats


# asyncio only, as the other tests of what the server answers (its requests, record, replay,
# progressive matmul, quiesce): the application's logic is the same on either loop, and the
# pool's quiesce and idle timer on uvloop are in test_lifecycle.py. The tests of what the loop
# does (answers during a storm, signals, a client hanging up, shutdown with compiles in flight)
# run the server on both.
@asyncio_only
@pytest.mark.timeout(180)
async def test_compile_answers_with_the_kernel_and_where_it_came_from(
    tmp_path: Path, server_loop: str
) -> None:
    body = {"kernel": "add_kernel", "constexprs": {"BLOCK": 512}, "num_warps": 4}
    cache_dir = tmp_path / "cache"
    async with serve(cache_dir, server_loop) as server, client_of(server) as client:
        # Ask once the warm-up's jobs wait in the queue behind ready workers.
        with anyio.fail_after(30):
            while True:
                stats = (await client.get("/health")).json()["pool"]
                if stats["workers"]["started"] == stats["workers"]["size"] and stats["jobs"]["queued"] > 0:
                    break
                await anyio.sleep(0.01)
        first = await post_compile(client, body)
        assert first.status_code == 200, f"{first.text}\n{server.log}"
        # It went ahead of the warm-up (queued with background=True), which is still going on.
        during = (await client.get("/health")).json()
        assert during["warmup"]["state"] == "running", during
        again = await post_compile(client, body)
        assert again.status_code == 200, again.text

    one, two = first.json(), again.json()
    assert one["name"] == "add_kernel"
    assert len(one["key"]) == 64 and int(one["key"], 16) >= 0, one
    assert one["cubin_bytes"] > 0
    assert one["tier"] == "compile", one
    assert two["tier"] == "memory", two
    assert (two["key"], two["cubin_bytes"]) == (one["key"], one["cubin_bytes"])
    assert two["seconds"] < one["seconds"], (one, two)

    # A new server process on the same cache folder finds it on disk. (With its own record: the
    # replay of the shared one would have loaded it into memory first, see the replay test.)
    fresh_record = str(tmp_path / "second-run.toml")
    async with (
        serve(cache_dir, server_loop, ACOMPILE_RECORD=fresh_record) as server,
        client_of(server) as client,
    ):
        third = await post_compile(client, body)
        assert third.status_code == 200, third.text
    assert third.json()["tier"] == "disk", third.json()
    assert third.json()["key"] == one["key"]


@asyncio_only
@pytest.mark.timeout(180)
async def test_bad_requests_get_400_and_kernels_triton_rejects_get_422(
    tmp_path: Path, server_loop: str
) -> None:
    bad_requests: list[tuple[Any, str]] = [
        ({"kernel": "no_such_kernel"}, "this server knows ['add_kernel'"),
        ({"constexprs": {"BLOCK": 256}}, "missing field 'kernel'"),
        ({"kernel": "add_kernel", "block": 256}, "unknown field(s) ['block']"),
        ({"kernel": "add_kernel", "constexprs": {"BLOK": 256}}, "add_kernel has no parameter 'BLOK'"),
        ({"kernel": "add_kernel"}, "missing constexpr 'BLOCK' of add_kernel"),
        (
            {"kernel": "add_kernel", "constexprs": {"BLOCK": 256}, "num_warps": 3},
            "num_warps must be a power of two",
        ),
        ({"kernel": "add_kernel", "constexprs": [256]}, "constexprs must map names to values"),
        (["add_kernel"], "the body must be a JSON object"),
    ]
    async with serve(tmp_path / "cache", server_loop) as server, client_of(server) as client:
        for body, expected in bad_requests:
            response = await post_compile(client, body)
            assert response.status_code == 400, (body, response.text)
            assert expected in response.json()["error"], (body, response.json())

        headers = {"content-type": "application/json"}
        response = await client.post("/compile", content=b"{not json", headers=headers)
        assert response.status_code == 400, response.text
        assert "the body is not JSON" in response.json()["error"]

        # tl.arange needs a power of two: Triton rejects the kernel, and says where.
        broken = await post_compile(client, {"kernel": "add_kernel", "constexprs": {"BLOCK": 3}})
        assert broken.status_code == 422, broken.text
        message = broken.json()["error"]
        assert "Triton failed to compile 'add_kernel'" in message, message
        assert "arange's range must be a power of 2" in message, message
        assert "tl.arange(0, BLOCK)" in message, message

        # The server is none the worse for it.
        good = await post_compile(client, {"kernel": "add_kernel", "constexprs": {"BLOCK": 256}})
        assert good.status_code == 200, good.text
        health = (await client.get("/health")).json()
    assert health["status"] == "ok"
    assert health["pool"]["failed"] == 1 and restarts(health) == {}, health


@asyncio_only
@pytest.mark.timeout(180)
async def test_ready_answers_503_while_warming_up_then_200_and_the_pool_is_marked_ready(
    tmp_path: Path, server_loop: str
) -> None:
    async with serve(tmp_path / "cache", server_loop) as server, client_of(server) as client:
        # At once: the server answers, and says it is not ready (a fresh cache: the warm-up's
        # seven compiles take seconds).
        early = await client.get("/ready")
        early_health = (await client.get("/health")).json()
        # Then ready, once the warm-up is over.
        with anyio.fail_after(60):
            while (late := await client.get("/ready")).status_code != 200:
                assert late.status_code == 503, late.text
                await anyio.sleep(0.05)
        health = (await client.get("/health")).json()
        # A kernel no warm-up compiled, asked for after ready: compiled, and counted as late.
        miss = await post_compile(client, STORM[0])
        after = (await client.get("/health")).json()

    assert early.status_code == 503, early.text
    assert early.json()["ready"] is False and early.json()["reason"].startswith("warming up"), early.json()
    assert early.json()["warmup"]["state"] == "running", early.json()
    assert early_health["ready"] is False and early_health["pool"]["after_ready"]["ready"] is False, (
        early_health
    )

    assert late.json()["ready"] is True and late.json()["warmup"]["state"] == "done", late.json()
    warmup = health["warmup"]
    # The manifest's cuda:90 variants were compiled; its cuda:80 ones are another target's.
    assert (warmup["total"], warmup["failed"], warmup["skipped"]) == (7, 0, 7), warmup
    assert warmup["sources"][str(MANIFEST)]["state"] == "done", warmup
    assert health["ready"] is True and health["status"] == "ok", health
    assert health["pool"]["after_ready"]["ready"] is True, health  # pool.mark_ready() was called
    assert health["shared"] == {"kind": None, "available": None}, health
    assert health["workers"]["alive"] == health["workers"]["size"], health

    assert miss.status_code == 200 and miss.json()["tier"] == "compile", miss.text
    assert after["compiled_after_ready"] >= health["compiled_after_ready"] + 1, after
    assert "add_kernel" in " ".join(after["pool"]["after_ready"]["names"]), after


@asyncio_only
@pytest.mark.timeout(180)
async def test_metrics_are_scraped_over_http_and_parse(tmp_path: Path, server_loop: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with serve(tmp_path / "cache", server_loop) as server, client_of(server) as client:
        compiled = await post_compile(client, STORM[3])
        again = await post_compile(client, STORM[3])
        scraped = await client.get("/metrics")

    assert compiled.status_code == 200 and again.status_code == 200, (compiled.text, again.text)
    assert scraped.status_code == 200, scraped.text
    assert scraped.headers["content-type"].startswith("text/plain"), scraped.headers
    families = {family.name: family for family in text_string_to_metric_families(scraped.text)}

    duration = families["acompile_compile_duration_seconds"]
    assert duration.type == "histogram", duration
    counts = [s for s in duration.samples if s.name == "acompile_compile_duration_seconds_count"]
    assert sum(s.value for s in counts) >= 1, duration.samples

    # A counter's family drops "_total"; its samples keep it.
    requests = [
        sample
        for family in families.values()
        for sample in family.samples
        if sample.name == "acompile_cache_requests_total"
    ]
    assert requests, sorted(families)
    # The second request was a memory hit.
    assert any(
        s.labels.get("tier") == "memory" and s.labels.get("result") == "hit" and s.value >= 1
        for s in requests
    ), requests


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_stops_the_server_and_its_workers(
    tmp_path: Path, server_loop: str, signum: signal.Signals
) -> None:
    async with serve(tmp_path / "cache", server_loop) as server, client_of(server) as client:
        # Wait until every worker process exists, while the warm-up still compiles.
        with anyio.fail_after(30):
            while True:
                health = (await client.get("/health")).json()
                workers = health["pool"]["workers"]
                if workers["alive"] == workers["size"]:
                    break
                await anyio.sleep(0.02)
        children = psutil.Process(server.process.pid).children(recursive=True)
        ours = [p for p in children if "acompile._worker" in " ".join(_cmdline(p))]
        # Workers are forked from a template process, itself a child of the server.
        templates = [p for p in ours if p.ppid() == server.process.pid and "--template" in _cmdline(p)]
        assert len(templates) <= 1 and len(ours) - len(templates) == workers["size"], (children, health)
        warmup_when_signalled = health["warmup"]["state"]

        t0 = time.perf_counter()
        server.process.send_signal(signum)
        with anyio.fail_after(10):
            code = await server.process.wait()
        seconds = time.perf_counter() - t0

    # uvicorn shuts down gracefully, then re-raises the signal so that the exit status says it.
    assert code in (0, -signum), f"exit status {code}\n{server.log}"
    assert seconds < 5, f"shutdown took {seconds:.2f} s\n{server.log}"
    assert "Application shutdown complete" in server.log, server.log
    assert "Traceback" not in server.log, server.log
    _, alive = psutil.wait_procs(children, timeout=3)
    alive = [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after shutdown (warm-up was {warmup_when_signalled}): {alive}"
    print(f"{signum.name} during warm-up {warmup_when_signalled!r}: exit {code} in {seconds:.2f} s")


@asyncio_only
@pytest.mark.timeout(180)
async def test_served_kernels_are_recorded_and_replayed_by_the_next_start(
    tmp_path: Path, server_loop: str
) -> None:
    cache_dir = tmp_path / "cache"
    record = cache_dir / "served.toml"  # the default: next to the cache
    on_demand = [STORM[0], STORM[5]]
    async with serve(cache_dir, server_loop) as server, client_of(server) as client:
        assert replay_of(server.first_health)["state"] == "none", server.first_health
        first = [await post_compile(client, body) for body in on_demand]
        assert all(r.status_code == 200 for r in first), [r.text for r in first]
        health = await wait_until_settled(client)
    assert health["warmup"]["state"] == "done" and health["matmul"]["stage"] == "best", health

    # Everything served was recorded once: the warm-up, both matmul versions, the requests.
    keys = recorded_keys(record)
    served = health["warmup"]["total"] + 2 + len(on_demand)
    assert len(keys) == len(set(keys)) == served, record.read_text()
    assert {r.json()["key"] for r in first} <= set(keys)
    entries = tomllib.loads(record.read_text())["kernel"]
    assert {e["kernel"] for e in entries} == {
        "kernels:add_kernel",
        "kernels:bias_gelu_kernel",
        "kernels:softmax_kernel",
        "kernels:matmul_kernel",
    }, entries
    assert all(e["targets"] == [TARGET] for e in entries), entries
    recorded = record.read_bytes()
    # Requested, recorded, but never compiled: a fast matmul stopped because the tuned one
    # landed first (rare, see restarts()). The next start compiles it.
    never_compiled = 0 if health["matmul"]["fast_tier"] else 1

    # The next deploy replays the record in the background: what production used is loaded
    # (here from the disk cache) before anyone asks for it.
    async with serve(cache_dir, server_loop) as server, client_of(server) as client:
        health = await wait_until_settled(client)
        again = [await post_compile(client, body) for body in on_demand]
    replay = health["warmup"]["sources"][str(record)]
    assert replay["state"] == "done", health
    assert (replay["total"], replay["errors"]) == (served, []), replay
    assert [r.json()["tier"] for r in again] == ["memory"] * len(on_demand), [r.text for r in again]
    assert [r.json()["key"] for r in again] == [r.json()["key"] for r in first]
    stats = health["pool"]
    assert stats["cache"]["misses"] == never_compiled and stats["compiled"] <= never_compiled, stats
    # Each recorded kernel read from the disk once; one more read where this start's fast matmul
    # was stopped because its tuned one landed first, after the fast one's read: the replay's
    # request for it then reads it again (the stopped request kept nothing).
    stopped_after_reading = 1 if health["matmul"]["fast_tier"] is None else 0
    hits = stats["cache"]["hits_disk"]
    assert served - never_compiled <= hits <= served - never_compiled + stopped_after_reading, (stats, health)
    assert record.read_bytes() == recorded  # nothing new was served: the record is as it was
    print(f"replay of {served} kernels in {replay['seconds']} s")

    if server_loop == "asyncio":  # the command does not depend on the loop
        # The build box: `acompile warmup` replays the same record into another cache, without a
        # GPU. The record names kernels by module (`kernels`), so that module must import there.
        env = subprocess_env(PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), str(ROOT)]))
        command = [
            sys.executable,
            "-m",
            "acompile.cli",
            "warmup",
            str(record),
            "--cache-dir",
            str(tmp_path / "box"),
        ]
        out = await anyio.run_process(command, env=env, check=False)
        text = out.stdout.decode() + out.stderr.decode()
        assert out.returncode == 0, text
        assert f"{served} kernels: {served} compiled, 0 cached, 0 failed" in text, text


@asyncio_only
@pytest.mark.timeout(180)
async def test_progressive_matmul_is_served_fast_then_best(tmp_path: Path, server_loop: str) -> None:
    stages: list[str] = []
    served: dict[str, dict[str, Any]] = {}
    # One worker: the fast compile (urgent lane) then certainly runs before the tuned one
    # (background lane). With two, both run at once and the fast one usually, not always, wins.
    async with (
        serve(tmp_path / "cache", server_loop, ACOMPILE_WORKERS="1") as server,
        client_of(server) as client,
    ):
        with anyio.fail_after(60):
            while True:
                health = (await client.get("/health")).json()
                stage = health["matmul"]["stage"]
                if not stages or stages[-1] != stage:
                    stages.append(stage)
                    answer = await client.get("/matmul")
                    if stage == "pending":
                        assert answer.status_code == 503, answer.text
                    elif answer.json()["stage"] == stage:  # it may have moved on meanwhile
                        served[stage] = answer.json()
                if stage in ("best", "failed"):
                    break
                await anyio.sleep(0.02)
        final = (await client.get("/matmul")).json()

    # Observed in order (polling may miss a short stage, never reorder them).
    assert stages == [s for s in ("pending", "fast", "best") if s in stages], stages
    assert stages[-1] == "best", (stages, health)
    assert final["stage"] == "best" and final["config"] == MATMUL_BEST, final
    # What the binary itself says, not only which config the server thinks it launches.
    assert (final["num_warps"], final["num_stages"]) == (8, 3), final
    if "fast" in served:
        assert served["fast"]["config"] == MATMUL_FAST, served
        assert (served["fast"]["num_warps"], served["fast"]["num_stages"]) == (4, 2), served
        assert served["fast"]["key"] != final["key"], served
    stats = final["stats"]
    # The fast kernel was there first (it compiled in the urgent lane), the tuned one later; the
    # server answered meanwhile (this test polled it throughout).
    assert stats["fast_tier"] == stats["best_tier"] == "compile", stats
    assert stats["fast_seconds"] < stats["best_seconds"], stats
    assert stats["fast_error"] is None and stats["best_error"] is None, stats
    print(
        f"matmul stages seen {stages}: fast at {stats['fast_seconds']:.2f} s, best at {stats['best_seconds']:.2f} s"
    )


@asyncio_only
@pytest.mark.timeout(180)
async def test_quiesce_stops_the_workers_and_a_miss_wakes_them(tmp_path: Path, server_loop: str) -> None:
    async with serve(tmp_path / "cache", server_loop) as server, client_of(server) as client:
        settled = await wait_until_settled(client)
        size = settled["pool"]["workers"]["size"]
        children = psutil.Process(server.process.pid).children(recursive=True)

        # What a server calls before CUDA-graph capture: it answers once the workers are gone.
        quiet = await client.post("/quiesce")
        assert quiet.status_code == 200, quiet.text
        assert quiet.json() | {"seconds": 0} == {"awake": False, "alive": 0, "queued": 0, "seconds": 0}
        workers = [
            p
            for p in children
            if "--template" not in _cmdline(p) and "acompile._worker" in " ".join(_cmdline(p))
        ]
        _, alive = psutil.wait_procs(workers, timeout=3)
        assert not [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE], alive

        # It stays quiet, and a request the cache answers does not wake it.
        await anyio.sleep(0.3)
        hit = await post_compile(client, {"kernel": "add_kernel", "constexprs": {"BLOCK": 1024}})
        assert hit.status_code == 200 and hit.json()["tier"] == "memory", hit.text
        health = (await client.get("/health")).json()
        assert (health["pool"]["workers"]["awake"], health["pool"]["workers"]["alive"]) == (False, 0), health

        # A miss wakes it, and is compiled.
        t0 = time.perf_counter()
        miss = await post_compile(client, STORM[1])
        miss_seconds = time.perf_counter() - t0
        assert miss.status_code == 200 and miss.json()["tier"] == "compile", miss.text
        health = (await client.get("/health")).json()
        assert health["pool"]["workers"]["awake"] is True, health
        with anyio.fail_after(10):
            while health["pool"]["workers"]["alive"] != size:
                await anyio.sleep(0.02)
                health = (await client.get("/health")).json()
    stats = health["pool"]
    assert restarts(health) == {"stopped": size}, stats
    assert stats["failed"] == 0 and health["matmul"]["stage"] == "best", health
    print(
        f"quiesce answered in {quiet.json()['seconds'] * 1000:.1f} ms; a miss woke the pool and compiled in {miss_seconds:.2f} s"
    )


@asyncio_only
@pytest.mark.timeout(180)
async def test_idle_timeout_quiesces_the_pool_until_the_next_miss(tmp_path: Path, server_loop: str) -> None:
    async with (
        serve(tmp_path / "cache", server_loop, ACOMPILE_IDLE_TIMEOUT="0.5") as server,
        client_of(server) as client,
    ):
        await wait_until_settled(client)
        # No work for half a second: the pool quiesces by itself.
        with anyio.fail_after(10):
            while True:
                health = (await client.get("/health")).json()
                if not health["pool"]["workers"]["awake"]:
                    break
                await anyio.sleep(0.05)
        assert health["pool"]["jobs"]["queued"] == 0, health
        miss = await post_compile(client, STORM[2])
        assert miss.status_code == 200 and miss.json()["tier"] == "compile", miss.text
        health = (await client.get("/health")).json()
    assert health["pool"]["workers"]["awake"] is True, health
    assert health["pool"]["failed"] == 0, health


def slow(steps: int) -> dict[str, Any]:
    """SLOW with its own number of steps: another kernel, compiled on its own (no single flight)."""
    return {**SLOW, "constexprs": {**SLOW["constexprs"], "STEPS": steps}}


def raw_post(path: str, body: Any) -> bytes:
    """An HTTP/1.1 POST as bytes, for a client that sends a request and hangs up without reading."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(payload)}\r\n\r\n".encode() + payload


def pool_children(server: Server) -> tuple[list[psutil.Process], list[int]]:
    """The server's pool processes (the template, its workers, their helpers), and the workers'
    pids. Workers are forked from the template and keep its command line: the template is the
    one whose parent is the server."""
    ours = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "acompile._worker" in " ".join(_cmdline(p)) and _status(p) != psutil.STATUS_ZOMBIE
    ]
    workers = [p.pid for p in ours if _ppid(p) != server.process.pid and _name(p) != "acompile-pyc"]
    return ours, workers


@pytest.mark.timeout(180)
async def test_a_client_that_hangs_up_cancels_its_compile(tmp_path: Path, server_loop: str) -> None:
    # One worker: the one that runs the compile is the one to watch.
    async with (
        serve(tmp_path / "cache", server_loop, ACOMPILE_WORKERS="1") as server,
        client_of(server) as client,
    ):
        before = (await wait_until_settled(client))["pool"]
        _, workers = pool_children(server)
        assert len(workers) == 1, workers

        # The client sends its request on a connection of its own and hangs up once its
        # compile runs (not a moment sooner: a job still queued is dropped, not stopped).
        stream = await anyio.connect_tcp("127.0.0.1", httpx.URL(server.url).port or 80)
        await stream.send(raw_post("/compile", SLOW))
        with anyio.fail_after(30):
            while True:
                if (await client.get("/health")).json()["pool"]["jobs"]["running"] > 0:
                    break
                await anyio.sleep(0.01)
        await stream.aclose()
        hung_up = time.perf_counter()

        # Then the compile is cancelled, or (if the server does not notice) it runs to its end.
        with anyio.fail_after(120):
            while True:
                after = (await client.get("/health")).json()["pool"]
                if after["jobs"]["cancelled"] > before["jobs"]["cancelled"]:
                    break
                if after["jobs"]["done"] > before["jobs"]["done"]:
                    break
                await anyio.sleep(0.01)
        cancel_seconds = time.perf_counter() - hung_up
        assert after["jobs"]["done"] == before["jobs"]["done"], (
            f"the compile ran to its end ({cancel_seconds:.2f} s after the client hung up) for nobody: {after}"
        )
        assert after["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1, after
        # The worker that ran it is stopped (its compiler with it), and a fresh one takes its place.
        with anyio.fail_after(30):
            while True:
                _, replaced = pool_children(server)
                if len(replaced) == 1 and replaced != workers:
                    break
                await anyio.sleep(0.01)
        replaced_seconds = time.perf_counter() - hung_up

        # The same compile for a client that waits: how long the cancelled one would have run
        # (nothing of it was cached). Measured here, on this machine, under the same load.
        t0 = time.perf_counter()
        full = await post_compile(client, SLOW)
        compile_seconds = time.perf_counter() - t0
        last = (await client.get("/health")).json()["pool"]

    summary = (
        f"cancelled {cancel_seconds:.2f} s and its worker replaced {replaced_seconds:.2f} s after the "
        f"client hung up; the same compile takes {compile_seconds:.2f} s"
    )
    print(summary)
    replacements = {
        cause: last["workers"]["restarts"].get(cause, 0) - before["workers"]["restarts"].get(cause, 0)
        for cause in ("abandoned", "crash", "killed")
    }
    assert replacements == {"abandoned": 1, "crash": 0, "killed": 0}, last["workers"]
    assert full.status_code == 200 and full.json()["tier"] == "compile", full.text
    assert last["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1, last
    assert last["failed"] == 0, last
    assert replaced_seconds < compile_seconds / 3, summary
    assert "Traceback" not in server.log, server.log


@pytest.mark.timeout(180)
async def test_sigterm_with_compiles_in_flight_answers_503_and_exits_at_once(
    tmp_path: Path, server_loop: str
) -> None:
    bodies = [slow(800 + i) for i in range(4)]
    answers: dict[int, httpx.Response | Exception] = {}
    # Two workers, whatever the machine: two of the compiles run, the other two wait in the queue.
    async with (
        serve(tmp_path / "cache", server_loop, ACOMPILE_WORKERS="2") as server,
        client_of(server) as client,
    ):
        size = (await wait_until_settled(client))["pool"]["workers"]["size"]
        assert size == 2, size

        async def ask(i: int) -> None:
            try:
                answers[i] = await post_compile(client, bodies[i])
            except httpx.TransportError as exc:  # no answer at all: the test says so below
                answers[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(ask, i)
            # Every worker runs one of them, and the rest are queued.
            with anyio.fail_after(30):
                while True:
                    jobs = (await client.get("/health")).json()["pool"]["jobs"]
                    if (jobs["running"], jobs["queued"]) == (size, len(bodies) - size):
                        break
                    await anyio.sleep(0.01)
            children, _ = pool_children(server)
            t0 = time.perf_counter()
            server.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                code = await server.process.wait()
            seconds = time.perf_counter() - t0

    print(
        f"SIGTERM with {size} compiles running and {len(bodies) - size} queued: exit {code} in {seconds:.2f} s"
    )
    assert seconds < SHUTDOWN_BOUND_S, f"shutdown took {seconds:.2f} s\n{server.log}"
    assert code in (0, -signal.SIGTERM), f"exit status {code}\n{server.log}"
    got = {
        i: (a.status_code, a.text) if isinstance(a, httpx.Response) else repr(a) for i, a in answers.items()
    }
    assert all(
        isinstance(a, httpx.Response)
        and a.status_code == 503
        and "the server is shutting down" in a.json()["error"]
        for a in answers.values()
    ), f"{got}\n{server.log}"
    assert len(answers) == len(bodies), got
    assert "Traceback" not in server.log and "CancelledError" not in server.log, server.log
    _, alive = psutil.wait_procs(children, timeout=3)
    alive = [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after shutdown: {alive}"


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:
        return []


def _status(process: psutil.Process) -> str:
    try:
        return str(process.status())
    except psutil.NoSuchProcess:
        return str(psutil.STATUS_DEAD)


def _ppid(process: psutil.Process) -> int:
    try:
        return process.ppid()
    except psutil.Error:
        return -1


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""
