"""acompile's torch extension entry point (the ``torch.backends`` entry point group).

torch loads every such entry point as it is imported, in every process that imports torch. This
module is all of acompile that such a process imports, unless ``acompile run`` asked it to serve
torch.compile (``ACOMPILE_SERVE_TORCH`` is set): then it imports acompile and hands over to
``acompile._torch._autoload``. It lives outside the ``acompile`` package on purpose: importing
any module of the package imports the package, whose public names import the pool, the cache
tiers, anyio and aiofiles (a third of a second that a program not served would pay at each
``import torch``).
"""

import os


def autoload() -> None:
    """torch's extension entry point: called once, as torch is imported. Never raises."""
    if not os.environ.get("ACOMPILE_SERVE_TORCH"):
        return
    try:
        import acompile.inductor  # noqa: F401  (hands ``serve`` to the loader below)
        from acompile._torch._autoload import autoload as serve_this_process
    except Exception as exc:  # torch's import must not fail for acompile's sake
        import logging

        logging.getLogger("acompile").warning("acompile: not serving torch.compile in this process (%s)", exc)
        return
    serve_this_process()
