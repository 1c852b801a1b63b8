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
    links are theirs: it is resolved one component at a time (``..`` after the link before it,
    as the kernel does), every link on the way must be this user's or root's, and the folder
    it leads to is checked with the folders above it; the path is resolved again once the
    folder is made, and must lead to the same folder (no link raced in meanwhile). Otherwise a
    link at ``path`` is refused. Raises ``UntrustedFolderError``, and ``OSError`` where the
    folder cannot be made."""
    folder = _walk(os.fspath(path), what, 0) if resolve else Path(path)
    if make:
        try:
            folder.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
    if resolve and _walk(os.fspath(path), what, 0) != folder:
        raise UntrustedFolderError(f"{what} {path} led elsewhere while it was made: refused")
    check_folder(folder, what)
    if resolve:
        _check_ancestors(folder, what)
    return folder


def _walk(path: str, what: str, depth: int) -> Path:
    """Where ``path`` leads, resolved one component at a time (``realpath``'s answer), raising
    ``UntrustedFolderError`` at a link that belongs to a user other than this one or root: its
    owner may point it elsewhere at any time (in ``/tmp``, anyone may make the link first).
    Components past the first missing one are taken as they are written."""
    if depth > 40:
        raise UntrustedFolderError(f"{what} {path}: too many levels of links")
    me = os.getuid()
    current = Path("/") if os.path.isabs(path) else Path(os.getcwd())
    missing = False
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        step = current / part
        if not missing:
            try:
                info = os.lstat(step)
            except (FileNotFoundError, NotADirectoryError):
                missing = True
            else:
                if stat.S_ISLNK(info.st_mode):
                    if info.st_uid not in (0, me):
                        raise UntrustedFolderError(
                            f"{what} {path} goes through the link {step}, which belongs to "
                            f"{user_name(info.st_uid)}: that user can point it at a folder of their "
                            "own (choose a folder of your own)"
                        )
                    current = _walk(os.path.join(current, os.readlink(step)), what, depth + 1)
                    continue
        current = step
    return current


def _check_ancestors(folder: Path, what: str) -> None:
    """Raise ``UntrustedFolderError`` where a folder above ``folder`` lets another user swap
    it: one that belongs to a user other than this one or root, or that others may write
    without the sticky bit (``/tmp`` has it: only a folder's owner may rename it there)."""
    me = os.getuid()
    for parent in folder.parents:
        info = os.lstat(parent)
        if stat.S_ISLNK(info.st_mode):  # a link where a folder was a moment ago
            raise UntrustedFolderError(f"{what} {folder}: {parent} became a link while it was checked")
        if info.st_uid not in (0, me):
            raise UntrustedFolderError(
                f"{what} {folder} is inside {parent}, which belongs to {user_name(info.st_uid)}: "
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
            f"{what} {folder} belongs to {user_name(info.st_uid)}, not to {user_name(me)}: another user's "
            "folder is never trusted (choose a folder of your own)"
        )
    if info.st_mode & 0o022:
        # A folder every user shares by design (sticky, like /tmp) is never one to make private.
        fix = (
            "choose a folder of your own"
            if info.st_mode & stat.S_ISVTX
            else f"make it private (chmod go-w {folder}) or choose another"
        )
        raise UntrustedFolderError(
            f"{what} {folder} may be written by other users (mode {stat.filemode(info.st_mode)}): "
            f"anything they put there would run as {user_name(me)}; {fix}"
        )


def user_name(uid: int) -> str:
    """A user as errors name them: ``nobody (uid 65534)``."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"
