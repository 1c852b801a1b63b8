"""The cache tiers and keys.

``TierChain`` (``_chain.py``) is the cache as one layer: memory (loaded kernels), then the disk,
then a shared tier, with back-fill, write-behind, fleet leases and records. Every tier it holds
implements ``Tier`` (``_tier.py``): ``get/set/delete/close`` over bytes, faults as misses.

- ``_disk``: ``DiskTier``, the folder's files (atomic publication, daemon threads), and
  ``GuardedDisk``, the same with every fault a miss and deadlines (the chain's disk tier);
- ``_shared``: ``SharedTier``, over an aiocache cache (signed entries, namespaces, leases);
- ``_memory``: ``MemoryTier``, a bounded LRU of loaded kernels;
- ``_entry``: the bytes of one entry; ``_keys``: cache keys.
"""

from __future__ import annotations

import typing as _typing

from acompile import _lazy

# In a pool's worker process, the names below are imported at the first one used (see
# acompile._lazy); everywhere else, with the package.
if _typing.TYPE_CHECKING or _lazy.eager(__name__):
    from acompile._cache._chain import TierChain
    from acompile._cache._disk import DiskTier, GuardedDisk, default_cache_dir, read_entry
    from acompile._cache._entry import CorruptEntry, Entry
    from acompile._cache._keys import make_key
    from acompile._cache._memory import MemoryTier
    from acompile._cache._tier import LeaseTier, Tier
else:
    __getattr__ = _lazy.on_first_use(__name__)

__all__ = [
    "CorruptEntry",
    "DiskTier",
    "Entry",
    "GuardedDisk",
    "LeaseTier",
    "MemoryTier",
    "Tier",
    "TierChain",
    "default_cache_dir",
    "make_key",
    "read_entry",
]
