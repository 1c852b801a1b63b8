"""The ``acompile`` command.

acompile --version
acompile warmup MANIFEST [--workers N] [--target T] [--cache-dir DIR] [--json FILE]
                         [--shared-cache URL] [--require-shared | --no-require-shared]
                         [--farm ADDRESS]
acompile cache stats [--cache-dir DIR]
acompile cache export FILE [--manifest M] [--target T] [--cache-dir DIR]
acompile cache import FILE [--allow-unsigned] [--unsafe-unsigned-host-code] [--cache-dir DIR]
acompile cache prune [--max-size 10GiB] [--max-age 30d] [--dry-run] [--cache-dir DIR]
acompile cache explain KEY [--against KEY2] [--cache-dir DIR]
acompile bench [...]        (see acompile bench --help)
acompile run [-v] [--workers N] [--cache-dir DIR] [--shared-cache URL] [--host-pool] -- COMMAND [ARGS...]

``python -m acompile`` is the same command.

Exit status: 0 done; 1 some work failed (a kernel did not compile, an entry was damaged, rejected
or missing, a shared tier that warm-up was asked to fill did not get every kernel); 2 bad usage (a
bad argument, manifest or bundle file, a cache folder that does not exist, $ACOMPILE_SIGNING_KEY
set but empty); 141 the reader of the output went away (``acompile ... | head``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import anyio

from acompile._cache import DiskTier, default_cache_dir, human_bytes, is_key, read_header, toolchain_dir
from acompile._errors import AcompileError, UntrustedFolderError
from acompile._version import __version__
from acompile._workers import BYTECODE_FOLDER

WARMUP_EPILOG = """\
columns: wait is the time a kernel queued for a free worker, compile the time a worker spent on it
(both empty for a kernel the cache answered).

with --shared-cache, the kernels are also published to the shared tier, and the summary says how
many were found there, published, refused (entries that failed their signature check) and how
many operations failed. A kernel that was already in the local cache is looked up in the shared
tier and published there if absent. Unless --no-require-shared is given, warm-up exits 1 when
fewer kernels are in the shared tier at the end (found or published) than compiled successfully:
the tier was unreachable, refused writes, or dropped them.
"""


def _positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (argparse's own message names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns its exit status."""
    try:
        with _whole_log_lines():
            return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader went away (`acompile ... | head -1`). Whatever is left to print goes nowhere,
        # including what Python flushes at exit, which would otherwise print a second error.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a command killed by SIGPIPE reports it in a shell


