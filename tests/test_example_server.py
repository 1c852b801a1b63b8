"""examples/server.py, run for real: uvicorn in a subprocess, driven over HTTP as a client would.

Each test starts its own server with its own cache folder, on the event loop the test runs on
(asyncio or uvloop, from the ``anyio_backend`` fixture), and checks what a user of the server
would: answers, their timing, error messages, and the process table after shutdown.
"""

from __future__ import annotations

import contextlib
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
from conftest import ROOT, TARGET, subprocess_env

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
async def serve(cache_dir: Path, loop: str) -> AsyncIterator[Server]:
    """Start the example under uvicorn, wait for its first /health answer, stop it afterwards."""
    port = _free_port()
    env = subprocess_env(ACOMPILE_CACHE_DIR=str(cache_dir), ACOMPILE_TARGET=TARGET)
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


@pytest.mark.timeout(180)
async def test_health_answers_at_once_while_warmup_and_compiles_run(tmp_path: Path, server_loop: str) -> None:
    async with serve(tmp_path / "cache", server_loop) as server:
        # The server answered before its warm-up finished: start-up does not wait for it.
        assert server.first_health["warmup"] == "running", server.first_health

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

            # Once the storm is over, the warm-up finishes too: wait for it, still answering.
            with anyio.fail_after(60):
                while True:
                    health = (await client.get("/health")).json()
                    if health["warmup"] != "running":
                        break
                    await anyio.sleep(0.05)

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
    assert health["warmup"] == "done", health
    stats = health["pool"]
    assert stats["compiled"] == len(STORM) + health["warmup_detail"]["total"], stats
    assert stats["failed"] == 0 and stats["workers"]["restarts"] == {}, stats


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
        assert during["warmup"] == "running", during
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

    # A new server process on the same cache folder finds it on disk.
    async with serve(cache_dir, server_loop) as server, client_of(server) as client:
        third = await post_compile(client, body)
        assert third.status_code == 200, third.text
    assert third.json()["tier"] == "disk", third.json()
    assert third.json()["key"] == one["key"]


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
    assert health["pool"]["failed"] == 1 and health["pool"]["workers"]["restarts"] == {}, health


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
        warmup_when_signalled = health["warmup"]

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
