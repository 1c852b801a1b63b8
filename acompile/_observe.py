"""What the pool tells about its work: a trace of every request, and the shape of its stats.

The record of what it served (a warm-up manifest) is written by ``_manifest.Recorder``.

- ``Tracer`` collects Chrome trace events (the JSON that ui.perfetto.dev and chrome://tracing
  open): one span per request on the requesting side, with its queue wait, its compile on the
  worker's own track and its load, and the tier that answered, as arguments.
- ``Stats`` (with ``WorkerStats``, ``JobStats``, ``CacheStats``) is the shape of
  ``CompilePool.stats()``, for type checkers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

from acompile import _files

logger = logging.getLogger("acompile")

_ORIGIN = time.perf_counter()


class WorkerStats(TypedDict):
    """``stats()["workers"]``: the worker processes."""

    size: int
    alive: int
    busy: int
    awake: bool
    started: int
    forked: int
    restarts: dict[str, int]
    rss_mib: dict[int, float]
    mean_rss_mib: float | None


class JobStats(TypedDict):
    """``stats()["jobs"]``: compile jobs given to workers."""

    queued: int
    running: int
    done: int
    failed: int
    cancelled: int
    retried: int


class _SeveralSharedTiers(TypedDict, total=False):
    # Each shared tier's own counts and hits, by kind, where there are several.
    shared_tiers: dict[str, dict[str, Any]]


class CacheStats(_SeveralSharedTiers):
    """``stats()["cache"]``: hits by tier, and what the disk and shared tiers did."""

    memory_entries: int
    hits_memory: int
    hits_disk: int
    hits_shared: int
    shared_corrupt: int
    shared_rejected: int
    shared_errors: int
    shared_writes: int
    shared_write_failures: int
    shared_skipped: int
    shared_ignored_leases: int
    # Leases of dead holders (or planted ones) replaced by this replica's: object stores, folders.
    shared_leases_taken_over: int
    shared_available: bool | None
    # Why the shared tier is off (what its server said, or that it did not answer), else None.
    shared_problem: str | None
    shared_namespace: str | None
    # What the shared tier is kept in: "redis", "memcached", "s3", "gs", "az", "file" (several
    # joined by "+", each then in shared_tiers: its own counts and hits); None without one.
    shared_kind: str | None
    fleet_waits: int
    # Bytes of entries read from each tier after memory ("disk", "shared"), hits only.
    bytes_read: dict[str, int]
    misses: int
    disk_corrupt: int
    stale: int
    disk_writes: int
    costs_from_fleet: int
    costs_published: int


class AfterReadyStats(TypedDict):
    """``stats()["after_ready"]``: what was compiled after the server said it was ready."""

    ready: bool
    on_late: str | None
    # Compiles started after ready (each kernel variant, module or graph; one whose client then
    # hung up included), by "backend" or "backend:library" ("triton", "torch", "jit:flashinfer").
    compiles: int
    by_backend: dict[str, int]
    # Requests refused instead (on_late="refuse"), by the same names.
    refused: int
    refused_by_backend: dict[str, int]
    # The latest variants named ("triton:add_kernel[BLOCK=128]"; at most _LATE_NAMES), oldest first.
    names: list[str]


class Stats(TypedDict):
    """What ``CompilePool.stats()`` returns (see its docstring for each field)."""

    state: str
    target: str | None
    workers: WorkerStats
    jobs: JobStats
    cache: CacheStats
    compiled: int
    failed: int
    compile_seconds: dict[str, float]
    slowest: list[list[str | float]]
    after_ready: AfterReadyStats


# How many names of compiles after ready the stats keep (the latest).
_LATE_NAMES = 100
LATE_MODES = ("warn", "refuse")


class AfterReady:
    """The server's "ready" and what was compiled after it (``CompilePool.mark_ready``).

    Called from the pool's loop (its requests, torch.compile's jobs) and from a JIT library's
    thread (its builds): every method takes the lock."""

    def __init__(self) -> None:
        self.ready_at: float | None = None
        self.on_late: str | None = None
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.names: list[str] = []
        self._said: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def mark(self, on_late: str) -> None:
        if on_late not in LATE_MODES:
            raise ValueError(f"on_late must be 'warn' or 'refuse', got {on_late!r}")
        with self._lock:
            if self.ready_at is None:
                self.ready_at = time.monotonic()
            self.on_late = on_late

    def refuses(self) -> bool:
        return self.ready_at is not None and self.on_late == "refuse"

    def note(self, backend: str, name: str, *, say: bool = True, refused: bool = False) -> bool:
        """A compile of ``name`` (a kernel's variant, a module; by ``backend``: "triton",
        "torch", "jit:<library>") is about to start, or is ``refused``: counted, and named once
        in a warning, where the server said it was ready. True where it was after ready."""
        if self.ready_at is None:
            return False
        with self._lock:
            (self.refused if refused else self.counts)[backend] += 1
            self.names.append(f"{backend}:{name}")
            del self.names[:-_LATE_NAMES]
            first = (backend, name) not in self._said
            self._said.add((backend, name))
        if first and say:
            if refused:
                logger.warning(
                    "acompile: refused to compile %s (%s) after the server said it was ready "
                    "(on_late='refuse'); the pool's record, where it keeps one, names it for the "
                    "next warm-up",
                    name,
                    backend,
                )
            else:
                logger.warning(
                    "acompile: compiling %s (%s) after the server said it was ready: the warm-up missed it",
                    name,
                    backend,
                )
        return True

    def stats(self) -> AfterReadyStats:
        with self._lock:
            return {
                "ready": self.ready_at is not None,
                "on_late": self.on_late,
                "compiles": sum(self.counts.values()),
                "by_backend": dict(self.counts),
                "refused": sum(self.refused.values()),
                "refused_by_backend": dict(self.refused),
                "names": list(self.names),
            }


@dataclass
class RequestDone:
    """A request of the pool's that did not come from the memory tier, as it ended."""

    backend: str  # "triton", "cuda", "cpp"
    name: str
    key: str
    tier: str  # "disk", "shared", "compile"; "" where it failed before any answered
    outcome: str  # "ok", "error", "cancelled"
    error: str | None  # the error's class name
    start: float  # perf_counter
    end: float
    job: Any  # its compile job where it compiled here, else None
    nbytes: int  # the entry's bytes read from ``tier`` (0 for a compile)
    captured: Any  # what the listener's capture() returned in the caller's task


