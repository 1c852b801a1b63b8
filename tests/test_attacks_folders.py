"""Attacks on the cache folder by a second user on the machine (``nobody``; see tests/attacker.py).

A cache folder's entries hold code this process runs: a C++ library's constructor runs as the
library is loaded. An attacker who makes the folder first at the path a pool is configured with
(in a shared folder such as ``/tmp``), or puts a link there, plants an entry under the key of a
request the pool will make, with a library of their own in it. Each test plants such an entry as
``nobody`` and checks that the pool refuses the folder, naming it and its owner, and that the
planted library's constructor never runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from attacker import as_nobody, nobody, shared_folder
from conftest import subprocess_env

import acompile
from acompile._cache import Entry, decode_entry

BENIGN = 'extern "C" int answer() { return 42; }\n'


def _evil(marker: Path) -> str:
    """A library whose constructor leaves a file saying whose process loaded it."""
    return f"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {{
    FILE *f = fopen("{marker}", "w");
    if (f) {{ fprintf(f, "%d", (int)getuid()); fclose(f); }}
}}
int answer(void) {{ return 666; }}
"""


async def _benign_entry(scratch: Path) -> Entry:
    """The entry a pool publishes for BENIGN: its key is the one the attacker targets."""
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=scratch, prestart=False) as pool:
        library = await pool.cpp(BENIGN)
    (path,) = [p for p in (scratch / "v1").rglob("*") if p.is_file() and p.name == library.key]
    return decode_entry(path.read_bytes(), library.key)


