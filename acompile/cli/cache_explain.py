"""``acompile cache explain KEY``: what a cache entry's key was computed from (its recorded key
parts: the kernel's source, the compiler, the target, the options ...), and the other entries of
the same kernel nearest to it; with ``--against KEY2``, only the factors in which two entries
differ: why a process missed an entry that another one wrote."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from acompile._cache import DiskTier, human_bytes, is_key
from acompile._errors import AcompileError

if TYPE_CHECKING:
    import argparse


def _resolve_key(root: Path, text: str) -> tuple[str, str, int]:
    """A whole key from ``text``: a key, or the unique start of one (at least 6 hexadecimal
    digits) among the folder's entries, as ``cache stats`` prints them. Returns (key, problem,
    the exit status for the problem: 1 where no entry starts so, as for an absent key; 2 for
    what is not a key, or the start of several)."""
    if is_key(text):
        return text, "", 0
    hexdigits = set("0123456789abcdef")
    if len(text) < 6 or not set(text) <= hexdigits:
        return "", f"{text!r} is not a cache key (64 hexadecimal digits, or a unique start of 6 or more)", 2
    folder = DiskTier(root).path(text).parent
    try:
        found = sorted(p.name for p in folder.iterdir() if p.name.startswith(text) and is_key(p.name))
    except OSError:
        found = []
    if len(found) != 1:
        what = "no entry" if not found else f"{len(found)} entries"
        verb = "starts" if len(found) <= 1 else "start"
        return "", f"{what} in {root} {verb} with {text!r}", 1 if not found else 2
    return found[0], "", 0


async def _held_in(places: list[str], key: str) -> list[tuple[str, str]]:
    """For each shared tier, in order: its URL as shown and whether it holds ``key`` (verified
    as a pool would read it), or why it could not say."""
    from acompile._cache import CorruptEntry, SharedTier, decode_entry, redact_url, signing_key_from

    answers = []
    for place in places:
        tier = SharedTier.connect_later(place, signing_key_from(None))
        shown = redact_url(place).split("?")[0]
        try:
            await tier.open()
            data = await tier.get(key)
            if data is not None:
                decode_entry(data, key)
                said = "holds it"
            elif tier.counts["rejected"]:
                said = "holds a value under this key that is refused (see the warning above)"
            elif not tier.available:
                said = "could not be reached"
            else:
                said = "does not hold it"
        except CorruptEntry as exc:
            said = f"holds a damaged copy ({exc})"
        except ValueError as exc:
            said = f"cannot be used: {exc}"
        finally:
            await tier.close()
        answers.append((shown, f"{said} (namespace {tier.namespace})"))
    return answers


def run_explain(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import describe_factor, explain, explain_key, explain_miss
    from acompile.cli._common import shared_places, shared_url_problem

    if args.shared_cache is not None and (problem := shared_url_problem(args.shared_cache)):
        print(f"acompile cache explain: --shared-cache: {problem}", file=sys.stderr)
        return 2

    keys = []
    for text in [args.key] + ([args.against] if args.against else []):
        key, problem, status = _resolve_key(root, text.strip().lower())
        if problem:
            print(f"acompile cache explain: {problem}", file=sys.stderr)
            return status
        keys.append(key)

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
    if args.shared_cache is not None:
        places = shared_places(args.shared_cache)
        held = anyio.run(_held_in, places if isinstance(places, list) else [places], info["key"])
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["written"]))
    print(f"key      {info['key']}", file=out)
    print(f"backend  {info['backend']}", file=out)
    print(f"kernel   {info['name']}", file=out)
    print(f"size     {human_bytes(info['bytes'])}", file=out)
    print(f"written  {written}", file=out)
    if args.shared_cache is not None:
        print("shared tiers, in the order a pool reads them:", file=out)
        for shown, said in held:
            print(f"  {shown}: {said}", file=out)
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


def _factor_order(parts: dict[str, Any]) -> list[str]:
    from acompile._cache import FACTORS

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
