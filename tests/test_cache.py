"""The cache: entries, the disk tier, the tier chain, keys, and what a fresh process finds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, asyncio_only, run_python, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._backends import prepare_triton
from acompile._cache import (
    CorruptEntry,
    DiskTier,
    Entry,
    GuardedDisk,
    LeaseTier,
    MemoryTier,
    Tier,
    TierChain,
    decode_entry,
    toolchain_dir,
)
from acompile._cache._entry import peek_header

pytestmark = pytest.mark.anyio


def pool(cache_dir: Path, workers: int = 1, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


def entry_path(cache_dir: Path, key: str) -> Path:
    return DiskTier(cache_dir).path(key)


# --- entries -------------------------------------------------------------------------------------


def sample_entry() -> Entry:
    return Entry(
        key="ab" * 32,
        backend="triton",
        name="k",
        blobs={"json": b'{"a": 1}', "cubin": bytes(range(256)) * 4},
        meta={"m": 1},
    )


def test_an_entry_round_trips() -> None:
    e = sample_entry()
    back = decode_entry(e.encode(), e.key)
    assert back.blobs == e.blobs and back.meta == e.meta and back.name == "k"


def test_every_damaged_byte_and_every_truncation_is_detected() -> None:
    data = sample_entry().encode()
    key = sample_entry().key
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x41
        try:
            back = decode_entry(bytes(damaged), key)
        except CorruptEntry:
            continue
        # A flip inside JSON whitespace-free text that still parses must not change the content.
        assert back.blobs == sample_entry().blobs and back.key == key, f"byte {i} changed content silently"
    for n in range(len(data)):
        with pytest.raises(CorruptEntry):
            decode_entry(data[:n], key)


def test_an_entry_for_another_key_is_refused() -> None:
    with pytest.raises(CorruptEntry, match="holds key"):
        decode_entry(sample_entry().encode(), "cd" * 32)


def test_memory_tier_is_bounded_lru() -> None:
    tier = MemoryTier(2)
    tier.set("a", 1)
    tier.set("b", 2)
    assert tier.get("a") == 1
    tier.set("c", 3)
    assert tier.get("b") is None and tier.get("a") == 1 and tier.get("c") == 3 and len(tier) == 2


# --- the disk tier through the pool -----------------------------------------------------------------


async def test_a_fresh_process_loads_last_runs_kernels_without_any_worker(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        first = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 512})
    script = textwrap.dedent(
        f"""
        import json, anyio, acompile
        from kernels_for_tests import add_kernel, ADD_SIG

        async def main():
            async with acompile.CompilePool(2, target="cuda:90", cache_dir={str(cache_dir)!r}, prestart=False) as p:
                k, tier = await p.compile_with_tier(acompile.TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": 512}}))
                print(json.dumps({{"key": k.key, "tier": tier, "ptx": k.asm["ptx"], "started": p.stats()["workers"]["started"]}}))

        anyio.run(main)
        """
    )
    out = await anyio.to_thread.run_sync(run_python, script)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"key": first.key, "tier": "disk", "ptx": first.asm["ptx"], "started": 0}


async def test_the_memory_tier_answers_repeats(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
        a, tier_a = await p.compile_with_tier(spec)
        b, tier_b = await p.compile_with_tier(spec)
    assert (tier_a, tier_b) == ("compile", "memory") and a is b


# asyncio only, as the damage of the next test: what is checked is the entry's bytes, read the
# same on either loop (a damaged entry on uvloop too: the warm start's test below).
@asyncio_only
@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "other-key"])
async def test_a_damaged_disk_entry_is_a_miss_and_is_replaced(
    cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256})
    async with pool(cache_dir) as p:
        good = await p.compile(spec)
        other = await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 128}))
    path = entry_path(cache_dir, good.key)
    data = path.read_bytes()
    if damage == "flip":
        data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "empty":
        data = b""
    else:
        data = entry_path(cache_dir, other.key).read_bytes()
    path.write_bytes(data)
    async with pool(cache_dir) as p:
        k, tier = await p.compile_with_tier(spec)
        stats = p.stats()
    assert tier == "compile" and k.asm["ptx"] == good.asm["ptx"]
    assert stats["cache"]["disk_corrupt"] == 1
    assert any("damaged" in r.message for r in caplog.records)
    assert decode_entry(path.read_bytes(), good.key).blobs["cubin"] == good.cubin  # overwritten whole


async def test_a_warm_start_reads_its_entries_together_and_verifies_each(cache_dir: Path) -> None:
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128, 256, 512)]
    async with pool(cache_dir, 2) as p:
        compiled = await p.gather(*specs)
    damaged = entry_path(cache_dir, compiled[2].key)
    data = bytearray(damaged.read_bytes())
    start, end = blob_span(damaged, "cubin")  # what a warm start reads and checks
    data[(start + end) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    results: list[Any] = [None] * len(specs)
    async with pool(cache_dir, prestart=False) as p:

        async def one(i: int) -> None:
            results[i] = await p.compile_with_tier(specs[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(specs)):
                tg.start_soon(one, i)
        stats = p.stats()
    # Each request gets its own entry back, whatever order the reads finished in.
    assert [k.key for k, _ in results] == [k.key for k in compiled]
    assert [k.asm["ptx"] for k, _ in results] == [k.asm["ptx"] for k in compiled]
    assert [tier for _, tier in results] == ["disk", "disk", "compile", "disk"]
    cache = stats["cache"]
    assert (cache["hits_disk"], cache["misses"], cache["disk_corrupt"], stats["compiled"]) == (3, 1, 1, 1)


def blob_span(path: Path, name: str) -> tuple[int, int]:
    """Where a blob of the entry file at ``path`` is, (start, end)."""
    header = peek_header(path.read_bytes())
    offset = header["_end"]
    for blob, size, *_ in header["blobs"]:
        if blob == name:
            return offset, offset + size
        offset += size
    raise KeyError(name)


async def test_a_warm_start_reads_a_kernels_text_stages_only_when_asked_and_checks_them(
    cache_dir: Path,
) -> None:
    # A warm start reads each kernel's binary and metadata (checked); its IRs and PTX, most of
    # the entry, are read from the file, and checked, when .asm first asks. Damage there is
    # not seen by the warm start: the kernel is a disk hit and launches; .asm says the stages
    # cannot be read, the damaged file is removed, and the next request compiles it again.
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128)]
    async with pool(cache_dir) as p:
        good = await p.gather(*specs)
    damaged = entry_path(cache_dir, good[1].key)
    data = bytearray(damaged.read_bytes())
    start, end = blob_span(damaged, "llir")
    data[(start + end) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    async with pool(cache_dir, prestart=False) as p:
        intact, hit = await p.gather(*specs)
        stats = p.stats()
        assert intact.asm == good[0].asm and intact.compiled.asm["ptx"] == good[0].asm["ptx"]
        assert hit.cubin == good[1].cubin  # checked: what a launch loads
        with pytest.raises(acompile.StageUnavailableError, match=r"add_kernel: .*damaged.*blob llir"):
            _ = hit.asm
        assert not damaged.exists()
    assert (stats["cache"]["hits_disk"], stats["compiled"]) == (2, 0)
    async with pool(cache_dir) as p:
        k, tier = await p.compile_with_tier(specs[1])
    assert tier == "compile" and k.asm["llir"] == good[1].asm["llir"]


@pytest.mark.parametrize("change", ["removed", "other-bytes", "same-bytes-other-order"])
async def test_a_kernels_text_stages_are_read_from_the_file_as_it_is_when_asked(
    cache_dir: Path, change: str
) -> None:
    # The file of a kernel loaded from the disk can change before .asm asks for its stages: a
    # prune removes it, another compile replaces it. Stages are taken from the file there only
    # if they are the bytes the kernel was loaded with (their digests), wherever they now are.
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256})
    async with pool(cache_dir) as p:
        good = await p.compile(spec)
    path = entry_path(cache_dir, good.key)
    async with pool(cache_dir, prestart=False) as p:
        hit, tier = await p.compile_with_tier(spec)
        assert tier == "disk"
        entry = decode_entry(path.read_bytes(), good.key)
        if change == "removed":
            path.unlink()
        else:
            blobs = {name: entry.blobs[name] for name in entry.blobs}
            if change == "other-bytes":
                blobs["ptx"] = blobs["ptx"].replace(b".version", b".version ", 1)
            else:
                blobs = dict(reversed(list(blobs.items())))
            path.write_bytes(Entry(entry.key, entry.backend, entry.name, blobs, entry.meta).encode())
        if change == "same-bytes-other-order":
            assert hit.asm == good.asm
        else:
            why = "removed" if change == "removed" else "replaced by one whose ptx differs"
            with pytest.raises(acompile.StageUnavailableError, match=why):
                _ = hit.asm
            assert hit.cubin == good.cubin


def _metadata_edit(edit: Any) -> Any:
    def damage(blobs: dict[str, bytes]) -> None:
        metadata = json.loads(blobs["json"])
        edit(metadata)
        blobs["json"] = json.dumps(metadata).encode()

    return damage


# Damage that a checksum recomputed over it hides (an entry written by another program), each
# with the word the miss's log line names it by. Unless loading looks for it, each shows only
# where it is read: at .asm, at .compiled, or at the first launch (Triton's launcher reads the
# scratch sizes and launch flags; loading the binary compares shared and num_warps).
INTACT_BUT_UNLOADABLE = {
    "name-missing": ("name", _metadata_edit(lambda md: md.pop("name"))),
    "name-null": ("name", _metadata_edit(lambda md: md.update(name=None))),
    "num_warps-missing": ("num_warps", _metadata_edit(lambda md: md.pop("num_warps"))),
    "num_warps-text": ("num_warps", _metadata_edit(lambda md: md.update(num_warps="x"))),
    "num_ctas-missing": ("num_ctas", _metadata_edit(lambda md: md.pop("num_ctas"))),
    "shared-missing": ("shared", _metadata_edit(lambda md: md.pop("shared"))),
    "shared-float": ("shared", _metadata_edit(lambda md: md.update(shared=0.5))),
    "scratch-null": ("global_scratch_size", _metadata_edit(lambda md: md.update(global_scratch_size=None))),
    "launch_pdl-missing": ("launch_pdl", _metadata_edit(lambda md: md.pop("launch_pdl"))),
    "global_scratch_size-missing": (
        "global_scratch_size",
        _metadata_edit(lambda md: md.pop("global_scratch_size")),
    ),
    "tmem_size-negative": ("tmem_size", _metadata_edit(lambda md: md.update(tmem_size=-5))),
    "scratch_align-zero": (
        "global_scratch_align",
        _metadata_edit(lambda md: md.update(global_scratch_align=0)),
    ),
    # An entry for another target under this key: Triton's AMD backend, made for it, asserts
    # that the arch is a name; one for another CUDA arch would load a binary this GPU can't run.
    "target-hip": ("target", _metadata_edit(lambda md: md["target"].update(backend="hip"))),
    "target-other-arch": ("target", _metadata_edit(lambda md: md["target"].update(arch=80))),
    "target-arch-text": ("target", _metadata_edit(lambda md: md["target"].update(arch="90"))),
    "target-warp_size-text": ("warp_size", _metadata_edit(lambda md: md["target"].update(warp_size="32"))),
    "ptx-not-utf8": ("ptx", lambda blobs: blobs.update(ptx=b"\xff\xfe" + blobs["ptx"][2:])),
    "ttir-not-utf8": ("ttir", lambda blobs: blobs.update(ttir=b"\xc3" * 10)),
}


# asyncio only: eighteen kinds of damage to an entry's contents, each two compiles; what tells
# them apart is the checks made as an entry is loaded, not the loop.
@asyncio_only
@pytest.mark.parametrize("damage", list(INTACT_BUT_UNLOADABLE))
async def test_an_intact_entry_without_a_loadable_kernel_is_a_miss_and_is_replaced(
    cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    async with pool(cache_dir) as p:
        good = await p.compile(spec)
    path = entry_path(cache_dir, good.key)
    entry = decode_entry(path.read_bytes(), good.key)
    good_json = entry.blobs["json"]
    named, edit = INTACT_BUT_UNLOADABLE[damage]
    edit(entry.blobs)
    path.write_bytes(entry.encode())  # its checksum holds: only loading it can tell
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec)
        stats = p.stats()
    assert tier == "compile" and k.cubin == good.cubin
    cache = stats["cache"]
    assert (cache["hits_disk"], cache["misses"], cache["disk_corrupt"]) == (0, 1, 1)
    message = next(r.message for r in caplog.records if "damaged" in r.message)
    assert "not a loadable Triton kernel" in message and named in message
    # What the kernel serves works, as the kernel compiled the first time did.
    assert k.metadata._asdict() == good.metadata._asdict() and k.metadata.name == "add_kernel"
    assert (k.asm["ptx"], k.asm["ttir"]) == (good.asm["ptx"], good.asm["ttir"])
    assert k.compiled.packed_metadata == good.compiled.packed_metadata
    replaced = decode_entry(path.read_bytes(), good.key).blobs
    assert json.loads(replaced["json"]) == json.loads(good_json)
    assert {ext: replaced[ext] for ext in good.asm} == {
        ext: stage if isinstance(stage, bytes) else stage.encode() for ext, stage in good.asm.items()
    }


class LoopPasses:
    """The CPU time the loop's thread spends in each pass of the event loop, while it runs: a
    callback that schedules itself again runs once per pass. CPU time, not wall time, so that a
    busy machine taking the CPU away does not count as the loop being busy."""

    def __init__(self) -> None:
        self.cpu: list[float] = []

    def __enter__(self) -> LoopPasses:
        import asyncio
        import time

        loop = asyncio.get_running_loop()
        last = time.thread_time()

        def tick() -> None:
            nonlocal last
            now = time.thread_time()
            self.cpu.append(now - last)
            last = now
            self._handle = loop.call_soon(tick)

        self._handle = loop.call_soon(tick)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.cancel()


async def test_many_kernels_at_once_are_served_a_slice_of_the_loop_at_a_time(cache_dir: Path) -> None:
    import gc

    # The disk holds entries for 150 requests: one compiled kernel's bytes, under each key.
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64 + i}) for i in range(150)]
    async with pool(cache_dir) as p:
        model = decode_entry(entry_path(cache_dir, (await p.compile(specs[0])).key).read_bytes())
    target = acompile.Target("cuda", 90)
    disk = DiskTier(cache_dir)
    for spec in specs[1:]:
        key = (await prepare_triton(spec, target, toolchain_dir(cache_dir))).key
        await disk.set(key, Entry(key, model.backend, model.name, model.blobs, model.meta).encode())
    gc.disable()  # the collector's passes are not the pool's
    try:
        async with pool(cache_dir, prestart=False) as p:
            with LoopPasses() as from_disk:
                await p.gather(*specs)
            with LoopPasses() as from_memory:
                await p.gather(*specs)
            stats = p.stats()
    finally:
        gc.enable()
    assert stats["cache"]["hits_disk"] == 150 and stats["cache"]["hits_memory"] == 150
    # A hundred and fifty requests arrive in one pass: each pass serves a slice of them (0.5 ms
    # of work, and the request that crosses it), never all at once (some 10 ms here).
    assert max(from_disk.cpu) < 0.004, sorted(from_disk.cpu)[-5:]
    assert max(from_memory.cpu) < 0.004, sorted(from_memory.cpu)[-5:]


async def test_keys_are_portable_across_cache_folders_users_and_working_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    keys = []
    for i in range(2):
        where = tmp_path / f"cwd{i}"
        where.mkdir()
        monkeypatch.chdir(where)
        # Another user, another home: nothing of either may enter the key.
        monkeypatch.setenv("HOME", str(tmp_path / f"home{i}"))
        monkeypatch.setenv("USER", f"user{i}")
        async with acompile.CompilePool(
            1, target=TARGET, cache_dir=tmp_path / f"cache{i}", prestart=False
        ) as p:
            # Keys are computed in the parent: no compile needed to know one.
            keys.append((await prepare_triton(spec, p.target, tmp_path / f"memo{i}")).key)
    assert keys[0] == keys[1]


async def test_the_key_follows_what_changes_the_binary(cache_dir: Path) -> None:
    base = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    variants = [
        base,
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 128}),
        acompile.TritonSpec(add_kernel, {**ADD_SIG, "x_ptr": "*fp16"}, {"BLOCK": 64}),
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, num_warps=8),
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, num_stages=2),
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, target="cuda:80"),
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, attrs={"x_ptr": [["tt.divisibility", 16]]}),
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, options={"enable_fp_fusion": False}),
    ]
    target = acompile.Target("cuda", 90)
    keys = [(await prepare_triton(s, target, cache_dir)).key for s in variants]
    assert len(set(keys)) == len(keys)
    assert (await prepare_triton(base, target, cache_dir)).key == keys[0]
    parts = (await prepare_triton(base, target, cache_dir)).key_parts
    assert str(Path.home()) not in json.dumps(parts) and str(cache_dir) not in json.dumps(parts)
    assert parts["toolchain"]["triton"] == __import__("triton").__version__


def test_several_processes_share_one_cache_folder(cache_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import anyio, acompile
        from kernels_for_tests import add_kernel, ADD_SIG

        async def main():
            async with acompile.CompilePool(1, target="cuda:90", cache_dir={str(cache_dir)!r}) as p:
                ks = await p.gather(*[acompile.TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": b}}) for b in (64, 128, 256)])
                print(" ".join(k.key for k in ks))

        anyio.run(main)
        """
    )
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert len({o[0] for o in outs}) == 1
    for key in outs[0][0].split():
        decode_entry(entry_path(cache_dir, key).read_bytes(), key)
    leftovers = [p for p in (cache_dir / "v1").rglob(".*") if p.is_file()]
    assert leftovers == []


