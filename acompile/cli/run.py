"""``acompile run -- COMMAND``: run a program with torch.compile, FlashInfer and torch's C++/CUDA
extensions served by acompile in each of its Python processes (docs/torch.md, docs/jit.md). The
options go to the processes in one environment variable; the command checks, before it runs the
program, that they would be served (acompile installed as a torch extension where the program's
Python runs, a usable signing key for a shared tier), then replaces itself with the program."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from acompile._cache import default_cache_dir
from acompile._errors import UntrustedFolderError
from acompile.cli._common import (
    add_cache_dir,
    add_workers,
    output_path_problem,
    shared_places,
    shared_url_problem,
    signing_key_error,
    signing_key_problem,
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "run",
        help="run a command with its torch.compile, FlashInfer and torch extensions served by acompile",
        description="Run COMMAND with torch.compile served by acompile in each of its Python "
        "processes that compiles (docs/torch.md): Inductor's caches on acompile's tiers, its "
        "compiles on a pool's workers; and FlashInfer's modules and torch's C++/CUDA extensions "
        "from the tiers or built once on the pool (docs/jit.md). The program needs no change; "
        "acompile must be installed in the Python environment it runs in.",
        epilog="example: acompile run --shared-cache redis://cache:6379/0 -- vllm serve MODEL",
    )
    add_workers(parser)
    add_cache_dir(parser)
    parser.add_argument(
        "--shared-cache",
        default=os.environ.get("ACOMPILE_SHARED_CACHE"),
        help="a shared tier, e.g. redis://host:6379/0 (default: $ACOMPILE_SHARED_CACHE); its entries "
        "are signed with $ACOMPILE_SIGNING_KEY, which it needs",
    )
    parser.add_argument(
        "--unsafe-unsigned-shared-cache",
        action="store_true",
        help="serve from the shared tier without a signing key: whoever can write to it can run code "
        "in the program",
    )
    parser.add_argument(
        "--host-pool",
        action="store_true",
        help="one pool for every process of this host (the program's ranks share its workers)",
    )
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        help="append what the program's processes were served (Triton kernels, FlashInfer modules) to "
        "this warm-up manifest: `acompile warmup FILE` replays it on a box without a GPU",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say in each served process, on stderr, that it is served, and what was served when it ends",
    )
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command to run, after --"
    )


def run(args: argparse.Namespace) -> int:
    from acompile._torch import SERVE_ENV as ENV

    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("acompile run: no command; for example: acompile run -- python serve.py", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.workers is not None:
        options["workers"] = args.workers
    if args.cache_dir is not None:
        options["cache_dir"] = str(args.cache_dir)
    if problem := _untrusted_cache_folder(args.cache_dir or default_cache_dir()):
        # Said now, not by each served process as it starts (and then runs unserved).
        print(f"acompile run: {problem}", file=sys.stderr)
        return 2
    if args.record is not None:
        if problem := output_path_problem(args.record):
            print(f"acompile run: --record {args.record}: {problem}", file=sys.stderr)
            return 2
        options["record"] = str(args.record.absolute())
    if args.host_pool:
        options["host_pool"] = True
    if args.shared_cache:
        if problem := shared_url_problem(args.shared_cache):
            print(f"acompile run: --shared-cache: {problem}", file=sys.stderr)
            return 2
        if problem := signing_key_error():  # set but empty, or short: it names the variable
            print(f"acompile run: {problem}", file=sys.stderr)
            return 2
        if signing_key_problem() is not None and not args.unsafe_unsigned_shared_cache:  # not set
            print(
                "acompile run: --shared-cache needs $ACOMPILE_SIGNING_KEY: torch.compile's cache entries "
                "and the JIT libraries' modules hold code the program runs (or pass "
                "--unsafe-unsigned-shared-cache)",
                file=sys.stderr,
            )
            return 2
        # A SharedCache's fields (its key stays in the environment, read by each process).
        options["shared_cache"] = {
            "where": shared_places(args.shared_cache),
            "unsafe_trust_unsigned": args.unsafe_unsigned_shared_cache,
        }
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        print(
            "acompile run: TORCH_DEVICE_BACKEND_AUTOLOAD is off: torch loads no extension, and the "
            "program would run unserved; unset it",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ, **{ENV: json.dumps(options)})
    python = _program_python(command[0])
    if (
        python is not None
        and python != os.path.abspath(sys.executable)
        and (why := _python_serves(python, env)) is not None
    ):
        print(
            f"acompile run: {command[0]} runs {python}, {why}: the program would run unserved",
            file=sys.stderr,
        )
        return 2
    if python in (None, os.path.abspath(sys.executable)) and not _autoload_registered():
        print(
            "acompile run: acompile is not installed as a torch extension in this environment "
            '(pip install "acompile[torch]"): the program would run unserved',
            file=sys.stderr,
        )
        return 2
    if args.verbose:
        env["ACOMPILE_RUN_VERBOSE"] = "1"
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"acompile run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"acompile run: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process


def _program_python(program: str) -> str | None:
    """The Python interpreter a command runs: itself (``python3``), or the one its script's
    ``#!`` line names (``vllm``, ``torchrun``); None where it is neither (a shell script). Paths
    are not resolved: a virtual environment's interpreter links to its base's, whose
    environment is another."""
    import re
    import shutil

    path = shutil.which(program)
    if path is None:
        return None
    if re.fullmatch(r"python[0-9.]*", os.path.basename(program)):
        return os.path.abspath(path)
    try:
        with open(path, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [shutil.which(words[1]) or words[1], *words[2:]]
    if not words or not re.fullmatch(r"python[0-9.]*", os.path.basename(words[0])):
        return None
    return os.path.abspath(words[0])


def _python_serves(python: str, env: dict[str, str]) -> str | None:
    """Why torch, imported by that interpreter, would not be served as this command serves it
    (acompile's entry point is not there, or another release of acompile is, which may read the
    options this one hands it otherwise), or None."""
    import subprocess

    from acompile import __version__

    probe = (
        "import sys\n"
        "from importlib.metadata import entry_points, version\n"
        "sys.exit(3) if not any(e.value.startswith(('_acompile_autoload', 'acompile._torch._autoload')) "
        "for e in entry_points(group='torch.backends')) else print(version('acompile'))\n"
    )
    try:
        done = subprocess.run(
            [python, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None  # cannot tell: let the program run
    if done.returncode == 3:
        return 'whose environment has no acompile (install "acompile[torch]" there)'
    there = done.stdout.strip()
    if done.returncode == 0 and there and there != __version__:
        return f"whose acompile is {there}, not this command's {__version__} (install the same release there)"
    return None


def _autoload_registered() -> bool:
    """Whether torch will load acompile as it is imported (the entry point the package declares)."""
    from importlib.metadata import entry_points

    return any(
        ep.value.startswith(("_acompile_autoload", "acompile._torch._autoload"))
        for ep in entry_points(group="torch.backends")
    )


def _untrusted_cache_folder(root: Path) -> str | None:
    """Why the cache folder ``root`` is not one to trust (another user's, open to others, under
    a folder another user may swap), or None; a folder not made yet is made by the pool."""
    from acompile._trust import own_folder

    try:
        own_folder(root, "the cache folder", resolve=True, make=False)
    except UntrustedFolderError as exc:
        return str(exc)
    except OSError:
        return None  # missing: made, private, by the first served process
    return None
