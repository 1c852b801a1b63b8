"""``acompile bench --torch``'s import row, run for real (fresh processes that import torch), and
its report of the targets' rows read from a document of the shape the arms write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

pytest.importorskip("torch")


def test_the_import_row_counts_the_entry_points_one_module_and_times_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "acompile",
            "bench",
            "--torch",
            "--sections",
            "import",
            "--fleet",
            "0",
            "--repeat",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = [line for line in done.stdout.splitlines() if line.startswith("- import torch")]
    assert len(row) == 1, done.stdout
    assert "1 more module(s) than with torch's extensions off: _acompile_autoload." in row[0], row[0]
    assert "its entry point, loaded and called as torch does," in row[0]


def test_the_report_sets_each_target_against_its_anchor() -> None:
    from acompile._bench.compile_torch import report

    def arm(first: float, process: float, wait: float = 0.0) -> dict[str, object]:
        return {
            "first_call_s": first,
            "process_to_ready_s": process,
            "samples_first_call_s": [first],
            "samples_process_s": [process],
            "triton_s": wait,
            "inductor": {},
            "outputs_match": True,
        }

    document = {
        "model": "llama",
        "arms": {
            "cold": arm(20.0, 30.0),
            "acompile_fill": arm(18.0, 27.0),
            "local_warm": arm(5.0, 10.0),
            "acompile_second": arm(5.5, 10.5),
            "serial_cold": arm(25.0, 35.0, 4.3),
            "pool_cold": arm(22.0, 32.0, 1.6),
            "served_threads1_cold": arm(18.0, 28.0, 1.2),
        },
    }
    text = report(document)
    assert "- first machine, served / Inductor alone: first call 18.00 vs 20.00 s = 0.90x" in text
    assert "process 27.00 vs 30.00 s = 0.90x" in text
    assert "- second machine, served / local warm: first call 5.50 vs 5.00 s = 1.10x" in text
    assert "served 1.20 s, Inductor serial 4.30 s, Inductor's own pool (default threads) 1.60 s" in text
