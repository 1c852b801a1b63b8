"""The fleet-tier section of ``acompile bench --stores``: a second machine warm from an object
store, a shared folder and Redis, side by side; 1,000 small entries fetched by a fresh process
through acompile's object-store client (obstore) and through aiobotocore; and N processes booting
together on an empty object store (each compile counted).

Each step runs in a fresh process. The section starts a private ``redis-server`` and an
S3-compatible server on loopback (moto's server mode: a Python server, so its absolute rates are
the server's, not a real store's; both clients face the same one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from acompile._bench import harness

SMALL_ENTRIES = 1000
SMALL_SIZE = 1024
CONCURRENCY = 64
WARM = {
    "warm_redis": "Redis",
    "warm_store": "object store (S3 API)",
    "warm_folder": "shared folder (file://)",
}
_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench-access-key",
    "AWS_SECRET_ACCESS_KEY": "bench-secret-key",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_KEY = "the-benchmark's-signing-key"


def _specs(n: int | None, limit: int | None) -> list[Any]:
    """The corpus's requests; with ``n``, that many distinct ones (the corpus again with other
    warp counts)."""
    import acompile
    from acompile._bench.corpus import acompile_specs

    base = acompile_specs(limit)
    if n is None:
        return base
    out = []
    for warps in (4, 2, 8, 1, 16):
        for s in base:
            out.append(
                acompile.TritonSpec(s.fn, s.signature, s.constexprs, num_warps=warps, num_stages=s.num_stages)
            )
    return out[:n]


def _cache(args: argparse.Namespace, places: list[str], **kw: Any) -> Any:
    import acompile

    return acompile.SharedCache(places if len(places) > 1 else places[0], signing_key=_KEY, **kw)


async def fill(args: argparse.Namespace) -> dict[str, Any]:
    """Compile the corpus once, into every fleet tier (write-through), and seed the small entries."""
    import anyio

    import acompile
    from acompile._cache import open_storage

    requests = _specs(None, args.limit)
    cache = _cache(args, [args.redis, args.store, args.folder], write="through")
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        args.workers, target=args.target, cache_dir=args.disk, shared_cache=cache
    ) as pool:
        await pool.gather(*requests)
        stats = pool.stats()
    storage = open_storage(args.store_small, max_connections=CONCURRENCY)
    limiter = anyio.Semaphore(CONCURRENCY)

    async def put(i: int) -> None:
        async with limiter:
            await storage.set(f"small:{i:06d}", os.urandom(SMALL_SIZE))

    async with anyio.create_task_group() as tg:
        for i in range(SMALL_ENTRIES):
            tg.start_soon(put, i)
    return {"wall_s": time.perf_counter() - t0, "compiled": stats["compiled"], "stats": stats}


async def warm(args: argparse.Namespace) -> dict[str, Any]:
    """Every kernel at once, from one fleet tier, on an empty disk folder."""
    import anyio

    import acompile

    stamps = {"imported": time.time()}
    requests = _specs(None, args.limit)
    place = {"warm_redis": args.redis, "warm_store": args.store, "warm_folder": args.folder}[args.step]
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        args.workers, target=args.target, cache_dir=args.empty, shared_cache=_cache(args, [place])
    ) as pool:
        async with anyio.create_task_group() as tg:
            for spec in requests:
                tg.start_soon(pool.compile, spec)
        wall = time.perf_counter() - t0
        stats = pool.stats()
    stamps["ready"] = time.time()
    hits = stats["cache"]["hits_shared"]
    problem = (
        None
        if hits == len(requests) and not stats["compiled"]
        else f"shared hits {hits}, compiled {stats['compiled']}"
    )
    return {"wall_s": wall, "stamps": stamps, "stats": stats, "assertion": problem}


async def fetch_obstore(args: argparse.Namespace) -> dict[str, Any]:
    """The small entries through acompile's object-store client, CONCURRENCY at once."""
    import anyio

    from acompile._cache import open_storage

    stamps = {"imported": time.time()}
    storage = open_storage(args.store_small, max_connections=CONCURRENCY)
    limiter = anyio.Semaphore(CONCURRENCY)
    got = 0

    async def one(i: int) -> None:
        nonlocal got
        async with limiter:
            value = await storage.get_bounded(f"small:{i:06d}", 1 << 20)
            got += isinstance(value, bytes) and len(value) == SMALL_SIZE

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(SMALL_ENTRIES):
            tg.start_soon(one, i)
    wall = time.perf_counter() - t0
    stamps["ready"] = time.time()
    return {
        "wall_s": wall,
        "stamps": stamps,
        "got": got,
        "assertion": None if got == SMALL_ENTRIES else f"got {got}",
    }


