"""Which environment variables change what Triton compiles, for the key and for the worker.

The parent keys a request with the variables it finds set (``key_environment``), and the worker
compiles with exactly those set. Both halves import this module: it imports nothing heavier than
Triton's ``knobs``, and that only when first asked.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from acompile._backends._memos import on_forget, remembered

# TRITON_* variables that cannot change a compiled kernel (paths, caches, logging). Every other
# TRITON_* variable, and every variable Triton itself lists as cache-invalidating, is part of the
# key and is set in the worker exactly as it was in the parent when the request was keyed. Tool
# paths are left out on purpose: the key holds the tools' versions instead, which travel.
_ENV_IGNORED = frozenset(
    {
        "TRITON_CACHE_DIR",
        "TRITON_HOME",
        "TRITON_DUMP_DIR",
        "TRITON_OVERRIDE_DIR",
        "TRITON_CACHE_MANAGER",
        "TRITON_REMOTE_CACHE_BACKEND",
        "TRITON_REMOTE_CACHE_URL",
        "TRITON_REDIS_HOST",
        "TRITON_REDIS_PORT",
        "TRITON_REDIS_KEY_FORMAT",
        "TRITON_CACHE_AUTOTUNING",
        "TRITON_PRINT_AUTOTUNING",
        "TRITON_ALWAYS_COMPILE",
        "TRITON_STORE_BINARY_ONLY",
        "TRITON_KERNEL_DUMP",
        "TRITON_INTERPRET",
        "TRITON_PTXAS_PATH",
        "TRITON_PTXAS_BLACKWELL_PATH",
        "TRITON_CUOBJDUMP_PATH",
        "TRITON_NVDISASM_PATH",
        "TRITON_LIBDEVICE_PATH",
        "TRITON_LIBCUDA_PATH",
        "TRITON_CUDACRT_PATH",
        "TRITON_CUDART_PATH",
    }
)


# The last answer for os.environ, with the environment it was read from (os.environ's own
# encoded table, copied) and the names it looked for: requests are keyed one after the other,
# dozens at once in a warm start, and the environment rarely changes between them.
_last: tuple[dict[object, object], frozenset[str], dict[str, str]] | None = None


def key_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that change what Triton compiles, as they are in environ."""
    global _last
    extra = invalidating_env_names()
    # os.environ decodes every name it yields: comparing its table with the one last read costs
    # a fraction of that pass, which runs only where something changed.
    table = getattr(environ, "_data", None) if environ is os.environ else None
    if type(table) is dict:
        last = _last
        if last is not None and last[1] is extra and last[0] == table:
            return dict(last[2])
        found = _find(environ, extra)
        _last = (dict(table), extra, found)
        return dict(found)
    return _find(environ, extra)


def _find(environ: Mapping[str, str], extra: frozenset[str]) -> dict[str, str]:
    # One pass over the names only, then the values of those kept.
    names = sorted(k for k in environ if (k.startswith("TRITON_") or k in extra) and k not in _ENV_IGNORED)
    return {k: environ[k] for k in names}


@on_forget
def forget() -> None:
    """Forget the environment last read (see ``_triton.forget``)."""
    global _last
    _last = None


@remembered
@functools.cache
def invalidating_env_names() -> frozenset[str]:
    """The variables other than ``TRITON_*`` that Triton says change a compile (read once a
    process: it imports Triton's ``knobs``, so the first call belongs on a thread)."""
    # Triton lists only the variables that are set; read the names it knows from its knobs.
    from triton import knobs

    names: set[str] = set()
    for group_name in dir(knobs):
        group = getattr(knobs, group_name, None)
        for attr in getattr(type(group), "__dict__", {}).values():
            key = getattr(attr, "key", None)
            if isinstance(key, str) and key.isupper():
                names.add(key)
    return frozenset(n for n in names if not n.startswith("TRITON_"))
