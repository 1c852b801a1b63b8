"""Warm-up from production (record, then replay) and traces of the pool's work."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import anyio
import pytest
from conftest import TARGET, Mounts, fill, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel

import acompile

pytestmark = pytest.mark.anyio


async def test_a_record_that_cannot_be_written_costs_the_record_not_the_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The record's folder cannot be made (a file stands where it would be: as a read-only or
    full disk would refuse it): one warning, and the pool goes on serving (it used to shut down,
    every later request failing with PoolClosedError)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    record = blocker / "served.toml"
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c", record=record) as p:
        await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}))
        await anyio.sleep(0.5)  # the record is written in the background
        await p.compile(acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": 128}))
        assert p.stats()["state"] == "running"
    assert caplog.text.count("cannot write the warm-up record") == 1, caplog.text


async def test_record_then_warmup_replays_what_was_served(tmp_path: Path) -> None:
    manifest = tmp_path / "served.toml"
    async with acompile.CompilePool(2, target=TARGET, cache_dir=tmp_path / "prod", record=manifest) as p:
        await p.gather(
            acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}),
            acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}),  # the same: recorded once
            acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": 128}, num_warps=8),
        )
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "prod", record=manifest) as p:
        await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}))  # a later run: not again
    text = manifest.read_text()
    assert text.count("[[kernel]]") == 2, text
    assert "kernels_for_tests:scale_add_kernel" in text and "num_warps = 8" in text
    # The next deploy, on a machine without a GPU and with an empty cache: replay it.
    command = [
        sys.executable,
        "-m",
        "acompile.cli",
        "warmup",
        str(manifest),
        "--cache-dir",
        str(tmp_path / "next"),
    ]
    out = await anyio.run_process(command, check=False, env=subprocess_env())
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr
    assert "2 kernels: 2 compiled, 0 cached, 0 failed" in stdout


async def test_a_trace_holds_a_span_per_request_and_opens_as_chrome_json(
    tmp_path: Path, cache_dir: Path
) -> None:
    path = tmp_path / "trace.json"
    async with acompile.CompilePool(2, target=TARGET, cache_dir=cache_dir) as p:
        async with p.trace(path):
            await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}))
            await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}))
        await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 32}))  # after: not traced
    doc = json.loads(await anyio.Path(path).read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    requests = [e for e in spans if e["name"].startswith("add_kernel (")]
    assert [e["args"]["tier"] for e in requests] == ["compile", "memory"]
    assert requests[0]["args"]["constexprs"] == {"BLOCK": 64} and len(requests[0]["args"]["key"]) == 64
    compiles = [e for e in spans if e["name"] == "add_kernel" and "worker_pid" in e["args"]]
    assert len(compiles) == 1 and compiles[0]["dur"] > 0
    assert any(e["name"] == "queue wait" for e in spans) and any(e["name"] == "load" for e in spans)
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert "requests" in tracks and any(t.startswith("worker pid") for t in tracks)
    assert not any(e["args"].get("constexprs") == {"BLOCK": 32} for e in spans)


def test_processes_recording_into_one_file_record_each_entry_once(tmp_path: Path) -> None:
    """A server's ranks under ``acompile run --record`` share one record: each append holds a
    lock on the file, and what another process recorded meanwhile is not recorded again (each
    process alone would record it: it has not seen the other's)."""
    import subprocess

    record = tmp_path / "served.toml"
    start = tmp_path / "go"
    code = """
import os, sys, time
from pathlib import Path
from acompile._manifest import Recorder
r = Recorder(Path(sys.argv[1]))
Path(sys.argv[2] + f".ready-{os.getpid()}").touch()
while not os.path.exists(sys.argv[2]):  # all at once: the same keys at the same moments
    time.sleep(0.001)
for i in range(400):
    r.add_module(f"{i:064x}", "flashinfer", {"module": f"m{i}", "files": {"<w>/a.cu": "x\\x7f\\U0001f600"}})
"""
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(record), str(start)], env=subprocess_env())
        for _ in range(4)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("go.ready-*"))) < len(procs):  # each one imported and waiting
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        start.write_text("")
        assert [p.wait(timeout=120) for p in procs] == [0] * 4
    finally:
        for p in procs:
            p.kill()
    import tomllib

    entries = tomllib.loads(record.read_text())["flashinfer"]
    assert sorted(e["module"] for e in entries) == sorted(f"m{i}" for i in range(400))
    # Text that TOML escapes otherwise than JSON (DEL, a character outside the BMP) reads back.
    assert {e["files"]["<w>/a.cu"] for e in entries} == {"x\x7f\U0001f600"}


def test_a_record_is_this_users_file_and_never_left_with_half_an_entry(
    tmp_path: Path, mounts: Mounts
) -> None:
    """The record is appended only to a regular file of this user's (a link planted where it
    goes is refused, not followed); an entry the disk refuses halfway (a real tmpfs, full) is
    cut off again, so the record still parses and the entry is recorded at the next try; a
    record replaced by another file is read anew (an entry the user removed is recorded again)."""
    import tomllib

    from acompile._manifest import Recorder

    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    link = tmp_path / "linked.toml"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        Recorder(link).add_module("a" * 64, "flashinfer", {"module": "m"})
    assert victim.read_text() == "mine\n"

    disk = tmp_path / "disk"
    mounts.tmpfs(disk, "1m")
    record = disk / "served.toml"
    recorder = Recorder(record)
    assert recorder.add_module("a" * 64, "flashinfer", {"module": "first"})
    size = record.stat().st_size
    fill(disk, leave=4096)
    big = {"module": "second", "files": {"<w>/x.cu": "x" * 20000}}
    with pytest.raises(OSError, match="No space left"):
        recorder.add_module("b" * 64, "flashinfer", big)
    assert record.stat().st_size == size
    (disk / "filler").unlink()
    assert recorder.add_module("b" * 64, "flashinfer", big)
    assert [e["module"] for e in tomllib.loads(record.read_text())["flashinfer"]] == ["first", "second"]

    # Replaced by an edited copy without the second entry: the next add reads it anew.
    edited = disk / "edited.toml"
    edited.write_text(record.read_text().split('\n[[flashinfer]]\nkey = "' + "b" * 64)[0] + "\n" * 40)
    edited.replace(record)
    assert recorder.add_module("b" * 64, "flashinfer", big)
    assert [e["module"] for e in tomllib.loads(record.read_text())["flashinfer"]] == ["first", "second"]


def test_a_record_locked_by_another_process_for_long_costs_the_entry_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that holds the record's lock and does not let go (stopped, stuck on a network
    filesystem): an append waits a bounded time, then fails (the pool then records nothing
    more, and says so once), instead of holding the build that asked, and the pool's exit."""
    import subprocess

    from acompile import _manifest

    record = tmp_path / "served.toml"
    record.write_text("")
    held = tmp_path / "held"
    holder = subprocess.Popen(["flock", str(record), "sh", "-c", f"touch {held}; sleep 60"])
    try:
        deadline = time.monotonic() + 30
        while not held.exists():  # the lock is taken
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.01)
        monkeypatch.setattr(_manifest, "_LOCK_WAIT", 0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="stayed locked"):
            _manifest.Recorder(record).add_module("a" * 64, "flashinfer", {"module": "m"})
        assert time.monotonic() - started < 30
    finally:
        holder.kill()
        holder.wait()
