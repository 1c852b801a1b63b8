"""``acompile bench``: compile a kernel corpus against the baselines (acompile._bench). The
benchmark reads its own options (``acompile bench --help``): this command's parser only lists it,
and ``main`` hands it the rest of the command line as it is, in ``args.argv``."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("bench", help="compile a kernel corpus against the baselines (see: acompile bench --help)")


def run(args: argparse.Namespace) -> int:
    from acompile._bench import main

    return main(args.argv)