async def fetch_aiobotocore(args: argparse.Namespace) -> dict[str, Any]:
    """The same entries through aiobotocore (botocore's async client), CONCURRENCY at once."""
    import anyio
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    stamps = {"imported": time.time()}
    bucket, prefix = args.small_bucket, args.small_prefix
    got = 0
    t0 = time.perf_counter()
    session = get_session()
    config = AioConfig(max_pool_connections=CONCURRENCY)
    async with session.create_client(
        "s3", endpoint_url=args.endpoint, region_name="us-east-1", config=config
    ) as client:
        limiter = anyio.Semaphore(CONCURRENCY)

        async def one(i: int) -> None:
            nonlocal got
            async with limiter:
                reply = await client.get_object(Bucket=bucket, Key=f"{prefix}/small/{i:06d}")
                async with reply["Body"] as body:
                    got += len(await body.read()) == SMALL_SIZE

        t1 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(SMALL_ENTRIES):
                tg.start_soon(one, i)
        fetch = time.perf_counter() - t1
    wall = time.perf_counter() - t0
    stamps["ready"] = time.time()
    # (A baseline's short reads are reported beside its time, not failed: they are its own.)
    return {"wall_s": fetch, "with_client_s": wall, "stamps": stamps, "got": got}


async def boot(args: argparse.Namespace) -> dict[str, Any]:
    """One of the processes booting together on an empty object store: every kernel, at once."""
    import anyio

    import acompile

    requests = _specs(args.kernels, None)
    # Start together: each waits for the moment the orchestrator set (its imports done).
    await anyio.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.perf_counter()
    async with acompile.CompilePool(
        args.workers, target=args.target, cache_dir=args.empty, shared_cache=_cache(args, [args.boot_store])
    ) as pool:
        results = await pool.gather(*requests, return_exceptions=True)
        stats = pool.stats()
    ok = sum(not isinstance(r, BaseException) for r in results)
    return {"wall_s": time.perf_counter() - t0, "compiled": stats["compiled"], "ok": ok, "stats": stats,
            "assertion": None if ok == len(requests) else f"{len(requests) - ok} failed"}  # fmt: skip


CHILDREN = {
    "fill": fill,
    **dict.fromkeys(WARM, warm),
    "fetch_obstore": fetch_obstore,
    "fetch_aiobotocore": fetch_aiobotocore,
    "boot": boot,
}


# -- the orchestrator ----------------------------------------------------------------------------


@contextlib.contextmanager
def s3_server(folder: Path) -> Any:
    """An S3-compatible server on a free loopback port (moto's server mode): yields its endpoint."""
    import socket

    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True, env={**os.environ, **_CREDENTIALS})  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/", timeout=1).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the S3-compatible server (moto) did not start") from None
                time.sleep(0.05)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)


