"""The cache-tier benchmark: hit latency by tier, and warm start of the corpus from each tier,
against Triton's file cache and its Redis remote cache.

    python -m acompile.cli bench --tiers [--workers N] [--target cuda:90] [--limit K] [--json PATH]

The orchestrating process starts a private ``redis-server`` on a free loopback port (no
persistence: ``--save "" --appendonly no``), runs every *step* below in its own fresh Python
process (``python -c`` entry of this module) with its own ``TRITON_CACHE_DIR`` and
``ACOMPILE_CACHE_DIR``, and stops the server at the end. The results go into the benchmark's
JSON under ``"tiers"``. Before every step the server's statistics are reset (``CONFIG
RESETSTAT``), and read after it: the Redis commands each step sent (GET, MGET, SET ...) and the
connections it opened are part of its result, counted by the server, not by the client.

Fill (once each):

``fill_acompile``
    ``CompilePool(workers=N, shared_cache="redis://127.0.0.1:PORT/0")`` on an empty disk folder
    gathers the whole corpus: every entry lands on disk and (write-behind, before the pool has
    left) in Redis. Checked: N compiles, N shared writes, N ``acompile`` entries in Redis.
``triton_fill_file``
    ``triton.compile`` (``corpus.compile_spec``) of every spec into an empty ``TRITON_CACHE_DIR``.
``triton_fill_redis``
    The same with Triton's Redis remote cache enabled (see below) and an empty local folder.

Hit latency per request (``pool.compile_with_tier(spec)`` awaited one after the other, timed
around each await; P passes over the corpus, default 5), each in a fresh process on a pool with
``prestart=False`` (no worker may start); every request must report the tier claimed, and
``stats()`` must show only hits of that tier:

``hit_memory``
    A pool on the filled disk folder, no shared tier: a first pass loads every kernel from disk
    (not counted), then P passes of memory hits.
``hit_disk``
    A pool on the filled disk folder, no shared tier, ``memory_cache_size=0``: every request of
    every pass reads, verifies and loads its entry from disk.
``hit_shared``
    A pool on an EMPTY disk folder with the Redis URL, ``memory_cache_size=0``; before each pass
    after the first the disk folder's entries are removed (untimed), so every request is a Redis
    GET, a verify, a write of the entry to disk and a load.

Pass 1 is the first time each kernel is requested from that tier in the process (its first
request pays the process's first-use costs: imports, a connection); passes 2..P are the steady
state. Both are reported.

Warm start of the whole corpus in a fresh process (R runs each, default 3, interleaved; medians
reported, every run kept). acompile: ``CompilePool(prestart=False)`` and one task per spec
awaiting ``compile_with_tier`` (what ``pool.gather`` does, plus the tier and the time each kernel
became ready); "entry" is the clock started before the pool is entered. Triton: ``compile_spec``
of each spec in turn. "interpreter" is the wall clock from just before the orchestrator starts
the process until every kernel is ready (the child's ``time.time()`` stamp), imports included.

``warm_disk``          acompile, the filled disk folder, no shared tier: all disk hits.
``warm_disk_shared``   the same with the Redis URL configured: all disk hits, and no Redis command
                       at all (a local hit never touches the shared tier).
``warm_shared``        acompile, an EMPTY disk folder and the Redis URL: all shared hits.
``triton_warm_file``   Triton, ``TRITON_CACHE_DIR`` filled by ``triton_fill_file``: no new entry.
``triton_warm_redis``  Triton's Redis backend, an EMPTY local folder: no compile (checked: no SET
                       reached Redis; a compile publishes every file it makes with SET).
``triton_warm_redis_local``  Triton's Redis backend again, on the local folder the previous step
                       filled: every file is there, and Triton still asks Redis for all of them.

Triton's Redis remote cache is enabled with ``TRITON_CACHE_MANAGER=triton.runtime.cache:
RemoteCacheManager`` (without it ``TRITON_REMOTE_CACHE_BACKEND`` is never read),
``TRITON_REMOTE_CACHE_BACKEND`` naming the backend class, ``TRITON_REDIS_HOST`` and
``TRITON_REDIS_PORT``; keys are ``triton:{key}:{filename}`` (``TRITON_REDIS_KEY_FORMAT``), so they
do not collide with acompile's (``acompile`` namespace). The backend class is this module's
``TritonRedisBackend``: Triton's own ``RedisRemoteCacheBackend`` where it works; where it cannot
be constructed (Triton 3.9.0 reads ``knobs.cache.redis``, which does not exist: the knobs are
``knobs.redis``), a subclass that repairs only that lookup. Everything measured (the synchronous
redis-py client, a new client per kernel, MGET of the group file then of its children, every
file rewritten locally on every hit) is Triton's own code. The result says which was used.

Checks (``assertion``, which makes ``acompile bench`` exit 1): every kernel produced a cubin; the
tiers and counts above; every row's cubins equal those of its product's fill (``cubin≠fill``);
acompile's cubins are compared with Triton's too (reported, ``cubin≠triton``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILL_STEPS = ("fill_acompile", "triton_fill_file", "triton_fill_redis")
HIT_STEPS = ("hit_memory", "hit_disk", "hit_shared")
WARM_STEPS = (
    "warm_disk",
    "warm_disk_shared",
    "warm_shared",
    "triton_warm_file",
    "triton_warm_redis",
    "triton_warm_redis_local",
)
STEPS = FILL_STEPS + HIT_STEPS + WARM_STEPS
_TRITON_STEPS = {s for s in STEPS if s.startswith("triton_")}
_TRITON_REDIS_STEPS = {"triton_fill_redis", "triton_warm_redis", "triton_warm_redis_local"}
# The tier every request of a step must come from.
_EXPECTED_TIER = {
    "hit_memory": "memory",
    "hit_disk": "disk",
    "hit_shared": "shared",
    "warm_disk": "disk",
    "warm_disk_shared": "disk",
    "warm_shared": "shared",
}
_LABELS = {
    "warm_disk": "acompile, disk",
    "warm_disk_shared": "acompile, disk (Redis configured)",
    "warm_shared": "acompile, Redis (empty disk folder)",
    "triton_warm_file": "Triton, file cache",
    "triton_warm_redis": "Triton, Redis (empty local folder)",
    "triton_warm_redis_local": "Triton, Redis (local folder filled)",
    "triton_fill_file": "Triton, cold (fill, file cache)",
    "triton_fill_redis": "Triton, cold (fill, Redis)",
}
PASSES = 5
REPEATS = 3
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_CHILD_ENTRY = (
    "import sys; from acompile._bench.tiers import _child_main; sys.exit(_child_main(sys.argv[1:]))"
)
_REDIS_NOISE = {"info", "config|resetstat", "config", "hello", "client|setinfo", "client"}


# -- Triton's Redis backend ------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    # ``TRITON_REMOTE_CACHE_BACKEND=acompile._bench.tiers:TritonRedisBackend``: built on first
    # use, so that importing this module (the orchestrator does) never imports Triton.
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

    class RepairedRedisRemoteCacheBackend(RedisRemoteCacheBackend):  # type: ignore[misc]
        """Triton's backend with the knob lookup it gets wrong repaired; nothing else changed."""

        def __init__(self, key: str) -> None:
            import redis

            self._key = key
            self._key_fmt = knobs.redis.key_format
            self._redis = redis.Redis(host=knobs.redis.host, port=knobs.redis.port)

    return RepairedRedisRemoteCacheBackend