@contextlib.contextmanager
def _whole_log_lines() -> Iterator[None]:
    """The ``acompile`` logger's records as whole lines on stderr, each after any progress bar
    line in progress (which would otherwise cut it, or be cut by it, mid-line)."""
    logger = logging.getLogger("acompile")
    if logger.handlers:  # configured by whoever called us: theirs to format
        yield
        return
    handler = _LineHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class _LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("acompile: %(levelname)s: %(message)s"))
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        _Progress.end_line()
        super().emit(record)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        # The benchmark parses its own options (acompile bench --help).
        from acompile._bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="acompile", description="Compile GPU kernels ahead of time.")
    parser.add_argument("--version", action="version", version=f"acompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

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
    warm.add_argument(
        "--workers", type=_positive_int, default=None, help="worker processes (default: usable CPUs)"
    )
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
    warm.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $ACOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/acompile, else ~/.cache/acompile",
    )
    warm.add_argument(
        "--json", dest="json_path", type=Path, default=None, help="also write the results as JSON"
    )
    warm.add_argument(
        "--shared-cache",
        default=os.environ.get("ACOMPILE_SHARED_CACHE"),
        help="also fill a shared tier, e.g. redis://host:6379/0 (default: $ACOMPILE_SHARED_CACHE); "
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

    cache = sub.add_parser("cache", help="look at, move and bound the cache")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)
    dir_help = "default: $ACOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/acompile, else ~/.cache/acompile"
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
    imp.add_argument("file", type=Path, help="the bundle to load (a .tar.gz, as export writes it)")
    imp.add_argument("--cache-dir", type=Path, default=None, help=dir_help)
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
    prune.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    explain = cache_sub.add_parser("explain", help="what an entry's key was computed from")
    explain.add_argument("key", help="an entry's key, or the start of one (at least 6 hexadecimal digits)")
    explain.add_argument("--against", default=None, help="another key: show only the factors that differ")
    explain.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    sub.add_parser("bench", help="compile a kernel corpus against the baselines (see: acompile bench --help)")

    launcher = sub.add_parser(
        "launcher",
        help="build acompile's kernel launcher (and its bridge to PyTorch) now, e.g. in an image's build",
        description="Build acompile's launcher for Triton kernels, and its bridge to PyTorch where "
        "PyTorch is installed, into the cache folder now (a C compiler's second, a C++ compiler's ten "
        "seconds and up to 1 GB of memory), rather than in the background of the first process that "
        "loads a kernel on a GPU. Needs no GPU. Exit status 1 if either cannot be built (why, on stderr).",
    )
    launcher.add_argument("--cache-dir", type=Path, default=None, help=dir_help)

    run = sub.add_parser(
        "run",
        help="run a command with its torch.compile, FlashInfer and torch extensions served by acompile",
        description="Run COMMAND with torch.compile served by acompile in each of its Python "
        "processes that compiles (docs/torch.md): Inductor's caches on acompile's tiers, its "
        "compiles on a pool's workers; and FlashInfer's modules and torch's C++/CUDA extensions "
        "from the tiers or built once on the pool (docs/jit.md). The program needs no change; "
        "acompile must be installed in the Python environment it runs in.",
        epilog="example: acompile run --shared-cache redis://cache:6379/0 -- vllm serve MODEL",
    )
    run.add_argument(
        "--workers", type=_positive_int, default=None, help="worker processes (default: usable CPUs)"
    )
    run.add_argument("--cache-dir", type=Path, default=None, help=dir_help)
    run.add_argument(
        "--shared-cache",
        default=os.environ.get("ACOMPILE_SHARED_CACHE"),
        help="a shared tier, e.g. redis://host:6379/0 (default: $ACOMPILE_SHARED_CACHE); its entries "
        "are signed with $ACOMPILE_SIGNING_KEY, which it needs",
    )
    run.add_argument(
        "--unsafe-unsigned-shared-cache",
        action="store_true",
        help="serve from the shared tier without a signing key: whoever can write to it can run code "
        "in the program",
    )
    run.add_argument(
        "--host-pool",
        action="store_true",
        help="one pool for every process of this host (the program's ranks share its workers)",
    )
    run.add_argument(
        "--record",
        type=Path,
        default=None,
        help="append what the program's processes were served (Triton kernels, FlashInfer modules) to "
        "this warm-up manifest: `acompile warmup FILE` replays it on a box without a GPU",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say in each served process, on stderr, that it is served, and what was served when it ends",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command to run, after --")

    args = parser.parse_args(argv)
    if args.command == "warmup":
        return _warmup(args)
    if args.command == "launcher":
        return _build_launcher(args)
    if args.command == "run":
        return _run(args)
    root = args.cache_dir or default_cache_dir()
    if args.cache_command != "import" and not root.is_dir():
        # An empty report would read as "nothing cached" where the folder is mistyped.
        where = "--cache-dir" if args.cache_dir else "the default cache folder ($ACOMPILE_CACHE_DIR)"
        problem = "is not a folder" if root.exists() else "does not exist"
        print(f"acompile cache {args.cache_command}: {root} {problem}; check {where}", file=sys.stderr)
        return 2 if args.cache_dir else 1
    if args.cache_command == "export":
        return _cache_export(args, root)
    if args.cache_command == "import":
        return _cache_import(args, root)
    if args.cache_command == "prune":
        return _cache_prune(args, root)
    if args.cache_command == "explain":
        return _cache_explain(args, root)
    return _cache_stats(root)


# --- run ------------------------------------------------------------------------------------------


def _build_launcher(args: argparse.Namespace) -> int:
    """``acompile launcher``: the launcher and the bridge to PyTorch built (or found built) in
    the cache folder, each one's path printed, or why it cannot be."""
    import importlib.util

    from acompile._backends import (
        bridge_enabled,
        bridge_problem,
        launcher_module,
        launcher_problem,
        load_bridge,
    )

    if args.cache_dir is not None:
        os.environ["ACOMPILE_CACHE_DIR"] = str(args.cache_dir)
    status = 0
    logger = logging.getLogger("acompile")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a build that fails is said once, below, not also as a warning
    try:
        started = time.time()
        built = launcher_module(wait=True)
    finally:
        logger.setLevel(level)
    if built is None:
        print(f"acompile: the launcher is not built: {launcher_problem()}", file=sys.stderr)
        status = 1
    else:
        print(f"launcher: {built.__file__} ({_built_or_found(built.__file__, started)})")
    if importlib.util.find_spec("torch") is None:
        print("bridge to PyTorch: not needed (PyTorch is not installed)")
    elif not bridge_enabled():
        print(f"bridge to PyTorch: {bridge_problem()}")
    else:
        try:
            started = time.time()
            bridge = load_bridge()
        except Exception as exc:
            print(f"acompile: the bridge to PyTorch is not built: {exc}", file=sys.stderr)
            status = 1
        else:
            print(f"bridge to PyTorch: {bridge.__file__} ({_built_or_found(bridge.__file__, started)})")
    return status


