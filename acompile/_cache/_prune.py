"""Bounding a cache folder by age and size: ``prune`` and its ``PruneReport``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread

from acompile import _files
from acompile._cache import _layout
from acompile._cache._disk import DiskTier
from acompile._cache._layout import human_bytes, plural


@dataclass
class PruneReport:
    """What ``prune`` removed (or, with ``dry_run``, would remove)."""

    root: Path
    dry_run: bool = False
    entries_before: int = 0
    bytes_before: int = 0
    removed_by_age: int = 0
    removed_by_size: int = 0
    bytes_removed: int = 0
    temp_files_removed: int = 0
    # Native libraries (<root>/lib/<key>.so, .o) whose entry is gone: counted, never removed (a
    # running process may be loading one, and a `.o` path is handed to the caller to link with).
    orphan_libs: int = 0
    orphan_lib_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return self.removed_by_age + self.removed_by_size

    @property
    def entries_after(self) -> int:
        return self.entries_before - self.removed

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - self.bytes_removed

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        text = (
            f"{verb} {plural(self.removed, 'entry', 'entries')} ({human_bytes(self.bytes_removed)}: "
            f"{self.removed_by_age} by age, {self.removed_by_size} by size); "
            f"{plural(self.entries_after, 'entry', 'entries')} ({human_bytes(self.bytes_after)}) remain"
        )
        if self.temp_files_removed:
            text += f"; {verb} {plural(self.temp_files_removed, 'stale temporary file')}"
        if self.orphan_libs:
            text += (
                f"; {plural(self.orphan_libs, 'library file')} ({human_bytes(self.orphan_lib_bytes)}) "
                f"in {_layout.LIB}/ "
                "outlived their entries (left in place)"
            )
        if self.errors:
            text += f"; {plural(len(self.errors), 'error')}: {self.errors[0]}"
        return text


async def prune(
    root: Path,
    *,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
    dry_run: bool = False,
) -> PruneReport:
    """Bound the cache folder ``root`` by age and size.

    First every entry written more than ``max_age_s`` seconds ago is removed, then the oldest
    entries until the entries left total at most ``max_bytes``. Age is the time since the entry
    was written into this folder (its mtime): the disk tier does not touch a file when it reads
    it, so this is not "least recently used". Temporary files left by writers that died (names
    starting with ".", older than an hour) are removed too. Files in ``<root>/lib`` are not
    counted against ``max_bytes`` and are never removed; the report counts those whose entry is
    gone. Removing an entry another process is reading is safe: it keeps the open file.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if max_age_s is not None and max_age_s < 0:
        raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
    report = PruneReport(Path(root), dry_run=dry_run)
    return await anyio.to_thread.run_sync(_prune, DiskTier(root), max_bytes, max_age_s, report)


def _prune(
    disk: DiskTier, max_bytes: int | None, max_age_s: float | None, report: PruneReport
) -> PruneReport:
    # Files are removed in it: only in a folder of this user's, and never through a link.
    disk.check()
    now = time.time()
    entries: list[tuple[int, str, Path, int]] = []  # (mtime_ns, name, path, size)
    for entry_path in disk.iter_paths():
        try:
            st = entry_path.lstat()  # a link's own age and size: its target is not the folder's
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.errors.append(f"{entry_path}: {exc}")
            continue
        entries.append((st.st_mtime_ns, entry_path.name, entry_path, st.st_size))
    entries.sort()
    report.entries_before = len(entries)
    report.bytes_before = total = sum(e[3] for e in entries)

    def remove(mtime_ns: int, entry_path: Path, size: int) -> bool:
        anyio.from_thread.check_cancelled()
        if report.dry_run:
            report.bytes_removed += size
            return True
        try:
            # Skip an entry rewritten since the scan (a new compile, an import): it is new.
            if entry_path.lstat().st_mtime_ns != mtime_ns:
                return False
            entry_path.unlink()
        except FileNotFoundError:
            pass  # someone else removed it: it is gone all the same
        except OSError as exc:
            report.errors.append(f"{entry_path}: {exc}")
            return False
        report.bytes_removed += size
        return True

    kept: list[tuple[int, str, Path, int]] = []
    cutoff_ns = None if max_age_s is None else int((now - max_age_s) * 1e9)
    for entry in entries:
        mtime_ns, _, entry_path, size = entry
        if cutoff_ns is not None and mtime_ns < cutoff_ns:
            if remove(mtime_ns, entry_path, size):
                report.removed_by_age += 1
                total -= size
                continue
        kept.append(entry)
    if max_bytes is not None:
        for mtime_ns, _, entry_path, size in kept:  # oldest first
            if total <= max_bytes:
                break
            if remove(mtime_ns, entry_path, size):
                report.removed_by_size += 1
                total -= size
    _remove_stale_temps(disk, now, report)
    _count_orphan_libs(disk, report)
    return report


def _remove_stale_temps(disk: DiskTier, now: float, report: PruneReport) -> None:
    # Writers' temporary files: the disk tier's (v1/<xx>/.<key>...tmp), native libraries'
    # (lib/.<key>.so.<pid>.<token>.tmp), the toolchain memo's (toolchain/.<name>.<pid>.<token>.tmp,
    # without ".tmp" from older releases) and those deeper in the toolchain folder (the workers'
    # bytecode's, toolchain/bytecode/.../.<name>.pyc.<pid>.<token>.tmp; the launcher's).
    # Never through a link: what it leads to is not the cache folder's to clean.
    folders = _layout.entry_folders(disk.root)
    folders += [_layout.lib_dir(disk.root), _layout.toolchain_dir(disk.root)]
    temps: list[Path] = []
    for folder in folders:
        try:
            temps += [p for p in folder.iterdir() if _layout.is_temp(p)]
        except OSError:
            continue
    toolchain = _layout.toolchain_dir(disk.root)
    for where, _, files in os.walk(toolchain):
        # Where a process killed mid-write (a bytecode helper) left one: every writer names its
        # temporaries alike (acompile._files), whoever it is. The folder's own files are above.
        if Path(where) != toolchain:
            temps += [Path(where, name) for name in files if _files.is_temporary(name)]
    for temp in temps:
        try:
            st = temp.lstat()
            if not temp.is_file() or now - st.st_mtime < _layout.STALE_TEMP_S:
                continue
            if not report.dry_run:
                temp.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.errors.append(f"{temp}: {exc}")
            continue
        report.temp_files_removed += 1


def _count_orphan_libs(disk: DiskTier, report: PruneReport) -> None:
    lib = _layout.lib_dir(disk.root)
    try:
        files = [p for p in lib.iterdir() if not _layout.is_temp(p) and p.suffix in (".so", ".o")]
    except OSError:
        return
    for file in files:
        key = file.stem
        try:
            if _layout.is_key(key) and not disk.path(key).exists():
                report.orphan_libs += 1
                report.orphan_lib_bytes += file.stat().st_size
        except OSError:
            continue


_AGE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_age(value: str | float) -> float:
    """Seconds from a number of seconds or a string such as ``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        unit = text[-1:] if text[-1:] in _AGE_UNITS else "s"
        number = text[:-1] if text[-1:] in _AGE_UNITS else text
        try:
            seconds = float(number) * _AGE_UNITS[unit]
        except ValueError:
            raise ValueError(
                f"cannot read the age {value!r}: write e.g. '30d', '12h', '90m', '3600s'"
            ) from None
    else:
        raise ValueError(f"an age is seconds or a string such as '30d', got {value!r}")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"an age must be a finite number >= 0, got {value!r}")
    return seconds


__all__ = ["PruneReport", "parse_age", "prune"]
