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

Nothing here is imported by ``import acompile``; torch is imported only once served.
"""
