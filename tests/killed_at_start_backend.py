"""A worker-side backend for tests whose workers are killed from outside as they start, for as long
as the file named by ``ACOMPILE_TEST_KILL_STARTS`` exists: each worker (not the template) SIGKILLs
itself in ``setup``, as an operator or an OOM killer would kill it during its preload. Once the
file is gone, workers start. Jobs are those of ``fake_backend``."""

from __future__ import annotations

import os
import signal
from typing import Any

from fake_backend import compile as compile

MARKER = "ACOMPILE_TEST_KILL_STARTS"


def setup(config: dict[str, Any]) -> None:
    if config.get("stderr_path") is None:
        return  # the template: it forks the workers that are killed
    marker = os.environ.get(MARKER)
    if marker and os.path.exists(marker):
        os.kill(os.getpid(), signal.SIGKILL)


def preload(config: dict[str, Any]) -> None:
    pass
