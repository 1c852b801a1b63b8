"""``acompile launcher``: build acompile's launcher for Triton kernels, and its bridge to PyTorch
where PyTorch is installed, into the cache folder now (in an image's build, say), rather than in
the background of the first process that loads a kernel on a GPU. Prints each one's path, or why
it cannot be built (then exits 1)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from acompile.cli._common import add_cache_dir


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    launcher = sub.add_parser(
        "launcher",
        help="build acompile's kernel launcher (and its bridge to PyTorch) now, e.g. in an image's build",
        description="Build acompile's launcher for Triton kernels, and its bridge to PyTorch where "
        "PyTorch is installed, into the cache folder now (a C compiler's second, a C++ compiler's ten "
        "seconds and up to 1 GB of memory), rather than in the background of the first process that "
        "loads a kernel on a GPU. Needs no GPU. Exit status 1 if either cannot be built (why, on stderr).",
    )
    add_cache_dir(launcher)


def run(args: argparse.Namespace) -> int:
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
