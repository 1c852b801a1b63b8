"""Inductor's remote caches on acompile's tiers.

Inductor builds each remote cache (``RemoteFxGraphCache`` and four more, all
``RedisRemoteCache`` with a JSON serde) over the backend class its ``backend_override_cls``
names, where one is set (Inductor's own tests use that seam; every release since 2.6 has it).
While served, each of the five gets a class of this module: reads and writes go to the active
``Served`` (the pool's tiers); in a pool worker, to a read-only view of the pool's disk tier.

A backend never raises: Inductor catches a failing read of most caches, but not a failing
write of the AOTAutograd and PGO caches, nor either of the autotune cache (the compile fails).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from torch._inductor.remote_cache import RemoteCacheBackend

from acompile._cache import make_key

logger = logging.getLogger("acompile")

# The five remote caches, by Inductor's class name, and what their entries are called here.
KINDS = {
    "RemoteFxGraphCache": "fx-graph",
    "RemoteAOTAutogradCache": "aot-autograd",
    "RemoteAutotuneCache": "autotune",
    "RemoteBundledAutotuneCache": "bundled-autotune",
    "RemoteDynamoPGOCache": "pgo",
}
# The entries' backend, in their header (``acompile cache stats`` counts them apart).
ENTRY_BACKEND = "torch"


class Store(Protocol):
    """Where a served backend reads and writes."""

    def cache_get(self, kind: str, inductor_key: str) -> bytes | None: ...

    def cache_put(self, kind: str, inductor_key: str, data: bytes) -> None: ...


_lock = threading.Lock()
_active: Store | None = None


def activate(store: Store | None) -> None:
    """Make ``store`` the one the parent's backends use (None: none; every read a miss)."""
    global _active
    with _lock:
        _active = store


def cache_parts(kind: str, inductor_key: str) -> dict[str, Any]:
    """What the entry key of a value Inductor stores under ``inductor_key`` in cache ``kind``
    is made of (recorded in the entry: ``acompile cache explain`` shows it)."""
    return {"torch-cache": kind, "key": inductor_key, "format": 1}


def cache_key(kind: str, inductor_key: str) -> str:
    """The entry key of a value Inductor stores under ``inductor_key`` in cache ``kind``."""
    return make_key(cache_parts(kind, inductor_key))


def backend_class(kind: str, store: Store | None = None) -> type[RemoteCacheBackend[bytes]]:
    """The backend class for cache ``kind``: over ``store``, or the active one at each call
    (instances outlive a ``serve()``: Inductor keeps the AOTAutograd cache's for the process)."""

    class ServedBackend(RemoteCacheBackend[bytes]):
        def _get(self, key: str) -> bytes | None:
            target = store if store is not None else _active
            if target is None:
                return None
            try:
                return target.cache_get(kind, key)
            except Exception as exc:  # never into torch.compile
                logger.debug("served %s cache read failed: %s", kind, exc)
                return None

        def _put(self, key: str, data: bytes) -> None:
            target = store if store is not None else _active
            if target is None:
                return
            try:
                target.cache_put(kind, key, data)
            except Exception as exc:  # never into torch.compile
                logger.debug("served %s cache write failed: %s", kind, exc)

    ServedBackend.__name__ = ServedBackend.__qualname__ = f"Acompile{kind.title().replace('-', '')}Backend"
    return ServedBackend


class _DiskReader:
    """A pool worker's view of Inductor's caches: the pool's disk tier, read-only."""

    def __init__(self, root: str) -> None:
        self.root = root

    def cache_get(self, kind: str, inductor_key: str) -> bytes | None:
        from acompile._cache import read_entry

        entry = read_entry(self.root, cache_key(kind, inductor_key))
        if entry is None or entry.backend != ENTRY_BACKEND or entry.name != kind:
            return None
        value = entry.blobs.get("value")
        return value if isinstance(value, bytes) else None

    def cache_put(self, kind: str, inductor_key: str, data: bytes) -> None:
        """Not here: the process that owns the pool writes (Inductor puts what its workers tuned
        from that process)."""


def disk_reader(root: str) -> Any:
    return _DiskReader(root)
