"""Executors handed in: what ``CompilePool(workers=...)`` takes, and the one call that opens it.

A pool's ``workers`` argument is a count (``CompilePool(workers=8)``, the shorthand for
``LocalWorkers(8)``) or an *executor spec*: ``LocalWorkers``, ``acompile.RayFarm``, ``Split``
(urgent work on one, background work on another), or the host's pool that torch.compile's served
processes share. A spec is a description; it holds nothing that runs. When the pool is entered it
makes one call, ``await spec.open(settings, opening)``, and gets its ``Executor``: the spec
decides everything about how its jobs reach a worker (a farm that cannot be reached falls back to
local workers, where it says so, inside its own ``open``). ``settings`` is the pool's checked
``WorkerSettings``, carried whole to wherever the workers run; ``opening`` is what the pool lends
the executor (its work folder, its toolchain memo, the hook that prepares the workers'
configuration, a stack for resources that must be closed after the executor's ``serve()``).

Adding an executor (a Kubernetes job, a remote build service) is writing a class with such an
``open``: nothing in the pool changes.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from acompile._sizing import usable_cpus
from acompile._workers._pool import WorkerPool
from acompile._workers._split import SplitExecutor

if TYPE_CHECKING:
    from acompile._workers._config import BackendConfig
    from acompile._workers._executor import Executor
    from acompile._workers._settings import WorkerSettings

__all__ = (
    "ExecutorSpec",
    "LocalWorkers",
    "Opening",
    "Split",
    "checked_count",
    "executor_spec",
    "is_executor_spec",
    "opened",
)

logger = logging.getLogger("acompile")


@dataclass(frozen=True)
class Opening:
    """What a pool lends the executor it opens (``ExecutorSpec.open``).

    Attributes:
        workdir: the pool's work folder (this user's, private): workers' stderr, sockets.
        memo_dir: the toolchain memo folder in the cache (one-time costs of this machine).
        cache_root: the pool's cache folder.
        bytecode_dir, bytecode_helpers: where local workers keep their imports' bytecode.
        backend_config: computes what the backends' parent halves hand the local workers
            (once, when the first one starts).
        size: how many local workers the pool would run by default (a fallback's size).
        stack: resources an executor holds beyond its ``serve()`` (a connection), closed after
            the pool's task group has ended, or at once where entering fails: an executor that
            holds a process or a connection puts its closing here as it is opened.
        sys_path, cwd: the pool's at its entry: what local workers made later (a fallback) start
            with too.
        fallback: the executor a remote one moves its jobs to when it is lost (``Split`` gives
            its urgent executor); None: the spec makes local workers when it needs them.
    """

    workdir: str
    memo_dir: Path
    cache_root: Path
    bytecode_dir: str | None
    bytecode_helpers: str
    backend_config: Callable[[], Awaitable[BackendConfig]] | None
    size: int
    stack: AsyncExitStack
    sys_path: tuple[str, ...]
    cwd: str
    fallback: Executor | None = None
    # How many local pools were made for this pool: each after the first gets a folder of its
    # own inside the work folder (their workers' files are named by slot).
    _made: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)

    def local_workers(self, settings: WorkerSettings, size: int | None = None) -> WorkerPool:
        """Local worker processes for ``settings`` (``size`` of them, else the pool's default),
        in a work folder of their own."""
        made = self._made[0]
        self._made[0] += 1
        workdir = self.workdir if made == 0 else os.path.join(self.workdir, f"local-{made}")
        pool = WorkerPool(
            size if size is not None else self.size,
            settings,
            workdir,
            bytecode_dir=self.bytecode_dir,
            bytecode_helpers=self.bytecode_helpers,
            sys_path=self.sys_path,
            cwd=self.cwd,
        )
        if self.backend_config is not None:
            # What the workers' preload needs from this process (Triton's key of its binaries,
            # computed once per machine) is prepared when they first start.
            pool.prepare_config_with(self.backend_config)
        return pool

    def with_fallback(self, fallback: Executor) -> Opening:
        """This opening, with ``fallback`` as the executor a remote one falls back to."""
        return replace(self, fallback=fallback)

    def fallback_or_local(self, settings: WorkerSettings, size: int | None = None) -> Executor:
        """What a remote executor that cannot be had falls back to: ``fallback`` where there is
        one (the urgent executor of a ``Split``), else new local workers."""
        return self.fallback if self.fallback is not None else self.local_workers(settings, size)


class ExecutorSpec(Protocol):
    """What ``CompilePool(workers=...)`` takes besides a count: a description of an executor,
    opened once when the pool is entered."""

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        """Build the executor (connecting where it must) for a pool being entered."""
        ...


class LocalWorkers:
    """Worker processes on this machine: ``CompilePool(workers=LocalWorkers(8))``, which
    ``CompilePool(workers=8)`` is short for.

    Args:
        count: how many worker processes; ``None``: the pool's default (one per CPU this process
            may use, keeping one for the process itself beyond four).
    """

    def __init__(self, count: int | None = None, *, _warn: bool = True) -> None:
        self.count = checked_count(count, warn=_warn)

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        return opening.local_workers(settings, self.count)

    def __repr__(self) -> str:
        return f"LocalWorkers({self.count!r})"


class Split:
    """Urgent work on one executor, background work on another:
    ``CompilePool(workers=Split(LocalWorkers(4), RayFarm("auto")))`` keeps a server's on-demand
    compiles (somebody waits for each) on 4 local workers and sends warm-ups, progressive best
    tiers and every other background job to the farm. A farm that falls back to local workers
    falls back to the urgent ones.

    Args:
        urgent: the executor spec for the urgent lane, or a count of local workers (None: the
            pool's default count).
        background: the same, for the background lane.
    """

    def __init__(self, urgent: ExecutorSpec | int | None, background: ExecutorSpec | int | None) -> None:
        self.urgent = executor_spec(urgent, "urgent", warn=False)
        self.background = executor_spec(background, "background", warn=False)
        # The local workers of both halves run on this machine together.
        halves = (self.urgent, self.background)
        local = sum(half.count or 0 for half in halves if isinstance(half, LocalWorkers))
        _warn_beyond_cpus(local, "Split's local workers")

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        urgent = opened(self.urgent, await self.urgent.open(settings, opening))
        background = opened(
            self.background, await self.background.open(settings, opening.with_fallback(urgent))
        )
        if background is urgent:
            return urgent  # the background side fell back to the urgent workers
        return SplitExecutor(urgent, background)

    def __repr__(self) -> str:
        return f"Split({self.urgent!r}, {self.background!r})"


def checked_count(count: object, name: str = "workers", *, warn: bool = True) -> int | None:
    """A count of local workers, checked: a positive integer, within what the machine can run
    (a count beyond its CPUs is allowed, with a warning unless ``warn`` is False), or None.
    Raises ``ValueError``."""
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        hint = ""
        if isinstance(count, str) and count.strip().isdigit():
            hint = f" (a count is a number: {name}={int(count)})"  # read from the environment, say
        elif isinstance(count, str) and name == "workers":
            # A pool's first argument as text is most often a target given by position.
            hint = f" (a target is given by name: CompilePool(target={count!r}))"
        raise ValueError(f"{name} must be a positive integer or None, got {count!r}{hint}")
    cpus = usable_cpus()
    if count > (most := max(256, 16 * cpus)):
        # Each worker is a process with its own memory: a count like this is a slip (a value
        # meant for something else), and entering would try to make them all.
        raise ValueError(
            f"{name}={count} is more than this machine can run ({cpus} usable CPUs; at most {most} workers)"
        )
    if warn:
        _warn_beyond_cpus(count, name)
    return count


def _warn_beyond_cpus(count: int, what: str) -> None:
    cpus = usable_cpus()
    if count > cpus:
        # Allowed (a machine shared with a changing load, a test), but rarely what is meant.
        logger.warning(
            "%s=%d on %d usable CPU%s: a compile keeps a CPU busy, so workers beyond the CPUs make a "
            "storm slower, not faster, and each holds its own memory",
            what,
            count,
            cpus,
            "" if cpus == 1 else "s",
        )


# What every executor has (``Executor``): an ``open`` that returns something without them returned
# no executor.
_EXECUTOR_METHODS = (
    "submit",
    "run",
    "cancel",
    "promote",
    "quiesce",
    "wakeup",
    "wait_ready",
    "stats",
    "serve",
)


def opened(spec: object, executor: object) -> Executor:
    """``executor``, as ``spec.open()`` returned it, checked to be one; raises ``TypeError``
    naming the spec otherwise (an ``open`` that returned None, say)."""
    missing = [name for name in _EXECUTOR_METHODS if not callable(getattr(executor, name, None))]
    if missing:
        raise TypeError(
            f"{spec!r}.open() returned {executor!r}, not an executor (it has no {', '.join(missing)})"
        )
    return executor  # type: ignore[return-value]


def is_executor_spec(value: object) -> bool:
    """Whether ``value`` is an executor spec: an object (not a class) whose class has a coroutine
    function ``open`` (a path, which has a plain ``open``, is not one)."""
    return not isinstance(value, type) and inspect.iscoroutinefunction(getattr(type(value), "open", None))


def executor_spec(value: object, name: str = "workers", *, warn: bool = True) -> ExecutorSpec:
    """``value`` as an executor spec: a count is ``LocalWorkers(count)``, ``None`` the default
    ``LocalWorkers()``. Raises ``ValueError`` for a count that is not one (a float, a string)
    and ``TypeError`` naming ``name`` for anything else."""
    # A string is no count, but a pool's first argument given one is most often a target given
    # by position (or a count read from the environment): checked_count says which.
    if value is None or isinstance(value, (int, float)) or (isinstance(value, str) and name == "workers"):
        return LocalWorkers(checked_count(value, name, warn=warn), _warn=False)
    if is_executor_spec(value):
        return value  # type: ignore[return-value]
    hint = ""
    if isinstance(value, type) and inspect.iscoroutinefunction(getattr(value, "open", None)):
        hint = f" (a class: give one of its instances, {value.__name__}(...))"
    elif isinstance(value, os.PathLike):
        hint = " (a folder is given by name: CompilePool(cache_dir=...))"
    raise TypeError(
        f"{name} must be a count of workers, None, or an executor spec "
        f"(acompile.LocalWorkers, acompile.RayFarm, acompile.Split), got {value!r}{hint}"
    )
