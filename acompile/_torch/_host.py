"""What a running ``CompilePool`` lends the served torch.compile: built by the pool
(``CompilePool.torch_host``), so that nothing here reaches into the pool's insides."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acompile._cache import Entry
    from acompile._torch._portal import Portal
    from acompile._workers import Job


@dataclass(frozen=True)
class TorchHost:
    """A running pool's parts, as the served code uses them (every coroutine function runs on
    the pool's loop: through ``portal`` from torch's threads).

    Attributes:
        portal: the way in from torch's threads.
        find: ``find(key) -> (entry or None, tier name)``: the byte tiers, in order (disk, then
            shared), every entry verified.
        store: ``store(key, name, blobs, meta, backend=...)``: on disk now, on the further
            tiers in the background; gives back a lease ``claim`` took.
        claim: ``claim(key) -> entry or None``: fleet single flight (see ``TierChain.claim``).
        release: ``release(key)``: give back a claim's lease (call on the loop).
        run: ``run(job)``: a job on the pool's executor (traced), its result or error.
        wait_ready: the pool's ``wait_ready``.
        size: how many workers the pool runs.
        shared: whether the pool has a shared tier; ``trusted``: whether code that runs on this
            host may be loaded from it (it is signed, or its owner trusts it unsigned: entries
            of an unsigned shared tier may have been written by anyone who can reach it).
        cache_root: the pool's cache folder (its workers read the disk tier's entries there).
        fleet_wait: how long ``claim`` may wait for another replica.
        record: ``record(key, library, fields)``: add a JIT library's module to the pool's
            warm-up record (blocking; a record that cannot be written is the pool's to say), or
            None where the pool keeps no record.
        late: ``late(backend, name, say=...)``: a compile about to start after the server said
            it was ready: counted, or refused (raises ``CompiledAfterReadyError``); any thread.
        is_ready: whether the server said it was ready (``CompilePool.mark_ready``).
        host_pool: whether the jobs run on the host's pool, shared by its processes.
    """

    portal: Portal
    find: Callable[[str], Awaitable[tuple[Entry | None, str]]]
    store: Callable[..., Awaitable[None]]
    claim: Callable[[str], Awaitable[Entry | None]]
    release: Callable[[str], None]
    run: Callable[[Job], Awaitable[Any]]
    wait_ready: Callable[[], Awaitable[None]]
    size: int
    shared: bool
    trusted: bool
    cache_root: Path
    fleet_wait: float
    record: Callable[[str, str, dict[str, Any]], None] | None = None
    late: Callable[..., None] | None = None
    is_ready: Callable[[], bool] | None = None
    host_pool: bool = False
