"""The cache-tier section of ``acompile bench --tiers``: hit latency by tier, and warm start of the
corpus from each tier against Triton's file cache and its Redis remote cache. It starts a private
``redis-server`` on loopback; each step runs in a fresh process.

The fill compiles the corpus into a disk folder with Redis as the shared tier (and Triton into
its file cache, and into its Redis backend). Hit steps time one request at a time, 5 passes, each
from one tier (``hit_shared`` on an empty disk folder, emptied before each pass); warm starts
request every kernel at once and fail unless every kernel came from the tier measured.

On Triton 3.9.0 the Redis backend reads ``knobs.cache.redis``, which is ``knobs.redis``:
``TritonRedisBackend`` below repairs only that lookup.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from acompile._bench import harness
from acompile._cache import entries_dir

HIT_STEPS = ("hit_memory", "hit_disk", "hit_shared")
WARM_STEPS = {
    "warm_disk": "acompile, disk",
    "warm_shared": "acompile, Redis (empty disk folder)",
    "triton_warm_file": "Triton, its file cache",
    "triton_warm_redis": "Triton, its Redis backend (empty local folder)",
    "triton_warm_redis_local": "Triton, its Redis backend (local folder filled)",
}
PASSES = 5


def __getattr__(name: str) -> Any:
    # TRITON_REMOTE_CACHE_BACKEND=acompile._bench.tiers:TritonRedisBackend, built on first use so
    # that importing this module never imports Triton.
    if name == "TritonRedisBackend":
        return _triton_redis_backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _triton_redis_backend() -> type[Any]:
    from triton import knobs
    from triton.runtime.cache import RedisRemoteCacheBackend

    if hasattr(knobs.cache, "redis"):
        stock: type[Any] = RedisRemoteCacheBackend  # Triton's own works as shipped
        return stock

    class Repaired(RedisRemoteCacheBackend):  # type: ignore[misc]
        """Triton's backend with the knob lookup it gets wrong repaired; nothing else changed."""

        def __init__(self, key: str) -> None:
            import redis

            self._key, self._key_fmt = key, knobs.redis.key_format
            self._redis = redis.Redis(host=knobs.redis.host, port=knobs.redis.port)

    return Repaired


# -- the steps, each run in a fresh process ------------------------------------------------------


def _pool(args: argparse.Namespace, tier: str) -> Any:
    import acompile

    options: dict[str, Any] = {"target": args.target}  # the default pool: workers prestarted
    options["cache_dir"] = args.empty if tier == "shared" else args.disk
    options["shared_cache"] = args.redis if tier in ("fill", "shared") else None
    if args.step in ("hit_disk", "hit_shared"):
        # Every request of a hit step goes to the tier measured, none to the memory tier.
        options["memory_cache_size"] = 0
    return acompile.CompilePool(args.workers, **options)


def _problems(stats: dict[str, Any], n: int, tier: str) -> list[str]:
    cache = stats["cache"]
    if tier == "fill":
        return [] if stats["compiled"] == n else [f"compiled {stats['compiled']} (want {n})"]
    problems = [] if cache[f"hits_{tier}"] == n else [f"{tier} hits {cache[f'hits_{tier}']} (want {n})"]
    if stats["compiled"] or stats["workers"]["started"]:
        problems.append(
            f"compiled {stats['compiled']}, workers started {stats['workers']['started']} (want 0)"
        )
    return problems


async def acompile_step(args: argparse.Namespace) -> dict[str, Any]:
    """``fill``, a hit step or an acompile warm step (``args.step``)."""
    import anyio

    from acompile._bench.corpus import acompile_specs, outcome

    stamps = {"imported": time.time()}
    tier = args.step.removeprefix("hit_").removeprefix("warm_")
    requests = acompile_specs(args.limit)
    n, results, samples, ready = len(requests), [None] * len(requests), [], []
    t0 = time.perf_counter()
    async with _pool(args, tier) as pool:
        if args.step.startswith("hit_"):
            if tier == "memory":
                await pool.gather(*requests)  # into the memory tier first, not counted
            for p in range(PASSES):
                # The previous pass wrote every entry to disk (behind, after each hit): remove them
                # once written, so that this pass reads Redis again.
                with anyio.move_on_after(5):
                    while tier == "shared" and pool.stats()["cache"]["disk_writes"] < p * len(requests):  # noqa: ASYNC110
                        await anyio.sleep(0.005)
                entries = entries_dir(Path(args.empty))
                await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, entries, ignore_errors=True))
                for i, spec in enumerate(requests):
                    t = time.perf_counter()
                    results[i], _ = await pool.compile_with_tier(spec)
                    samples.append(time.perf_counter() - t)
            n *= PASSES
        else:

            async def one(i: int) -> None:
                results[i] = await pool.compile_with_tier(requests[i])
                ready.append(time.perf_counter() - t0)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
            results = [r[0] for r in results]  # type: ignore[index]
        wall = time.perf_counter() - t0
        stamps["ready"] = time.time()
        stats = pool.stats()
    return {
        "wall_s": wall,
        "first_s": min(ready, default=None),
        "stamps": stamps,
        "latency": harness.latency(samples) if samples else None,
        "stats": stats,
        "assertion": "; ".join(_problems(dict(stats), n, tier)) or None,
        **outcome(results, args.limit),
    }


