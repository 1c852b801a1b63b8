"""The cache folder's layout, spelled out once::

    <root>/v1/<xx>/<key>        entries (the disk tier), <xx> the key's first two characters
    <root>/lib/<key>.so|.o      native libraries and objects, loaded or linked from their path
    <root>/logs/                compiler logs too long for an error message
    <root>/toolchain/           the toolchain's identity, remembered once per machine
    <root>/run/                 a host pool's socket (acompile.inductor.serve(host_pool=True))
    <root>/costs.json           compile times per kernel, which the pool orders its queue by
    <root>/costs.json.lock      held (flock) while a process merges its times into costs.json
    .<name>.<pid>.<token>.tmp   a writer's temporary file, next to the file it becomes

Every name that starts with "." is a temporary file: readers skip it, and ``prune`` removes one a
dead writer left behind (older than ``STALE_TEMP_S``).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

# The entries' folder is named for the layout's version: a change of layout starts a new folder
# instead of misreading the old one.
ENTRIES = "v1"
LIB = "lib"
LOGS = "logs"
TOOLCHAIN = "toolchain"
RUN = "run"
# Temporary files older than this are left over from a writer that died.
STALE_TEMP_S = 3600.0

# \Z, not $: "$" also matches before a final newline, and "<key>\n" is not a key.
_KEY_RE = re.compile(r"\A[0-9a-f]{64}\Z")


def is_key(name: str) -> bool:
    """Whether ``name`` is a cache key (64 lowercase hex digits), hence a valid entry file name."""
    return _KEY_RE.match(name) is not None


def entries_dir(root: Path) -> Path:
    """The folder of the disk tier's entries."""
    return root / ENTRIES


def lib_dir(root: Path) -> Path:
    """The folder of native libraries and objects."""
    return root / LIB


def lib_path(root: Path, key: str, output: str) -> Path:
    """Where the native backends publish the ``output`` (``"so"`` or ``"o"``) of entry ``key``."""
    return root / LIB / f"{key}.{output}"


def logs_dir(root: Path) -> Path:
    """The folder of compiler logs too long for an error message."""
    return root / LOGS


def toolchain_dir(root: Path) -> Path:
    """The folder where backends remember the toolchain's identity."""
    return root / TOOLCHAIN


def temp_path(final: Path) -> Path:
    """A fresh temporary file's path next to ``final``, unique to this process and call; the
    writer renames it onto ``final`` when it is whole."""
    return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def is_temp(path: Path) -> bool:
    """Whether ``path`` names a writer's temporary file."""
    return path.name.startswith(".")


def plural(n: int, one: str, many: str | None = None) -> str:
    """``"1 entry"``, ``"2 entries"``: how reports about a folder count what it holds."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def human_bytes(n: float) -> str:
    """A size as people read it: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = [
    "ENTRIES",
    "LIB",
    "LOGS",
    "STALE_TEMP_S",
    "TOOLCHAIN",
    "entries_dir",
    "human_bytes",
    "is_key",
    "is_temp",
    "lib_dir",
    "lib_path",
    "logs_dir",
    "plural",
    "temp_path",
    "toolchain_dir",
]
