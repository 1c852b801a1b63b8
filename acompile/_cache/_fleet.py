"""``FleetTiers``: several shared tiers as the one tier named ``shared`` (Redis in front of an object
store, say), with a policy the user sets on ``SharedCache``.

- **order**: the tiers as listed, fastest first; a read asks each in turn until one has it.
- **copy back**: a hit in a later tier is written, in the background, to the earlier ones
  (``copy_back=True``, the default), so that the next replica finds it in the fast tier. The
  disk and memory tiers are filled from any hit anyway (the chain does that).
- **skipping**: an entry over a tier's ``?max_value=`` skips that tier (a Redis kept for small
  entries) and goes to the next: a policy, counted as ``skipped_by_size``, not as a failure,
  where a later tier takes it.
- **writes**: every tier of the list, in order, in the background (``write="behind"``, the
  default), or before the request that compiled the entry returns (``write="through"``: a
  warm-up job that must know the fleet has it, a replica about to be stopped).
- **leases**: taken in the first tier that holds them and answers (Redis before an object store:
  one round trip). A replica's lease is renewed and given back in the tier it was taken in.

``stats()`` keeps the names of a single shared tier (``shared_errors``, ``shared_rejected``,
...: summed over the tiers; ``shared_writes`` and ``shared_write_failures``: entries, each
counted once, that every tier took, or that one or more did not) and adds ``shared_tiers``:
each tier's own counts and its hits, by kind (``{"redis": {...}, "s3": {...}}``), so that a hit
is known by the tier it came from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread

from acompile._cache._entry import CorruptEntry, decode
from acompile._cache._shared import SharedTier

WRITE_MODES = ("behind", "through")


class FleetTiers:
    """Shared tiers in order, as one (see the module's docstring)."""

    name = "shared"

    def __init__(self, tiers: Sequence[SharedTier], *, copy_back: bool = True) -> None:
        if not tiers:
            raise ValueError("FleetTiers needs at least one tier")
        self.tiers = list(tiers)
        self.copy_back = copy_back
        self.counts: Counter[str] = Counter()
        self._later: Callable[..., None] | None = None
        # Where each lease this replica holds was taken: its renewals and release go there.
        self._lease_in: dict[str, SharedTier] = {}
        self._names = _names(self.tiers)

    @property
    def first(self) -> SharedTier:
        """The first (fastest) tier: the one the fleet's documents (compile times) live in."""
        return self.tiers[0]

    @property
    def max_lease_ttl(self) -> float:
        """The shortest tier's: the chain renews for the tier that holds each lease."""
        return min(t.max_lease_ttl for t in self.tiers)

    @property
    def polls_per_second(self) -> float:
        """The slowest tier's (a look-up asks each tier in turn)."""
        return min(t.polls_per_second for t in self.tiers)

    def attach(self, later: Callable[..., None]) -> None:
        """How to run work in the background (the chain's write-behind): copies back."""
        self._later = later

    async def open(self) -> None:
        """Open every tier at once: a stalled one delays the pool's entry by its own bound, not
        by the sum of theirs. A tier that cannot work raises (``ValueError``), as alone."""
        problems: list[BaseException] = []

        async def open_one(tier: SharedTier) -> None:
            try:
                await tier.open()
            except ValueError as exc:
                problems.append(exc)

        async with anyio.create_task_group() as tg:
            for tier in self.tiers:
                tg.start_soon(open_one, tier)
        if problems:
            raise problems[0]

    async def get(self, key: str) -> bytes | None:
        for index, tier in enumerate(self.tiers):
            data = await tier.get(key)
            if data is None:
                continue
            self.counts[f"hits_{self._names[index]}"] += 1
            if self.copy_back and index and self._later is not None:
                for faster in self.tiers[:index]:
                    if not faster.too_large(data):
                        self._later(faster.set, key, data)
            return data
        return None

    async def set(self, key: str, data: bytes) -> bool:
        """Publish to every tier (but those the entry skips for its size); True where each took
        it. Counted once for the chain (``writes`` or ``write_failures``), and by each tier."""
        stored = True
        for index, tier in enumerate(self.tiers):
            if tier.too_large(data) and index + 1 < len(self.tiers):
                tier.counts["skipped_by_size"] += 1  # the next tier takes it: a policy, not a fault
                continue
            stored = await tier.set(key, data) and stored
        self.counts["writes" if stored else "write_failures"] += 1
        return stored

    async def spread(self, key: str, local: Callable[[], Awaitable[bytes | None]]) -> tuple[int, int]:
        """Make every tier hold ``key`` (a warm-up filling the fleet from a warm disk): (1, 0)
        where each held it already, (0, 1) where each holds it now, some written, (0, 0) where
        one could not take it (a fault). ``local()`` gives the entry's verified bytes (or None).
        A tier that the entry skips for its size (another follows) is not asked."""
        data: bytes | None = None
        held: bytes | None = None  # a copy one of the tiers holds (verified before it is spread)
        lacking = []
        for index, tier in enumerate(self.tiers):
            try:
                found = await tier.get(key)
            except CorruptEntry:
                found = None  # a damaged copy there: the good one replaces it
            if found is None:
                lacking.append(index)
            elif held is None:
                held = found
        wrote = False
        for index in lacking:
            tier = self.tiers[index]
            last = index + 1 == len(self.tiers)
            if data is None:
                data = await local()
                if data is None and held is not None:
                    try:
                        await anyio.to_thread.run_sync(decode, held, key)
                        data = held
                    except CorruptEntry:
                        pass
                if data is None:
                    return 0, 0
            if tier.too_large(data) and not last:
                tier.counts["skipped_by_size"] += 1
                continue
            if not await tier.set(key, data):
                self.counts["write_failures"] += 1
                return 0, 0
            wrote = True
        if wrote:
            self.counts["writes"] += 1
        return (0, 1) if wrote else (1, 0)

    async def delete(self, key: str) -> None:
        for tier in self.tiers:
            await tier.delete(key)

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()

    def stats(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        per_tier: dict[str, Any] = {}
        for index, tier in enumerate(self.tiers):
            own = tier.stats()
            for name, value in own.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    merged[name] = merged.get(name, 0) + value
            per_tier[self._names[index]] = {
                **{k.removeprefix("shared_"): v for k, v in own.items()},
                "hits": self.counts[f"hits_{self._names[index]}"],
                "skipped_by_size": tier.counts["skipped_by_size"],
            }
        # Entries the chain took (every tier that should), and those one tier or more did not.
        merged["shared_writes"] = self.counts["writes"]
        merged["shared_write_failures"] = self.counts["write_failures"]
        merged["shared_available"] = all(t.available for t in self.tiers)
        problems = [f"{self._names[i]}: {t.problem}" for i, t in enumerate(self.tiers) if t.problem]
        merged["shared_problem"] = "; ".join(problems) or None
        merged["shared_namespace"] = self.first.namespace
        merged["shared_kind"] = "+".join(self._names)
        merged["shared_tiers"] = per_tier
        return merged

    # -- leases: in the first tier that holds them and answers ---------------------------------

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        for tier in self.tiers:
            answer = await tier.take_lease(key, ttl)
            if answer is not None:
                if answer:
                    self._lease_in[key] = tier
                return answer
        return None

    async def renew_lease(self, key: str, ttl: float) -> bool | None:
        tier = self._lease_in.get(key)
        if tier is None:
            return await self.take_lease(key, ttl)
        answer = await tier.renew_lease(key, ttl)
        if answer is False:
            self._lease_in.pop(key, None)
        return answer

    async def release_lease(self, key: str) -> None:
        tier = self._lease_in.pop(key, None)
        if tier is not None:
            await tier.release_lease(key)

    async def lease_held(self, key: str) -> bool:
        for tier in self.tiers:
            if await tier.lease_held(key):
                return True
        return False


def _names(tiers: Sequence[SharedTier]) -> list[str]:
    """Each tier's name in stats: its kind; a second of one kind is ``<kind>-2``, and so on."""
    kinds = [t.kind for t in tiers]
    seen: Counter[str] = Counter()
    names = []
    for kind in kinds:
        seen[kind] += 1
        names.append(kind if seen[kind] == 1 else f"{kind}-{seen[kind]}")
    return names