async def test_the_cache_folder_is_private(cache_dir: Path) -> None:
    async with pool(cache_dir, prestart=False):
        pass
    mode = (await anyio.Path(cache_dir).stat()).st_mode
    assert mode & 0o777 == 0o700


# --- the tier chain, through its seam: a tier is a small class over bytes -------------------------


class DictTier:
    """A tier in a dozen lines: what a new tier module implements (and leases, as a fleet's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: Counter[str] = Counter()
        self.data: dict[str, bytes] = {}
        self.leases: dict[str, str] = {}

    async def open(self) -> None:
        self.counts["opened"] += 1

    async def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    async def set(self, key: str, data: bytes) -> bool:
        self.data[key] = data
        return True

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def close(self) -> None:
        self.counts["closed"] += 1

    def stats(self) -> dict[str, Any]:
        return {}

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        return self.leases.setdefault(key, "us") == "us"

    async def renew_lease(self, key: str, ttl: float) -> bool:
        return self.leases.get(key) == "us"

    async def release_lease(self, key: str) -> None:
        if self.leases.get(key) == "us":
            del self.leases[key]

    async def lease_held(self, key: str) -> bool:
        return self.leases.get(key, "us") != "us"


async def test_a_lease_is_renewed_through_the_tiers_faults_until_it_is_another_replicas(
    tmp_path: Path,
) -> None:
    class Flaky(DictTier):
        """Renewals answer: no word (a fault), no word, renewed, another replica's."""

        def __init__(self) -> None:
            super().__init__("far")
            self.answers: list[bool | None] = [None, None, True, False]
            self.renewals = 0

        async def renew_lease(self, key: str, ttl: float) -> bool | None:
            self.renewals += 1
            return self.answers.pop(0) if self.answers else True

    far = Flaky()
    chain = TierChain(MemoryTier(4), GuardedDisk(tmp_path), [far], fleet_wait=1.0, lease_ttl=0.06)
    await chain.open()
    key = "d4" * 32

    async def compile() -> bytes:
        await anyio.sleep(0.5)  # 25 turns of renewal
        return chain_entry(key)

    async with anyio.create_task_group() as tg:
        chain.start(tg)
        _, tier = await chain.compile_once(key, compile)
        await chain.drain(5)
        tg.cancel_scope.cancel()
    assert tier == "compile" and far.renewals == 4  # past the faults, not past another's lease


