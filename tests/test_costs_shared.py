"""Compile times shared by a fleet through the shared tier, against a real redis-server.

A replica that starts on an empty cache folder orders its first storm by what the other replicas
measured: their records are one document in the shared tier (``costs:<namespace>``), read with
the local file before the first compile and merged with each replica's own records as it saves.
A damaged, forged or unreachable document costs a guess, never an error nor more than a moment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, RedisServer, with_shared
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._cache import (
    COSTS_FILE,
    COSTS_MAX_BYTES,
    COSTS_MAX_RECORDS,
    CompileCosts,
    CostFeatures,
    GuardedDisk,
    SharedTier,
    open_shared_cache,
    signing_key_id,
)

pytestmark = pytest.mark.anyio
KEY = b"a-signing-key-for-the-tests"
OTHER_KEY = b"another-signing-key-of-16-bytes"
DOCUMENT = "costs"
# What a load and a save may take at most (_LOAD_DEADLINE, _SAVE_DEADLINE), and room for a busy
# machine of 2 cores.
LOAD_DEADLINE = 0.5
SAVE_DEADLINE = 2.0
MARGIN = 0.5


def features(key: str, family: str = "family", size: int = 1000) -> CostFeatures:
    return CostFeatures(key=key, family=family, size=size, num_warps=4, num_stages=3)


def document_name(signing_key: bytes | None) -> str:
    """The document's name in Redis: the URL's namespace, then ``costs:<signing key's id>``."""
    return f"acompile:costs:{signing_key_id(signing_key)}"


@asynccontextmanager
async def tier(redis: RedisServer, signing_key: bytes | None = KEY) -> AsyncIterator[SharedTier]:
    shared = SharedTier(await anyio.to_thread.run_sync(open_shared_cache, redis.url), signing_key)
    try:
        yield shared
    finally:
        await shared.close()


async def replica(folder: Path, shared: SharedTier) -> CompileCosts:
    disk = GuardedDisk(folder)
    await disk.open()
    return CompileCosts(disk, shared)


async def published(shared: SharedTier) -> dict[str, Any]:
    """The document's records, as the fleet reads it."""
    data = await shared.get_document(DOCUMENT, COSTS_MAX_BYTES)
    assert data is not None
    records: dict[str, Any] = json.loads(data)["records"]
    return records


def local_records(folder: Path) -> dict[str, Any]:
    records: dict[str, Any] = json.loads((folder / COSTS_FILE).read_text())["records"]
    return records


def pool(folder: Path, redis: RedisServer, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(2, target=TARGET, cache_dir=folder, **with_shared(redis.url, **kw))


async def test_a_fresh_replica_expects_what_the_fleet_measured(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with pool(tmp_path / "a", redis_server, signing_key=KEY) as p:
        async with anyio.create_task_group() as tg:
            for block in (64, 128, 256):
                tg.start_soon(p.compile, acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block}))
    measured = {key: row[0] for key, row in local_records(tmp_path / "a").items()}
    assert len(measured) == 3

    # A fresh folder, nothing compiled yet: the first expect() finds A's times, each exactly.
    async with pool(tmp_path / "b", redis_server, signing_key=KEY, prestart=False) as p:
        costs = p._cache.costs
        for key, seconds in measured.items():
            # The key decides: another family, size or options would be guessed, not looked up.
            assert await costs.expect(features(key, family="unrelated", size=1)) == pytest.approx(seconds)
        assert costs.counts["shared_loaded"] == 3
        assert p.stats()["cache"]["costs_from_fleet"] == 3  # what users see
        await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 512}))
    # B's file holds what B measured, not what it read; the fleet's document holds both.
    [own] = local_records(tmp_path / "b")
    assert own not in measured
    async with tier(redis_server) as shared:
        assert set(await published(shared)) == {*measured, own}

    # A replica with another key (or none) has its own document: it sees none of these.
    async with pool(tmp_path / "c", redis_server, signing_key=OTHER_KEY, prestart=False) as p:
        for key, seconds in measured.items():
            assert await p._cache.costs.expect(features(key)) != pytest.approx(seconds)
        assert p.stats()["cache"]["costs_from_fleet"] == 0
    # The document is no entry: it is not under the entries' names.
    assert not [k for k in redis_server.client().keys(f"acompile:{signing_key_id(KEY)}:*") if b"costs" in k]


