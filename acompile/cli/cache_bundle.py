"""``acompile cache export`` and ``acompile cache import``: move a cache's entries between
machines in one bundle file (a .tar.gz), signed with $ACOMPILE_SIGNING_KEY where it is set.
Export writes every entry of the folder, or those of a warm-up manifest's kernels; import verifies
every entry of a bundle before it writes it, and refuses host code from a bundle whose signature
does not verify (docs/caching.md)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from acompile._cache import DiskTier, is_key, read_header, toolchain_dir
from acompile._errors import AcompileError, UntrustedFolderError
from acompile.cli._common import output_path_problem, signing_key_error

if TYPE_CHECKING:
    import argparse

    from acompile._cache import BundleReport


def run_export(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import export_bundle

    keys: list[str] | None = None
    if args.target is not None and args.manifest is None:
        print(
            "acompile cache export: --target applies with --manifest only (the target of its "
            "kernels that name none); without a manifest every entry is exported",
            file=sys.stderr,
        )
        return 2
    if problem := output_path_problem(args.file):
        print(f"acompile cache export: cannot write {args.file}: {problem}", file=sys.stderr)
        return 2
    if problem := signing_key_error():  # $ACOMPILE_SIGNING_KEY, which signs the bundle: under 16 bytes
        print(f"acompile cache export: {problem}", file=sys.stderr)
        return 2
    if args.manifest is not None:
        try:
            keys = _manifest_keys(args.manifest, args.target, root)
        except AcompileError as exc:
            print(f"acompile cache export: {exc}", file=sys.stderr)
            return 2
    try:
        report = anyio.run(export_bundle, root, args.file, keys)
    except UntrustedFolderError as exc:
        print(f"acompile cache export: {exc}", file=sys.stderr)
        return 2
    except AcompileError as exc:
        print(f"acompile cache export: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # The bundle is written to a temporary file beside it, then renamed: name the bundle,
        # not that file.
        print(f"acompile cache export: cannot write {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    _print_report(report, root, args.file, "left out")
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
    from acompile._backends import prepare_triton as prepare
    from acompile._manifest import load_manifest
    from acompile._targets import parse_target

    specs = load_manifest(manifest)
    if target is None and any(s.target is None for s in specs):
        raise AcompileError(
            'some kernels name no target: add targets = ["cuda:90"] to the manifest or pass --target cuda:90'
        )
    if target is not None and specs and all(s.target is not None for s in specs):
        # Not an error (as for warmup), but never silent: the bundle holds the manifest's targets.
        named = sorted({str(s.target) for s in specs})
        print(
            f"acompile cache export: note: --target {target} is not used: every kernel in {manifest} "
            f"names its targets ({', '.join(named)}); --target is for entries that name none",
            file=sys.stderr,
        )
    default = parse_target(target) if target is not None else None

    async def keys() -> list[str]:
        return [(await prepare(spec, default, toolchain_dir(root))).key for spec in specs]

    found = anyio.run(keys)
    if _has_torch_entries(manifest):
        # What torch.compile wrote is keyed by Inductor, not by the manifest: every such entry of
        # the cache goes in with the manifest's kernels.
        found += _torch_entry_keys(root)
    return found


def _has_torch_entries(manifest: Path) -> bool:
    from acompile._manifest import load_torch_entries

    return bool(load_torch_entries(manifest))


def _torch_entry_keys(root: Path) -> list[str]:
    """The keys of the cache's torch.compile entries (blocking: reads every entry's header)."""
    found = []
    for path in DiskTier(root).iter_paths():
        header = read_header(path)
        if header is not None and header.get("backend") == "torch" and is_key(path.name):
            found.append(path.name)
    return found


def run_import(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import import_bundle
    from acompile.cli._common import shared_url_problem

    if args.shared_cache is not None:
        problem = shared_url_problem(args.shared_cache) or signing_key_error()
        if problem:
            print(f"acompile cache import: --shared-cache: {problem}", file=sys.stderr)
            return 2

    def spelled(text: str) -> str:
        """The API's switches, as this command spells them."""
        text = text.replace("unsafe_unsigned_host_code=True", "--unsafe-unsigned-host-code")
        return text.replace("allow_unsigned=True", "--allow-unsigned")

    try:
        report = anyio.run(
            lambda: import_bundle(
                root,
                args.file,
                allow_unsigned=args.allow_unsigned,
                unsafe_unsigned_host_code=args.unsafe_unsigned_host_code,
            )
        )
    except (AcompileError, ValueError) as exc:  # ValueError: a signing key that is short or empty
        print(f"acompile cache import: {spelled(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"acompile cache import: cannot write to {root}: {exc}", file=sys.stderr)
        return 1
    _print_report(report, root, args.file, "rejected", spelled)
    if args.shared_cache is not None and report.keys:
        shared_ok = _publish(args.shared_cache, root, report.keys)
        return 0 if report.ok and shared_ok else 1
    return 0 if report.ok else 1


def _publish(where: str, root: Path, keys: list[str]) -> bool:
    """Make the shared tier hold every key (published from the folder where absent): True where
    it does at the end. The entries are read back from the folder, verified, as a pool reads them."""
    import acompile
    from acompile.cli._common import shared_places, shown

    async def run() -> tuple[int, int, dict[str, Any]]:
        # A pool that compiles nothing (no worker starts): any target does; one is named so that
        # no GPU is looked for.
        pool = acompile.CompilePool(
            1, target="cuda:90", cache_dir=root, prestart=False, shared_cache=shared_places(where)
        )
        async with pool:
            found, written = await pool.share(keys)
        return found, written, dict(pool.stats()["cache"])

    try:
        found, written, cache = anyio.run(run)
    except (AcompileError, ValueError) as exc:
        print(f"acompile cache import: --shared-cache: {exc}", file=sys.stderr)
        return False
    there = found + written
    print(
        f"shared tier {shown(where)}: {there} of {len(keys)} entries there ({found} found, {written} "
        f"published); {cache['shared_errors']} failed operations, namespace {cache['shared_namespace']}"
    )
    if there < len(keys):
        print(
            f"acompile cache import: {len(keys) - there} of {len(keys)} entries did not reach the shared "
            f"tier {shown(where)}: is it reachable and writable?",
            file=sys.stderr,
        )
    return there == len(keys)


def _print_report(
    report: BundleReport, root: Path, bundle: Path, rejected_as: str, spelled: Callable[[str], str] = str
) -> None:
    """What export and import say of their work: the cache folder, the bundle and the report's
    summary on stdout; each entry left out (rejected_as, e.g. "rejected") and why, on stderr."""
    print(f"cache folder: {root}")
    print(f"bundle: {bundle}")
    print(report.summary())
    for name, reason in report.rejected:
        print(f"  {rejected_as} {name}: {spelled(reason)}", file=sys.stderr)
