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

Each command is a module of this package that adds its sub-parser (``add_parser``) and runs it
once parsed (``run``): ``warmup``, ``cache`` (with ``cache_bundle`` and ``cache_explain``),
``bench``, ``launcher`` and ``run``; ``COMMANDS`` is the table of them, and ``_common`` what they
share. Each imports what its work needs when it runs, not with the package: ``acompile --help``
stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Protocol

from acompile._version import __version__
from acompile.cli import bench, cache, launcher, run, warmup
from acompile.cli._common import whole_log_lines


class Command(Protocol):
    """A command's module."""

    def add_parser(self, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """Add the command's sub-parser to ``sub``, under the command's name."""

    def run(self, args: argparse.Namespace) -> int:
        """Run the command with its parsed arguments; returns its exit status."""


# The commands by name, in the order ``acompile --help`` lists them.
COMMANDS: dict[str, Command] = {
    "warmup": warmup,
    "cache": cache,
    "bench": bench,
    "launcher": launcher,
    "run": run,
}


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns its exit status."""
    try:
        with whole_log_lines():
            return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # The reader went away (`acompile ... | head -1`). Whatever is left to print goes nowhere,
        # including what Python flushes at exit, which would otherwise print a second error.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a command killed by SIGPIPE reports it in a shell


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        # The benchmark parses its own options (acompile bench --help): they are not this parser's.
        args = argparse.Namespace(command="bench", argv=argv[1:])
    else:
        args = _parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acompile", description="Compile GPU kernels ahead of time.")
    parser.add_argument("--version", action="version", version=f"acompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser
