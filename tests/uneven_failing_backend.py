"""A worker-side backend for tests whose workers all fail to start, at different moments: slot 0's
at once, every other slot's after ``SLOW_FAIL`` seconds (``setup`` runs in each worker with its
slot's configuration). The template itself starts. Jobs are those of ``fake_backend``."""

from __future__ import annotations

import os
import time
from typing import Any

from fake_backend import compile as compile

SLOW_FAIL = 3.0


def setup(config: dict[str, Any]) -> None:
    stderr = config.get("stderr_path")
    if stderr is None:
        return  # the template: it forks the workers that fail
    if os.path.basename(stderr) != "worker-0.stderr":
        time.sleep(SLOW_FAIL)
    raise RuntimeError(f"this backend cannot start in {os.path.basename(stderr)}")


def preload(config: dict[str, Any]) -> None:
    pass
