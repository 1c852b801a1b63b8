"""The Linux process controls the pool's child processes set (``prctl``), a background thread's
priority, and what the pool reads of a process group (its members' memory, from ``/proc``);
elsewhere, and where libc has no ``prctl``, they do nothing. Imports nothing heavy: the
short-lived processes that use it (a source probe, a bytecode helper) start in milliseconds."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar

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


# The memory limit (bytes) of the pool that is preparing a request in this task, or None for
# none. ``CompilePool`` sets it around a backend's ``prepare()``: the short-lived processes started
# there, outside the workers (a source string's probe), are held to the limit the workers are.
pool_memory_limit: ContextVar[int | None] = ContextVar("acompile_pool_memory_limit", default=None)


@contextlib.contextmanager
def under_memory_limit(limit: int | None) -> Iterator[None]:
    """Within the block, what this task starts outside the workers is held to ``limit`` (see
    ``pool_memory_limit``): a pool wraps each ``backend.prepare()`` in it."""
    token = pool_memory_limit.set(limit)
    try:
        yield
    finally:
        pool_memory_limit.reset(token)


def group_rss(pgid: int) -> int:
    """The resident memory, in bytes, of every process in process group ``pgid`` together (0
    where there is no ``/proc``). A group rather than a process: what a process starts stays in
    its group unless it leaves on purpose, and a child that holds the memory counts as much as
    the process itself."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # The name is in parentheses and may hold spaces: from the state after ")", the
                # group is the third field and the resident pages the twenty-second.
                fields = f.read().rpartition(b")")[2].split()
            if int(fields[2]) == pgid:
                total += int(fields[21]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def kill_group(pgid: int) -> None:
    """SIGKILL every process in group ``pgid``; nothing if there is none left. The group's id is
    not given to another process while any member lives, so a group whose leader was reaped is
    still the one meant."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def lower_this_thread() -> None:
    """Put the calling thread (and the processes it starts, which inherit its nice value) at
    nice 19, below the caller's event loop: for background work in the caller's process that
    nothing waits for (building the launcher: kernels launch through Triton's meanwhile),
    which would otherwise take CPU slices of several milliseconds from the loop on a small
    machine. Not for work a request waits on: on a machine busy at normal priority, nice 19
    gets a few percent of a CPU (Triton's key, 0.4 s of hashing, took over 30 s so). Linux
    only (elsewhere a pid is a whole process); a thread of a shared pool must not call this."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < 19:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists (one that is not this process's child: a
    detached server, another process's worker). One of another user's with that id counts: its
    id is taken, and nothing here can tell it from ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
