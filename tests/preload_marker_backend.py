"""A worker-side backend for tests: its preload leaves a file named by its pid in
``$ACOMPILE_TEST_MARKER_DIR`` (a test sees when a process preloads), and a job returns what the
worker's configuration says under ``"from_hook"``: in the configuration it started with, or, for
a worker started before the pool's hook was over, in the pool's late configuration."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from acompile._workers import late_config

_config: dict[str, Any] = {}


def setup(config: dict[str, Any]) -> None:
    _config.clear()
    _config.update(config)


def preload(config: dict[str, Any]) -> None:
    (Path(os.environ["ACOMPILE_TEST_MARKER_DIR"]) / f"preloaded-{os.getpid()}").touch()


def compile(payload: Any) -> Any:
    if "from_hook" in _config:
        return _config["from_hook"]
    return (late_config(_config, wait=True) or {}).get("from_hook")
