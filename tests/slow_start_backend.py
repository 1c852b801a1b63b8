"""A worker-side backend for tests whose workers start at different speeds: every worker but
slot 0's takes ``SLOW_START`` seconds more to set up, whether forked from the template or started
afresh (``setup`` runs in each, with its slot's configuration). The template itself starts fast.
Jobs are those of ``fake_backend``."""

from __future__ import annotations

import os
import time
from typing import Any

from fake_backend import compile as compile

# The first worker's three jobs take under 0.1 s on 2 cores (a few times that under load): the
# others' extra start is well beyond it, and each run of the test waits it out once.
SLOW_START = 2.0


def setup(config: dict[str, Any]) -> None:
    stderr = config.get("stderr_path")
    if stderr is not None and os.path.basename(stderr) != "worker-0.stderr":
        time.sleep(SLOW_START)


def preload(config: dict[str, Any]) -> None:
    pass
