"""A pool's live metrics (Prometheus) and a span per compile job (OpenTelemetry).

    pip install "acompile[metrics]"

    async with acompile.CompilePool() as pool:
        acompile.metrics.instrument(pool)          # on prometheus_client's default registry
        ...
        body, content_type = acompile.metrics.exposition()   # what GET /metrics answers

``instrument`` adds, on a ``prometheus_client`` registry:

- what ``pool.stats()`` holds, read when the registry is scraped (nothing on the requests' path):
  cache requests by tier and result, bytes read by tier, jobs queued and running, workers by
  state, worker restarts by cause (``crash`` is a worker that died), retries, the shared tier's
  errors and whether it is available, fleet waits, compiles after the server said it was ready
  (by backend and library), readiness;
- three histograms, observed as a job or a request ends (a memory hit never reaches them): the
  compile's duration on its worker by backend and result, its wait in the queue, and a request's
  whole time by backend, tier and outcome.

With OpenTelemetry's API installed (``opentelemetry-api``, part of the extra), each request that
misses the memory tier is a span (``acompile.compile``, a child of the caller's span as the
request began) with the kernel, its key, the tier that answered, the worker and the outcome; a
compile on a worker has child spans for its queue wait and its run. Without an SDK configured
the API is a no-op, as OpenTelemetry intends.

Names follow Prometheus's conventions: a ``acompile_`` prefix, base units (seconds, bytes),
``_total`` on counters, labels of few values (no kernel names, no keys: those are in the spans).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from acompile._errors import BackendUnavailableError
from acompile._observe import RequestDone

_EXTRA = 'the pool\'s metrics need prometheus-client: pip install "acompile[metrics]"'

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised where the extra is absent
    raise BackendUnavailableError(_EXTRA) from exc

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
except ImportError:  # spans are optional: metrics alone without OpenTelemetry's API
    otel_context = None  # type: ignore[assignment]
    otel_trace = None  # type: ignore[assignment]

# A compile's duration on its worker: from a cache-sized C++ file (50 ms) to a tuned GEMM (minutes).
COMPILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A job's wait for a worker: nothing on an idle pool, a storm's length on a busy one.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# A request that missed memory: a disk hit (under a millisecond) to a compile.
REQUEST_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)

# Why a worker is replaced (``stats()["workers"]["restarts"]``'s keys).
RESTART_CAUSES = ("crash", "killed", "memory", "timeout", "abandoned", "stopped")

# By registry (its id; the entry holds the registry, so the id stays its own until close()).
_instrumented: dict[int, Instrumentation] = {}
_lock = threading.Lock()


def _result(job: Any) -> str:
    """A job's result as a label: ok, error (the compiler refused it), timeout, crashed,
    cancelled, or other (the pool's fault)."""
    if job.error is None:
        return "ok" if job.state == "done" else "cancelled"
    name = type(job.error).__name__
    return {
        "CompileTimeoutError": "timeout",
        "WorkerCrashedError": "crashed",
        "JobCancelled": "cancelled",
    }.get(name, "error" if "CompileError" in name or name == "CompileError" else "other")


class _StatsCollector(Collector):
    """What ``pool.stats()`` says, as metric families, read at each scrape."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        stats = self.pool.stats()
        cache = stats["cache"]
        workers = stats["workers"]
        jobs = stats["jobs"]
        shared = cache.get("shared_available") is not None

        state = GaugeMetricFamily(
            "acompile_pool_state", "The pool's state (1 for the current one).", labels=["state"]
        )
        for name in ("new", "running", "closed"):
            state.add_metric([name], 1.0 if stats["state"] == name else 0.0)
        yield state

        requests = CounterMetricFamily(
            "acompile_cache_requests",
            "Cache look-ups by tier and result (a request that missed memory asked the disk, and so on).",
            labels=["tier", "result"],
        )
        hits = {"memory": cache["hits_memory"], "disk": cache["hits_disk"], "shared": cache["hits_shared"]}
        tiers = ["memory", "disk"] + (["shared"] if shared else [])
        later = cache["misses"]
        for tier in reversed(tiers):  # a tier's misses are the hits of those after it, and misses
            requests.add_metric([tier, "miss"], float(later))
            requests.add_metric([tier, "hit"], float(hits[tier]))
            later += hits[tier]
        yield requests

        read = CounterMetricFamily(
            "acompile_cache_read_bytes", "Bytes of entries read by tier.", labels=["tier"]
        )
        for tier, nbytes in cache.get("bytes_read", {}).items():
            read.add_metric([tier], float(nbytes))
        yield read

        yield GaugeMetricFamily(
            "acompile_cache_memory_entries", "Kernels the memory tier holds.", value=cache["memory_entries"]
        )
        yield GaugeMetricFamily(
            "acompile_jobs_queued", "Compile jobs waiting for a worker.", value=jobs["queued"]
        )
        yield GaugeMetricFamily(
            "acompile_jobs_running", "Compile jobs on a worker now.", value=jobs["running"]
        )
        ended = CounterMetricFamily("acompile_jobs", "Compile jobs ended, by result.", labels=["result"])
        for result in ("done", "failed", "cancelled"):
            ended.add_metric([result], float(jobs[result]))
        yield ended
        yield CounterMetricFamily(
            "acompile_job_retries", "Jobs run again after their worker died.", value=jobs["retried"]
        )

        by_state = GaugeMetricFamily("acompile_workers", "Worker processes by state.", labels=["state"])
        alive, busy = workers["alive"], workers["busy"]
        by_state.add_metric(["busy"], float(busy))
        by_state.add_metric(["idle"], float(max(0, alive - busy)))
        by_state.add_metric(["down"], float(max(0, workers["size"] - alive)))
        yield by_state
        yield GaugeMetricFamily(
            "acompile_workers_awake", "1 unless the pool is quiesced.", value=1.0 if workers["awake"] else 0.0
        )
        restarts = CounterMetricFamily(
            "acompile_worker_restarts",
            "Workers replaced, by cause (crash: it died; memory, timeout: stopped by a limit).",
            labels=["cause"],
        )
        # Every cause from the start (0 until it happens): an alert on one matches a series.
        for cause, count in sorted({**dict.fromkeys(RESTART_CAUSES, 0), **workers["restarts"]}.items()):
            restarts.add_metric([cause], float(count))
        yield restarts

        yield CounterMetricFamily(
            "acompile_compiles", "Kernels compiled by this pool.", value=stats["compiled"]
        )
        yield CounterMetricFamily(
            "acompile_compile_failures", "Requests whose compile failed.", value=stats["failed"]
        )
        yield CounterMetricFamily(
            "acompile_fleet_waits",
            "Waits for another replica's compile of the same kernel.",
            value=cache["fleet_waits"],
        )
        if shared:
            errors = CounterMetricFamily(
                "acompile_shared_errors",
                "The shared tier's faults by kind (error: no answer in time or a failed call).",
                labels=["kind"],
            )
            for kind, field in (
                ("error", "shared_errors"),
                ("write_failure", "shared_write_failures"),
                ("corrupt", "shared_corrupt"),
                ("rejected", "shared_rejected"),
            ):
                errors.add_metric([kind], float(cache.get(field, 0)))
            yield errors
            yield GaugeMetricFamily(
                "acompile_shared_available",
                "1 while the shared tier answers; 0 while it is off (an outage, or it cannot work).",
                value=1.0 if cache["shared_available"] else 0.0,
            )

        after = stats["after_ready"]
        yield GaugeMetricFamily(
            "acompile_ready", "1 once the server said it was ready.", value=1.0 if after["ready"] else 0.0
        )
        yield _by_backend(
            "acompile_compiles_after_ready",
            "Compiles after the server said it was ready (its serving KPI: 0), by backend and library.",
            after["by_backend"],
        )
        yield _by_backend(
            "acompile_refused_after_ready",
            "Compiles refused after the server said it was ready (on_late='refuse'), by backend and library.",
            after["refused_by_backend"],
        )


def _by_backend(name: str, documentation: str, counts: dict[str, int]) -> Metric:
    """A counter family of ``counts`` keyed "backend" or "backend:library", as two labels."""
    family = CounterMetricFamily(name, documentation, labels=["backend", "library"])
    for key, count in sorted(counts.items()):
        backend, _, library = key.partition(":")
        family.add_metric([backend, library], float(count))
    return family


class Instrumentation:
    """A pool's metrics on one registry (``instrument``'s result); ``close()`` removes them."""

    def __init__(self, pool: Any, registry: CollectorRegistry, tracer_provider: Any = None) -> None:
        self.pool = pool
        self.registry = registry
        self._collector = _StatsCollector(pool)
        self.compile_seconds = prometheus_client.Histogram(
            "acompile_compile_duration_seconds",
            "A compile job's time on its worker, by backend and result.",
            ["backend", "result"],
            registry=None,
            buckets=COMPILE_BUCKETS,
        )
        self.wait_seconds = prometheus_client.Histogram(
            "acompile_queue_wait_seconds",
            "A compile job's wait for a worker, by backend.",
            ["backend"],
            registry=None,
            buckets=WAIT_BUCKETS,
        )
        self.request_seconds = prometheus_client.Histogram(
            "acompile_request_duration_seconds",
            "A request that missed the memory tier, whole, by backend, the tier that answered and outcome.",
            ["backend", "tier", "outcome"],
            registry=None,
            buckets=REQUEST_BUCKETS,
        )
        self._histograms = (self.compile_seconds, self.wait_seconds, self.request_seconds)
        self._tracer = None
        if otel_trace is not None:
            from acompile._version import __version__

            self._tracer = otel_trace.get_tracer("acompile", __version__, tracer_provider=tracer_provider)
        for collector in (self._collector, *self._histograms):
            registry.register(collector)
        pool._add_listener(self)

    def close(self) -> None:
        """Stop observing the pool, and remove its metrics from the registry."""
        self.pool._remove_listener(self)
        for collector in (self._collector, *self._histograms):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass
        with _lock:
            if _instrumented.get(id(self.registry)) is self:
                del _instrumented[id(self.registry)]

    # -- the pool's listener ------------------------------------------------------------------------

    def capture(self) -> Any:
        return otel_context.get_current() if self._tracer is not None else None

    def job_done(self, backend: str, job: Any) -> None:
        if job.started_at:
            self.wait_seconds.labels(backend).observe(max(0.0, job.started_at - job.queued_at))
            # A job stopped on its worker (its caller left) has no end of its own: now is its end.
            ended = job.ended_at or time.perf_counter()
            self.compile_seconds.labels(backend, _result(job)).observe(max(0.0, ended - job.started_at))
        if self._tracer is not None and backend in (
            "torch",
            "jit",
        ):  # no request of the pool's: a span of its own
            end = time.time_ns()
            start = end - int(max(0.0, time.perf_counter() - job.queued_at) * 1e9)
            span = self._tracer.start_span(
                "acompile.compile",
                start_time=start,
                attributes={
                    "acompile.kernel": job.name,
                    "acompile.backend": backend,
                    "acompile.tier": "compile",
                    "acompile.outcome": _result(job),
                    **({"acompile.worker_pid": job.worker_pid} if job.worker_pid else {}),
                },
            )
            self._job_spans(span, job, end)
            self._end(span, job.error, end)

    def request_done(self, event: RequestDone) -> None:
        self.request_seconds.labels(event.backend, event.tier or "none", event.outcome).observe(
            max(0.0, event.end - event.start)
        )
        if self._tracer is None:
            return
        end = time.time_ns() - int(max(0.0, time.perf_counter() - event.end) * 1e9)
        start = end - int(max(0.0, event.end - event.start) * 1e9)
        attributes: dict[str, Any] = {
            "acompile.kernel": event.name,
            "acompile.key": event.key,
            "acompile.backend": event.backend,
            "acompile.tier": event.tier,
            "acompile.outcome": event.outcome,
        }
        job = event.job
        if job is not None and job.worker_pid:
            attributes["acompile.worker_pid"] = job.worker_pid
        span = self._tracer.start_span(
            "acompile.compile", context=event.captured, start_time=start, attributes=attributes
        )
        if job is not None:
            self._job_spans(span, job, end)
        error = None if event.error is None else f"{event.error}"
        self._end(span, error, end)

    def _job_spans(self, span: Any, job: Any, end: int) -> None:
        """The job's queue wait and its run on its worker, as children of ``span``."""
        if not job.started_at or self._tracer is None:
            return
        # perf_counter times as the wall clock's, from one reading of both.
        now_ns, now = time.time_ns(), time.perf_counter()

        def ns(t: float) -> int:
            return now_ns - int((now - t) * 1e9)

        parent = otel_trace.set_span_in_context(span)
        wait = self._tracer.start_span("acompile.queue_wait", context=parent, start_time=ns(job.queued_at))
        wait.end(end_time=ns(job.started_at))
        run = self._tracer.start_span(
            "acompile.worker_compile",
            context=parent,
            start_time=ns(job.started_at),
            attributes={"acompile.worker_pid": job.worker_pid or 0},
        )
        run.end(end_time=ns(job.ended_at) if job.ended_at else end)

    def _end(self, span: Any, error: Any, end: int) -> None:
        if error is not None:
            span.set_status(
                otel_trace.Status(
                    otel_trace.StatusCode.ERROR,
                    str(type(error).__name__ if not isinstance(error, str) else error),
                )
            )
        span.end(end_time=end)


