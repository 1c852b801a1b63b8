"""Entries of format 2 read in part: what a hostile or unlucky folder does to a kernel's stages.

A warm start reads a Triton kernel's header, metadata and binary, each checked; its text stages
(IRs, PTX) are read from the entry's file, and checked against the header's digests, when
``kernel.asm`` first asks. Between the two, anything can happen to the file: removed, replaced,
cut short, swapped for a link, a FIFO or a folder. Every case must end as a clean miss (the
kernel compiled again) or a clean ``StageUnavailableError``: never another kernel's text, a
hang, an exception of another type, nor a file read or removed outside the cache folder. And
the stages of one kernel, read on whatever thread asks, must hold up no other kernel.

Each test builds its cache folder from entries compiled once for the module (``genuine``), so
that only the misses a test is about cost a compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, RedisServer, asyncio_only, gpu_available
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._cache import (
    DiskTier,
    Entry,
    _disk,
    _entry,
    _layout,
    decode_entry,
    export_bundle,
    import_bundle,
    prune,
)
from acompile._cache._layout import MAX_ENTRY_BYTES

pytestmark = pytest.mark.anyio

BLOCKS = (64, 128, 256)
KEY = b"a-signing-key-for-the-entry-tests"


def spec(block: int) -> acompile.TritonSpec:
    return acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})


def pool(cache_dir: Path, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **kw)


def entry_path(cache_dir: Path, key: str) -> Path:
    return DiskTier(cache_dir).path(key)


class Genuine:
    """A kernel compiled once for the module: its key, its entry's bytes, its stages."""

    def __init__(self, block: int, key: str, data: bytes, asm: dict[str, Any]) -> None:
        self.block = block
        self.key = key
        self.data = data
        self.asm = asm

    @property
    def entry(self) -> Entry:
        return decode_entry(self.data, self.key)

    def plant(self, cache_dir: Path, data: bytes | None = None) -> Path:
        """Put this entry (or ``data`` in its place) in the cache folder; its path."""
        path = entry_path(cache_dir, self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.data if data is None else data)
        return path


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Genuine]:
    root = tmp_path_factory.mktemp("genuine")

    async def compile_all() -> dict[int, Genuine]:
        async with pool(root) as p:
            kernels = await p.gather(*(spec(b) for b in BLOCKS))
        return {
            b: Genuine(b, k.key, entry_path(root, k.key).read_bytes(), dict(k.asm))
            for b, k in zip(BLOCKS, kernels, strict=True)
        }

    return anyio.run(compile_all)


async def warm(cache_dir: Path, *blocks: int) -> list[Any]:
    """The kernels of ``blocks`` from a warm start of the folder (disk hits, stages not read)."""
    async with pool(cache_dir, prestart=False) as p:
        found = [await p.compile_with_tier(spec(b)) for b in blocks]
    assert [tier for _, tier in found] == ["disk"] * len(blocks)
    return [k for k, _ in found]


def rows(data: bytes) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """An entry's header (without what ``peek_header`` adds) and its blobs, in order."""
    header = _entry.peek_header(data)
    offset = header.pop("_end")
    header.pop("_digest")
    blobs = []
    for name, size, *_ in header["blobs"]:
        blobs.append((name, data[offset : offset + size]))
        offset += size
    return header, blobs


def packed(header: dict[str, Any], blobs: list[tuple[str, bytes]], *, version: int = 2) -> bytes:
    """An entry of whatever header, its prefix's checksum valid: what anyone who can write the
    cache folder can write."""
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = _entry._PREFIX.pack(_entry.MAGIC, version, len(head), hashlib.sha256(head).digest())
    return b"".join([prefix, head, *(blob for _, blob in blobs)])


def span(data: bytes, name: str) -> tuple[int, int]:
    _, blobs = rows(data)
    offset = len(data) - sum(len(blob) for _, blob in blobs)
    for blob_name, blob in blobs:
        if blob_name == name:
            return offset, offset + len(blob)
        offset += len(blob)
    raise KeyError(name)