def chain_entry(key: str, name: str = "k") -> bytes:
    return Entry(key=key, backend="triton", name=name, blobs={"b": b"x"}, meta={}).encode()


async def test_a_tier_is_one_class_and_the_chain_orders_fills_and_publishes(tmp_path: Path) -> None:
    far, further = DictTier("far"), DictTier("further")
    assert isinstance(far, Tier) and isinstance(far, LeaseTier)
    chain = TierChain(MemoryTier(4), GuardedDisk(tmp_path), [far, further], fleet_wait=1.0)
    await chain.open()
    key, other, bad = "a1" * 32, "b2" * 32, "c3" * 32
    further.data[key] = chain_entry(key)
    further.data[bad] = b"not an entry"
    async with anyio.create_task_group() as tg:
        chain.start(tg)
        # A hit in the last tier, written back to every faster one in the background.
        entry, tier = await chain.lookup(key)
        assert entry is not None and entry.key == key and tier == "further"
        # A damaged entry is a miss, counted under its tier's name.
        assert await chain.lookup(bad) == (None, "")

        async def compile() -> bytes:
            return chain_entry(other, "compiled")

        entry, tier = await chain.compile_once(other, compile)
        assert entry.name == "compiled" and tier == "compile"
        assert await chain.local.files.get(other) == chain_entry(other, "compiled")  # local: now
        await chain.put_record("d4" * 32, "choice", {"choice": b"{}"}, {})
        await chain.drain(5)
    assert far.data[key] == further.data[key] and await chain.local.files.get(key) == further.data[key]
    assert far.data[other] == further.data[other] == chain_entry(other, "compiled")  # write-behind
    assert "d4" * 32 in further.data and not far.leases  # published, and the lease released
    stats = chain.stats()
    assert stats["misses"] == 1 and stats["hits_disk"] == 0 and stats["disk_writes"] == 3
    assert chain.counts["hits_further"] == 1 and chain.counts["further_corrupt"] == 1
    with pytest.raises(acompile.PoolClosedError):
        await chain.get_record("d4" * 32)  # records only while the pool runs
    await chain.close()
    assert far.counts == Counter(opened=1, closed=1)


