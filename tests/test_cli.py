"""The `acompile` command, run as a user runs it."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT, gpu_available, run_python, subprocess_env


def acompile_cmd(
    *args: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acompile.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=subprocess_env(),
    )


def test_warmup_compiles_the_example_manifest_then_finds_it_cached(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    report = tmp_path / "report.json"
    first = acompile_cmd(
        "warmup",
        str(ROOT / "examples" / "manifest.toml"),
        "--cache-dir",
        str(cache),
        "--workers",
        "2",
        "--json",
        str(report),
    )
    assert first.returncode == 0, first.stderr
    assert "14 kernels: 14 compiled, 0 cached, 0 failed" in first.stdout
    assert "matmul_kernel" in first.stdout and "cuda:80" in first.stdout
    assert "14/14" in first.stderr  # the progress bar, on stderr
    rows = json.loads(report.read_text())["kernels"]
    assert len(rows) == 14 and all(len(r["key"]) == 64 for r in rows)
    # Queue wait and compile time apart, for each kernel a worker compiled.
    header = first.stdout.splitlines()[0].split()
    assert header[-4:] == ["wait", "s", "compile", "s"], first.stdout
    assert all(r["wait_seconds"] >= 0 and r["compile_seconds"] > 0 for r in rows), rows
    # Every entry of this manifest names its targets: a --target is not used, and the run says so.
    second = acompile_cmd(
        "warmup",
        str(ROOT / "examples" / "manifest.toml"),
        "--cache-dir",
        str(cache),
        "--json",
        str(report),
        "--target",
        "cuda:86",
    )
    assert second.returncode == 0, second.stderr
    assert "note: --target cuda:86 is not used: every kernel" in second.stderr, second.stderr
    assert "cuda:86" not in second.stdout
    assert "14 kernels: 0 compiled, 14 cached, 0 failed" in second.stdout
    assert "cached (disk)" in second.stdout
    rows = json.loads(report.read_text())["kernels"]
    assert all(r["wait_seconds"] is None and r["compile_seconds"] is None for r in rows)
    stats = acompile_cmd("cache", "stats", "--cache-dir", str(cache))
    assert stats.returncode == 0
    assert "entries: 14" in stats.stdout and "triton: 14 entries" in stats.stdout


def test_warmup_exits_non_zero_and_names_what_failed(tmp_path: Path) -> None:
    (tmp_path / "kernels_bad.py").write_text(
        textwrap.dedent(
            """
            import triton, triton.language as tl

            @triton.jit
            def good(x_ptr, BLOCK: tl.constexpr):
                tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)

            @triton.jit
            def bad(x_ptr, BLOCK: tl.constexpr):
                tl.store(x_ptr + tl.arange(0, BLOCK), no_such_thing)
            """
        )
    )
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        textwrap.dedent(
            """
            [defaults]
            targets = ["cuda:90"]
            [[kernel]]
            kernel = "kernels_bad.py:good"
            signature = { x_ptr = "*fp32" }
            constexprs = { BLOCK = 64 }
            [[kernel]]
            kernel = "kernels_bad.py:bad"
            signature = { x_ptr = "*fp32" }
            constexprs = { BLOCK = 64 }
            """
        )
    )
    out = acompile_cmd("warmup", str(manifest), "--cache-dir", str(tmp_path / "cache"), "--workers", "1")
    assert out.returncode == 1
    assert "2 kernels: 1 compiled, 0 cached, 1 failed" in out.stdout
    assert "FAILED bad cuda:90" in out.stdout and "no_such_thing" in out.stdout


def test_warmup_fails_when_its_kernels_cannot_reach_the_cache_folder(tmp_path: Path) -> None:
    """Filling the cache folder is warm-up's job: a folder it cannot write to (here, under a
    regular file) makes it compile into memory only, and it says so and exits 1 instead of
    reporting success with nothing on disk."""
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"
    out = acompile_cmd("warmup", str(ROOT / "examples" / "manifest.toml"), "--cache-dir", str(cache))
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cannot be written by this process" in out.stderr and "Not a directory" in out.stderr
    assert f"kernels are not in the cache folder {cache}" in out.stderr, out.stderr


def test_warmup_whose_json_report_cannot_be_written_says_so_after_warming_up(tmp_path: Path) -> None:
    # What no check before the work can see: a full disk (/dev/full takes no byte).
    report = Path("/dev/full")
    out = acompile_cmd(
        "warmup", str(ROOT / "examples" / "manifest.toml"), "--cache-dir", str(tmp_path / "cache"),
        "--json", str(report),
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"the kernels are warmed up, but --json {report} cannot be written" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_warmup_refuses_an_empty_target_and_a_json_report_in_a_missing_folder_before_any_work(
    tmp_path: Path,
) -> None:
    manifest = str(ROOT / "examples" / "manifest.toml")
    cache = tmp_path / "cache"
    out = acompile_cmd("warmup", manifest, "--cache-dir", str(cache), "--target", "")
    assert out.returncode == 2 and "--target is empty" in out.stderr, out.stderr
    (tmp_path / "a-file").write_text("")
    cases = {
        str(
            tmp_path / "no-such-folder" / "r.json"
        ): f"there is no folder {tmp_path / 'no-such-folder'} (create",
        str(tmp_path): "it is a folder: name a file",
        "": "it is a folder: name a file",
        str(tmp_path / "a-file" / "r.json"): f"{tmp_path / 'a-file'} is not a folder",
    }
    for report, says in cases.items():
        out = acompile_cmd("warmup", manifest, "--cache-dir", str(cache), "--json", report)
        assert out.returncode == 2, (report, out.stdout[-2000:] + out.stderr[-2000:])
        assert says in out.stderr and "Traceback" not in out.stderr, (report, out.stderr)
    assert not (tmp_path / "no-such-folder").exists() and not cache.exists()  # nothing made or compiled


def test_warmup_explains_a_bad_manifest(tmp_path: Path) -> None:
    cases = {
        "[[kernel]]\nkernel = 'nowhere.py:k'\nsignature = {}\ntargets=['cuda:90']\n": "no file",
        "[[kernel]]\nkernel = 'k'\nsignature = {}\n": "must read 'file.py:name'",
        "[[kernel]]\nkernal = 'x.py:k'\n": "unknown field(s) ['kernal']",
        "[defaults]\nnum_warp = 4\n[[kernel]]\nkernel = 'x.py:k'\n": "[defaults]: unknown field(s) ['num_warp']",
        "defaults = 3\n[[kernel]]\nkernel = 'x.py:k'\n": "[defaults] must be a table",
        "not toml [": "is not valid TOML",
        "[defaults]\n": "lists no [[kernel]] (or [[torch]], [[flashinfer]]) entries",
        # Fields of the wrong shape: named, never a TypeError from inside.
        "[[kernel]]\nkernel = 'x.py:k'\nsignature = 3\n": "signature must be a table of parameter types",
        "[[kernel]]\nkernel = 'x.py:k'\nsignature = {}\nconstexprs = 3\n": "constexprs must be a table",
        "[[kernel]]\nkernel = 'x.py:k'\nsignature = {}\nconstexprs = [1]\n": "constexprs must be a table",
        "[[kernel]]\nkernel = 'x.py:k'\nsignature = {}\ntargets = 5\n": "targets must be a list of targets",
        "[[kernel]]\nkernel = 'x.py:k'\nsignature = {}\noptions = 3\n": "options must be a table",
    }
    for text, message in cases.items():
        manifest = tmp_path / "m.toml"
        manifest.write_text(text)
        out = acompile_cmd("warmup", str(manifest), "--cache-dir", str(tmp_path / "cache"))
        assert out.returncode == 2, (text, out.stdout, out.stderr)
        assert message in out.stderr, (text, out.stderr)
    missing = acompile_cmd("warmup", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "no manifest at" in missing.stderr
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[[kernel]]")
    for path, message in ((tmp_path, "is a folder: name a manifest file"), (binary, "is not a text file")):
        out = acompile_cmd("warmup", str(path))
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
    for workers, message in (("0", "must be at least 1, got 0"), ("two", "not a whole number: 'two'")):
        out = acompile_cmd("warmup", str(manifest), "--workers", workers)
        assert out.returncode == 2 and f"argument --workers: {message}" in out.stderr, out.stderr


def test_warmup_refuses_a_manifest_that_is_no_regular_file_too_large_or_nested_too_deep(
    tmp_path: Path,
) -> None:
    """A manifest is read whole before any work: a device (/dev/zero never ends), a FIFO (no
    writer: the read would wait for ever), a file over the size bound, and TOML nested deeper
    than Python's recursion limit are each refused at once, with exit code 2 and no traceback."""
    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as f:
        f.truncate(65 << 20)  # sparse: nothing written, yet over the bound by its size
    deep = tmp_path / "deep.toml"
    deep.write_text("[[kernel]]\nkernel = 'x.py:k'\nsignature = " + "[" * 100_000 + "]" * 100_000 + "\n")
    # Dotted keys nest tables without the parser recursing; a message's repr of it would.
    dotted = tmp_path / "dotted.toml"
    dotted.write_text("[[kernel]]\nkernel" + ".a" * 20_000 + " = 1\n")
    cases = {
        "/dev/zero": "/dev/zero is not a regular file (a character device): name a manifest file",
        str(fifo): f"{fifo} is not a regular file (a FIFO): name a manifest file",
        str(huge): f"{huge} is 65.0 MiB: a manifest is at most 64 MiB",
        str(deep): f"{deep} nests arrays or tables too deep",
        str(dotted): f"{dotted} nests tables or arrays over 64 deep",
    }
    for path, message in cases.items():
        out = acompile_cmd("warmup", path, "--cache-dir", str(tmp_path / "cache"), timeout=60)
        assert out.returncode == 2, (path, out.stdout[-2000:], out.stderr[-2000:])
        assert message in out.stderr, (path, out.stderr[-2000:])
        assert "Traceback" not in out.stderr, (path, out.stderr[-2000:])
    assert not (tmp_path / "cache").exists()  # refused before any pool


