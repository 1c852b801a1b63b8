"""A worker's half of the configuration that comes late: what the pool's configuration hook
(``WorkerPool.prepare_config_with``) computed, for a worker that started before it was over.

Nothing in the pool waits for the hook: the first time on a machine, Triton's hash of its
binaries takes longer than a worker's start. A worker started after it gets the hook's result in
its configuration; one started before finds it, when a job needs it, in the JSON file named by
its configuration's ``late_config``, which the pool writes whole (a rename) once the hook is
over: ``{}`` where the hook failed or ran out of time, and the worker computes what it needs.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

_POLL_S = 0.002


def prepared(config: dict[str, Any], *, wait: bool) -> dict[str, Any] | None:
    """The hook's result: from the file named by ``config["late_config"]``; None while the file
    is not there and ``wait`` is false. Waiting ends after ``config["late_config_timeout"]``
    seconds with ``{}`` (the pool could not write the file, or it was removed); so does a file
    that is not a regular file or not a JSON object. A configuration without
    ``late_config`` (its worker was started by something else than a pool) reads as ``{}``."""
    path = config.get("late_config")
    if not path:
        return {}
    deadline = time.monotonic() + float(config.get("late_config_timeout", 10.0))
    while True:
        try:
            # Not blocking: something else than the pool's file there (a FIFO) must not hang
            # the job; the pool writes a regular file.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return {}
                value = json.loads(f.read())
        except FileNotFoundError:
            if not wait:
                return None
            if time.monotonic() > deadline:
                return {}
            time.sleep(_POLL_S)
            continue
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}