async def test_the_chain_waits_for_a_replica_that_holds_the_lease(tmp_path: Path) -> None:
    fleet = DictTier("fleet")
    chain = TierChain(MemoryTier(4), GuardedDisk(tmp_path), [fleet], fleet_wait=5.0)
    await chain.open()
    key = "e5" * 32
    fleet.leases[key] = "another replica"

    async def never() -> bytes:
        raise AssertionError("compiled although another replica was compiling it")

    async def the_other_replica() -> None:
        await anyio.sleep(0.2)
        fleet.data[key] = chain_entry(key, "theirs")
        del fleet.leases[key]

    async with anyio.create_task_group() as tg:
        chain.start(tg)
        tg.start_soon(the_other_replica)
        entry, tier = await chain.compile_once(key, never)
        await chain.drain(5)
    assert entry.name == "theirs" and tier == "fleet" and chain.stats()["fleet_waits"] == 1
    assert await chain.local.files.get(key) == chain_entry(key, "theirs")  # kept on disk


async def test_spreading_a_local_entry_fills_the_tiers_after_disk_and_never_spreads_damage(
    tmp_path: Path,
) -> None:
    far = DictTier("far")
    chain = TierChain(MemoryTier(4), GuardedDisk(tmp_path), [far], fleet_wait=1.0)
    await chain.open()
    good, there, damaged, absent = "a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32
    await chain.local.set(good, chain_entry(good))
    await chain.local.set(there, chain_entry(there))
    far.data[there] = chain_entry(there)
    await chain.local.set(damaged, chain_entry(damaged)[:-1] + b"!")  # one byte flipped
    assert await chain.spread(good) == (0, 1) and far.data[good] == chain_entry(good)
    assert await chain.spread(there) == (1, 0)
    assert await chain.spread(damaged) == (0, 0) and damaged not in far.data
    assert await chain.spread(absent) == (0, 0)
    far.data[good] = b"not an entry"  # a damaged copy in the far tier is replaced, not raised
    far.get = _raising_get(far.get)  # type: ignore[method-assign]
    assert await chain.spread(good) == (0, 1) and far.data[good] == chain_entry(good)
    await chain.close()


def _raising_get(get: Any) -> Any:
    async def checked(key: str) -> bytes | None:
        data: bytes | None = await get(key)
        if data is not None and not data.startswith(chain_entry(key)[:4]):
            raise CorruptEntry("not an entry")
        return data

    return checked


@pytest.mark.parametrize("field, value", [("meta", ["a", "list"]), ("name", 7), ("backend", None)])
def test_an_entry_whose_header_has_the_wrong_shape_is_corrupt_even_with_a_valid_checksum(
    field: str, value: object
) -> None:
    # Entry.encode() computes the checksum over whatever the header holds: only the decoder's
    # checks stand between such an entry and a backend's loader.
    fields: dict[str, Any] = {"key": "ab" * 32, "backend": "cuda", "name": "k", "meta": {"a": 1}}
    entry = Entry(blobs={"cubin": b"\0"}, **(fields | {field: value}))
    with pytest.raises(CorruptEntry, match="malformed header"):
        decode_entry(entry.encode(), "ab" * 32)
