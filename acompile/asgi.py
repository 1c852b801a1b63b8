"""Serving a ``CompilePool`` from an ASGI app (Starlette, FastAPI).

    import acompile, acompile.asgi
    from starlette.applications import Starlette
    from starlette.routing import Route

    @acompile.asgi.cancellable
    async def compile_kernel(request):
        pool = request.state.pool
        kernel = await pool.compile(spec_of(await request.json()))
        return JSONResponse({"key": kernel.key})

    app = Starlette(
        routes=[Route("/compile", compile_kernel, methods=["POST"]), *acompile.asgi.routes()],
        lifespan=acompile.asgi.lifespan(
            lambda: acompile.CompilePool(target="cuda:90"), warmup="manifest.toml"
        ),
    )

What it does for the app:

* a compile whose client hangs up is cancelled (``run_unless_gone``, ``cancellable``): for a
  plain response nothing else tells a handler, and the worker would compile for nobody;
* on SIGTERM or SIGINT, every compile awaited under ``run_unless_gone`` is cancelled and its
  request answered ``503 {"error": "the server is shutting down; ..."}`` at once, so that the
  server's graceful shutdown finds nothing to wait for and the pool is left within a fraction of
  a second. The server's own signal handlers (uvicorn's) still run, after this module's;
* the lifespan (``serving``, ``lifespan``) enters the pool and warms it up from manifests in the
  background lane while requests are served; ``GET /ready`` answers 503 until the warm-up is
  over, then 200, and the pool is told (``pool.mark_ready()``);
* ``GET /health`` answers the pool's state at once, whatever is compiling, and ``GET /metrics``
  the pool's Prometheus metrics (with the ``metrics`` extra).

Needs Starlette (the ``server`` extra); ``import acompile`` never imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio

try:
    from starlette.requests import ClientDisconnect, HTTPConnection, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route
except ImportError as _missing:
    raise ImportError(
        f"acompile.asgi needs Starlette ({_missing}): install the server extra, "
        "pip install 'acompile[server]'"
    ) from _missing

from acompile import (
    CompiledAfterReadyError,
    CompilePool,
    InvalidSpecError,
    PoolClosedError,
    TritonSpec,
    WorkerStartError,
    load_manifest,
)
from acompile._targets import parse_target

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

__all__ = (
    "CLIENT_CLOSED_REQUEST",
    "SHUTTING_DOWN",
    "STATE_KEY",
    "ClientGone",
    "Serving",
    "ShuttingDown",
    "Warmup",
    "cancellable",
    "health",
    "lifespan",
    "metrics",
    "ready",
    "routes",
    "run_unless_gone",
    "serving",
    "serving_of",
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The key of the lifespan state (``request.state``) that holds the ``Serving``.
STATE_KEY = "acompile"

# What proxies log for a client that closed its request; the ASGI server drops the answer.
CLIENT_CLOSED_REQUEST = 499

SHUTTING_DOWN = "the server is shutting down; send the request again (to another replica)"


class ClientGone(Exception):
    """The client hung up before its answer was ready; its work was cancelled."""


class ShuttingDown(Exception):
    """The server began to shut down before the answer was ready; its work was cancelled
    (answered with a 503, so that the client retries elsewhere)."""


class Warmup:
    """The warm-up's progress, as ``/health`` and ``/ready`` report it.

    ``state``: ``"running"``, then ``"done"``, or ``"failed"`` when a kernel or a manifest
    failed (the pool still serves; ``errors`` says what), or ``"cancelled"`` when the server
    stopped first. Each source (a manifest's path, or ``"specs"`` for specs given as they are)
    has its own entry in ``sources``; a replayed record that does not exist yet is ``"none"``.
    """

    def __init__(self) -> None:
        self.state = "running"
        self.sources: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        self.seconds: float | None = None

    def _add(self, name: str, state: str = "running") -> dict[str, Any]:
        entry: dict[str, Any] = {
            "state": state,
            "total": 0,
            "failed": 0,
            "skipped": 0,
            "errors": [],
            "seconds": None,
        }
        self.sources[name] = entry
        return entry

    @property
    def errors(self) -> list[str]:
        return [error for entry in self.sources.values() for error in entry["errors"]]

    def report(self) -> dict[str, Any]:
        """Plain data: the state, kernels in all (compiled for this pool's target), those that
        failed, those of another target (skipped), the sources still running, and each source."""
        entries = self.sources.values()
        return {
            "state": self.state,
            "total": sum(e["total"] for e in entries),
            "failed": sum(e["failed"] for e in entries),
            "skipped": sum(e["skipped"] for e in entries),
            "running": sum(e["state"] == "running" for e in entries),
            "seconds": self.seconds
            if self.seconds is not None
            else round(time.monotonic() - self.started, 3),
            "errors": self.errors,
            "sources": {name: dict(entry) for name, entry in self.sources.items()},
        }


class Serving:
    """A pool as an ASGI app serves it: its warm-up, whether it is ready, whether the server is
    stopping. Made by ``serving()`` (or ``lifespan()``), and found in a handler with
    ``serving_of(request)`` or ``request.state.acompile``."""

    def __init__(self, pool: CompilePool) -> None:
        self.pool = pool
        self.warmup = Warmup()
        self._stopping = anyio.Event()
        self._ready = False
        self._broken: str | None = None
        self.registry: Any = None  # the Prometheus registry the pool's metrics are on, if any

    @property
    def ready(self) -> bool:
        """The warm-up is over (failed kernels included) and the server is not stopping."""
        return self._ready and not self._stopping.is_set()

    @property
    def stopping(self) -> bool:
        """The server was told to stop (a signal, or the lifespan's end)."""
        return self._stopping.is_set()

    def stop(self) -> None:
        """Cancel every request awaiting under ``run_unless_gone`` (each answers a 503) and the
        warm-up. What SIGTERM and SIGINT do; called again, does nothing."""
        self._stopping.set()

    async def wait_stopping(self) -> None:
        """Return once the server is told to stop."""
        await self._stopping.wait()

    def not_ready_reason(self) -> str | None:
        """Why ``/ready`` answers 503, or None when it answers 200."""
        if self._stopping.is_set():
            return SHUTTING_DOWN
        if self._broken is not None:
            return self._broken
        if not self._ready:
            report = self.warmup.report()
            return f"warming up ({report['running']} source(s) to go, {report['seconds']:.1f} s so far)"
        return None

    def health(self) -> dict[str, Any]:
        """What ``/health`` answers: a summary of the pool's state, then ``pool.stats()``
        whole (under ``"pool"``). Cheap: nothing is measured on the call."""
        stats = self.pool.stats()
        cache = stats["cache"]
        workers = stats["workers"]
        status = "ok" if stats["state"] == "running" else stats["state"]
        if self._stopping.is_set():
            status = "stopping"
        return {
            "status": status,
            "ready": self.ready,
            "state": stats["state"],
            "workers": {
                "size": workers["size"],
                "alive": workers["alive"],
                "awake": workers["awake"],
                "busy": workers["busy"],
            },
            "queued": stats["jobs"]["queued"],
            "running": stats["jobs"]["running"],
            "warmup": self.warmup.report(),
            # None where the pool has no shared tier; False while it is unreachable.
            "shared": {"kind": cache["shared_kind"], "available": cache["shared_available"]},
            "compiled_after_ready": stats["after_ready"]["compiles"],
            "pool": stats,
        }


WarmupSource = str | os.PathLike[str] | TritonSpec


@contextlib.asynccontextmanager
async def serving(
    pool: CompilePool,
    *,
    warmup: WarmupSource | Iterable[WarmupSource] = (),
    replay: str | os.PathLike[str] | None = None,
    on_late: Literal["warn", "refuse"] = "warn",
    signals: bool = True,
    metrics: bool | Any = True,
) -> AsyncIterator[Serving]:
    """Enter ``pool`` and serve it, for an app's lifespan: yields a ``Serving`` at once.

    ``warmup``: manifests' paths (``acompile.load_manifest``) and ``TritonSpec``s, compiled in
    the background lane while requests are served; kernels for another target than the pool's
    are skipped (a build box warms those, with ``acompile warmup``). ``replay``: a record of
    what a previous run served (``CompilePool(record=...)``), warmed up the same way if it
    exists. Once everything finished (failures included), ``pool.mark_ready(on_late)`` is
    called and ``Serving.ready`` is true.

    ``signals``: set handlers for SIGTERM and SIGINT, in front of the server's, that stop the
    requests awaiting the pool (each answers a 503) and then hand the signal on. Only the main
    thread can: elsewhere, requests are stopped when the lifespan ends.

    ``metrics``: register the pool's Prometheus metrics (``acompile.metrics.instrument``) on the
    default registry, or on the registry given; False for none. Without prometheus_client,
    nothing is registered and ``/metrics`` answers 404.
    """
    server = Serving(pool)
    entries = [
        (source, server.warmup._add(str(source) if isinstance(source, Path) else "specs"))
        for source in _sources(warmup)
    ]
    if replay is not None:
        # Known before the first request: a first run's "none" must never read "running".
        exists = await anyio.Path(replay).exists()
        entries.append((Path(replay), server.warmup._add(str(replay), "running" if exists else "none")))
    instrumentation = _instrument(server, metrics)
    try:
        async with pool, anyio.create_task_group() as tg:
            tg.start_soon(_warm_up, server, entries, on_late, None if replay is None else str(replay))
            tg.start_soon(_stop_warmup_on_stop, server, tg.cancel_scope)
            with _stop_signals(server) if signals else contextlib.nullcontext():
                try:
                    yield server
                finally:
                    # Shutting down: requests still awaiting the pool answer a 503; leaving the
                    # pool stops the workers.
                    server.stop()
                    tg.cancel_scope.cancel()
    finally:
        if instrumentation is not None:
            # The registry is free again for the next pool (an app started twice, in tests).
            instrumentation.close()


def lifespan(
    pool: CompilePool | Callable[[], CompilePool],
    *,
    warmup: WarmupSource | Iterable[WarmupSource] = (),
    replay: str | os.PathLike[str] | None = None,
    on_late: Literal["warn", "refuse"] = "warn",
    signals: bool = True,
    metrics: bool | Any = True,
) -> Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]:
    """A Starlette (or FastAPI) ``lifespan=`` that runs ``serving()`` with these arguments and
    puts the ``Serving`` in the lifespan state as ``acompile`` and its pool as ``pool``
    (``request.state.acompile``, ``request.state.pool``). ``pool``: a pool, or a callable that
    makes one each time the app starts (an app started twice, in tests, needs a fresh pool)."""

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[dict[str, Any]]:
        the_pool = pool if isinstance(pool, CompilePool) else pool()
        async with serving(
            the_pool, warmup=warmup, replay=replay, on_late=on_late, signals=signals, metrics=metrics
        ) as server:
            yield {STATE_KEY: server, "pool": server.pool}

    return run


def serving_of(connection: HTTPConnection) -> Serving:
    """The ``Serving`` in a request's lifespan state (``STATE_KEY``)."""
    found = connection.scope.get("state", {}).get(STATE_KEY)
    if not isinstance(found, Serving):
        raise LookupError(
            f"no acompile.asgi.Serving in the lifespan state under {STATE_KEY!r}: use "
            "acompile.asgi.lifespan(), or yield {'acompile': serving} from a lifespan that enters "
            "acompile.asgi.serving()"
        )
    return found


async def run_unless_gone(request: Request, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, unless the client hangs up or the server starts to stop first: then
    cancel it and raise ``ClientGone`` or ``ShuttingDown``. An answer wins over a hang-up that
    comes with it; the awaitable's own exceptions are raised as they are.

    Reads the request's body first, if nothing has (it stays available: ``request.json()``):
    after it, the ASGI server's next message is ``http.disconnect``. Cancelling the await is all
    the pool needs: a queued job is dropped, and a running one is stopped with its worker (a
    fresh one takes its place) unless another request waits for the same kernel. Without a
    ``Serving`` in the lifespan state, only a hang-up cancels.
    """
    found = request.scope.get("state", {}).get(STATE_KEY)
    server = found if isinstance(found, Serving) else None
    try:
        if server is not None and server.stopping:
            raise ShuttingDown(SHUTTING_DOWN)
        try:
            await request.body()
        except ClientDisconnect:
            raise ClientGone("the client closed the connection while sending its request") from None
        except RuntimeError:
            pass  # the body was read as a stream (a form, say): nothing is left to read
    except BaseException:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never awaited: say nothing about it
        raise

    gone: Exception | None = None
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as watchers:

        async def watch_client() -> None:
            nonlocal gone
            # The body has been read: the next message comes when the client hangs up.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = ClientGone("the client closed the connection")
            watchers.cancel_scope.cancel()

        async def watch_server(server: Serving) -> None:
            nonlocal gone
            await server.wait_stopping()
            gone = ShuttingDown(SHUTTING_DOWN)
            watchers.cancel_scope.cancel()

        watchers.start_soon(watch_client)
        if server is not None:
            watchers.start_soon(watch_server, server)
        try:
            result.append(await awaitable)
        except Exception as exc:
            # Raised as it is after the task group: raised in it, it would come out wrapped in
            # an ExceptionGroup. (A cancellation is no Exception: it goes through untouched.)
            failure.append(exc)
        watchers.cancel_scope.cancel()
    if result:
        return result[0]
    if failure:
        raise failure[0]
    assert gone is not None  # only a watcher cancels the await
    raise gone


def cancellable(endpoint: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Run an async endpoint under ``run_unless_gone``: a client that hangs up cancels it (its
    answer, 499, is dropped by the server), and a server that starts to stop answers 503
    ``{"error": "the server is shutting down; ..."}``, as it does for ``PoolClosedError``. The
    endpoint takes a Starlette ``Request`` (for FastAPI: declare a ``request: Request``
    parameter). A compile refused after ready (``CompiledAfterReadyError``) is a 503 too, with
    the kernel named; anything else it raises goes through as it is."""

    @functools.wraps(endpoint)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = next((a for a in (*args, *kwargs.values()) if isinstance(a, Request)), None)
        if request is None:
            raise TypeError(
                f"{endpoint.__qualname__} takes no starlette Request: acompile.asgi.cancellable needs "
                "one (for FastAPI, declare a `request: Request` parameter)"
            )
        try:
            return await run_unless_gone(request, endpoint(*args, **kwargs))
        except ClientGone as exc:
            return JSONResponse({"error": str(exc)}, status_code=CLIENT_CLOSED_REQUEST)
        except (ShuttingDown, PoolClosedError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        except CompiledAfterReadyError as exc:
            # The server refuses to compile once ready (on_late="refuse"): not this request's
            # fault, and another replica (or this one, once warmed up) may hold it.
            return JSONResponse({"error": str(exc), "kernel": exc.kernel}, status_code=503)

    return wrapper


async def health(request: Request) -> Response:
    """``GET /health``: ``Serving.health()``, always a 200 while the process serves."""
    return JSONResponse(serving_of(request).health())


async def ready(request: Request) -> Response:
    """``GET /ready``: 200 ``{"ready": true, ...}`` once the warm-up is over, else 503
    ``{"ready": false, "reason": ...}`` (warming up, the workers cannot start, shutting down)."""
    server = serving_of(request)
    reason = server.not_ready_reason()
    report = server.warmup.report()
    warmup = {key: report[key] for key in ("state", "total", "failed", "skipped", "seconds")}
    if reason is None:
        return JSONResponse({"ready": True, "warmup": warmup})
    return JSONResponse({"ready": False, "reason": reason, "warmup": warmup}, status_code=503)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: the Prometheus text exposition of the pool's registry, or a 404 that
    names the extra to install."""
    server = serving_of(request)
    try:
        from acompile.metrics import exposition
    except ImportError as exc:
        return PlainTextResponse(
            f"no metrics here ({exc}): install the metrics extra, pip install 'acompile[metrics]'\n",
            status_code=404,
        )
    body, content_type = exposition(server.registry)
    return Response(body, headers={"content-type": content_type})


def routes(
    *, health_path: str = "/health", ready_path: str = "/ready", metrics_path: str | None = "/metrics"
) -> list[Route]:
    """Starlette routes for ``health``, ``ready`` and ``metrics`` (None leaves /metrics out)."""
    found = [Route(health_path, health, methods=["GET"]), Route(ready_path, ready, methods=["GET"])]
    if metrics_path is not None:
        found.append(Route(metrics_path, metrics, methods=["GET"]))
    return found


# -- the lifespan's work -------------------------------------------------------------------------


def _sources(warmup: WarmupSource | Iterable[WarmupSource]) -> list[Path | list[TritonSpec]]:
    """Manifests' paths, and the specs given as they are (one list, in the order given)."""
    items: Iterable[WarmupSource] = [warmup] if isinstance(warmup, (str, os.PathLike, TritonSpec)) else warmup
    sources: list[Path | list[TritonSpec]] = []
    specs: list[TritonSpec] = []
    for item in items:
        if isinstance(item, TritonSpec):
            specs.append(item)
        elif isinstance(item, (str, os.PathLike)):
            # Absolute as the server starts: a relative path is the start folder's, and says so
            # in /ready and the log (a server started from another folder finds no manifest).
            sources.append(Path(os.path.abspath(item)))
        else:
            raise TypeError(f"warmup takes manifests' paths and TritonSpecs, got {item!r}")
    if specs:
        sources.append(specs)
    return sources


def _instrument(server: Serving, metrics: bool | Any) -> Any:
    """Register the pool's metrics (``acompile.metrics.instrument``) on the registry ``metrics``
    names (True: prometheus_client's default one), and remember it for ``/metrics``. Returns
    what undoes it, or None where nothing was registered."""
    if metrics is False:
        return None
    try:
        from acompile.metrics import instrument
    except ImportError:  # no prometheus_client: /metrics says which extra to install
        return None
    server.registry = None if metrics is True else metrics
    return instrument(server.pool, registry=server.registry)


async def _stop_warmup_on_stop(server: Serving, scope: anyio.CancelScope) -> None:
    # The warm-up shares the lifespan's task group: on a signal, stop it at once rather than
    # once the server's graceful shutdown has waited for the requests in flight.
    await server.wait_stopping()
    scope.cancel()


async def _warm_up(
    server: Serving,
    entries: Sequence[tuple[Path | list[TritonSpec], dict[str, Any]]],
    on_late: Literal["warn", "refuse"],
    replayed: str | None = None,
) -> None:
    """Warm up from ``entries``, then say the pool is ready; a manifest that cannot be read
    (``replayed``, the record of a previous run, aside) keeps it not ready."""
    warmup = server.warmup
    try:
        await server.pool.wait_ready()
    except WorkerStartError as exc:  # the workers cannot start: the message says why
        server._broken = f"the pool's workers cannot start: {exc}"
        for _, entry in entries:
            if entry["state"] == "running":
                entry["state"] = "failed"
        warmup.state = "failed"
        warmup._add("pool", "failed")["errors"].append(str(exc))
        warmup.seconds = round(time.monotonic() - warmup.started, 3)
        logger.error("warm-up failed: %s", exc)
        return
    async with anyio.create_task_group() as tg:
        for source, entry in entries:
            if entry["state"] == "running":
                tg.start_soon(_warm_up_source, server.pool, source, entry)
    warmup.seconds = round(time.monotonic() - warmup.started, 3)
    warmup.state = "failed" if warmup.errors else "done"
    report = warmup.report()
    logger.info(
        "warm-up %s: %d kernels (%d failed, %d for other targets skipped) in %.2f s",
        warmup.state,
        report["total"],
        report["failed"],
        report["skipped"],
        warmup.seconds,
    )
    for error in warmup.errors:
        logger.warning("warm-up: %s", error.splitlines()[0] if error else error)
    # A source that failed before any of its kernels was tried could not be read.
    unreadable = [
        (name, entry)
        for name, entry in warmup.sources.items()
        if entry["errors"] and not entry["total"] and not entry["failed"] and name != replayed
    ]
    if unreadable:
        # A manifest the deploy names and that cannot be read (a wrong path, a kernel module
        # that does not import) is the deploy's mistake: a replica that would serve cold stays
        # out of rotation, saying why. A kernel that fails to compile does not hold it back.
        name, entry = unreadable[0]
        first = entry["errors"][0].splitlines()[0]
        server._broken = f"the warm-up manifest {name} cannot be used: {first}"
        logger.error(
            "warm-up: %s; /ready answers 503 until the server restarts with it fixed", server._broken
        )
        return
    server.pool.mark_ready(on_late=on_late)
    server._ready = True


async def _warm_up_source(pool: CompilePool, source: Path | list[TritonSpec], entry: dict[str, Any]) -> None:
    t0 = time.monotonic()
    try:
        if isinstance(source, Path):
            # Reading a manifest imports the kernels' modules: blocking, so in a thread.
            specs = await anyio.to_thread.run_sync(load_manifest, source)
        else:
            specs = source
    except InvalidSpecError as exc:  # the message names the entry at fault
        entry["errors"].append(str(exc))
    except Exception as exc:  # a manifest's fault must end its warm-up, never the server's lifespan
        logger.debug("warm-up of %s failed", source, exc_info=True)
        entry["errors"].append(f"{source}: {type(exc).__name__}: {str(exc)[:300]}")
    else:
        mine = [spec for spec in specs if _for_target(spec, pool)]
        entry["skipped"] = len(specs) - len(mine)
        entry["total"] = len(mine)
        results = await pool.gather(*mine, return_exceptions=True, background=True)
        for spec, result in zip(mine, results, strict=True):
            if isinstance(result, Exception):
                entry["failed"] += 1
                entry["errors"].append(f"{spec.fn.__name__} {spec.constexprs}: {result}")
    entry["seconds"] = round(time.monotonic() - t0, 3)
    entry["state"] = "failed" if entry["errors"] else "done"


def _for_target(spec: TritonSpec, pool: CompilePool) -> bool:
    """Whether a spec compiles for the pool's target (a spec without one does)."""
    if spec.target is None or pool.target is None:
        return True
    try:
        return parse_target(spec.target) == pool.target
    except InvalidSpecError:
        return True  # its compile says what is wrong with it


# -- signals -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_signals(server: Serving) -> Iterator[None]:
    """Stop ``server`` as soon as the process receives SIGTERM or SIGINT, then hand the signal
    on to the handler that was there before (the ASGI server's own, which starts its shutdown).

    Why: on SIGTERM uvicorn stops accepting connections, then waits for every request in flight
    before it runs the lifespan's shutdown: a handler awaiting a long compile holds the process
    up to the end of that compile. ``--timeout-graceful-shutdown`` bounds the wait by cancelling
    the handlers' tasks from outside (a ``CancelledError`` traceback and a 500 each). uvicorn
    sets its handlers with ``signal.signal`` before it runs the lifespan, so this one goes in
    front of it, and puts it back on the way out.
    """
    if threading.current_thread() is not threading.main_thread():
        # Only the main thread may set signal handlers (a server run in a thread, in a test).
        yield
        return
    try:
        loop = asyncio.get_running_loop()  # uvicorn runs the app on asyncio (or uvloop)
    except RuntimeError:  # another loop (trio): requests are stopped when the lifespan ends
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of whatever the main thread does, the
        # event loop's own code included: it only schedules the stop.
        loop.call_soon_threadsafe(server.stop)
        chained = previous[signum]
        if callable(chained):
            chained(signum, frame)
        elif chained == signal.SIG_IGN:
            pass
        else:  # SIG_DFL (or set outside Python): do what it would have done
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        previous[stop_signal] = signal.signal(stop_signal, handler)
    try:
        yield
    finally:
        for signum, chained in previous.items():
            if chained is not None:  # None: set outside Python; nothing to restore
                signal.signal(signum, chained)
