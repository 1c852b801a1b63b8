"""The shared tier on Memcached, against a real memcached on loopback (started per test): what a
fleet that shares its cache through Memcached gets, as on Redis (tests/test_shared.py), and what
is Memcached's own: an item size limit (1 MiB by default) that larger entries run into."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, asyncio_only, with_shared
from kernels_for_tests import ADD_SIG, add_kernel

import acompile

# asyncio only: the subject is the tier on Memcached (its client, its leases, its item size), not
# the loop; the tier's code on uvloop is in tests/test_shared.py, on Redis.
pytestmark = [pytest.mark.anyio, asyncio_only]
KEY = "a-signing-key-for-the-tests"


class Memcached:
    """A real memcached on loopback, owned by the test that uses it; ``options``: its own."""

    def __init__(self, *options: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"memcached://127.0.0.1:{self.port}"
        binary = shutil.which("memcached")
        assert binary is not None
        # -u: memcached refuses to run as root without a user to become; -U 0: no UDP.
        self.process = subprocess.Popen(
            [
                binary,
                "-l",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "0",
                "-m",
                "64",
                "-u",
                "nobody",
                *options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None:
                    _, said = self.process.communicate()
                    raise RuntimeError(f"memcached did not start: {said!r}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def keys(self) -> list[str]:
        """Every key the server holds (``lru_crawler metadump``), as the client named them."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"lru_crawler metadump all\r\n")
            data = b""
            while not data.endswith(b"END\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        from urllib.parse import unquote

        return [
            unquote(line.split()[0][4:].decode()) for line in data.splitlines() if line.startswith(b"key=")
        ]

    def stop(self) -> None:
        self.process.terminate()
        self.process.communicate(timeout=10)


def _needs_memcached() -> None:
    if shutil.which("memcached") is None:
        if os.environ.get("ACOMPILE_REQUIRE_MEMCACHED"):
            pytest.fail("memcached is required here (ACOMPILE_REQUIRE_MEMCACHED is set) but not installed")
        pytest.skip("memcached is not installed (CI installs it)")
    pytest.importorskip("aiomcache")  # the dev extra brings it (acompile[memcached])


@pytest.fixture
def memcached() -> Iterator[Memcached]:
    _needs_memcached()
    server = Memcached()
    yield server
    server.stop()


def pool(cache_dir: Path, url: str, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **with_shared(url, **kw))


def spec(block: int = 64) -> acompile.TritonSpec:
    return acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})


async def test_a_fresh_replica_takes_the_fleets_entry_from_memcached(
    tmp_path: Path, memcached: Memcached
) -> None:
    async with pool(tmp_path / "a", memcached.url, signing_key=KEY) as p:
        first, tier = await p.compile_with_tier(spec())
    assert tier == "compile"
    assert any(not k.startswith("acompile:lease") for k in memcached.keys()), memcached.keys()
    async with pool(tmp_path / "b", memcached.url, signing_key=KEY, prestart=False) as p:
        again, tier = await p.compile_with_tier(spec())
        stats = p.stats()
    assert tier == "shared" and again.key == first.key and again.asm["ptx"] == first.asm["ptx"]
    assert stats["workers"]["started"] == 0 and stats["cache"]["hits_shared"] == 1
    # A replica with another key neither takes it nor is served it.
    async with pool(tmp_path / "c", memcached.url, signing_key=KEY[::-1], prestart=False) as p:
        _, tier = await p.compile_with_tier(spec())
    assert tier == "compile"


async def test_fleet_single_flight_on_memcached_one_replica_compiles(
    tmp_path: Path, memcached: Memcached
) -> None:
    """Two replicas ask for the same kernel at once: the one that took the lease (Memcached's
    add) compiles it, the other waits for its entry."""
    async with pool(tmp_path / "a", memcached.url) as a, pool(tmp_path / "b", memcached.url) as b:
        await a.wait_ready()
        await b.wait_ready()
        await b.compile(spec(128))  # b's one-time costs (its first key), paid before

        def leases() -> int:
            return sum("lease" in k for k in memcached.keys())

        with anyio.fail_after(10):
            while leases():  # noqa: ASYNC110 - watching the server: that compile's lease goes
                await anyio.sleep(0.005)
        compiled = b.stats()["compiled"]
        results: dict[str, tuple[Any, str]] = {}
        async with anyio.create_task_group() as tg:

            async def ask(name: str, p: acompile.CompilePool) -> None:
                results[name] = await p.compile_with_tier(spec(4096))

            tg.start_soon(ask, "a", a)
            with anyio.fail_after(10):
                while not leases():  # noqa: ASYNC110 - watching the server for a's lease
                    await anyio.sleep(0.005)
            tg.start_soon(ask, "b", b)
        assert results["a"][1] == "compile" and results["b"][1] == "shared", results
        assert results["a"][0].key == results["b"][0].key
        assert b.stats()["compiled"] == compiled and b.stats()["cache"]["fleet_waits"] == 1


async def test_an_entry_over_memcacheds_item_size_is_not_published_and_the_tier_stays_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Memcached refuses an item over its size limit (``-I``; 1 MiB by default, where large
    kernels' entries go over). That entry is not published (a write failure, said once); the
    tier stays on: other entries, smaller, are still published and found."""
    _needs_memcached()
    small = Memcached("-I", "16k", "-o", "slab_chunk_max=8192")  # a kernel's entry is ~20-40 KiB
    try:
        caplog.set_level(logging.WARNING, logger="acompile")
        async with pool(tmp_path / "a", small.url, signing_key=KEY) as p:
            await p.compile(spec())
            await p.compile(spec(128))
        stats = p.stats()["cache"]  # after the exit, which waits for the publications
        assert stats["shared_write_failures"] == 2 and stats["shared_writes"] == 0, stats
        assert stats["shared_available"] and stats["shared_errors"] == 0, stats
        assert "shared cache unavailable" not in caplog.text, caplog.text
        assert "too large" in caplog.text, caplog.text
    finally:
        small.stop()
