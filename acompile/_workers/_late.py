"""A worker's half of the configuration that comes late: what the pool's configuration hook
(``WorkerPool.prepare_config_with``) computed, for a worker that started before it was over.

Nothing in the pool waits for the hook: the first time on a machine, Triton's hash of its
binaries takes longer than a worker's start. A worker started after it gets the hook's result in
its configuration; one started before finds it, when a job needs it, in the JSON file named by
its configuration's ``late_config``, which the pool writes whole (a rename) once the hook is
over: ``{}`` where the hook failed or ran out of time, and the worker computes what it needs.

Such a wait is not the job's work: ``paused()`` tells the pool so, and the pool counts it neither
against the job's time limit nor in the compile time it remembers for the kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from acompile._workers import _protocol

_POLL_S = 0.002

# (the pool's stream, the running job's id, the thread running it) while this worker runs a
# job for a pool: set by the worker's loop around each job (``reporting``).
report_to: tuple[int, int, int] | None = None
_depth = 0  # paused() blocks open: only the outermost one tells the pool


@contextlib.contextmanager
def reporting(fd: int, job_id: int) -> Iterator[None]:
    """The worker's loop, around job ``job_id``: ``paused()`` inside it tells the pool on ``fd``."""
    global report_to
    report_to = (fd, job_id, threading.get_ident())
    try:
        yield
    finally:
        report_to = None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Around a wait inside the running job that is not its work (the pool's late
    configuration, a hash of Triton's binaries the pool could not hand over): the pool stops
    the job's clocks meanwhile, its time limit and its compile time, up to how long preloading
    and the late configuration may take (a wait that hangs still ends in the time limit).

    Only in the thread that runs the job, while it runs it (a message sent from elsewhere could
    come after the job's reply, or inside another message); nested blocks count once. Out of a
    pool's job (a test, another executor, another thread), it does nothing."""
    global _depth
    report = report_to
    if report is None or report[2] != threading.get_ident() or _depth:
        yield
        return
    fd, job_id, _ = report
    _depth += 1
    _tell(fd, _protocol.Pause(job_id))
    started = time.perf_counter()
    try:
        yield
    finally:
        _depth -= 1
        _tell(fd, _protocol.Resume(job_id, time.perf_counter() - started))


def _tell(fd: int, message: _protocol.Pause | _protocol.Resume) -> None:
    with contextlib.suppress(OSError):  # the pool is gone: the job's reply finds out
        _protocol.write_message(fd, message)


def prepared(config: dict[str, Any], *, wait: bool) -> dict[str, Any] | None:
    """The hook's result: from the file named by ``config["late_config"]``; None while the file
    is not there and ``wait`` is false. Waiting ends after ``config["late_config_timeout"]``
    seconds with ``{}`` (the pool could not write the file, or it was removed); so does a file
    that is not a regular file or not a JSON object. A configuration without
    ``late_config`` (its worker was started by something else than a pool) reads as ``{}``."""
    path = config.get("late_config")
    if not path:
        return {}
    value = _read(path)
    if value is not None or not wait:
        return value
    with paused():  # not the job's time
        deadline = time.monotonic() + float(config.get("late_config_timeout", 10.0))
        while (value := _read(path)) is None:
            if time.monotonic() > deadline:
                return {}
            time.sleep(_POLL_S)
        return value


def _read(path: str) -> dict[str, Any] | None:
    """The file's JSON object; None while there is no file; ``{}`` for anything else."""
    try:
        # Not blocking: something else than the pool's file there (a FIFO) must not hang the
        # job; the pool writes a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}
            value = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
