"""The folders acompile trusts: this user's, and no other user's to write.

A cache folder holds code this process runs (libraries it loads, torch.compile graphs Inductor
unpickles); a work folder holds the sockets its workers connect to. Another user who can write
to one of them, or who made it first in a shared place (``/tmp``), can run code as this user.
``own_folder`` is the one check every such folder goes through: it makes a missing folder private
(mode 700), and refuses, with ``UntrustedFolderError`` naming the folder and its owner, a folder
that belongs to another user, that other users may write, or that is a link (a user-given path
is resolved once, through the links its user made, and the folder it leads to is checked, with
the folders above it: none may let another user swap it). It never ``chmod``-s a folder into
shape: a folder someone else controls stays theirs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from acompile._errors import UntrustedFolderError


def own_folder(path: str | os.PathLike[str], what: str, *, resolve: bool = False, make: bool = True) -> Path:
    """``path``, checked (and made, where missing and ``make``); blocking. ``what`` names the
    folder in the error (``"the cache folder"``). ``resolve``: the path is one a user gave, whose
    links are theirs: resolved once, then the folder it leads to is checked; otherwise a link
    at ``path`` is refused. Raises ``UntrustedFolderError``, and ``OSError`` where the folder
    cannot be made."""
    folder = Path(os.path.realpath(path)) if resolve else Path(path)
    if make:
        try:
            folder.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
    check_folder(folder, what)
    if resolve:
        _check_ancestors(folder, what)
    return folder


def _check_ancestors(folder: Path, what: str) -> None:
    """Raise ``UntrustedFolderError`` where a folder above ``folder`` lets another user swap
    it: one that belongs to a user other than this one or root, or that others may write
    without the sticky bit (``/tmp`` has it: only a folder's owner may rename it there)."""
    me = os.getuid()
    for parent in folder.parents:
        info = os.stat(parent)
        if info.st_uid not in (0, me):
            raise UntrustedFolderError(
                f"{what} {folder} is inside {parent}, which belongs to {_user(info.st_uid)}: "
                "that user can put a folder of their own in its place (choose a folder of your own)"
            )
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise UntrustedFolderError(
                f"{what} {folder} is inside {parent}, which other users may write "
                f"(mode {stat.filemode(info.st_mode)}, no sticky bit): they can put a folder of "
                "their own in its place (choose a folder of your own)"
            )


def check_folder(folder: Path, what: str) -> None:
    """Raise ``UntrustedFolderError`` unless ``folder`` is a folder (not a link) of this user's
    that no other user may write (blocking; the folder must exist)."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedFolderError(f"{what} {folder} is a link: acompile trusts no link it did not make")
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedFolderError(f"{what} {folder} is not a folder")
    me = os.getuid()
    if info.st_uid != me:
        raise UntrustedFolderError(
            f"{what} {folder} belongs to {_user(info.st_uid)}, not to {_user(me)}: another user's "
            "folder is never trusted (choose a folder of your own)"
        )
    if info.st_mode & 0o022:
        raise UntrustedFolderError(
            f"{what} {folder} may be written by other users (mode {stat.filemode(info.st_mode)}): "
            f"anything they put there would run as {_user(me)}; make it private (chmod go-w {folder}) "
            "or choose another"
        )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"