def instrument(
    pool: Any, *, registry: CollectorRegistry | None = None, tracer_provider: Any = None
) -> Instrumentation:
    """Export ``pool``'s metrics on ``registry`` (default: prometheus_client's global one) and
    its spans through ``tracer_provider`` (default: OpenTelemetry's global one). Call it once
    the pool is built (entered or not); one pool per registry (give another pool its own
    ``CollectorRegistry``). Returns the ``Instrumentation``, whose ``close()`` undoes it: call
    it when the pool is done with (``acompile.asgi`` does), or the registry and the pool's
    listener stay."""
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _lock:
        held = _instrumented.get(id(registry))
        if held is not None:
            if held.pool is pool:
                return held
            raise ValueError(
                "this registry already holds another pool's metrics: give each pool its own "
                "registry (prometheus_client.CollectorRegistry()), or close() the other's"
            )
        made = Instrumentation(pool, registry, tracer_provider)
        _instrumented[id(registry)] = made
        return made


def exposition(registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The registry's metrics in Prometheus's text format, and its content type: what a
    ``GET /metrics`` route answers."""
    registry = prometheus_client.REGISTRY if registry is None else registry
    return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST


__all__ = [
    "COMPILE_BUCKETS",
    "REQUEST_BUCKETS",
    "WAIT_BUCKETS",
    "Instrumentation",
    "exposition",
    "instrument",
]
