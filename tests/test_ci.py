"""The promise of the README: its test command is the one CI runs, in a venv of CI's own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[str]:
    return [
        line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()
    ]


def test_ci_runs_the_readme_test_command_word_for_word_in_a_fresh_venv() -> None:
    readme = _commands((ROOT / "README.md").read_text())
    test_command = next(c for c in readme if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
    # Its own venv, activated before the command runs: the machine's site-packages never count.
    assert "python3 -m venv" in ci
    assert ci.index("activate") < ci.index(test_command)
