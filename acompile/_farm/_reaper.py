"""The reaper of a farm actor's local pool: its processes go when the actor goes, however it goes.

``FarmWorker`` starts this script (``python -I -S _reaper.py MARK ACTOR_PID``, by path: it
imports nothing but the standard library) before its local pool, with a pipe on its stdin
whose other end only the actor holds; it detaches from the actor (a fork whose parent exits).
When the actor's process ends, by ``stop()`` or otherwise (the driver exited and Ray ended the
actor, killing its children with SIGKILL; the OOM killer), the pipe reads EOF and the reaper
SIGKILLs every process that carries the actor's mark in its environment: the template, its
forked workers and their compilers, each with its process group.

Why not the parent-death signal alone: the template and each worker get SIGTERM when their
parent dies, but Python runs the handler between bytecodes, and a worker inside a long native
call (an LLVM pass of tens of seconds) goes only when that call returns; meanwhile it compiles
for nobody, re-parented to init. A SIGKILL from outside takes it at once.

The mark is an environment variable (``MARK_VARIABLE``) set in the actor before its pool
starts any process: the pool copies the actor's environment into the template, forked workers
inherit it, and so do their compilers. A process is matched by its initial environment
(``/proc/PID/environ``), which no later change in that process hides. Linux only: elsewhere
the reaper exits at once and the parent-death signal is all there is.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MARK_VARIABLE = "ACOMPILE_FARM_ACTOR"
# Passes over the process table after the actor is gone: a template may fork a worker between
# two passes, and a pass that finds nothing ends the reaper.
_PASSES = 20
_PAUSE = 0.05


def marked(mark: str, spare: set[int]) -> list[int]:
    """The processes (of this user; others' are unreadable) whose environment has ``mark``."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) in spare:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or not ours
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def reap(mark: str, spare: set[int]) -> int:
    """SIGKILL every marked process with its process group, pass after pass until none is
    left (or ``_PASSES`` passes); returns how many processes were signalled."""
    signalled = 0
    for _ in range(_PASSES):
        pids = marked(mark, spare)
        if not pids:
            break
        for pid in pids:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                signalled += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(_PAUSE)
    return signalled


def main() -> None:
    mark, actor = sys.argv[1], int(sys.argv[2])
    # Not the actor's child: a Ray worker that exits kills its own children (SIGKILL, so neither
    # the template's clean-up nor this one's would run), which is the very case to cover. The
    # process the actor started exits at once; its child, re-parented, does the work.
    if os.fork() > 0:
        os._exit(0)
    # The actor's own signals (a terminal's Ctrl-C, a SIGTERM to its group) are not ours: this
    # process must outlive the actor to do its job. It runs in a session of its own too.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    if sys.platform.startswith("linux"):
        reap(mark, {os.getpid(), actor})


if __name__ == "__main__":
    main()