def _built_or_found(path: str | None, started: float) -> str:
    """Whether the library at ``path`` was written since ``started`` (a ``time.time()``: by
    this command, or by another process building it meanwhile), and how long that took."""
    try:
        made = path is not None and os.stat(path).st_mtime >= started
    except OSError:
        made = False
    return f"built in {time.time() - started:.1f} s" if made else "built already"


def _run(args: argparse.Namespace) -> int:
    from acompile._cache import signing_key_from
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
        if problem := _output_path_problem(args.record):
            print(f"acompile run: --record {args.record}: {problem}", file=sys.stderr)
            return 2
        options["record"] = str(args.record.absolute())
    if args.host_pool:
        options["host_pool"] = True
    if args.shared_cache:
        if problem := _shared_url_problem(args.shared_cache):
            print(f"acompile run: --shared-cache: {problem}", file=sys.stderr)
            return 2
        try:
            key = signing_key_from(None)
        except ValueError as exc:  # set but empty, or short: it names the variable
            print(f"acompile run: {exc}", file=sys.stderr)
            return 2
        if key is None and not args.unsafe_unsigned_shared_cache:
            print(
                "acompile run: --shared-cache needs $ACOMPILE_SIGNING_KEY: torch.compile's cache entries "
                "and the JIT libraries' modules hold code the program runs (or pass "
                "--unsafe-unsigned-shared-cache)",
                file=sys.stderr,
            )
            return 2
        # A SharedCache's fields (its key stays in the environment, read by each process).
        options["shared_cache"] = {
            "where": args.shared_cache,
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
        "sys.exit(3) if not any(e.value.startswith('acompile._torch._autoload') "
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
        ep.value.startswith("acompile._torch._autoload") for ep in entry_points(group="torch.backends")
    )


# --- warmup ---------------------------------------------------------------------------------------


def _warmup(args: argparse.Namespace) -> int:
    from acompile._manifest import load_flashinfer_entries, load_manifest, load_torch_entries

    if args.shared_cache is not None and (problem := _shared_url_problem(args.shared_cache)):
        print(f"acompile warmup: --shared-cache: {problem}", file=sys.stderr)
        return 2
    if args.shared_cache is not None and (problem := _signing_key_error()):
        # Set but empty (a secret that failed to mount) is never "no key": refused before any work.
        print(f"acompile warmup: {problem}", file=sys.stderr)
        return 2
    if args.target is not None and not args.target.strip():
        print("acompile warmup: --target is empty; pass one such as --target cuda:90", file=sys.stderr)
        return 2
    if args.json_path is not None and (problem := _output_path_problem(args.json_path)):
        print(f"acompile warmup: cannot write --json {args.json_path}: {problem}", file=sys.stderr)
        return 2
    try:
        specs = load_manifest(args.manifest)
        models = load_torch_entries(args.manifest)
        jits = load_flashinfer_entries(args.manifest)
    except AcompileError as exc:
        print(f"acompile warmup: {exc}", file=sys.stderr)
        return 2
    if models and args.shared_cache is not None and _signing_key_problem():
        print(
            "acompile warmup: [[torch]] entries with --shared-cache need $ACOMPILE_SIGNING_KEY: "
            "torch.compile's cache entries hold code the processes that read them run",
            file=sys.stderr,
        )
        return 2
    if jits and args.shared_cache is not None and _signing_key_problem():
        print(
            "acompile warmup: [[flashinfer]] entries with --shared-cache need $ACOMPILE_SIGNING_KEY: "
            "a FlashInfer module is host code, which replicas load from a signed tier only",
            file=sys.stderr,
        )
        return 2
    args.models = models
    args.jits = jits
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
        _Progress.end_line()
        print("acompile warmup: interrupted", file=sys.stderr)
        return 130


