"""``acompile cache``: look at, move and bound the cache folder. ``stats`` (what it holds) and
``prune`` (remove entries by age, then the oldest until it fits a size) are here; ``export`` and
``import`` in ``cache_bundle``, ``explain`` in ``cache_explain``. Every one but ``import`` needs
the folder to exist: an empty report would read as "nothing cached" where it is mistyped."""

from __future__ import annotations

import argparse
import heapq
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio

from acompile._cache import DiskTier, default_cache_dir, human_bytes, read_header, toolchain_dir
from acompile._errors import UntrustedFolderError
from acompile._workers import BYTECODE_FOLDER
from acompile.cli import cache_bundle, cache_explain
from acompile.cli._common import add_cache_dir


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser("cache", help="look at, move and bound the cache")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)
    stats = cache_sub.add_parser("stats", help="what the disk cache holds")
    add_cache_dir(stats)

    export = cache_sub.add_parser("export", help="write the cache's entries into one bundle file")
    export.add_argument("file", type=Path, help="the bundle to write (a .tar.gz)")
    export.add_argument(
        "--manifest", type=Path, default=None, help="only the entries of this warm-up manifest's kernels"
    )
    export.add_argument(
        "--target", default=None, help="with --manifest: target for kernels whose entry names none"
    )
    add_cache_dir(export)

    imp = cache_sub.add_parser("import", help="load a bundle into the cache, verifying every entry")
    imp.add_argument("file", type=Path, help="the bundle to load (a .tar.gz, as export writes it)")
    add_cache_dir(imp)
    imp.add_argument(
        "--shared-cache",
        default=None,
        metavar="URL",
        help="also publish the bundle's entries to this shared tier (or chain: URLs separated by "
        "spaces), signed with $ACOMPILE_SIGNING_KEY: a fleet seeded from one bundle",
    )
    imp.add_argument(
        "--allow-unsigned",
        action="store_true",
        help="with $ACOMPILE_SIGNING_KEY set, also import a bundle that carries no signature "
        "(every entry is still verified; its host code is still refused); a bundle signed with "
        "another key is refused all the same",
    )
    imp.add_argument(
        "--unsafe-unsigned-host-code",
        action="store_true",
        help="UNSAFE: also import code that runs on this host (C++ and nvcc libraries, object files, "
        "torch.compile's entries) from a bundle not signed with $ACOMPILE_SIGNING_KEY (implies "
        "--allow-unsigned): whoever made or altered the bundle can then run code here. Without it, "
        "such entries are imported only from a bundle whose signature verifies",
    )

    prune = cache_sub.add_parser(
        "prune", help="remove entries by age, then the oldest until the cache fits a size"
    )
    prune.add_argument("--max-size", default=None, help="e.g. 10GiB, 500MB")
    prune.add_argument(
        "--max-age", default=None, help="time since an entry was written: 30d, 12h, 90m, 3600s"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    prune.add_argument(
        "--shared-cache",
        default=None,
        metavar="URL",
        help="prune this object store (s3://, gs://, az://) or shared folder (file://) instead of the "
        "cache folder: with --max-age, entries written longer ago, and leases left by dead replicas",
    )
    add_cache_dir(prune)

    explain = cache_sub.add_parser("explain", help="what an entry's key was computed from")
    explain.add_argument("key", help="an entry's key, or the start of one (at least 6 hexadecimal digits)")
    explain.add_argument("--against", default=None, help="another key: show only the factors that differ")
    explain.add_argument(
        "--shared-cache",
        default=None,
        metavar="URL",
        help="also say which shared tier holds the entry (one URL, or several separated by spaces: a "
        "chain); entries are looked up in the namespace of $ACOMPILE_SIGNING_KEY",
    )
    add_cache_dir(explain)


def run(args: argparse.Namespace) -> int:
    if args.cache_command == "prune" and args.shared_cache is not None:
        return _prune_shared(args)
    root = args.cache_dir or default_cache_dir()
    if args.cache_command != "import" and not root.is_dir():
        # An empty report would read as "nothing cached" where the folder is mistyped.
        where = "--cache-dir" if args.cache_dir else "the default cache folder ($ACOMPILE_CACHE_DIR)"
        problem = "is not a folder" if root.exists() else "does not exist"
        print(f"acompile cache {args.cache_command}: {root} {problem}; check {where}", file=sys.stderr)
        return 2 if args.cache_dir else 1
    return _COMMANDS[args.cache_command](args, root)


def _stats(args: argparse.Namespace, root: Path) -> int:
    disk = DiskTier(root)
    by_backend: Counter[str] = Counter()
    size_by_backend: Counter[str] = Counter()
    names: Counter[str] = Counter()
    newest: list[tuple[float, str, str]] = []
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
        newest = heapq.nlargest(
            5, [*newest, (os.path.getmtime(path), path.name, f"{backend}:{header.get('name', '?')}")]
        )
    total = sum(by_backend.values())
    print(f"cache folder: {root}")
    print(
        f"entries: {total}  ({human_bytes(sum(size_by_backend.values()))})"
        + (f", {damaged} damaged" if damaged else "")
    )
    for backend in sorted(by_backend):
        print(f"  {backend}: {by_backend[backend]} entries, {human_bytes(size_by_backend[backend])}")
    if names:
        print("most variants:")
        for name, count in names.most_common(10):
            print(f"  {count:4d}  {name}")
    if newest:
        print("newest entries (a key's start is enough for `acompile cache explain`):")
        for _, key, name in newest:
            print(f"  {key[:16]}  {name}")
    bytecode = toolchain_dir(root) / BYTECODE_FOLDER
    if bytecode.is_dir():
        files = [p for p in bytecode.rglob("*.pyc") if p.is_file()]
        print(
            f"workers' bytecode ({bytecode}): {len(files)} files, "
            f"{human_bytes(sum(p.stat().st_size for p in files))}; not entries (prune leaves it): "
            "remove it at any time"
        )
    return 0


def _prune(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import parse_age, prune
    from acompile._sizing import parse_size

    if args.max_size is None and args.max_age is None:
        print(
            "acompile cache prune: say --max-size (e.g. 10GiB), --max-age (e.g. 30d) or both", file=sys.stderr
        )
        return 2
    if args.max_size is not None and args.max_size.strip().replace(".", "", 1).isdigit():
        # A bare number would be bytes: "--max-size 10" meant as 10 GiB would empty the cache.
        n = args.max_size.strip()
        print(
            f"acompile cache prune: --max-size {n} needs a unit: e.g. {n}GiB, {n}MiB, or {n}B for bytes",
            file=sys.stderr,
        )
        return 2
    try:
        max_bytes = parse_size(args.max_size) if args.max_size is not None else None
        max_age = parse_age(args.max_age) if args.max_age is not None else None
    except ValueError as exc:
        print(f"acompile cache prune: {exc}", file=sys.stderr)
        return 2
    try:
        report = anyio.run(lambda: prune(root, max_bytes=max_bytes, max_age_s=max_age, dry_run=args.dry_run))
    except UntrustedFolderError as exc:
        print(f"acompile cache prune: {exc}", file=sys.stderr)
        return 2
    print(f"cache folder: {root}")
    print(report.summary())
    for error in report.errors:
        print(f"  {error}", file=sys.stderr)
    return 1 if report.errors else 0


def _prune_shared(args: argparse.Namespace) -> int:
    """``acompile cache prune --shared-cache URL --max-age AGE``: the object stores and folders
    of a shared tier (or of a chain: URLs separated by spaces; a memory cache in it is skipped:
    it forgets entries by itself)."""
    from acompile._cache import StoreError, is_store_url, parse_age, prune_storage, redact_url
    from acompile.cli._common import shared_places, shared_url_problem

    if args.max_size is not None or args.max_age is None:
        print(
            "acompile cache prune: a shared tier is pruned by age only: say --max-age (e.g. 30d)",
            file=sys.stderr,
        )
        return 2
    if problem := shared_url_problem(args.shared_cache):
        print(f"acompile cache prune: --shared-cache: {problem}", file=sys.stderr)
        return 2
    try:
        max_age = parse_age(args.max_age)
    except ValueError as exc:
        print(f"acompile cache prune: {exc}", file=sys.stderr)
        return 2
    places = shared_places(args.shared_cache)
    urls = places if isinstance(places, list) else [places]
    stores = [u for u in urls if is_store_url(u)]
    for url in urls:
        if url not in stores:
            print(
                f"{redact_url(url).split('?')[0]}: a memory cache forgets entries by itself (Redis's "
                "maxmemory policy, Memcached's LRU): not pruned"
            )
    if not stores:
        print(
            "acompile cache prune: --shared-cache names no object store (s3://, gs://, az://) or shared "
            "folder (file://) to prune",
            file=sys.stderr,
        )
        return 2
    verb = "would remove" if args.dry_run else "removed"
    status = 0
    for url in stores:
        shown = redact_url(url).split("?")[0]
        try:
            report = anyio.run(lambda: prune_storage(url, max_age, dry_run=args.dry_run))  # noqa: B023
        except ValueError as exc:
            print(f"acompile cache prune: {exc}", file=sys.stderr)
            return 2
        except (StoreError, TimeoutError, OSError) as exc:
            print(f"acompile cache prune: {shown} could not be pruned: {exc or 'timed out'}", file=sys.stderr)
            status = 1
            continue
        print(
            f"{shown}: {verb} {report['removed']} entries ({human_bytes(report['removed_bytes'])}) "
            f"written more than {max_age:g} s ago and {report['leases_removed']} leases of dead "
            f"replicas; kept {report['kept']}"
            + (
                f"; {report['staged_removed']} values staged by writers that died"
                if report.get("staged_removed")
                else ""
            )
        )
        for error in report["errors"]:
            print(f"  {error}", file=sys.stderr)
        status = status or (1 if report["errors"] else 0)
    return status


# Each sub-command of ``acompile cache`` by its name: what runs it, handed the cache folder.
_COMMANDS: dict[str, Callable[[argparse.Namespace, Path], int]] = {
    "stats": _stats,
    "export": cache_bundle.run_export,
    "import": cache_bundle.run_import,
    "prune": _prune,
    "explain": cache_explain.run_explain,
}
