"""A backend whose preload leaves a thread running: a template must not fork after it."""

from __future__ import annotations

import threading
import time
from typing import Any


def setup(config: dict[str, Any]) -> None:
    pass


def preload(config: dict[str, Any]) -> None:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def compile(payload: dict[str, Any]) -> Any:
    return payload.get("value")
