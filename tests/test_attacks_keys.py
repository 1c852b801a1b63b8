"""Attacks on signing keys, host code, the shared tier's values and fleet leases (issue #26).

Real parts throughout: a redis-server on loopback, bundles written by ``cache export``, C++
libraries built by the system compiler. The forged library of each attack creates a marker file
from its constructor (``__attribute__((constructor))``): it runs as the library is loaded, so a
marker that stays absent says that the forged code never ran.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import ROOT, TARGET, RedisServer, asyncio_only, subprocess_env, with_shared

import acompile
from acompile._backends import CppSpec, load_parent
from acompile._cache import (
    BUNDLE_MANIFEST,
    Entry,
    SharedTier,
    export_bundle,
    import_bundle,
    open_shared_cache,
    read_entry,
    signing_key_id,
)

pytestmark = pytest.mark.anyio
KEY = "a-signing-key-for-the-tests"

GOOD = 'extern "C" int answer() { return 42; }\n'
# A compile that takes seconds (std::regex at -O2): a lease is held through it.
SLOW = (
    "#include <regex>\n#include <string>\n"
    'extern "C" int matches_%d(const char* s) '
    '{ return std::regex_match(std::string(s), std::regex("[a-z]+[0-9]*")); }\n'
)


@pytest.fixture(autouse=True)
def no_signing_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOMPILE_SIGNING_KEY", raising=False)


def pool(cache_dir: Path, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(
        1, target=TARGET, cache_dir=cache_dir, preload=(), **with_shared(kw.pop("shared_cache", None), **kw)
    )


def evil_library(folder: Path, marker: Path) -> bytes:
    """A library whose constructor creates ``marker``, and whose answer() is not 42."""
    source = folder / "evil.cpp"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) "
        f'{{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
        'extern "C" int answer() { return 666; }\n'
    )
    out = folder / "evil.so"
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out.read_bytes()


def forged(genuine: Entry, library: bytes) -> bytes:
    """The genuine entry with its library swapped: an intact entry (its checksum matches)."""
    blobs = {**genuine.blobs, "so": library}
    return Entry(genuine.key, genuine.backend, genuine.name, blobs, genuine.meta).encode()


async def genuine_entry(cache_dir: Path, source: str = GOOD, **kw: Any) -> Entry:
    """Compile ``source`` in a pool of its own and return its entry (from the pool's disk)."""
    async with pool(cache_dir, **kw) as p:
        library = await p.cpp(source)
        assert library.answer() == 42
    entry = read_entry(cache_dir, library.key)
    assert entry is not None
    return entry


def rewrite_bundle(path: Path, out: Path, key: str, data: bytes) -> None:
    """The bundle at ``path`` with entry ``key`` replaced by ``data``; the description's digest is
    updated too (an unsigned bundle's digests authenticate nothing)."""
    with tarfile.open(path, "r:gz") as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    assert members[0][0] == BUNDLE_MANIFEST
    description = json.loads(members[0][1])
    description["digests"][key] = hashlib.sha256(data).hexdigest()
    members[0] = (BUNDLE_MANIFEST, json.dumps(description).encode())
    members = [(n, data if n == f"entries/{key}" else d) for n, d in members]
    with tarfile.open(out, "w:gz") as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acompile", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=subprocess_env(**env),
    )


# --- a key that is set is a key -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "is set but empty"),
        ("   ", "is set but holds only whitespace"),
        ("\n", "is set but holds only whitespace"),
    ],
)
async def test_an_empty_signing_key_is_an_error_naming_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, says: str
) -> None:
    shared = "redis://127.0.0.1:1/0"
    monkeypatch.setenv("ACOMPILE_SIGNING_KEY", value)
    with pytest.raises(ValueError, match=rf"\$ACOMPILE_SIGNING_KEY {says}"):
        pool(tmp_path / "c", shared_cache=shared)
    with pytest.raises(ValueError, match=rf"\$ACOMPILE_SIGNING_KEY {says}"):
        await export_bundle(tmp_path / "c", tmp_path / "b.tar.gz")
    with pytest.raises(ValueError, match=rf"\$ACOMPILE_SIGNING_KEY {says}"):
        await import_bundle(tmp_path / "c", tmp_path / "b.tar.gz")
    monkeypatch.delenv("ACOMPILE_SIGNING_KEY")
    for option in (value, value.encode(), " " * 32):
        with pytest.raises(ValueError, match=r"signing_key is set but (empty|holds only whitespace)"):
            pool(tmp_path / "c", shared_cache=shared, signing_key=option)
        # A key given is checked where no tier uses it yet, too: the mistake is made now.
        with pytest.raises(ValueError, match=r"signing_key is set but (empty|holds only whitespace)"):
            pool(tmp_path / "c", signing_key=option)


