"""The ``acompile`` command.

acompile warmup MANIFEST [--workers N] [--target T] [--cache-dir DIR]
acompile cache stats [--cache-dir DIR]
acompile bench [...]        (see acompile bench --help)
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
from acompile._cache._entry import CorruptEntry, peek_header
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

    cache = sub.add_parser("cache", help="look at the cache")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    stats = cache_sub.add_parser("stats", help="what the disk cache holds")
    stats.add_argument("--cache-dir", type=Path, default=None)

    sub.add_parser("bench", help="compile a kernel corpus against the baselines (see: acompile bench --help)")

    args = parser.parse_args(argv)
    if args.command == "warmup":
        return _warmup(args)
    return _cache_stats(args.cache_dir or default_cache_dir())


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
        args.workers, target=args.target or specs[0].target, cache_dir=args.cache_dir, prestart=False
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
        try:
            with open(path, "rb") as f:
                head = f.read(64 * 1024)
            header = peek_header(head)
        except (OSError, CorruptEntry):
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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main())
