"""acompile's one way to write a file: whole or not at all, never through a link.

Every file acompile replaces (cache entries, the toolchain's memo, the workers' bytecode, compiler
logs, traces, bundles, the launcher's library, Inductor's build outputs) goes through
``acompile._files``. These tests hold it to what each of those writers promises.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import textwrap
from pathlib import Path

import pytest
from conftest import run_python

from acompile import _files


def leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if _files.is_temporary(name))


def test_a_write_replaces_the_file_whole_with_the_mode_asked_for(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    _files.write_whole(target, b"new" * 1000, mode=0o640, fsync=True)
    assert target.read_bytes() == b"new" * 1000
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 & ~_umask()
    assert leftovers(tmp_path) == []


def test_a_failure_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "bundle.tar.gz"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="cut short"), _files.writing(target) as file:
        file.write(b"half of the new ")
        file.flush()
        assert leftovers(tmp_path), "the bytes go to a temporary beside the file"
        raise RuntimeError("cut short")
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_a_write_the_disk_refuses_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    # A real short write: the process may write no file beyond 64 KiB (RLIMIT_FSIZE), as a full
    # disk stops a write partway; the kernel answers EFBIG instead of a shorter file.
    target = tmp_path / "entry"
    target.write_bytes(b"old")
    script = textwrap.dedent(
        f"""
        import errno, resource, signal
        from acompile import _files
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        try:
            _files.write_whole({str(target)!r}, b"x" * (1 << 20))
        except OSError as exc:
            print("refused", errno.errorcode[exc.errno])
        """
    )
    out = run_python(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "EFBIG"]
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_link_at_the_temporarys_name_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dangling: bool
) -> None:
    # Someone who can guess the temporary's name plants a link there, to a file of the victim's
    # or to where they want a file made: the write fails, and writes nothing through it.
    monkeypatch.setattr(secrets, "token_hex", lambda n: "0123abcd")
    target = tmp_path / "entry"
    target.write_bytes(b"old")
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    if not dangling:
        victim.write_bytes(b"the victim's")
    planted = tmp_path / f".entry.{os.getpid()}.0123abcd.tmp"
    planted.symlink_to(victim)
    with pytest.raises(OSError) as raised:
        _files.write_whole(target, b"attacker-controlled?")
    assert raised.value.errno in (errno.EEXIST, errno.ELOOP)
    assert target.read_bytes() == b"old"
    assert victim.read_bytes() == b"the victim's" if not dangling else not victim.exists()
    assert planted.is_symlink(), "a file the writer did not make is not its to remove"


def test_a_link_at_the_files_own_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's")
    target = tmp_path / "entry"
    target.symlink_to(victim)
    _files.write_whole(target, b"new")
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert victim.read_bytes() == b"the victim's"


def test_a_folder_at_the_files_name_is_an_error_that_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "entry").mkdir()
    with pytest.raises(IsADirectoryError):
        _files.write_whole(tmp_path / "entry", b"new")
    assert leftovers(tmp_path) == []


def test_a_write_relative_to_an_open_folder_stays_in_it(tmp_path: Path) -> None:
    folder = tmp_path / "builds"
    folder.mkdir()
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _files.write_whole("out.so", b"\x7fELF", mode=0o755, dir_fd=dfd)
        # The folder's path now leads elsewhere: the descriptor still names the folder opened.
        folder.rename(tmp_path / "moved")
        folder.symlink_to(tmp_path / "decoy")
        (tmp_path / "decoy").mkdir()
        _files.write_whole("out.so", b"\x7fELF2", mode=0o755, dir_fd=dfd)
    finally:
        os.close(dfd)
    assert (tmp_path / "moved" / "out.so").read_bytes() == b"\x7fELF2"
    assert stat.S_IMODE((tmp_path / "moved" / "out.so").stat().st_mode) == 0o755 & ~_umask()
    assert os.listdir(tmp_path / "decoy") == []
    assert leftovers(tmp_path / "moved") == []


def test_a_temporarys_name_is_bounded_and_recognised() -> None:
    name = _files.temporary_name("k" * 255)
    assert len(name) < 255 and name.startswith(".") and _files.is_temporary(name)
    assert _files.is_temporary("mod.cpython-311.pyc.4242.0123abcd.tmp")  # an older release's
    assert not _files.is_temporary("mod.cpython-311.pyc") and not _files.is_temporary("a" * 64)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
