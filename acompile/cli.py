"""The ``acompile`` command.

acompile warmup MANIFEST [--workers N] [--target T] [--cache-dir DIR]
acompile cache stats [--cache-dir DIR]
acompile cache export FILE [--manifest M] [--target T] [--cache-dir DIR]
acompile cache import FILE [--cache-dir DIR]
acompile cache prune [--max-size 10GiB] [--max-age 30d] [--dry-run] [--cache-dir DIR]
acompile cache explain KEY [--against KEY2] [--cache-dir DIR]
acompile bench [...]        (see acompile bench --help)

Exit status: 0 done; 1 some work failed (a kernel did not compile, an entry was damaged, rejected
or missing); 2 bad usage (a bad argument, manifest or bundle file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import anyio

from acompile._cache import DiskTier, default_cache_dir
from acompile._cache._bundle import read_header
from acompile._errors import AcompileError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The benchmark parses its own options (acompile bench --help).
        from acompile._bench.run import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="acompile", description="Compile GPU kernels ahead of time.")
    sub = parser.add_subparsers(dest="command", required=True)

    warm = sub.add_parser("warmup", help="compile every kernel of a manifest into the cache")
    warm.add_argument("manifest", type=Path)
    warm.add_argument("--workers", type=int, default=None, help="worker processes (default: usable CPUs)")
    warm.add_argument(
        "--target", default=None, help="target for kernels whose entry names none, e.g. cuda:90"
    )
    warm.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $ACOMPILE_CACHE_DIR or ~/.cache/acompile"
    )
    warm.add_argument(
        "--json", dest="json_path", type=Path, default=None, help="also write the results as JSON"
    )
    warm.add_argument(
        "--shared-cache",
        default=os.environ.get("ACOMPILE_SHARED_CACHE"),
        help="also fill a shared tier, e.g. redis://host:6379/0 (default: $ACOMPILE_SHARED_CACHE); "
        "entries are signed with $ACOMPILE_SIGNING_KEY when it is set",
    )

    cache = sub.add_parser("cache", help="look at, move and bound the cache")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    dir_help = "default: $ACOMPILE_CACHE_DIR or ~/.cache/acompile"
    stats = cache_sub.add_parser("stats", help="what the disk cache holds")
    stats.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    export = cache_sub.add_parser("export", help="write the cache's entries into one bundle file")
    export.add_argument("file", type=Path, help="the bundle to write (a .tar.gz)")
    export.add_argument(
        "--manifest", type=Path, default=None, help="only the entries of this warm-up manifest's kernels"
    )
    export.add_argument(
        "--target", default=None, help="with --manifest: target for kernels whose entry names none"
    )
    export.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    imp = cache_sub.add_parser("import", help="load a bundle into the cache, verifying every entry")
    imp.add_argument("file", type=Path)
    imp.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    prune = cache_sub.add_parser(
        "prune", help="remove entries by age, then the oldest until the cache fits a size"
    )
    prune.add_argument("--max-size", default=None, help="e.g. 10GiB, 500MB")
    prune.add_argument(
        "--max-age", default=None, help="time since an entry was written: 30d, 12h, 90m, 3600s"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    prune.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    explain = cache_sub.add_parser("explain", help="what an entry's key was computed from")
    explain.add_argument("key")
    explain.add_argument("--against", default=None, help="another key: show only the factors that differ")
    explain.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    sub.add_parser("bench", help="compile a kernel corpus against the baselines (see: acompile bench --help)")

    args = parser.parse_args(argv)
    if args.command == "warmup":
        return _warmup(args)
    root = args.cache_dir or default_cache_dir()
    if args.cache_command == "export":
        return _cache_export(args, root)
    if args.cache_command == "import":
        return _cache_import(args, root)
    if args.cache_command == "prune":
        return _cache_prune(args, root)
    if args.cache_command == "explain":
        return _cache_explain(args, root)
    return _cache_stats(root)


# --- warmup ---------------------------------------------------------------------------------------


def _warmup(args: argparse.Namespace) -> int:
    from acompile._manifest import load_manifest

    try:
        specs = load_manifest(args.manifest)
    except AcompileError as exc:
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 2
    if args.target is None and any(s.target is None for s in specs):
        print(
            'acompile warmup: some kernels name no target: add targets = ["cuda:90"] to the manifest '
            "or pass --target cuda:90",
            file=sys.stderr,
        )
        return 2
    try:
        return anyio.run(_warmup_async, specs, args)
    except ValueError as exc:  # the pool's own arguments: a bad --shared-cache URL, say
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 2
    except AcompileError as exc:
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nacompile warmup: interrupted", file=sys.stderr)
        return 130


async def _warmup_async(specs: list[Any], args: argparse.Namespace) -> int:
    from acompile._compiler import CompilePool

    rows: list[dict[str, Any]] = []
    progress = _Progress(len(specs), sys.stderr)
    t0 = time.perf_counter()
    async with CompilePool(
        args.workers,
        target=args.target or specs[0].target,
        cache_dir=args.cache_dir,
        prestart=False,
        shared_cache=args.shared_cache,
    ) as pool:

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
                row.update(result="cached" if tier in ("memory", "disk") else "compiled", key=kernel.key)
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            progress.advance(row["result"])

        async with anyio.create_task_group() as tg:
            for spec in specs:
                tg.start_soon(one, spec)
    elapsed = time.perf_counter() - t0
    progress.close()
    _print_summary(rows, elapsed, pool.cache_dir, sys.stdout)
    if args.json_path:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps({"seconds": elapsed, "kernels": rows}, indent=2, default=str))
    return 1 if any(r["result"] == "failed" for r in rows) else 0


class _Progress:
    """A one-line progress bar on a terminal; a line per tenth of the work elsewhere (CI logs)."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out = total, out
        self.counts: Counter[str] = Counter()
        self.tty = out.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def advance(self, result: str) -> None:
        self.counts[result] += 1
        done = sum(self.counts.values())
        width = 30
        filled = width * done // max(1, self.total)
        c = self.counts
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  compiled {c['compiled']}"
            f"  cached {c['cached']}  failed {c['failed']}  {time.perf_counter() - self.t0:.1f}s"
        )
        if self.tty:
            self.out.write("\r" + line)
        elif (decile := 10 * done // max(1, self.total)) != self._last_decile:
            self._last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def _print_summary(rows: list[dict[str, Any]], elapsed: float, cache_dir: Path, out: TextIO) -> None:
    rows = sorted(rows, key=lambda r: (r["kernel"], r["target"], json.dumps(r["constexprs"], sort_keys=True)))
    table = [("kernel", "target", "constexprs", "warps", "result", "seconds")]
    for r in rows:
        consts = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
        table.append(
            (r["kernel"], r["target"], consts, str(r["num_warps"]), r["result"], f"{r['seconds']:.2f}")
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)
    counts = Counter(r["result"] for r in rows)
    print(
        f"\n{len(rows)} kernels: {counts['compiled']} compiled, {counts['cached']} cached, "
        f"{counts['failed']} failed in {elapsed:.2f} s  (cache: {cache_dir})",
        file=out,
    )
    for r in rows:
        if r["result"] == "failed":
            print(f"\nFAILED {r['kernel']} {r['target']} {r['constexprs']}:\n{r['error']}", file=out)


# --- cache stats ----------------------------------------------------------------------------------


def _cache_stats(root: Path) -> int:
    disk = DiskTier(root)
    by_backend: Counter[str] = Counter()
    size_by_backend: Counter[str] = Counter()
    names: Counter[str] = Counter()
    damaged = 0
    for path in disk.iter_paths():
        # The whole header, however long (an entry's recorded key parts may hold its source).
        header = read_header(path)
        if header is None:
            damaged += 1
            continue
        backend = str(header.get("backend", "?"))
        by_backend[backend] += 1
        size_by_backend[backend] += os.path.getsize(path)
        names[f"{backend}:{header.get('name', '?')}"] += 1
    total = sum(by_backend.values())
    print(f"cache folder: {root}")
    print(
        f"entries: {total}  ({_human(sum(size_by_backend.values()))})"
        + (f", {damaged} damaged" if damaged else "")
    )
    for backend in sorted(by_backend):
        print(f"  {backend}: {by_backend[backend]} entries, {_human(size_by_backend[backend])}")
    if names:
        print("most variants:")
        for name, count in names.most_common(10):
            print(f"  {count:4d}  {name}")
    return 0


# --- cache export / import / prune / explain -----------------------------------------------------


def _cache_export(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache._bundle import export_bundle

    keys: list[str] | None = None
    if args.manifest is not None:
        try:
            keys = _manifest_keys(args.manifest, args.target, root)
        except AcompileError as exc:
            print(f"acompile cache export: {exc}", file=sys.stderr)
            return 2
    try:
        report = anyio.run(export_bundle, root, args.file, keys)
    except (AcompileError, OSError) as exc:
        print(f"acompile cache export: {exc}", file=sys.stderr)
        return 1
    print(f"cache folder: {root}")
    print(f"bundle: {args.file}")
    print(report.summary())
    for key, reason in report.rejected:
        print(f"  left out {key}: {reason}", file=sys.stderr)
    if report.missing:
        print(
            f"acompile cache export: {len(report.missing)} of the manifest's kernels are not in {root}: "
            "run `acompile warmup` on the manifest first",
            file=sys.stderr,
        )
        for key in report.missing:
            print(f"  missing {key}", file=sys.stderr)
    return 0 if report.ok else 1


def _manifest_keys(manifest: Path, target: str | None, root: Path) -> list[str]:
    """The keys the manifest's kernels have here (as `acompile warmup` computes them)."""
    from acompile._backends._triton import prepare
    from acompile._manifest import load_manifest
    from acompile._targets import parse_target

    specs = load_manifest(manifest)
    if target is None and any(s.target is None for s in specs):
        raise AcompileError(
            'some kernels name no target: add targets = ["cuda:90"] to the manifest or pass --target cuda:90'
        )
    default = parse_target(target) if target is not None else None

    async def keys() -> list[str]:
        return [(await prepare(spec, default, root / "toolchain")).key for spec in specs]

    return anyio.run(keys)


def _cache_import(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache._bundle import import_bundle

    try:
        report = anyio.run(import_bundle, root, args.file)
    except AcompileError as exc:
        print(f"acompile cache import: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"acompile cache import: cannot write to {root}: {exc}", file=sys.stderr)
        return 1
    print(f"cache folder: {root}")
    print(f"bundle: {args.file}")
    print(report.summary())
    for name, reason in report.rejected:
        print(f"  rejected {name}: {reason}", file=sys.stderr)
    return 0 if report.ok else 1


def _cache_prune(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache._bundle import parse_age, prune
    from acompile._sizing import parse_size

    if args.max_size is None and args.max_age is None:
        print(
            "acompile cache prune: say --max-size (e.g. 10GiB), --max-age (e.g. 30d) or both", file=sys.stderr
        )
        return 2
    try:
        max_bytes = parse_size(args.max_size) if args.max_size is not None else None
        max_age = parse_age(args.max_age) if args.max_age is not None else None
    except ValueError as exc:
        print(f"acompile cache prune: {exc}", file=sys.stderr)
        return 2
    report = anyio.run(lambda: prune(root, max_bytes=max_bytes, max_age_s=max_age, dry_run=args.dry_run))
    print(f"cache folder: {root}")
    print(report.summary())
    for error in report.errors:
        print(f"  {error}", file=sys.stderr)
    return 1 if report.errors else 0


def _cache_explain(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache._bundle import describe_factor, explain, explain_key, explain_miss

    keys = [args.key.strip().lower()] + ([args.against.strip().lower()] if args.against else [])
    for key in keys:
        if not _is_key(key):
            print(
                f"acompile cache explain: {key!r} is not a cache key (64 hexadecimal digits)", file=sys.stderr
            )
            return 2

    async def run() -> tuple[list[dict[str, Any]], list[tuple[str, list[tuple[str, object, object]]]]]:
        infos = [await explain_key(root, key) for key in keys]
        parts = infos[0]["key_parts"]
        nearest = await explain_miss(root, parts, limit=3) if parts and len(infos) == 1 else []
        return infos, nearest

    try:
        infos, nearest = anyio.run(run)
    except AcompileError as exc:
        print(f"acompile cache explain: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout
    if len(infos) == 2:
        a, b = infos
        if a["key_parts"] is None or b["key_parts"] is None:
            for info in infos:
                if info["key_parts"] is None:
                    print(f"acompile cache explain: {info['key']}: {info['note']}", file=sys.stderr)
            return 1
        diffs = explain(a["key_parts"], b["key_parts"])
        print(f"- {a['key']}  ({a['backend']} {a['name']})", file=out)
        print(f"+ {b['key']}  ({b['backend']} {b['name']})", file=out)
        if not diffs:
            print("the recorded key parts are the same", file=out)
        else:
            print(f"{_factors(len(diffs))}:", file=out)
            _print_diffs(diffs, out, describe_factor)
        for info in infos:
            if info["note"]:
                print(f"note: {info['key'][:16]}…: {info['note']}", file=out)
        return 0
    info = infos[0]
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["written"]))
    print(f"key      {info['key']}", file=out)
    print(f"backend  {info['backend']}", file=out)
    print(f"kernel   {info['name']}", file=out)
    print(f"size     {_human(info['bytes'])}", file=out)
    print(f"written  {written}", file=out)
    if info["key_parts"] is None:
        print(f"note: {info['note']}", file=out)
        return 0
    print("key parts:", file=out)
    parts = info["key_parts"]
    width = max(len(describe_factor(name)) for name in parts)
    for name in _factor_order(parts):
        print(f"  {describe_factor(name).ljust(width)}  {_show(parts[name])}", file=out)
    if info["note"]:
        print(f"note: {info['note']}", file=out)
    if nearest:
        print(f"\nother entries of {info['name']} here, nearest first:", file=out)
        for key, diffs in nearest:
            print(f"  {key}: {_factors(len(diffs))}", file=out)
            _print_diffs(diffs, out, describe_factor, indent="    ")
    return 0


def _factors(n: int) -> str:
    return "1 factor differs" if n == 1 else f"{n} factors differ"


def _is_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _factor_order(parts: dict[str, Any]) -> list[str]:
    from acompile._cache._bundle import FACTORS

    return [n for n in FACTORS if n in parts] + sorted(set(parts) - set(FACTORS))


def _print_diffs(
    diffs: list[tuple[str, object, object]], out: TextIO, describe: Any, indent: str = "  "
) -> None:
    for name, a, b in diffs:
        print(f"{indent}{describe(name)}:", file=out)
        print(f"{indent}  - {_show(a)}", file=out)
        print(f"{indent}  + {_show(b)}", file=out)


def _show(value: object, limit: int = 300) -> str:
    """A value on one line: tables as k=v, long text cut."""
    if isinstance(value, dict):
        text = ", ".join(f"{k}={_show(v, limit)}" for k, v in value.items()) or "(none)"
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, separators=(",", ":"))
        except (TypeError, ValueError):
            text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + f"… ({len(text)} characters)"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main())
