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
from pathlib import Path
from typing import Any, TypedDict

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
    shared_namespace: str | None
    # What the shared tier is kept in: "redis", "memcached", "s3", "gs", "az", "file" (several
    # joined by "+", each then in shared_tiers: its own counts and hits); None without one.
    shared_kind: str | None
    fleet_waits: int
    misses: int
    disk_corrupt: int
    stale: int
    disk_writes: int
    costs_from_fleet: int
    costs_published: int


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


__all__ = ["CacheStats", "JobStats", "Stats", "Tracer", "WorkerStats"]
