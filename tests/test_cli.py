"""The `acompile` command, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT, subprocess_env


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
    second = acompile_cmd("warmup", str(ROOT / "examples" / "manifest.toml"), "--cache-dir", str(cache))
    assert second.returncode == 0, second.stderr
    assert "14 kernels: 0 compiled, 14 cached, 0 failed" in second.stdout
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


def test_warmup_explains_a_bad_manifest(tmp_path: Path) -> None:
    cases = {
        "[[kernel]]\nkernel = 'nowhere.py:k'\nsignature = {}\ntargets=['cuda:90']\n": "no file",
        "[[kernel]]\nkernel = 'k'\nsignature = {}\n": "must read 'file.py:name'",
        "[[kernel]]\nkernal = 'x.py:k'\n": "unknown field(s) ['kernal']",
        "not toml [": "is not valid TOML",
        "[defaults]\n": "lists no [[kernel]] entries",
    }
    for text, message in cases.items():
        manifest = tmp_path / "m.toml"
        manifest.write_text(text)
        out = acompile_cmd("warmup", str(manifest), "--cache-dir", str(tmp_path / "cache"))
        assert out.returncode == 2, (text, out.stdout, out.stderr)
        assert message in out.stderr, (text, out.stderr)
    missing = acompile_cmd("warmup", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "no manifest at" in missing.stderr


def test_cache_stats_on_an_empty_folder(tmp_path: Path) -> None:
    out = acompile_cmd("cache", "stats", "--cache-dir", str(tmp_path / "nothing"))
    assert out.returncode == 0 and "entries: 0" in out.stdout


def test_bench_runs_its_rows_side_by_side_and_writes_json(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    out = acompile_cmd(
        "bench",
        "--limit",
        "2",
        "--workers",
        "1",
        "--only",
        "sequential,acompile_cold,warm_acompile",
        "--json",
        str(report),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (
        "sequential" in out.stdout and "acompile_cold" in out.stdout and "warm start, acompile" in out.stdout
    )
    rows = json.loads(report.read_text())["rows"]
    assert {"sequential", "acompile_cold", "warm_acompile"} <= set(rows)
