"""How long compiles take: the cost model the pool orders its queue by.

A storm of compiles ends when its longest job ends, so the queue runs the longest expected job
first (``JobQueue``); this module says how long a job is expected to take. It remembers each
finished compile's time in a small file beside the entries (``<cache>/costs.json``), so that the
next process, on the same machine or folder, knows the costs before anything runs.

What a job is expected to take, best answer first:

1. the same kernel with the same options compiled before: its time (the mean of the last two);
2. the same kernel with other options (``family``: its name and source): the times of those,
   each scaled by how this job's options compare with theirs (``_weight``);
3. a kernel never seen: ``_weight`` of what the payload holds (the size of the source it ships,
   ``num_stages``, ``num_warps``), in seconds per weight learned from every recorded compile.

Only the order matters to the queue, so a rough guess does its job: the long matmul ahead of the
short elementwise kernel. The file is written off the loop, atomically (a reader sees the old
file or the new one); a writer merges what is on disk first, so processes that share the folder
lose at most the records of a save that raced theirs. A file that does not parse (or a record
that makes no sense) is ignored, and replaced at the next save.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from acompile._cache._layout import temp_path

if TYPE_CHECKING:
    from acompile._cache._disk import GuardedDisk

logger = logging.getLogger("acompile")

COSTS_FILE = "costs.json"
_FORMAT = 1
# Records kept in the file, the newest: some 60 bytes each.
MAX_RECORDS = 2048
# Seconds per unit of weight before any compile was measured: about what a small Triton kernel
# costs on a server core (0.1-0.3 s), and a large one's source weighs ten times more.
_DEFAULT_RATE = 0.1
# Reading or writing the file past these is abandoned (a hung filesystem): no order is worth
# more than a moment of the first compile's time, nor a save more than a moment of the pool's exit.
_LOAD_DEADLINE = 0.5
_SAVE_DEADLINE = 2.0


@dataclass(frozen=True)
class CostFeatures:
    """What the cost model knows of a job before it runs."""

    key: str  # the cache key: the kernel with its options
    family: str  # the kernel without its options (its name and source)
    size: int  # characters of source (and other text) the payload ships
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, payload: Any, name: str) -> CostFeatures:
        """The features of a backend's payload (a dict with ``key`` and ``key_parts``; the
        Triton payload's ``options`` say ``num_warps`` and ``num_stages``)."""
        if not isinstance(payload, Mapping):
            payload = {}
        parts = payload.get("key_parts")
        parts = parts if isinstance(parts, Mapping) else {}
        source = parts.get("kernel") or parts.get("source") or ""
        family = hashlib.sha256(f"{name}\0{source}".encode()).hexdigest()[:16]
        options = payload.get("options")
        options = options if isinstance(options, Mapping) else {}
        shipped = {k: v for k, v in payload.items() if k != "key_parts"}
        return cls(
            key=str(payload.get("key", ""))[:16],
            family=family,
            size=_text_size(shipped),
            num_warps=_positive_int(options.get("num_warps"), 4),
            num_stages=_positive_int(options.get("num_stages"), 3),
        )


