"""Benchmark helpers for the compile service: ``acompile bench`` (``main``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``acompile bench``: see ``run.main``. Its modules are imported when it runs, not with the
    command line's."""
    from acompile._bench.run import main as run

    return run(argv)


__all__ = ["main"]
