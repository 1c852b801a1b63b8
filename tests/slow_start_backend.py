"""A worker-side backend for tests whose workers start at different speeds: every worker but
slot 0's takes ``SLOW_START`` seconds more to set up, whether forked from the template or started
afresh (``setup`` runs in each, with its slot's configuration). The template itself starts fast.
Jobs are those of ``fake_backend``."""

from __future__ import annotations

import os
import time
from typing import Any

from fake_backend import compile as compile

SLOW_START = 4.0


def setup(config: dict[str, Any]) -> None:
    stderr = config.get("stderr_path")
    if stderr is not None and os.path.basename(stderr) != "worker-0.stderr":
        time.sleep(SLOW_START)


def preload(config: dict[str, Any]) -> None:
    pass
