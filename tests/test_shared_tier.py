"""The shared tier under load and faults, against a real redis-server on loopback: bursts queue
instead of failing, a stall costs only the operations during it, namespaces keep replicas with
other keys apart, and leases that are not to be honoured make nobody wait."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import RedisServer

import acompile
from acompile._cache import SharedTier, open_shared_cache, signing_key_id

pytestmark = pytest.mark.anyio
KEY = b"a-signing-key-for-the-tests"
OTHER_KEY = b"another-signing-key-of-16-bytes"


@asynccontextmanager
async def tier(redis: RedisServer, signing_key: bytes | None = KEY, **kw: Any) -> AsyncIterator[SharedTier]:
    url = redis.url + kw.pop("query", "")
    shared = SharedTier(await anyio.to_thread.run_sync(open_shared_cache, url), signing_key, **kw)
    try:
        yield shared
    finally:
        await shared.close()


def client(redis: RedisServer) -> Any:
    return redis.client()


def entry_keys(redis: RedisServer, namespace: str) -> list[bytes]:
    return list(client(redis).scan_iter(match=f"acompile:{namespace}:*", count=1000))


def cache_key(i: int) -> str:
    return f"{i:064x}"


async def test_a_burst_of_500_publications_all_arrive_within_the_pool(redis_server: RedisServer) -> None:
    async with tier(redis_server, query="?max_connections=8") as shared:
        assert shared.max_in_flight == 8
        results: list[bool] = []

        async def publish(i: int) -> None:
            results.append(await shared.set(cache_key(i), b"entry %d" % i))

        async with anyio.create_task_group() as tg:
            for i in range(500):
                tg.start_soon(publish, i)
        assert results.count(True) == 500 and shared.counts["writes"] == 500
        assert shared.counts["errors"] == 0 and shared.available
        # Never more connections than configured (idle ones stay in the pool: this is the peak).
        connections = [c for c in client(redis_server).client_list() if c["cmd"] != "client|list"]
        assert 1 <= len(connections) <= 8
        assert len(entry_keys(redis_server, signing_key_id(KEY))) == 500
        # ...and the same burst reads back whole.
        got: list[bytes | None] = []

        async def read(i: int) -> None:
            got.append(await shared.get(cache_key(i)))

        async with anyio.create_task_group() as tg:
            for i in range(500):
                tg.start_soon(read, i)
        assert sorted(got, key=str) == sorted((b"entry %d" % i for i in range(500)), key=str)


async def test_a_publication_waits_its_turn_however_long_the_queue(redis_server: RedisServer) -> None:
    """One connection and a queue wait far shorter than the queue: every publication still
    arrives (one skipped would be an entry the fleet never gets, and how long a burst queues
    depends on the machine), while a read that gets no turn in time is a miss, as bounded."""
    async with tier(redis_server, query="?max_connections=1", queue_wait=0.001) as shared:
        assert shared.max_in_flight == 1
        results: list[bool] = []

        async def publish(i: int) -> None:
            results.append(await shared.set(cache_key(i), b"entry %d" % i))

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(publish, i)
        assert results.count(True) == 200 and shared.counts["skipped"] == 0
        assert len(entry_keys(redis_server, signing_key_id(KEY))) == 200
        got: list[bytes | None] = []

        async def read(i: int) -> None:
            got.append(await shared.get(cache_key(i)))

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(read, i)
        # Reads have a caller waiting: those that got no turn within queue_wait were skipped.
        assert len(got) == 200 and shared.counts["full"] >= 1
        assert got.count(None) == shared.counts["skipped"] and shared.available


async def test_500_concurrent_misses_of_a_pool_are_all_published(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # Records take the same write-behind path as compiled kernels (disk now, shared in the
    # background), without 500 compiles.
    async with acompile.CompilePool(
        1,
        target="cuda:90",
        cache_dir=tmp_path,
        shared_cache=acompile.SharedCache(redis_server.url, signing_key=KEY),
        prestart=False,
        preload=(),
    ) as p:
        async with anyio.create_task_group() as tg:
            for i in range(500):
                tg.start_soon(p._cache.put_record, cache_key(i), f"record{i}", {"choice": b"%d" % i}, {})
    stats = p.stats()["cache"]
    assert stats["shared_writes"] == 500 and stats["shared_errors"] == 0
    assert len(entry_keys(redis_server, signing_key_id(KEY))) == 500


async def test_a_stall_costs_only_the_operations_during_it(redis_server: RedisServer) -> None:
    assert redis_server.process is not None
    async with tier(redis_server, timeout=0.2) as shared:
        assert await shared.set(cache_key(0), b"before")
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            got: list[bytes | None] = []

            async def read() -> None:
                got.append(await shared.get(cache_key(0)))

            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(read)
            assert got == [None] * 50 and not shared.available
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
        # One outage, however many operations it failed: the back-off did not grow with them.
        assert 1 <= shared.counts["errors"] <= 50
        assert shared.backoff == pytest.approx(0.25)
        with anyio.fail_after(10):
            while await shared.get(cache_key(0)) != b"before":  # noqa: ASYNC110 - polling the server
                await anyio.sleep(0.05)
        assert shared.available
        results: list[bool] = []

        async def publish(i: int) -> None:
            results.append(await shared.set(cache_key(i), b"after"))

        async with anyio.create_task_group() as tg:
            for i in range(1, 501):
                tg.start_soon(publish, i)
        assert results.count(True) == 500 and shared.available
        assert len(entry_keys(redis_server, signing_key_id(KEY))) == 501


async def test_a_dead_server_is_probed_by_one_operation_at_a_time(redis_server: RedisServer) -> None:
    async with tier(redis_server, timeout=0.2) as shared:
        redis_server.stop()
        assert await shared.get(cache_key(0)) is None and not shared.available
        errors = shared.counts["errors"]
        with anyio.fail_after(10):
            while shared.counts["errors"] == errors:  # the next probe, past the back-off
                await shared.get(cache_key(0))
                await anyio.sleep(0.02)
        # The probe failed: the next back-off is longer, and meanwhile nothing is tried.
        assert shared.backoff == pytest.approx(0.5) and not shared.available
        errors, skipped = shared.counts["errors"], shared.counts["skipped"]
        for _ in range(20):
            assert await shared.get(cache_key(0)) is None
        assert shared.counts["errors"] == errors and shared.counts["skipped"] == skipped + 20
        redis_server.start()
        with anyio.fail_after(10):
            while not await shared.set(cache_key(1), b"back"):  # noqa: ASYNC110 - polling the server
                await anyio.sleep(0.05)
        assert shared.available and shared.backoff == pytest.approx(0.25)


async def test_replicas_with_other_keys_can_neither_overwrite_nor_delete_the_fleets_entries(
    redis_server: RedisServer,
) -> None:
    k = cache_key(7)
    async with (
        tier(redis_server, KEY) as good,
        tier(redis_server, OTHER_KEY) as other,
        tier(redis_server, None) as unsigned,
    ):
        assert good.namespace != other.namespace and unsigned.namespace == "unsigned"
        assert KEY.hex() not in good.namespace and KEY.decode() not in good.namespace
        assert await good.set(k, b"the fleet's")
        assert await other.set(k, b"a stranger's") and await unsigned.set(k, b"nobody's")
        await other.delete(k)
        await unsigned.delete(k)
        assert await good.get(k) == b"the fleet's"
        assert await other.get(k) is None and await unsigned.get(k) is None
        assert good.counts["rejected"] == other.counts["rejected"] == 0
        # A value planted in the fleet's namespace without the key is refused and counted.
        name = f"acompile:{good.namespace}:{k}"
        for planted in (b"an unsigned entry", b"ACSIG2" + b"\0" * 32 + b"a forged entry"):
            client(redis_server).set(name, planted)
            assert await good.get(k) is None
        assert good.counts["rejected"] == 2
        # A signed value moved to another key of the namespace does not verify there either.
        assert await good.set(cache_key(8), b"moved")
        client(redis_server).set(name, client(redis_server).get(f"acompile:{good.namespace}:{cache_key(8)}"))
        assert await good.get(k) is None and good.counts["rejected"] == 3


@pytest.mark.parametrize("signing_key", [KEY, None], ids=["signed", "unsigned"])
async def test_leases_that_are_not_to_be_honoured_are_ignored(
    redis_server: RedisServer, signing_key: bytes | None
) -> None:
    k = cache_key(9)
    async with tier(redis_server, signing_key) as shared, tier(redis_server, OTHER_KEY) as other:
        name = f"acompile:lease:{shared.namespace}:{k}"
        planted = [
            b"a-replica-that-died",  # garbage, no TTL
            shared.lease_value(k, "someone", time.time() - 5),  # expired, no TTL
            shared.lease_value(k, "someone", time.time() + 10 * 86400),  # beyond any compile
        ]
        if signing_key is not None:
            planted += [
                other.lease_value(k, "someone", time.time() + 60),  # another key's
                SharedTier(shared.cache, None).lease_value(k, "someone", time.time() + 60),  # unsigned
            ]
        for value in planted:
            client(redis_server).set(name, value)  # no TTL: it would stay forever
            assert not await shared.lease_held(k)
            assert await shared.take_lease(k, ttl=30) is None  # compile here, do not wait
            await shared.release_lease(k)  # not ours: left alone
            assert client(redis_server).get(name) == value
        assert shared.counts["ignored_leases"] >= len(planted)
        # A real lease is honoured, carries a TTL in Redis, and is released by its holder only.
        client(redis_server).delete(name)
        assert await shared.take_lease(k, ttl=30) is True
        assert 0 < client(redis_server).ttl(name) <= 30
        replica = SharedTier(shared.cache, signing_key)
        assert await replica.take_lease(k, ttl=30) is False and await replica.lease_held(k)
        await replica.release_lease(k)
        assert await replica.lease_held(k)
        await shared.release_lease(k)
        assert not await replica.lease_held(k)


async def test_a_lease_is_renewed_only_while_it_is_this_replicas(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = cache_key(11)
    async with tier(redis_server, None) as shared:
        name = f"acompile:lease:{shared.namespace}:{k}"
        replica = SharedTier(shared.cache, None)  # another replica, on the same server
        assert await shared.take_lease(k, ttl=2) is True
        before = client(redis_server).get(name)
        # A lease lasts seconds whatever is asked (its holder renews it): 6 s at most.
        assert await shared.renew_lease(k, ttl=30) is True and 2000 < client(redis_server).pttl(name) <= 6000
        assert client(redis_server).get(name) != before  # a new value: a copy of the old one expires
        # Gone (it expired while the server was unreachable, say): taken again.
        client(redis_server).delete(name)
        assert await shared.renew_lease(k, ttl=30) is True and await replica.lease_held(k)
        # Another replica's: left alone.
        theirs = replica.lease_value(k, replica.owner, time.time() + 5)
        client(redis_server).set(name, theirs, ex=5)
        assert await shared.renew_lease(k, ttl=30) is False and client(redis_server).get(name) == theirs
        # Taken over between this replica's read and its write (the read is made to return this
        # replica's own lease): the compare-and-set leaves the other replica's lease alone.
        mine = shared.lease_value(k, shared.owner, time.time() + 5)

        async def read_before_the_takeover(*args: Any, **kwargs: Any) -> tuple[bool, bytes]:
            return True, mine

        monkeypatch.setattr(shared, "_fetch", read_before_the_takeover)
        assert await shared.renew_lease(k, ttl=30) is False and client(redis_server).get(name) == theirs
        monkeypatch.undo()
        # The server down: nothing to say (None), so the holder tries again at its next turn.
        redis_server.stop()
        assert await shared.renew_lease(k, ttl=30) is None


async def test_every_fault_is_a_miss(redis_server: RedisServer) -> None:
    class Broken:
        serializer: Any = None

        async def get(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("boom")

        set = add = delete = exists = get

        async def close(self) -> None:
            pass

    shared = SharedTier(Broken(), KEY)
    assert await shared.get(cache_key(1)) is None
    assert await shared.set(cache_key(1), b"x") is False
    assert await shared.take_lease(cache_key(1), 30) is None
    assert not await shared.lease_held(cache_key(1))
    await shared.release_lease(cache_key(1))
    await shared.delete(cache_key(1))
    assert shared.counts["errors"] == 1 and shared.counts["write_failures"] == 1
