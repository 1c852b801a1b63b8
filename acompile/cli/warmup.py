"""``acompile warmup``: compile every kernel of a warm-up manifest (docs/manifest.md) into the
cache folder, run its ``[[torch]]`` entries with torch.compile served and build its
``[[flashinfer]]`` modules; with ``--shared-cache``, fill the shared tier too and check that every
kernel reached it. Prints a table of the kernels and a summary; ``--json`` writes the results."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import anyio

from acompile._cache import DiskTier
from acompile._errors import AcompileError, UntrustedFolderError
from acompile._outputs import write_own_file
from acompile.cli._common import (
    Progress,
    add_cache_dir,
    add_workers,
    output_path_problem,
    shared_places,
    shared_url_problem,
    shown,
    signing_key_error,
    signing_key_problem,
)

WARMUP_EPILOG = """\
columns: wait is the time a kernel queued for a free worker, compile the time a worker spent on it
(both empty for a kernel the cache answered). A variant the manifest lists more than once is
compiled and counted once; the summary says how many such duplicates were skipped.

with --shared-cache, the kernels are also published to the shared tier, and the summary says how
many were found there, published, refused (entries that failed their signature check) and how
many operations failed. A kernel that was already in the local cache is looked up in the shared
tier and published there if absent. Unless --no-require-shared is given, warm-up exits 1 when
fewer kernels are in the shared tier at the end (found or published) than compiled successfully:
the tier was unreachable, refused writes, or dropped them.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    warm = sub.add_parser(
        "warmup",
        help="compile every kernel of a manifest into the cache",
        description="Compile every kernel of a warm-up manifest into the cache "
        "(the manifest's format: docs/manifest.md).",
        epilog=WARMUP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    warm.add_argument(
        "manifest", type=Path, help="a TOML file of [[kernel]] (and [[torch]], [[flashinfer]]) entries"
    )
    add_workers(warm)
    warm.add_argument(
        "--target", default=None, help="target for kernels whose entry names none, e.g. cuda:90"
    )
    warm.add_argument(
        "--farm",
        metavar="ADDRESS",
        default=None,
        help="compile on a Ray cluster (auto, HOST:PORT, ray://HOST:PORT; docs/farm.md) "
        'instead of local workers; needs pip install "acompile[ray]"',
    )
    add_cache_dir(warm)
    warm.add_argument(
        "--json", dest="json_path", type=Path, default=None, help="also write the results as JSON"
    )
    warm.add_argument(
        "--shared-cache",
        default=os.environ.get("ACOMPILE_SHARED_CACHE"),
        help="also fill a shared tier, e.g. redis://host:6379/0, s3://bucket/prefix, "
        "file:///mnt/nfs/acompile, or several separated by spaces (default: $ACOMPILE_SHARED_CACHE); "
        "entries are signed with $ACOMPILE_SIGNING_KEY when it is set (required for [[torch]] and "
        "[[flashinfer]] entries: they hold code)",
    )
    warm.add_argument(
        "--require-shared",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --shared-cache: exit 1 unless every kernel that compiled is in the shared tier "
        "at the end (default: required)",
    )


def run(args: argparse.Namespace) -> int:
    from acompile._manifest import load_flashinfer_entries, load_manifest, load_torch_entries

    if args.shared_cache is not None and (problem := shared_url_problem(args.shared_cache)):
        print(f"acompile warmup: --shared-cache: {problem}", file=sys.stderr)
        return 2
    if args.shared_cache is not None and (problem := signing_key_error()):
        # Set but empty (a secret that failed to mount) is never "no key": refused before any work.
        print(f"acompile warmup: {problem}", file=sys.stderr)
        return 2
    if args.target is not None and not args.target.strip():
        print("acompile warmup: --target is empty; pass one such as --target cuda:90", file=sys.stderr)
        return 2
    if args.json_path is not None and (problem := output_path_problem(args.json_path)):
        print(f"acompile warmup: cannot write --json {args.json_path}: {problem}", file=sys.stderr)
        return 2
    try:
        specs = load_manifest(args.manifest)
        models = load_torch_entries(args.manifest)
        jits = load_flashinfer_entries(args.manifest)
    except AcompileError as exc:
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 2
    for entries, table, why in (
        (models, "torch", "torch.compile's cache entries hold code the processes that read them run"),
        (jits, "flashinfer", "a FlashInfer module is host code, which replicas load from a signed tier only"),
    ):
        if entries and args.shared_cache is not None and signing_key_problem():
            print(
                f"acompile warmup: [[{table}]] entries with --shared-cache need $ACOMPILE_SIGNING_KEY: {why}",
                file=sys.stderr,
            )
            return 2
    args.models = models
    args.jits = jits
    # A variant listed more than once (records concatenated, defaults that make two entries
    # equal) is one kernel: compiled once, and counted once in the summary.
    specs, args.duplicates = _distinct(specs)
    if args.target is None and any(s.target is None for s in specs):
        print(
            'acompile warmup: some kernels name no target: add targets = ["cuda:90"] to the manifest '
            "or pass --target cuda:90",
            file=sys.stderr,
        )
        return 2
    if args.target is not None and specs and all(s.target is not None for s in specs):
        # Not an error (a script may pass --target for manifests of either kind), but never silent.
        named = sorted({str(s.target) for s in specs})
        print(
            f"acompile warmup: note: --target {args.target} is not used: every kernel in "
            f"{args.manifest} names its targets ({', '.join(named)}); --target is for entries that name none",
            file=sys.stderr,
        )
    try:
        return anyio.run(_warmup_async, specs, args)
    except (ValueError, UntrustedFolderError) as exc:  # the pool's own arguments; another's folder
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 2
    except AcompileError as exc:
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        Progress.end_line()
        print("acompile warmup: interrupted", file=sys.stderr)
        return 130


async def _warmup_async(specs: list[Any], args: argparse.Namespace) -> int:
    from acompile._compiler import CompilePool
    from acompile._farm import RayFarm
    from acompile._workers import Split

    rows: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    modules: list[dict[str, Any]] = []
    progress = Progress(len(specs) + len(args.models) + len(args.jits), sys.stderr)
    t0 = time.perf_counter()
    shared: dict[str, int] = {}
    preload = (("triton",) if specs else ()) + (("inductor",) if args.models else ())
    workers: Any = args.workers
    if args.farm:
        # The farm alone, or with --workers too, local workers for the urgent lane beside it.
        farm = RayFarm(args.farm)
        workers = farm if args.workers is None else Split(args.workers, farm)
    with tempfile.TemporaryDirectory(prefix="acompile-warmup-") as scratch:
        trace_path = Path(scratch) / "trace.json"
        async with CompilePool(
            workers,
            target=args.target or (specs[0].target if specs else None),
            preload=preload,
            cache_dir=args.cache_dir,
            prestart=False,
            # Compiling is this command's whole job, not a background task: its workers run at
            # its own priority, keeping their share of a machine busy with other work.
            worker_nice=0,
            shared_cache=shared_places(args.shared_cache) if args.shared_cache is not None else None,
        ) as pool:
            # The pool's trace says, per kernel, how long it queued and how long a worker took.
            async with pool.trace(trace_path):

                async def one(spec: Any) -> None:
                    start = time.perf_counter()
                    row = {
                        "kernel": spec.fn.__name__,
                        "target": str(spec.target or args.target),
                        "constexprs": dict(spec.constexprs or {}),
                        "num_warps": spec.num_warps,
                        "num_stages": spec.num_stages,
                    }
                    try:
                        kernel, tier = await pool.compile_with_tier(spec, background=True)
                    except AcompileError as exc:
                        row.update(result="failed", error=str(exc))
                    else:
                        cached = tier in ("memory", "disk", "shared")
                        row.update(result="cached" if cached else "compiled", tier=tier, key=kernel.key)
                    row["seconds"] = time.perf_counter() - start
                    rows.append(row)
                    progress.advance(row["result"])

                async with anyio.create_task_group() as tg:
                    for spec in specs:
                        tg.start_soon(one, spec)
            torch_keys = await _warm_models(pool, args.models, models, progress) if args.models else set()
            if args.jits:
                torch_keys |= await _warm_flashinfer(pool, args.jits, modules, progress)
            if args.shared_cache is not None:
                shared["confirmed"] = await _confirm_local_hits(pool, rows)
                if torch_keys:
                    # torch.compile's entries: each in the shared tier now (found, or published
                    # from the disk where its write-behind did not make it).
                    found, written = await pool.share(torch_keys)
                    shared["torch_entries"] = len(torch_keys)
                    shared["torch_missing"] = len(torch_keys) - found - written
        _add_job_times(rows, trace_path)
    # Variants spelled apart that are one kernel (its target named, or left to --target): one
    # key, one row.
    rows, also = _one_row_a_key(rows)
    args.duplicates += also
    elapsed = time.perf_counter() - t0
    progress.close()
    if rows:
        _print_summary(rows, elapsed, pool.cache_dir, sys.stdout, duplicates=args.duplicates)
    if models:
        _print_models(models, sys.stdout)
    if modules:
        _print_modules(modules, sys.stdout)
    ok = not any(r["result"] == "failed" for r in rows + models + modules)
    # Filling the cache folder is this command's job: kernels that are not there now (a folder
    # it could not write to, a disk that filled up) fail it, as the shared tier's do below.
    keys = {r["key"] for r in rows if "key" in r}
    absent = await anyio.to_thread.run_sync(_absent_from_disk, pool.cache_dir, keys)
    if absent:
        print(
            f"acompile warmup: {absent} of {len(keys)} kernels are not in the cache folder "
            f"{pool.cache_dir} (see the warning above): the next process will compile them again",
            file=sys.stderr,
        )
        ok = False
    if args.shared_cache is not None and not rows:
        # Only torch.compile models: their entries are what the shared tier must hold.
        if _report_served_entries(shared, args, alone=True):
            ok = False
    elif args.shared_cache is not None:
        # Read after the pool has closed: leaving it waits for the publications in flight.
        cache = pool.stats()["cache"]
        keys = {r["key"] for r in rows if r["result"] != "failed"}
        shared.update(
            kernels=len(keys),
            found=len({r["key"] for r in rows if r.get("tier") == "shared"}) + shared["confirmed"],
            published=cache["shared_writes"],
            refused=cache["shared_rejected"],
            errors=cache["shared_errors"],
            not_published=cache["shared_write_failures"],
        )
        missing = shared["kernels"] - shared["found"] - shared["published"]
        shared["missing"] = max(0, missing)
        _print_shared_summary(shared, args.shared_cache, sys.stdout)
        namespace = cache["shared_namespace"]
        if namespace == "unsigned":
            # A fleet's servers hold its key: what went to the unsigned namespace, they never read.
            went = "went" if shared["published"] or shared["found"] else "were to go"
            print(
                f"acompile warmup: no signing key ($ACOMPILE_SIGNING_KEY is not set): the entries {went} "
                "to the shared tier's unsigned namespace, which replicas with a key never read",
                file=sys.stderr,
            )
        else:
            print(f"  signed: namespace {namespace} (the id of $ACOMPILE_SIGNING_KEY)", file=sys.stdout)
        if _report_served_entries(shared, args, alone=False):
            ok = False
        if shared["missing"] and args.require_shared:
            # Why, where the tier is off at the end (a URL that parses but cannot work: a Redis
            # database the server does not have), not only in a warning far above.
            off = f"; it is off: {cache['shared_problem']}" if cache.get("shared_problem") else ""
            print(
                f"acompile warmup: {shared['missing']} of {shared['kernels']} kernels did not reach the "
                f"shared tier {shown(args.shared_cache)} ({shared['errors']} failed operations, "
                f"{shared['refused']} refused entries, {shared['not_published']} not published: over "
                f"?max_value= or a fault, see the warnings above){off}; is it reachable and writable? "
                "(--no-require-shared: fill the local cache only, exit 0)",
                file=sys.stderr,
            )
            ok = False
    if args.json_path:
        document: dict[str, Any] = {"seconds": elapsed, "kernels": rows, "duplicates": args.duplicates}
        if models:
            document["torch"] = models
        if shared:
            document["shared"] = shared
        try:
            write_own_file(args.json_path, json.dumps(document, indent=2, default=str).encode())
        except OSError as exc:
            # The warm-up itself is done (the table above says how it went): only the report
            # could not be written.
            print(
                f"acompile warmup: the kernels are warmed up, but --json {args.json_path} cannot be "
                f"written: {exc.strerror or exc}",
                file=sys.stderr,
            )
            ok = False
    return 0 if ok else 1


async def _warm_models(
    pool: Any, entries: list[Any], models: list[dict[str, Any]], progress: Any
) -> set[str]:
    """Run each ``[[torch]]`` entry with torch.compile served by the pool, one after the other
    (torch.compile runs on a thread; its compiles on the pool); save its Mega-Cache artifacts
    where the entry names them. Returns the keys of the entries torch.compile wrote."""
    from acompile import inductor

    unsigned = signing_key_problem() is not None  # refused before any work where a shared tier needs one
    async with inductor._serve_trusting(pool, trust_unsigned=unsigned) as serving:
        if not serving.active:
            for entry in entries:
                models.append({"torch": entry.ref, "result": "failed", "error": "this torch is not served"})
                progress.advance("failed")
            return set()
        for entry in entries:
            before = await anyio.to_thread.run_sync(serving.stats)
            start = time.perf_counter()
            row: dict[str, Any] = {"torch": entry.ref}
            try:
                await anyio.to_thread.run_sync(entry.fn)
                if entry.artifacts:
                    row["artifacts"] = await anyio.to_thread.run_sync(serving.save_artifacts, entry.artifacts)
            except Exception as exc:  # the user's code: any error is this entry's failure
                row.update(result="failed", error=f"{type(exc).__name__}: {exc}")
            else:
                after = await anyio.to_thread.run_sync(serving.stats)
                graphs = after["caches"]["fx-graph"]
                compiled = graphs["misses"] - before["caches"]["fx-graph"]["misses"]
                row.update(result="compiled" if compiled else "cached", graphs_compiled=compiled)
                row["graphs"] = graphs["gets"] - before["caches"]["fx-graph"]["gets"]
            row["seconds"] = time.perf_counter() - start
            models.append(row)
            progress.advance(row["result"])
        return serving.written()


def _served_what(args: argparse.Namespace) -> str:
    """What the entries warm-up checks in the shared tier (besides kernels) are of."""
    kinds = [what for what, there in (("torch.compile", args.models), ("FlashInfer", args.jits)) if there]
    return " and ".join(kinds) or "served"


def _report_served_entries(shared: dict[str, int], args: argparse.Namespace, *, alone: bool) -> bool:
    """Say how many of the entries torch.compile and FlashInfer wrote are in the shared tier now:
    as the shared tier's line where the warm-up had no kernels (``alone``), else as a line under
    the kernels' (where there are such entries). Returns whether the warm-up fails for them: some
    did not reach the tier, and --require-shared (then said on stderr)."""
    entries, missing = shared.get("torch_entries", 0), shared.get("torch_missing", 0)
    what = _served_what(args)
    if alone:
        print(
            f"shared tier {shown(args.shared_cache)}: {entries - missing} of {entries} {what} entries there",
            file=sys.stdout,
        )
    elif entries:
        print(f"  and {entries - missing} of {entries} {what} entries there", file=sys.stdout)
    if not (missing and args.require_shared):
        return False
    counted = f"{missing}" if alone else f"{missing} of {entries}"
    print(
        f"acompile warmup: {counted} {what} entries did not reach the shared tier {shown(args.shared_cache)}",
        file=sys.stderr,
    )
    return True


async def _warm_flashinfer(
    pool: Any, entries: list[Any], modules: list[dict[str, Any]], progress: Any
) -> set[str]:
    """Build each ``[[flashinfer]]`` entry's module with FlashInfer served by the pool, one after
    the other (FlashInfer's build runs on a thread; ninja on the pool). Returns the keys of the
    entries the modules were stored or found under."""
    from acompile import inductor

    unsigned = signing_key_problem() is not None  # refused before any work where a shared tier needs one
    async with inductor._serve_trusting(
        pool, trust_unsigned=unsigned, publish_library_hits=True, jits=("flashinfer",)
    ) as serving:

        def counts() -> dict[str, Any]:
            stats: dict[str, Any] = serving.stats().get("jit", {}).get("flashinfer", {})
            return stats

        for entry in entries:
            before = await anyio.to_thread.run_sync(counts)
            start = time.perf_counter()
            row: dict[str, Any] = {"flashinfer": entry.ref}
            if entry.key is None:
                row["args"] = list(entry.args)
            else:  # its args are the record's fields, sources and all
                row["key"] = entry.key
            try:
                made = await anyio.to_thread.run_sync(
                    functools.partial(entry.generator, *entry.args, **entry.kwargs)
                )
                if _is_jit_spec(made):
                    row["module"] = str(getattr(made, "name", "?"))
                    await anyio.to_thread.run_sync(made.build)
                # Else the generator built what it makes itself, served (a CuTe DSL kernel's
                # builder returns the kernel: FlashInfer compiles it in this process).
            except Exception as exc:  # the generator or the build: this entry's failure
                row.update(result="failed", error=f"{type(exc).__name__}: {exc}")
            else:
                stats = await anyio.to_thread.run_sync(serving.stats)
                after = stats.get("jit", {}).get("flashinfer", {})
                unsupported = stats.get("jit_unsupported", {}).get("flashinfer")
                built = sum(
                    after.get(k, 0) - before.get(k, 0) for k in ("builds", "in_process", "local_builds")
                )
                hits = sum(after.get("hits", {}).values()) - sum(before.get("hits", {}).values())
                unserved = after.get("unserved", 0) - before.get("unserved", 0)
                if unserved:
                    # Built by FlashInfer as without acompile (its warning says why): nothing of
                    # it is in the shared tier.
                    row.update(
                        result="failed",
                        error="built, but acompile could not key it (see its warning): nothing published",
                    )
                elif unsupported or "jit" not in stats:
                    # Built by FlashInfer alone: nothing of it is in the cache or the shared tier.
                    why = unsupported or "this torch is not served"
                    row.update(result="failed", error=f"FlashInfer is not served ({why})")
                elif not built and not hits:
                    row.update(result="failed", error="FlashInfer built nothing through acompile")
                elif entry.key is not None and entry.key not in await anyio.to_thread.run_sync(
                    serving.written
                ):
                    # The servers look the module up under the recorded key: this one is another.
                    here = after.get("keys", {}).get(row["module"], "?")
                    row.update(
                        result="failed",
                        error=f"built here under the key {here}, not the recorded {entry.key} (another "
                        "nvcc, host compiler or header here: the servers would not find it); `acompile "
                        "cache explain KEY` of each, here and beside the server's entry, shows its parts",
                    )
                else:
                    row.update(result="compiled" if built else "cached")
            row["seconds"] = time.perf_counter() - start
            modules.append(row)
            progress.advance(row["result"])
        return serving.written()


def _is_jit_spec(made: Any) -> bool:
    """Whether a ``[[flashinfer]]`` generator made a FlashInfer ``JitSpec`` (to build), rather
    than building its kernel itself."""
    core = sys.modules.get("flashinfer.jit.core")
    spec_class = getattr(core, "JitSpec", None)
    return isinstance(spec_class, type) and isinstance(made, spec_class)


def _print_modules(modules: list[dict[str, Any]], out: TextIO) -> None:
    print("\nFlashInfer modules:", file=out)
    for m in modules:
        name = m.get("module") or m["flashinfer"]
        if m["result"] == "failed":
            print(f"  {name}: FAILED: {m['error']}", file=out)
        else:
            print(f"  {name}: {m['result']} in {m['seconds']:.2f} s", file=out)


def _print_models(models: list[dict[str, Any]], out: TextIO) -> None:
    print("\ntorch.compile models:", file=out)
    for m in models:
        extra = f", artifacts {m['artifacts']}" if m.get("artifacts") else ""
        if m["result"] == "failed":
            print(f"  {m['torch']}: FAILED: {m['error']}", file=out)
        else:
            if m["graphs"]:
                graphs = (
                    f"{m['graphs']} graph{'' if m['graphs'] == 1 else 's'}, {m['graphs_compiled']} compiled"
                )
            else:
                graphs = "Inductor's own cache in this folder answered"
            print(f"  {m['torch']}: {m['result']} ({graphs}) in {m['seconds']:.2f} s{extra}", file=out)


def _absent_from_disk(cache_dir: Path, keys: set[str]) -> int:
    """How many of ``keys`` (the kernels warm-up compiled or found) are not in the cache folder
    (blocking: a stat per kernel)."""
    disk = DiskTier(cache_dir)
    return sum(1 for key in keys if not disk.path(key).is_file())


async def _confirm_local_hits(pool: Any, rows: list[dict[str, Any]]) -> int:
    """Make sure the kernels the local cache answered are in the shared tier too (a local hit
    never touches it): ``pool.share`` looks each up there and publishes it from the disk where it
    is absent. Returns how many were found there; publications count in ``shared_writes``.
    """
    from_pool = {r["key"] for r in rows if r.get("tier") in ("compile", "shared")}
    local = sorted({r["key"] for r in rows if r.get("tier") in ("memory", "disk")} - from_pool)
    found, _ = await pool.share(local)
    if "shared_tiers" in pool.stats()["cache"]:
        # A chain: a kernel found in its first tier may be missing from a later one (a new
        # object store behind a warm Redis). Each must hold it: they are filled from the tier
        # that has it. Counted as found where every tier held it already.
        hits = sorted({r["key"] for r in rows if r.get("tier") == "shared"})
        also, _ = await pool.share(hits)
        found += also - len(hits)  # the rows already count these as found
    return int(found)


def _add_job_times(rows: list[dict[str, Any]], trace_path: Path) -> None:
    """``wait_seconds`` (queued for a worker) and ``compile_seconds`` (on the worker) per row
    that a worker compiled, from the pool's trace; None for the others."""
    waits: dict[str, float] = {}
    compiles: dict[str, float] = {}
    try:
        events = json.loads(trace_path.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError):
        events = []
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    for event in events:
        key = event.get("args", {}).get("key")
        if event.get("ph") != "X" or key is None:
            continue
        if event["name"] == "queue wait":
            waits[key] = event["dur"] / 1e6
        elif tracks.get(event["tid"], "").startswith("worker"):
            compiles[key] = event["dur"] / 1e6
    for row in rows:
        compiled = row["result"] == "compiled"
        row["wait_seconds"] = waits.get(row.get("key", "")) if compiled else None
        row["compile_seconds"] = compiles.get(row.get("key", "")) if compiled else None


def _distinct(specs: list[Any]) -> tuple[list[Any], int]:
    """``specs`` without the ones equal to an earlier one (field by field, the kernel by
    identity), and how many were left out. A spec whose fields are not plain data is kept: the
    pool's single flight compiles it once all the same, and ``_one_row_a_key`` counts it once."""
    seen: set[str] = set()
    kept = []
    for spec in specs:
        fields = [id(spec.fn), spec.kernel_name, spec.signature, spec.constexprs, spec.num_warps,
                  spec.num_stages, str(spec.target), spec.attrs, spec.options]  # fmt: skip
        try:
            identity = json.dumps(fields, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            kept.append(spec)
            continue
        if identity not in seen:
            seen.add(identity)
            kept.append(spec)
    return kept, len(specs) - len(kept)


# Which of the rows of one key is shown: the one that says what this run did to it.
_RESULT_ORDER = {"compiled": 0, "cached": 1, "failed": 2}


def _one_row_a_key(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """One row a kernel's key (rows without a key, failed before one was computed, each stay),
    and how many rows were left out."""
    best: dict[str, dict[str, Any]] = {}
    kept: list[dict[str, Any]] = []
    for row in rows:
        key = row.get("key")
        if key is None:
            kept.append(row)
        elif key not in best or _RESULT_ORDER[row["result"]] < _RESULT_ORDER[best[key]["result"]]:
            best[key] = row
    kept.extend(best.values())
    return kept, len(rows) - len(kept)


def _print_summary(
    rows: list[dict[str, Any]], elapsed: float, cache_dir: Path, out: TextIO, *, duplicates: int = 0
) -> None:
    rows = sorted(rows, key=lambda r: (r["kernel"], r["target"], json.dumps(r["constexprs"], sort_keys=True)))
    table = [("kernel", "target", "constexprs", "warps", "result", "wait s", "compile s")]
    for r in rows:
        consts = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
        table.append(
            (
                r["kernel"],
                r["target"],
                consts,
                str(r["num_warps"]),
                r["result"] if r["result"] != "cached" else f"cached ({r['tier']})",
                _seconds(r.get("wait_seconds")),
                _seconds(r.get("compile_seconds")),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)
    counts = Counter(r["result"] for r in rows)
    print(
        f"\n{len(rows)} kernel{'' if len(rows) == 1 else 's'}: {counts['compiled']} compiled, "
        f"{counts['cached']} cached, "
        f"{counts['failed']} failed in {elapsed:.2f} s  (cache: {cache_dir})",
        file=out,
    )
    if duplicates:
        print(
            f"{duplicates} duplicate variant{'' if duplicates == 1 else 's'} skipped (listed more than once "
            "in the manifest: each distinct one is compiled and counted once)",
            file=out,
        )
    print("wait s: queued for a free worker; compile s: on the worker", file=out)
    for r in rows:
        if r["result"] == "failed":
            print(f"\nFAILED {r['kernel']} {r['target']} {r['constexprs']}:\n{r['error']}", file=out)


def _print_shared_summary(shared: dict[str, int], url: str, out: TextIO) -> None:
    there = shared["kernels"] - shared["missing"]
    print(
        f"shared tier {shown(url)}: {there} of {shared['kernels']} kernels there ({shared['found']} found, "
        f"{shared['published']} published); {shared['refused']} refused, "
        f"{shared['errors']} failed operations",
        file=out,
    )


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