def _positive_int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def _text_size(value: Any, depth: int = 0) -> int:
    """Characters of the strings and bytes in a payload (its kernel's source, mostly)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if depth > 8:
        return 0
    if isinstance(value, Mapping):
        return sum(_text_size(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v, depth + 1) for v in value)
    return 0


def _log_rate(record: _Record) -> float:
    return math.log(max(record.seconds, 1e-4) / _weight(record.features))


def _weight(f: CostFeatures) -> float:
    """How heavy a compile looks before it runs: its source's size, and the options that
    multiply the work of the passes (software pipelining stages, warps to lay out)."""
    stages = 1.0 + 0.25 * max(0, f.num_stages - 1)
    return (1.0 + f.size / 2000) * stages * (1.0 + 0.1 * math.log2(f.num_warps))


@dataclass
class _Record:
    seconds: float
    family: str
    size: int
    num_warps: int
    num_stages: int
    at: float  # when measured (Unix time): the newest records are kept

    @property
    def features(self) -> CostFeatures:
        return CostFeatures("", self.family, self.size, self.num_warps, self.num_stages)

    def row(self) -> list[Any]:
        seconds = round(self.seconds, 4)
        return [seconds, self.family, self.size, self.num_warps, self.num_stages, round(self.at)]

    @classmethod
    def from_row(cls, row: Any) -> _Record | None:
        """A record from the file, or None for one that makes no sense."""
        try:
            seconds, family, size, warps, stages, at = row
            record = cls(float(seconds), str(family), int(size), int(warps), int(stages), float(at))
        except (TypeError, ValueError):
            return None
        if not (0 <= record.seconds < 1e6 and record.num_warps > 0 and record.num_stages > 0):
            return None
        return record


class CompileCosts:
    """Compile times per kernel and options, remembered in the cache folder.

    ``await expect(features)`` loads the file the first time (on the disk tier's threads);
    ``record(features, seconds)`` says whether a ``save()`` should be started (none is on its
    way); ``save()`` merges and writes the file.
    """

    def __init__(self, disk: GuardedDisk) -> None:
        self._disk = disk
        self._records: dict[str, _Record] = {}
        self._families: dict[str, set[str]] = {}  # family -> keys of its records
        # log(seconds per weight), summed over every record: their geometric mean is the rate of
        # a kernel never seen (one slow outlier moves it less than it would move a mean).
        self._log_rates = 0.0
        self._unsaved: dict[str, _Record] = {}
        self._loaded = False
        self._loading: anyio.Event | None = None
        self._saving = False

    @property
    def path(self) -> Path:
        return self._disk.root / COSTS_FILE

    async def expect(self, f: CostFeatures) -> float:
        """The seconds a compile with these features is expected to take."""
        if not self._loaded:
            await self._load()
        exact = self._records.get(f.key)
        if exact is not None:
            return exact.seconds
        weight = _weight(f)
        kin = [self._records[key] for key in self._families.get(f.family, ())]
        if kin:
            return statistics.fmean(r.seconds * weight / _weight(r.features) for r in kin)
        rate = math.exp(self._log_rates / len(self._records)) if self._records else _DEFAULT_RATE
        return weight * rate

    def record(self, f: CostFeatures, seconds: float) -> bool:
        """Remember a finished compile; True when the caller should start ``save()``."""
        old = self._records.get(f.key)
        if old is not None:
            seconds = (old.seconds + seconds) / 2  # damp one slow run (a busy machine)
        record = _Record(seconds, f.family, f.size, f.num_warps, f.num_stages, time.time())
        self._add(f.key, record)
        self._unsaved[f.key] = record
        if self._saving or not (self._disk.writable and self._disk.answered):
            return False
        self._saving = True
        return True

    def _add(self, key: str, record: _Record) -> None:
        old = self._records.pop(key, None)
        if old is not None:
            self._log_rates -= _log_rate(old)
            self._families[old.family].discard(key)
        self._records[key] = record
        self._families.setdefault(record.family, set()).add(key)
        self._log_rates += _log_rate(record)

    async def save(self) -> None:
        """Write the records not yet saved into the file (merged with what other processes
        wrote there); records made while it writes are saved by a next round."""
        try:
            while self._unsaved:
                batch, self._unsaved = self._unsaved, {}
                with anyio.move_on_after(_SAVE_DEADLINE, shield=True):
                    try:
                        await self._disk.files.call(functools.partial(self._merge_and_write, batch))
                    except OSError as exc:
                        logger.debug("cannot save compile times to %s: %s", self.path, exc)
                        return
        finally:
            self._saving = False

    async def _load(self) -> None:
        if self._loading is not None:
            await self._loading.wait()
            return
        self._loading = anyio.Event()
        try:
            if self._disk.answered:
                with anyio.move_on_after(_LOAD_DEADLINE):
                    found = await self._disk.files.call(self._read)
                    for key, record in found.items():
                        if key not in self._records:  # measured here meanwhile: newer
                            self._add(key, record)
        finally:
            self._loaded = True
            self._loading.set()

    def _read(self) -> dict[str, _Record]:
        """The file's records (blocking); empty for a file that is absent or damaged."""
        records = {}
        for key, row in self._read_rows().items():
            record = _Record.from_row(row)
            if record is not None:
                records[key] = record
        return records

    def _read_rows(self) -> dict[str, list[Any]]:
        """The file's rows as they are stored (blocking): those shaped like a record."""
        try:
            document = json.loads(self.path.read_bytes())
            rows = document["records"] if document.get("format") == _FORMAT else {}
            if not isinstance(rows, dict):
                return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}
        return {k: r for k, r in rows.items() if isinstance(k, str) and isinstance(r, list) and len(r) == 6}

    def _merge_and_write(self, batch: dict[str, _Record]) -> None:
        """Merge ``batch`` into the file and replace it atomically (blocking). Rows stay rows
        (no record objects): this runs on a thread that shares the interpreter with the event
        loop, and the less Python it runs the less it delays the loop."""
        rows = self._read_rows()
        rows.update((key, record.row()) for key, record in batch.items())
        if len(rows) > MAX_RECORDS:
            rows = dict(sorted(rows.items(), key=_row_time, reverse=True)[:MAX_RECORDS])
        data = json.dumps({"format": _FORMAT, "records": rows}, separators=(",", ":")).encode()
        tmp = temp_path(self.path)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _row_time(item: tuple[str, list[Any]]) -> float:
    at = item[1][5]
    return float(at) if isinstance(at, (int, float)) else 0.0