def _signing_key_error() -> str | None:
    """What is wrong with ``$ACOMPILE_SIGNING_KEY`` (set but empty, too short), or None where it
    is a usable key or unset."""
    from acompile._cache import signing_key_from

    try:
        signing_key_from(None)
    except ValueError as exc:
        return str(exc)
    return None


def _signing_key_problem() -> str | None:
    """Why there is no usable signing key in the environment, or None where there is one."""
    from acompile._cache import signing_key_from

    try:
        return None if signing_key_from(None) is not None else "not set"
    except ValueError as exc:
        return str(exc)


def _output_path_problem(path: Path) -> str | None:
    """Why a file a command writes (a report, a bundle) cannot be written at path, as far as
    can be told before the work; None if nothing is wrong (the write can still fail: a full
    disk). A missing folder is not made: a mistyped path would make folders nobody asked for."""
    folder = path.parent
    if path.is_dir():
        return "it is a folder: name a file"
    if not folder.exists():
        return f"there is no folder {folder} (create it first)"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written by this user"
    return None


_SHARED_URL_FORMS = (
    "redis://HOST:PORT/DB (e.g. redis://cache.internal:6379/0), rediss://... or memcached://HOST:PORT"
)


def _shared_url_problem(url: str) -> str | None:
    """What is wrong with a shared-cache URL, before any client is imported; None if nothing.
    The pool's own check (its constructor makes it; its message names the URL, its secret hidden),
    with the forms a good URL takes where that message gives none."""
    from acompile._cache import check_target

    try:
        check_target(url)
    except ValueError as exc:
        text = str(exc)
        return text if ": use " in text or ": write " in text else f"{text}; use {_SHARED_URL_FORMS}"
    return None