def damaged_in(data: bytes, name: str) -> bytes:
    """The entry with one byte of its blob ``name`` flipped."""
    start, end = span(data, name)
    out = bytearray(data)
    out[(start + end) // 2] ^= 0x01
    return bytes(out)


def first_format(g: Genuine) -> bytes:
    """The entry as format 1 wrote it: one checksum over the header and every blob."""
    header, blobs = rows(g.data)
    header.pop("ascii")
    header["blobs"] = [row[:2] for row in header["blobs"]]
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.sha256(head)
    for _, blob in blobs:
        digest.update(blob)
    prefix = _entry._PREFIX.pack(_entry.MAGIC, 1, len(head), digest.digest())
    return b"".join([prefix, head, *(blob for _, blob in blobs)])


def with_other_ptx(g: Genuine) -> bytes:
    """An intact entry of the same key whose PTX differs (another compile's, say)."""
    entry = g.entry
    blobs = {name: entry.blobs[name] for name in entry.blobs}
    blobs["ptx"] = blobs["ptx"].replace(b".version", b".version ", 1)
    return Entry(entry.key, entry.backend, entry.name, blobs, entry.meta).encode()


def reordered(g: Genuine) -> bytes:
    """An intact entry of the same key and bytes, its blobs in the other order."""
    entry = g.entry
    blobs = {name: entry.blobs[name] for name in reversed(list(entry.blobs))}
    return Entry(entry.key, entry.backend, entry.name, blobs, entry.meta).encode()


def stages_or_why(kernel: Any) -> dict[str, Any] | str:
    """The kernel's stages, or "unavailable" where it says it cannot read them."""
    try:
        return dict(kernel.asm)
    except acompile.StageUnavailableError:
        return "unavailable"


# --- what the change got wrong -------------------------------------------------------------------


# asyncio only: what is read is the file, the same on either loop.
@asyncio_only
async def test_an_entry_cut_short_just_after_a_warm_start_opens_it_is_a_miss(
    genuine: dict[int, Genuine], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another program rewriting the file in place (cp over it, rsync --inplace) cuts it short
    # between the open (its size taken) and the reads: the header's end is then past what
    # the file holds. That is damage, a miss; not an internal exception for the caller.
    g = genuine[64]
    g.plant(cache_dir)
    real_open = _disk.open_limited
    cut: list[str] = []

    def cut_after_open(where: str | os.PathLike[str], limit: int) -> tuple[int, int] | None:
        opened = real_open(where, limit)
        if opened is not None and os.path.basename(where) == g.key and not cut:
            cut.append(os.fspath(where))
            os.truncate(where, 100)  # past the prefix, inside the header
        return opened

    monkeypatch.setattr(_disk, "open_limited", cut_after_open)
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec(64))
        corrupt = p.stats()["cache"]["disk_corrupt"]
    assert cut, "the warm start did not open the entry"
    assert (tier, corrupt) == ("compile", 1) and k.cubin == g.entry.blobs["cubin"]


@asyncio_only
async def test_an_entry_whose_header_is_deeply_nested_json_is_a_miss(
    genuine: dict[int, Genuine], cache_dir: Path
) -> None:
    # The header is parsed before its checksum is checked: JSON nested deeper than the
    # interpreter recurses must read as damage too (format 1 read it so as well).
    g = genuine[64]
    head = b"[" * 100_000
    prefix = _entry._PREFIX.pack(_entry.MAGIC, _entry.VERSION, len(head), hashlib.sha256(head).digest())
    g.plant(cache_dir, prefix + head)
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec(64))
        corrupt = p.stats()["cache"]["disk_corrupt"]
    assert (tier, corrupt) == ("compile", 1) and k.cubin == g.entry.blobs["cubin"]


def stuck_in_open(thread: threading.Thread, timeout: float = 10) -> None:
    """Wait until ``thread`` sits in the kernel in an open() of a FIFO no one writes to."""
    deadline = time.monotonic() + timeout
    wchan = Path(f"/proc/self/task/{thread.native_id}/wchan")
    while time.monotonic() < deadline and thread.is_alive():
        try:
            if wchan.read_text() == "wait_for_partner":
                return
        except OSError:  # no /proc: give it a moment
            time.sleep(1)
            return
        time.sleep(0.01)


