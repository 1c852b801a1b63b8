"""Cache keys: a SHA-256 over a canonical JSON of everything that changes the compiled bytes."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def make_key(parts: dict[str, Any]) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()
