"""``TierChain``: the cache as one layer. The front end asks it one question per request.

::

    kernel = chain.loaded(key)                      # the memory tier: loaded kernels
    entry, tier = await chain.lookup(key)           # every byte tier, in order; None on a miss
    entry, tier = await chain.compile_once(key, compile)   # on a miss

The chain owns what used to be spread over the front end:

- **order**: memory (loaded kernels), then the local tier (the disk), then every further tier
  (the shared one) in the order given. A hit in a slower tier is written back, in the background,
  to the faster ones.
- **faults are misses**: a tier's ``get`` returns None or raises ``CorruptEntry``; every entry
  read is verified (checksum, key) once (the disk's on its reading thread, the others' here),
  and a damaged one is counted (``<tier>_corrupt``), warned about once, and compiled again; so
  is one the backend cannot load (``reject``). One the backend finds stale (``StaleEntry``:
  intact, but built from inputs the key does not hold that have changed since, such as the
  headers a C++ source includes) is a miss too, counted as ``stale``, not as damage.
- **single flight across replicas**: where a tier can hold leases (``LeaseTier``), a miss takes
  the key's lease before compiling, and renews it (it lasts seconds) until the entry is out; a
  replica that finds the lease taken polls for the entry up to ``fleet_wait``, then compiles
  itself, sooner where the lease goes away or stops being renewed.
- **publication**: a compiled entry is written to the local tier before the request returns
  (backends load files from it), and to the further tiers in the background (write-behind);
  the lease is released after. Write-behind runs in the task group handed to ``start()``, so
  nothing outlives the pool; ``drain()`` waits (bounded) for what is still on its way.
- **records**: small entries that are not kernels (autotuning choices), read and written
  through the same tiers with ``get_record`` / ``put_record``.

Adding a tier is one class that implements ``Tier`` (``_tier.py``), handed to the chain.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc

from acompile._cache import _entry
from acompile._cache._costs import CompileCosts
from acompile._cache._disk import GuardedDisk
from acompile._cache._entry import CorruptEntry, Entry
from acompile._cache._fleet import FleetTiers
from acompile._cache._memory import MemoryTier
from acompile._cache._tier import MAX_LEASE_TTL, LeaseTier, Tier
from acompile._errors import PoolClosedError

if TYPE_CHECKING:
    from acompile._observe import CacheStats

logger = logging.getLogger("acompile")

# Entries at least this large are verified (and records encoded) on a thread: hashing them would
# stall the loop (SHA-256 runs at about 1 GB/s: 256 KiB is some 0.25 ms). Verified all the same.
_VERIFY_INLINE_MAX = 256 * 1024

# How many polls a second all of a process's waits on other replicas may make, where the tier
# does not say (``polls_per_second``), and how often a lease is looked at when polls are spread.
_POLLS_PER_SECOND = 1000.0
_LEASE_LOOK = 2.0
# How much longer than fleet_wait a replica waits on another while its own workers are busy.
_BUSY_WAITS = 10

# What stats()["cache"] says of a tier that is not configured (CacheStats's keys).
_ABSENT: dict[str, Any] = {
    "hits_disk": 0,
    "hits_shared": 0,
    "disk_corrupt": 0,
    "disk_writes": 0,
    "shared_corrupt": 0,
    "shared_rejected": 0,
    "shared_errors": 0,
    "shared_writes": 0,
    "shared_write_failures": 0,
    "shared_skipped": 0,
    "shared_ignored_leases": 0,
    "shared_leases_taken_over": 0,
    "shared_available": None,
    "shared_problem": None,
    "shared_namespace": None,
    "shared_kind": None,
}


class StaleEntry(CorruptEntry):
    """An intact entry that is not what its request builds now: its compile read files that the
    key cannot hold (the headers a C++ or CUDA source includes) and one of them has changed.
    Raised by a backend's ``load``; the chain counts it as ``stale`` and compiles again, and
    the fresh entry replaces it, in every tier."""


class TierChain:
    """The cache tiers in order, with back-fill, write-behind, fleet leases and records.

    Args:
        memory: the front: loaded kernels (not bytes), filled by the front end after a load.
        local: the tier of this host (the cache folder): written before a compile returns, and
            the folder backends load files from and remember the toolchain in.
        more: further tiers, slower ones last (the shared tier); written in the background.
        fleet_wait: how long to wait for another replica that holds a key's lease.
        lease_ttl: how long a lease this replica takes lasts unless renewed (at most
            ``MAX_LEASE_TTL``, a few seconds). It is renewed every third of that while the
            compile runs or waits in the queue, however long: a holder that dies or stalls
            holds the others for this long at most, not for a compile's time limit.

    ``counts``: ``hits_<tier>`` (memory and each byte tier), ``misses``, ``fleet_waits``,
    ``<tier>_corrupt`` (damaged entries read), ``stale`` (entries built from other headers).
    Lifecycle: ``open()``, ``start(task_group)``, requests, ``drain(seconds)``, ``close()``.
    """

    def __init__(
        self,
        memory: MemoryTier,
        local: GuardedDisk,
        more: Sequence[Tier] = (),
        *,
        fleet_wait: float = 60.0,
        lease_ttl: float = MAX_LEASE_TTL,
        write_through: bool = False,
    ) -> None:
        self.memory = memory
        self.local = local
        self.tiers: list[Tier] = [local, *more]
        self.fleet_wait = fleet_wait
        self.lease_ttl = min(lease_ttl, MAX_LEASE_TTL)
        self.write_through = write_through
        self.counts: Counter[str] = Counter()
        # How long compiles took, kept in the cache folder: what the pool orders its queue by
        # (shared through the first shared tier of several).
        shared = self.tier("shared")
        self.costs = CompileCosts(local, shared.first if isinstance(shared, FleetTiers) else shared)
        # The first tier that can hold leases: single flight across the fleet goes through it.
        self._lease_tier: LeaseTier | None = next((t for t in self.tiers if isinstance(t, LeaseTier)), None)
        self._tg: anyio.abc.TaskGroup | None = None
        # Leases taken by claim() for work done outside the chain, by key: what stops renewing each.
        self._claims: dict[str, anyio.CancelScope] = {}
        self._accepting = False
        self._pending = 0
        self._writes_done = anyio.Event()
        # Waits on another replica's lease under way (their polls share the tier's budget).
        self._waiting = 0
        # Whether this replica's own jobs queue for its workers (set by the pool).
        self.busy: Callable[[], bool] = lambda: False

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The cache folder (the local tier's)."""
        return self.local.root

    @property
    def memo_dir(self) -> Path:
        """Where backends remember the toolchain's identity (see ``GuardedDisk.memo_dir``)."""
        return self.local.memo_dir

    def tier(self, name: str) -> Tier | None:
        """The byte tier of that name (``"disk"``, ``"shared"``), if the chain has one."""
        return next((t for t in self.tiers if t.name == name), None)

    async def open(self) -> None:
        """Open every tier, in order (a tier's faults leave it usable as misses)."""
        for tier in self.tiers:
            await tier.open()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Run write-behind work in ``tg`` from now on (the pool's task group)."""
        self._tg = tg
        self._accepting = True
        for tier in self.tiers:
            if isinstance(tier, FleetTiers):
                tier.attach(self._later)  # its copies back run as the chain's own writes do

    async def drain(self, seconds: float) -> None:
        """Take no more records, give back the leases ``claim()`` holds, and wait up to
        ``seconds`` (shielded) for write-behind work."""
        self._accepting = False
        for key in list(self._claims):
            self.release(key)
        if self._pending:
            with anyio.move_on_after(seconds, shield=True):
                while self._pending:
                    await self._writes_done.wait()

    async def close(self) -> None:
        """Close every tier, slowest first (shielded: clean-up; each tier bounds its own)."""
        self._accepting = False
        with anyio.CancelScope(shield=True):
            for tier in reversed(self.tiers):
                await tier.close()

    # -- requests --------------------------------------------------------------------------------

    def loaded(self, key: str) -> Any | None:
        """The loaded kernel from the memory tier (counted as a memory hit), or None."""
        kernel = self.memory.get(key)
        if kernel is not None:
            self.counts["hits_memory"] += 1
        return kernel

    def keep_loaded(self, key: str, kernel: Any) -> None:
        """Put a loaded kernel in the memory tier."""
        self.memory.set(key, kernel)

    async def lookup(self, key: str, *, after_local: bool = False) -> tuple[Entry | None, str]:
        """The verified entry from the first byte tier that has it, and that tier's name;
        ``(None, "")`` for a miss in every tier. Counted: ``hits_<tier>`` or ``misses``.
        ``after_local``: the tiers after the local one only (``lookup_local`` missed)."""
        entry, tier = await self._find(key, self.tiers[1:] if after_local else self.tiers)
        self.counts[f"hits_{tier}" if entry is not None else "misses"] += 1
        return entry, tier

    async def lookup_local(self, key: str) -> Entry | None:
        """The verified entry from the local tier (counted as its hit), or None: absent,
        damaged (counted and warned about, as ``lookup`` does) or too slow, and not counted as a
        miss: the caller goes on with ``lookup(key, after_local=True)``. A warm start's requests
        look here first, each in its own task, without a task of the pool's for each."""
        entry = await self._read(self.local, key)
        if entry is not None:
            self.counts[f"hits_{self.local.name}"] += 1
        return entry

    def reject(self, key: str, tier: str, exc: Exception) -> None:
        """An entry ``lookup`` found in ``tier`` that the backend cannot load (``exc``, a
        ``CorruptEntry``): counted as damaged (as ``stale`` for a ``StaleEntry``) and as a miss
        instead of a hit; the caller compiles it again with ``compile_once``, which replaces it."""
        self.counts[f"hits_{tier}"] -= 1
        self.counts["misses"] += 1
        if isinstance(exc, StaleEntry):
            # Routine (someone edited a header), not a fault: no warning.
            self.counts["stale"] += 1
            logger.debug("%s cache entry %s… is stale (%s); compiling it again", tier, key[:16], exc)
            return
        self._damaged(tier, key, exc)

    async def compile_once(
        self, key: str, compile: Callable[[], Awaitable[bytes]], *, fleet: bool = True
    ) -> tuple[Entry, str]:
        """After a miss: ``compile()`` (which returns the entry's bytes) unless another replica
        of the fleet already is compiling the key, then wait for its entry. Returns the entry
        and ``"compile"``, or where the replica's entry came from. ``fleet=False``: compile
        here whatever the fleet does (its entry could not be used here).

        A compiled entry is on the local tier when this returns, and on its way to the others;
        one taken from another replica reaches the local tier in the background.
        Raises what ``compile()`` raises (``CorruptEntry`` for bytes that are not an entry).
        """
        leases = self._lease_tier if fleet else None
        lease = None
        if leases is not None:
            life = self._life(leases)
            lease = await leases.take_lease(key, ttl=life)
            if lease is False:
                self.counts["fleet_waits"] += 1
                entry = await self._await_fleet(leases, key)
                if entry is not None:
                    return entry, leases.name
                lease = await leases.take_lease(key, ttl=life)
        # A job can wait in the queue (a storm, a paused pool) for longer than the lease lasts:
        # the lease is renewed while this replica has not published, so that the others keep
        # waiting for it instead of compiling the same kernel.
        renewing = anyio.CancelScope()
        if lease and leases is not None and self._tg is not None:
            self._tg.start_soon(self._keep_lease, leases, key, renewing)
        try:
            data = await compile()
            # The worker built it a moment ago: its checksum says nothing new.
            entry = _entry.decode(data, key, verify=False)
            await self.local.set(key, data)
        except BaseException:
            renewing.cancel()
            if lease and leases is not None:
                self._later(leases.release_lease, key)
            raise
        # Renewed until the entry is out (a large one takes a while): the others wait for it.
        publish = self._publication(key, data, release_lease=True, renewing=renewing)
        if len(self.tiers) == 1:
            renewing.cancel()  # no tier past the disk: nothing to publish, no lease
        elif self.write_through:
            await publish()  # the fleet has it (or said why not) before the request returns
        else:
            self._later(publish)
        return entry, "compile"

    async def _keep_lease(
        self, leases: LeaseTier, key: str, scope: anyio.CancelScope, ttl: float | None = None
    ) -> None:
        """Renew this replica's lease on key every third of its life (``ttl``, default the
        chain's), until scope is cancelled or the lease is another replica's. A fault of the
        tier (an outage, its back-off) is tried again at the next turn: a lease that expired
        meanwhile is taken again if nobody else took it."""
        life = ttl or self._life(leases)
        with scope:
            while True:
                await anyio.sleep(life / 3)
                if await leases.renew_lease(key, life) is False:
                    return

    def _life(self, leases: LeaseTier) -> float:
        """How long a lease lasts in ``leases`` unless renewed: ``lease_ttl``, scaled to the
        tier's longest (``max_lease_ttl``): an object store's leases last five times longer,
        each renewal being a billed request to a slower server."""
        longest = float(getattr(leases, "max_lease_ttl", MAX_LEASE_TTL))
        return self.lease_ttl * longest / MAX_LEASE_TTL

    async def claim(self, key: str) -> Entry | None:
        """Single flight across the fleet for work done outside the chain (torch.compile's
        graphs, which Inductor compiles between a miss and a ``put_record``).

        None: nobody else is doing it; this replica holds the key's lease (where a tier can hold
        one), renewed until ``put_record(key, ...)`` publishes it or ``release(key)`` gives it
        back, and for ``fleet_wait`` at most (a compile that never stores its result must not
        hold the others longer than they would wait anyway). Else the entry another replica
        published while this one waited (up to ``fleet_wait``; then None, and no lease).
        Faults of the tier are "nobody else": never raised."""
        leases = self._lease_tier
        if leases is None or key in self._claims:
            return None
        # Short and renewed: a holder that dies (its process killed mid-compile) holds the others
        # for this long at most, not for a compile's whole time limit.
        ttl = self._life(leases)
        lease = await leases.take_lease(key, ttl=ttl)
        if lease is False:
            self.counts["fleet_waits"] += 1
            entry = await self._await_fleet(leases, key)
            if entry is not None:
                return entry
            lease = await leases.take_lease(key, ttl=ttl)
        if lease and self._tg is not None and self._accepting:
            scope = anyio.CancelScope(deadline=anyio.current_time() + self.fleet_wait)
            self._claims[key] = scope
            self._tg.start_soon(self._keep_claim, leases, key, scope, ttl)
        return None

    async def _keep_claim(self, leases: LeaseTier, key: str, scope: anyio.CancelScope, ttl: float) -> None:
        await self._keep_lease(leases, key, scope, ttl)
        if self._claims.get(key) is scope:
            # Renewed for as long as it may be (fleet_wait), or another replica's now: let it go
            # (release_lease leaves a lease that is not this replica's alone).
            del self._claims[key]
            self._later(leases.release_lease, key)

    def release(self, key: str) -> None:
        """Give back the lease ``claim(key)`` took (no-op where it took none), in the background."""
        scope = self._claims.pop(key, None)
        if scope is None:
            return
        scope.cancel()
        if self._lease_tier is not None:
            self._later(self._lease_tier.release_lease, key)

    # -- records ---------------------------------------------------------------------------------

    async def spread(self, key: str) -> tuple[int, int]:
        """Make sure every tier after the local one holds the local entry ``key`` (a local hit
        never touches them): look it up in each, and write it where it is absent or damaged.
        Returns (how many tiers held it already, how many it was written to). The local copy is
        verified first (a damaged one is not spread to a fleet); faults count as neither, and
        are never raised. Used by warm-up jobs that fill a fleet's tier from a warm disk."""
        found = written = 0
        data: bytes | None = None
        for tier in self.tiers[1:]:
            if isinstance(tier, FleetTiers):  # several shared tiers: each must hold it
                f, w = await tier.spread(key, lambda: self._local_bytes(key))
                found, written = found + f, written + w
                continue
            try:
                if await tier.get(key) is not None:
                    found += 1
                    continue
            except CorruptEntry:
                pass  # a damaged copy there: the good one replaces it
            if data is None:
                data = await self._local_bytes(key)
                if data is None:
                    return found, written
            if await tier.set(key, data):
                written += 1
        return found, written

    async def _local_bytes(self, key: str) -> bytes | None:
        """The local entry ``key``'s bytes, verified whole on a thread; None where there is none
        or it is damaged (counted, as a read is)."""
        try:
            data = await self.local.get(key)
            if data is not None:
                await anyio.to_thread.run_sync(_entry.decode, data, key)
        except CorruptEntry as exc:
            self._damaged(self.local.name, key, exc)
            return None
        return data

    async def get_record(self, key: str) -> Entry | None:
        """A small record (not a kernel) from the byte tiers, in order: autotuning choices and
        similar decisions, reused by other processes and replicas. Not counted as a hit.
        Raises ``PoolClosedError`` outside the pool's life."""
        entry, _ = await self.find_record(key)
        return entry

    async def find_record(self, key: str) -> tuple[Entry | None, str]:
        """``get_record``, and the name of the tier it came from (``""`` for none)."""
        self._check_accepting()
        return await self._find(key, self.tiers)

    async def put_record(
        self, key: str, name: str, blobs: dict[str, bytes], meta: dict[str, Any], *, backend: str = "record"
    ) -> None:
        """Store a record under ``key``: on the local tier now, in the others in the
        background; a lease ``claim(key)`` holds is given back once they have it. Raises
        ``PoolClosedError`` outside the pool's life."""
        self._check_accepting()
        entry = Entry(key=key, backend=backend, name=name, blobs=blobs, meta=meta)
        # A record of megabytes (a JIT library's module, torch's Mega-Cache) is hashed as it is
        # encoded: on a thread, not the loop.
        big = sum(len(b) for b in blobs.values()) >= _VERIFY_INLINE_MAX
        data = await anyio.to_thread.run_sync(entry.encode) if big else entry.encode()
        await self.local.set(key, data)
        claimed = self._claims.pop(key, None)
        if claimed is not None:
            claimed.cancel()  # publish() below gives the lease back once the entry is out
        if len(self.tiers) > 1:
            self._later(self._publication(key, data, release_lease=claimed is not None))

    # -- stats -----------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """``stats()["cache"]``: hits by tier, misses, and what each tier did."""
        stats: dict[str, Any] = {
            **_ABSENT,
            "memory_entries": len(self.memory),
            "hits_memory": self.counts["hits_memory"],
            "fleet_waits": self.counts["fleet_waits"],
            "misses": self.counts["misses"],
            "stale": self.counts["stale"],
            # Compile times: the fleet's records taken in, and this pool's saves that reached it.
            "costs_from_fleet": self.costs.counts["shared_loaded"],
            "costs_published": self.costs.counts["shared_published"],
        }
        stats["bytes_read"] = {tier.name: self.counts[f"bytes_{tier.name}"] for tier in self.tiers}
        for tier in self.tiers:
            stats[f"hits_{tier.name}"] = self.counts[f"hits_{tier.name}"]
            stats[f"{tier.name}_corrupt"] = self.counts[f"{tier.name}_corrupt"]
            stats.update(tier.stats())
        return cast("CacheStats", stats)

    # -- inside ----------------------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise PoolClosedError("the pool is not running: records are read and stored inside it")

    async def _find(self, key: str, tiers: Sequence[Tier]) -> tuple[Entry | None, str]:
        for tier in tiers:
            entry = await self._read(tier, key)
            if entry is not None:
                return entry, tier.name
        return None, ""

    async def _read(self, tier: Tier, key: str) -> Entry | None:
        """The verified entry from one tier, or None; a hit is written back to faster tiers."""
        try:
            if tier is self.local:
                # Read and verified on a disk thread, in one hop; no tier is faster to back-fill.
                found = await self.local.get_entry(key)
                if found is not None:
                    blobs = found.blobs
                    self.counts[f"bytes_{tier.name}"] += (
                        blobs.nbytes() if isinstance(blobs, _entry.Blobs) else sum(map(len, blobs.values()))
                    )
                return found
            data = await tier.get(key)
            if data is None:
                return None
            self.counts[f"bytes_{tier.name}"] += len(data)
            if len(data) < _VERIFY_INLINE_MAX:
                entry = _entry.decode(data, key)
            else:
                entry = await anyio.to_thread.run_sync(_entry.decode, data, key)
        except CorruptEntry as exc:
            # Not deleted: another process may be publishing a good copy right now, and the
            # fresh compile replaces this one atomically anyway.
            self._damaged(tier.name, key, exc)
            return None
        # Kept in the faster tiers for the next process, in the background: the caller has what
        # it needs.
        for faster in self.tiers[: self.tiers.index(tier)]:
            self._later(faster.set, key, data)
        return entry

    def _damaged(self, tier: str, key: str, exc: Exception) -> None:
        counter = f"{tier}_corrupt"
        level = logging.DEBUG if self.counts[counter] else logging.WARNING
        self.counts[counter] += 1
        logger.log(level, "%s cache entry %s… is damaged (%s); compiling it again", tier, key[:16], exc)

    async def _await_fleet(self, leases: LeaseTier, key: str) -> Entry | None:
        """Another replica holds the lease: poll for its entry, up to fleet_wait, or until the
        lease is gone without an entry (it failed, or died and the lease expired).

        The polls of all this process's waits together stay within the tier's
        ``polls_per_second`` (Redis: a thousand; an object store: a few dozen, each request
        billed and a small server answering a few hundred a second): a boot that waits on
        thousands of keys at once polls each less often, not the store harder. The lease is
        looked at with each poll while few wait, and every ``_LEASE_LOOK`` seconds otherwise
        (its holder rewrites it every two).

        ``fleet_wait`` counts the time this replica would have had a worker free for the key:
        while its own jobs queue (``busy()``), a storm in which every replica is busy, the wait
        goes on, up to ``_BUSY_WAITS`` times ``fleet_wait``; a replica that gave up then would
        only add a second compile of the key to a machine that has no CPU to spare."""
        started = last = looked = anyio.current_time()
        deadline = started + self.fleet_wait
        longest = started + self.fleet_wait * _BUSY_WAITS
        budget = float(getattr(leases, "polls_per_second", _POLLS_PER_SECOND))
        delay = 0.05
        self._waiting += 1
        try:
            while anyio.current_time() < deadline:
                spread = self._waiting / budget
                await anyio.sleep(max(delay, spread))
                delay = min(delay * 1.5, 0.5)
                now = anyio.current_time()
                if self.busy():
                    # This replica's own jobs queue for its workers: compiling the key here would
                    # queue too. Waiting costs it nothing, so it does not count against fleet_wait
                    # (up to _BUSY_WAITS times fleet_wait in all).
                    deadline = min(deadline + (now - last), longest)
                last = now
                entry = await self._read(leases, key)
                if entry is not None:
                    return entry
                if spread < _LEASE_LOOK or anyio.current_time() - looked >= _LEASE_LOOK:
                    looked = anyio.current_time()
                    if not await leases.lease_held(key):
                        return await self._read(leases, key)
        finally:
            self._waiting -= 1
        logger.warning(
            "waited %.0f s for another replica to compile %s…; compiling it here", self.fleet_wait, key[:16]
        )
        return None

    def _publication(
        self, key: str, data: bytes, *, release_lease: bool, renewing: anyio.CancelScope | None = None
    ) -> Callable[[], Awaitable[None]]:
        """What writes to the tiers past the local one, then stops renewing the lease
        (``renewing``) and releases it (after the entry is there: a replica that sees the lease
        go finds the entry): run in the background, or awaited (write-through)."""
        further = self.tiers[1:]
        leases = self._lease_tier if release_lease else None

        async def publish() -> None:
            try:
                for tier in further:
                    await tier.set(key, data)
            finally:
                if renewing is not None:
                    renewing.cancel()
            if leases is not None:
                await leases.release_lease(key)

        return publish

    def write_behind(self, work: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``work(*args)`` in the background, as the chain's own writes run (in the pool's
        task group, waited for by ``drain()``): for what else belongs in the cache folder."""
        self._later(work, *args)

    def _later(self, work: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Write-behind work: a task of the pool, so nothing outlives it; ``drain()`` waits
        for these before the pool stops anything."""
        if self._tg is None:
            # Before start() (or a chain used without a pool): nothing to run it in.
            logger.debug("cache write-behind dropped: the chain is not started")
            return

        async def run() -> None:
            try:
                await work(*args)
            finally:
                self._pending -= 1
                if self._pending == 0:
                    self._writes_done.set()
                    self._writes_done = anyio.Event()

        self._pending += 1
        self._tg.start_soon(run)
