"""The worker half of a served JIT library's build: ninja, run in the library's build folder with
the library's environment, on a pool worker instead of the library's own thread.

A payload is JSON made by ``_builds.ServedBuilds`` (the folder, the build file, the ninja
program, the environment, the products); the reply is JSON (how long it took). A build that fails
raises ``CompileError`` carrying ninja's output.

ninja puts each command it runs in a process group of its own, so killing the worker's group (a
cancel, a time limit, the pool's exit, the pool's process killed) would not reach the compilers:
they would run on and write into the library's folder under the next build. So ninja runs in a
session of its own, and is sent SIGTERM by the kernel when its worker dies, however it dies
(``PR_SET_PDEATHSIG``); on SIGTERM ninja stops every command it runs (their groups) and exits.

Stopping is not instant: ninja interrupts its commands, waits for them, then removes the outputs
they left half-written, and a linker removes its own output as it dies. Meanwhile the library may
already be building the same module in the same folder (the pool's fault: the library builds it
itself). So the whole ninja tree holds a lock on the build folder (``flock`` on the folder,
through a descriptor each of its processes inherits) until its last process is gone, and the
library's own build takes that lock first (``folder_lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

from acompile import _linux
from acompile._errors import CompileError

# The backend a CompileError names where ninja itself failed (the compiler refused the module).
NINJA_FAILED = "ninja"
# ninja's output kept for the error of a failed build (the compiler's message is at its end).
_LOG_TAIL = 64 * 1024
# How long a build waits for its folder's lock (another build there, or one being stopped) before
# it goes on without it: a lock another process holds for ever must not stop builds for ever.
LOCK_WAIT = 120.0


def _dies_with(worker: int) -> Callable[[], None]:
    """What ninja's process runs before ninja: SIGTERM at its worker's death (then ninja stops
    its commands); a worker that died already is noticed at once."""

    def arrange() -> None:
        _linux.signal_at_parent_death(signal.SIGTERM)
        if os.getppid() != worker:
            os._exit(1)

    return arrange


@contextlib.contextmanager
def folder_lock(folder: str, timeout: float, skipped: Callable[[str], None]) -> Iterator[int | None]:
    """Hold the build lock of ``folder`` (exclusive; the descriptor, which a child inherits to
    hold it too). Past ``timeout`` seconds of waiting, or where the folder cannot be opened,
    yields None (the caller goes on without it) and ``skipped`` says why first."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        skipped(f"cannot be opened ({exc.strerror or exc})")
        yield None
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    skipped(f"stayed locked {timeout:.0f} s by another process")
                    yield None
                    return
                time.sleep(0.02)
        yield fd
    finally:
        os.close(fd)


def setup(config: Any) -> None:
    """Nothing to set up: ninja is a program of its own."""


def preload(config: Any) -> None:
    """Nothing to preload: ninja is a program of its own."""


def compile(payload: bytes) -> bytes:
    job = json.loads(payload)
    # The folder's lock, held by ninja and every command it runs until the last of them is gone
    # (a build killed before, of this pool's or the library's own, is waited for).
    unlocked: list[str] = []
    with folder_lock(job["folder"], LOCK_WAIT, unlocked.append) as lock:
        reply = _build(job, lock)
    if unlocked:  # said by the library's process (the worker's log is not the user's)
        reply = json.dumps({**json.loads(reply), "unlocked": unlocked[0]}).encode()
    return reply


def _build(job: dict[str, Any], lock: int | None) -> bytes:
    # Each product is built anew: this job may be the retry of one whose worker was killed while
    # a compiler wrote it in place, and ninja takes a product newer than its inputs as built.
    for path in job["products"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    started = time.perf_counter()
    command = [job["ninja"], "-v", "-C", job["folder"], "-f", job["build_file"]]
    if job.get("jobs"):
        command += ["-j", str(int(job["jobs"]))]
    done = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=job["env"] or None,
        check=False,
        start_new_session=True,  # out of the worker's group: a group kill must not SIGKILL it
        pass_fds=() if lock is None else (lock,),
        preexec_fn=_dies_with(os.getpid()),  # the worker runs one job at a time: no thread forks
    )
    output = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        # backend "ninja": the build itself failed (the compiler's message is in the log); any
        # other error of this job is the pool's or the worker's, and the library then builds.
        raise CompileError(
            f"ninja failed to build {job['name']!r} (exit status {done.returncode})",
            kernel=job["name"],
            backend=NINJA_FAILED,
            log=output[-_LOG_TAIL:],
        )
    return json.dumps({"seconds": time.perf_counter() - started}).encode()
