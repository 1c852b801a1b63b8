"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, subprocess_env


def test_the_warmup_example_fills_the_cache_then_finds_it_full(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "warmup.py"), "--cache-dir", str(tmp_path / "cache")]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert first.returncode == 0, first.stderr
    assert "14 kernels for cuda:90, cuda:80: 14 compiled, 0 cached, 0 failed" in first.stdout
    again = subprocess.run(
        [*cmd, "--target", "cuda:90"], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert again.returncode == 0, again.stderr
    assert "7 kernels for cuda:90: 0 compiled, 7 cached, 0 failed" in again.stdout
    wrong = subprocess.run(
        [*cmd, "--target", "cuda:12345"], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert wrong.returncode == 2 and "unknown CUDA architecture in 'cuda:12345'" in wrong.stderr
    assert "Traceback" not in wrong.stderr, wrong.stderr
    # A cache folder that cannot be made: compiled, but nothing filled, which is a failure.
    (tmp_path / "a-file").write_text("")
    nowhere = [sys.executable, str(ROOT / "examples" / "warmup.py"), "--target", "cuda:90"]
    nowhere += ["--cache-dir", str(tmp_path / "a-file" / "cache")]
    unsaved = subprocess.run(nowhere, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert unsaved.returncode == 1, unsaved.stderr
    assert (
        "7 compiled" in unsaved.stdout and "7 compiled kernels are not in the cache folder" in unsaved.stderr
    )