CHILDREN = {step: acompile_step for step in ("fill", *HIT_STEPS, "warm_disk", "warm_shared")}


# -- the orchestrator ----------------------------------------------------------------------------


@contextlib.contextmanager
def redis_server(executable: str, folder: Path) -> Any:
    """A private ``redis-server`` on a free loopback port, without persistence: yields its port."""
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{executable} did not start on port {port}")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start Redis, run every step, each in a fresh process under ``root``: the JSON section."""
    executable = args.redis_server or shutil.which("redis-server") or "/usr/bin/redis-server"
    steps: dict[str, dict[str, Any]] = {}
    disk, triton_file = root / "acompile-disk", root / "triton-file"
    base = {"workers": args.workers, "target": args.target, "limit": args.limit, "disk": str(disk)}
    try:
        with redis_server(executable, root / "redis") as port:
            base["redis"] = f"redis://127.0.0.1:{port}/0"
            redis_env = {
                "TRITON_CACHE_MANAGER": "triton.runtime.cache:RemoteCacheManager",
                "TRITON_REMOTE_CACHE_BACKEND": "acompile._bench.tiers:TritonRedisBackend",
                "TRITON_REDIS_HOST": "127.0.0.1",
                "TRITON_REDIS_PORT": str(port),
            }

            def step(name: str, module: str, child: str, **env: str) -> None:
                print(f"[bench] tiers {name} ...", file=sys.stderr, flush=True)
                folder = root / name
                options = {
                    **base,
                    "step": child,
                    "empty": str(folder / "empty"),
                    "warm": name == "triton_warm_file",
                }
                result = harness.run_child(
                    module, child, options, folder, harness.child_env(folder, **env), 900
                )
                steps[name] = result

            step("fill", "tiers", "fill")
            step("triton_fill_file", "run", "sequential", TRITON_CACHE_DIR=str(triton_file))
            step("triton_fill_redis", "run", "sequential", **redis_env)
            for name in (*HIT_STEPS, "warm_disk", "warm_shared"):
                step(name, "tiers", name)
            step("triton_warm_file", "run", "sequential", TRITON_CACHE_DIR=str(triton_file))
            step("triton_warm_redis", "run", "sequential", **redis_env)
            local = str(root / "triton_warm_redis" / "triton-cache")
            step("triton_warm_redis_local", "run", "sequential", TRITON_CACHE_DIR=local, **redis_env)
    except RuntimeError as exc:
        steps["redis_server"] = {"crashed": str(exc)}
    return {"workers": args.workers, "steps": steps}


def failed(section: dict[str, Any]) -> list[str]:
    """The steps that crashed or whose checks failed."""
    bad = [s for s, r in section["steps"].items() if "crashed" in r or r.get("assertion") or r.get("failed")]
    return [f"tiers {s}" for s in bad]


def report(section: dict[str, Any]) -> str:
    """The section as text: two tables."""
    steps, f = section["steps"], harness.fmt
    lat = {s: steps[s].get("latency") or {} for s in HIT_STEPS if s in steps}
    hits = [
        [s.removeprefix("hit_"), f(v.get("p50_ms"), ".3f"), f(v.get("p99_ms"), ".3f")] for s, v in lat.items()
    ]
    warm = [
        [label, f(steps[s].get("first_s"), ".1f", 1000), f(steps[s].get("wall_s"), ".1f", 1000),
         f(steps[s].get("process_to_ready_s"), ".0f", 1000)]
        for s, label in WARM_STEPS.items() if s in steps and "crashed" not in steps[s]
    ]  # fmt: skip
    lines = [
        f"cache tiers, {section['workers']} workers",
        harness.table(["hit latency, per request", "p50 ms", "p99 ms"], hits),
        "",
        harness.table(
            ["warm start, fresh process", "first ms", "all ms", "interpreter start -> all ms"], warm
        ),
    ]
    lines += [f"{s}: {steps[s.removeprefix('tiers ')].get('crashed') or 'FAILED'}" for s in failed(section)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The children's entry (``--child``); the section itself runs from ``acompile bench``."""
    return harness.child_main(CHILDREN, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
