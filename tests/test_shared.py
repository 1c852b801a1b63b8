"""The shared tier against a real redis-server on loopback (started per test)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, RedisServer, asyncio_only, with_shared
from kernels_for_tests import ADD_SIG, add_kernel, slow_to_compile_kernel

import acompile
from acompile._backends import prepare_triton
from acompile._cache import SharedTier, decode_entry

pytestmark = pytest.mark.anyio
KEY = "a-signing-key-for-the-tests"


def pool(cache_dir: Path, redis: RedisServer, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **with_shared(redis.url, **kw))


def spec(block: int = 64) -> acompile.TritonSpec:
    return acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})


async def test_a_fresh_replica_takes_the_fleets_entry_and_keeps_it_on_disk(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with pool(tmp_path / "a", redis_server, signing_key=KEY) as p:
        first, tier = await p.compile_with_tier(spec())
    assert tier == "compile"
    async with pool(tmp_path / "b", redis_server, signing_key=KEY, prestart=False) as p:
        again, tier = await p.compile_with_tier(spec())
        stats = p.stats()
    assert tier == "shared" and again.key == first.key and again.asm["ptx"] == first.asm["ptx"]
    assert stats["workers"]["started"] == 0 and stats["cache"]["hits_shared"] == 1
    # The shared hit was written to the local disk: the next process finds it there.
    redis_server.stop()
    async with pool(tmp_path / "b", redis_server, signing_key=KEY, prestart=False) as p:
        _, tier = await p.compile_with_tier(spec())
        assert tier == "disk" and p.stats()["cache"]["shared_errors"] == 0  # a local hit: no network


async def test_replicas_without_the_key_neither_feed_nor_spoil_the_fleet(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with pool(tmp_path / "unsigned", redis_server) as p:  # no signing key: its own namespace
        await p.compile(spec())
        assert p.stats()["cache"]["shared_namespace"] == "unsigned"
    async with pool(tmp_path / "strict", redis_server, signing_key=KEY) as p:
        _, tier = await p.compile_with_tier(spec())  # the unsigned entry is not even looked at
        assert tier == "compile" and p.stats()["cache"]["shared_rejected"] == 0
        namespace = p.stats()["cache"]["shared_namespace"]
    # A replica with the wrong key publishes the same kernel: the fleet's entry stays as it was.
    client: Any = redis_server.client()
    [fleet_name] = [k for k in client.keys(f"acompile:{namespace}:*") if b"lease" not in k]
    fleet_value = client.get(fleet_name)
    async with pool(
        tmp_path / "other-key", redis_server, signing_key="another-key-of-16-bytes", prestart=False
    ) as p:
        _, tier = await p.compile_with_tier(spec())
        assert tier == "compile"
    assert client.get(fleet_name) == fleet_value
    async with pool(tmp_path / "strict2", redis_server, signing_key=KEY, prestart=False) as p:
        _, tier = await p.compile_with_tier(spec())
        assert tier == "shared" and p.stats()["cache"]["shared_rejected"] == 0
    # Planted in the fleet's namespace without the key: refused, counted, compiled again.
    client.set(fleet_name, fleet_value[:6] + bytes(32) + fleet_value[38:])
    async with pool(tmp_path / "strict3", redis_server, signing_key=KEY) as p:
        _, tier = await p.compile_with_tier(spec())
        assert tier == "compile" and p.stats()["cache"]["shared_rejected"] == 1
    assert any("does not verify" in r.message for r in caplog.records)


async def test_a_damaged_shared_entry_is_a_miss_and_is_replaced(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with pool(tmp_path / "a", redis_server) as p:
        good = await p.compile(spec())
    client: Any = redis_server.client()
    [name] = [k for k in client.keys("*") if good.key.encode() in k and b"lease" not in k]
    for damage in (client.get(name)[:-10], b"garbage", client.get(name)[:50] + b"X" + client.get(name)[51:]):
        client.set(name, damage)
        async with pool(tmp_path / f"fresh{len(damage)}", redis_server) as p:
            _, tier = await p.compile_with_tier(spec())
            assert tier == "compile" and p.stats()["cache"]["shared_corrupt"] == 1
        # ...and the fresh compile was published over the damaged one.
        decode_entry(client.get(name), good.key)


async def test_redis_down_then_back(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "acompile")
    redis_server.stop()
    async with pool(tmp_path / "a", redis_server) as p:
        t0 = time.perf_counter()
        _, tier = await p.compile_with_tier(spec(64))
        assert tier == "compile" and time.perf_counter() - t0 < 10
        await p.compile(spec(128))  # the tier is skipped while down: no second timeout
        warnings = [r for r in caplog.records if "shared cache unavailable" in r.message]
        assert len(warnings) == 1 and p.stats()["cache"]["shared_available"] is False
        redis_server.start()
        with anyio.fail_after(10):  # past the back-off, the next operation finds it again
            while not p.stats()["cache"]["shared_available"]:
                await p.share(["0" * 64])  # a look-up in the shared tier (nothing to publish)
                await anyio.sleep(0.05)
        await p.compile(spec(256))
        with anyio.fail_after(5):
            while p.stats()["cache"]["shared_writes"] < 1:  # noqa: ASYNC110 - the write-behind has no event
                await anyio.sleep(0.05)
        assert p.stats()["cache"]["shared_available"] is True
    assert any("reachable again" in r.message for r in caplog.records)
    async with pool(tmp_path / "b", redis_server, prestart=False) as p:
        _, tier = await p.compile_with_tier(spec(256))
        assert tier == "shared"


async def test_fleet_single_flight_one_replica_compiles(tmp_path: Path, redis_server: RedisServer) -> None:
    client: Any = redis_server.client()
    async with pool(tmp_path / "a", redis_server) as a, pool(tmp_path / "b", redis_server) as b:
        await a.wait_ready()
        await b.wait_ready()
        # b's first request pays its one-time costs (its first key): made here, they cannot make
        # b look for the entry only after a has published it (a hit, no wait on the lease).
        await b.compile(spec(128))
        with anyio.fail_after(10):
            while any(b"lease" in k for k in client.keys("*")):  # noqa: ASYNC110 - watching Redis
                await anyio.sleep(0.005)  # that compile's lease goes in the background
        compiled = b.stats()["compiled"]
        results: dict[str, tuple[Any, str]] = {}
        async with anyio.create_task_group() as tg:

            async def ask(name: str, p: acompile.CompilePool) -> None:
                results[name] = await p.compile_with_tier(spec(4096))

            tg.start_soon(ask, "a", a)
            with anyio.fail_after(10):
                while not any(b"lease" in k for k in client.keys("*")):  # noqa: ASYNC110 - watching Redis
                    await anyio.sleep(0.005)
            tg.start_soon(ask, "b", b)
        assert results["a"][1] == "compile" and results["b"][1] == "shared"
        assert results["a"][0].key == results["b"][0].key
        assert b.stats()["compiled"] == compiled and b.stats()["cache"]["fleet_waits"] == 1


# asyncio only: the subject is the lease's renewal against its life in Redis (2.5 s waited out in
# each run), not the loop; the shared tier's leases on uvloop are in the tests around it.
@asyncio_only
async def test_a_lease_outlives_a_job_queued_past_its_ttl(tmp_path: Path, redis_server: RedisServer) -> None:
    """Replica a takes the lease on a kernel whose job then waits in a's queue (its one worker
    busy with a slow compile) longer than a lease lasts (1 s here). a renews it, so replica b,
    asking later, waits for a's entry instead of compiling the kernel too."""
    client: Any = redis_server.client()
    slow = acompile.TritonSpec(slow_to_compile_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"N": 300})
    async with pool(tmp_path / "a", redis_server) as a, pool(tmp_path / "b", redis_server) as b:
        for p in (a, b):
            p._cache.lease_ttl = 1.0  # a private knob: 6 s in a pool
        await a.wait_ready()
        await b.wait_ready()
        await b.compile(spec(128))  # b's one-time costs, paid before the race
        results: dict[str, tuple[Any, str]] = {}

        async def ask(name: str, p: acompile.CompilePool, s: acompile.TritonSpec) -> None:
            results[name] = await p.compile_with_tier(s)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "slow", a, slow)
            with anyio.fail_after(10):
                while a.stats()["workers"]["busy"] < 1:  # noqa: ASYNC110 - watching the pool
                    await anyio.sleep(0.01)
            tg.start_soon(ask, "a", a, spec(8192))  # its lease is taken now; its job waits
            with anyio.fail_after(10):
                while len([k for k in client.keys("*") if b"lease" in k]) < 2:  # noqa: ASYNC110 - watching Redis
                    await anyio.sleep(0.005)
            await anyio.sleep(2.5)  # more than twice the lease's life
            assert "a" not in results, "a compiled it before b asked: the slow kernel was too fast"
            assert len([k for k in client.keys("*") if b"lease" in k]) == 2  # both renewed
            compiled = b.stats()["compiled"]
            tg.start_soon(ask, "b", b, spec(8192))
        waits = b.stats()["cache"]["fleet_waits"]
    assert results["a"][1] == "compile" and results["b"][1] == "shared", results
    assert b.stats()["compiled"] == compiled and waits == 1


