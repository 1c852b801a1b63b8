"""acompile.asgi in the app's own process: what a request awaiting the pool does when its client
hangs up or the server stops, the signal handlers, and the lifespan's warm-up and routes.

The example server (tests/test_example_server.py) runs the same module under uvicorn with a real
client; these tests drive it through the ASGI interface, without a server.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import TARGET, asyncio_only, run_python
from kernels_for_tests import add_kernel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

import acompile
import acompile.asgi
from acompile.asgi import ClientGone, Serving, ShuttingDown, run_unless_gone

pytestmark = pytest.mark.anyio

ADD_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


def _request(state: dict[str, Any] | None = None) -> tuple[Request, Callable[[], None]]:
    """A POST with a small JSON body, and what makes its client hang up."""
    hung_up = anyio.Event()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b'{"n": 1}', "more_body": False}
        await hung_up.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/compile",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
        "state": state if state is not None else {},
    }
    return Request(scope, receive), hung_up.set


class _Work:
    """An await that lasts until cancelled, and says whether it was."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.cancelled = False

    async def forever(self) -> str:
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        return "never"


def test_importing_acompile_leaves_the_asgi_module_and_starlette_out() -> None:
    out = run_python(
        "import sys, acompile\nprint(sorted(m for m in sys.modules if m.startswith(('starlette', 'acompile.asgi'))))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_starlette_the_import_error_names_the_extra() -> None:
    code = (
        "import sys\nsys.modules['starlette'] = None\n"
        "try:\n    import acompile.asgi\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "acompile.asgi needs Starlette" in out.stdout and "acompile[server]" in out.stdout, out.stdout


async def test_a_client_that_hangs_up_cancels_the_await() -> None:
    request, hang_up = _request()
    work = _Work()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def hang_up_once_started() -> None:
                await work.started.wait()
                hang_up()

            tg.start_soon(hang_up_once_started)
            with pytest.raises(ClientGone, match="closed the connection"):
                await run_unless_gone(request, work.forever())
    assert work.cancelled
    # The body was read first, and is still there for the handler.
    assert await request.json() == {"n": 1}


async def test_a_server_that_stops_cancels_the_await_and_an_answer_or_an_error_goes_through() -> None:
    server = Serving(None)  # type: ignore[arg-type]  # no pool needed to stop requests
    request, _ = _request({acompile.asgi.STATE_KEY: server})
    work = _Work()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def stop_once_started() -> None:
                await work.started.wait()
                server.stop()

            tg.start_soon(stop_once_started)
            with pytest.raises(ShuttingDown, match="the server is shutting down"):
                await run_unless_gone(request, work.forever())
    assert work.cancelled and server.stopping

    async def answer() -> int:
        return 42

    async def fails() -> None:
        raise ValueError("no")

    fresh, _ = _request({acompile.asgi.STATE_KEY: Serving(None)})  # type: ignore[arg-type]
    assert await run_unless_gone(fresh, answer()) == 42
    fresh, _ = _request()
    # Raised as it is, not wrapped in an ExceptionGroup.
    with pytest.raises(ValueError, match="no"):
        await run_unless_gone(fresh, fails())

    # Once the server is stopping, the work does not start (and is closed, not left unawaited).
    late, _ = _request({acompile.asgi.STATE_KEY: server})
    coroutine = answer()
    with pytest.raises(ShuttingDown):
        await run_unless_gone(late, coroutine)
    assert coroutine.cr_frame is None


async def test_cancellable_answers_499_to_a_hang_up_and_503_on_shutdown() -> None:
    work = _Work()

    @acompile.asgi.cancellable
    async def endpoint(request: Request) -> Any:
        assert await request.json() == {"n": 1}
        return await work.forever()

    @acompile.asgi.cancellable
    async def closed(request: Request) -> Any:
        raise acompile.PoolClosedError("the pool is closed")

    request, hang_up = _request()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _after(work.started, hang_up))
            gone = await endpoint(request)
    assert gone.status_code == acompile.asgi.CLIENT_CLOSED_REQUEST and work.cancelled

    server = Serving(None)  # type: ignore[arg-type]
    request, _ = _request({acompile.asgi.STATE_KEY: server})
    work = _Work()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _after(work.started, server.stop))
            stopped = await endpoint(request)
    assert stopped.status_code == 503, stopped.body
    assert b"the server is shutting down" in stopped.body

    request, _ = _request()
    answer = await closed(request)
    assert (answer.status_code, answer.body) == (503, b'{"error":"the pool is closed"}')

    @acompile.asgi.cancellable
    async def refused(request: Request) -> Any:
        raise acompile.CompiledAfterReadyError(
            "add_kernel[BLOCK=64] (triton) is not in the cache", kernel="add_kernel"
        )

    request, _ = _request()
    answer = await refused(request)
    assert answer.status_code == 503 and json.loads(answer.body)["kernel"] == "add_kernel", answer.body

    with pytest.raises(TypeError, match="needs one"):
        await endpoint("not a request")


