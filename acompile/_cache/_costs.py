"""How long compiles take: the cost model the pool orders its queue by.

A storm of compiles ends when its longest job ends, so the queue runs the longest expected job
first (``JobQueue``); this module says how long a job is expected to take. It remembers each
finished compile's time in a small file beside the entries (``<cache>/costs.json``), so that the
next process, on the same machine or folder, knows the costs before anything runs.

What a job is expected to take, best answer first:

1. the same kernel with the same options compiled before: its time (the mean of the last two);
2. the same kernel with other options (``family``: its name and source): the times of those,
   each scaled by how this job's options compare with theirs (``_ratio``);
3. a kernel never seen: ``_weight`` of what the payload holds (the size of the source it ships,
   the dot products in it, ``num_stages``, ``num_warps``), in seconds per weight learned from
   every recorded compile. The first request of such a family this model sees gets that guess;
   the family's later requests are scaled from it by ``_ratio``, as in 2.

A dot product (``tl.dot``, ``tl.dot_scaled``) is what makes a Triton compile long: its lowering
to tensor-core instructions and the software pipeline around it. In the benchmark corpus, kernels
with one or two take 0.3 to 3 s to compile for ``cuda:90`` on 2 cores, those without 0.06 to
0.9 s, at similar source sizes; by size alone, the first guess put elementwise kernels ahead of
the matmuls.

``_ratio`` compares two jobs of one family as the autotuner's heuristic does: the product of the
integer constexprs (the tile sizes) times ``num_stages``, over ``num_warps``; Triton unrolls each
warp's share of a tile over the pipeline's stages. Compile time grows a little slower than that
product: on the autotune benchmark's 18 matmul configs (Triton for ``cuda:90``, 0.5 to 18 s), a
fit of log(seconds) against log(product) has a slope of 0.84 to 0.88, so the ratio is raised to
the power 0.8 (``_FAMILY_EXPONENT``). Part of a compile does not grow with it at all (parsing,
the passes' fixed costs, starting ptxas): in the benchmark corpus, a 32x32x32 matmul took 0.38 s
where a 256x64x64 one took 3.0 s on 2 cores, a sixty-fourth of the tile for an eighth of the
time, and the plain ratio had guessed it last of 68 jobs, behind kernels of 0.06 s. So a job is
never expected to take less than ``_FAMILY_FLOOR`` of its kin's time, and the ratio moves
between that floor and 1 (above 1 it is the plain ratio, less the floor's share). Across
families tile sizes say nothing (an elementwise kernel's block is no matmul's), so they are not
compared there.

Only the order matters to the queue, so a rough guess does its job: the long matmul ahead of the
short elementwise kernel. The file is written off the loop, atomically (a reader sees the old
file or the new one); a writer holds an advisory lock (``costs.json.lock``, ``flock``) while it
merges what is on disk and replaces it, so processes that share the folder lose no record. The
lock is waited for a moment only: a holder that is stuck (stopped, a hung filesystem) costs a save
that may race another, never a pool's exit. A file that does not parse, is too large or is not a
regular file (read with ``read_state``: never blocking, never through a link), and a record that
makes no sense (a huge or negative number, NaN), is ignored, and dropped at the next save. The
lock file is never opened through a link (a link planted there would have ``O_CREAT`` make a
file wherever it leads); a link, a FIFO or a folder in its place is replaced by a lock file.

**The fleet's records.** With a shared tier, the replicas of a fleet share their records too, so
that a fresh replica (an empty cache folder) orders its first storm by what the others measured,
not by guesses. They are one document in the tier, ``costs:<namespace>`` (rows as in the file,
signed as entries are, never unpickled, at most ``MAX_FILE_BYTES``). The first ``expect()``
reads it with the file, both within ``_LOAD_DEADLINE`` (a tier that is away or stalled costs
that, never an error); the file's records win over the fleet's for the same kernel. Each
``save()`` merges the records this process measured (not those it only read from the fleet) into
the document, within ``_SAVE_DEADLINE`` with the file's write: read, merge (the newest record of
each kernel wins; ``MAX_RECORDS`` kept, the newest), write. On Redis the write is a
compare-and-set, tried again on the document as another writer left it, so replicas saving at
once lose nothing. Elsewhere (Memcached), or past the tries, a writer may lose another's records;
each replica's next save publishes all it measured again, so nothing stays lost while it compiles.
The file holds what this machine measured only: the fleet's records stay in memory.

Only the order matters, but of records from machines that may differ: a replica on twice as many
cores compiles in half the time. So the fleet's records are scaled to this machine's as they are
read (``_scale``: the median ratio over the kernels both measured; none shared, no scaling), and
this process's to the document's as they are published: a kernel only the fleet measured sorts
among this machine's own records as it would have, measured here.

A document that does not parse or holds no records is ignored (said once), as is a row that makes
no sense; one over the size bound is not read, and one whose signature does not verify (or that is
unsigned, in a signed tier) is refused by the tier; any of them is replaced at the next save.
Replicas with other signing keys have other namespaces, so other documents.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import stat
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from acompile import _files
from acompile._cache._layout import clear_way, read_state, write_state
from acompile._cache._shared import SharedTier

if TYPE_CHECKING:
    from acompile._cache._disk import GuardedDisk
    from acompile._cache._tier import Tier

logger = logging.getLogger("acompile")

COSTS_FILE = "costs.json"
# Beside the file, never replaced (a lock on a file that was replaced locks nothing). Its name
# does not start with "." so that pruning, which removes stale temporary files, leaves it.
LOCK_FILE = "costs.json.lock"
# The fleet's records in the shared tier: the document ``costs:<namespace>``.
SHARED_DOCUMENT = "costs"
_FORMAT = 1
# Records kept in the file, the newest: some 70 bytes each.
MAX_RECORDS = 2048
# A file larger than this is damaged (MAX_RECORDS rows take some 150 KB): not read, and replaced.
MAX_FILE_BYTES = 4 << 20
# Seconds per unit of weight before any compile was measured: about what a small Triton kernel
# costs on a server core (0.1-0.3 s), and a large one's source weighs ten times more.
_DEFAULT_RATE = 0.1
# Reading or writing the file past these is abandoned (a hung filesystem): no order is worth
# more than a moment of the first compile's time, nor a save more than a moment of the pool's exit.
_LOAD_DEADLINE = 0.5
_SAVE_DEADLINE = 2.0
# The lock is waited for at most this long, within the save's deadline; then the save goes on
# without it (its records may race another writer's, but they are not given up).
_LOCK_WAIT = 1.0
# What a record may say and still make sense; anything else in the file is ignored. They also
# bound the arithmetic: no value can overflow a float or make a weight zero or negative.
_MAX_SECONDS = 1e6
_MAX_SIZE = 1 << 40
_MAX_OPTION = 1024  # num_warps, num_stages
_MAX_TILES = 1 << 48
_MAX_TIME = 1e11  # Unix time, year 5138
# How far ahead of this machine's clock a record may be dated (another machine's clock may run
# ahead); a later one is refused.
_FUTURE_SLACK = 86400.0
# The fleet's document is read up to this size: MAX_RECORDS rows take some 150 KB, and parsing it
# (on a thread that cannot be stopped) must stay well inside the load's and the save's deadlines.
SHARED_MAX_BYTES = 1 << 20
# The fleet's records are scaled to this machine's by at most this factor, either way: machines
# of one fleet differ by a few times, not by hundreds.
_MAX_SCALE = 100.0
# O_NOFOLLOW: a link at the lock's path is refused (ELOOP), never followed; O_NONBLOCK: a FIFO
# there opens at once (and is then replaced, as not a regular file).
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# How compile time grows with tiles x stages / warps within a family: see the module's docstring.
_FAMILY_EXPONENT = 0.8
# The share of a compile's time that does not grow with its tiles: see the module's docstring.
_FAMILY_FLOOR = 0.15
# A kernel's weight grows by this much with one dot product in its source (see the module's
# docstring), and as the square root of their count past one (attention has two: not twice as
# long as a matmul); counted up to _MAX_DOTS.
_DOT_WEIGHT = 3.0
_MAX_DOTS = 64
_DOT_CALL = re.compile(r"\bdot(?:_scaled)?\s*\(")


@dataclass(frozen=True)
class CostFeatures:
    """What the cost model knows of a job before it runs."""

    key: str  # the cache key: the kernel with its options
    family: str  # the kernel without its options (its name and source)
    size: int  # characters of source (and other text) the payload ships
    num_warps: int
    num_stages: int
    tiles: int = 0  # the product of the integer constexprs (its tile sizes); 0: not known
    dots: int = 0  # dot products (``dot(`` calls) in the source it ships

    @classmethod
    def of(cls, payload: Any, name: str) -> CostFeatures:
        """The features of a backend's payload (a dict with ``key`` and ``key_parts``; the
        Triton payload's ``options`` say ``num_warps`` and ``num_stages``, its ``constexprs``
        the tile sizes)."""
        if not isinstance(payload, Mapping):
            payload = {}
        parts = payload.get("key_parts")
        parts = parts if isinstance(parts, Mapping) else {}
        source = parts.get("kernel") or parts.get("source") or ""
        family = hashlib.sha256(f"{name}\0{source}".encode()).hexdigest()[:16]
        options = payload.get("options")
        options = options if isinstance(options, Mapping) else {}
        shipped = {k: v for k, v in payload.items() if k != "key_parts"}
        texts = list(_texts(shipped))
        dots = sum(len(_DOT_CALL.findall(text)) for text in texts if isinstance(text, str))
        return cls(
            key=str(payload.get("key", ""))[:16],
            family=family,
            size=min(max(sum(len(text) for text in texts), 1), _MAX_SIZE),
            num_warps=_option(options.get("num_warps"), 4),
            num_stages=_option(options.get("num_stages"), 3),
            tiles=_tiles(payload.get("constexprs")),
            dots=min(dots, _MAX_DOTS),
        )


def _option(value: Any, default: int) -> int:
    return min(value, _MAX_OPTION) if type(value) is int and value > 0 else default


def _tiles(constexprs: Any) -> int:
    """The product of the integer constexprs above 1 (block sizes; not flags), capped."""
    if not isinstance(constexprs, Mapping):
        return 1
    product = 1
    for value in constexprs.values():
        if type(value) is int and value > 1:
            product = min(product * min(value, _MAX_TILES), _MAX_TILES)
    return product


def _texts(value: Any, depth: int = 0) -> Iterator[str | bytes]:
    """The strings and bytes in a payload: its kernel's source and its callees', mostly."""
    if isinstance(value, (str, bytes)):
        yield value
    elif depth <= 8 and isinstance(value, Mapping):
        for item in value.values():
            yield from _texts(item, depth + 1)
    elif depth <= 8 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item, depth + 1)


def _clamp(value: int, high: int) -> int:
    # Features built by hand (not by ``of``) may say anything: a guess never raises.
    return min(max(value, 1), high)


def _log_rate(record: _Record) -> float:
    return math.log(max(record.seconds, 1e-4) / _weight(record.features))


def _weight(f: CostFeatures) -> float:
    """How heavy a compile looks before it runs: its source's size, its dot products, and the
    options that multiply the work of the passes (software pipelining stages, warps to lay out).
    Tile sizes are left out: they compare jobs of one family only (``_ratio``)."""
    stages = 1.0 + 0.25 * (_clamp(f.num_stages, _MAX_OPTION) - 1)
    warps = 1.0 + 0.1 * math.log2(_clamp(f.num_warps, _MAX_OPTION))
    dots = 1.0 + _DOT_WEIGHT * math.sqrt(min(max(f.dots, 0), _MAX_DOTS))
    return (1.0 + _clamp(f.size, _MAX_SIZE) / 2000) * stages * warps * dots


def _ratio(f: CostFeatures, other: CostFeatures) -> float:
    """How many times longer ``f`` is expected to compile than ``other``, of the same family:
    (tiles x num_stages / num_warps) compared, damped by ``_FAMILY_EXPONENT``, on top of the
    share of a compile that does not grow with them (``_FAMILY_FLOOR``). Tiles count only where
    both are known (records written before they were kept say 0)."""

    def heft(g: CostFeatures) -> float:
        return _clamp(g.num_stages, _MAX_OPTION) / _clamp(g.num_warps, _MAX_OPTION)

    ratio = heft(f) / heft(other)
    if f.tiles > 0 and other.tiles > 0:
        ratio *= _clamp(f.tiles, _MAX_TILES) / _clamp(other.tiles, _MAX_TILES)
    return float(_FAMILY_FLOOR + (1 - _FAMILY_FLOOR) * ratio**_FAMILY_EXPONENT)


@dataclass
class _Record:
    seconds: float
    family: str
    size: int
    num_warps: int
    num_stages: int
    at: float  # when measured (Unix time): the newest records are kept
    tiles: int = 0
    dots: int = 0

    @property
    def features(self) -> CostFeatures:
        f = (self.family, self.size, self.num_warps, self.num_stages, self.tiles, self.dots)
        return CostFeatures("", *f)

    def row(self) -> list[Any]:
        seconds = round(self.seconds, 4)
        row = [seconds, self.family, self.size, self.num_warps, self.num_stages, round(self.at), self.tiles]
        return [*row, self.dots] if self.dots else row

    def sane(self) -> bool:
        """Whether every field is in its range (finite, positive where it must be)."""
        return (
            0 <= self.seconds < _MAX_SECONDS  # False for NaN
            and 0 < self.size <= _MAX_SIZE
            and 0 < self.num_warps <= _MAX_OPTION
            and 0 < self.num_stages <= _MAX_OPTION
            and 0 <= self.tiles <= _MAX_TILES
            and 0 <= self.dots <= _MAX_DOTS
            and 0 <= self.at < _MAX_TIME
            # Not from the future: a row dated years ahead would outlive every real one ("the
            # newest win"), and a document of them would shut the fleet's records out for good.
            and self.at <= time.time() + _FUTURE_SLACK
        )

    @classmethod
    def from_row(cls, row: Any) -> _Record | None:
        """A record from the file, or None for one that makes no sense. Rows have six fields,
        seven where the tiles are known, eight where the source has dot products."""
        if not isinstance(row, list) or len(row) not in (6, 7, 8):
            return None
        try:
            seconds, family, size, warps, stages, at, *more = row
            record = cls(
                float(seconds),
                family,
                int(size),
                int(warps),
                int(stages),
                float(at),
                int(more[0]) if more else 0,
                int(more[1]) if len(more) > 1 else 0,
            )
        except (TypeError, ValueError, OverflowError):  # 10**400 is a JSON number, not a float
            return None
        return record if isinstance(family, str) and record.sane() else None


def _records(data: bytes) -> dict[str, _Record]:
    """The sensible records of a document (the file's, the fleet's); rows that make no sense are
    left out. Raises ``ValueError`` (``json``'s), ``TypeError`` or ``RecursionError`` for one
    that is not a document of records."""
    document = json.loads(data)
    if not isinstance(document, dict):
        raise TypeError("it is not an object")
    rows = document.get("records") if document.get("format") == _FORMAT else {}
    if not isinstance(rows, dict):
        raise TypeError("its records are not an object")
    records = {}
    for key, row in rows.items():
        record = _Record.from_row(row)
        if isinstance(key, str) and record is not None:
            records[key] = record
    if len(records) > MAX_RECORDS:  # written by something else than acompile: the newest
        newest = sorted(records.items(), key=lambda item: item[1].at, reverse=True)
        records = dict(newest[:MAX_RECORDS])
    return records


def _document(records: Mapping[str, _Record]) -> bytes:
    """The document of ``records``, the newest ``MAX_RECORDS`` of them."""
    if len(records) > MAX_RECORDS:
        newest = sorted(records.items(), key=lambda item: item[1].at, reverse=True)
        records = dict(newest[:MAX_RECORDS])
    rows = {key: record.row() for key, record in records.items()}
    return json.dumps({"format": _FORMAT, "records": rows}, separators=(",", ":")).encode()


def _scale(to: Mapping[str, _Record], of: Mapping[str, _Record]) -> float:
    """How many times longer a compile takes where ``to`` was measured than where ``of`` was:
    the median ratio of their times over the kernels both hold (between 1/``_MAX_SCALE`` and
    ``_MAX_SCALE``), 1 where they hold none in common. The median: a kernel measured once on a
    busy machine moves it little."""
    logs = [
        math.log(max(to[key].seconds, 1e-4) / max(record.seconds, 1e-4))
        for key, record in of.items()
        if key in to
    ]
    if not logs:
        return 1.0
    bound = math.log(_MAX_SCALE)
    return math.exp(min(max(statistics.median(logs), -bound), bound))


def _scaled(record: _Record, scale: float) -> _Record:
    return record if scale == 1.0 else replace(record, seconds=min(record.seconds * scale, _MAX_SECONDS / 2))


def _open_lock(path: Path) -> int:
    """The lock file's descriptor, the file made where missing (blocking). What sits in its
    place and is not a regular file (a link, a FIFO, a device, a folder) is removed, and the
    file made afresh: a lock on it would lock nothing another process locks. Raises ``OSError``."""
    for attempt in (1, 2):
        try:
            fd = os.open(path, _LOCK_FLAGS, 0o600)
        except OSError as exc:
            # ELOOP: a link; EISDIR: a folder (opened to write). Removed below, once.
            if exc.errno not in (errno.ELOOP, errno.EISDIR) or attempt == 2:
                raise
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            # Unless another process replaced it by a lock file meanwhile: that one is good.
            if not stat.S_ISREG(os.lstat(path).st_mode):
                clear_way(path)
    raise OSError(errno.EINVAL, f"not a regular file, even once replaced: {path}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (blocking, at most ``_LOCK_WAIT`` seconds);
    yields whether it is held. Closing the file releases it, as does the holder's death."""
    try:
        fd = _open_lock(path)
    except OSError as exc:
        logger.debug("cannot open %s: %s", path, exc)
        yield False
        return
    try:
        try:
            held = _files.lock_within(fd, _LOCK_WAIT)
            if not held:
                logger.debug("%s is held too long: saving without it", path)
        except OSError as exc:  # a filesystem without locks
            logger.debug("cannot lock %s: %s", path, exc)
            held = False
        yield held
    finally:
        os.close(fd)


class CompileCosts:
    """Compile times per kernel and options, remembered in the cache folder, and shared with the
    fleet through ``shared`` (a ``SharedTier``; any other tier, or None, shares nothing).

    ``await expect(features)`` loads the file and the fleet's document the first time (on the
    disk tier's threads); ``record(features, seconds)`` says whether a ``save()`` should be
    started (none is on its way); ``save()`` merges and writes the file, and publishes to the
    fleet. None of them raises (but for cancellation).

    ``counts``: ``shared_loaded`` (the fleet's records taken in), ``shared_ignored`` (documents
    of the fleet that did not parse), ``shared_published`` (documents written).
    """

    def __init__(self, disk: GuardedDisk, shared: Tier | None = None) -> None:
        self._disk = disk
        self._shared = shared if isinstance(shared, SharedTier) else None
        self._records: dict[str, _Record] = {}
        self._families: dict[str, set[str]] = {}  # family -> keys of its records
        # The first request seen of each family without a record: the others are scaled from it.
        self._first_seen: dict[str, CostFeatures] = {}
        # log(seconds per weight), summed over every record: their geometric mean is the rate of
        # a kernel never seen (one slow outlier moves it less than it would move a mean).
        self._log_rates = 0.0
        self._unsaved: dict[str, _Record] = {}
        # What this process measured, oldest first: all of it is published at each save (an
        # update that another writer overwrote is made good by the next).
        self._mine: dict[str, _Record] = {}
        # How many times this machine's times are multiplied as they are published (``_scale``).
        self._to_fleet = 1.0
        self._loaded = False
        self._loading: anyio.Event | None = None
        self._saving = False
        self.counts: Counter[str] = Counter()

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
        kin = [self._records[key] for key in self._families.get(f.family, ())]
        if kin:
            return statistics.fmean(r.seconds * _ratio(f, r.features) for r in kin)
        if len(self._first_seen) >= MAX_RECORDS:
            self._first_seen.clear()
        first = self._first_seen.setdefault(f.family, f)
        rate = math.exp(self._log_rates / len(self._records)) if self._records else _DEFAULT_RATE
        return _weight(first) * rate * _ratio(f, first)

    def record(self, f: CostFeatures, seconds: float) -> bool:
        """Remember a finished compile; True when the caller should start ``save()``. A time
        or features that make no sense (NaN, a negative size) are not remembered."""
        old = self._records.get(f.key)
        if old is not None:
            seconds = (old.seconds + seconds) / 2  # damp one slow run (a busy machine)
        record = _Record(seconds, f.family, f.size, f.num_warps, f.num_stages, time.time(), f.tiles, f.dots)
        if not record.sane():
            return False
        self._add(f.key, record)
        self._unsaved[f.key] = record
        self._mine.pop(f.key, None)
        self._mine[f.key] = record
        if len(self._mine) > MAX_RECORDS:
            del self._mine[next(iter(self._mine))]
        if self._saving or not (self._writable or self._shared is not None):
            return False
        self._saving = True
        return True

    @property
    def _writable(self) -> bool:
        return self._disk.writable and self._disk.answered

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
        wrote there), and publish this process's to the fleet; records made meanwhile are saved
        by a next round. The whole save, its rounds, the file and the fleet together, takes
        ``_SAVE_DEADLINE`` at most (records left by a round it cut short wait for the next save).
        Never raises but for cancellation: a save that fails is logged (at debug) and given up,
        since it runs behind the pool's back, and an error there would stop the pool."""
        try:
            with anyio.move_on_after(_SAVE_DEADLINE, shield=True):
                while self._unsaved:
                    batch, self._unsaved = self._unsaved, {}
                    if self._writable:
                        try:
                            await self._disk.files.call(functools.partial(self._merge_and_write, batch))
                        except Exception as exc:
                            logger.debug("cannot save compile times to %s: %r", self.path, exc)
                    if self._shared is not None:
                        await self._publish(self._shared)
        finally:
            self._saving = False

    async def _publish(self, shared: SharedTier) -> None:
        """Merge what this process measured into the fleet's document (never raises)."""
        mine = dict(self._mine)

        def merged(data: bytes | None) -> bytes:
            fleet = self._parse_fleet(data, logging.DEBUG)
            # This machine's times as the document's, from the kernels that other replicas
            # measured too: this process's own rows there would only echo the scale they were
            # written with, which is kept for them.
            others = {k: r for k, r in fleet.items() if k not in mine or not self._published(r, mine[k])}
            if any(key in others for key in mine):
                self._to_fleet = _scale(others, mine)
            for key, record in mine.items():
                there = fleet.get(key)
                if there is None or there.at <= round(record.at):  # the newest wins (rows: whole seconds)
                    fleet[key] = _scaled(record, self._to_fleet)
            return _document(fleet)

        async def change(data: bytes | None) -> bytes:
            return await anyio.to_thread.run_sync(merged, data)  # JSON of 100s of KB: off the loop

        try:
            if await shared.update_document(SHARED_DOCUMENT, SHARED_MAX_BYTES, change):
                self.counts["shared_published"] += 1
        except Exception as exc:
            logger.debug("cannot publish compile times to the shared cache: %r", exc)

    def _published(self, row: _Record, record: _Record) -> bool:
        """Whether ``row`` (read from the fleet's document) is ``record``, as this process
        published it."""
        return row.row() == _scaled(record, self._to_fleet).row()

    def _parse_fleet(self, data: bytes | None, level: int) -> dict[str, _Record]:
        """The records of the fleet's document (blocking: JSON); none for a document that is
        absent or does not parse (logged at ``level``: the next save replaces it)."""
        if data is None:
            return {}
        try:
            return _records(data)
        except (ValueError, TypeError, RecursionError) as exc:
            if level > logging.DEBUG:
                self.counts["shared_ignored"] += 1
            logger.log(
                level, "compile times shared by the fleet ignored (%s); the next save replaces them", exc
            )
            return {}

    async def _load(self) -> None:
        # A load cancelled from outside (its request was) leaves the model unloaded: the next
        # expect() loads again. A load past its deadline counts as done: the filesystem hangs
        # (or the shared tier does; each has its deadline, and they run at once).
        while not self._loaded:
            if self._loading is not None:
                await self._loading.wait()
                continue
            loading = self._loading = anyio.Event()
            try:
                local, fleet = await self._read_all()
                for key, record in local.items():
                    if key not in self._records:  # measured here meanwhile: newer
                        self._add(key, record)
                scale = _scale(local, fleet)  # the fleet's times as this machine's
                for key, record in fleet.items():
                    if key not in self._records:  # this machine's own record wins
                        self._add(key, _scaled(record, scale))
                        self.counts["shared_loaded"] += 1
                self._loaded = True
            except Exception as exc:
                logger.debug("cannot read compile times: %r", exc)
                self._loaded = True
            finally:
                self._loading = None
                loading.set()

    async def _read_all(self) -> tuple[dict[str, _Record], dict[str, _Record]]:
        """The file's records and the fleet's, read at once, each within ``_LOAD_DEADLINE``
        (none from one that takes longer)."""
        local: dict[str, _Record] = {}
        fleet: dict[str, _Record] = {}

        async def read_local() -> None:
            if self._disk.answered:
                with anyio.move_on_after(_LOAD_DEADLINE):
                    local.update(await self._disk.files.call(self._read))

        async def read_fleet(shared: SharedTier) -> None:
            with anyio.move_on_after(_LOAD_DEADLINE):
                data = await shared.get_document(SHARED_DOCUMENT, SHARED_MAX_BYTES)
                if data is not None:
                    parse = functools.partial(self._parse_fleet, data, logging.WARNING)
                    fleet.update(await anyio.to_thread.run_sync(parse))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_local)
            if self._shared is not None:
                tg.start_soon(read_fleet, self._shared)
        return local, fleet

    def _read(self, level: int = logging.WARNING) -> dict[str, _Record]:
        """The file's sensible records (blocking); none for a file that is absent, refused
        (``read_state``) or does not parse, logged at ``level`` (said once, where it is loaded:
        the next save replaces it)."""
        try:
            data = read_state(self.path, MAX_FILE_BYTES)
            return {} if data is None else _records(data)
        except (OSError, ValueError, TypeError, RecursionError) as exc:
            logger.log(level, "compile times in %s ignored (%s); the next save replaces them", self.path, exc)
            return {}

    def _merge_and_write(self, batch: dict[str, _Record]) -> None:
        """Merge ``batch`` into the file and replace it atomically (blocking), under the lock.
        Rows that make no sense are dropped, not carried over."""
        with _locked(self._disk.root / LOCK_FILE):
            records = self._read(logging.DEBUG)
            records.update(batch)
            # A rename replaces whatever is there (a FIFO, a link) without opening it; a folder
            # there is removed first.
            write_state(self.path, _document(records))