def test_warmup_counts_distinct_variants_and_says_how_many_duplicates_it_skipped(tmp_path: Path) -> None:
    """A manifest that lists the same variant many times (a record concatenated with itself,
    defaults that make two entries equal) is not "N compiled": each distinct variant is one row,
    counted once, and the summary says how many duplicates were skipped."""
    (tmp_path / "kernels_dup.py").write_text(
        "import triton, triton.language as tl\n\n"
        "@triton.jit\ndef fill(x_ptr, BLOCK: tl.constexpr):\n    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)\n"
    )
    variants = ", ".join(["{ BLOCK = 64 }", "{ BLOCK = 128 }"] * 100)
    entry = f'[[kernel]]\nkernel = "kernels_dup.py:fill"\nsignature = {{ x_ptr = "*fp32" }}\nconstexprs = [{variants}]\n'
    manifest = tmp_path / "dup.toml"
    manifest.write_text('[defaults]\ntargets = ["cuda:90"]\n' + entry * 3)
    report = tmp_path / "report.json"
    out = acompile_cmd("warmup", str(manifest), "--cache-dir", str(tmp_path / "cache"), "--workers", "1",
                       "--json", str(report))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2 kernels: 2 compiled, 0 cached, 0 failed" in out.stdout, out.stdout
    assert "598 duplicate variants skipped" in out.stdout, out.stdout
    document = json.loads(report.read_text())
    assert len(document["kernels"]) == 2 and document["duplicates"] == 598
    assert len({r["key"] for r in document["kernels"]}) == 2


