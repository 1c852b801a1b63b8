"""``serve()``'s options as a test's machine process gets them (JSON): a ``shared_cache`` that is
a table is a ``SharedCache``'s fields (``conftest.json_shared``)."""

from __future__ import annotations

import json
from typing import Any


def decode(text: str) -> dict[str, Any]:
    options: dict[str, Any] = json.loads(text)
    if isinstance(options.get("shared_cache"), dict):
        import acompile

        options["shared_cache"] = acompile.SharedCache(**options["shared_cache"])
    return options