# asyncio only: the commands run in processes of their own; this loop only waits for them.
@asyncio_only
@pytest.mark.parametrize("value", ["", "    "])
async def test_the_command_line_refuses_an_empty_signing_key_with_exit_2(tmp_path: Path, value: str) -> None:
    (tmp_path / "cache").mkdir()
    bundle = tmp_path / "b.tar.gz"
    await export_bundle(tmp_path / "cache", bundle)
    says = "is set but empty" if not value else "is set but holds only whitespace"
    commands = [
        ["cache", "import", str(bundle), "--cache-dir", str(tmp_path / "cache")],
        ["cache", "export", str(tmp_path / "out.tar.gz"), "--cache-dir", str(tmp_path / "cache")],
        ["warmup", str(tmp_path / "m.toml"), "--shared-cache", "redis://127.0.0.1:1/0"],
        ["run", "--shared-cache", "redis://127.0.0.1:1/0", "--", "true"],
    ]
    for command in commands:
        done = await anyio.to_thread.run_sync(lambda c=command: cli(*c, ACOMPILE_SIGNING_KEY=value))
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert f"$ACOMPILE_SIGNING_KEY {says}" in done.stderr, (command, done.stderr)
        assert "Traceback" not in done.stderr


# --- host code from bundles -------------------------------------------------------------------


