"""Explaining keys: which factors of a key differ, from the key parts an entry records in its
header.

- ``explain(parts_a, parts_b)``: the factors that differ between two keys' parts.
- ``explain_key(root, key)``: what a cache folder knows of one entry.
- ``explain_miss(root, parts)``: the folder's entries of the same kernel, nearest first, with
  what differs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread

from acompile._cache._disk import DiskTier
from acompile._cache._entry import _PREFIX, CorruptEntry, decode, peek_header
from acompile._cache._keys import make_key
from acompile._cache._layout import open_state
from acompile._errors import AcompileError


class _Absent:
    """A factor one of the two key-part dicts does not have."""

    def __repr__(self) -> str:
        return "(absent)"

    def __str__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()

# The factors of a key, in the order a reader wants them, with what each stands for where the name
# does not say it. Triton's key parts and the native backends' overlap; any other factor is
# reported under its own name.
FACTORS: dict[str, str] = {
    "kernel": "source",  # Triton's hash of the function's source and of every JIT function it calls
    "source": "",
    "text": "source",  # the SHA-256 of a kernel given as a source string
    "name": "kernel name",
    "signature": "",
    "constexprs": "",
    "attrs": "",
    "options": "",
    "name_expressions": "",
    "include_dirs": "",
    "target": "",
    "arch": "",
    "output": "",
    "kind": "compiler",
    "toolchain": "compiler versions",
    "compiler": "compiler version",
    "env": "environment",
    "acompile": "version",
    "backend": "",
    "format": "key format",
}
# Factors whose values are tables: a difference is reported entry by entry ("toolchain.ptxas").
_NESTED = frozenset({"toolchain", "env", "options", "constexprs"})


def explain(parts_a: dict[str, Any], parts_b: dict[str, Any]) -> list[tuple[str, object, object]]:
    """The factors that differ between two keys' parts, as ``(factor, value_a, value_b)``.

    Factors follow ``FACTORS``' order (then any others by name). Where a table differs
    (``toolchain``, ``env``, ``options``, ``constexprs``), each of its differing entries is one
    item named ``factor.entry`` (``"toolchain.ptxas"``, ``"env.TRITON_DEFAULT_FP_FUSION"``). A
    factor one side lacks is ``ABSENT`` there. Values are compared as JSON, as the key is.
    """
    a, b = _as_json(parts_a), _as_json(parts_b)
    names = [n for n in FACTORS if n in a or n in b] + sorted((set(a) | set(b)) - set(FACTORS))
    diffs: list[tuple[str, object, object]] = []
    for name in names:
        va, vb = a.get(name, ABSENT), b.get(name, ABSENT)
        if _same(va, vb):
            continue
        if name in _NESTED and isinstance(va, dict) and isinstance(vb, dict):
            for sub in sorted(set(va) | set(vb)):
                sa, sb = va.get(sub, ABSENT), vb.get(sub, ABSENT)
                if not _same(sa, sb):
                    diffs.append((f"{name}.{sub}", sa, sb))
        else:
            diffs.append((name, va, vb))
    return diffs


def describe_factor(name: str) -> str:
    """A reader's name for an item of ``explain``: ``"kernel"`` -> ``"kernel (source)"``,
    ``"toolchain.ptxas"`` -> ``"toolchain.ptxas (compiler versions)"``."""
    label = FACTORS.get(name.partition(".")[0], "")
    return f"{name} ({label})" if label else name


def _as_json(parts: dict[str, Any]) -> dict[str, Any]:
    # Tuples and lists alike, as make_key sees them.
    value = json.loads(json.dumps(parts, sort_keys=True, default=str))
    if not isinstance(value, dict):
        raise TypeError("key parts must be a dict")
    return value


def _same(a: object, b: object) -> bool:
    if a is ABSENT or b is ABSENT:
        return a is b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


NO_PARTS_NOTE = (
    "this entry predates key recording: the acompile that wrote it did not store its key's parts, "
    "so what it was compiled from cannot be shown (compile it again to record them)"
)


async def explain_key(root: Path, key: str) -> dict[str, Any]:
    """What the cache folder ``root`` knows of the entry ``key``.

    A dict: ``key``, ``backend``, ``name``, ``bytes``, ``written`` (the file's mtime, seconds since
    the epoch), ``key_parts`` (the parts the key was computed from, or None where the entry
    predates key recording, with ``note`` saying so) and ``parts_match_key`` (whether those parts
    hash to ``key``; None without parts). Raises ``AcompileError`` for an absent or damaged entry
    and ``ValueError`` for a string that is not a key.
    """
    disk = DiskTier(root)
    entry_path = disk.path(key)
    try:
        data = await disk.get(key)
        st = await anyio.to_thread.run_sync(entry_path.stat) if data is not None else None
    except OSError as exc:
        raise AcompileError(f"cannot read the entry {key} in {root}: {exc}") from None
    if data is None or st is None:
        raise AcompileError(f"no entry {key} in {root}")
    try:
        entry = await anyio.to_thread.run_sync(decode, data, key)
    except CorruptEntry as exc:
        raise AcompileError(f"the entry {key} in {root} is damaged: {exc}") from None
    parts = entry.meta.get("key_parts") if isinstance(entry.meta, dict) else None
    result: dict[str, Any] = {
        "key": key,
        "backend": entry.backend,
        "name": entry.name,
        "bytes": len(data),
        "written": st.st_mtime,
        "key_parts": None,
        "parts_match_key": None,
        "note": None,
    }
    if isinstance(parts, dict) and parts:
        result["key_parts"] = parts
        result["parts_match_key"] = make_key(parts) == key
        if not result["parts_match_key"]:
            result["note"] = (
                "the recorded parts do not hash to this key: the acompile that wrote it keyed "
                "with more (or other) parts than it recorded"
            )
    else:
        result["note"] = NO_PARTS_NOTE
    return result


async def explain_miss(
    root: Path, key_parts: dict[str, Any], *, limit: int = 5
) -> list[tuple[str, list[tuple[str, object, object]]]]:
    """Why a request with these key parts misses: the folder's entries of the same kernel (same
    backend and name) that recorded their parts, nearest first, each with ``explain``'s
    differences from ``key_parts``. Empty where the folder holds no other compile of that kernel;
    an entry for exactly these parts is not listed (that would be a hit).
    """
    disk = DiskTier(root)
    want = make_key(key_parts)
    backend, name = key_parts.get("backend"), key_parts.get("name")

    def scan() -> list[tuple[str, dict[str, Any]]]:
        found = []
        for entry_path in disk.iter_paths():
            anyio.from_thread.check_cancelled()
            header = read_header(entry_path)
            if header is None or entry_path.name == want:
                continue
            if header.get("backend") != backend or header.get("name") != name:
                continue
            meta = header.get("meta")
            parts = meta.get("key_parts") if isinstance(meta, dict) else None
            if isinstance(parts, dict) and parts:
                found.append((entry_path.name, parts))
        return found

    candidates = await anyio.to_thread.run_sync(scan)
    ranked = sorted(((key, explain(key_parts, parts)) for key, parts in candidates), key=lambda r: len(r[1]))
    return ranked[:limit]


# The largest header an entry has: its key's parts and metadata (a C++ entry's headers list
# runs to some hundred kilobytes).
_MAX_HEADER = 16 << 20


def read_header(path: Path) -> dict[str, Any] | None:
    """An entry file's header, unverified, reading only as much of the file as it takes
    (blocking); None where the file is absent or is not an entry."""
    try:
        fd = open_state(path)  # never a FIFO's read that does not end, nor through a link
        if fd is None:
            return None
        with open(fd, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return None
            _, _, head_len, _ = _PREFIX.unpack(prefix)
            if head_len > _MAX_HEADER:  # not an entry's: never read gigabytes to find out
                return None
            head = f.read(head_len)
        header = peek_header(prefix + head)
    except (OSError, CorruptEntry, struct.error):
        return None
    header.pop("_end", None)
    header.pop("_digest", None)
    return header


__all__ = ["ABSENT", "FACTORS", "describe_factor", "explain", "explain_key", "explain_miss", "read_header"]