def _triton_redis_backend_kind() -> str:
    from triton.runtime.cache import RedisRemoteCacheBackend

    if _triton_redis_backend() is RedisRemoteCacheBackend:
        return "stock RedisRemoteCacheBackend"
    return "RedisRemoteCacheBackend with its knob lookup repaired (knobs.cache.redis -> knobs.redis)"


# -- helpers of the step processes --------------------------------------------------------------


def _stats_problems(stats: Mapping[str, Any], *, n_hits: int, tier: str) -> list[str]:
    problems = []
    cache = stats["cache"]
    if stats["compiled"] != 0 or cache["misses"] != 0:
        problems.append(f"compiled {stats['compiled']}, misses {cache['misses']} (want 0, 0)")
    if cache[f"hits_{tier}"] != n_hits:
        problems.append(f"{tier} hits {cache[f'hits_{tier}']} (want {n_hits})")
    others = {t: cache[f"hits_{t}"] for t in ("memory", "disk", "shared") if t != tier and cache[f"hits_{t}"]}
    if tier != "memory" and others:
        problems.append(f"hits of other tiers {others} (want none)")
    if stats["workers"]["started"] != 0:
        problems.append(f"{stats['workers']['started']} workers started (want 0)")
    return problems


def _pool_kwargs(args: Any, tier: str) -> dict[str, Any]:
    """The pool of a hit or warm step: which folder, which tiers."""
    kwargs: dict[str, Any] = {"workers": args.workers, "target": args.target, "prestart": False}
    if tier == "shared":
        kwargs["cache_dir"] = args.empty_dir
        kwargs["shared_cache"] = args.redis
    else:
        kwargs["cache_dir"] = args.disk
    if args.step == "warm_disk_shared":
        kwargs["shared_cache"] = args.redis
    if args.step in ("hit_disk", "hit_shared"):
        # Every request of every pass goes to the tier measured, none to the memory tier.
        kwargs["memory_cache_size"] = 0
    return kwargs


