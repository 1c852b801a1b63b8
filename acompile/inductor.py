"""torch.compile served by acompile: Inductor's caches on acompile's tiers, its compiles on the
pool's workers (the optional extra ``acompile[torch]``).

::

    from acompile import inductor

    # sync code (a training script, a benchmark, an engine you do not control)
    with inductor.serve(shared_cache="redis://cache:6379/0", signing_key=KEY, workers=8):
        compiled = torch.compile(model)
        compiled(x)

    # an async server with its own pool
    async with acompile.CompilePool(shared_cache=..., preload=("inductor",)) as pool:
        async with inductor.serve(pool):
            await anyio.to_thread.run_sync(lambda: compiled(x))  # torch.compile off the loop

While served, in this process:

- Inductor's FX-graph, AOTAutograd, autotune, bundled-autotune (where Triton has a GPU) and PGO
  (with a job id) caches read and write through the pool's tiers: the disk, then the shared tier
  (entries verified, signed where a key is set); faults are misses, never errors; writes leave
  the compiling thread at once; replicas that miss the same graph at once compile it once.
- Inductor's Triton compiles run on the pool's workers, also where the engine set
  ``compile_threads=1``: Inductor's own compile function, so the same kernels in Inductor's own
  caches, with acompile's crash containment, cancellation, quiesce and traces.
- Inductor's C++ builds (kernels, the vector-ISA probes, the precompiled header) come from the
  tiers where another process built them, and are built on the pool's workers otherwise.

See docs/torch.md: the torch releases served and how that is checked, the fleet set-up, the
figures measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio

from acompile._errors import AcompileError, BackendUnavailableError, PoolError
from acompile._torch import SUPPORTED, serve_with

if TYPE_CHECKING:
    from acompile._compiler import CompilePool
    from acompile._jit import JitServing
    from acompile._torch import Patches, Served, TorchHost

__all__ = ("SUPPORTED", "Serving", "UnsupportedTorchWarning", "load_artifacts", "save_artifacts", "serve")

logger = logging.getLogger("acompile")


class UnsupportedTorchWarning(UserWarning):
    """Warned (once a process) by ``serve()`` on a torch it cannot serve: a release outside
    ``SUPPORTED``, or one that lacks a part of Inductor acompile goes through. torch.compile then
    runs as it would without acompile."""


_lock = threading.Lock()
_current: Serving | None = None
_warned_unsupported = False


def serve(
    pool: CompilePool | None = None,
    /,
    *,
    host_pool: bool = False,
    unsafe_unsigned_shared_cache: bool = False,
    jits: Iterable[str] | None = None,
    **options: Any,
) -> Serving:
    """Serve torch.compile in this process while the returned context is active (``with``, or
    ``async with`` on an event loop: its set-up then runs on a thread).

    Args:
        pool: a running ``CompilePool`` to serve through (entered, on its event loop; torch.compile
            must then run off that loop's thread). Best made with ``preload=("inductor",)``: its
            workers then import torch once, in their template, rather than at their first job.
            Without one, ``serve`` starts its own pool on a thread of its own with ``options``
            (``CompilePool``'s arguments: ``workers``, ``cache_dir``,
            ``shared_cache=SharedCache(...)``, ...), and stops it when the context ends.
        host_pool: compile on the host's pool, shared by every process of this host that asks
            for it (a model server's ranks), instead of workers of this process's own: the
            first such process starts it (``workers`` sizes it), and it stops a minute after the
            last one left. Each process keeps its own cache tiers.
        jits: the other JIT libraries served beside torch.compile, each from the moment the
            program imports it (docs/jit.md): ``None`` (the default) for every one acompile
            serves (``"flashinfer"``, ``"cpp_extension"``: torch's C++/CUDA extensions), ``()``
            for none, or the names of some.
        unsafe_unsigned_shared_cache: deprecated (removed in 0.3): give
            ``shared_cache=SharedCache(url, unsafe_trust_unsigned=True)``. Inductor's cache
            entries hold code this process runs (a graph's Python, its C++ libraries): a shared
            tier serving them must be signed, or trusted unsigned by its owner.

    Raises ``BackendUnavailableError`` where torch is not installed, ``ValueError`` for a shared
    tier neither signed nor trusted (see above), ``AcompileError`` where torch.compile is served
    already in this process, and what ``CompilePool(**options)`` raises for its arguments. On a
    torch it cannot serve, it warns once (``UnsupportedTorchWarning``) and serves nothing:
    ``Serving.active`` is False.
    """
    if not isinstance(host_pool, bool):
        raise TypeError(f"host_pool must be True or False, got {host_pool!r}")
    if not isinstance(unsafe_unsigned_shared_cache, bool):
        raise TypeError(
            f"unsafe_unsigned_shared_cache must be True or False, got {unsafe_unsigned_shared_cache!r}"
        )
    if unsafe_unsigned_shared_cache:
        from acompile._cache import SharedCache

        if options.get("unsafe_unsigned_host_code") is False:
            raise TypeError(
                "unsafe_unsigned_shared_cache=True with unsafe_unsigned_host_code=False: an unsigned tier "
                "is trusted or not; give shared_cache=SharedCache(url, unsafe_trust_unsigned=...)"
            )
        if isinstance(options.get("shared_cache"), SharedCache):
            raise TypeError(
                "give unsafe_trust_unsigned=True to the SharedCache, not unsafe_unsigned_shared_cache "
                "to serve()"
            )
        new = (
            "make the pool with shared_cache=acompile.SharedCache(url, unsafe_trust_unsigned=True)"
            if pool is not None
            else "pass shared_cache=acompile.SharedCache(url, unsafe_trust_unsigned=True), which also "
            "trusts the tier with the C++ outputs and JIT modules it holds"
        )
        warnings.warn(
            f"serve(unsafe_unsigned_shared_cache=True) is deprecated and will be removed in 0.3: {new}",
            DeprecationWarning,
            stacklevel=2,
        )
    return _serve_trusting(
        pool, trust_unsigned=unsafe_unsigned_shared_cache, host_pool=host_pool, jits=jits, **options
    )


def _serve_trusting(
    pool: CompilePool | None,
    /,
    *,
    trust_unsigned: bool,
    publish_library_hits: bool = False,
    host_pool: bool = False,
    jits: Iterable[str] | None = None,
    **options: Any,
) -> Serving:
    """``serve()``, where the caller may serve torch.compile through a given pool whose shared
    tier is unsigned and untrusted (``acompile warmup`` filling a tier without a key: what it
    writes goes to the tier's unsigned namespace, which keyed replicas never read), and have
    what a JIT library's own cache answered published too (``publish_library_hits``: a
    warm-up's)."""
    unsafe_unsigned_shared_cache = trust_unsigned
    if pool is not None:
        from acompile._compiler import CompilePool

        if not isinstance(pool, CompilePool):
            raise TypeError(
                f"serve()'s first argument is a running CompilePool, got {pool!r}; for serve's own "
                "pool, pass its options by name: serve(shared_cache=..., workers=...)"
            )
        if options:
            raise TypeError(
                f"serve(pool) takes no pool options (the pool has its own); got {sorted(options)}"
            )
        if host_pool:
            raise TypeError(
                "serve(pool) serves through that pool: host_pool applies to serve's own pool only"
            )
    from acompile._jit import check_names

    names = check_names(jits)
    if pool is None:
        options = _own_pool_options(options, unsafe_unsigned_shared_cache)
    serving = Serving(pool, options, unsafe_unsigned_shared_cache, host_pool, names)
    serving._publish_library_hits = publish_library_hits
    return serving


def _gpu_for_triton() -> bool:
    """Whether torch here has a GPU to run Triton kernels on (CUDA, ROCm, XPU): only then does
    torch.compile hand a pool Triton compiles."""
    try:
        import torch
    except ImportError:
        return False
    xpu = getattr(torch, "xpu", None)
    return bool(torch.cuda.is_available() or (xpu is not None and xpu.is_available()))


def _own_pool_options(options: dict[str, Any], unsafe: bool) -> dict[str, Any]:
    from acompile._cache import SharedCache, shared_cache_argument

    options = dict(options)
    # Without a GPU, torch.compile gives the pool no compile (see Serving._start): its workers
    # start when something asks for them, not beside the compile.
    options.setdefault("prestart", _gpu_for_triton())
    preload = tuple(options.get("preload", ()))
    options["preload"] = preload if "inductor" in preload else (*preload, "inductor")
    given = options.get("shared_cache")
    legacy = {
        k: options.pop(k) for k in ("signing_key", "unsafe_unsigned_host_code", "fleet_wait") if k in options
    }
    # serve() -> _serve_trusting -> here -> shared_cache_argument: the warning names serve()'s caller.
    shared = shared_cache_argument(given, **legacy, stacklevel=5)
    if unsafe and shared is not None and not shared.trusted:
        # One trust: the tier's, for every kind of code (serve() warned of the old name).
        shared = SharedCache(
            shared.where,
            signing_key=shared.signing_key,
            unsafe_trust_unsigned=True,
            fleet_wait=shared.fleet_wait,
            copy_back=shared.copy_back,
            write=shared.write,
        )
    if shared is not None and not shared.trusted:
        raise ValueError(_UNSIGNED)
    options["shared_cache"] = shared
    return options


_UNSIGNED = (
    "torch.compile's cache entries hold code this process runs (a graph's Python, its C++ "
    "libraries): a shared tier serving them must be signed. Give SharedCache(url, signing_key=...) "
    "(or set ACOMPILE_SIGNING_KEY), or SharedCache(url, unsafe_trust_unsigned=True) to trust "
    "whoever can write to the shared tier"
)


class Serving:
    """torch.compile served, from ``serve()`` until the context ends.

    Attributes:
        active: whether anything is served (False on a torch that cannot be: see ``serve``).
        pool: the pool that serves (``serve``'s own, or the one given); None when not active.
    """

    def __init__(
        self,
        pool: CompilePool | None,
        options: dict[str, Any],
        unsafe: bool,
        host_pool: bool,
        jits: tuple[str, ...] = (),
    ) -> None:
        self._given = pool
        self._jit_names = jits
        self._publish_library_hits = False
        self._jits: JitServing | None = None
        self._options = options
        self._unsafe = unsafe
        self._host_pool = host_pool
        # serve()'s own pool, made now (its argument errors are serve()'s), started on entry.
        self._own: _OwnPool | None = _OwnPool(options, host_pool) if pool is None else None
        self._served: Served | None = None
        self._patches: Patches | None = None
        self._entered = False
        self._last_stats: dict[str, Any] | None = None
        self.active = False
        self.pool: CompilePool | None = None

    # -- the contexts -----------------------------------------------------------------------------

    def __enter__(self) -> Serving:
        if self._entered:
            raise AcompileError("a serve() context is entered once; call serve() again")
        self._entered = True
        global _current
        with _lock:
            if _current is not None:
                raise AcompileError("torch.compile is served already in this process (serve() does not nest)")
            _current = self
        try:
            self._start()
        except BaseException:
            with _lock:
                _current = None
            self._stop(drain=False)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _current
        try:
            self._stop(drain=True)
        finally:
            with _lock:
                if _current is self:
                    _current = None

    async def __aenter__(self) -> Serving:
        return await anyio.to_thread.run_sync(self.__enter__)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.__exit__, exc_type, exc, tb)

    # -- inside -----------------------------------------------------------------------------------

    def _start(self) -> None:
        from acompile._torch import Served, Unsupported, find_seams, install_seams

        try:
            seams = find_seams()
        except ImportError as exc:  # torch itself is missing
            raise BackendUnavailableError(
                'serving torch.compile needs torch: pip install "acompile[torch]"'
            ) from exc
        except Unsupported as exc:
            # Nothing is served: the other JITs served here build with this torch too.
            _warn_unsupported(str(exc))
            return
        host = self._host()
        if host.shared and not host.trusted and not self._unsafe:
            raise ValueError(_UNSIGNED)
        served = Served(host)
        self._patches = install_seams(seams, served)
        self._served = served
        if self._jit_names:
            from acompile._jit import JitServing, ServedBuilds

            builds = ServedBuilds(served)
            builds.publish_library_hits = self._publish_library_hits
            self._jits = JitServing(builds, self._jit_names)
            self._jits.start()
        self.active = True

        if served.builds_on_pool or _gpu_for_triton():
            # Inductor hands the pool its Triton compiles (or, on the host's pool, its C++
            # builds): the workers, ready as soon as they can be. Without a GPU torch can use it
            # hands this process's pool none (its C++ builds run in its own threads), and the
            # workers start only if something asks for them (a served JIT library's build,
            # ``wait_ready``): nothing competes with the compile for the CPU.
            served.want_workers()

    def _host(self) -> TorchHost:
        if self._given is not None:
            self.pool = self._given
            return self._given.torch_host()
        assert self._own is not None
        host = self._own.start()
        self.pool = self._own.pool
        return host

    def _stop(self, *, drain: bool) -> None:
        if self._jits is not None:
            self._jits.stop()  # its counts stay readable below
        patches, self._patches = self._patches, None
        if patches is not None:
            patches.undo()
        served = self._served
        if served is not None:
            served.close()
        if served is not None and drain and not served.host.portal.on_loop_thread():
            # Writes on their way to the tiers (on the loop's own thread they would wait for the
            # thread that waits: the pool's own exit waits for them then).
            served.drain()
        elif served is not None:
            served.drain(0)  # outputs not yet being published are dropped
        if served is not None:
            self._last_stats = self.stats()
        self._served = None
        self._jits = None
        own, self._own = self._own, None
        if own is not None:
            own.stop()
            if self._last_stats is not None:
                self._last_stats["pool"] = own.pool.stats()  # closed now: its final state
        self.active = False

    def mark_ready(self, on_late: Literal["warn", "refuse"] = "warn") -> None:
        """Say that the server is ready: the serving pool's ``mark_ready(on_late)``. From now on
        every build of a served JIT library, and every compile of the pool's, is counted
        (``stats()["jit"][lib]["after_ready"]``, the pool's ``stats()["after_ready"]``) and named
        in a warning, and still published to the fleet's tiers so that the next replica has it
        (``on_late="refuse"``: a JIT library's build raises ``CompiledAfterReadyError``)."""
        if self.pool is not None:
            self.pool.mark_ready(on_late)
        if self._jits is not None:
            self._jits.builds.mark_ready()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the serving pool's workers are ready (from a thread other than the pool's
        loop's: in async code, ``await pool.wait_ready()``); True once they are. Until then
        Inductor compiles in its own process, as it does while its own pool warms up: a program
        that knows it will compile soon may wait here first."""
        served = self._served
        if served is None:
            return False
        served.want_workers()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not served.ready.wait(0.1):
            if served.host.portal.closed or (self._own is not None and self._own.gone()):
                return False  # the pool ended: it will not be ready
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def written(self) -> set[str]:
        """The keys of the cache entries written while serving (``CompilePool.share`` makes
        sure a shared tier holds them)."""
        served = self._served
        keys = served.written() if served is not None else set()
        if self._jits is not None:
            keys |= self._jits.builds.keys
        return keys

    def save_artifacts(self, name: str) -> dict[str, int] | None:
        """``acompile.inductor.save_artifacts`` through this context."""
        served = self._served
        if served is None:
            raise AcompileError("this serve() context is not active")
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        blob, info = saved
        counts = _counts(info)
        served.store_artifacts(name, blob, {"artifacts": counts, "torch": str(torch.__version__)})
        return counts

    def load_artifacts(self, name: str) -> dict[str, int] | None:
        """``acompile.inductor.load_artifacts`` through this context."""
        served = self._served
        if served is None:
            raise AcompileError("this serve() context is not active")
        import torch

        blob = served.fetch_artifacts(name)
        if blob is None:
            return None
        info = torch.compiler.load_cache_artifacts(blob)
        return _counts(info) if info is not None else None

    def stats(self) -> dict[str, Any]:
        """What was served (safe from any thread but the pool's loop's): per cache
        (``fx-graph``, ``aot-autograd``, ``autotune``, ``bundled-autotune``, ``pgo``) the reads
        (``gets``), hits by tier, ``misses``, ``puts`` (writes) and ``fleet_waits``; ``cpp``:
        outputs from the tiers (``hits``), built (``local_builds`` here, in Inductor's threads;
        ``builds`` on a host pool's workers) and published (``puts``); ``jobs``: compile jobs
        sent to the pool; ``errors``: reads and writes that failed for acompile's own sake
        (misses for torch.compile); ``pool``: the serving pool's ``stats()``. The numbers stay
        readable after the context ends."""
        served = self._served
        if served is None:
            return self._last_stats or {"active": False}
        stats = served.stats()
        if self._jits is not None:
            stats["jit"] = self._jits.builds.stats()
            if self._jits.unsupported:
                stats["jit_unsupported"] = dict(self._jits.unsupported)
        remote = self._own.host_pool if self._own is not None else None
        if remote is not None:
            stats["host_pool"] = {"pid": remote.server_pid, "workers": remote.size}
        pool = self.pool
        if pool is not None and not served.host.portal.on_loop_thread():

            async def pool_stats() -> Any:
                return pool.stats()

            with contextlib.suppress(Exception):
                stats["pool"] = served.host.portal.call(pool_stats, timeout=5)
        return stats


def _serving() -> Serving:
    with _lock:
        current = _current
    if current is None or current._served is None:
        raise AcompileError("torch.compile is not served in this process: call this inside inductor.serve()")
    return current


def save_artifacts(name: str) -> dict[str, int] | None:
    """Store torch's Mega-Cache artifacts (``torch.compiler.save_cache_artifacts()``: what this
    process compiled, its graphs, autotuning, AOTAutograd and PGO entries) under ``name`` in the
    serving pool's tiers: on its disk when this returns, on its shared tier (signed) in the
    background, and in the bundles ``acompile cache export`` writes. Returns the artifacts'
    counts by kind, or None where torch had none. Blocking (call it off the pool's loop).

    Raises ``AcompileError`` outside ``serve()``."""
    return _serving().save_artifacts(name)


def load_artifacts(name: str) -> dict[str, int] | None:
    """Load the Mega-Cache artifacts stored under ``name`` (by this torch release) into torch's
    caches (``torch.compiler.load_cache_artifacts``): the compiles they cover then hit. Returns
    their counts by kind, or None where the tiers hold none. Blocking; raises ``AcompileError``
    outside ``serve()``."""
    return _serving().load_artifacts(name)


def _counts(info: Any) -> dict[str, int]:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(items) for kind, items in artifacts.items()}


def _warn_unsupported(reason: str) -> None:
    global _warned_unsupported
    with _lock:
        first = not _warned_unsupported
        _warned_unsupported = True
    if first:
        warnings.warn(
            f"{reason}: torch.compile is not served by acompile and runs as it would without it",
            UnsupportedTorchWarning,
            stacklevel=4,
        )


# How long serve() waits for its own pool to start: a pool enters in about a second, a host
# pool's server starts within a minute.
_START_WAIT = 180.0


class _OwnPool:
    """The pool ``serve(**options)`` starts: on an event loop of its own, in a thread of its own,
    entered before ``serve`` returns and left when it ends."""

    def __init__(self, options: dict[str, Any], host_pool: bool) -> None:
        from acompile._compiler import CompilePool

        if host_pool:
            from acompile._torch import HostPool

            # Its jobs go to the host's pool (through this pool's queue, traces and stats): this
            # one keeps the cache tiers, and starts no worker of its own unless it falls back.
            options = dict(options, prestart=False, workers=HostPool(options.get("workers")))
        try:
            self.pool = CompilePool(**options)  # its argument errors, here and now
        except TypeError as exc:
            raise TypeError(
                f"serve(): {exc}".replace("CompilePool.__init__()", "the pool's options")
            ) from None
        self._entered = threading.Event()
        self._error: BaseException | None = None
        self._host: TorchHost | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self.host_pool: Any = None
        self._thread = threading.Thread(target=self._main, name="acompile-inductor", daemon=True)

    def start(self) -> TorchHost:
        self._thread.start()
        if not self._entered.wait(_START_WAIT):
            # A hang, never a wait for ever: a start that waits for what this thread holds (an
            # import lock of a program's own, a lock around its imports) ends unserved.
            raise PoolError(f"the pool serving torch.compile did not start within {_START_WAIT:g} s")
        if self._error is not None:
            raise self._error
        assert self._host is not None
        return self._host

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            if not self._entered.is_set():
                self._error = exc
            else:
                logger.error("the pool serving torch.compile stopped: %s", exc)
        finally:
            self._entered.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        async with self.pool:
            from acompile._torch import HostPoolExecutor

            executor = self.pool.executor
            if isinstance(executor, HostPoolExecutor):
                self.host_pool = executor
            self._host = self.pool.torch_host()
            self._entered.set()
            await self._stop_event.wait()

    def gone(self) -> bool:
        """Whether the pool's thread has ended (its pool left: stopped, or failed)."""
        return self._entered.is_set() and not self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Leave the pool (its writes arrive first, bounded) and wait for the thread."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # its loop ended already
                loop.call_soon_threadsafe(event.set)
        if self._thread.is_alive():
            self._thread.join(timeout)


# torch's extension entry point (``acompile run``) serves through this module's ``serve``, handed
# to it here: it sits below this module and does not import it.
def _triggers() -> tuple[str, ...]:
    from acompile._jit import TRIGGERS

    return TRIGGERS


serve_with(serve, _triggers())
