"""What a test's machine process shares: ``serve()``'s options as it gets them (JSON: a
``shared_cache`` that is a table is a ``SharedCache``'s fields, ``conftest.json_shared``), and its
report of what was served."""

from __future__ import annotations

import json
from typing import Any


def decode(text: str) -> dict[str, Any]:
    options: dict[str, Any] = json.loads(text)
    if isinstance(options.get("shared_cache"), dict):
        import acompile

        options["shared_cache"] = acompile.SharedCache(**options["shared_cache"])
    return options


def leave(serving: Any, report: dict[str, Any], library: str) -> None:
    """End ``serving`` (None: not served) and add what it served of ``library`` to ``report``:
    ``jit`` (its counts), ``cache`` (the pool's cache counts), ``unsupported``."""
    if serving is None:
        return
    serving.__exit__(None, None, None)
    stats = serving.stats()
    report["jit"] = stats.get("jit", {}).get(library)
    report["cache"] = (stats.get("pool") or {}).get("cache")
    report["unsupported"] = stats.get("jit_unsupported", {})
