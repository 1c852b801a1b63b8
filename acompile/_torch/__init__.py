"""torch.compile served by acompile (the optional extra ``acompile[torch]``).

Inductor, torch.compile's compiler, keeps graph-level caches (FX graph, AOTAutograd, autotune,
bundled autotune, PGO), compiles Triton kernels in a process pool of its own and C++ kernels with
the system compiler. While ``acompile.inductor.serve()`` is active, all three go through acompile:
the caches through the pool's tier chain (disk, shared tier: signed, faults as misses, single
flight across replicas), the compiles on the pool's workers. The modules, each with one job:

* ``_seams``: the private parts of Inductor this goes through, found and checked once, and the
  patches that swap them in and out;
* ``_portal``: how torch's threads reach the pool's event loop (bounded waits, never the loop's
  own thread);
* ``_served``: what is served while ``serve()`` is active: cache reads and writes, C++ outputs,
  compile jobs; the counters;
* ``_jobs``: the process pool Inductor submits to, in front of the pool's executor;
* ``_worker``: the worker half (runs Inductor's own compile functions in a pool worker);
* ``_parent``: the parent half the backend registry names (``preload=("inductor",)``);
* ``_autoload``: torch's extension entry point, for programs served from outside
  (``acompile run``);
* ``_hostpool``: one pool for every process of a host, reached over a private local socket.

Nothing here imports torch: torch is imported only once served. Outside this package, these
names come from here, never from the modules above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from acompile import _lazy

if TYPE_CHECKING:
    from acompile._torch._autoload import ENV as SERVE_ENV
    from acompile._torch._autoload import after_import, serve_with
    from acompile._torch._host import TorchHost
    from acompile._torch._hostpool import HostPool, HostPoolError, HostPoolExecutor
    from acompile._torch._portal import LoopThreadError, Portal, PortalTimeout
    from acompile._torch._seams import SUPPORTED, Patches, Unsupported
    from acompile._torch._seams import find as find_seams
    from acompile._torch._seams import install as install_seams
    from acompile._torch._served import Served

# Each name, by its module and its name there. A name is imported the first time it is asked
# for, with its module alone: ``import acompile`` imports ``_seams`` and ``_portal`` (names it
# uses at once) and not the served caches or the host pool, and ``python -m
# acompile._torch._hostpool`` finds its module not imported yet when it runs it as the program.
_NAMES: dict[str, str | tuple[str, str]] = {
    "SERVE_ENV": ("_autoload", "ENV"),
    "serve_with": ("_autoload", "serve_with"),
    "after_import": ("_autoload", "after_import"),
    "TorchHost": ("_host", "TorchHost"),
    "HostPool": ("_hostpool", "HostPool"),
    "HostPoolExecutor": ("_hostpool", "HostPoolExecutor"),
    "HostPoolError": ("_hostpool", "HostPoolError"),
    "Portal": ("_portal", "Portal"),
    "PortalTimeout": ("_portal", "PortalTimeout"),
    "LoopThreadError": ("_portal", "LoopThreadError"),
    "SUPPORTED": ("_seams", "SUPPORTED"),
    "Patches": ("_seams", "Patches"),
    "Unsupported": ("_seams", "Unsupported"),
    "find_seams": ("_seams", "find"),
    "install_seams": ("_seams", "install"),
    "Served": ("_served", "Served"),
}
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=False)


__all__ = [
    "SERVE_ENV",
    "SUPPORTED",
    "HostPool",
    "HostPoolError",
    "HostPoolExecutor",
    "LoopThreadError",
    "Patches",
    "Portal",
    "PortalTimeout",
    "Served",
    "TorchHost",
    "Unsupported",
    "after_import",
    "find_seams",
    "install_seams",
    "serve_with",
]
