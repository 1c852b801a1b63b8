"""Attacks on the files the command line writes where its user says (``acompile warmup --json``,
``acompile run --record``, ``acompile bench --json``) by a second user (``nobody``; see
tests/attacker.py): a link placed at that path, pointing at a file of the user's, or a file of
theirs there. Each is refused, naming the link or the file and its owner, with a non-zero exit,
and the file pointed at is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from attacker import nobody
from conftest import ROOT, subprocess_env

from acompile._outputs import own_file_problem, write_own_file

KERNELS = """
import triton, triton.language as tl

@triton.jit
def fill_one(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)
"""

MANIFEST = """
[[kernel]]
kernel = "kernels_outputs.py:fill_one"
signature = { x_ptr = "*fp32" }
constexprs = [{ BLOCK = 64 }]
targets = ["cuda:90"]
"""

PRECIOUS = "the user's own file, which nobody else may have written\n"


def _planted_link(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A link at ``name`` that ``nobody`` placed, to a file of this user's."""
    user = nobody()
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    link = tmp_path / name
    link.symlink_to(victim)
    os.chown(link, user.pw_uid, user.pw_gid, follow_symlinks=False)
    return link, victim


def _planted_file(tmp_path: Path, name: str) -> Path:
    """A file of ``nobody``'s at ``name``."""
    user = nobody()
    theirs = tmp_path / name
    theirs.write_text(PRECIOUS)
    os.chown(theirs, user.pw_uid, user.pw_gid)
    return theirs


def _acompile(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acompile", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=subprocess_env(PYTHONPATH=f"{ROOT}{os.pathsep}{cwd}"),
    )


def _manifest(tmp_path: Path) -> Path:
    (tmp_path / "kernels_outputs.py").write_text(KERNELS)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    return manifest


def test_warmup_json_through_another_users_link_is_refused(tmp_path: Path) -> None:
    # It wrote the report through the link, over the file it points at.
    link, victim = _planted_link(tmp_path, "report.json")
    out = _acompile(
        "warmup",
        str(_manifest(tmp_path)),
        "--cache-dir",
        str(tmp_path / "c"),
        "--json",
        str(link),
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a link placed by another user (nobody" in out.stderr, out.stderr
    assert victim.read_text() == PRECIOUS and link.is_symlink()


def test_warmup_json_into_another_users_file_is_refused(tmp_path: Path) -> None:
    theirs = _planted_file(tmp_path, "report.json")
    out = _acompile(
        "warmup",
        str(_manifest(tmp_path)),
        "--cache-dir",
        str(tmp_path / "c"),
        "--json",
        str(theirs),
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a file of another user (nobody" in out.stderr, out.stderr
    assert theirs.read_text() == PRECIOUS


def test_warmup_json_through_the_users_own_link_is_written(tmp_path: Path) -> None:
    mine = tmp_path / "reports" / "latest.json"
    mine.parent.mkdir()
    link = tmp_path / "report.json"
    link.symlink_to(mine)
    out = _acompile(
        "warmup",
        str(_manifest(tmp_path)),
        "--cache-dir",
        str(tmp_path / "c"),
        "--json",
        str(link),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"kernels"' in mine.read_text() and link.is_symlink()


@pytest.mark.parametrize("planted", ["link", "file"])
def test_run_record_at_another_users_link_or_file_is_refused_before_the_program_runs(
    tmp_path: Path, planted: str
) -> None:
    # The served processes' recorder refuses links and others' files, each in its own warning,
    # while the program ran and the command said nothing of it.
    if planted == "link":
        path, victim = _planted_link(tmp_path, "served.toml")
    else:
        path = victim = _planted_file(tmp_path, "served.toml")
    ran = tmp_path / "ran"
    program = f"open({str(ran)!r}, 'w').close()"
    out = _acompile("run", "--record", str(path), "--", sys.executable, "-c", program, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    said = (
        "is a link placed by another user (nobody"
        if planted == "link"
        else "is a file of another user (nobody"
    )
    assert "acompile run: --record" in out.stderr and said in out.stderr, out.stderr
    assert not ran.exists() and victim.read_text() == PRECIOUS


def test_a_report_is_never_written_through_another_users_link_or_into_their_file(tmp_path: Path) -> None:
    # What every --json writer goes through (the bench's too), on the file it opens: a link or a
    # file planted after the command's first check is refused all the same.
    link, victim = _planted_link(tmp_path, "bench.json")
    with pytest.raises(PermissionError, match="is a link placed by another user"):
        write_own_file(link, b"{}")
    theirs = _planted_file(tmp_path, "theirs.json")
    with pytest.raises(PermissionError, match="is a file of another user"):
        write_own_file(theirs, b"{}")
    assert victim.read_text() == PRECIOUS and theirs.read_text() == PRECIOUS  # not even cut short
    # A chain of the user's own links that ends in another user's.
    own = tmp_path / "own.json"
    own.symlink_to(link)
    assert "is a link placed by another user" in (own_file_problem(own) or "")
    # The user's own file is replaced whole.
    mine = tmp_path / "mine.json"
    mine.write_text("x" * 100)
    write_own_file(mine, b"{}")
    assert mine.read_text() == "{}"
