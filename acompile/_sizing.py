"""How many workers this process can really use."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota() -> float | None:
    # cgroup v2: "max 100000" or "<quota> <period>"; v1: two files.
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def default_workers() -> int:
    """One worker per usable CPU, leaving one CPU to the process itself beyond four."""
    cpus = usable_cpus()
    return cpus - 1 if cpus > 4 else cpus


_UNITS = {"": 1, "b": 1}
for _prefix, _power in (("k", 1), ("m", 2), ("g", 3), ("t", 4)):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000**_power
    _UNITS[_prefix + "ib"] = 1024**_power


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512 MiB"`` or ``"2G"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"a size is bytes (int) or a string such as '4GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        unit = text[len(number) :]
        try:
            size = int(float(number) * _UNITS[unit])
        except (ValueError, KeyError):
            raise ValueError(f"cannot read the size {value!r}: write e.g. '4GiB', '512MiB'") from None
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size
