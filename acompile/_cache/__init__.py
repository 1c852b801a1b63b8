"""The cache tiers and keys.

``Cache`` puts the tiers in order (memory, then disk) and turns every fault of a tier into a
miss: a corrupt, truncated or foreign entry is counted, logged once and compiled again (the
fresh entry replaces it).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import anyio

from acompile._cache import _entry
from acompile._cache._disk import DiskTier, default_cache_dir
from acompile._cache._entry import CorruptEntry, Entry
from acompile._cache._keys import make_key
from acompile._cache._memory import MemoryTier

logger = logging.getLogger("acompile")

# Entries at least this large are verified on a thread: hashing them would stall the loop
# (SHA-256 runs at about 1 GB/s: 256 KiB is some 0.25 ms).
_VERIFY_INLINE_MAX = 256 * 1024


class Cache:
    def __init__(self, root: str | Path, memory_entries: int = 1024) -> None:
        self.memory = MemoryTier(memory_entries)
        self.disk = DiskTier(root)
        self.counts: Counter[str] = Counter()
        self._warned_corrupt = False

    @property
    def root(self) -> Path:
        return self.disk.root

    async def open(self) -> None:
        await anyio.to_thread.run_sync(self.disk.prepare)

    async def read(self, key: str) -> Entry | None:
        """The verified entry from disk, or None for a miss (absent or damaged)."""
        try:
            data = await self.disk.get(key)
        except OSError as exc:
            self._fault(key, f"cannot read: {exc}")
            return None
        if data is None:
            return None
        try:
            if len(data) < _VERIFY_INLINE_MAX:
                entry = _entry.decode(data, key)
            else:
                entry = await anyio.to_thread.run_sync(_entry.decode, data, key)
        except CorruptEntry as exc:
            # Not deleted: another process may be publishing a good copy right now, and the
            # fresh compile replaces this one atomically anyway.
            self._fault(key, str(exc))
            return None
        return entry

    async def write(self, key: str, data: bytes) -> None:
        try:
            await self.disk.set(key, data)
            self.counts["disk_writes"] += 1
        except OSError as exc:
            # A full or read-only disk costs a recompile next time, never this compile.
            self.counts["disk_write_errors"] += 1
            logger.warning("cannot write cache entry %s…: %s", key[:16], exc)

    def _fault(self, key: str, why: str) -> None:
        self.counts["disk_corrupt"] += 1
        level = logging.DEBUG if self._warned_corrupt else logging.WARNING
        self._warned_corrupt = True
        logger.log(level, "disk cache entry %s… is damaged (%s); compiling it again", key[:16], why)


__all__ = [
    "Cache",
    "CorruptEntry",
    "DiskTier",
    "Entry",
    "MemoryTier",
    "default_cache_dir",
    "make_key",
]