@asyncio_only
async def test_stages_waiting_on_a_hung_filesystem_hold_up_no_other_kernel(
    genuine: dict[int, Genuine], cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One kernel's .asm reads its file on a filesystem that hangs (a FIFO whose open() blocks in
    # the kernel, as a hung network filesystem's does). Another kernel, whose stages are all in
    # memory, must still give its CompiledKernel (and so launch for the first time): the wait
    # for one file is no other kernel's.
    slow, other = genuine[64], genuine[128]
    for g in (slow, other):
        g.plant(cache_dir)
    a, b = await warm(cache_dir, 64, 128)
    assert dict(b.asm) == other.asm
    path = entry_path(cache_dir, slow.key)
    path.unlink()
    os.mkfifo(path)
    handle = tmp_path / "fifo"
    os.link(path, handle)  # to let the stuck open() go at the end
    monkeypatch.setattr(_layout, "_READ_FLAGS", os.O_RDONLY | os.O_CLOEXEC)
    outcome: dict[str, Any] = {}

    def ask(name: str, fn: Callable[[], Any]) -> None:
        try:
            outcome[name] = fn()
        except Exception as exc:
            outcome[name] = exc

    stuck = threading.Thread(target=ask, args=("a", lambda: a.asm), daemon=True)
    stuck.start()
    asking = threading.Thread(target=ask, args=("b", lambda: b.compiled), daemon=True)
    try:
        await anyio.to_thread.run_sync(stuck_in_open, stuck)
        asking.start()
        await anyio.to_thread.run_sync(asking.join, 5)
        held_up = asking.is_alive()
    finally:
        deadline = time.monotonic() + 30
        while stuck.is_alive() and time.monotonic() < deadline:
            try:
                os.close(os.open(handle, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader yet, or none any more
            await anyio.to_thread.run_sync(stuck.join, 0.1)
        if asking.ident is not None:
            await anyio.to_thread.run_sync(asking.join, 10)
    assert not held_up, "another kernel's CompiledKernel waited for this one's file"
    assert outcome["b"].kernel == other.asm["cubin"]
    assert isinstance(outcome["a"], acompile.StageUnavailableError)


@asyncio_only
async def test_after_stage_unavailable_the_pool_keeps_the_kernel_and_a_later_pool_compiles_it(
    genuine: dict[int, Genuine], cache_dir: Path
) -> None:
    # StageUnavailableError says what happens next: the damaged file is removed, the pool keeps
    # the loaded kernel (its memory tier: the same kernel, which launches), and a later pool
    # compiles it again, stages and all.
    g = genuine[64]
    path = g.plant(cache_dir, damaged_in(genuine[64].data, "ptx"))
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec(64))
        assert tier == "disk"
        with pytest.raises(acompile.StageUnavailableError, match="this one keeps the kernel loaded"):
            _ = k.asm
        assert not path.exists()
        again, tier_again = await p.compile_with_tier(spec(64))
        assert (again, tier_again) == (k, "memory")
    async with pool(cache_dir, prestart=False) as p:
        fresh, tier_fresh = await p.compile_with_tier(spec(64))
    assert tier_fresh == "compile" and stages_or_why(fresh) == g.asm


@asyncio_only
async def test_stages_never_remove_a_file_through_a_link_at_an_entries_folder(
    genuine: dict[int, Genuine], cache_dir: Path, tmp_path: Path
) -> None:
    # After the pool opened (which removes such links), a link takes the place of the folder of
    # entries (v1/<xx>) and leads elsewhere, to a file of the entry's name that is not intact.
    # .asm must not read through the link, and above all must not remove what is out there.
    g = genuine[64]
    path = g.plant(cache_dir)
    (k,) = await warm(cache_dir, 64)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / g.key
    outside.write_bytes(damaged_in(g.data, "ttgir"))
    shutil.rmtree(path.parent)
    path.parent.symlink_to(elsewhere, target_is_directory=True)
    assert stages_or_why(k) == "unavailable"
    assert outside.exists(), "a file outside the cache folder was removed"


@asyncio_only
async def test_a_kernels_stages_pickle_as_tritons_own_do(
    genuine: dict[int, Genuine], cache_dir: Path
) -> None:
    # kernel.asm (and kernel.compiled.asm, the same dict) was Triton's AsmDict, which pickles:
    # shipped to another process, or kept. The class now is local to a function.
    g = genuine[64]
    g.plant(cache_dir)
    (k,) = await warm(cache_dir, 64)
    assert pickle.loads(pickle.dumps(k.asm)) == g.asm
    assert pickle.loads(pickle.dumps(k.compiled.asm)) == g.asm


# --- what holds, and must keep holding -------------------------------------------------------------


def _rows_of(edit: Callable[[dict[str, Any], list[list[Any]]], None]) -> Callable[[Genuine], bytes]:
    def forge(g: Genuine) -> bytes:
        header, blobs = rows(g.data)
        edit(header, header["blobs"])
        return packed(header, blobs)

    return forge


def _row(name: str, field: int, value: Any) -> Callable[[dict[str, Any], list[list[Any]]], None]:
    def edit(header: dict[str, Any], table: list[list[Any]]) -> None:
        for row in table:
            if row[0] == name:
                row[field] = value

    return edit


def _moved(header: dict[str, Any], table: list[list[Any]]) -> None:
    """Ten bytes of the TTGIR counted as the TTIR's: the total unchanged."""
    sizes = {row[0]: row for row in table}
    sizes["ttir"][1] += 10
    sizes["ttgir"][1] -= 10


def _cubin_is_text(header: dict[str, Any], table: list[list[Any]]) -> None:
    header["ascii"] = [*header["ascii"], "cubin"]


def _cubin_is_text_and_lies(header: dict[str, Any], table: list[list[Any]]) -> None:
    _cubin_is_text(header, table)
    _row("cubin", 2, "00" * 32)(header, table)


def _padded(header: dict[str, Any], table: list[list[Any]]) -> None:
    header["meta"]["padding"] = "x" * 20_000  # past the warm start's first read


FORGED: dict[str, tuple[Callable[[Genuine], bytes], str]] = {
    "digest rows of two": (_rows_of(lambda h, t: t.__setitem__(slice(None), [r[:2] for r in t])), "miss"),
    "digest rows of four": (_rows_of(lambda h, t: [r.append("00" * 32) for r in t]), "miss"),
    "digests in capitals": (_rows_of(lambda h, t: [r.__setitem__(2, r[2].upper()) for r in t]), "miss"),
    "digests not hex": (_rows_of(lambda h, t: [r.__setitem__(2, "zz" * 32) for r in t]), "miss"),
    "sizes that do not add up": (_rows_of(_row("ptx", 1, 1)), "miss"),
    "a name twice": (_rows_of(lambda h, t: t[1].__setitem__(0, t[0][0])), "miss"),
    "the cubin's digest lies": (_rows_of(_row("cubin", 2, "00" * 32)), "miss"),
    "the cubin listed as text, its digest lying": (_rows_of(_cubin_is_text_and_lies), "miss"),
    "the cubin listed as text": (_rows_of(_cubin_is_text), "hit"),
    "a header longer than the first read": (_rows_of(_padded), "hit"),
    "the ptx's digest lies": (_rows_of(_row("ptx", 2, "00" * 32)), "unavailable"),
    "sizes moved between two text stages": (_rows_of(_moved), "unavailable"),
    "format 1 with digests": (lambda g: packed(*rows(g.data), version=1), "miss"),
}


# asyncio only: each case is about the bytes of one file, read the same on either loop.
@asyncio_only
@pytest.mark.parametrize("case", list(FORGED))
async def test_a_forged_header_is_a_clean_miss_or_a_clean_stage_unavailable(
    genuine: dict[int, Genuine], cache_dir: Path, case: str
) -> None:
    g = genuine[64]
    forge, expected = FORGED[case]
    path = g.plant(cache_dir, forge(g))
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec(64))
    assert k.cubin == g.entry.blobs["cubin"]
    assert tier == ("compile" if expected == "miss" else "disk")
    stages = stages_or_why(k)
    if expected == "unavailable":
        assert stages == "unavailable" and not path.exists()  # damaged: removed for the next request
    else:
        assert stages == g.asm


def _symlink(g: Genuine, path: Path, tmp_path: Path) -> None:
    copy_ = tmp_path / "copy"
    copy_.write_bytes(g.data)
    path.unlink()
    path.symlink_to(copy_)


def _fifo(g: Genuine, path: Path, tmp_path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _folder(g: Genuine, path: Path, tmp_path: Path) -> None:
    path.unlink()
    (path / "inside").mkdir(parents=True)


def _oversized(g: Genuine, path: Path, tmp_path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(MAX_ENTRY_BYTES + 1)  # sparse: no disk space taken


def _other_users_with_other_ptx(g: Genuine, path: Path, tmp_path: Path) -> None:
    from attacker import nobody

    user = nobody()  # skips where there is no second user to be
    path.write_bytes(with_other_ptx(g))
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(0o666)


REPLACED: dict[str, tuple[Callable[[Genuine, Path, Path], None], str]] = {
    "a link to a copy outside": (_symlink, "unavailable"),
    "a FIFO": (_fifo, "unavailable"),
    "a folder": (_folder, "unavailable"),
    "a file over the bound": (_oversized, "unavailable"),
    "another user's writable file with other PTX": (_other_users_with_other_ptx, "unavailable"),
    "another kernel's entry": (
        lambda g, p, t: p.write_bytes(t.joinpath("other").read_bytes()),
        "unavailable",
    ),
    "the same kernel in format 1": (lambda g, p, t: p.write_bytes(first_format(g)), "stages"),
    "the same stages in another order": (lambda g, p, t: p.write_bytes(reordered(g)), "stages"),
    "the cache folder removed": (lambda g, p, t: shutil.rmtree(p.parent.parent.parent), "unavailable"),
}


@asyncio_only
@pytest.mark.parametrize("case", [*REPLACED, "pruned"])
async def test_whatever_replaces_the_file_before_asm_gives_its_own_stages_or_stage_unavailable(
    genuine: dict[int, Genuine], cache_dir: Path, tmp_path: Path, case: str
) -> None:
    g = genuine[64]
    path = g.plant(cache_dir)
    (tmp_path / "other").write_bytes(genuine[128].data)
    (k,) = await warm(cache_dir, 64)
    if case == "pruned":
        await prune(cache_dir, max_bytes=0)
        expected = "unavailable"
    else:
        replace, expected = REPLACED[case]
        replace(g, path, tmp_path)
    with anyio.fail_after(30):
        stages = await anyio.to_thread.run_sync(stages_or_why, k)
    assert stages == (g.asm if expected == "stages" else "unavailable")
    assert k.cubin == g.entry.blobs["cubin"]
    if case == "a link to a copy outside":
        assert (tmp_path / "copy").read_bytes() == g.data  # neither read through nor removed
    if case == "another user's writable file with other PTX":
        assert path.read_bytes() == with_other_ptx(g)  # intact: another compile's, left there


class Churn:
    """A thread that replaces the entries of 64 and 128 over and over (atomically, as writers
    do) with what the folder may hold: the entry, its stages in another order, format 1, another
    compile's PTX, damage, nothing. ``stop`` puts the genuine entries back."""

    def __init__(self, genuine: dict[int, Genuine], cache_dir: Path) -> None:
        self.genuine = [genuine[64], genuine[128]]
        self.cache_dir = cache_dir
        self.variants = {
            g.key: [
                g.data,
                reordered(g),
                first_format(g),
                with_other_ptx(g),
                damaged_in(g.data, "llir"),
                None,
            ]
            for g in self.genuine
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, seed: int) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._churn, args=(seed,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        for g in self.genuine:
            g.plant(self.cache_dir)

    def _churn(self, seed: int) -> None:
        pick = random.Random(seed)
        while not self._stop.is_set():
            key = pick.choice(list(self.variants))
            data = pick.choice(self.variants[key])
            path = entry_path(self.cache_dir, key)
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_name(f".{key}.tmp")
                temporary.write_bytes(data)
                os.replace(temporary, path)
            time.sleep(0.0005)


@pytest.fixture
def churn(genuine: dict[int, Genuine], cache_dir: Path) -> Iterator[Churn]:
    for g in genuine.values():
        g.plant(cache_dir)
    churn = Churn(genuine, cache_dir)
    yield churn
    churn.stop()


# asyncio only: the subject is threads and files; the loop's part (asking while the pool
# compiles) reads the same on uvloop.
@asyncio_only
async def test_threads_and_the_loop_asking_for_stages_while_files_change_never_hang_or_mix_kernels(
    genuine: dict[int, Genuine], cache_dir: Path, churn: Churn
) -> None:
    truth = {g.key: g.asm for g in genuine.values()}
    problems: list[str] = []
    built: dict[int, set[int]] = {}  # by kernel: the CompiledKernels it gave
    held: list[Any] = []  # every kernel, so that no id is reused
    may_load = not gpu_available()  # without a GPU, load() builds the CompiledKernel, then says so

    def use(kernels: list[Any], seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(25):
            k = pick.choice(kernels)
            op = pick.choice(["asm", "compiled", "compiled.asm", "load"] if may_load else ["asm", "compiled"])
            try:
                if op == "asm":
                    if dict(k.asm) != truth[k.key]:
                        problems.append(f"{k.key[:8]}: asm not its own")
                elif op == "compiled":
                    c = k.compiled
                    built.setdefault(id(k), set()).add(id(c))
                    if c.kernel != truth[k.key]["cubin"]:
                        problems.append(f"{k.key[:8]}: another binary")
                elif op == "compiled.asm":
                    if k.compiled.asm["ptx"] != truth[k.key]["ptx"]:
                        problems.append(f"{k.key[:8]}: another PTX")
                else:
                    k.load()
            except (acompile.StageUnavailableError, acompile.DeviceUnavailableError):
                pass
            except Exception as exc:
                problems.append(f"{k.key[:8]} {op}: {type(exc).__name__}: {exc}")

    for round_ in range(4):
        async with pool(cache_dir, prestart=False) as p:
            kernels = [await p.compile(spec(b)) for b in (64, 128, 256)]
            held.extend(kernels)  # each read from its genuine entry
            churn.start(round_)
            threads = [
                threading.Thread(target=use, args=(kernels, round_ * 100 + i), daemon=True) for i in range(8)
            ]
            for t in threads:
                t.start()
            async with anyio.create_task_group() as tg:
                # The pool busy compiling meanwhile (a miss), and the loop itself asking.
                tg.start_soon(p.compile, acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 32}))
                for i in range(10):
                    stages = stages_or_why(kernels[i % 3])
                    if stages != "unavailable" and stages != truth[kernels[i % 3].key]:
                        problems.append("the loop read stages not its kernel's")
                    await anyio.sleep(0.005)
            for t in threads:
                await anyio.to_thread.run_sync(t.join, 30)
            assert not any(t.is_alive() for t in threads), "a thread asking for stages hung"
            churn.stop()
    assert not problems, problems[:5]
    assert all(len(ids) == 1 for ids in built.values())  # each kernel built one CompiledKernel


# asyncio only, as the two below: the subject is which bytes travel, the same on either loop.
@asyncio_only
async def test_share_spreads_no_entry_whose_text_stages_are_damaged(
    genuine: dict[int, Genuine], tmp_path: Path, redis_server: RedisServer
) -> None:
    # A warm start does not read a kernel's text stages: damage there is found only when they
    # are read. Spreading a warm disk to the fleet reads and checks each entry whole.
    intact, damaged = genuine[64], genuine[128]
    here, there = tmp_path / "here", tmp_path / "there"
    intact.plant(here)
    damaged.plant(here, damaged_in(damaged.data, "llir"))
    shared = {"shared_cache": acompile.SharedCache(redis_server.url, signing_key=KEY), "prestart": False}
    async with pool(here, **shared) as p:
        kernels = await p.gather(spec(64), spec(128))  # both disk hits
        assert await p.share([k.key for k in kernels]) == (0, 1)
    async with pool(there, **shared) as p:
        k, tier = await p.compile_with_tier(spec(64))
    assert tier == "shared" and dict(k.asm) == intact.asm
    (k,) = await warm(there, 64)  # written back to that disk, read in part there
    assert dict(k.asm) == intact.asm


@asyncio_only
async def test_a_bundle_carries_whole_entries_and_leaves_out_damaged_text_stages(
    genuine: dict[int, Genuine], tmp_path: Path
) -> None:
    intact, damaged = genuine[64], genuine[128]
    here, there = tmp_path / "here", tmp_path / "there"
    intact.plant(here)
    damaged.plant(here, damaged_in(damaged.data, "ptx"))
    bundle = tmp_path / "b.tgz"
    report = await export_bundle(here, bundle, signing_key=KEY)
    assert report.entries == 1 and [key for key, _ in report.rejected] == [damaged.key]
    assert (await import_bundle(there, bundle, signing_key=KEY)).entries == 1
    assert entry_path(there, intact.key).read_bytes() == intact.data  # the same bytes: format 2
    (k,) = await warm(there, 64)
    assert dict(k.asm) == intact.asm
