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

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from acompile._workers._pool import WorkerPool
from acompile._workers._split import SplitExecutor

if TYPE_CHECKING:
    from acompile._workers._config import BackendConfig
    from acompile._workers._executor import Executor
    from acompile._workers._settings import WorkerSettings

__all__ = ("ExecutorSpec", "LocalWorkers", "Opening", "Split")


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
            the pool's task group has ended, or at once where entering fails.
        fallback: local workers a remote executor may move its jobs to (``Split`` gives its
            urgent executor); None: the spec makes its own when it needs them.
    """

    workdir: str
    memo_dir: Path
    cache_root: Path
    bytecode_dir: str | None
    bytecode_helpers: str
    backend_config: Callable[[], Awaitable[BackendConfig]] | None
    size: int
    stack: AsyncExitStack
    fallback: Executor | None = None

    def local_workers(self, settings: WorkerSettings, size: int | None = None) -> WorkerPool:
        """Local worker processes for ``settings`` (``size`` of them, else the pool's default)."""
        pool = WorkerPool(
            size if size is not None else self.size,
            settings,
            self.workdir,
            bytecode_dir=self.bytecode_dir,
            bytecode_helpers=self.bytecode_helpers,
        )
        if self.backend_config is not None:
            # What the workers' preload needs from this process (Triton's key of its binaries,
            # computed once per machine) is prepared when they first start.
            pool.prepare_config_with(self.backend_config)
        return pool

    def with_fallback(self, fallback: Executor) -> Opening:
        """This opening, with ``fallback`` as the local workers a remote executor falls back to."""
        return replace(self, fallback=fallback)


@runtime_checkable
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

    def __init__(self, count: int | None = None) -> None:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"LocalWorkers needs a positive count or None, got {count!r}")
        self.count = count

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
        urgent: the executor spec (or a count of local workers) for the urgent lane.
        background: the executor spec for the background lane.
    """

    def __init__(self, urgent: ExecutorSpec | int, background: ExecutorSpec | int) -> None:
        self.urgent = executor_spec(urgent, "urgent")
        self.background = executor_spec(background, "background")

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        urgent = await self.urgent.open(settings, opening)
        background = await self.background.open(settings, opening.with_fallback(urgent))
        if background is urgent:
            return urgent  # the background side fell back to the urgent workers
        return SplitExecutor(urgent, background)

    def __repr__(self) -> str:
        return f"Split({self.urgent!r}, {self.background!r})"


def executor_spec(value: object, name: str = "workers") -> ExecutorSpec:
    """``value`` as an executor spec: a count is ``LocalWorkers(count)``, ``None`` the default
    ``LocalWorkers()``. Raises ``TypeError`` naming ``name`` for anything else."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return LocalWorkers(value)
    if isinstance(value, ExecutorSpec) and not isinstance(value, type):
        return value
    raise TypeError(
        f"{name} must be a count of workers, None, or an executor spec "
        f"(acompile.LocalWorkers, acompile.RayFarm, acompile.Split), got {value!r}"
    )
