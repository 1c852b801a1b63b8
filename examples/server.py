"""A model server that compiles Triton kernels on demand, with acompile behind it.

    uvicorn examples.server:app                      # from the repository root
    uvicorn server:app --app-dir examples --port 8000 --timeout-graceful-shutdown 5
    python examples/server.py --host 0.0.0.0 --port 8000

Routes:
    GET  /health    answers at once, whatever is compiling: ``acompile.asgi.Serving.health()``
                    (the pool's state, the warm-up's progress, ``pool.stats()`` under ``pool``)
                    and the progressive matmul's stage and stats (``matmul``).
    GET  /ready     503 while the warm-up runs, 200 once it is over (``acompile.asgi.ready``).
    GET  /metrics   the pool's Prometheus metrics (a 404 without the ``metrics`` extra).
    POST /compile   ``{"kernel": "add_kernel", "constexprs": {"BLOCK": 512}, "num_warps": 4}``
                    compiles (or takes from the cache) and answers ``{"name", "key", "tier",
                    "cubin_bytes", "seconds"}``; a wrong request is a 400, a kernel Triton
                    rejects a 422, each with the message that says why. A client that hangs
                    up cancels its compile; on SIGTERM or SIGINT, every compile request in
                    flight is answered at once with a 503 ("the server is shutting down").
    GET  /matmul    which matmul the server launches now: ``{"stage": "fast" | "best", "config",
                    "key", ...}`` (a 503 while neither version has compiled yet).
    POST /quiesce   stops the compile workers (what a server calls before CUDA-graph capture)
                    and answers the pool's awake state; the next request that misses the cache
                    wakes them (``pool.stats()["workers"]["awake"]`` is true again).

The server starts accepting requests as soon as the pool is entered. Meanwhile, in the
background lane (so a request that someone waits on never queues behind them), it compiles the
kernels of ``manifest.toml`` (those for its own target) and replays the record of the previous
run: every Triton request this server serves is appended to a warm-up manifest
(``CompilePool(record=...)``), and the next start compiles (or loads from disk) what production
used. The matmul is progressive: a small-tile version compiles first and is served at once, and
the tuned version is swapped in when it lands.

Environment: ``ACOMPILE_TARGET`` (default ``cuda:90``; compiling needs no GPU),
``ACOMPILE_WORKERS`` (compile processes; default one per usable CPU), ``ACOMPILE_CACHE_DIR``
(the pool's disk cache), ``ACOMPILE_RECORD`` (the record of served kernels; default
``served.toml`` in the cache folder), ``ACOMPILE_IDLE_TIMEOUT`` (quiesce the workers after this
many idle seconds; default never), ``ACOMPILE_HOST`` and ``ACOMPILE_PORT`` (for
``python examples/server.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import acompile
import acompile.asgi

# The kernels live next to this file. Import them as the top-level module `kernels` however the
# server is started (`uvicorn examples.server:app`, `--app-dir examples`, or as a script); the
# pool hands its workers this sys.path, so they can import the module too if they need to.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import kernels  # noqa: E402

logger = logging.getLogger("acompile.example")

# On SIGTERM, uvicorn's bound on the wait for requests in flight (its --timeout-graceful-shutdown).
# The handlers that await the pool answer a 503 at once (acompile.asgi.cancellable): this is only a
# backstop, for a client slow to read its answer, say. Past it, uvicorn cancels what is left.
GRACEFUL_SHUTDOWN_S = 5

# A deadline for one on-demand compile: a compile that takes longer is abandoned (its worker is
# replaced) and the caller gets a 504 instead of a hung connection.
COMPILE_DEADLINE_S = 120.0

_FP32_PTRS = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32"}

# What a client may name, and the runtime signature each kernel is compiled with.
KERNELS: dict[str, tuple[Any, dict[str, str]]] = {
    "add_kernel": (kernels.add_kernel, {**_FP32_PTRS, "n": "i32"}),
    "bias_gelu_kernel": (
        kernels.bias_gelu_kernel,
        {"x_ptr": "*fp16", "bias_ptr": "*fp16", "out_ptr": "*fp16", "n": "i32", "cols": "i32"},
    ),
    "softmax_kernel": (
        kernels.softmax_kernel,
        {"x_ptr": "*fp32", "out_ptr": "*fp32", "stride": "i32", "cols": "i32"},
    ),
    "matmul_kernel": (
        kernels.matmul_kernel,
        {
            "a_ptr": "*fp16",
            "b_ptr": "*fp16",
            "c_ptr": "*fp16",
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "stride_am": "i32",
            "stride_ak": "i32",
            "stride_bk": "i32",
            "stride_bn": "i32",
            "stride_cm": "i32",
            "stride_cn": "i32",
        },
    ),
    # Compiles for seconds (STEPS=800: 3-6 s on 2 cores): a compile a client may give up on.
    "unrolled_kernel": (kernels.unrolled_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}),
}

# The matmul is served progressively: small tiles that compile fast (in the urgent lane, at
# start-up), then tiles tuned for an H100 swapped in when they land (in the background lane).
MATMUL_FAST: tuple[dict[str, int], int, int] = ({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, 4, 2)
MATMUL_BEST: tuple[dict[str, int], int, int] = ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, 8, 3)

# What the server compiles at start-up: the kernels of this manifest for its own target (the
# manifest also lists cuda:80 variants, for a build box's `acompile warmup`).
MANIFEST = Path(__file__).resolve().parent / "manifest.toml"

_REQUEST_FIELDS = {"kernel", "constexprs", "num_warps", "num_stages"}


class BadRequest(Exception):
    """The request body is wrong before acompile sees it (answered with a 400)."""


def default_record_path() -> Path:
    """``$ACOMPILE_RECORD``, else ``served.toml`` in the pool's default cache folder (the same
    folder ``CompilePool`` picks: a deploy that keeps its cache keeps its record with it)."""
    explicit = os.environ.get("ACOMPILE_RECORD")
    if explicit:
        return Path(explicit).expanduser()
    cache_dir = os.environ.get("ACOMPILE_CACHE_DIR")
    if cache_dir:
        return Path(cache_dir).expanduser() / "served.toml"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "acompile" / "served.toml"


def _spec(kernel: Any, constexprs: Any, num_warps: Any, num_stages: Any) -> acompile.TritonSpec:
    try:
        fn, signature = KERNELS[kernel]
    except (KeyError, TypeError):
        raise BadRequest(f"unknown kernel {kernel!r}; this server knows {sorted(KERNELS)}") from None
    # acompile checks the rest (constexpr names and values, num_warps, num_stages) and says
    # what is wrong with an InvalidSpecError.
    return acompile.TritonSpec(fn, signature, constexprs, num_warps=num_warps, num_stages=num_stages)


def _matmul_spec(config: tuple[dict[str, int], int, int]) -> acompile.TritonSpec:
    constexprs, num_warps, num_stages = config
    return _spec("matmul_kernel", constexprs, num_warps, num_stages)


def create_app(
    target: str | None = None,
    workers: int | None = None,
    *,
    record: str | os.PathLike[str] | None = None,
    idle_timeout: float | None = None,
) -> Starlette:
    """The server as a Starlette app, compiling for ``target`` (default ``$ACOMPILE_TARGET``
    or ``cuda:90``) with ``workers`` compile processes (default ``$ACOMPILE_WORKERS``, else one
    per usable CPU), recording
    what it serves to ``record`` (default ``default_record_path()``) and quiescing its workers
    after ``idle_timeout`` seconds without work (default ``$ACOMPILE_IDLE_TIMEOUT``, else never).
    """
    target = target or os.environ.get("ACOMPILE_TARGET", "cuda:90")
    if workers is None and os.environ.get("ACOMPILE_WORKERS"):
        workers = int(os.environ["ACOMPILE_WORKERS"])
    record_path = Path(record) if record is not None else default_record_path()
    if idle_timeout is None and os.environ.get("ACOMPILE_IDLE_TIMEOUT"):
        idle_timeout = float(os.environ["ACOMPILE_IDLE_TIMEOUT"])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        pool = acompile.CompilePool(workers, target=target, record=record_path, idle_timeout=idle_timeout)
        # Enters the pool, warms it up from the manifest and the last run's record in the
        # background lane (requests are served meanwhile; /ready says when it is over), and
        # answers the requests in flight with a 503 on SIGTERM or SIGINT.
        async with acompile.asgi.serving(pool, warmup=MANIFEST, replay=record_path) as serving:
            # Before the warm-up's jobs are queued, so that the fast matmul is the first urgent
            # job and the best one the first in the background lane. Its compiles run in the
            # pool's task group; leaving the pool cancels them if they are still pending.
            matmul = pool.progressive(_matmul_spec(MATMUL_FAST), _matmul_spec(MATMUL_BEST))
            # Handlers read these as request.state.pool, request.state.matmul; acompile.asgi's
            # own endpoints and cancellable() find the Serving under "acompile".
            yield {acompile.asgi.STATE_KEY: serving, "pool": pool, "matmul": matmul}

    async def health(request: Request) -> JSONResponse:
        matmul: acompile.ProgressiveKernel = request.state.matmul
        return JSONResponse({**acompile.asgi.serving_of(request).health(), "matmul": matmul.stats()})

    async def matmul_served(request: Request) -> JSONResponse:
        matmul: acompile.ProgressiveKernel = request.state.matmul
        # No await between these two reads: the swap, made on this thread, cannot fall between.
        stage, kernel = matmul.stage, matmul.kernel
        if kernel is None:
            return _error(503, f"no matmul kernel yet ({stage}): {matmul.stats()}")
        # A request handler would launch it the same way: matmul[grid](a, b, c, M, N, K, ...),
        # which takes whichever kernel is current at that call.
        constexprs, num_warps, num_stages = MATMUL_BEST if stage == "best" else MATMUL_FAST
        return JSONResponse(
            {
                "stage": stage,
                "config": {**constexprs, "num_warps": num_warps, "num_stages": num_stages},
                "key": kernel.key,
                # From the binary itself, not from the config above.
                "num_warps": kernel.metadata.num_warps,
                "num_stages": kernel.metadata.num_stages,
                "stats": matmul.stats(),
            }
        )

    @acompile.asgi.cancellable
    async def quiesce(request: Request) -> JSONResponse:
        pool: acompile.CompilePool = request.state.pool
        t0 = time.perf_counter()
        await pool.quiesce()
        # quiesce() returns at once and the workers stop within milliseconds: answer once they
        # have, so that a caller about to capture CUDA graphs knows the machine is quiet. Work
        # still queued (a warm-up) wakes the pool again by itself: the answer then says so.
        with anyio.move_on_after(5):
            while True:
                workers = pool.stats()["workers"]
                if workers["alive"] == 0 or workers["awake"]:
                    break
                await anyio.sleep(0.005)
        stats = pool.stats()
        return JSONResponse(
            {
                "awake": stats["workers"]["awake"],
                "alive": stats["workers"]["alive"],
                "queued": stats["jobs"]["queued"],
                "seconds": round(time.perf_counter() - t0, 6),
            }
        )

    # A client that hangs up cancels its compile (acompile then stops it, unless another request
    # waits for the same kernel); on SIGTERM or SIGINT it is cancelled and answered with a 503.
    @acompile.asgi.cancellable
    async def compile_kernel(request: Request) -> JSONResponse:
        pool: acompile.CompilePool = request.state.pool
        t0 = time.perf_counter()
        try:
            body = await _read_body(request)
            spec = _spec(
                body["kernel"],
                body.get("constexprs", {}),
                body.get("num_warps", 4),
                body.get("num_stages", 3),
            )
            with anyio.fail_after(COMPILE_DEADLINE_S):
                kernel, tier = await pool.compile_with_tier(spec)
        except (BadRequest, acompile.InvalidSpecError) as exc:
            return _error(400, str(exc))
        except acompile.CompileError as exc:
            return _error(422, str(exc))
        except TimeoutError:
            return _error(504, f"the compile took longer than {COMPILE_DEADLINE_S:g} s and was abandoned")
        return JSONResponse(
            {
                "name": kernel.name,
                "key": kernel.key,
                "tier": tier,  # "memory", "disk" or "compile": where this answer came from
                "cubin_bytes": len(kernel.cubin),
                "seconds": round(time.perf_counter() - t0, 6),
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/ready", acompile.asgi.ready),
            Route("/metrics", acompile.asgi.metrics),
            Route("/compile", compile_kernel, methods=["POST"]),
            Route("/matmul", matmul_served),
            Route("/quiesce", quiesce, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


async def _read_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object such as {_EXAMPLE}, got {type(body).__name__}")
    unknown = sorted(set(body) - _REQUEST_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; a request has {sorted(_REQUEST_FIELDS)}")
    if "kernel" not in body:
        raise BadRequest(f"missing field 'kernel'; e.g. {_EXAMPLE}")
    return body


_EXAMPLE = '{"kernel": "add_kernel", "constexprs": {"BLOCK": 1024}, "num_warps": 4}'


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


app = create_app()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve Triton compiles over HTTP with acompile.")
    parser.add_argument("--host", default=os.environ.get("ACOMPILE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("ACOMPILE_PORT", "8000")))
    parser.add_argument("--target", default=None, help="default: $ACOMPILE_TARGET or cuda:90")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: one per CPU)")
    parser.add_argument(
        "--record",
        default=None,
        help="record of served kernels (default: $ACOMPILE_RECORD or served.toml in the cache)",
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=None, help="quiesce workers after this many idle seconds"
    )
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=int,
        default=GRACEFUL_SHUTDOWN_S,
        help=f"on SIGTERM, wait at most this long for requests in flight (default {GRACEFUL_SHUTDOWN_S} s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    default = all(v is None for v in (args.target, args.workers, args.record, args.idle_timeout))
    server_app = (
        app
        if default
        else create_app(args.target, args.workers, record=args.record, idle_timeout=args.idle_timeout)
    )
    uvicorn.run(
        server_app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )


if __name__ == "__main__":
    main()
