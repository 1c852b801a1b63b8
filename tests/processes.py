"""What the tests of worker processes share: the process table as the pool's users see it, and a
bounded wait for a state that has no event (processes, counters)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import psutil
import pytest

# Every test of a fault runs with workers forked from the template and with fresh interpreters:
# the two start, stop and die differently.
forked_and_fresh = pytest.mark.parametrize("fork_workers", [True, False], ids=["forked", "fresh"])


@contextlib.contextmanager
def reaped(processes: Sequence[subprocess.Popen[str]], folder: Path | None = None) -> Iterator[None]:
    """However the test ends (an assertion, a timeout), every process it started ends with it,
    with what they started: each one's own children, and a host pool's server (a process of
    its own, started by one of them) whose command line names ``folder``."""
    try:
        yield
    finally:
        doomed: list[psutil.Process] = []
        for process in processes:
            with contextlib.suppress(psutil.Error):
                if process.poll() is None:
                    doomed += psutil.Process(process.pid).children(recursive=True)
                    process.kill()
        if folder is not None:
            for proc in psutil.process_iter(["cmdline"]):
                command = " ".join(proc.info["cmdline"] or ())
                if "acompile._torch._hostpool" in command and str(folder) in command:
                    with contextlib.suppress(psutil.Error):
                        doomed += [proc, *proc.children(recursive=True)]
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(doomed, timeout=10)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=10)


def children_running(marker: str) -> list[psutil.Process]:
    """Every live process under this one whose command line holds ``marker``."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            pass  # gone while we looked
    return found


def pool_processes() -> list[psutil.Process]:
    """Every live process of a pool under this one: workers and the template."""
    return children_running("acompile._worker")


def probe_processes() -> list[psutil.Process]:
    """Every live process that runs a source string's probe under this one."""
    return children_running("_triton_probe")


def is_template(proc: psutil.Process) -> bool:
    # Forked workers inherit the template's command line: the template is the one we started.
    try:
        return proc.ppid() == os.getpid() and "--template" in proc.cmdline()
    except psutil.Error:
        return False


def is_bytecode_helper(proc: psutil.Process) -> bool:
    # A template's bytecode helpers (forked, so with its command line) rename themselves.
    from acompile._workers import BYTECODE_HELPER_NAME

    try:
        return proc.name() == BYTECODE_HELPER_NAME
    except psutil.Error:
        return False


def worker_pids() -> list[int]:
    """The workers alive under this process, from the process table (the template and its
    bytecode helpers aside: pool_processes() has them all, for the check that none is left)."""
    return [p.pid for p in pool_processes() if not is_template(p) and not is_bytecode_helper(p)]


def template_pids() -> list[int]:
    return [p.pid for p in pool_processes() if is_template(p)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def until(predicate: Callable[[], object], seconds: float = 10) -> None:
    """Wait until predicate() is true, at most ``seconds`` (processes and counters have no
    events to wait on: poll them)."""
    with anyio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.005)