async def test_a_lease_left_by_a_dead_replica_does_not_block_forever(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with pool(tmp_path / "probe", redis_server, prestart=False) as p:
        key = (await prepare_triton(spec(512), p.target, tmp_path / "memo")).key
    client: Any = redis_server.client()
    async with pool(tmp_path / "a", redis_server, fleet_wait=0.5) as p:
        # A lease as a replica of this fleet (no signing key) writes it: it lasts seconds.
        lease = SharedTier(None, None).lease_value(key, "a-replica-that-died", time.time() + 5)
        client.set(f"acompile:lease:unsigned:{key}", lease, px=600_000)  # held, never released
        t0 = time.perf_counter()
        _, tier = await p.compile_with_tier(spec(512))
        waited = time.perf_counter() - t0
        assert p.stats()["cache"]["fleet_waits"] == 1
    assert tier == "compile" and 0.4 < waited < 10


@pytest.mark.parametrize("signing_key", [KEY, None], ids=["signed", "unsigned"])
async def test_a_planted_lease_makes_nobody_wait(
    tmp_path: Path, redis_server: RedisServer, signing_key: str | None
) -> None:
    async with pool(tmp_path / "probe", redis_server, prestart=False, signing_key=signing_key) as p:
        key = (await prepare_triton(spec(1024), p.target, tmp_path / "memo")).key
        namespace = p.stats()["cache"]["shared_namespace"]
    client: Any = redis_server.client()
    client.set(f"acompile:lease:{namespace}:{key}", b"planted, no TTL")
    async with pool(tmp_path / "a", redis_server, fleet_wait=600, signing_key=signing_key) as p:
        with anyio.fail_after(120):  # a guard only: honouring the lease would wait 600 s
            _, tier = await p.compile_with_tier(spec(1024))
        stats = p.stats()["cache"]
    assert tier == "compile" and stats["fleet_waits"] == 0 and stats["shared_ignored_leases"] >= 1
    assert client.get(f"acompile:lease:{namespace}:{key}") == b"planted, no TTL"  # not ours to remove
    async with pool(tmp_path / "b", redis_server, prestart=False, signing_key=signing_key) as p:
        _, tier = await p.compile_with_tier(spec(1024))
    assert tier == "shared"


async def test_a_bad_shared_cache_argument_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="redis://"):
        acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path, shared_cache="ftp://example")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        acompile.CompilePool(
            1, target=TARGET, cache_dir=tmp_path, shared_cache="redis://127.0.0.1:1/0", signing_key="short"
        )