async def _after(event: anyio.Event, then: Callable[[], None]) -> None:
    await event.wait()
    then()


async def test_a_stop_signal_stops_the_server_then_reaches_the_previous_handler() -> None:
    server = Serving(None)  # type: ignore[arg-type]
    received: list[int] = []

    def previous(signum: int, frame: Any) -> None:
        received.append(signum)

    before = signal.signal(signal.SIGTERM, previous)
    try:
        with acompile.asgi._stop_signals(server):
            assert signal.getsignal(signal.SIGTERM) is not previous
            signal.raise_signal(signal.SIGTERM)
            with anyio.fail_after(5):
                await server.wait_stopping()
        assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is previous  # put back on the way out
    finally:
        signal.signal(signal.SIGTERM, before)


def _with_state(app: Starlette, state: dict[str, Any]) -> Callable[[Scope, Receive, Send], Any]:
    """The app with a lifespan state, as an ASGI server passes it (httpx's transport does not)."""

    async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, "state": dict(state)}, receive, send)

    return with_state


@asyncio_only
@pytest.mark.timeout(180)
async def test_serving_warms_up_then_is_ready_marks_the_pool_and_answers_its_routes(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    mine = acompile.TritonSpec(add_kernel, ADD_SIGNATURE, {"BLOCK": 128})
    other_target = acompile.TritonSpec(add_kernel, ADD_SIGNATURE, {"BLOCK": 128}, target="cuda:80")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[kernel]]\nkernel = 'nowhere.py:k'\nsignature = {}\n")
    missing_record = tmp_path / "served.toml"
    pool = acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "cache")
    app = Starlette(routes=acompile.asgi.routes())

    # A manifest the deploy names that cannot be used (its kernel's module is not there): the
    # replica stays out of rotation, saying which file and why.
    cold = acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "cold", prestart=False)
    async with acompile.asgi.serving(cold, warmup=[broken, mine], metrics=False, signals=False) as server:
        transport = httpx.ASGITransport(app=_with_state(app, {acompile.asgi.STATE_KEY: server}))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            with anyio.fail_after(120):
                while True:
                    refused = await client.get("/ready")
                    if not refused.json()["reason"].startswith("warming up"):
                        break
                    await anyio.sleep(0.02)
    assert refused.status_code == 503, refused.text
    assert f"the warm-up manifest {broken} cannot be used" in refused.json()["reason"], refused.text
    assert not cold.ready

    async with acompile.asgi.serving(
        pool, warmup=[mine, other_target], replay=missing_record, metrics=registry, signals=False
    ) as server:
        transport = httpx.ASGITransport(app=_with_state(app, {acompile.asgi.STATE_KEY: server}))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            early = await client.get("/ready")
            with anyio.fail_after(120):
                while True:
                    ready = await client.get("/ready")
                    if ready.status_code == 200:
                        break
                    assert ready.status_code == 503, ready.text
                    await anyio.sleep(0.02)
            health = (await client.get("/health")).json()
            scraped = await client.get("/metrics")
    after = server.health()

    assert early.status_code == 503 and early.json()["reason"].startswith("warming up"), early.text
    assert ready.json()["ready"] is True, ready.text
    warmup = health["warmup"]
    assert warmup["state"] == "done", warmup
    sources = warmup["sources"]
    assert sources["specs"] | {"seconds": 0} == {
        "state": "done",
        "total": 1,
        "failed": 0,
        "skipped": 1,
        "errors": [],
        "seconds": 0,
    }, sources
    assert sources[str(missing_record)]["state"] == "none", sources
    assert health["ready"] is True and health["pool"]["after_ready"]["ready"] is True, health
    assert health["pool"]["compiled"] == 1, health

    assert scraped.status_code == 200, scraped.text
    names = {s.name for f in text_string_to_metric_families(scraped.text) for s in f.samples}
    assert "acompile_compile_duration_seconds_count" in names, sorted(names)

    # Out of the lifespan: stopped, and not ready any more.
    assert server.stopping and not server.ready
    assert after["status"] == "stopping" and after["state"] == "closed", after
    assert server.not_ready_reason() == acompile.asgi.SHUTTING_DOWN

    # The registry is free again: a second start of the app registers its pool's metrics anew.
    again = acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / "cache", prestart=False)
    async with acompile.asgi.serving(again, metrics=registry, signals=False) as second:
        assert second.registry is registry


async def test_a_route_without_the_lifespan_state_says_what_is_missing() -> None:
    app = Starlette(routes=acompile.asgi.routes())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        with pytest.raises(LookupError, match=r"acompile\.asgi\.lifespan"):
            await client.get("/health")
