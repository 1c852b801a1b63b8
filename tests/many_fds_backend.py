"""A worker-side backend whose preload keeps 1,100 descriptors open (as a library holding many
files or handles would): the pool processes' own descriptors then number past 1023, out of
``select()``'s range. A job returns the worker's pid."""

from __future__ import annotations

import os
import resource
from typing import Any

_held: list[int] = []


def setup(config: dict[str, Any]) -> None:
    pass


def preload(config: dict[str, Any]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        raise RuntimeError(f"needs 2048 descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    for _ in range(1100):
        _held.append(os.open(os.devnull, os.O_RDONLY))


def compile(payload: Any) -> int:
    return os.getpid()
