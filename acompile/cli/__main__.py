"""``python -m acompile.cli``: the ``acompile`` command, as ``python -m acompile`` is."""

if __name__ == "__main__":
    import sys

    from acompile.cli import main

    sys.exit(main())