def _bucket(endpoint: str, name: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT"), timeout=10).read()


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers, run every step in a fresh process: the JSON section."""
    from acompile._bench.tiers import redis_server

    if need := [m for m in ("moto", "obstore", "aiobotocore") if not _importable(m)]:
        return {"skipped": f"needs {', '.join(need)} (pip install 'acompile[dev]')", "steps": {}}
    executable = args.redis_server or shutil.which("redis-server") or "/usr/bin/redis-server"
    steps: dict[str, dict[str, Any]] = {}
    kernels = getattr(args, "boot_kernels", 200)
    processes = getattr(args, "boot_processes", 8)
    try:
        with redis_server(executable, root / "redis") as port, s3_server(root / "s3") as endpoint:
            for bucket in ("fleet", "boot"):
                _bucket(endpoint, bucket)
            store_options = f"endpoint={endpoint}&allow_http=true&region=us-east-1"
            folder = root / "nfs"
            folder.mkdir(parents=True, exist_ok=True)
            base = {
                "workers": args.workers, "target": args.target, "limit": args.limit,
                "disk": str(root / "disk"), "redis": f"redis://127.0.0.1:{port}/0",
                "store": f"s3://fleet/acompile?{store_options}", "folder": f"file://{folder}",
                "store_small": f"s3://fleet/bench?{store_options}", "endpoint": endpoint,
                "small_bucket": "fleet", "small_prefix": "bench",
                "boot_store": f"s3://boot/acompile?{store_options}", "kernels": kernels,
            }  # fmt: skip
            env = dict(_CREDENTIALS)

            def step(name: str, child: str, **extra: Any) -> dict[str, Any]:
                print(f"[bench] stores {name} ...", file=sys.stderr, flush=True)
                where = root / name
                options = {**base, "step": child, "empty": str(where / "empty"), **extra}
                result = harness.run_child(
                    "stores", child, options, where, harness.child_env(where, **env), 1800
                )
                steps[name] = result
                return result

            step("fill", "fill")
            for turn in range(2):  # taking turns: the second round is the one reported
                for name in WARM:
                    step(name if turn else f"{name}_first", name)
                step("fetch_obstore" if turn else "fetch_obstore_first", "fetch_obstore")
                step("fetch_aiobotocore" if turn else "fetch_aiobotocore_first", "fetch_aiobotocore")
            steps["boot"] = _boot(root, base, env, processes, endpoint)
    except RuntimeError as exc:
        steps["servers"] = {"crashed": str(exc)}
    return {"workers": args.workers, "steps": steps, "kernels": kernels, "processes": processes}


def _boot(
    root: Path, base: dict[str, Any], env: dict[str, str], processes: int, endpoint: str
) -> dict[str, Any]:
    """``processes`` fresh processes at once on the empty ``boot`` bucket; the compiles counted
    and the leases left listed."""
    import json

    print(
        f"[bench] stores boot: {processes} processes x {base['kernels']} kernels ...",
        file=sys.stderr,
        flush=True,
    )
    start_at = time.time() + 15  # after every process has imported what it needs
    children = []
    for i in range(processes):
        where = root / f"boot-{i}"
        where.mkdir(parents=True, exist_ok=True)
        options = {**base, "workers": 1, "step": "boot", "empty": str(where / "empty"), "start_at": start_at}
        out = str(where / "result.json")
        cmd = [sys.executable, "-m", "acompile._bench.stores", "--child", "boot", "--out", out]
        cmd += ["--options", json.dumps(options)]
        log = open(where / "log.txt", "wb")
        children.append(
            (
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=harness.child_env(where, **env)
                ),
                log,
                where,
            )
        )
    results = []
    for process, log, where in children:
        process.wait(timeout=3600)
        log.close()
        try:
            results.append(json.loads((where / "result.json").read_text()))
        except (OSError, ValueError):
            results.append({"crashed": (where / "log.txt").read_text()[-2000:]})
    wall = time.time() - start_at
    leases = _leases(endpoint)
    compiled = sum(r.get("compiled", 0) for r in results)
    ok = [r.get("ok", 0) for r in results]
    problems = []
    if compiled != base["kernels"]:
        problems.append(f"{compiled} compiles for {base['kernels']} kernels")
    if leases:
        problems.append(f"{len(leases)} leases left")
    if any(n != base["kernels"] for n in ok):
        problems.append(f"answered {ok}")
    return {
        "wall_s": max((r.get("wall_s", 0.0) for r in results), default=None),
        "compiled": compiled,
        "ok": ok,
        "leases_left": len(leases),
        "since_start_s": wall,
        "assertion": "; ".join(problems) or None,
    }


def _leases(endpoint: str) -> list[str]:
    import obstore
    from obstore.store import S3Store

    store = S3Store("boot", endpoint=endpoint, region="us-east-1", client_options={"allow_http": True},
                    access_key_id=_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                    secret_access_key=_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    return [item["path"] for chunk in obstore.list(store, prefix="acompile/lease/") for item in chunk]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def failed(section: dict[str, Any]) -> list[str]:
    bad = [s for s, r in section["steps"].items() if "crashed" in r or r.get("assertion")]
    return [f"stores {s}" for s in bad]


def report(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"fleet tiers: skipped ({section['skipped']})"
    steps, f = section["steps"], harness.fmt
    warm = [
        [label, f(steps[s].get("wall_s"), ".2f"), f(steps[s].get("process_to_ready_s"), ".2f"),
         f((steps[s].get("wall_s") or 0) / (steps["warm_redis"].get("wall_s") or 1), ".2f")]
        for s, label in WARM.items() if s in steps and "crashed" not in steps[s]
    ]  # fmt: skip
    fetch = []
    for s, label in (("fetch_obstore", "acompile's client (obstore)"), ("fetch_aiobotocore", "aiobotocore")):
        r = steps.get(s, {})
        if "crashed" in r or not r:
            continue
        rate = SMALL_ENTRIES / r["wall_s"] if r.get("wall_s") else None
        fetch.append(
            [
                label,
                f(r.get("wall_s"), ".3f"),
                f(rate, ".0f"),
                f(r.get("process_to_ready_s"), ".2f"),
                str(r.get("got")),
            ]
        )
    boot = steps.get("boot", {})
    lines = [
        f"fleet tiers, {section['workers']} workers, the default corpus",
        harness.table(["second machine, warm from", "pool s", "whole process s", "x Redis"], warm),
        "",
        harness.table(
            [
                f"{SMALL_ENTRIES} entries of {SMALL_SIZE} B, fresh process, {CONCURRENCY} at once",
                "fetch s",
                "requests/s",
                "whole process s",
                "read whole",
            ],
            fetch,
        ),
        "",
        f"{section['processes']} processes x {section['kernels']} kernels booting on an empty object store: "
        f"{boot.get('compiled')} compiles, answered {boot.get('ok')}, {boot.get('leases_left')} leases left, "
        f"slowest process {f(boot.get('wall_s'), '.1f')} s",
    ]
    for name in failed(section):
        bad = steps[name.removeprefix("stores ")]
        lines.append(f"{name}: {bad.get('crashed') or bad.get('assertion')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The children's entry (``--child``); the section itself runs from ``acompile bench``."""
    return harness.child_main(CHILDREN, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
