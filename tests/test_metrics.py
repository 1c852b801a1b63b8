"""A pool's live metrics and spans (``acompile.metrics``), and what a server gets from saying
it is ready (``mark_ready``): real Triton compiles for an explicit target, a real Prometheus
registry read back through the client library's own parser, OpenTelemetry's SDK in memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel

import acompile

pytestmark = pytest.mark.anyio

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import acompile.metrics  # noqa: E402


def scrape(registry: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of the registry's exposition, parsed as a scraper would: by sample name,
    then by its labels."""
    body, content_type = acompile.metrics.exposition(registry)
    assert content_type.startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def spec(block: int, kernel: Any = add_kernel) -> acompile.TritonSpec:
    return acompile.TritonSpec(kernel, ADD_SIG, {"BLOCK": block})


async def test_a_scrape_says_what_the_pool_did(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c") as pool:
        acompile.metrics.instrument(pool, registry=registry)
        await pool.compile(spec(128))  # a compile
        await pool.compile(spec(128))  # a memory hit
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c") as pool:
        registry2 = prometheus_client.CollectorRegistry()
        acompile.metrics.instrument(pool, registry=registry2)
        await pool.compile(spec(128))  # a disk hit
        seen2 = scrape(registry2)
    seen = scrape(registry)
    ok = (("backend", "triton"), ("result", "ok"))
    assert seen["acompile_compile_duration_seconds_count"][ok] == 1
    assert seen["acompile_queue_wait_seconds_count"][(("backend", "triton"),)] == 1
    requests = seen["acompile_cache_requests_total"]
    assert requests[(("result", "hit"), ("tier", "memory"))] == 1
    assert requests[(("result", "miss"), ("tier", "memory"))] == 1
    assert requests[(("result", "miss"), ("tier", "disk"))] == 1
    assert seen["acompile_compiles_total"][()] == 1
    assert seen["acompile_jobs_total"][(("result", "done"),)] == 1
    assert seen["acompile_pool_state"][(("state", "closed"),)] == 1
    compiled = (("backend", "triton"), ("outcome", "ok"), ("tier", "compile"))
    assert seen["acompile_request_duration_seconds_count"][compiled] == 1
    # The second process found it on the disk: bytes read there, no compile.
    assert seen2["acompile_cache_requests_total"][(("result", "hit"), ("tier", "disk"))] == 1
    assert seen2["acompile_cache_read_bytes_total"][(("tier", "disk"),)] > 1000
    assert seen2["acompile_compiles_total"][()] == 0
    assert (
        seen2["acompile_workers"][(("state", "down"),)] + seen2["acompile_workers"][(("state", "idle"),)] == 1
    )


async def test_a_memory_hit_costs_no_observer_call(tmp_path: Path) -> None:
    """The hot path stays a dictionary look-up: the listeners hear of misses and jobs only."""
    calls: list[str] = []

    class Counting:
        def capture(self) -> None:
            calls.append("capture")

        def request_done(self, event: Any) -> None:
            calls.append("request")

        def job_done(self, backend: str, job: Any) -> None:
            calls.append("job")

    class Failing:  # a listener's fault is never the request's
        def capture(self) -> None:
            raise RuntimeError("capture")

        def request_done(self, event: Any) -> None:
            raise RuntimeError("request_done")

        def job_done(self, backend: str, job: Any) -> None:
            raise RuntimeError("job_done")

    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c") as pool:
        pool._add_listener(Failing())
        pool._add_listener(Counting())
        await pool.compile(spec(128))
        assert calls == ["capture", "job", "request"]
        for _ in range(100):
            await pool.compile(spec(128))
        assert len(calls) == 3


async def test_one_registry_holds_one_pool(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with (
        acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "a") as a,
        acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "b") as b,
    ):
        made = acompile.metrics.instrument(a, registry=registry)
        assert acompile.metrics.instrument(a, registry=registry) is made
        with pytest.raises(ValueError, match="its own registry"):
            acompile.metrics.instrument(b, registry=registry)
        made.close()
        acompile.metrics.instrument(b, registry=registry)  # the first one's names are gone
        assert "acompile_pool_state" in scrape(registry)


async def test_compiles_after_ready_are_counted_named_and_may_be_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c") as pool:
        acompile.metrics.instrument(pool, registry=registry)
        await pool.compile(spec(128))  # the warm-up
        assert not pool.ready
        pool.mark_ready()
        assert pool.ready
        await pool.compile(spec(128))  # warm: not counted
        await pool.compile(spec(256))  # late: compiled, counted, named
        late = pool.stats()["after_ready"]
        assert late["compiles"] == 1 and late["by_backend"] == {"triton": 1} and late["refused"] == 0
        assert late["names"] == ["triton:add_kernel[BLOCK=256]"] and late["on_late"] == "warn"
        assert "compiling add_kernel[BLOCK=256] (triton) after the server said it was ready" in caplog.text
        pool.mark_ready(on_late="refuse")
        with pytest.raises(acompile.CompiledAfterReadyError, match="scale_add_kernel") as refused:
            await pool.compile(spec(64, scale_add_kernel))
        assert refused.value.kernel == "scale_add_kernel" and refused.value.backend == "triton"
        await pool.compile(spec(256))  # a cache hit is still served
        stats = pool.stats()
        assert stats["after_ready"]["compiles"] == 1 and stats["after_ready"]["refused"] == 1
        assert stats["after_ready"]["refused_by_backend"] == {"triton": 1}
        assert "refused to compile scale_add_kernel[BLOCK=64] (triton)" in caplog.text
        assert stats["failed"] == 0 and stats["compiled"] == 2  # a refusal is not a failure
        with pytest.raises(ValueError, match="on_late"):
            pool.mark_ready(on_late="maybe")  # type: ignore[arg-type]
    seen = scrape(registry)
    assert seen["acompile_compiles_after_ready_total"][(("backend", "triton"), ("library", ""))] == 1
    assert seen["acompile_refused_after_ready_total"][(("backend", "triton"), ("library", ""))] == 1
    assert seen["acompile_ready"][()] == 1