async def test_writers_publishing_at_once_lose_nothing(tmp_path: Path, redis_server: RedisServer) -> None:
    writers = 4
    async with tier(redis_server) as shared:
        replicas = [await replica(tmp_path / str(i), shared) for i in range(writers)]
        for turn in range(2):
            for i, costs in enumerate(replicas):
                await costs.expect(features("any"))  # loaded: what a pool does first
                for j in range(50):
                    costs.record(features(f"{i}-{turn}-{j:02}"), 0.1 + i)
            async with anyio.create_task_group() as tg:
                for costs in replicas:
                    tg.start_soon(costs.save)
            expected = {f"{i}-{r}-{j:02}" for i in range(writers) for r in range(turn + 1) for j in range(50)}
            assert set(await published(shared)) == expected


async def test_a_replica_on_another_machine_is_scaled_to_this_ones(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Only the order matters, but the order of a mix: this machine's own records and the fleet's,
    measured on a machine twice as slow. The fleet's are scaled by how the kernels both measured
    compare, so that a kernel only the fleet measured sorts among this machine's own."""
    async with tier(redis_server) as shared:
        slow = await replica(tmp_path / "slow", shared)
        await slow.expect(features("any"))
        for key, seconds in (("a", 2.0), ("b", 4.0), ("c", 6.0), ("fleet-only", 3.0)):
            slow.record(features(key), seconds)
        await slow.save()
        fast = await replica(tmp_path / "fast", shared)
        for key, seconds in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
            fast.record(features(key), seconds)
        await fast.save()  # this machine's own file, before it reads the fleet's
        slow.record(features("c"), 12.0)  # measured again (a busy moment): now (6 + 12) / 2
        await slow.save()
        again = await replica(tmp_path / "fast", shared)
        assert await again.expect(features("c")) == pytest.approx(3.0)  # its own record wins, not 4.5
        assert await again.expect(features("fleet-only")) == pytest.approx(1.5, rel=1e-3)


@pytest.mark.parametrize("damage", ["garbage", "nonsense rows", "oversized", "unsigned", "another key"])
async def test_a_damaged_or_forged_document_is_ignored_and_replaced(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    client: Any = redis_server.client()
    name = document_name(KEY)
    good = {"format": 1, "records": {"planted": [9.0, "family", 1000, 4, 3, 1700000000]}}
    async with tier(redis_server) as shared, tier(redis_server, OTHER_KEY) as other:
        if damage == "garbage":  # signed with the fleet's key, but not JSON
            assert await shared.update_document(DOCUMENT, COSTS_MAX_BYTES, lambda _: b"{not json")
        elif damage == "nonsense rows":  # signed, JSON: one good row among rows that make no sense
            rows = {"nan": [float("nan"), "family", 1000, 4, 3, 1], "negative": [1.0, "family", -5, 4, 3, 1]}
            # Dated years ahead: it would outlive every real record, the newest being kept.
            rows["future"] = [1.0, "family", 1000, 4, 3, 9.9e10]
            text = json.dumps(
                {"format": 1, "records": {**rows, "fine": [0.5, "family", 1000, 4, 3, 1700000000]}}
            )
            assert await shared.update_document(DOCUMENT, COSTS_MAX_BYTES, lambda _: text.encode())
        elif damage == "oversized":  # never read: refused by its size alone
            client.set(name, b" " * (COSTS_MAX_BYTES + 1))
        elif damage == "unsigned":
            client.set(name, json.dumps(good).encode())
        else:  # signed, but with another key: a replica that holds that key cannot speak for this fleet
            assert await other.update_document(DOCUMENT, COSTS_MAX_BYTES, lambda _: json.dumps(good).encode())
            client.rename(document_name(OTHER_KEY), name)
        planted = client.get(name)

        caplog.set_level(logging.WARNING, logger="acompile")
        costs = await replica(tmp_path, shared)
        with anyio.fail_after(5):
            guess = await costs.expect(features("planted"))
        assert guess != pytest.approx(9.0)
        if damage == "nonsense rows":
            assert await costs.expect(features("fine")) == pytest.approx(0.5)
            assert costs.counts["shared_loaded"] == 1
        else:
            assert costs.counts["shared_loaded"] == 0
        assert costs.record(features("new"), 1.0)
        await costs.save()
        # Replaced by a document this fleet reads, with the sensible rows that were there.
        assert client.get(name) != planted
        kept = await published(shared)
        assert set(kept) == ({"new", "fine"} if damage == "nonsense rows" else {"new"})
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]


@pytest.mark.parametrize("fault", ["stopped", "killed"])
async def test_an_unreachable_tier_costs_a_load_and_a_save_a_moment_only(
    tmp_path: Path, redis_server: RedisServer, fault: str
) -> None:
    async with tier(redis_server) as shared:
        fleet = await replica(tmp_path / "fleet", shared)
        fleet.record(features("k"), 1.5)
        await fleet.save()
        assert redis_server.process is not None
        pid = redis_server.process.pid
        if fault == "stopped":
            os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers
        else:
            redis_server.stop()
        try:
            costs = await replica(tmp_path / "fresh", shared)
            started = time.monotonic()
            guess = await costs.expect(features("k"))
            assert time.monotonic() - started < LOAD_DEADLINE + MARGIN
            assert guess != pytest.approx(1.5)  # a guess: the fleet's record was out of reach
            costs.record(features("new"), 1.0)
            started = time.monotonic()
            await costs.save()  # never raises
            assert time.monotonic() - started < SAVE_DEADLINE + MARGIN
            assert set(local_records(tmp_path / "fresh")) == {"new"}
        finally:
            if fault == "stopped":
                os.kill(pid, signal.SIGCONT)


async def test_a_document_of_more_records_than_kept_is_cut_to_the_newest_and_a_save_keeps_its_deadline(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A document written by something else than a replica, with more rows than a replica keeps,
    is read as its newest MAX_RECORDS; and a document that changes under every write (a hostile
    writer, or a very busy fleet) costs a save its deadline, not more."""
    client: Any = redis_server.client()
    name = document_name(KEY)
    now = time.time()
    rows = {f"k{i}": [1.0, "family", 1000, 4, 3, round(now) - i] for i in range(COSTS_MAX_RECORDS + 500)}
    text = json.dumps({"format": 1, "records": rows}).encode()
    async with tier(redis_server) as shared:
        assert await shared.update_document(DOCUMENT, 4 << 20, lambda _: text)
        costs = await replica(tmp_path / "a", shared)
        await costs.expect(features("any"))
        assert costs.counts["shared_loaded"] == COSTS_MAX_RECORDS
        assert await costs.expect(features(f"k{COSTS_MAX_RECORDS - 1}")) == pytest.approx(1.0)

        # Two signed documents near the size read (each try of a write parses one), set in turn
        # without pause by another thread, while this replica keeps measuring compiles.
        values = []
        for i in range(2):
            family = f"{i}" * 300  # some 700 KB: read, and parsed at each try
            big = {f"w{i}-{j}": [1.0, family, 1000, 4, 3, round(now)] for j in range(COSTS_MAX_RECORDS)}
            doc = json.dumps({"format": 1, "records": big})
            assert await shared.update_document(DOCUMENT, 4 << 20, lambda _, d=doc: d.encode())
            values.append(client.get(name))
        stop = False

        def rewrite() -> None:
            writer: Any = redis_server.client()
            i = 0
            while not stop:
                writer.set(name, values[i % 2])
                i += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rewrite)
            try:
                busy = await replica(tmp_path / "b", shared)
                await busy.expect(features("any"))

                async def measuring() -> None:
                    for i in range(100):
                        busy.record(features(f"mine{i}"), 1.0)
                        await anyio.sleep(0.05)

                tg.start_soon(measuring)
                started = time.monotonic()
                await busy.save()
                assert time.monotonic() - started < 2.0 + 0.5
            finally:
                stop = True
                tg.cancel_scope.cancel()