async def _warmup_async(specs: list[Any], args: argparse.Namespace) -> int:
    from acompile._compiler import CompilePool
    from acompile._farm import RayFarm

    rows: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    modules: list[dict[str, Any]] = []
    progress = _Progress(len(specs) + len(args.models) + len(args.jits), sys.stderr)
    t0 = time.perf_counter()
    shared: dict[str, int] = {}
    preload = (("triton",) if specs else ()) + (("inductor",) if args.models else ())
    with tempfile.TemporaryDirectory(prefix="acompile-warmup-") as scratch:
        trace_path = Path(scratch) / "trace.json"
        async with CompilePool(
            args.workers,
            target=args.target or (specs[0].target if specs else None),
            preload=preload,
            cache_dir=args.cache_dir,
            prestart=False,
            # Compiling is this command's whole job, not a background task: its workers run at
            # its own priority, keeping their share of a machine busy with other work.
            worker_nice=0,
            shared_cache=args.shared_cache,
            farm=RayFarm(args.farm) if args.farm else None,
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
    elapsed = time.perf_counter() - t0
    progress.close()
    if rows:
        _print_summary(rows, elapsed, pool.cache_dir, sys.stdout)
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
        there = shared.get("torch_entries", 0) - shared.get("torch_missing", 0)
        print(
            f"shared tier {_shown(args.shared_cache)}: {there} of {shared.get('torch_entries', 0)} "
            f"{_served_what(args)} entries there",
            file=sys.stdout,
        )
        if shared.get("torch_missing") and args.require_shared:
            print(
                f"acompile warmup: {shared['torch_missing']} {_served_what(args)} entries did not reach the "
                f"shared tier {_shown(args.shared_cache)}",
                file=sys.stderr,
            )
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
        if shared.get("torch_entries"):
            there = shared["torch_entries"] - shared["torch_missing"]
            print(
                f"  and {there} of {shared['torch_entries']} {_served_what(args)} entries there",
                file=sys.stdout,
            )
        if shared.get("torch_missing") and args.require_shared:
            print(
                f"acompile warmup: {shared['torch_missing']} of {shared['torch_entries']} "
                f"{_served_what(args)} entries did not reach the shared tier {_shown(args.shared_cache)}",
                file=sys.stderr,
            )
            ok = False
        if shared["missing"] and args.require_shared:
            print(
                f"acompile warmup: {shared['missing']} of {shared['kernels']} kernels did not reach the "
                f"shared tier {_shown(args.shared_cache)} ({shared['errors']} failed operations, "
                f"{shared['refused']} refused entries, {shared['not_published']} not published: over "
                "?max_value= or a fault, see the warnings above); is it reachable and writable? "
                "(--no-require-shared: fill the local cache only, exit 0)",
                file=sys.stderr,
            )
            ok = False
    if args.json_path:
        document: dict[str, Any] = {"seconds": elapsed, "kernels": rows}
        if models:
            document["torch"] = models
        if shared:
            document["shared"] = shared
        try:
            args.json_path.write_text(json.dumps(document, indent=2, default=str))
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

    unsigned = _signing_key_problem() is not None  # refused before any work where a shared tier needs one
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


async def _warm_flashinfer(
    pool: Any, entries: list[Any], modules: list[dict[str, Any]], progress: Any
) -> set[str]:
    """Build each ``[[flashinfer]]`` entry's module with FlashInfer served by the pool, one after
    the other (FlashInfer's build runs on a thread; ninja on the pool). Returns the keys of the
    entries the modules were stored or found under."""
    from acompile import inductor

    unsigned = _signing_key_problem() is not None  # refused before any work where a shared tier needs one
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


class _Progress:
    """A one-line progress bar on a terminal; elsewhere (CI logs), a line per tenth of the work
    once the work has taken a second, and the last: a warm-up served from the cache in
    milliseconds writes one line, not eleven."""

    # The bar being drawn on the terminal, if any: a log line must first end it (see main()).
    _open: _Progress | None = None

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
            _Progress._open = self
        elif (decile := 10 * done // max(1, self.total)) != self._last_decile and (
            done == self.total or time.perf_counter() - self.t0 >= 1.0
        ):
            self._last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()

    @classmethod
    def end_line(cls) -> None:
        """End the bar's line, so that what is written next starts a line of its own (the bar
        starts a new line at its next step)."""
        bar, cls._open = cls._open, None
        if bar is not None:
            bar.out.write("\n")
            bar.out.flush()

    def close(self) -> None:
        if _Progress._open is self:
            _Progress.end_line()


def _print_summary(rows: list[dict[str, Any]], elapsed: float, cache_dir: Path, out: TextIO) -> None:
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
    print("wait s: queued for a free worker; compile s: on the worker", file=out)
    for r in rows:
        if r["result"] == "failed":
            print(f"\nFAILED {r['kernel']} {r['target']} {r['constexprs']}:\n{r['error']}", file=out)


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


def _shown(url: str) -> str:
    """A shared cache URL as it may be printed: its password, if any, never is."""
    from acompile._cache import redact_url

    return redact_url(url)


def _print_shared_summary(shared: dict[str, int], url: str, out: TextIO) -> None:
    there = shared["kernels"] - shared["missing"]
    print(
        f"shared tier {_shown(url)}: {there} of {shared['kernels']} kernels there ({shared['found']} found, "
        f"{shared['published']} published); {shared['refused']} refused, "
        f"{shared['errors']} failed operations",
        file=out,
    )


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


# --- cache stats ----------------------------------------------------------------------------------


def _cache_stats(root: Path) -> int:
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


# --- cache export / import / prune / explain -----------------------------------------------------


def _cache_export(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import export_bundle

    keys: list[str] | None = None
    if args.target is not None and args.manifest is None:
        print(
            "acompile cache export: --target applies with --manifest only (the target of its "
            "kernels that name none); without a manifest every entry is exported",
            file=sys.stderr,
        )
        return 2
    if problem := _output_path_problem(args.file):
        print(f"acompile cache export: cannot write {args.file}: {problem}", file=sys.stderr)
        return 2
    from acompile._cache import signing_key_from

    try:
        signing_key_from(None)  # $ACOMPILE_SIGNING_KEY, which signs the bundle
    except ValueError as exc:  # under 16 bytes
        print(f"acompile cache export: {exc}", file=sys.stderr)
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


def _cache_import(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import import_bundle

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
    print(f"cache folder: {root}")
    print(f"bundle: {args.file}")
    print(report.summary())
    for name, reason in report.rejected:
        print(f"  rejected {name}: {spelled(reason)}", file=sys.stderr)
    return 0 if report.ok else 1


def _cache_prune(args: argparse.Namespace, root: Path) -> int:
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


def _cache_explain(args: argparse.Namespace, root: Path) -> int:
    from acompile._cache import describe_factor, explain, explain_key, explain_miss

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
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["written"]))
    print(f"key      {info['key']}", file=out)
    print(f"backend  {info['backend']}", file=out)
    print(f"kernel   {info['name']}", file=out)
    print(f"size     {human_bytes(info['bytes'])}", file=out)
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


if __name__ == "__main__":
    sys.exit(main())
