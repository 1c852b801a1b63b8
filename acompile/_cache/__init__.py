"""The cache tiers and keys.

``Cache`` puts the tiers in order (memory, then disk) and turns every fault of the disk into a
miss: a corrupt, truncated or foreign entry is counted, logged once and compiled again (the
fresh entry replaces it). The disk never fails a compile and never holds up a request or the
pool's exit for long:

- a read-only folder serves the entries it holds; new results stay in the memory tier;
- a publication that fails (a full disk: ENOSPC, EDQUOT, EFBIG; EROFS) is logged once, the
  result is still returned, and the partial temporary file is removed;
- a read or a write that does not answer within a few seconds (a hung network filesystem) is
  abandoned: a read is a miss, a write is left to finish on its own thread; the disk is then
  left alone for a while.
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio

from acompile._cache import _entry
from acompile._cache._disk import DiskTier, NotAnEntryFile, default_cache_dir
from acompile._cache._entry import CorruptEntry, Entry
from acompile._cache._keys import make_key
from acompile._cache._memory import MemoryTier

logger = logging.getLogger("acompile")

# Entries at least this large are verified on a thread: hashing them would stall the loop
# (SHA-256 runs at about 1 GB/s: 256 KiB is some 0.25 ms). Verified all the same.
_VERIFY_INLINE_MAX = 256 * 1024

# How long a disk read or write may take before it is abandoned. A whole entry (tens of KB to a
# few MB) comes from a local disk in milliseconds and from a healthy network filesystem in well
# under a second; past this the filesystem is hung or drowning, and a compile is the better bet.
DISK_DEADLINE = 2.0
# After a read or write past the deadline, the disk is left alone this long: every request would
# otherwise wait out the deadline again, and each stuck call holds a thread.
DISK_BACKOFF = 30.0

# A disk that is full (or read-only) says so with any of these: one warning for all of them.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class Cache:
    def __init__(self, root: str | Path, memory_entries: int = 1024) -> None:
        self.memory = MemoryTier(memory_entries)
        self.disk = DiskTier(root)
        self.counts: Counter[str] = Counter()
        # False for a folder this process cannot write to: compiles are kept in memory only.
        self.writable = True
        # False when the folder did not answer at start (a hung filesystem): nothing else in it
        # (the toolchain's memo) is worth waiting for either.
        self.answered = True
        self._stalled_until = 0.0
        self._private_memo: Path | None = None
        self._warned: set[str] = set()

    @property
    def root(self) -> Path:
        return self.disk.root

    @property
    def memo_dir(self) -> Path:
        """Where backends remember the toolchain's identity: in the cache folder, or in a
        private temporary folder when the cache folder did not answer."""
        return self._private_memo or self.root / "toolchain"

    async def open(self) -> None:
        """Prepare the folder. Never raises for the folder's sake: one that cannot be created or
        written to is used read-only (with one warning), one that does not answer is skipped."""
        with anyio.move_on_after(DISK_DEADLINE, shield=True) as scope:
            why = await self.disk.call(self._prepare)
        if scope.cancelled_caught:
            self.answered = False
            self._stall()
            self._private_memo = Path(
                await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="acompile-toolchain-"))
            )
            why = f"it did not answer within {DISK_DEADLINE:g} s"
        if why is not None:
            self.writable = False
            self._warn_once(
                "read-only",
                "cache folder %s is read-only for this process (%s): serving the entries it holds; "
                "new compiles are kept in memory only",
                self.root,
                why,
            )

    def _prepare(self) -> str | None:
        """None where entries can be published, else why not (blocking)."""
        try:
            self.disk.prepare()
        except OSError as exc:
            return str(exc)
        return None if self.disk.writable() else "not writable"

    async def close(self) -> None:
        """Remove what ``open()`` made outside the cache folder (shielded: clean-up)."""
        if self._private_memo is not None:
            memo, self._private_memo = self._private_memo, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(memo, ignore_errors=True))

    async def read(self, key: str) -> Entry | None:
        """The verified entry from disk, or None for a miss (absent, damaged, or too slow)."""
        if self._stalled():
            return None
        data: bytes | None = None
        # Not shielded: the caller's cancellation (its own deadline, the pool's exit) abandons
        # the read at once, as the deadline does; the thread finishes, and closes the file, alone.
        with anyio.move_on_after(DISK_DEADLINE) as scope:
            try:
                data = await self.disk.get(key)
            except NotAnEntryFile as exc:
                self._fault(key, str(exc))
                return None
            except OSError as exc:
                self._fault(key, f"cannot read: {exc}")
                return None
        if scope.cancelled_caught:
            self.counts["disk_timeouts"] += 1
            self._stall()
            self._warn_once(
                "read-timeout",
                "disk cache read of %s… did not answer within %g s (a hung filesystem?); compiling "
                "it instead, and leaving %s alone for %g s",
                key[:16],
                DISK_DEADLINE,
                self.root,
                DISK_BACKOFF,
            )
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
        """Publish an entry; never raises for the disk's sake (the caller has its result)."""
        if not self.writable or self._stalled():
            return
        # Shielded: an entry cut off by a cancellation would only cost a recompile next time,
        # but a moment is cheap. Bounded: a hung filesystem must not hold up the pool's exit;
        # the write is then left to finish (or fail, and clean up) on its own thread.
        with anyio.move_on_after(DISK_DEADLINE, shield=True) as scope:
            try:
                await self.disk.set(key, data)
            except OSError as exc:
                self.counts["disk_write_errors"] += 1
                # A full or read-only disk costs a recompile next time, never this compile.
                kind = "full" if exc.errno in _DISK_FULL else f"error-{exc.errno}"
                self._warn_once(
                    f"write-{kind}",
                    "cannot write cache entry %s… to %s (%s); results are kept in memory",
                    key[:16],
                    self.root,
                    exc,
                )
                return
        if scope.cancelled_caught:
            self.counts["disk_write_timeouts"] += 1
            self._stall()
            self._warn_once(
                "write-timeout",
                "disk cache write of %s… did not finish within %g s (a hung filesystem?); left to "
                "finish in the background",
                key[:16],
                DISK_DEADLINE,
            )
            return
        self.counts["disk_writes"] += 1

    def _stall(self) -> None:
        self._stalled_until = time.monotonic() + DISK_BACKOFF

    def _stalled(self) -> bool:
        return self._stalled_until > 0 and time.monotonic() < self._stalled_until

    def _fault(self, key: str, why: str) -> None:
        self.counts["disk_corrupt"] += 1
        self._warn_once("corrupt", "disk cache entry %s… is damaged (%s); compiling it again", key[:16], why)

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        """Each kind of disk trouble is a WARNING the first time in a pool, DEBUG after that."""
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        logger.log(level, message, *args)


__all__ = [
    "Cache",
    "CorruptEntry",
    "DiskTier",
    "Entry",
    "MemoryTier",
    "default_cache_dir",
    "make_key",
]