async def test_host_code_from_a_bundle_not_signed_with_the_key_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "the-forged-library-ran"
    genuine = await genuine_entry(tmp_path / "maker")
    await export_bundle(tmp_path / "maker", tmp_path / "unsigned.tar.gz")
    tampered = tmp_path / "tampered.tar.gz"
    rewrite_bundle(
        tmp_path / "unsigned.tar.gz", tampered, genuine.key, forged(genuine, evil_library(tmp_path, marker))
    )

    # No key configured: the library is left out (every other entry would go in).
    report = await import_bundle(tmp_path / "victim", tampered)
    assert report.entries == 0 and not report.ok
    assert [name for name, _ in report.rejected] == [f"entries/{genuine.key}"]
    assert "host code" in report.rejected[0][1] and "unsafe_unsigned_host_code" in report.rejected[0][1]
    # The command line says so and exits 1.
    done = await anyio.to_thread.run_sync(
        lambda: cli("cache", "import", str(tampered), "--cache-dir", str(tmp_path / "victim-cli"))
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "host code" in done.stderr and "--unsafe-unsigned-host-code" in done.stderr
    # A key configured and --allow-unsigned: device code would go in, host code still does not.
    report = await import_bundle(tmp_path / "victim-keyed", tampered, signing_key=KEY, allow_unsigned=True)
    assert report.entries == 0 and "host code" in report.rejected[0][1]
    # The pools of those folders compile the library: the forged one is never loaded.
    for folder in ("victim", "victim-cli", "victim-keyed"):
        async with pool(tmp_path / folder) as p:
            library, tier = await p.compile_with_tier(CppSpec(GOOD))
            assert tier == "compile" and library.answer() == 42
    assert not marker.exists()

    # Opting in, by a name that says what it is: imported as it is.
    report = await import_bundle(tmp_path / "trusting", tampered, unsafe_unsigned_host_code=True)
    assert report.entries == 1 and report.ok
    # A bundle signed with the key carries its libraries.
    signed = tmp_path / "signed.tar.gz"
    await export_bundle(tmp_path / "maker", signed, signing_key=KEY)
    report = await import_bundle(tmp_path / "fleet", signed, signing_key=KEY)
    assert report.entries == 1 and report.signature == "verified"
    assert not marker.exists()


# --- host code from the shared tier -------------------------------------------------------------


async def test_a_forged_library_in_an_unsigned_shared_tier_is_never_loaded(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    marker = tmp_path / "the-forged-library-ran"
    genuine = await genuine_entry(tmp_path / "a", shared_cache=redis_server.url)  # published, unsigned
    client: Any = redis_server.client()
    name = f"acompile:unsigned:{genuine.key}"
    assert client.get(name) is not None
    client.set(name, forged(genuine, evil_library(tmp_path, marker)))

    async with pool(tmp_path / "b", shared_cache=redis_server.url) as p:
        library, tier = await p.compile_with_tier(CppSpec(GOOD))
        stats = p.stats()["cache"]
    assert tier == "compile" and library.answer() == 42 and not marker.exists()
    assert stats["shared_rejected"] == 1 and stats["hits_shared"] == 0
    # A keyed pool never reads the unsigned namespace at all.
    async with pool(tmp_path / "c", shared_cache=redis_server.url, signing_key=KEY) as p:
        _, tier = await p.compile_with_tier(CppSpec(GOOD))
    assert tier == "compile" and not marker.exists()
    # Opting in takes whatever the tier holds: here, the forged library (its constructor runs).
    client.set(name, forged(genuine, evil_library(tmp_path, marker)))
    async with pool(tmp_path / "d", shared_cache=redis_server.url, unsafe_unsigned_host_code=True) as p:
        library, tier = await p.compile_with_tier(CppSpec(GOOD))
    assert tier == "shared" and library.answer() == 666 and marker.exists()


# --- leases -----------------------------------------------------------------------------------


async def key_of(spec: CppSpec, tmp_path: Path) -> str:
    return (await load_parent("cpp").prepare(spec, None, tmp_path / "memo")).key


async def wait_before_compiling(p: acompile.CompilePool, spec: CppSpec) -> float:
    """Ask for ``spec`` and say how long the pool waited before its worker started compiling it
    (then the request is left: the compile itself is not what is measured)."""
    await p.wait_ready()
    t0 = time.perf_counter()
    with anyio.fail_after(40):  # a guard: a lease honoured to its end would be 60 s
        async with anyio.create_task_group() as tg:
            tg.start_soon(p.compile, spec)
            while p.stats()["workers"]["busy"] < 1:  # noqa: ASYNC110 - watching the pool
                await anyio.sleep(0.01)
            waited = time.perf_counter() - t0
            tg.cancel_scope.cancel()
    assert p.stats()["cache"]["hits_shared"] == 0
    return waited


# asyncio only, as the replayed lease's test: what bounds the wait is the lease's contents as
# Redis holds them, not the loop (a compile and a lease's life in each run).
@asyncio_only
async def test_a_planted_lease_without_ttl_costs_a_replica_seconds_at_most(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client: Any = redis_server.client()
    plant = SharedTier(None, None)  # what anyone who can write to an unsigned tier can write
    # Beyond any lease's life (not honoured at all); within the clocks' margin, but never renewed.
    for i, expires in enumerate([3600.0, 30.0]):
        spec = CppSpec(GOOD + f"// {i}\n")
        key = await key_of(spec, tmp_path)
        client.set(f"acompile:lease:unsigned:{key}", plant.lease_value(key, "planted", time.time() + expires))
        async with pool(tmp_path / f"r{i}", shared_cache=redis_server.url, fleet_wait=60) as p:
            waited = await wait_before_compiling(p, spec)
        assert waited < 10, f"waited {waited:.1f} s on a lease planted to last {expires:.0f} s"


@asyncio_only
async def test_a_replayed_lease_costs_a_replica_seconds_at_most(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client: Any = redis_server.client()
    spec = CppSpec(SLOW % 1, options=("-O2",))
    key = await key_of(spec, tmp_path)
    namespace = signing_key_id(KEY.encode())
    lease = f"acompile:lease:{namespace}:{key}"
    copies: list[bytes] = []
    async with pool(tmp_path / "a", shared_cache=redis_server.url, signing_key=KEY) as a:
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.compile, spec)
            with anyio.fail_after(10):
                while not client.exists(lease):  # noqa: ASYNC110 - watching Redis
                    await anyio.sleep(0.01)
            # Copied while held, as late as it can be: the holder's last renewal.
            while (value := client.get(lease)) is not None:
                copies.append(value)
                await anyio.sleep(0.02)
    assert copies, "the lease was never seen held"
    # Replayed after its release (with the entry gone from the tier: nothing to find there).
    client.delete(f"acompile:{namespace}:{key}")
    client.set(lease, copies[-1])
    async with pool(tmp_path / "b", shared_cache=redis_server.url, signing_key=KEY, fleet_wait=60) as b:
        waited = await wait_before_compiling(b, spec)
    assert waited < 10, f"waited {waited:.1f} s on a replayed lease"


async def test_no_lease_outlives_its_pool_after_a_redis_stall(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    assert redis_server.process is not None
    client: Any = redis_server.client()
    # One compile takes seconds, the other waits behind it in the queue: both hold a lease.
    specs = [CppSpec(SLOW % 2, options=("-O2",)), CppSpec(GOOD + "// queued\n")]

    def leases() -> list[bytes]:
        return [k for k in client.keys("*") if b":lease:" in k]

    try:
        async with pool(tmp_path / "a", shared_cache=redis_server.url, signing_key=KEY) as p:
            async with anyio.create_task_group() as tg:
                for spec in specs:
                    tg.start_soon(p.compile, spec)
                with anyio.fail_after(10):
                    while len(leases()) < 2:  # noqa: ASYNC110 - watching Redis
                        await anyio.sleep(0.01)
                # A lease says how long its holder may still be alive: seconds, not a compile's limit
                # (-2: released since it was listed).
                assert all(t == -2 or 0 < t <= 10_000 for t in map(client.pttl, leases()))
                os.kill(redis_server.process.pid, signal.SIGSTOP)  # the server stalls mid-compile
        # The pool is gone; the server comes back (and runs what was queued while it stalled).
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    t0 = time.perf_counter()
    with anyio.fail_after(30):
        while left := leases():
            assert time.perf_counter() - t0 < 12, f"leases outlived the pool: {left}"
            await anyio.sleep(0.1)


# --- the shared tier's values -----------------------------------------------------------------


@asynccontextmanager
async def tier(redis: RedisServer, signing_key: bytes | None) -> AsyncIterator[SharedTier]:
    shared = SharedTier(await anyio.to_thread.run_sync(open_shared_cache, redis.url), signing_key)
    try:
        yield shared
    finally:
        await shared.close()


async def test_a_huge_value_in_the_shared_tier_is_a_miss_without_stalling_the_loop(
    redis_server: RedisServer,
) -> None:
    client: Any = redis_server.client()
    key = "ab" * 32
    async with tier(redis_server, KEY.encode()) as shared:
        lags: list[float] = []

        async def ticker() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.002)
                lags.append(time.perf_counter() - t - 0.002)

        huge = b"ACSIG2" + bytes(64 << 20)  # looks signed: the signature would be computed
        large = b"ACSIG2" + bytes(20 << 20)  # under the bound: verified, on a thread
        for value in (huge, large):
            await anyio.to_thread.run_sync(client.set, f"acompile:{shared.namespace}:{key}", value)
            await anyio.to_thread.run_sync(client.set, f"acompile:lease:{shared.namespace}:{key}", value)
            lags.clear()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await anyio.sleep(0.05)
                for _ in range(3):
                    assert await shared.get(key) is None
                    assert not await shared.lease_held(key)
                tg.cancel_scope.cancel()
            assert max(lags) < 0.08, (
                f"the event loop stalled {max(lags) * 1000:.0f} ms on a {len(value)} byte value"
            )
        assert shared.counts["rejected"] == 6 and shared.counts["errors"] == 0