def _plant(folder: str, entry_bytes: bytes, key: str, source: str, workdir: str) -> str:
    """As nobody: build the attacker's library and plant it under ``key`` in ``folder``, made
    open to read (as a folder another user controls would be)."""
    os.makedirs(os.path.join(folder, "v1", key[:2]), exist_ok=True)
    for sub in (folder, os.path.join(folder, "v1"), os.path.join(folder, "v1", key[:2])):
        os.chmod(sub, 0o755)
    c_file, so_file = os.path.join(workdir, "evil.c"), os.path.join(workdir, "evil.so")
    # (made in the shared folder, as nobody: a file of theirs)
    with open(c_file, "w") as f:
        f.write(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", so_file, c_file], check=True)
    genuine = decode_entry(entry_bytes, key)
    (blob,) = [name for name, data in genuine.blobs.items() if data.startswith(b"\x7fELF")]
    with open(so_file, "rb") as f:
        forged = Entry(
            key, genuine.backend, genuine.name, dict(genuine.blobs, **{blob: f.read()}), genuine.meta
        )
    path = os.path.join(folder, "v1", key[:2], key)
    with open(path, "wb") as f:
        f.write(forged.encode())
    os.chmod(path, 0o644)
    return path


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder like /tmp: anyone may make things in it; only their owner may rename them."""
    with shared_folder() as folder:
        yield folder


async def _try_pool(cache: Path, marker: Path) -> str:
    """What a pool configured with ``cache`` does with BENIGN: the error it raises, or the
    answer of the library it loads."""
    try:
        async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache, prestart=False) as pool:
            library = await pool.cpp(BENIGN)
            return f"served: answer() = {library.answer()}"
    except acompile.UntrustedFolderError as exc:
        return f"refused: {exc}"


@pytest.mark.anyio
async def test_a_cache_folder_another_user_made_first_is_refused_and_nothing_of_theirs_runs(
    shared: Path, tmp_path: Path
) -> None:
    genuine = await _benign_entry(tmp_path / "scratch")
    marker = tmp_path / "constructor-ran"
    theirs = shared / "cache"
    as_nobody(_plant, str(theirs), genuine.encode(), genuine.key, _evil(marker), str(shared))
    outcome = await _try_pool(theirs, marker)
    assert outcome.startswith("refused:") and "belongs to nobody" in outcome and str(theirs) in outcome, (
        outcome
    )
    assert not marker.exists(), f"the planted library ran as uid {marker.read_text()}"
    info = theirs.stat()
    assert info.st_uid == nobody().pw_uid and info.st_mode & 0o777 == 0o755  # never chmod-ed


@pytest.mark.anyio
async def test_a_link_another_user_put_at_the_cache_path_is_refused(shared: Path, tmp_path: Path) -> None:
    genuine = await _benign_entry(tmp_path / "scratch")
    marker = tmp_path / "constructor-ran"
    planted = str(shared / "theirs")
    as_nobody(_plant, planted, genuine.encode(), genuine.key, _evil(marker), str(shared))
    as_nobody(os.symlink, planted, str(shared / "cache"))
    outcome = await _try_pool(shared / "cache", marker)
    assert outcome.startswith("refused:") and "nobody" in outcome, outcome
    assert not marker.exists(), f"the planted library ran as uid {marker.read_text()}"

    # A link of theirs to a folder of ours is refused too: they could point it elsewhere later.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    as_nobody(os.symlink, str(mine), str(shared / "to-mine"))
    outcome = await _try_pool(shared / "to-mine", marker)
    assert outcome.startswith("refused:") and "link" in outcome and "nobody" in outcome, outcome

    # ... and a link of theirs the path walks through and back out of (".."): the kernel follows
    # the link before it goes up, so they could point it elsewhere and move the folder's parent.
    as_nobody(os.symlink, str(mine), str(shared / "work"))
    (tmp_path / "cache").mkdir(mode=0o700)
    outcome = await _try_pool(shared / "work" / ".." / "cache", marker)
    assert outcome.startswith("refused:") and "work" in outcome and "nobody" in outcome, outcome


def test_the_cli_refuses_another_users_cache_folder_with_exit_2(shared: Path, tmp_path: Path) -> None:
    """The commands that write entries, remove them, or sign them (an export signs what the
    folder holds with this user's key), refuse a folder another user controls; those that only
    look (stats, explain) may look at one."""
    theirs = shared / "cache"
    as_nobody(os.mkdir, str(theirs), 0o755)
    manifest = Path(__file__).parent.parent / "examples" / "manifest.toml"
    env = dict(os.environ, ACOMPILE_CACHE_DIR=str(theirs))
    acompile_command = [sys.executable, "-m", "acompile"]
    bundle = tmp_path / "mine.tar"  # a bundle of this user's own (empty) cache
    (tmp_path / "mine").mkdir(mode=0o700)
    made = subprocess.run(
        [*acompile_command, "cache", "export", str(bundle), "--cache-dir", str(tmp_path / "mine")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    for command in (
        ["warmup", str(manifest)],
        ["cache", "import", str(bundle)],
        ["run", "--", sys.executable, "-c", "pass"],
        ["cache", "prune", "--max-age", "0d"],  # files are removed there: theirs may be links
        ["cache", "export", str(tmp_path / "theirs.tar")],
    ):
        done = subprocess.run(
            [*acompile_command, *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, (command, done.returncode, done.stdout, done.stderr)
        assert "belongs to nobody" in done.stderr, (command, done.stderr)
        assert not any(theirs.iterdir()), f"{command} wrote into nobody's folder"


def test_the_launcher_is_never_loaded_from_a_folder_another_user_controls(shared: Path) -> None:
    """The launcher (a C extension acompile builds once per machine) lives in the default cache
    folder and is imported into this process: one of another user's there is never imported,
    and the launcher says why it is not used (kernels then launch through Triton's)."""
    theirs = shared / "cache"
    as_nobody(os.mkdir, str(theirs), 0o755)
    # A fresh process: one that has not looked for its launcher yet, as a program starting.
    code = (
        "from acompile._backends import launcher_module, launcher_problem\n"
        "print(launcher_module(build=False) is None)\n"
        "print(launcher_problem())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(ACOMPILE_CACHE_DIR=str(theirs)),
    )
    assert done.returncode == 0, done.stderr
    unused, problem = done.stdout.splitlines()
    if problem == "Triton's CUDA headers are not installed":
        pytest.skip(problem)
    assert unused == "True"
    assert "belongs to nobody" in problem, problem
    assert not any(theirs.iterdir()), "the launcher's folders were made in nobody's folder"