def _latency(samples: list[float]) -> dict[str, Any]:
    from acompile._bench.run import _ms, _percentile

    if not samples:
        return {"requests": 0}
    return {
        "requests": len(samples),
        "p50_ms": _ms(_percentile(samples, 0.50)),
        "p90_ms": _ms(_percentile(samples, 0.90)),
        "p99_ms": _ms(_percentile(samples, 0.99)),
        "max_ms": _ms(max(samples)),
        "mean_ms": _ms(sum(samples) / len(samples)),
    }


# -- the steps (each runs in its own process) ---------------------------------------------------


async def _step_fill_acompile(args: Any) -> dict[str, Any]:
    import acompile
    from acompile._bench.run import _acompile_outcome, _acompile_specs, _specs

    specs = _specs(args.limit)
    requests = _acompile_specs(args.limit)
    n = len(requests)
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        workers=args.workers, target=args.target, cache_dir=args.disk, shared_cache=args.redis, prestart=True
    ) as pool:
        results = await pool.gather(*requests, return_exceptions=True)
        wall = time.perf_counter() - t0
    # After leaving: the write-behind to Redis has finished (or been given up) by then.
    stats = pool.stats()
    problems = []
    if stats["compiled"] != n:
        problems.append(f"compiled {stats['compiled']} (want {n})")
    if stats["cache"]["shared_writes"] != n:
        problems.append(f"shared writes {stats['cache']['shared_writes']} (want {n})")
    out = _acompile_outcome(specs, results)
    return {"wall_s": wall, "stats": stats, "problems": problems, **out.report()}


async def _step_hit(args: Any) -> dict[str, Any]:
    import anyio

    import acompile
    from acompile._bench.run import _acompile_outcome, _acompile_specs, _specs

    tier = _EXPECTED_TIER[args.step]
    specs = _specs(args.limit)
    requests = _acompile_specs(args.limit)
    n = len(requests)
    passes: list[list[float]] = []
    wrong: list[str] = []
    results: list[Any] = [None] * n
    async with acompile.CompilePool(**_pool_kwargs(args, tier)) as pool:
        if tier == "memory":
            # Into the memory tier first (from disk), not counted.
            for spec in requests:
                _, got = await pool.compile_with_tier(spec)
                if got != "disk":
                    wrong.append(f"loading pass: {spec.name} from {got}")
        entries = Path(args.empty_dir) / "v1"
        for p in range(args.passes):
            if tier == "shared" and p > 0:
                # The previous pass wrote every entry to disk: remove them, so that this pass
                # reads Redis again.
                await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, entries, ignore_errors=True))
            samples = []
            for i, spec in enumerate(requests):
                t = time.perf_counter()
                try:
                    kernel, got = await pool.compile_with_tier(spec)
                except acompile.AcompileError as exc:
                    kernel, got = exc, "error"
                samples.append(time.perf_counter() - t)
                if got != tier:
                    wrong.append(f"pass {p + 1}: {spec.name} from {got}")
                if p == 0:
                    results[i] = kernel
            passes.append(samples)
        stats = pool.stats()
    problems = _stats_problems(stats, n_hits=n * args.passes, tier=tier)
    if wrong:
        problems.append(f"{len(wrong)} requests not from the {tier} tier, e.g. {wrong[:3]}")
    out = _acompile_outcome(specs, results)
    steady = [s for samples in passes[1:] for s in samples]
    return {
        "tier": tier,
        "passes": args.passes,
        "first_pass": _latency(passes[0]),
        "first_request_ms": round(passes[0][0] * 1000, 3),
        "steady": _latency(steady),
        "all": _latency([s for samples in passes for s in samples]),
        "pass_seconds": [round(sum(samples), 4) for samples in passes],
        "stats": stats,
        "problems": problems,
        **out.report(),
    }


