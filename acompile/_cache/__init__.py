"""The cache tiers and keys.

``TierChain`` (``_chain.py``) is the cache as one layer: memory (loaded kernels), then the disk,
then a shared tier, with back-fill, write-behind, fleet leases and records. Every tier it holds
implements ``Tier`` (``_tier.py``): ``get/set/delete/close`` over bytes, faults as misses.

- ``_disk``: ``DiskTier``, the folder's files (atomic publication, daemon threads), and
  ``GuardedDisk``, the same with every fault a miss and deadlines (the chain's disk tier);
- ``_shared``: ``SharedTier``, over an aiocache cache, an object store or a shared folder
  (signed entries, namespaces, leases); ``_stores``: the object store (obstore) and the shared
  folder as that tier's storage; ``_fleet``: ``FleetTiers``, several shared tiers as one;
- ``_settings``: ``SharedCache``, the shared tier as the user gives it (where, key, trust);
- ``_memory``: ``MemoryTier``, a bounded LRU of loaded kernels;
- ``_entry``: the bytes of one entry; ``_keys``: cache keys;
- ``_layout``: the cache folder's layout, spelled once, and how its files are read and written;
- ``_costs``: the cost model (compile times by key);
- ``_bundle``, ``_prune``, ``_explain``: bundles, pruning and key explanations, each apart.

Outside this package, these names come from here, never from the modules above.
"""

from __future__ import annotations

import typing as _typing

from acompile import _lazy

# Each name, by the module it lives in (and its name there where it differs); see acompile._lazy.
_NAMES: dict[str, str | tuple[str, str]] = {
    "BUNDLE_MANIFEST": ("_bundle", "MANIFEST_NAME"),
    "BundleReport": "_bundle",
    "export_bundle": "_bundle",
    "import_bundle": "_bundle",
    "StaleEntry": "_chain",
    "TierChain": "_chain",
    "COSTS_FILE": "_costs",
    "COSTS_LOCK_FILE": ("_costs", "LOCK_FILE"),
    "COSTS_MAX_BYTES": ("_costs", "MAX_FILE_BYTES"),
    "COSTS_MAX_RECORDS": ("_costs", "MAX_RECORDS"),
    "CompileCosts": "_costs",
    "CostFeatures": "_costs",
    "DiskTier": "_disk",
    "FleetTiers": "_fleet",
    "GuardedDisk": "_disk",
    "default_cache_dir": "_disk",
    "read_entry": "_disk",
    "Blobs": "_entry",
    "CorruptEntry": "_entry",
    "Entry": "_entry",
    "blob_isascii": "_entry",
    "blob_view": "_entry",
    "decode_entry": ("_entry", "decode"),
    "ABSENT": "_explain",
    "FACTORS": "_explain",
    "describe_factor": "_explain",
    "explain": "_explain",
    "explain_key": "_explain",
    "explain_miss": "_explain",
    "read_header": "_explain",
    "make_key": "_keys",
    "MAX_MEMO_BYTES": "_layout",
    "entries_dir": "_layout",
    "human_bytes": "_layout",
    "is_key": "_layout",
    "lib_path": "_layout",
    "logs_dir": "_layout",
    "read_state": "_layout",
    "toolchain_dir": "_layout",
    "write_state": "_layout",
    "MemoryTier": "_memory",
    "PruneReport": "_prune",
    "parse_age": "_prune",
    "prune": "_prune",
    "DEFAULT_FLEET_WAIT": "_settings",
    "SharedCache": "_settings",
    "shared_cache_argument": "_settings",
    "with_shared_cache_fields": "_settings",
    "SharedTier": "_shared",
    "is_store_url": "_shared",
    "prune_storage": "_stores",
    "open_storage": "_stores",
    "StoreError": "_stores",
    "check_target": "_shared",
    "open_shared_cache": ("_shared", "open_cache"),
    "redact_url": "_shared",
    "signing_key_id": ("_shared", "key_id"),
    "signing_key_from": "_shared",
    "LeaseTier": "_tier",
    "Tier": "_tier",
}
if _typing.TYPE_CHECKING:
    from acompile._cache._bundle import MANIFEST_NAME as BUNDLE_MANIFEST
    from acompile._cache._bundle import BundleReport, export_bundle, import_bundle
    from acompile._cache._chain import StaleEntry, TierChain
    from acompile._cache._costs import COSTS_FILE, CompileCosts, CostFeatures
    from acompile._cache._costs import LOCK_FILE as COSTS_LOCK_FILE
    from acompile._cache._costs import MAX_FILE_BYTES as COSTS_MAX_BYTES
    from acompile._cache._costs import MAX_RECORDS as COSTS_MAX_RECORDS
    from acompile._cache._disk import DiskTier, GuardedDisk, default_cache_dir, read_entry
    from acompile._cache._entry import Blobs, CorruptEntry, Entry, blob_isascii, blob_view
    from acompile._cache._entry import decode as decode_entry
    from acompile._cache._explain import (
        ABSENT,
        FACTORS,
        describe_factor,
        explain,
        explain_key,
        explain_miss,
        read_header,
    )
    from acompile._cache._fleet import FleetTiers
    from acompile._cache._keys import make_key
    from acompile._cache._layout import (
        MAX_MEMO_BYTES,
        entries_dir,
        human_bytes,
        is_key,
        lib_path,
        logs_dir,
        read_state,
        toolchain_dir,
        write_state,
    )
    from acompile._cache._memory import MemoryTier
    from acompile._cache._prune import PruneReport, parse_age, prune
    from acompile._cache._settings import (
        DEFAULT_FLEET_WAIT,
        SharedCache,
        shared_cache_argument,
        with_shared_cache_fields,
    )
    from acompile._cache._shared import SharedTier, check_target, is_store_url, redact_url, signing_key_from
    from acompile._cache._shared import key_id as signing_key_id
    from acompile._cache._shared import open_cache as open_shared_cache
    from acompile._cache._stores import StoreError, open_storage, prune_storage
    from acompile._cache._tier import LeaseTier, Tier
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=True)

__all__ = [
    "ABSENT",
    "BUNDLE_MANIFEST",
    "COSTS_FILE",
    "COSTS_LOCK_FILE",
    "COSTS_MAX_BYTES",
    "COSTS_MAX_RECORDS",
    "DEFAULT_FLEET_WAIT",
    "FACTORS",
    "MAX_MEMO_BYTES",
    "Blobs",
    "BundleReport",
    "CompileCosts",
    "CorruptEntry",
    "CostFeatures",
    "DiskTier",
    "Entry",
    "FleetTiers",
    "GuardedDisk",
    "LeaseTier",
    "MemoryTier",
    "PruneReport",
    "SharedCache",
    "SharedTier",
    "StaleEntry",
    "StoreError",
    "Tier",
    "TierChain",
    "blob_isascii",
    "blob_view",
    "check_target",
    "decode_entry",
    "default_cache_dir",
    "describe_factor",
    "entries_dir",
    "explain",
    "explain_key",
    "explain_miss",
    "export_bundle",
    "human_bytes",
    "import_bundle",
    "is_key",
    "is_store_url",
    "lib_path",
    "logs_dir",
    "make_key",
    "open_shared_cache",
    "open_storage",
    "parse_age",
    "prune",
    "prune_storage",
    "read_entry",
    "read_header",
    "read_state",
    "redact_url",
    "shared_cache_argument",
    "signing_key_from",
    "signing_key_id",
    "toolchain_dir",
    "with_shared_cache_fields",
    "write_state",
]