def test_warmup_log_lines_start_on_their_own_line_under_the_progress_bar(tmp_path: Path) -> None:
    (tmp_path / "kernels_bad2.py").write_text(
        "import triton, triton.language as tl\n\n"
        "@triton.jit\ndef good(x_ptr, BLOCK: tl.constexpr):\n    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)\n\n"
        "@triton.jit\ndef bad(x_ptr, BLOCK: tl.constexpr):\n    tl.store(x_ptr + tl.arange(0, BLOCK), nothing)\n"
    )
    defaults = (
        '[defaults]\ntargets = ["cuda:90"]\nsignature = { x_ptr = "*fp32" }\nconstexprs = { BLOCK = 64 }\n'
    )
    manifest = tmp_path / "m.toml"
    manifest.write_text(defaults + '[[kernel]]\nkernel = "kernels_bad2.py:good"\n')
    cached = acompile_cmd("warmup", str(manifest), "--cache-dir", str(tmp_path / "c"))
    assert cached.returncode == 0, cached.stderr
    # Now the good kernel is a disk hit, which draws the bar long before the bad one has failed
    # on a worker (that needs a worker to start first).
    manifest.write_text(manifest.read_text() + '[[kernel]]\nkernel = "kernels_bad2.py:bad"\n')
    # stderr on a terminal: the progress bar redraws its line there, and a log record must not
    # land in the middle of it.
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "acompile", "warmup", str(manifest), "--cache-dir", str(tmp_path / "c")],
            stdout=subprocess.PIPE,
            stderr=terminal,
            text=True,
            timeout=300,
            env=subprocess_env(),
        )
        os.close(terminal)
        terminal = -1
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(controller)
        if terminal != -1:
            os.close(terminal)
    assert proc.returncode == 1
    err = seen.decode().replace("\r\n", "\n")
    assert "1/2" in err.split("acompile: WARNING")[0], repr(err)
    warning = err.index("acompile: WARNING: compile of bad failed")
    assert err[warning - 1] == "\n", repr(err)
    assert err[warning:].split("\n", 1)[1].startswith("\r["), repr(err)  # the bar goes on below it


