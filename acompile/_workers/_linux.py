"""The two Linux process controls the pool's child processes set (``prctl``); elsewhere, and
where libc has no ``prctl``, they do nothing. Imports nothing heavy: the short-lived processes
that use it (a source probe, a bytecode helper) start in milliseconds."""

from __future__ import annotations

import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, value: int | bytes) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def signal_at_parent_death(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies, even by SIGKILL
    (``PR_SET_PDEATHSIG``). A parent that died before this call is not noticed: callers compare
    ``os.getppid()`` with the parent they expect afterwards."""
    _prctl(_PR_SET_PDEATHSIG, signum)


def set_name(name: str) -> None:
    """This process's name in ``/proc/<pid>/comm`` and ``ps`` (15 bytes at most)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])
