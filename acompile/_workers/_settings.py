"""``WorkerSettings``: how a pool's workers run, wherever they run, as one frozen value.

A pool's arguments that tune its worker processes (``worker_nice``, ``memory_limit``,
``max_compile_seconds``, ``preload_timeout``, ``idle_timeout``, ``fork_workers``, what each worker
preloads, the target) are checked once, when the ``CompilePool`` is made, into one of these; from
then on they travel whole: to the local workers (``WorkerPool``), to a farm's connection process
and from there to each Ray actor on a node, to the host's pool. Nothing unpacks them into keyword
arguments or dicts on the way, so a setting added here reaches every executor, and a process at
the other end of a pipe gets the same checked value.

It is plain data (strings, numbers, tuples) and pickles as itself: it only ever travels away from
the pool (frames from the pool are read with plain pickle, ``_protocol``; through Ray to an
actor), never back from a worker, whose frames name no class of this kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from acompile._sizing import parse_size

__all__ = ("DEFAULT_NICE", "WorkerSettings")

# The workers' default priority (``worker_nice``): nice +5 weighs about a third of a nice-0 task
# with the kernel's scheduler, so the event loop (and any other nice-0 work) goes first, and yet
# the compiles progress on a machine busy with other work, where "idle" (SCHED_IDLE) got only
# scraps of CPU and had to be noticed and moved. Measured on 2 CPUs against two nice-0 busy
# loops: 5 compiles in 28.8 s at +5, 61 s at +10, 104 s idle (17 s at 0); the loop's lag with
# nothing else running, 2-4 ms at +5 and idle alike.
DEFAULT_NICE = 5


def _positive_seconds(value: object) -> bool:
    """Whether ``value`` is a positive, finite number of seconds (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


@dataclass(frozen=True)
class WorkerSettings:
    """How a pool's workers run; see the module's docstring. Every field is checked as the value
    is made (``ValueError`` or ``TypeError`` naming the ``CompilePool`` argument it comes from).

    Attributes:
        target: the pool's target as text (``"cuda:90"``), ``""`` for none.
        backends: the backends each worker preloads, by name (``"triton"``): their parent halves
            prepare the workers' configuration, on this machine or on a farm's node.
        preload: the worker-side modules of those backends, which each worker imports.
        nice: a nice value from 0 to 19 added to the workers' (10, the default: the event loop
            still goes first, and compiles keep a share of a busy machine), or ``"idle"``
            (Linux's ``SCHED_IDLE``: only the CPU nobody else wants).
        memory_limit: the resident bytes past which a worker is stopped (``"4GiB"`` is read as
            bytes), or None.
        max_compile_seconds: how long a job may run before its worker is stopped, or None.
        preload_timeout: how long a worker (or the template) may take to preload.
        idle_timeout: quiesce after this many seconds without work, or None.
        fork_workers: fork workers from a preloaded template process.
    """

    target: str = ""
    backends: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    nice: int | Literal["idle"] = DEFAULT_NICE
    memory_limit: int | None = None
    max_compile_seconds: float | None = 600.0
    preload_timeout: float = 120.0
    idle_timeout: float | None = None
    fork_workers: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the checks below normalize in place, once
        if not isinstance(self.target, str):
            raise TypeError(f"target must be text such as 'cuda:90', got {self.target!r}")
        for name in ("backends", "preload"):
            names = getattr(self, name)
            if not isinstance(names, (tuple, list)) or not all(isinstance(item, str) for item in names):
                raise TypeError(
                    f"preload must be a tuple of backend names such as ('triton',), got {names!r}"
                )
            set_(self, name, tuple(names))
        nice = self.nice
        if nice != "idle" and (isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19):
            raise ValueError(f'worker_nice must be "idle" or an integer from 0 to 19, got {nice!r}')
        if self.idle_timeout is not None and not _positive_seconds(self.idle_timeout):
            raise ValueError(
                f"idle_timeout must be a positive number of seconds or None, got {self.idle_timeout!r}"
            )
        if self.memory_limit is not None:
            try:
                set_(self, "memory_limit", parse_size(self.memory_limit))
            except ValueError as exc:
                raise ValueError(f"memory_limit: {exc}") from None
        if self.max_compile_seconds is not None and not _positive_seconds(self.max_compile_seconds):
            raise ValueError(
                f"max_compile_seconds must be positive or None, got {self.max_compile_seconds!r}"
            )
        if not _positive_seconds(self.preload_timeout):
            raise ValueError(
                f"preload_timeout must be a positive number of seconds, got {self.preload_timeout!r}"
            )
        set_(self, "preload_timeout", float(self.preload_timeout))
        if not isinstance(self.fork_workers, bool):
            raise TypeError(f"fork_workers must be True or False, got {self.fork_workers!r}")

    @classmethod
    def checked(cls, *, memory_limit: int | str | None = None, **fields: Any) -> WorkerSettings:
        """Settings from a user's values as ``CompilePool`` takes them (``memory_limit`` may be
        ``"4GiB"``), checked; raises ``ValueError`` or ``TypeError`` naming the argument."""
        if memory_limit is not None:
            try:
                memory_limit = parse_size(memory_limit)
            except ValueError as exc:
                raise ValueError(f"memory_limit: {exc}") from None
        return cls(memory_limit=memory_limit, **fields)

    def replace(self, **changes: Any) -> WorkerSettings:
        """A copy with ``changes``, checked as a new one is."""
        return dataclasses.replace(self, **changes)
