"""``RayFarm``: where a ``CompilePool`` sends its compile jobs when they should run on a cluster.

This module imports nothing of Ray: a ``RayFarm`` is a description (an address, a size, what each
worker reserves). Ray is imported by the farm's connection process (``_broker``), which a pool
that uses the farm starts when it is entered; never in the pool's own process.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from acompile._workers import Executor, Opening, WorkerSettings


class NodeStats(TypedDict):
    """One node of ``RayFarm.stats()["nodes"]``."""

    address: str
    workers: int
    busy: int
    done: int
    failed: int
    cancelled: int
    lost: int


class FarmStats(TypedDict):
    """What ``RayFarm.stats()`` returns."""

    address: str
    connected: bool
    size: int
    nodes: dict[str, NodeStats]
    refused: dict[str, str]
    restarts: dict[str, int]
    queued: int


@dataclass(frozen=True)
class Setup:
    """What a pool's farm connection process (``_broker``) is started with, its first frame."""

    # The cluster to connect to (the farm's address, or the program's own cluster's).
    address: str
    # The farm, as ``RayFarm(**farm)`` remakes it there.
    farm: dict[str, Any]
    # The pool's toolchain memo folder, and its sys.path.
    memo_dir: str
    sys_path: list[str]
    # How the farm's workers run: the pool's settings, whole.
    settings: WorkerSettings

    def __post_init__(self) -> None:
        from acompile._workers import WorkerSettings

        if not isinstance(self.settings, WorkerSettings):
            # The one type, whole: a dict of settings is a second shape for the same thing.
            raise TypeError(f"a farm's Setup carries a WorkerSettings, got {type(self.settings).__name__}")


class _FarmReporter(Protocol):
    """What ``RayFarm.stats()`` asks: the farm's executor (in the pool's process, its
    ``RemoteExecutor``; in the connection process, its ``FarmExecutor``)."""

    def farm_stats(self) -> FarmStats: ...


class RayFarm:
    """A Ray cluster to compile on: ``CompilePool(target=..., workers=RayFarm(address="auto"))``.

    With a farm, the pool's compile jobs run in long-lived Ray actors spread over the cluster's
    nodes, each one a preloaded acompile worker; results come back as bytes and land in the
    pool's cache tiers under the same keys as local compiles. See docs/farm.md.

    Args:
        address: the cluster, as ``ray.init(address=...)`` takes it: ``"host:6379"``,
            ``"ray://host:10001"``; ``"auto"``, by Ray's rule: ``RAY_ADDRESS`` if set (it wins
            over any address), else the cluster most recently started with ``ray start`` on
            this machine, whoever started it: on a shared host, give ``host:port``;
            ``"local"`` starts a Ray instance on this machine, which ends when the pool is left.
            Ignored when this process is connected to a cluster already (its own
            ``ray.init()``): the farm uses that one.
        workers: how many compile workers (actors); default: as many as the cluster's CPUs
            allow, at ``num_cpus`` each, counted when the pool is entered.
        num_cpus: CPUs each worker reserves on its node (one compile at a time runs on it).
        resources: Ray custom resources each worker reserves too (``{"compile": 1}`` confines
            the farm to the nodes that offer them).
        runtime_env: Ray's runtime environment for the farm's workers (``env_vars``,
            ``py_modules``, ``working_dir``): what a node needs to import a kernel's module when
            the kernel cannot travel as source.
        connect_timeout: seconds to reach the cluster when the pool is entered; past them
            ``FarmUnreachableError`` (Ray itself would retry for minutes).
        local_fallback: if the cluster cannot be reached when the pool is entered, or is lost
            while it serves (its head has not answered for 10 s), log one warning and compile
            on this machine's workers instead of raising ``FarmUnreachableError``.

    The pool's connection to Ray is held by a process of its own (see docs/farm.md): nothing of
    Ray runs in the pool's process, so a cluster that is lost cannot take it down.

    A farm serves one pool at a time; ``stats()`` describes its latest.
    """

    def __init__(
        self,
        address: str = "auto",
        *,
        workers: int | None = None,
        num_cpus: float = 1.0,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        connect_timeout: float = 20.0,
        local_fallback: bool = False,
    ) -> None:
        if not isinstance(address, str) or not address.strip():
            raise ValueError(
                f"address must be a Ray address such as 'host:6379', 'auto' or 'local', got {address!r}"
            )
        if resources is not None and (
            not isinstance(resources, Mapping)
            or not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in resources.items())
        ):
            raise ValueError(
                f"resources must map resource names to amounts, such as {{'compile': 1}}, got {resources!r}"
            )
        if not isinstance(local_fallback, bool):
            raise TypeError(f"local_fallback must be True or False, got {local_fallback!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
        if not num_cpus >= 0:
            raise ValueError(f"num_cpus must be a number of CPUs, got {num_cpus!r}")
        if not 0 < connect_timeout <= 30:
            raise ValueError(f"connect_timeout must be within (0, 30] seconds, got {connect_timeout!r}")
        self.address = address
        self.workers = workers
        self.num_cpus = float(num_cpus)
        self.resources = dict(resources or {})
        self.runtime_env = dict(runtime_env) if runtime_env is not None else None
        self.connect_timeout = float(connect_timeout)
        self.local_fallback = local_fallback
        self.executor: _FarmReporter | None = None

    def __repr__(self) -> str:
        return f"RayFarm(address={self.address!r}, workers={self.workers!r})"

    def description(self) -> dict[str, Any]:
        """The arguments this farm was made with, as ``RayFarm(**description)`` takes them (what
        the farm's connection process remakes it from)."""
        return {
            "address": self.address,
            "workers": self.workers,
            "num_cpus": self.num_cpus,
            "resources": self.resources,
            "runtime_env": self.runtime_env,
            "connect_timeout": self.connect_timeout,
            "local_fallback": self.local_fallback,
        }

    async def open(self, settings: WorkerSettings, opening: Opening) -> Executor:
        """The farm's executor for a pool being entered (``ExecutorSpec.open``): its connection
        process started and connected. Where the cluster cannot be reached and the farm allows
        it (``local_fallback``), local workers instead, after one warning. Raises
        ``FarmUnreachableError``, and ``BackendUnavailableError`` without Ray."""
        # By name: the farm's executor (``_remote``) sits above this description in the package,
        # and this module imports nothing of it.
        remote = importlib.import_module("acompile._farm._remote")
        executor: Executor = await remote.open_farm(self, settings, opening)
        return executor

    def stats(self) -> FarmStats:
        """The farm as its latest pool sees it: per node (by node id) its address, workers
        alive and busy, jobs done, failed, cancelled and lost (its worker died mid-job); the
        nodes refused (their toolchain differs) with why; worker restarts by cause; the queue."""
        if self.executor is not None:
            return self.executor.farm_stats()
        return {
            "address": self.address,
            "connected": False,
            "size": self.workers or 0,
            "nodes": {},
            "refused": {},
            "restarts": {},
            "queued": 0,
        }