async def _step_warm(args: Any) -> dict[str, Any]:
    import anyio

    import acompile
    from acompile._bench.run import _acompile_outcome, _acompile_specs, _specs

    stamps = {"imported": time.time()}
    tier = _EXPECTED_TIER[args.step]
    specs = _specs(args.limit)
    requests = _acompile_specs(args.limit)
    n = len(requests)
    results: list[Any] = [None] * n
    tiers: list[str] = [""] * n
    ready: list[float] = [0.0] * n

    t0 = time.perf_counter()
    async with acompile.CompilePool(**_pool_kwargs(args, tier)) as pool:
        t_entered = time.perf_counter()

        async def one(i: int) -> None:
            try:
                results[i], tiers[i] = await pool.compile_with_tier(requests[i])
            except acompile.AcompileError as exc:
                results[i], tiers[i] = exc, "error"
            ready[i] = time.perf_counter()

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        wall = time.perf_counter() - t0
        stamps["ready"] = time.time()
        stats = pool.stats()
    problems = _stats_problems(stats, n_hits=n, tier=tier)
    wrong = [f"{s.name} from {t}" for s, t in zip(specs, tiers, strict=True) if t != tier]
    if wrong:
        problems.append(f"{len(wrong)} kernels not from the {tier} tier, e.g. {wrong[:3]}")
    out = _acompile_outcome(specs, results)
    return {
        "wall_s": wall,
        "enter_s": t_entered - t0,
        "first_s": min(ready) - t0,
        "stamps": stamps,
        "stats": stats,
        "problems": problems,
        **out.report(),
    }


def _step_triton(args: Any) -> dict[str, Any]:
    from acompile._bench.corpus import compile_spec
    from acompile._bench.run import _gpu_target, _Outcome, _specs

    stamps = {"imported": time.time()}
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = {p.name for p in cache.iterdir()} if cache.is_dir() else set()
    specs = _specs(args.limit)
    out = _Outcome([s.name for s in specs])
    target = _gpu_target(args.target)
    per: list[float] = []
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        t = time.perf_counter()
        try:
            out.set(i, compile_spec(spec, target).asm["cubin"])
        except Exception as exc:
            out.set(i, error=exc)
        per.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    stamps["ready"] = time.time()
    after = {p.name for p in cache.iterdir()} if cache.is_dir() else set()
    new = len(after - before)
    problems = []
    if args.step == "triton_warm_file" and new:
        problems.append(f"{new} new Triton cache entries (want 0)")
    result: dict[str, Any] = {
        "wall_s": wall,
        "first_s": per[0] if per else None,
        "after_first": _latency(per[1:]),
        "new_local_entries": new,
        "stamps": stamps,
        "problems": problems,
        **out.report(),
    }
    if args.step in _TRITON_REDIS_STEPS:
        result["triton_redis_backend"] = _triton_redis_backend_kind()
    return result


