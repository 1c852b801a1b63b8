"""``python -m acompile``: the ``acompile`` command (see ``acompile --help``)."""

from __future__ import annotations

import sys

from acompile.cli import main

if __name__ == "__main__":
    sys.exit(main())
