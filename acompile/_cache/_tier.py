"""What a cache tier is: ``get/set/delete/close`` over bytes, plus a name.

A tier stores entries (``_entry``'s bytes) by cache key and knows nothing of kernels or of the
other tiers; ``TierChain`` puts tiers in order. The contract every tier keeps:

- **faults are misses**: ``get`` returns None for an absent entry *and* for one it cannot read
  (a hung filesystem, a server away); ``set``, ``delete`` and ``close`` never raise for the
  tier's own faults. Only the caller's cancellation propagates. A ``get`` may raise
  ``CorruptEntry`` for an entry that is there but damaged (the chain counts it, warns once,
  and treats it as a miss); it verifies nothing else: the chain checks every entry it reads.
- ``open`` runs once, before any other call, and never raises for the tier's sake.
- ``counts`` holds what the tier did, by name (for ``stats()``); ``stats`` says which of them
  appear in ``stats()["cache"]`` and under which names.

A tier that can also hold a fleet-wide lease (single flight across replicas) implements
``LeaseTier`` as well. A lease says that its holder is alive and compiling: it lasts seconds
(``MAX_LEASE_TTL`` at most), and its holder renews it every third of its life until it publishes,
so that a holder that dies, stalls or loses the tier stops holding anyone up within seconds, however
long its compile may run. Adding a tier is one module with a class like these, handed to the chain.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, runtime_checkable

# The longest a lease lasts without a renewal, in seconds. A replica waits on another's lease only
# while its holder keeps renewing it: a lease that claims to last longer is not honoured, and a
# lease whose value has not changed for this long is taken for a dead (or replayed) one.
MAX_LEASE_TTL = 6.0


@runtime_checkable
class Tier(Protocol):
    """A cache tier over bytes (see the module's docstring for the contract)."""

    name: str
    counts: Counter[str]

    async def open(self) -> None:
        """Prepare the tier (create a folder, connect a client); faults leave it usable as misses."""

    async def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None for a miss. May raise ``CorruptEntry`` for a damaged one."""

    async def set(self, key: str, data: bytes) -> bool:
        """Store an entry; True where it was stored. A fault is logged and counted, never raised."""

    async def delete(self, key: str) -> None:
        """Remove an entry where the tier holds one."""

    async def close(self) -> None:
        """Release what ``open`` took (shielded by the caller; bounded by the tier)."""

    def stats(self) -> dict[str, Any]:
        """This tier's part of ``stats()["cache"]`` (keys of ``CacheStats``)."""


@runtime_checkable
class LeaseTier(Tier, Protocol):
    """A tier a fleet of replicas shares, that can also hold a lease per key with a TTL."""

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        """True: ours to compile; False: another replica compiles it; None: no single flight.
        ``ttl`` is at most ``MAX_LEASE_TTL``: the holder renews the lease to keep it."""

    async def renew_lease(self, key: str, ttl: float) -> bool | None:
        """Extend this replica's lease on ``key`` to ``ttl`` from now: True, renewed; False, it
        is not this replica's (stop renewing); None, the tier could not say (try again)."""

    async def release_lease(self, key: str) -> None:
        """Give back this replica's lease on ``key`` (no-op where it holds none)."""

    async def lease_held(self, key: str) -> bool:
        """Whether another replica holds a lease on ``key`` that is to be honoured."""