def _child_main(argv: list[str]) -> int:
    """Entry of one step's process: run it, write its result as JSON to ``--out``."""
    import argparse
    import traceback

    parser = argparse.ArgumentParser()
    parser.add_argument("--step", required=True, choices=STEPS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--disk", required=True)
    parser.add_argument("--empty-dir", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--passes", type=int, default=PASSES)
    args = parser.parse_args(argv)
    result: dict[str, Any]
    try:
        from acompile._bench.run import _quiet_warnings, _specs

        _quiet_warnings()
        t = time.perf_counter()
        _specs(args.limit)  # imports the corpus, hence Triton: before every clock
        if args.step not in _TRITON_STEPS:
            import acompile  # noqa: F401
        import_s = time.perf_counter() - t
        if args.step in _TRITON_STEPS:
            result = _step_triton(args)
        else:
            import anyio

            func = {"fill_acompile": _step_fill_acompile}.get(args.step)
            if func is None:
                func = _step_hit if args.step in HIT_STEPS else _step_warm
            result = anyio.run(func, args)
        result["import_s"] = import_s
    except BaseException as exc:
        result = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


# -- the Redis server ----------------------------------------------------------------------------


class _RedisServer:
    """A private ``redis-server`` on a free loopback port, without persistence."""

    def __init__(self, executable: str, folder: Path) -> None:
        self.executable = executable
        self.folder = folder
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.version: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            # The port may be taken between this probe and the server's bind: then the server
            # exits, and the next attempt takes another port.
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            cmd = [
                self.executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", str(self.folder),
                "--logfile", str(self.folder / "redis.log"),
            ]  # fmt: skip
            process = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    info = client.info("server")
                except redis.ConnectionError:
                    time.sleep(0.05)
                    continue
                # Ours, not another server that happens to listen there.
                if info.get("process_id") == process.pid:
                    self.port, self.process, self.client = port, process, client
                    self.version = str(info.get("redis_version"))
                    return
                break
            client.close()
            self._stop(process)
        raise RuntimeError(f"could not start {self.executable} on a free port (see {self.folder}/redis.log)")

    def reset_stats(self) -> None:
        self.client.config_resetstat()

    def step_stats(self) -> dict[str, Any]:
        """Commands (calls by name) and connections since the last reset."""
        commands = {
            name.removeprefix("cmdstat_"): value["calls"]
            for name, value in self.client.info("commandstats").items()
            if name.removeprefix("cmdstat_") not in _REDIS_NOISE
        }
        stats = self.client.info("stats")
        return {
            "commands": commands,
            "connections": stats.get("total_connections_received"),
            "keyspace_hits": stats.get("keyspace_hits"),
            "keyspace_misses": stats.get("keyspace_misses"),
        }

    def count_keys(self, pattern: str) -> int:
        return sum(1 for key in self.client.scan_iter(match=pattern, count=1000) if b"lease:" not in key)

    def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        if self.process is not None:
            self._stop(self.process)
            self.process = None

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the benchmark dies (even by SIGKILL), so
    no redis-server outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- the orchestrator ----------------------------------------------------------------------------


def _run_step(
    step: str,
    folder: Path,
    server: _RedisServer,
    *,
    workers: int,
    target: str,
    limit: int | None,
    passes: int,
    timeout: float,
    disk: Path,
    triton_cache: Path,
) -> dict[str, Any]:
    from acompile._bench.run import run_child

    folder.mkdir(parents=True)
    empty_dir = folder / "acompile-empty"
    empty_dir.mkdir()
    own_triton = folder / "triton-cache"
    own_triton.mkdir()
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(triton_cache if step in _TRITON_STEPS else own_triton)
    env["ACOMPILE_CACHE_DIR"] = str(folder / "acompile-default")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    for name in [k for k in env if k.startswith(("TRITON_REDIS_", "TRITON_REMOTE_CACHE"))]:
        del env[name]
    env.pop("TRITON_CACHE_MANAGER", None)
    if step in _TRITON_REDIS_STEPS:
        env["TRITON_CACHE_MANAGER"] = "triton.runtime.cache:RemoteCacheManager"
        env["TRITON_REMOTE_CACHE_BACKEND"] = "acompile._bench.tiers:TritonRedisBackend"
        env["TRITON_REDIS_HOST"] = "127.0.0.1"
        env["TRITON_REDIS_PORT"] = str(server.port)
    out = folder / "result.json"  # run_child reads it
    cmd = [
        sys.executable, "-c", _CHILD_ENTRY, "--step", step, "--out", str(out), "--workers", str(workers),
        "--target", target, "--disk", str(disk), "--empty-dir", str(empty_dir), "--redis", server.url,
        "--passes", str(passes),
    ]  # fmt: skip
    if limit:
        cmd += ["--limit", str(limit)]
    server.reset_stats()
    result = run_child(cmd, env, folder, timeout, "step")
    result["redis"] = server.step_stats()
    if "stamps" in result:
        result["process_to_ready_s"] = result["stamps"]["ready"] - result["spawned_at"]
        result["process_to_imported_s"] = result["stamps"]["imported"] - result["spawned_at"]
    result["triton_cache_dir"] = env["TRITON_CACHE_DIR"]
    result["acompile_empty_dir"] = str(empty_dir)
    return result


def _check_redis(step: str, r: dict[str, Any], n: int) -> list[str]:
    """What the server saw, against what the step must have sent."""
    if "crashed" in r:
        return []
    cmd = r["redis"]["commands"]
    gets, sets, mgets = cmd.get("get", 0), cmd.get("set", 0), cmd.get("mget", 0)
    problems = []
    if step in ("hit_memory", "hit_disk", "warm_disk", "warm_disk_shared") and any(cmd.values()):
        problems.append(f"Redis commands {cmd} (want none: every request is a local hit)")
    if step in ("hit_shared", "warm_shared") and sets:
        problems.append(f"{sets} Redis SETs (want 0: nothing to publish on a hit)")
    if step == "warm_shared" and gets != n:
        problems.append(f"{gets} Redis GETs (want {n})")
    if step in ("triton_warm_redis", "triton_warm_redis_local"):
        if sets:
            problems.append(f"{sets} Redis SETs: Triton compiled (want 0: all remote hits)")
        if not mgets:
            problems.append("no Redis MGET: Triton's remote cache was not used")
    if step == "triton_fill_redis" and not sets:
        problems.append("no Redis SET: Triton's remote cache was not used")
    return problems


def _compare(r: dict[str, Any], reference: dict[str, Any] | None) -> int | None:
    """How many cubins differ from the reference row's (None: nothing to compare)."""
    mine, theirs = r.get("digests") or {}, (reference or {}).get("digests") or {}
    if not mine or not theirs:
        return None
    return sum(1 for k, d in mine.items() if d and theirs.get(k) and d != theirs[k])


def run(
    root: Path,
    *,
    workers: int,
    target: str,
    limit: int | None = None,
    passes: int = PASSES,
    repeats: int = REPEATS,
    timeout: float = 900.0,
    redis_server: str | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Start a private Redis, run every step, each in a fresh process under ``root``, stop Redis;
    returns the JSON section."""
    executable = redis_server or shutil.which("redis-server") or "/usr/bin/redis-server"
    if passes < 2:
        raise ValueError("passes must be at least 2 (the first pass and the steady state)")
    server = _RedisServer(executable, root / "redis")
    steps: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in WARM_STEPS}
    disk = root / "acompile-disk"
    triton_file = root / "triton-file"
    triton_redis_fill = root / "triton-redis-fill"
    for folder in (disk, triton_file, triton_redis_fill):
        folder.mkdir(parents=True)

    def one(step: str, folder: Path, triton_cache: Path | None = None) -> dict[str, Any]:
        if log is not None:
            print(f"[bench] tiers {folder.name} ...", file=log, flush=True)
        r = _run_step(
            step,
            folder,
            server,
            workers=workers,
            target=target,
            limit=limit,
            passes=passes,
            timeout=timeout,
            disk=disk,
            triton_cache=triton_cache or folder / "triton-cache",
        )
        if log is not None:
            status = f"CRASHED {r['crashed']}" if "crashed" in r else f"{r['process_s']:.1f} s"
            if r.get("problems"):
                status += f"; PROBLEMS: {'; '.join(r['problems'])}"
            print(f"[bench] tiers {folder.name}: {status}", file=log, flush=True)
        return r

    t_start = time.perf_counter()
    config: dict[str, Any] = {
        "workers": workers,
        "target": target,
        "limit": limit,
        "passes": passes,
        "repeats": repeats,
        "redis_server": executable,
    }
    try:
        server.start()
    except Exception as exc:
        return {"config": config, "steps": {"redis_server": {"crashed": f"{type(exc).__name__}: {exc}"}}}
    keys: dict[str, int] = {}
    try:
        steps["fill_acompile"] = one("fill_acompile", root / "fill_acompile")
        keys["acompile"] = server.count_keys("acompile*")
        steps["triton_fill_file"] = one("triton_fill_file", root / "triton_fill_file", triton_file)
        steps["triton_fill_redis"] = one("triton_fill_redis", root / "triton_fill_redis", triton_redis_fill)
        keys["triton"] = server.count_keys("triton:*")
        for step in HIT_STEPS:
            steps[step] = one(step, root / step)
        for i in range(repeats):
            for step in WARM_STEPS:
                folder = root / f"{step}-{i + 1}"
                if step == "triton_warm_file":
                    r = one(step, folder, triton_file)
                elif step == "triton_warm_redis_local":
                    # The local folder the previous step (empty, remote hits) filled.
                    r = one(step, folder, root / f"triton_warm_redis-{i + 1}" / "triton-cache")
                else:
                    r = one(step, folder)
                runs[step].append(r)
    finally:
        server.stop()
    for step in WARM_STEPS:
        steps[step] = _combine(runs[step])

    specs = steps["fill_acompile"].get("specs") or steps["triton_fill_file"].get("specs") or 0
    for step, r in steps.items():
        problems = list(r.get("problems") or [])
        for each in runs.get(step) or [r]:
            problems += _check_redis(step, each, specs)
        if step == "fill_acompile" and "crashed" not in r and keys.get("acompile", 0) < specs:
            problems.append(f"{keys.get('acompile')} acompile entries in Redis (want {specs})")
        if step.startswith("triton_"):
            reference = steps["triton_fill_file"] if step != "triton_fill_file" else None
        else:
            reference = steps["fill_acompile"] if step != "fill_acompile" else None
            r["cubins_differing_from_triton"] = _compare(r, steps["triton_fill_file"])
        differ = _compare(r, reference)
        r["cubins_differing_from_fill"] = differ
        if differ:
            problems.append(f"{differ} cubins differ from the fill's")
        if r.get("failed"):
            problems.append(f"{r['failed']} kernels failed")
        r["assertion"] = "; ".join(dict.fromkeys(problems)) or None
    config.update(
        specs=specs,
        redis_version=server.version,
        redis_url=server.url,
        redis_keys=keys,
        seconds=round(time.perf_counter() - t_start, 1),
    )
    return {"config": config, "steps": steps}


_MEDIAN_KEYS = ("wall_s", "first_s", "enter_s", "process_to_ready_s", "process_to_imported_s", "process_s")


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One warm step over its runs: the median of each figure, the first run's details, every
    run kept under ``runs``."""
    from acompile._bench.run import _percentile

    bad = [r for r in runs if "crashed" in r]
    if bad or not runs:
        return dict(bad[0] if bad else {"crashed": "did not run"}, runs=runs)
    out = dict(runs[0])
    out.pop("stamps", None)
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = _percentile(values, 0.5) if values else None
    if runs[0].get("after_first"):
        steady = [r["after_first"]["p50_ms"] for r in runs if r["after_first"].get("p50_ms") is not None]
        out["after_first"] = dict(runs[0]["after_first"], p50_ms_runs=steady)
    out["problems"] = [p for r in runs for p in r.get("problems") or []]
    out["runs"] = [{k: v for k, v in r.items() if k not in ("digests",)} for r in runs]
    return out


def failed(section: dict[str, Any]) -> list[str]:
    """Steps that crashed or whose checks failed."""
    return [f"tiers/{name}" for name, r in section["steps"].items() if "crashed" in r or r.get("assertion")]


# -- the report ----------------------------------------------------------------------------------


def _f(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def _redis_brief(r: dict[str, Any]) -> str:
    cmd = (r.get("redis") or {}).get("commands") or {}
    names = ("get", "mget", "set", "exists", "del")
    shown = [f"{name.upper()} {cmd[name]}" for name in names if cmd.get(name)]
    conns = (r.get("redis") or {}).get("connections")
    if not shown:
        return "none"
    return ", ".join(shown) + (f"; {conns} conn" if conns else "")


def report(section: dict[str, Any], machine: dict[str, Any]) -> str:
    cfg, s = section["config"], section["steps"]
    if "redis_server" in s:
        return f"acompile cache-tier benchmark: CRASHED: {s['redis_server']['crashed']}"
    n = cfg["specs"]
    lines = [
        f"acompile cache-tier benchmark: {n} specs, target {cfg['target']}; redis-server "
        f"{cfg['redis_version']} on {cfg['redis_url']} (loopback, no persistence); "
        f"{cfg['passes']} passes per hit row, {cfg['repeats']} runs per warm-start row (medians)",
        f"machine: {machine['cpu_count']} CPUs ({machine['usable_cpus']} usable), {machine['cpu_model']}",
        f"python {machine['python']}, triton {machine['triton']}, anyio {machine['anyio']}, "
        f"acompile {machine['acompile']} ({machine['acompile_commit']})",
        "",
    ]
    fa, tf, tr = s["fill_acompile"], s["triton_fill_file"], s["triton_fill_redis"]
    if "crashed" in fa:
        lines.append(f"fill, acompile: CRASHED {fa['crashed']}")
    else:
        lines.append(
            f"fill: acompile compiled {fa['stats']['compiled']} kernels in {fa['wall_s']:.2f} s "
            f"({cfg['workers']} workers; pool entry included), {fa['stats']['cache']['disk_writes']} "
            f"disk writes, {fa['stats']['cache']['shared_writes']} Redis writes "
            f"({cfg['redis_keys'].get('acompile')} entries in Redis; Redis: {_redis_brief(fa)})"
        )
    for label, r in (("Triton, file cache", tf), ("Triton, Redis backend", tr)):
        if "crashed" in r:
            lines.append(f"fill, {label}: CRASHED {r['crashed']}")
        else:
            lines.append(
                f"fill: {label}: triton.compile of {r['specs']} kernels in turn {r['wall_s']:.2f} s "
                f"(first {r['first_s']:.2f} s)" + (f"; Redis: {_redis_brief(r)}" if "Redis" in label else "")
            )
    lines.append("")

    header = (
        f"{'hit latency, per request':<28} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'1st pass p50/p99 ms':>20} {'1st req ms':>10}  tier counts (stats)"
    )
    lines += [header, "-" * len(header)]
    for step, label in (
        ("hit_memory", "memory (2nd request)"),
        ("hit_disk", "disk (no shared tier)"),
        ("hit_shared", "shared: Redis, empty disk"),
    ):
        r = s.get(step)
        if r is None:
            continue
        if "crashed" in r:
            lines.append(f"{label:<28} CRASHED: {r['crashed']}")
            continue
        st, fp, c = r["steady"], r["first_pass"], r["stats"]["cache"]
        counts = (
            f"memory {c['hits_memory']}, disk {c['hits_disk']}, shared {c['hits_shared']}, "
            f"misses {c['misses']}, compiled {r['stats']['compiled']}"
        )
        lines.append(
            f"{label:<28} {st['requests']:>8} {_f(st['p50_ms'], '.3f'):>8} {_f(st['p99_ms'], '.3f'):>8} "
            f"{_f(st['max_ms'], '.3f'):>8} {_f(fp['p50_ms'], '.3f') + ' / ' + _f(fp['p99_ms'], '.3f'):>20} "
            f"{_f(r['first_request_ms'], '.2f'):>10}  {counts}"
            + (f"; Redis {_redis_brief(r)}" if step == "hit_shared" else "")
        )
    lines.append(
        f"(sequential requests, steady state = passes 2..{cfg['passes']}; memory_cache_size=0 for disk "
        "and shared, and the disk folder emptied before each shared pass)"
    )
    lines.append("")

    header = (
        f"{'warm start, all kernels':<38} {'first ms':>9} {'all ms':>9} {'entry ms':>9} "
        f"{'interp→all ms':>13} {'per kernel p50/p99 ms':>22}  Redis (server-side)"
    )
    lines += [header, "-" * len(header)]
    for step in (*WARM_STEPS, "triton_fill_file", "triton_fill_redis"):
        r = s.get(step)
        if r is None:
            continue
        label = _LABELS[step]
        if "crashed" in r:
            lines.append(f"{label:<38} CRASHED: {r['crashed']}")
            continue
        per = r.get("after_first")
        per_text = f"{_f(per['p50_ms'], '.2f')} / {_f(per['p99_ms'], '.2f')}" if per else "concurrent"
        lines.append(
            f"{label:<38} {_f(r['first_s'], '.1f', 1000):>9} {_f(r['wall_s'], '.1f', 1000):>9} "
            f"{_f(r.get('enter_s'), '.1f', 1000):>9} {_f(r.get('process_to_ready_s'), '.0f', 1000):>13} "
            f"{per_text:>22}  {_redis_brief(r)}"
        )
    lines += [
        "(first / all: from the clock start in the process, imports done: acompile from before pool "
        "entry, all requests at once; Triton from its first triton.compile, one after the other. "
        "interp→all: from process start, imports included.)",
        "",
        "Notes:",
        "- Triton's remote cache is synchronous: each cache look-up is blocking redis-py calls (MGET of "
        "the group file, then MGET of its files) on the calling thread, with a new client per kernel; it "
        "queries Redis even when the local folder holds every file, and rewrites all of them locally.",
        "  Compare 'Triton, Redis (local folder filled)' with 'Triton, file cache' (no remote): the "
        "difference is what the remote look-up costs on a local hit. acompile with Redis configured "
        "sends no command at all on a disk hit ('acompile, disk (Redis configured)').",
    ]
    backend = tr.get("triton_redis_backend")
    if backend and "repaired" in backend:
        lines.append(
            f"- Triton {machine['triton']}'s RedisRemoteCacheBackend cannot be constructed as shipped "
            "(AttributeError: 'cache_knobs' object has no attribute 'redis'); measured with a subclass "
            "that only repairs that lookup (knobs.redis)."
        )
    problems = [f"{name}: {r['assertion']}" for name, r in s.items() if r.get("assertion")]
    crashed = [f"{name}: CRASHED {r['crashed']}" for name, r in s.items() if "crashed" in r]
    if problems or crashed:
        lines += ["", "CHECKS FAILED:", *(f"- {p}" for p in crashed + problems)]
    return "\n".join(lines)