class Listener(Protocol):
    """What a pool tells an observer (``acompile.metrics``): a listener's methods run on the
    pool's loop and must return at once."""

    def capture(self) -> Any:
        """Called in the caller's task as a request misses the memory tier (its tracing
        context, say); handed back in ``RequestDone.captured``."""

    def request_done(self, event: RequestDone) -> None: ...

    def job_done(self, backend: str, job: Any) -> None:
        """A job on the executor ended (done, failed, cancelled): ``job.state``, ``job.error``,
        ``job.queued_at``, ``started_at``, ``ended_at``, ``worker_pid``."""


def _us(t: float) -> float:
    return round((t - _ORIGIN) * 1e6, 1)


class Tracer:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._pid = os.getpid()
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()

    def _tid(self, track: str) -> int:
        tid = self._tracks.get(track)
        if tid is None:
            tid = self._tracks[track] = len(self._tracks) + 1
            self.events.append(
                {"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": track}}
            )
        return tid

    def span(
        self, name: str, track: str, start: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        with self._lock:
            self.events.append(
                {
                    "name": name,
                    "cat": "acompile",
                    "ph": "X",
                    "ts": _us(start),
                    "dur": max(0.0, round((end - start) * 1e6, 1)),
                    "pid": self._pid,
                    "tid": self._tid(track),
                    "args": args or {},
                }
            )

    def request(
        self, request: Any, tier: str, start: float, end: float, job: Any, load: tuple[float, float]
    ) -> None:
        args = {
            "kernel": request.name,
            "key": request.key,
            "tier": tier,
            **_request_args(request),
        }
        self.span(f"{request.name} ({tier})", "requests", start, end, args)
        if job is not None and job.started_at:
            self.span(
                "queue wait",
                "requests",
                job.queued_at,
                job.started_at,
                {"kernel": request.name, "key": request.key},
            )
            worker = f"worker pid {job.worker_pid}"
            self.span(
                request.name,
                worker,
                job.started_at,
                job.ended_at or end,
                {**args, "worker_pid": job.worker_pid},
            )
        self.span("load", "requests", load[0], load[1], {"kernel": request.name})

    def job(self, job: Any, start: float, end: float) -> None:
        """A job run for torch.compile (no request of this pool's): its wait and its run."""
        args = {"kernel": job.name, "job": job.id}
        self.span(f"{job.name} (torch.compile)", "requests", start, end, args)
        if job.started_at:
            self.span("queue wait", "requests", job.queued_at, job.started_at, args)
            worker = f"worker pid {job.worker_pid}"
            self.span(
                job.name, worker, job.started_at, job.ended_at or end, {**args, "worker_pid": job.worker_pid}
            )

    def document(self) -> dict[str, Any]:
        return {
            "traceEvents": list(self.events),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "acompile"},
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _files.write_whole(path, json.dumps(self.document()).encode())


def _request_args(request: Any) -> dict[str, Any]:
    payload = getattr(request, "payload", {}) or {}
    out: dict[str, Any] = {}
    for name in ("constexprs", "options", "target", "output", "arch"):
        if name in payload:
            out[name] = _plain(payload[name])
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


__all__ = [
    "AfterReady",
    "AfterReadyStats",
    "CacheStats",
    "JobStats",
    "Listener",
    "RequestDone",
    "Stats",
    "Tracer",
    "WorkerStats",
]
