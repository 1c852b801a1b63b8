"""What the pool tells about its work: a trace of every request, and a record of what it served.

- ``Tracer`` collects Chrome trace events (the JSON that ui.perfetto.dev and chrome://tracing
  open): one span per request on the requesting side, with its queue wait, its compile on the
  worker's own track and its load, and the tier that answered, as arguments.
- ``Stats`` (with ``WorkerStats``, ``JobStats``, ``CacheStats``) is the shape of
  ``CompilePool.stats()``, for type checkers.
- ``Recorder`` appends every kernel request the pool served to a warm-up manifest (TOML, the
  format ``acompile warmup`` reads), once per distinct request, across runs: replaying it on the
  next deploy compiles what production used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

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


class CacheStats(TypedDict):
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
    shared_available: bool | None
    shared_namespace: str | None
    fleet_waits: int
    misses: int
    disk_corrupt: int
    disk_writes: int


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

    def document(self) -> dict[str, Any]:
        return {
            "traceEvents": list(self.events),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "acompile"},
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.document()))
        os.replace(tmp, path)


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


# --- the warm-up record ----------------------------------------------------------------------------

_KEY_LINE = re.compile(r"^# key: ([0-9a-f]{64})$", re.MULTILINE)


class Recorder:
    """Appends served Triton requests to a manifest; blocking (the pool calls it from a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: set[str] | None = None

    def _known(self) -> set[str]:
        if self._seen is None:
            try:
                self._seen = set(_KEY_LINE.findall(self.path.read_text()))
            except FileNotFoundError:
                self._seen = set()
        return self._seen

    def add(self, request: Any, spec: Any) -> bool:
        """Record one request (once per key); False if it cannot be written as a manifest entry."""
        with self._lock:
            if request.key in self._known():
                return False
            text = _manifest_entry(request, spec)
            if text is None:
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                if f.tell() == 0:
                    f.write(
                        "# Kernels served by an acompile pool; replay with `acompile warmup <this file>`.\n"
                    )
                f.write(text)
            self._known().add(request.key)
            return True


def _toml(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        items = [_toml(v) for v in value]
        return None if any(i is None for i in items) else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, dict):
        pairs: list[str] = []
        for k, v in value.items():
            text = _toml(v)
            if text is None:
                return None
            pairs.append(f"{json.dumps(str(k))} = {text}")
        return "{ " + ", ".join(pairs) + " }"
    return None


def _manifest_entry(request: Any, spec: Any) -> str | None:
    fn = request.fn
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__", "__mp_main__") or module.startswith("acompile_source_"):
        file = getattr(getattr(fn, "fn", None), "__code__", None)
        if file is None or not os.path.isfile(file.co_filename):
            logger.debug("cannot record %s: it is not defined in a file", request.name)
            return None
        where = f"{os.path.abspath(file.co_filename)}:{fn.__name__}"
    else:
        where = f"{module}:{fn.__qualname__}"
    runtime = {k: v for k, v in request.signature.items() if v != "constexpr"}
    fields = {
        "kernel": where,
        "signature": runtime,
        "constexprs": dict(spec.constexprs or {}),
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "targets": [str(request.target)],
    }
    if spec.options:
        fields["options"] = dict(spec.options)
    lines = [f"\n[[kernel]]\n# key: {request.key}\n"]
    for name, value in fields.items():
        text = _toml(value)
        if text is None:
            logger.debug("cannot record %s: %s is not plain data", request.name, name)
            return None
        lines.append(f"{name} = {text}\n")
    return "".join(lines)


__all__ = ["CacheStats", "JobStats", "Recorder", "Stats", "Tracer", "WorkerStats"]