def test_version_and_python_m_acompile() -> None:
    import acompile

    out = subprocess.run(
        [sys.executable, "-m", "acompile", "--version"], capture_output=True, text=True, env=subprocess_env()
    )
    assert out.returncode == 0 and out.stdout.strip() == f"acompile {acompile.__version__}"
    usage = subprocess.run(
        [sys.executable, "-m", "acompile"], capture_output=True, text=True, env=subprocess_env()
    )
    assert usage.returncode == 2 and "usage: acompile" in usage.stderr


def test_a_reader_that_goes_away_is_not_an_error_with_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head -1` does once it has its line
    try:
        out = subprocess.run(
            [sys.executable, "-m", "acompile", "cache", "stats", "--cache-dir", str(tmp_path / "cache")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=subprocess_env(),
        )
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr
    assert out.stderr == ""


def test_bench_help_names_the_command() -> None:
    out = acompile_cmd("bench", "--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: acompile bench"), out.stdout
    assert "_bench" not in out.stdout
    bad = acompile_cmd("bench", "--no-such-option")
    assert bad.returncode == 2 and "acompile bench: error:" in bad.stderr


def test_bench_names_a_bad_target_and_what_a_section_needs_before_running_anything(tmp_path: Path) -> None:
    bad = acompile_cmd("bench", "--target", "cuda:999", cwd=tmp_path, timeout=60)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "acompile bench: error: --target: unknown CUDA architecture in 'cuda:999'" in bad.stderr, (
        bad.stderr
    )
    assert not (tmp_path / "bench-results").exists() and "[bench] " not in bad.stderr
    # A package missing (psutil, blocked in this process as if not installed): one named line.
    for args in (["bench", "--only", "lifecycle"], ["bench", "--storm"], ["bench"]):
        blocked = run_python(
            f"import sys; sys.modules['psutil'] = None; from acompile.cli import main; sys.exit(main({args!r}))"
        )
        assert blocked.returncode == 2, (args, blocked.stdout, blocked.stderr)
        assert "psutil (pip install 'acompile[bench]')" in blocked.stderr, blocked.stderr
        assert "Traceback" not in blocked.stderr and "[bench] " not in blocked.stderr  # no row started
    if gpu_available():
        return  # the GPU sections would run: tests/test_gpu.py runs --first-launch
    for section in ("--first-launch", "--autotune"):
        out = acompile_cmd("bench", section, cwd=tmp_path, timeout=120)
        assert out.returncode == 2, (section, out.stdout, out.stderr)
        assert f"acompile bench {section}: needs an NVIDIA GPU that PyTorch can use" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_a_bad_shared_cache_url_says_what_a_good_one_looks_like() -> None:
    for url in ("redis:/bad", "redis://host:6379/zero", "redis://host:port/0", "http://host"):
        out = acompile_cmd("warmup", str(ROOT / "examples" / "manifest.toml"), "--shared-cache", url)
        assert out.returncode == 2, (url, out.stderr)
        assert "redis://host:port" in out.stderr.lower() and out.stderr.count(url) == 1, out.stderr
        assert out.stderr.count(" use ") + out.stderr.count(" write ") == 1, out.stderr  # one hint
        assert "invalid literal" not in out.stderr and "Traceback" not in out.stderr


def test_cache_commands_refuse_a_folder_that_does_not_exist(tmp_path: Path) -> None:
    for command in (["stats"], ["prune", "--max-age", "1d"], ["export", str(tmp_path / "b.tar.gz")]):
        out = acompile_cmd("cache", *command, "--cache-dir", str(tmp_path / "typo"))
        assert out.returncode == 2, (command, out.stdout)
        assert f"{tmp_path / 'typo'} does not exist" in out.stderr


def test_cache_export_to_a_folder_or_an_unwritable_place_names_the_bundle(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "a-file").write_text("")
    cases = (
        (tmp_path, 2, "it is a folder: name a file"),
        (tmp_path / "a-file" / "b.tar.gz", 2, "cannot write"),
        # A missing folder is not made: a mistyped path would make folders nobody asked for.
        (tmp_path / "no-such" / "folder" / "b.tar.gz", 2, "there is no folder"),
    )
    for bundle, code, message in cases:
        out = acompile_cmd("cache", "export", str(bundle), "--cache-dir", str(tmp_path / "cache"))
        assert out.returncode == code and f"{bundle}" in out.stderr and message in out.stderr, out.stderr
        assert ".tmp" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "no-such").exists()
    out = acompile_cmd(
        "cache",
        "export",
        str(tmp_path / "b.tar.gz"),
        "--target",
        "cuda:90",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert out.returncode == 2 and "--target applies with --manifest only" in out.stderr, out.stderr
    assert not (tmp_path / "b.tar.gz").exists()


def test_cache_stats_on_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = acompile_cmd("cache", "stats", "--cache-dir", str(tmp_path / "empty"))
    assert out.returncode == 0 and "entries: 0" in out.stdout
    assert "bytecode" not in out.stdout


def test_cache_stats_shows_the_workers_bytecode_apart_from_the_entries(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "toolchain" / "bytecode" / "usr" / "lib" / "pkg" / "__pycache__"
    folder.mkdir(parents=True)
    (folder / "mod.cpython-311.pyc").write_bytes(b"x" * 2048)
    out = acompile_cmd("cache", "stats", "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 0 and "entries: 0" in out.stdout
    assert "workers' bytecode" in out.stdout and "1 files, 2.0 KiB" in out.stdout, out.stdout


def test_bench_runs_its_rows_side_by_side_and_writes_json(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    out = acompile_cmd(
        "bench",
        "--limit",
        "2",
        "--workers",
        "1",
        "--only",
        "sequential,acompile_new_kernels,warm_acompile,warm_triton",
        "--warm-repeat",
        "3",
        "--json",
        str(report),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "sequential" in out.stdout and "acompile_cold" in out.stdout and "warm start, acompile" in out.stdout
    )
    # The warm starts side by side, as a ratio too (the one the targets are written against).
    assert "warm start, acompile / Triton: " in out.stdout and "x all kernels ready (medians)" in out.stdout
    rows = json.loads(report.read_text())["rows"]
    # Each warm row ran three times in fresh processes, taking turns; its row is the median run.
    for name, label in (("warm_acompile", "acompile"), ("warm_triton", "Triton")):
        samples = rows[name]["samples_s"]
        assert len(samples) == 3 and rows[name]["wall_s"] == sorted(samples)[1]
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"warm start, {label} "))
        assert "(median of " + ", ".join(f"{x * 1000:.1f}" for x in samples) + ")" in line, line
    # acompile_new_kernels runs on what acompile_cold's pool left: that row runs first.
    assert {"sequential", "acompile_cold", "acompile_new_kernels", "warm_acompile"} <= set(rows)
    assert rows["acompile_new_kernels"]["ok"] == 2 and "acompile_new_kernels " in out.stdout
    # The bound's longest compile: the median of three compiles of that kernel, printed.
    samples = rows["sequential"]["longest_samples"]
    assert len(samples) == 3 and rows["sequential"]["longest_s"] == sorted(samples)[1]
    assert "(median of " in out.stdout
    # Their time is not the sequential row's (its wall and CPU seconds leave them out).
    assert "uncounted_s" not in rows["sequential"] and "uncounted_cpu_s" not in rows["sequential"]
    # The loop's lag comes with the full collections that stopped it in the same window.
    assert "full GC" in out.stdout
    assert isinstance(rows["acompile_cold"]["lag"]["full_gc"], int)


def test_bench_row_on_what_the_cold_row_left_is_not_run_without_it(tmp_path: Path) -> None:
    # Run on an empty cache folder, it would be acompile_cold again under another name.
    import argparse

    from acompile._bench import run

    args = argparse.Namespace(workers=1, target="cuda:90", limit=1, corpus="default", row_timeout=60.0)
    crashed = {"acompile_cold": {"crashed": "killed"}}
    assert "acompile_cold crashed" in run._run_row("acompile_new_kernels", args, tmp_path, crashed)["crashed"]
    empty = tmp_path / "cold-cache"
    empty.mkdir()
    left_nothing = {"acompile_cold": {"acompile_cache_dir": str(empty), "wall_s": 1.0}}
    result = run._run_row("acompile_new_kernels", args, tmp_path, left_nothing)
    assert "left no toolchain folder" in result["crashed"]


def test_bench_lag_probe_counts_the_full_collections_inside_its_window() -> None:
    """A full collection stops the loop like any long step: the probe reports each one's pause,
    and none from outside its window."""
    import gc

    import anyio

    from acompile._bench import harness

    async def main() -> tuple[harness.LagSamples, list[float]]:
        async with harness.probing() as samples:
            await anyio.sleep(0.01)
            gc.collect()  # a full collection, on the loop's thread
            await anyio.sleep(0.01)
            kept = list(samples.full_gc)
        gc.collect()  # after the window: not counted
        return samples, kept

    samples, inside = anyio.run(main)
    assert len(inside) == 1 and inside[0] > 0
    assert samples.full_gc == inside
    assert harness.lag_figures(samples)["full_gc"] == 1
    samples.clear()
    assert samples.full_gc == [] and harness.lag_figures(samples)["full_gc_max_ms"] is None


def test_cache_import_refuses_an_unsigned_bundle_unless_allowed(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    bundle = str(tmp_path / "b.tar.gz")
    env = {k: v for k, v in subprocess_env().items() if k != "ACOMPILE_SIGNING_KEY"}
    run = {"capture_output": True, "text": True, "timeout": 120}
    exported = subprocess.run(
        [sys.executable, "-m", "acompile", "cache", "export", bundle, "--cache-dir", str(tmp_path / "cache")],
        env=env,
        **run,  # type: ignore[call-overload]
    )
    assert exported.returncode == 0 and "unsigned" in exported.stdout, exported.stderr
    env["ACOMPILE_SIGNING_KEY"] = "a-test-key-of-enough-bytes"
    command = [
        sys.executable,
        "-m",
        "acompile",
        "cache",
        "import",
        bundle,
        "--cache-dir",
        str(tmp_path / "r"),
    ]
    refused = subprocess.run(command, env=env, **run)  # type: ignore[call-overload]
    assert refused.returncode == 2
    assert "not signed" in refused.stderr and "--allow-unsigned" in refused.stderr, refused.stderr
    allowed = subprocess.run([*command, "--allow-unsigned"], env=env, **run)  # type: ignore[call-overload]
    assert allowed.returncode == 0, allowed.stderr
    assert "NOT authenticated" in allowed.stdout