async def test_a_graph_claimed_by_one_replica_is_waited_for_by_another_and_handed_over(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Fleet single flight for work done outside the pool (torch.compile's graphs): the first
    replica's claim holds the key, the second waits for its entry and gets it once published."""
    key = "ab" * 32
    async with pool(tmp_path / "a", redis_server) as a, pool(tmp_path / "b", redis_server) as b:
        host_a, host_b = a.torch_host(), b.torch_host()
        assert await host_a.claim(key) is None  # nobody else: ours to compile

        async def publish_later() -> None:
            await anyio.sleep(0.5)
            await host_a.store(key, "fx-graph", {"value": b"the graph"}, {"cache": "fx-graph"})

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(publish_later)
            entry = await host_b.claim(key)
        assert entry is not None and entry.blobs["value"] == b"the graph"
        assert 0.4 < time.perf_counter() - t0 < 5
        assert b.stats()["cache"]["fleet_waits"] == 1


async def test_a_claim_is_given_back_when_its_replica_leaves_without_publishing(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A replica that claimed a graph and left (its compile failed, its pool closed) holds
    nobody: the other stops waiting as soon as the claim is gone, and compiles itself."""
    key = "cd" * 32
    async with pool(tmp_path / "b", redis_server, fleet_wait=30) as b:
        async with pool(tmp_path / "a", redis_server) as a:
            assert await a.torch_host().claim(key) is None
        t0 = time.perf_counter()
        assert await b.torch_host().claim(key) is None  # its own now
        assert time.perf_counter() - t0 < 2


async def test_a_url_that_cannot_work_is_said_at_the_pools_entry_and_in_its_stats(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Database 21 of a server that has 16: every operation is refused. It turned sharing off
    # with one warning at the first look-up, and stats() said nothing of why.
    caplog.set_level(logging.WARNING, "acompile")
    url = redis_server.url.rsplit("/", 1)[0] + "/21"
    shared = acompile.SharedCache(url, signing_key=KEY)
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "a", shared_cache=shared) as p:
        # Said at the entry, before any request.
        warned = [r.getMessage() for r in caplog.records if "shared cache unavailable" in r.getMessage()]
        assert len(warned) == 1 and "DB index is out of range" in warned[0], warned
        cache = p.stats()["cache"]
        assert cache["shared_available"] is False
        assert cache["shared_problem"] == "open: ResponseError: DB index is out of range", cache
        _, tier = await p.compile_with_tier(spec())
        assert tier == "compile"  # the local tiers serve
        assert p.stats()["cache"]["shared_problem"], p.stats()["cache"]
    async with pool(tmp_path / "b", redis_server, signing_key=KEY, prestart=False) as p:
        cache = p.stats()["cache"]
        assert cache["shared_available"] is True and cache["shared_problem"] is None
