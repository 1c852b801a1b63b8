"""The shared tier on an object store (a real S3-compatible server process on loopback: moto's
server mode, started by each test) and on a shared folder (``file://``), with the faults a fleet
meets: a server killed mid-read and mid-write, a stall, a forged object, a planted lease, a bucket
or folder that is not there."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from conftest import S3_CREDENTIALS, TARGET, RedisServer, S3Server, asyncio_only, subprocess_env, with_shared
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._backends import prepare_triton
from acompile._cache import SharedTier
from acompile._targets import parse_target

pytestmark = pytest.mark.anyio
KEY = "a-signing-key-for-the-store-tests"
SECRET = S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]


def spec(block: int = 64) -> acompile.TritonSpec:
    return acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})


class Fleet:
    """Where a fleet's tier is (a bucket of the test's server, or a folder), and its objects as
    the store itself shows them (not through acompile)."""

    def __init__(self, kind: str, tmp_path: Path, server: S3Server | None) -> None:
        self.kind = kind
        self.server = server
        if server is not None:
            self.bucket = server.bucket()
            self.url = server.url(self.bucket)
        else:
            self.folder = tmp_path / "nfs"
            self.folder.mkdir()
            self.url = f"file://{self.folder}"

    def objects(self) -> list[str]:
        """Every object's name under the tier's prefix (``<namespace>/<key>``, ``lease/...``)."""
        if self.server is not None:
            return [k.removeprefix("acompile/") for k in self.server.keys(self.bucket)]
        return sorted(
            p.relative_to(self.folder).as_posix()
            for p in self.folder.rglob("*")
            if p.is_file() and not p.relative_to(self.folder).as_posix().startswith(".incoming")
        )

    def put(self, name: str, data: bytes) -> None:
        if self.server is not None:
            self.server.put(self.bucket, f"acompile/{name}", data)
        else:
            (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
            (self.folder / name).write_bytes(data)

    def get(self, name: str) -> bytes:
        if self.server is not None:
            return self.server.get(self.bucket, f"acompile/{name}")
        return (self.folder / name).read_bytes()


@pytest.fixture(params=["s3", "file"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Fleet:
    server = request.getfixturevalue("s3_server") if request.param == "s3" else None
    return Fleet(request.param, tmp_path, server)


def pool(cache_dir: Path, where: str, **kw: Any) -> acompile.CompilePool:
    kw.setdefault("signing_key", KEY)
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **with_shared(where, **kw))


async def key_of(s: acompile.TritonSpec, tmp_path: Path) -> str:
    return (await prepare_triton(s, parse_target(TARGET), tmp_path / "memo")).key


def namespace() -> str:
    return SharedTier(None, KEY.encode()).namespace


# -- what users get ----------------------------------------------------------------------------


@asyncio_only  # the subject is two processes and a store, not the loop
async def test_a_second_machine_takes_the_fleets_entry_from_the_store(tmp_path: Path, fleet: Fleet) -> None:
    # The first machine: another process, its own cache folder; it compiles and publishes.
    child = f"""
