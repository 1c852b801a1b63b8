"""Compiler logs too long for an error: the whole text goes to a file the error names.

Used by the workers' halves of the backends. Logs live in ``<cache_dir>/logs/`` (the pool's cache
folder, so they outlive the pool and its temporary work folder), one file per kernel key: asking
again for a kernel that fails rewrites its file instead of adding one.
"""

from __future__ import annotations

import errno
import os

from acompile import _files
from acompile._errors import TEXT_LIMIT


def save_if_long(log: str, log_dir: str | None, name: str, key: str) -> tuple[str | None, str]:
    """Write log to a file if an error could not carry it whole.

    Returns (path or None, a sentence for the error's message: where the whole log is, or why it
    could not be written; empty when the log is short enough to travel whole).
    """
    if len(log) <= TEXT_LIMIT:
        return None, ""
    if not log_dir:
        return None, f"(the log, {len(log)} characters, was cut; no log folder to write it to)"
    path = os.path.join(log_dir, f"{name}-{key[:16]}.log")
    try:
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        _files.write_whole(path, log.encode("utf-8", errors="replace"))
    except OSError as exc:
        why = "the disk is full" if exc.errno == errno.ENOSPC else f"{type(exc).__name__}: {exc}"
        return None, f"(the log, {len(log)} characters, was cut and could not be saved: {why})"
    return path, f"(the log, {len(log)} characters, was cut; the whole log is in {path})"