async def test_a_span_per_request_is_a_child_of_the_callers_span(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("the server")
    registry = prometheus_client.CollectorRegistry()
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c") as pool:
        acompile.metrics.instrument(pool, registry=registry, tracer_provider=provider)
        with tracer.start_as_current_span("handle request") as caller:
            kernel = await pool.compile(spec(128))
        await pool.compile(spec(128))  # a memory hit: no span
    spans = {s.name: s for s in exporter.get_finished_spans()}
    compile_span = spans["acompile.compile"]
    assert compile_span.parent is not None
    assert compile_span.parent.span_id == caller.get_span_context().span_id
    attributes = dict(compile_span.attributes or {})
    assert attributes["acompile.kernel"] == "add_kernel" and attributes["acompile.tier"] == "compile"
    assert attributes["acompile.key"] == kernel.key and attributes["acompile.outcome"] == "ok"
    assert attributes["acompile.worker_pid"] > 0
    for child in ("acompile.queue_wait", "acompile.worker_compile"):
        assert spans[child].parent.span_id == compile_span.context.span_id
        assert compile_span.start_time <= spans[child].start_time <= spans[child].end_time
    assert len([s for s in exporter.get_finished_spans() if s.name == "acompile.compile"]) == 1


def test_without_the_extra_there_is_no_metric_and_a_clear_error() -> None:
    code = (
        "import sys, json\n"
        "sys.modules['prometheus_client'] = None\n"
        "import acompile\n"
        "pool = acompile.CompilePool(1, target='cuda:90')\n"
        "try:\n"
        "    import acompile.metrics\n"
        "except acompile.BackendUnavailableError as exc:\n"
        "    print(json.dumps(str(exc)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), check=False
    )
    assert done.returncode == 0, done.stderr
    assert 'pip install \\"acompile[metrics]\\"' in done.stdout or "acompile[metrics]" in json.loads(
        done.stdout
    )


async def test_the_record_names_what_the_warm_up_missed(tmp_path: Path) -> None:
    """A kernel compiled after ready lands in the pool's record with a comment that says so: the
    next start's warm-up (``acompile warmup RECORD``) compiles it before the server is ready."""
    record = tmp_path / "served.toml"
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c", record=record) as pool:
        await pool.compile(spec(128))  # the warm-up
        pool.mark_ready()
        await pool.compile(spec(64, scale_add_kernel))  # missed by the warm-up
        pool.mark_ready(on_late="refuse")
        with pytest.raises(acompile.CompiledAfterReadyError):
            await pool.compile(spec(32, scale_add_kernel))  # refused: named for the next start
    text = record.read_text()
    entries = text.split("[[kernel]]")[1:]
    assert len(entries) == 3, text
    late = [e for e in entries if "asked for after the server said it was ready" in e]
    assert len(late) == 2 and all("scale_add_kernel" in e for e in late), text
    command = [
        sys.executable,
        "-m",
        "acompile.cli",
        "warmup",
        str(record),
        "--cache-dir",
        str(tmp_path / "next"),
    ]
    done = await anyio.run_process(command, check=False, env=subprocess_env())
    assert done.returncode == 0, done.stderr.decode()
    assert "3 kernels: 3 compiled" in done.stdout.decode(), done.stdout.decode()


async def test_every_metric_the_operators_page_lists_is_exported(tmp_path: Path) -> None:
    """docs/operators.md's table is what an operator builds dashboards from: each name it lists
    is in a scrape (a pool with a shared tier, a compile done), and nothing exported is missing
    from it."""
    import re

    from conftest import ROOT

    page = (ROOT / "docs" / "operators.md").read_text()
    table = page[page.index("| metric | type |") : page.index("Kernel names and keys are not labels")]
    listed = set(re.findall(r"`(acompile_[a-z_]+)`", table))
    registry = prometheus_client.CollectorRegistry()
    shared = acompile.SharedCache(f"file://{tmp_path / 'fleet'}", unsafe_trust_unsigned=True)
    (tmp_path / "fleet").mkdir()
    async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "c", shared_cache=shared) as pool:
        made = acompile.metrics.instrument(pool, registry=registry)
        await pool.compile(spec(128))
        pool.mark_ready()
        families = {
            f.name for f in text_string_to_metric_families(acompile.metrics.exposition(registry)[0].decode())
        }
        made.close()
    # The client names a counter's family without its _total, and adds a histogram's _created.
    exported = {
        name + "_total" if name + "_total" in listed else name
        for name in families
        if not name.endswith("_created")
    }
    assert listed == exported, (sorted(listed - exported), sorted(exported - listed))
