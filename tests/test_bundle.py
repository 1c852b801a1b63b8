"""Cache bundles (export, import), pruning, and explaining keys: the API and the command line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, subprocess_env

from acompile._cache import (
    ABSENT,
    BUNDLE_MANIFEST,
    DiskTier,
    Entry,
    describe_factor,
    explain,
    explain_key,
    explain_miss,
    export_bundle,
    import_bundle,
    make_key,
    parse_age,
    prune,
)
from acompile._cache import _bundle as bundle  # its limit on a member's size, lowered by one test
from acompile._errors import AcompileError

pytestmark = pytest.mark.anyio

DAY = 86400.0
KEY = b"a-signing-key-for-the-tests"
OTHER_KEY = b"another-signing-key-of-16-bytes"


@pytest.fixture(autouse=True)
def no_signing_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACOMPILE_SIGNING_KEY", raising=False)


def parts_for(i: int, **changes: Any) -> dict[str, Any]:
    parts: dict[str, Any] = {
        "format": 1,
        "backend": "triton",
        "acompile": "0.1.0",
        "toolchain": {"triton": "3.9.0", "triton_files": "ab" * 8, "ptxas": "12.9"},
        "kernel": f"{i:064x}",
        "name": "add_kernel",
        "signature": [["x_ptr", "*fp32"], ["n", "i32"], ["BLOCK", "constexpr"]],
        "constexprs": {"BLOCK": ["int", 64]},
        "attrs": [],
        "options": {"num_stages": 3, "num_warps": 4},
        "target": TARGET,
        "env": {},
    }
    parts.update(changes)
    return parts


def make_entry(parts: dict[str, Any], size: int = 1000, *, record: bool = True) -> tuple[str, bytes]:
    key = make_key(parts)
    blob = os.urandom(size)  # incompressible: sizes in a bundle stay what they are on disk
    meta = {"key_parts": parts} if record else {"hash": "x"}
    data = Entry(key=key, backend="triton", name=parts["name"], blobs={"cubin": blob}, meta=meta).encode()
    return key, data


async def fill(root: Path, count: int, size: int = 1000) -> dict[str, bytes]:
    disk = DiskTier(root)
    await anyio.to_thread.run_sync(disk.make_or_check)
    entries = dict(make_entry(parts_for(i), size) for i in range(count))
    for key, data in entries.items():
        await disk.set(key, data)
    return entries


def on_disk(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in DiskTier(root).iter_paths()}


def write_bundle(
    path: Path, members: list[tuple[str, bytes]], *, manifest: dict[str, Any] | None = None
) -> None:
    """A bundle made by hand, with whatever members a test needs."""
    info = manifest or {"format": 1, "acompile": "0.1.0", "created": "now", "count": len(members)}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [(BUNDLE_MANIFEST, json.dumps(info).encode()), *members]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))


def acompile_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acompile.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )


# --- export and import ---------------------------------------------------------------------------


async def test_export_then_import_into_a_fresh_folder_round_trips(cache_dir: Path, tmp_path: Path) -> None:
    entries = await fill(cache_dir, 4)
    path = tmp_path / "out" / "seed.tar.gz"
    report = await export_bundle(cache_dir, path)
    assert report.ok and report.entries == 4 and report.bytes == sum(map(len, entries.values()))
    assert "exported 4 entries" in report.summary()
    assert [p.name for p in path.parent.iterdir()] == ["seed.tar.gz"]  # no temporary file left
    with tarfile.open(path, "r:gz") as tar:
        names = tar.getnames()
        description = json.loads(tar.extractfile(BUNDLE_MANIFEST).read())  # type: ignore[union-attr]
    assert names[0] == BUNDLE_MANIFEST and sorted(names[1:]) == sorted(f"entries/{k}" for k in entries)
    assert description["format"] == 1 and description["count"] == 4 and description["acompile"]

    fresh = tmp_path / "replica"
    report = await import_bundle(fresh, path)
    assert report.ok and (report.entries, report.present, report.rejected) == (4, 0, [])
    assert on_disk(fresh) == entries
    assert report.bundle_info["count"] == 4
    again = await import_bundle(fresh, path)
    assert (again.entries, again.present) == (0, 4) and "4 already present" in again.summary()


async def test_export_leaves_out_damaged_entries_and_names_missing_keys(
    cache_dir: Path, tmp_path: Path
) -> None:
    entries = await fill(cache_dir, 3)
    damaged, *good = sorted(entries)
    file = DiskTier(cache_dir).path(damaged)
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))
    absent = "f" * 64
    report = await export_bundle(cache_dir, tmp_path / "b.tgz", [*good, absent, "not-a-key"])
    assert report.entries == 2 and not report.ok
    assert report.missing == [absent]
    assert [k for k, _ in report.rejected] == ["not-a-key"]
    everything = await export_bundle(cache_dir, tmp_path / "all.tgz")
    assert everything.entries == 2 and [k for k, _ in everything.rejected] == [damaged]
    assert "checksum" in everything.rejected[0][1] and "1 damaged entry left out" in everything.summary()
    imported = await import_bundle(tmp_path / "replica", tmp_path / "all.tgz")
    assert sorted(on_disk(tmp_path / "replica")) == sorted(good) and imported.ok


async def test_a_corrupted_member_is_rejected_and_the_others_imported(tmp_path: Path) -> None:
    members = [make_entry(parts_for(i)) for i in range(3)]
    bad_key, bad_data = members[1]
    flipped = bytearray(bad_data)
    flipped[len(flipped) // 2] ^= 0x01
    other_key = members[2][0]
    path = tmp_path / "b.tgz"
    write_bundle(
        path,
        [
            (f"entries/{members[0][0]}", members[0][1]),
            (f"entries/{bad_key}", bytes(flipped)),
            (f"entries/{'e' * 64}", members[2][1]),  # an intact entry under another key's name
            (f"entries/{other_key}", members[2][1]),
        ],
    )
    report = await import_bundle(tmp_path / "cache", path)
    assert report.entries == 2 and not report.ok
    assert sorted(on_disk(tmp_path / "cache")) == sorted([members[0][0], other_key])
    reasons = dict(report.rejected)
    assert "checksum" in reasons[f"entries/{bad_key}"]
    assert "holds key" in reasons[f"entries/{'e' * 64}"]
    assert "2 rejected" in report.summary() and report.error is None

    short = tmp_path / "short.tgz"  # a bundle that lost members
    write_bundle(short, [(f"entries/{other_key}", members[2][1])], manifest={"format": 1, "count": 3})
    report = await import_bundle(tmp_path / "cache2", short)
    assert report.entries == 1 and report.error is not None and "says it holds 3 entries" in report.error


async def test_members_outside_the_bundle_or_not_entries_are_refused(
    tmp_path: Path, monkeypatch: Any
) -> None:
    key, data = make_entry(parts_for(0))
    path = tmp_path / "b.tgz"
    names = [
        "../evil",
        "/tmp/evil-abs",
        "entries/../../evil2",
        "entries/notakey",
        "other.txt",
        BUNDLE_MANIFEST,
    ]
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in [
            (BUNDLE_MANIFEST, json.dumps({"format": 1, "count": 2}).encode()),
            *[(n, data) for n in names],
            (f"entries/{key}", data),
        ]:
            ti = tarfile.TarInfo(name)
            ti.size = len(payload)
            tar.addfile(ti, io.BytesIO(payload))
        link = tarfile.TarInfo(f"entries/{'a' * 64}")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    root = tmp_path / "sub" / "cache"
    report = await import_bundle(root, path)
    assert report.entries == 1 and on_disk(root) == {key: data} and report.error is None
    reasons = dict(report.rejected)
    assert "outside the bundle" in reasons["../evil"] and "outside the bundle" in reasons["/tmp/evil-abs"]
    assert "outside the bundle" in reasons["entries/../../evil2"]
    assert "not an entry" in reasons["entries/notakey"] and "not an entry" in reasons["other.txt"]
    assert "second bundle description" in reasons[BUNDLE_MANIFEST]
    assert "not a regular file" in reasons[f"entries/{'a' * 64}"]
    assert not (tmp_path / "evil").exists() and not (tmp_path / "sub" / "evil2").exists()

    monkeypatch.setattr(bundle, "MAX_MEMBER_BYTES", 100)
    big = await import_bundle(tmp_path / "other", path)
    assert "over the" in dict(big.rejected)[f"entries/{key}"] and big.entries == 0


async def test_a_member_whose_name_ends_in_a_newline_is_refused_and_the_rest_imported(
    tmp_path: Path,
) -> None:
    (key, _), (other, other_data) = make_entry(parts_for(0)), make_entry(parts_for(1))
    # An intact entry for the name's "key" (newline included), so only the name can refuse it.
    data = Entry(key=f"{key}\n", backend="triton", name="add_kernel", blobs={"cubin": b"x"}, meta={}).encode()
    path = tmp_path / "b.tgz"
    write_bundle(path, [(f"entries/{key}\n", data), (f"entries/{other}", other_data)])
    report = await import_bundle(tmp_path / "cache", path)
    assert report.entries == 1 and on_disk(tmp_path / "cache") == {other: other_data}
    reason = dict(report.rejected)[f"entries/{key}\n"]
    assert "not an entry" in reason and "\\n" in reason  # the name is shown escaped


def read_members(path: Path) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    with tarfile.open(path, "r:gz") as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    return json.loads(members[0][1]), members[1:]


def forge(data: bytes, key: str) -> bytes:
    """The entry with its cubin replaced and its checksum recomputed: intact, but not what was
    exported."""
    from acompile._cache import decode_entry

    entry = decode_entry(data, key)
    entry.blobs["cubin"] = b"\x7fELF evil code" + bytes(100)
    return entry.encode()


async def test_a_signed_bundle_is_verified_and_a_forged_entry_refused(
    cache_dir: Path, tmp_path: Path
) -> None:
    entries = await fill(cache_dir, 4)
    path = tmp_path / "seed.tgz"
    report = await export_bundle(cache_dir, path, signing_key=KEY)
    assert report.ok and report.signature == "signed" and "signed" in report.summary()
    info, members = read_members(path)
    assert info["signature"]["algorithm"] == "hmac-sha256" and KEY.decode() not in json.dumps(info)
    assert sorted(info["digests"]) == sorted(entries)
    report = await import_bundle(tmp_path / "replica", path, signing_key=KEY)
    assert report.ok and report.entries == 4 and report.signature == "verified"
    assert on_disk(tmp_path / "replica") == entries

    # An entry swapped for a forged one (intact, its checksum recomputed): refused, the rest imported.
    victim = members[1][0]
    key = victim.removeprefix("entries/")
    forged = [(n, forge(d, key) if n == victim else d) for n, d in members]
    write_bundle(path, forged, manifest=info)
    report = await import_bundle(tmp_path / "replica2", path, signing_key=KEY)
    assert report.entries == 3 and key not in on_disk(tmp_path / "replica2")
    assert "signed digest" in dict(report.rejected)[victim]
    # ...and with the description's digest changed to match, the signature no longer verifies:
    # nothing at all is imported.
    info["digests"][key] = hashlib.sha256(dict(forged)[victim]).hexdigest()
    write_bundle(path, forged, manifest=info)
    with pytest.raises(AcompileError, match="signature does not verify"):
        await import_bundle(tmp_path / "replica3", path, signing_key=KEY)
    assert not on_disk(tmp_path / "replica3")
    # A member the signed description does not list is refused.
    extra_key, extra = make_entry(parts_for(99))
    await export_bundle(cache_dir, path, signing_key=KEY)
    info, members = read_members(path)
    write_bundle(path, [*members, (f"entries/{extra_key}", extra)], manifest=info)
    report = await import_bundle(tmp_path / "replica4", path, signing_key=KEY)
    assert report.entries == 4 and "not listed" in dict(report.rejected)[f"entries/{extra_key}"]


async def test_an_unsigned_bundle_imports_only_when_allowed(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    entries = await fill(cache_dir, 2)
    path = tmp_path / "seed.tgz"
    report = await export_bundle(cache_dir, path)  # no key anywhere: unsigned
    assert report.signature == "unsigned" and "signature" not in read_members(path)[0]
    with pytest.raises(AcompileError, match=r"not signed.*allow_unsigned"):
        await import_bundle(tmp_path / "replica", path, signing_key=KEY)
    monkeypatch.setenv("ACOMPILE_SIGNING_KEY", KEY.decode())  # the key as the shared tier takes it
    with pytest.raises(AcompileError, match="not signed"):
        await import_bundle(tmp_path / "replica", path)
    assert not on_disk(tmp_path / "replica")
    report = await import_bundle(tmp_path / "replica", path, allow_unsigned=True)
    assert report.ok and report.signature == "unsigned (allowed)" and on_disk(tmp_path / "replica") == entries
    assert any("not signed" in r.message and r.levelname == "WARNING" for r in caplog.records)
    assert "NOT authenticated" in report.summary()
    # Exports now sign with the environment's key.
    assert (await export_bundle(cache_dir, path)).signature == "signed"
    assert (await import_bundle(tmp_path / "replica2", path)).signature == "verified"


async def test_a_bundle_signed_with_another_key_is_refused_even_when_unsigned_ones_are_allowed(
    cache_dir: Path, tmp_path: Path
) -> None:
    await fill(cache_dir, 2)
    path = tmp_path / "seed.tgz"
    await export_bundle(cache_dir, path, signing_key=OTHER_KEY)
    with pytest.raises(AcompileError, match="another signing key"):
        await import_bundle(tmp_path / "replica", path, signing_key=KEY, allow_unsigned=True)
    assert not on_disk(tmp_path / "replica")
    # Without a key here there is nothing to verify with: imported, and said so.
    report = await import_bundle(tmp_path / "replica", path)
    assert report.entries == 2 and report.signature == "not verified (no signing key)"


async def test_a_file_that_is_not_a_bundle_is_a_clear_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.tgz"
    garbage.write_bytes(b"this is not a tar archive at all" * 40)
    with pytest.raises(AcompileError, match="not an acompile bundle: it is not a readable tar archive"):
        await import_bundle(tmp_path / "cache", garbage)
    with pytest.raises(AcompileError, match="no bundle at"):
        await import_bundle(tmp_path / "cache", tmp_path / "absent.tgz")
    foreign = tmp_path / "foreign.tgz"
    with tarfile.open(foreign, "w:gz") as tar:
        ti = tarfile.TarInfo("README")
        tar.addfile(ti, io.BytesIO(b""))
    with pytest.raises(AcompileError, match="its first member is 'README'"):
        await import_bundle(tmp_path / "cache", foreign)
    newer = tmp_path / "newer.tgz"
    write_bundle(newer, [], manifest={"format": 2, "acompile": "9.0"})
    with pytest.raises(AcompileError, match=r"format 2 .*reads format 1"):
        await import_bundle(tmp_path / "cache", newer)
    assert not (tmp_path / "cache").exists() or not on_disk(tmp_path / "cache")


async def test_a_bundle_cut_short_imports_what_came_before(cache_dir: Path, tmp_path: Path) -> None:
    await fill(cache_dir, 6, size=64 * 1024)
    path = tmp_path / "b.tgz"
    await export_bundle(cache_dir, path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 6 // 10])
    report = await import_bundle(tmp_path / "replica", path)
    assert report.error is not None and not report.ok
    assert 1 <= report.entries < 6 and "archive is damaged" in report.summary()
    assert set(on_disk(tmp_path / "replica").items()) <= set(on_disk(cache_dir).items())


async def test_import_keeps_an_intact_local_entry_and_replaces_a_damaged_one(tmp_path: Path) -> None:
    (k1, d1), (k2, d2) = make_entry(parts_for(1)), make_entry(parts_for(2))
    other_build = Entry(key=k1, backend="triton", name="add_kernel", blobs={"cubin": b"other bytes"}).encode()
    root = tmp_path / "cache"
    disk = DiskTier(root)
    await disk.set(k1, other_build)
    await disk.set(k2, d2[:-10])  # torn
    path = tmp_path / "b.tgz"
    write_bundle(path, [(f"entries/{k1}", d1), (f"entries/{k2}", d2)])
    report = await import_bundle(root, path)
    assert (report.entries, report.kept, report.repaired) == (1, 1, 1) and report.ok
    assert on_disk(root) == {k1: other_build, k2: d2}


# --- prune ---------------------------------------------------------------------------------------


def age(root: Path, key: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(DiskTier(root).path(key), (then, then))


async def test_prune_by_age_removes_what_was_written_longest_ago(cache_dir: Path) -> None:
    keys = sorted(await fill(cache_dir, 4))
    age(cache_dir, keys[0], 40 * DAY)
    age(cache_dir, keys[1], 31 * DAY)
    age(cache_dir, keys[2], 29 * DAY)
    dry = await prune(cache_dir, max_age_s=30 * DAY, dry_run=True)
    assert dry.removed_by_age == 2 and len(on_disk(cache_dir)) == 4 and "would remove 2" in dry.summary()
    report = await prune(cache_dir, max_age_s=30 * DAY)
    assert (report.removed_by_age, report.removed_by_size, report.entries_after) == (2, 0, 2)
    assert sorted(on_disk(cache_dir)) == keys[2:]


async def test_prune_by_size_removes_the_oldest_until_it_fits(cache_dir: Path) -> None:
    entries = await fill(cache_dir, 5, size=1000)
    order = sorted(entries)
    for rank, key in enumerate(order):
        age(cache_dir, key, (10 - rank) * 60)  # order[0] is the oldest
    size = len(entries[order[0]])
    report = await prune(cache_dir, max_bytes=3 * size)
    assert report.removed_by_size == 2 and report.bytes_after == 3 * size
    assert sorted(on_disk(cache_dir)) == order[2:]
    assert (await prune(cache_dir, max_bytes=10 * size)).removed == 0
    both = await prune(cache_dir, max_bytes=size, max_age_s=7.5 * 60)
    assert (both.removed_by_age, both.removed_by_size) == (1, 1) and sorted(on_disk(cache_dir)) == order[4:]
    assert (await prune(cache_dir, max_bytes=0)).entries_after == 0


async def test_prune_removes_stale_temporary_files_and_leaves_libraries(cache_dir: Path) -> None:
    keys = sorted(await fill(cache_dir, 1))
    folder = DiskTier(cache_dir).path(keys[0]).parent
    stale, fresh = folder / ".abc.123.dead.tmp", folder / ".abc.124.beef.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    lib = cache_dir / "lib"
    lib.mkdir()
    (lib / f"{keys[0]}.so").write_bytes(b"\x7fELF")
    orphan = lib / f"{'c' * 64}.so"
    orphan.write_bytes(b"\x7fELF....")
    # The workers' bytecode writer's, where a process killed mid-write (a bytecode helper) left
    # one, deep in its folder's tree; the bytecode itself stays.
    pycache = cache_dir / "toolchain" / "bytecode" / "site" / "pkg" / "__pycache__"
    pycache.mkdir(parents=True)
    stale_pyc = pycache / "mod.cpython-311.pyc.4242.0123abcd.tmp"
    fresh_pyc = pycache / "mod.cpython-311.pyc.4243.0123abce.tmp"
    pyc = pycache / "mod.cpython-311.pyc"
    for path in (stale_pyc, fresh_pyc, pyc):
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    os.utime(fresh_pyc)
    report = await prune(cache_dir, max_age_s=DAY)
    assert report.temp_files_removed == 2 and not stale.exists() and fresh.exists()
    assert not stale_pyc.exists() and fresh_pyc.exists() and pyc.exists()
    assert (report.orphan_libs, report.orphan_lib_bytes) == (1, 8) and orphan.exists()
    assert "outlived their entries (left in place)" in report.summary()
    with pytest.raises(ValueError):
        await prune(cache_dir, max_bytes=-1)


def test_ages_read_as_a_person_writes_them() -> None:
    assert [parse_age(t) for t in ("30d", "12h", "90m", "3600s", "45", "1.5h", "2w")] == [
        30 * DAY,
        12 * 3600,
        90 * 60,
        3600,
        45,
        5400,
        14 * DAY,
    ]
    for bad in ("3x", "d", "-1d", "", "nan"):
        with pytest.raises(ValueError):
            parse_age(bad)


# --- explain -------------------------------------------------------------------------------------


def test_explain_names_the_factors_that_differ() -> None:
    a = parts_for(1)
    assert explain(a, json.loads(json.dumps(a))) == []  # tuples or lists, as the key sees them
    b = parts_for(
        2,
        target="cuda:80",
        toolchain={**a["toolchain"], "ptxas": "13.0"},
        env={"TRITON_DEFAULT_FP_FUSION": "0"},
        options={"num_stages": 3, "num_warps": 8},
    )
    del b["attrs"]
    assert explain(a, b) == [
        ("kernel", a["kernel"], b["kernel"]),
        ("attrs", [], ABSENT),
        ("options.num_warps", 4, 8),
        ("target", TARGET, "cuda:80"),
        ("toolchain.ptxas", "12.9", "13.0"),
        ("env.TRITON_DEFAULT_FP_FUSION", ABSENT, "0"),
    ]
    assert describe_factor("toolchain.ptxas") == "toolchain.ptxas (compiler versions)"
    assert describe_factor("kernel") == "kernel (source)"


async def test_explain_key_reads_the_recorded_parts(cache_dir: Path) -> None:
    disk = DiskTier(cache_dir)
    parts = parts_for(1)
    key, data = make_entry(parts)
    await disk.set(key, data)
    info = await explain_key(cache_dir, key)
    assert info["key_parts"] == json.loads(json.dumps(parts)) and info["parts_match_key"] is True
    assert info["name"] == "add_kernel" and info["bytes"] == len(data) and info["note"] is None

    old_key, old = make_entry(parts_for(2), record=False)
    await disk.set(old_key, old)
    empty_key = "d" * 64
    await disk.set(empty_key, Entry(empty_key, "triton", "k", {"a": b""}, {"key_parts": {}}).encode())
    for k in (old_key, empty_key):
        info = await explain_key(cache_dir, k)
        assert info["key_parts"] is None and "predates key recording" in info["note"]

    liar_key = "e" * 64  # parts that do not hash to the key they are stored under
    await disk.set(liar_key, Entry(liar_key, "triton", "k", {"a": b""}, {"key_parts": parts}).encode())
    assert (await explain_key(cache_dir, liar_key))["parts_match_key"] is False
    with pytest.raises(AcompileError, match="no entry"):
        await explain_key(cache_dir, "0" * 64)
    disk.path(key).write_bytes(data[:-1])
    with pytest.raises(AcompileError, match="damaged"):
        await explain_key(cache_dir, key)


async def test_explain_miss_finds_the_nearest_compile_of_the_same_kernel(cache_dir: Path) -> None:
    disk = DiskTier(cache_dir)
    wanted = parts_for(1, toolchain={"triton": "3.9.0", "triton_files": "ab" * 8, "ptxas": "13.0"})
    near = parts_for(1)
    far = parts_for(2, target="cuda:80")
    other_kernel = parts_for(1, name="softmax")
    for p in (near, far, other_kernel):
        await disk.set(*make_entry(p))
    ranked = await explain_miss(cache_dir, wanted)
    assert [k for k, _ in ranked] == [make_key(near), make_key(far)]
    assert ranked[0][1] == [("toolchain.ptxas", "13.0", "12.9")]


# --- the command line ----------------------------------------------------------------------------


def test_cli_export_import_and_their_exit_codes(cache_dir: Path, tmp_path: Path) -> None:
    entries = anyio.run(fill, cache_dir, 3)
    path = tmp_path / "seed.tar.gz"
    out = acompile_cmd("cache", "export", str(path), "--cache-dir", str(cache_dir))
    assert out.returncode == 0, out.stderr
    assert "exported 3 entries" in out.stdout
    replica = tmp_path / "replica"
    out = acompile_cmd("cache", "import", str(path), "--cache-dir", str(replica))
    assert out.returncode == 0, out.stderr
    assert "imported 3 entries" in out.stdout and on_disk(replica) == entries

    key, data = next(iter(entries.items()))
    bad = tmp_path / "bad.tgz"
    write_bundle(bad, [(f"entries/{key}", data[:-1]), ("../escape", data)])
    out = acompile_cmd("cache", "import", str(bad), "--cache-dir", str(replica))
    assert out.returncode == 1
    assert "2 rejected" in out.stdout and f"rejected entries/{key}: damaged entry" in out.stderr
    assert "rejected ../escape: refused: a path outside the bundle" in out.stderr

    garbage = tmp_path / "garbage"
    garbage.write_text("hello")
    out = acompile_cmd("cache", "import", str(garbage), "--cache-dir", str(replica))
    assert out.returncode == 2 and "is not an acompile bundle" in out.stderr

    DiskTier(cache_dir).path(key).write_bytes(data[:-1])
    out = acompile_cmd("cache", "export", str(path), "--cache-dir", str(cache_dir))
    assert out.returncode == 1 and "exported 2 entries" in out.stdout and f"left out {key}" in out.stderr

    # A signing key too short to sign with: one line and 2, as import and warmup say it.
    out = subprocess.run(
        [sys.executable, "-m", "acompile.cli", "cache", "export", str(path), "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**subprocess_env(), "ACOMPILE_SIGNING_KEY": "short"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "at least 16 bytes" in out.stderr and out.stderr.startswith("acompile cache export:")


def test_cli_export_of_a_manifest_takes_its_kernels_only(cache_dir: Path, tmp_path: Path) -> None:
    from kernels_for_tests import ADD_SIG, add_kernel

    from acompile._backends import TritonSpec, prepare_triton
    from acompile._targets import parse_target

    manifest = tmp_path / "m.toml"
    manifest.write_text(
        "[[kernel]]\n"
        'kernel = "kernels_for_tests:add_kernel"\n'
        f"signature = {json.dumps(ADD_SIG).replace(':', ' =')}\n"
        "constexprs = [{ BLOCK = 64 }, { BLOCK = 128 }]\n"
    )

    async def key(block: int) -> str:
        spec = TritonSpec(add_kernel, ADD_SIG, {"BLOCK": block})
        return (await prepare_triton(spec, parse_target(TARGET), cache_dir / "toolchain")).key

    keys = [anyio.run(key, 64), anyio.run(key, 128)]
    unrelated = anyio.run(fill, cache_dir, 2)
    disk = DiskTier(cache_dir)
    data = Entry(keys[0], "triton", "add_kernel", {"cubin": b"\x00" * 10}).encode()
    anyio.run(disk.set, keys[0], data)
    path = tmp_path / "m.tgz"
    args = ["cache", "export", str(path), "--manifest", str(manifest), "--cache-dir", str(cache_dir)]
    out = acompile_cmd(*args)
    assert out.returncode == 2 and "name no target" in out.stderr
    out = acompile_cmd(*args, "--target", TARGET)
    assert out.returncode == 1, out.stderr  # one of the manifest's two kernels is not compiled
    assert "exported 1 entry" in out.stdout and f"missing {keys[1]}" in out.stderr
    assert "run `acompile warmup` on the manifest first" in out.stderr
    with tarfile.open(path) as tar:
        assert tar.getnames() == [BUNDLE_MANIFEST, f"entries/{keys[0]}"]
    assert not set(unrelated) & set(keys)
    anyio.run(disk.set, keys[1], Entry(keys[1], "triton", "add_kernel", {"cubin": b"\x01"}).encode())
    out = acompile_cmd(*args, "--target", TARGET)
    assert out.returncode == 0 and "exported 2 entries" in out.stdout
    assert "is not used" not in out.stderr
    # A manifest whose kernels name their targets: --target changes nothing, and says so.
    named = tmp_path / "named.toml"
    named.write_text(manifest.read_text() + f'targets = ["{TARGET}"]\n')
    out = acompile_cmd("cache", "export", str(path), "--manifest", str(named), "--cache-dir", str(cache_dir),
                       "--target", "cuda:80")  # fmt: skip
    assert out.returncode == 0 and "exported 2 entries" in out.stdout, out.stderr
    assert "note: --target cuda:80 is not used" in out.stderr, out.stderr


def test_cli_prune(cache_dir: Path) -> None:
    keys = sorted(anyio.run(fill, cache_dir, 3))
    age(cache_dir, keys[0], 3 * DAY)
    out = acompile_cmd("cache", "prune", "--cache-dir", str(cache_dir))
    assert out.returncode == 2 and "--max-size" in out.stderr
    for bad in (["--max-age", "3x"], ["--max-size", "lots"]):
        out = acompile_cmd("cache", "prune", *bad, "--cache-dir", str(cache_dir))
        assert out.returncode == 2 and "cannot read" in out.stderr
    # A bare number would be bytes (it would empty the cache): a unit is asked for, nothing goes.
    out = acompile_cmd("cache", "prune", "--max-size", "10", "--cache-dir", str(cache_dir))
    assert out.returncode == 2 and "needs a unit: e.g. 10GiB" in out.stderr
    assert sorted(on_disk(cache_dir)) == keys
    out = acompile_cmd(
        "cache", "prune", "--max-age", "2d", "--max-size", "10GiB", "--cache-dir", str(cache_dir)
    )
    assert out.returncode == 0, out.stderr
    assert (
        "removed 1 entry" in out.stdout
        and "1 by age" in out.stdout
        and sorted(on_disk(cache_dir)) == keys[1:]
    )


def test_cli_explain_and_stats(cache_dir: Path) -> None:
    disk = DiskTier(cache_dir)
    a = parts_for(1)
    b = parts_for(1, toolchain={**a["toolchain"], "ptxas": "13.0"})
    # A long source in the recorded parts makes a header larger than 64 KiB.
    big = parts_for(3, name="big", source="x" * 100_000)
    for p in (a, b, big):
        anyio.run(disk.set, *make_entry(p))
    ka, kb = make_key(a), make_key(b)
    old_key, old = make_entry(parts_for(4), record=False)
    anyio.run(disk.set, old_key, old)
    root = str(cache_dir)

    out = acompile_cmd("cache", "explain", ka, "--cache-dir", root)
    assert out.returncode == 0, out.stderr
    assert f"key      {ka}" in out.stdout and "target" in out.stdout and "cuda:90" in out.stdout
    assert "toolchain (compiler versions)  ptxas=12.9" in out.stdout
    assert f"other entries of add_kernel here, nearest first:\n  {kb}: 1 factor differs" in out.stdout

    out = acompile_cmd("cache", "explain", ka, "--against", kb, "--cache-dir", root)
    assert out.returncode == 0, out.stderr
    assert "1 factor differs:\n  toolchain.ptxas (compiler versions):\n    - 12.9\n    + 13.0" in out.stdout
    assert "kernel (source)" not in out.stdout

    out = acompile_cmd("cache", "explain", old_key, "--cache-dir", root)
    assert out.returncode == 0 and "predates key recording" in out.stdout
    out = acompile_cmd("cache", "explain", ka, "--against", old_key, "--cache-dir", root)
    assert out.returncode == 1 and "predates key recording" in out.stderr
    out = acompile_cmd("cache", "explain", "0" * 64, "--cache-dir", root)
    assert out.returncode == 1 and "no entry" in out.stderr
    out = acompile_cmd("cache", "explain", "nonsense", "--cache-dir", root)
    assert out.returncode == 2 and "is not a cache key" in out.stderr

    out = acompile_cmd("cache", "stats", "--cache-dir", root)
    assert out.returncode == 0 and "entries: 4" in out.stdout and "damaged" not in out.stdout
    # stats shows the newest keys' starts, and explain takes a unique start of one.
    assert f"  {ka[:16]}  triton:add_kernel" in out.stdout or f"  {kb[:16]}  triton:add_kernel" in out.stdout
    out = acompile_cmd("cache", "explain", ka[:12], "--cache-dir", root)
    assert out.returncode == 0 and f"key      {ka}" in out.stdout, out.stderr
    out = acompile_cmd("cache", "explain", "f00ba4", "--cache-dir", root)
    # No entry starts so: absent, as a whole key that is not there (1), not a usage error (2).
    assert out.returncode == 1 and "no entry" in out.stderr and "starts with 'f00ba4'" in out.stderr