import anyio, acompile
from kernels_for_tests import ADD_SIG, add_kernel
async def main():
    cache = acompile.SharedCache({fleet.url!r}, signing_key={KEY!r})
    async with acompile.CompilePool(1, target={TARGET!r}, cache_dir={str(tmp_path / "first")!r},
                                    shared_cache=cache) as p:
        _, tier = await p.compile_with_tier(acompile.TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": 64}}))
        assert tier == "compile", tier
anyio.run(main)
"""
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=subprocess_env()
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    entries = [n for n in fleet.objects() if n.startswith(namespace() + "/")]
    assert len(entries) >= 1 and not [n for n in fleet.objects() if n.startswith("lease/")]
    async with pool(tmp_path / "second", fleet.url, prestart=False) as p:
        kernel, tier = await p.compile_with_tier(spec())
        stats = p.stats()
    assert tier == "shared" and stats["workers"]["started"] == 0
    assert stats["cache"]["hits_shared"] == 1 and stats["cache"]["shared_kind"] == fleet.kind
    assert kernel.asm["ptx"]


async def test_replicas_missing_the_same_kernels_at_once_compile_each_once(
    tmp_path: Path, fleet: Fleet
) -> None:
    blocks = [64, 128, 256, 512]
    pools = [pool(tmp_path / f"r{i}", fleet.url) for i in range(3)]
    async with pools[0] as a, pools[1] as b, pools[2] as c:
        for p in (a, b, c):
            await p.wait_ready()
        async with anyio.create_task_group() as tg:
            for p in (a, b, c):
                for block in blocks:
                    tg.start_soon(p.compile, spec(block))
        compiled = sum(p.stats()["compiled"] for p in (a, b, c))
        waits = sum(p.stats()["cache"]["fleet_waits"] for p in (a, b, c))
    assert compiled == len(blocks), f"{compiled} compiles of {len(blocks)} kernels ({waits} waits)"
    # Every lease was given back; every entry is there.
    names = fleet.objects()
    assert not [n for n in names if n.startswith("lease/")], names
    assert len([n for n in names if n.startswith(namespace() + "/")]) == len(blocks)


async def test_a_forged_object_is_refused_and_replaced(tmp_path: Path, fleet: Fleet) -> None:
    key = await key_of(spec(2048), tmp_path)
    forged = b"ACSIG2" + b"\0" * 32 + b"a forged entry: it does not verify"
    fleet.put(f"{namespace()}/{key}", forged)
    async with pool(tmp_path / "a", fleet.url) as p:
        _, tier = await p.compile_with_tier(spec(2048))
        stats = p.stats()["cache"]
    assert tier == "compile" and stats["shared_rejected"] == 1
    assert fleet.get(f"{namespace()}/{key}") != forged  # replaced by the compiled one
    async with pool(tmp_path / "b", fleet.url, prestart=False) as p:
        _, tier = await p.compile_with_tier(spec(2048))
    assert tier == "shared"


@pytest.mark.parametrize("planted", [b"planted by someone without the key", "expired"])
async def test_a_planted_or_dead_lease_holds_nobody_and_is_taken_over(
    tmp_path: Path, fleet: Fleet, planted: bytes | str
) -> None:
    key = await key_of(spec(1024), tmp_path)
    if planted == "expired":  # a genuine lease of this fleet, its holder gone a second ago
        tier = SharedTier(None, KEY.encode())
        planted = tier.lease_value(key, "a-replica-that-died", time.time() - 1)
    assert isinstance(planted, bytes)
    fleet.put(f"lease/{namespace()}/{key}", planted)
    async with pool(tmp_path / "a", fleet.url, fleet_wait=600) as p:
        with anyio.fail_after(120):  # a guard: honouring the lease would wait 600 s
            _, tier = await p.compile_with_tier(spec(1024))
        stats = p.stats()["cache"]
    assert tier == "compile" and stats["fleet_waits"] == 0 and stats["shared_ignored_leases"] >= 1
    # Taken over (a conditional write over what was read), then given back: nothing left.
    assert f"lease/{namespace()}/{key}" not in fleet.objects()


async def test_a_bucket_or_folder_that_is_not_there_is_an_error_at_the_pools_entry(
    tmp_path: Path, s3_server: S3Server
) -> None:
    for url, said in [
        (s3_server.url("no-such-bucket"), "the bucket does not exist"),
        (f"file://{tmp_path}/not-mounted", "the folder does not exist"),
    ]:
        p = pool(tmp_path / "cache", url)
        with pytest.raises(ValueError, match=said):
            async with p:
                pass


def test_urls_that_cannot_work_are_refused_when_the_tier_is_made() -> None:
    for url, said in [
        ("s3://", "names no bucket"),
        ("s3://key:secret@bucket/p", "credentials do not go in the URL"),
        ("s3://bucket/p?endpoint=http://10.0.0.1:9000", "allow_http=true"),
        ("s3://bucket/p?endpoint=ftp://x", "http"),
        ("s3://bucket/p?colour=blue", "unknown option"),
        ("gs://bucket/p?region=eu", "options of s3:// URLs"),
        ("file://relative/path", "names no host"),
        ("file:///", "absolute path"),
        ("file:///mnt/x?endpoint=http://x", "options of object stores"),
        ("s3://bucket/p?timeout=0", "timeout"),
        ("s3://bucket/p?namespace=x", "unknown option"),
        (["file:///mnt/a", "file:///mnt/a"], "the same URL twice"),
    ]:
        with pytest.raises(ValueError, match=said):
            acompile.SharedCache(url)
    # A credential put in the query by mistake is never repeated back.
    with pytest.raises(ValueError, match="unknown option") as caught:
        acompile.SharedCache("s3://bucket/p?aws_secret_access_key=hunter2-secret")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ValueError, match="credentials do not go in the endpoint") as caught:
        acompile.SharedCache("s3://bucket/p?endpoint=https://user:hunter2-pw@minio.internal")
    assert "hunter2" not in str(caught.value)
    assert acompile.SharedCache("s3://bucket/p?timeout=1500ms") and acompile.SharedCache(
        "s3://b/p?timeout=2s"
    )
    shown = repr(acompile.SharedCache("s3://bucket/p?region=eu-west-1", signing_key=KEY))
    assert KEY not in shown and "s3://bucket/p" in shown


# -- faults -------------------------------------------------------------------------------------


@asyncio_only  # the subject is a stalled server and the tier's deadline, not the loop
async def test_a_stalled_store_is_a_miss_after_a_bounded_wait_and_never_stalls_the_loop(
    tmp_path: Path, s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "acompile")
    bucket = s3_server.bucket()
    url = s3_server.url(bucket)
    gaps: list[float] = []

    async def tick() -> None:  # how long the loop ever goes without running this task
        last = time.monotonic()
        while True:
            await anyio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    assert s3_server.process is not None
    async with pool(tmp_path / "a", url) as p:
        await p.wait_ready()
        os.kill(s3_server.process.pid, signal.SIGSTOP)  # a 5 s stall, from now
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                t0 = time.monotonic()
                _, tier = await p.compile_with_tier(spec(4096))
                took = time.monotonic() - t0
                tg.cancel_scope.cancel()
            assert tier == "compile" and took < 30
            stats = p.stats()["cache"]
            assert stats["shared_available"] is False and stats["shared_errors"] >= 1
            await anyio.sleep(max(0.0, 5 - took))
        finally:
            os.kill(s3_server.process.pid, signal.SIGCONT)
        with anyio.fail_after(30):  # past its back-off, the next operation finds it again
            while not p.stats()["cache"]["shared_available"]:
                await p.share(["0" * 64])
                await anyio.sleep(0.1)
    assert max(gaps) < 0.5, f"the event loop stood still for {max(gaps):.2f} s"
    assert SECRET not in caplog.text


@asyncio_only  # the subject is a server that dies, not the loop
async def test_the_server_killed_mid_write_and_mid_read_loses_nothing(
    tmp_path: Path, s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "acompile")
    bucket = s3_server.bucket()
    url = s3_server.url(bucket)
    blocks = [64, 128, 256, 512, 1024, 2048]
    assert s3_server.process is not None
    # Mid-write: the server dies while the first replica's publications are on their way.
    async with pool(tmp_path / "a", url) as a:
        async with anyio.create_task_group() as tg:
            for block in blocks[:3]:
                tg.start_soon(a.compile, spec(block))
        s3_server.stop()
        for block in blocks[3:]:
            await a.compile(spec(block))  # compiled here, its publication a miss
        stats = a.stats()["cache"]
    assert stats["shared_writes"] + stats["shared_write_failures"] == len(blocks)
    assert a.stats()["compiled"] == len(blocks)  # every request answered
    # Nothing lost: the next process on this host has every kernel on its disk.
    async with pool(tmp_path / "a", url, prestart=False) as a:
        for block in blocks:
            assert (await a.compile_with_tier(spec(block)))[1] == "disk"

    # Mid-read: a fresh server, filled, dies while a second replica reads from it.
    s3_server.start()
    url = s3_server.url(s3_server.bucket())
    async with pool(tmp_path / "fill", url) as a:
        for block in blocks:
            await a.compile(spec(block))
    async with pool(tmp_path / "b", url) as b:
        results: list[str] = []

        async def ask(block: int) -> None:
            results.append((await b.compile_with_tier(spec(block)))[1])

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, blocks[0])
            with anyio.fail_after(30):
                while not results:  # noqa: ASYNC110 - the kill lands between reads
                    await anyio.sleep(0.001)
            s3_server.stop()
            for block in blocks[1:]:
                tg.start_soon(ask, block)
    assert len(results) == len(blocks) and results[0] == "shared"
    assert set(results[1:]) <= {"shared", "compile"} and "compile" in results[1:]
    assert SECRET not in caplog.text


# -- a shared folder: atomic publish -----------------------------------------------------------


@asyncio_only  # threads and files, not the loop
async def test_a_folder_reader_sees_a_whole_value_or_none_and_follows_no_link(tmp_path: Path) -> None:
    folder = tmp_path / "nfs"
    folder.mkdir()
    url = f"file://{folder}"
    writer = SharedTier.connect_later(url, KEY.encode())
    reader = SharedTier.connect_later(url, KEY.encode())
    await writer.open()
    await reader.open()
    values = [bytes([i]) * (3 << 20) for i in range(1, 5)]  # 3 MiB each: many writes per value
    seen: set[bytes] = set()
    stop = anyio.Event()

    async def read() -> None:
        while not stop.is_set():
            data = await reader.get("k" * 16)
            if data is not None:
                assert data in values, "a torn or mixed value was read"
                seen.add(data[:1])
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        for _ in range(3):
            for value in values:
                assert await writer.set("k" * 16, value)
        stop.set()
    assert seen and reader.counts["rejected"] == 0
    assert not list((folder / ".incoming").iterdir())  # nothing staged is left behind
    # A link placed where an entry should be is not followed.
    target = tmp_path / "elsewhere"
    target.write_bytes(values[0])
    entry = folder / namespace() / ("j" * 16)
    entry.symlink_to(target)
    assert await reader.get("j" * 16) is None and reader.counts["rejected"] == 1
    await writer.close()
    await reader.close()


# -- tiers together ----------------------------------------------------------------------------


async def test_a_chain_of_redis_then_a_folder_copies_back_skips_big_entries_and_names_each_hit(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    folder = tmp_path / "nfs"
    folder.mkdir()
    chain = [redis_server.url, f"file://{folder}"]
    client: Any = redis_server.client()

    def cache(**kw: Any) -> acompile.SharedCache:
        return acompile.SharedCache(chain, signing_key=KEY, **kw)

    # write="through": the fleet has the entry when the request returns.
    async with acompile.CompilePool(
        1, target=TARGET, cache_dir=tmp_path / "a", shared_cache=cache(write="through")
    ) as p:
        await p.compile(spec(64))
        in_redis = [k for k in client.keys("*") if k.startswith(b"acompile:" + namespace().encode())]
        in_folder = list((folder / namespace()).iterdir())
    assert len(in_redis) == 1 and len(in_folder) == 1
    # Redis loses it (a restart): the next replica finds it in the folder, and copies it back.
    client.flushall()
    async with acompile.CompilePool(
        1, target=TARGET, cache_dir=tmp_path / "b", shared_cache=cache(), prestart=False
    ) as p:
        _, tier = await p.compile_with_tier(spec(64))
        stats = p.stats()["cache"]
    assert tier == "shared" and stats["shared_kind"] == "redis+file"
    assert stats["shared_tiers"]["file"]["hits"] == 1 and stats["shared_tiers"]["redis"]["hits"] == 0
    assert [k for k in client.keys("*") if k.startswith(b"acompile:" + namespace().encode())]  # copied back
    async with acompile.CompilePool(
        1, target=TARGET, cache_dir=tmp_path / "c", shared_cache=cache(), prestart=False
    ) as p:
        _, tier = await p.compile_with_tier(spec(64))
        assert p.stats()["cache"]["shared_tiers"]["redis"]["hits"] == 1
    # A Redis kept for small entries: a kernel's entry skips it (a policy, not a failure).
    small = acompile.SharedCache([redis_server.url + "?max_value=1KiB", f"file://{folder}"], signing_key=KEY)
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "d", shared_cache=small) as p:
        await p.compile(spec(128))
    stats = p.stats()["cache"]
    assert stats["shared_tiers"]["redis"]["skipped_by_size"] == 1
    assert (
        stats["shared_tiers"]["redis"]["write_failures"] == 0 and stats["shared_tiers"]["file"]["writes"] == 1
    )


# -- operations --------------------------------------------------------------------------------


async def test_cache_prune_removes_old_entries_and_dead_leases_from_the_tier(
    tmp_path: Path, fleet: Fleet
) -> None:
    async with pool(tmp_path / "a", fleet.url) as p:
        await p.compile(spec(64))
    old = f"{namespace()}/{'e' * 64}"
    fleet.put(old, b"an entry nobody asked for in a while")
    fleet.put(f"lease/{namespace()}/{'f' * 64}", b"a dead replica's lease")
    if fleet.server is None:  # a folder: its files' times say how old they are
        for name in (old, f"lease/{namespace()}/{'f' * 64}"):
            os.utime(fleet.folder / name, (time.time() - 90 * 86400,) * 2)
    cli = [sys.executable, "-m", "acompile", "cache", "prune", "--shared-cache", fleet.url]
    env = subprocess_env()

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=120, env=env)

    documents = [n for n in fleet.objects() if n.startswith("costs/")]
    assert documents  # the pool published its compile times
    refused = await anyio.to_thread.run_sync(run, "--max-size", "1GiB")
    assert refused.returncode == 2 and "by age only" in refused.stderr
    age = "30d" if fleet.server is None else "0s"  # a store's objects are all new here: 0s takes all
    dry = await anyio.to_thread.run_sync(run, "--max-age", age, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert old in [n for n in fleet.objects()]  # a dry run removes nothing
    done = await anyio.to_thread.run_sync(run, "--max-age", age)
    assert done.returncode == 0, done.stderr
    left = fleet.objects()
    assert old not in left
    # A lease goes once it has not been rewritten for a minute (a live holder rewrites it every
    # two seconds): the folder's is 90 days old; the store's was written a moment ago, and stays.
    assert bool([n for n in left if n.startswith("lease/")]) == (fleet.server is not None)
    if fleet.server is None:
        assert len([n for n in left if n.startswith(namespace())]) == 1, left  # the new entry stays
        assert "removed 1 entries" in done.stdout and "1 leases" in done.stdout, done.stdout
    # The fleet's documents (its compile times) are not entries: pruning leaves them.
    assert [n for n in left if n.startswith("costs/")] == documents
    assert SECRET not in done.stdout + done.stderr


def test_warmup_fills_every_tier_of_a_chain(tmp_path: Path, redis_server: RedisServer) -> None:
    from test_cli_shared import make_manifest, warmup

    manifest = make_manifest(tmp_path)
    folder = tmp_path / "nfs"
    folder.mkdir()
    chain = f"{redis_server.url} file://{folder}"
    first, shared = warmup(manifest, tmp_path / "a", "--shared-cache", chain, key=KEY)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (shared["kernels"], shared["published"], shared["missing"]) == (2, 2, 0), shared
    client: Any = redis_server.client()
    assert len([k for k in client.keys("*") if k.startswith(b"acompile:" + namespace().encode())]) == 2
    assert len(list((folder / namespace()).iterdir())) == 2
    # Redis restarted empty: the warm disk fills it again, and the folder is found complete.
    client.flushall()
    again, shared = warmup(manifest, tmp_path / "a", "--shared-cache", chain, key=KEY)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (shared["found"], shared["published"], shared["missing"]) == (0, 2, 0), shared
    assert len([k for k in client.keys("*") if k.startswith(b"acompile:" + namespace().encode())]) == 2
    # A new folder behind the warm Redis, and an empty cache folder: the kernels come from Redis,
    # and the new tier is filled from it (not reported found where it was not).
    later = tmp_path / "nfs2"
    later.mkdir()
    fresh, shared = warmup(
        manifest, tmp_path / "fresh", "--shared-cache", f"{redis_server.url} file://{later}", key=KEY
    )
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert (shared["found"], shared["published"], shared["missing"]) == (0, 2, 0), shared
    assert len(list((later / namespace()).iterdir())) == 2
    bad, _ = warmup(manifest, tmp_path / "a", "--shared-cache", f"{redis_server.url} ftp://x", key=KEY)
    assert bad.returncode == 2 and "ftp://x" in bad.stderr


# -- a shared folder other users can write to ----------------------------------------------------


def _plant(root: str, namespace_: str, key: str, elsewhere: str) -> list[str]:
    """As nobody: a FIFO where an entry goes, and a link where the leases' folder goes."""
    import os as os_

    os_.makedirs(f"{root}/{namespace_}", mode=0o777, exist_ok=True)
    os_.mkfifo(f"{root}/{namespace_}/{key}")
    os_.symlink(elsewhere, f"{root}/lease")
    return sorted(os_.listdir(root))


@asyncio_only  # files, links and FIFOs, not the loop
async def test_links_and_fifos_planted_in_a_shared_folder_by_another_user_are_neither_followed_nor_waited_on(
    tmp_path: Path,
) -> None:
    from attacker import as_nobody, shared_folder

    with shared_folder() as base:
        # The fleet's folder, which its users (and so nobody here) may write to, and a folder of
        # the attacker's own elsewhere.
        folder, elsewhere = base / "nfs", base / "elsewhere"
        for made in (folder, elsewhere):
            made.mkdir()
            made.chmod(0o777)
        key = await key_of(spec(64), tmp_path)
        as_nobody(_plant, str(folder), namespace(), key, str(elsewhere))
        async with pool(tmp_path / "a", f"file://{folder}", fleet_wait=600) as p:
            with anyio.fail_after(60):  # a guard: a reader blocked on the FIFO would hang here
                _, tier = await p.compile_with_tier(spec(64))
            stats = p.stats()["cache"]
        assert tier == "compile" and stats["shared_rejected"] >= 1 and stats["fleet_waits"] == 0
        assert list(elsewhere.iterdir()) == []  # no lease written through the link
        assert (folder / "lease").is_symlink()
        # The FIFO was replaced by the entry (renamed over it, never opened): the next replica
        # has it.
        assert (folder / namespace() / key).is_file()
        async with pool(tmp_path / "b", f"file://{folder}", prestart=False) as p:
            assert (await p.compile_with_tier(spec(64)))[1] == "shared"


def test_cache_explain_names_the_shared_tiers_that_hold_an_entry(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    from test_cli_shared import make_manifest, warmup

    manifest = make_manifest(tmp_path)
    folder = tmp_path / "nfs"
    folder.mkdir()
    out, _ = warmup(manifest, tmp_path / "a", "--shared-cache", f"file://{folder}", key=KEY)
    assert out.returncode == 0, out.stdout + out.stderr
    key = next((folder / namespace()).iterdir()).name
    chain = f"{redis_server.url} file://{folder}"
    explained = subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "explain", key[:12], "--cache-dir", str(tmp_path / "a"),
         "--shared-cache", chain],
        capture_output=True, text=True, timeout=120, env=subprocess_env(ACOMPILE_SIGNING_KEY=KEY),
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    lines = explained.stdout.splitlines()
    assert any(line.startswith(f"  {redis_server.url}: does not hold it") for line in lines), explained.stdout
    assert any(line.startswith(f"  file://{folder}: holds it") for line in lines), explained.stdout


def test_cache_import_seeds_a_fleets_tier_from_a_bundle(tmp_path: Path, s3_server: S3Server) -> None:
    from test_cli_shared import make_manifest, warmup

    manifest = make_manifest(tmp_path)
    out, _ = warmup(manifest, tmp_path / "warm", key=KEY)
    assert out.returncode == 0, out.stdout + out.stderr
    env = subprocess_env(ACOMPILE_SIGNING_KEY=KEY)

    def cache(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "acompile", "cache", *args], capture_output=True,
                              text=True, timeout=120, env=env)  # fmt: skip

    bundle = tmp_path / "fleet.tar.gz"
    assert cache("export", str(bundle), "--cache-dir", str(tmp_path / "warm")).returncode == 0
    bucket = s3_server.bucket()
    url = s3_server.url(bucket)
    done = cache("import", str(bundle), "--cache-dir", str(tmp_path / "fresh"), "--shared-cache", url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 entries there (0 found, 2 published)" in done.stdout, done.stdout
    assert len([k for k in s3_server.keys(bucket) if k.startswith(f"acompile/{namespace()}/")]) == 2
    assert SECRET not in done.stdout + done.stderr
    s3_server.stop()  # the tier gone: the import itself is done, the publication is said to fail
    gone = cache("import", str(bundle), "--cache-dir", str(tmp_path / "third"), "--shared-cache", url)
    assert gone.returncode == 1 and "did not reach the shared tier" in gone.stderr, gone.stdout + gone.stderr


@asyncio_only  # a mount, not the loop
async def test_a_replica_that_may_only_read_the_folder_reads_it_and_publishes_nothing(
    tmp_path: Path, mounts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "acompile")
    folder, read_only = tmp_path / "nfs", tmp_path / "ro"
    folder.mkdir()
    async with pool(tmp_path / "a", f"file://{folder}") as p:
        await p.compile(spec(64))
    mounts.read_only(folder, read_only)
    async with pool(tmp_path / "b", f"file://{read_only}") as p:
        assert (await p.compile_with_tier(spec(64)))[1] == "shared"
        assert (await p.compile_with_tier(spec(128)))[1] == "compile"
        assert (await p.compile_with_tier(spec(256)))[1] == "compile"
    stats = p.stats()["cache"]
    assert stats["shared_available"] is True and stats["shared_errors"] == 0  # an answer, not an outage
    assert stats["shared_write_failures"] == 2 and stats["shared_writes"] == 0
    assert len([r for r in caplog.records if "refuses this process's writes" in r.message]) == 1


@asyncio_only  # the environment's endpoint and a process's exit, not the loop
async def test_an_http_endpoint_from_the_environment_needs_allow_http_and_processes_exit_cleanly(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_server.bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    p = pool(tmp_path / "a", f"s3://{bucket}/acompile")
    with pytest.raises(ValueError, match="allow_http=true"):
        async with p:
            pass
    # Short-lived processes that list the store exit with 0, every time (obstore's runtime
    # threads are let finish before the interpreter does: without it, about 1 exit in 6 aborts).
    url = s3_server.url(bucket)
    code = f"""
import anyio
from acompile._cache import prune_storage
anyio.run(lambda: prune_storage({url!r}, 1e9, dry_run=True))  # one listing, as a cron job's prune
"""

    def runs() -> list[int]:
        env = subprocess_env(**S3_CREDENTIALS)
        return [subprocess.run([sys.executable, "-c", code], env=env, timeout=60, capture_output=True).returncode
                for _ in range(20)]  # fmt: skip

    codes = await anyio.to_thread.run_sync(runs)
    assert codes == [0] * 20, codes


@asyncio_only  # a stopped server at the pool's entry, not the loop
async def test_a_store_stopped_before_the_pool_starts_delays_its_entry_by_two_deadlines_at_most(
    tmp_path: Path, s3_server: S3Server
) -> None:
    url = s3_server.url(s3_server.bucket())
    assert s3_server.process is not None
    os.kill(s3_server.process.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        async with pool(tmp_path / "a", url) as p:
            entered = time.monotonic() - t0
            assert p.stats()["cache"]["shared_available"] is False
    finally:
        os.kill(s3_server.process.pid, signal.SIGCONT)
    assert entered < 2 * 2.0 + 3, f"entering the pool took {entered:.1f} s"


@asyncio_only  # a cancelled lease, not the loop
async def test_a_lease_whose_taker_was_cancelled_holds_nobody_and_is_given_back(tmp_path: Path) -> None:
    folder = tmp_path / "nfs"
    folder.mkdir()
    tier = SharedTier.connect_later(f"file://{folder}", KEY.encode())
    await tier.open()
    create = tier.cache.add

    async def slow_answer(*args: Any, **kwargs: Any) -> Any:
        # The create lands at once; its answer is slow (a network that stalls on the way back).
        answer = await create(*args, **kwargs)
        await anyio.sleep(30)
        return answer

    tier.cache.add = slow_answer
    with anyio.move_on_after(0.5):  # the caller's deadline fires while the answer is on its way
        await tier.take_lease("c" * 64, 6)
    with anyio.move_on_after(0.5):
        await tier.take_lease("d" * 64, 6)
    tier.cache.add = create
    leases = folder / "lease" / namespace()
    assert (leases / ("c" * 64)).exists() and (leases / ("d" * 64)).exists()  # both landed
    # The same replica asks again: its own orphan holds it up for no time at all.
    assert await tier.take_lease("c" * 64, 6) is True
    await tier.release_lease("c" * 64)
    assert not (leases / ("c" * 64)).exists()
    await tier.close()  # the other orphan is given back as the tier closes
    assert not (leases / ("d" * 64)).exists()


async def test_prune_removes_only_the_tiers_own_layout_and_refuses_a_root_in_disguise(tmp_path: Path) -> None:
    from acompile._cache import prune_storage

    folder = tmp_path / "nfs"
    ns, key = namespace(), "e" * 64
    (folder / ns).mkdir(parents=True)
    (folder / ns / key).write_bytes(b"an old entry")
    (folder / "lease" / ns).mkdir(parents=True)
    (folder / "lease" / ns / key).write_bytes(b"an old lease")
    # Files of other programs, under the folder, whose names look like keys: never the tier's.
    (folder / "var" / "lib" / "blobs" / "sha256").mkdir(parents=True)
    (folder / "var" / "lib" / "blobs" / "sha256" / key).write_bytes(b"someone else's blob")
    (folder / "costs").mkdir()
    (folder / "costs" / ns).write_bytes(b"the fleet's compile times")
    (folder / ".incoming").mkdir()
    (folder / ".incoming" / "host.1.dead").write_bytes(b"staged by a writer that died")
    old = time.time() - 90 * 86400
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    report = await prune_storage(f"file://{folder}", 30 * 86400)
    assert (report["removed"], report["leases_removed"], report["staged_removed"]) == (1, 1, 1), report
    assert (folder / "var" / "lib" / "blobs" / "sha256" / key).exists()
    assert (folder / "costs" / ns).exists()
    for disguised in ["file:///.", "file:////", "file:///tmp/..", "file:///%2F", f"file://{folder}/../nfs"]:
        with pytest.raises(ValueError):
            acompile.SharedCache(disguised)


@asyncio_only  # files, not the loop
async def test_one_unreadable_value_is_refused_and_the_tier_stays_on(tmp_path: Path) -> None:
    folder = tmp_path / "nfs"
    folder.mkdir()
    key = await key_of(spec(64), tmp_path)
    (folder / namespace() / key).mkdir(parents=True)  # a folder where an entry goes
    (folder / "lease" / namespace() / key).mkdir(parents=True)  # and where its lease goes
    async with pool(tmp_path / "a", f"file://{folder}") as p:
        assert (await p.compile_with_tier(spec(64)))[1] == "compile"
        await p.compile(spec(128))  # another kernel goes through the tier as ever
    stats = p.stats()["cache"]  # after the exit: its publications are out
    assert stats["shared_available"] is True and stats["shared_errors"] == 0
    assert stats["shared_rejected"] >= 1 and stats["shared_writes"] >= 1
