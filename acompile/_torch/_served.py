"""What is served while ``acompile.inductor.serve()`` is active: Inductor's cache reads and
writes, its C++ outputs, and its compile jobs, each through the pool that serves.

Everything here is called on torch's threads (the compiling thread, Inductor's compile threads)
and reaches the pool through the ``Portal``; nothing here ever raises into torch.compile for a
fault of acompile's own (a tier away, the pool gone, a deadline passed): a read is then a miss,
a write is dropped, a compile runs where Inductor would have run it. Only a compiler's own error
(the kernel is wrong) reaches Inductor, as Inductor's own pool would have raised it.

**Caches.** Inductor's remote caches store JSON values (bytes) under keys such as
``pt2:fx-graph-v1::<key>:c1``. Each becomes an acompile entry (backend ``torch``, named for the
cache: ``fx-graph``, ``aot-autograd``, ``autotune``, ``bundled-autotune``, ``pgo``) under a key
derived from Inductor's: read from the disk tier, then the shared tier (verified, signed where a
key is set), written to the disk at once and to the shared tier in the background. A miss of a
graph takes the fleet's lease on it: replicas that miss the same graph at once compile it once,
the others wait (up to the pool's ``fleet_wait``) for the holder's entry.

**C++ outputs.** Inductor builds each C++ kernel (and the vector-ISA probes, and the precompiled
header) into its own cache folder, and a graph from a cache hit builds them again where that
folder is empty (a new machine). Served, each build's output is an entry too, keyed by its
inputs (the command line with machine paths taken out, the sources' contents, the compiler's
version): read from the tiers instead of built, and built on the pool's workers when missing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import pickle
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from acompile._cache import make_key
from acompile._errors import PoolClosedError, PoolError
from acompile._outputs import cpu_identity, output_problem, write_output
from acompile._torch._caches import ENTRY_BACKEND, KINDS, cache_key, cache_parts
from acompile._torch._host import TorchHost
from acompile._torch._portal import START_TIMEOUT, LoopThreadError, PortalTimeout
from acompile._workers import DEFAULT_NICE, URGENT, Job

_T = TypeVar("_T")

logger = logging.getLogger("acompile")

WORKER_MODULE = "acompile._torch._worker"
# Caches whose miss is followed by a compile and a put of the same key (the others' misses
# often are not: a kernel with one config is never tuned, an AOTAutograd entry waits for the
# backward): only there does a replica hold the others back while it compiles.
SINGLE_FLIGHT = frozenset({"fx-graph"})
CPP_KIND = "cpp"
ARTIFACTS_KIND = "mega-cache"
# A read waits for the disk (bounded) and the shared tier (0.5 s an operation, up to 5 s queued).
_GET_TIMEOUT = 10.0
# Below this many workers, a kernel's further configs are not fanned out (see Served.fan_out).
_FAN_OUT_MIN_WORKERS = 4
# After the loop did not take a call in time, calls skip the pool this long (each would wait
# START_TIMEOUT again otherwise).
_STALL_SKIP = 10.0
# A write hands its bytes over and returns; the pool writes them. Whatever is still on its way
# when serving ends is waited for this long.
_DRAIN_TIMEOUT = 30.0
# C++ outputs over this size are compressed in their entry (zlib's fastest level), and published
# from a thread of their own (see Served.publish_output).
_COMPRESS_OVER = 1 << 20
# The build outputs that are served (a preprocessor's output is a step, not a result). Not a
# precompiled header: 156 MB on torch 2.13 (26 MB through zlib), whose publishing cost the
# machine that built it more than a second of CPU (on a busy 2-core host, 8% of a first
# compile), to spare its build (about 4 s) only to machines that compile kernels of their own,
# which then build it as Inductor alone would.
SERVED_SUFFIXES = (".so", ".o")
_HEADER_SUFFIXES = (".gch", ".pch")
# What Inductor's compile functions read from the environment, handed to the worker as this
# process has it when the job is submitted (a worker's own may differ: its Triton cache).
# Each is the submitting process's, set or unset, for the job's time (acompile's own Triton
# backend gives a worker a private TRITON_CACHE_DIR and always_compile).
JOB_ENVIRONMENT = (
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "TRITON_ALWAYS_COMPILE",
    "TORCHINDUCTOR_CACHE_DIR",
    "TMPDIR",
)
# These only where the submitting process set them: Inductor's compile functions set them in
# the worker themselves, once a process (torch's ptxas, the CUDA toolkit's libdevice), and a job
# that unset them would compile every later job of that worker with Triton's own.
JOB_ENVIRONMENT_IF_SET = ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH")


class Served:
    """The served parts of torch.compile for one ``serve()``; thread-safe.

    ``counts``: per cache kind, ``<kind>_gets``, ``<kind>_hits_<tier>``, ``<kind>_misses``,
    ``<kind>_puts``, ``<kind>_fleet_waits``; ``cpp_hits_<tier>``, ``cpp_builds`` (built on the
    host's pool), ``cpp_local_builds`` (built in this process, in Inductor's own threads: see
    ``builds_on_pool``; the vector-ISA probes' direct builds too, not the header's
    preprocessing), ``cpp_puts``;
    ``jobs`` (Triton compiles sent to the pool), ``jobs_failed``; ``errors`` (a read or write
    that failed for acompile's own sake: a miss, never an error in torch.compile).
    """

    def __init__(self, host: TorchHost) -> None:
        self.host = host
        self.counts: Counter[str] = Counter()
        self.ready = threading.Event()  # the pool had every worker ready once
        self.not_ready = threading.Event()  # its workers failed to start: it will not be ready
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._torch_key: bytes | None = None
        self._stalled_until = 0.0
        self.keys: set[str] = set()
        # Precompiled headers asked for and not needed yet, by header: (lock path, builders);
        # and a lock for each, held while one is built (the builds that include it wait).
        self._headers: dict[str, tuple[str, Sequence[Any]]] = {}
        self._header_locks: dict[str, threading.Lock] = {}
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._fan: concurrent.futures.ThreadPoolExecutor | None = None
        self.context = {"cache_root": str(host.cache_root)}
        self._wanted = False
        # C++ builds go to the pool's workers only where it is the host's pool, shared by its
        # processes (a cap on the host's compilers). Elsewhere a build runs where Inductor runs
        # it, in its own threads: their compilers are processes already, as many as the pool's
        # workers (``get_compile_threads`` is at least that while served), so the workers would
        # add no parallelism, only a hop and their lower priority (on a busy host, 1.4x the time
        # of Inductor alone; docs/performance.md). Their outputs are served the same.
        self.builds_on_pool = host.host_pool

    # -- bookkeeping -------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def warn_once(self, what: str, message: str, *args: object) -> None:
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def _unreachable(self, exc: BaseException) -> None:
        """A call into the pool that did not happen: counted, and said once."""
        self.count("errors")
        if isinstance(exc, LoopThreadError):
            self.warn_once(
                "loop",
                "torch.compile runs on the event loop's thread of the pool that serves it: it is "
                "not served there (run it with anyio.to_thread.run_sync or asyncio.to_thread)",
            )
        elif isinstance(exc, PortalTimeout):
            self.warn_once(
                "timeout",
                "the pool serving torch.compile did not answer (%s): Inductor goes on without it for "
                "the next %g s, then asks the pool again",
                exc,
                _STALL_SKIP,
            )
        elif isinstance(exc, PoolClosedError):
            self.warn_once("closed", "the pool serving torch.compile has shut down; going on without it")
        else:
            self.warn_once(
                "error", "the pool serving torch.compile failed (%s: %s); going on", type(exc).__name__, exc
            )

    # What other served JITs (``acompile._jit``) use of this object: the same calls into the
    # pool, the same outage handling, the same writes waited for by ``drain()``.

    def call(self, fn: Callable[..., Awaitable[_T]], *args: Any, timeout: float | None) -> _T:
        """A coroutine function run on the pool's loop, its result here (see ``_call``)."""
        return self._call(fn, *args, timeout=timeout)

    def unreachable(self, exc: BaseException) -> None:
        """A call into the pool that did not happen: counted, and said once."""
        self._unreachable(exc)

    def keep(self, future: concurrent.futures.Future[Any], what: str) -> None:
        """A write on its way: counted when it fails, waited for by ``drain()``."""
        self._keep(future, what)

    def _keep(self, future: concurrent.futures.Future[Any], what: str) -> None:
        """A write on its way: counted when it fails, waited for by ``drain()``."""
        with self._lock:
            self._pending.add(future)

        def done(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._pending.discard(f)
            if not f.cancelled() and f.exception() is not None:
                self.count("errors")
                logger.debug("served %s write failed: %s", what, f.exception())

        future.add_done_callback(done)

    def _written(self, key: str) -> None:
        with self._lock:
            self.keys.add(key)

    def written(self) -> set[str]:
        """The keys of every entry this served process wrote (a warm-up spreads them)."""
        with self._lock:
            return set(self.keys)

    # -- torch's Mega-Cache ------------------------------------------------------------------------

    def store_artifacts(self, name: str, blob: bytes, meta: dict[str, Any]) -> str:
        """Store a ``save_cache_artifacts()`` blob under ``name`` (on the disk when this returns,
        on the shared tier in the background); its entry key."""
        key = artifacts_key(name)
        data, meta = _packed(blob, dict(meta, name=name, key_parts=artifacts_parts(name)))
        self._call(self.host.store, key, ARTIFACTS_KIND, {"artifacts": data}, meta, timeout=_GET_TIMEOUT * 6)
        self._written(key)
        return key

    def fetch_artifacts(self, name: str) -> bytes | None:
        """The blob stored under ``name`` (any tier), or None."""
        entry, _ = self._call(self.host.find, artifacts_key(name), timeout=_GET_TIMEOUT * 6)
        if entry is None or entry.backend != ENTRY_BACKEND or entry.name != ARTIFACTS_KIND:
            return None
        try:
            return _unpacked(entry.blobs["artifacts"], entry.meta)
        except (KeyError, zlib.error):
            return None

    def drain(self, timeout: float = _DRAIN_TIMEOUT) -> None:
        """Wait (up to ``timeout``) for the writes handed to the pool (and those that a write
        being published hands it meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [f for f in self._pending if not f.done()]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            concurrent.futures.wait(pending, left)
        with self._lock:
            publisher = self._publisher if self._closed else None
        if publisher is not None:
            # What has not started by now is dropped (a cache entry, not a result): the one
            # being published ends, and the process's exit waits for no more.
            publisher.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        """``Serving.stats()``: the counters, by cache."""
        with self._lock:
            counts = Counter(self.counts)
        tiers = ("disk", "shared", "fleet")
        caches = {
            kind: {
                "gets": counts[f"{kind}_gets"],
                "hits": {tier: counts[f"{kind}_hits_{tier}"] for tier in tiers},
                "misses": counts[f"{kind}_misses"],
                "puts": counts[f"{kind}_puts"],
                "fleet_waits": counts[f"{kind}_fleet_waits"],
            }
            for kind in KINDS.values()
        }
        return {
            "active": True,
            "caches": caches,
            "cpp": {
                "hits": {tier: counts[f"cpp_hits_{tier}"] for tier in tiers[:2]},
                "builds": counts["cpp_builds"],
                "local_builds": counts["cpp_local_builds"],
                "puts": counts["cpp_puts"],
            },
            "jobs": {
                "sent": counts["jobs"] - counts["fan_out_jobs"],
                "configs_fanned_out": counts["fan_out_jobs"],
                "failed": counts["jobs_failed"],
                "run_here": counts["jobs_local"],
            },
            "errors": counts["errors"],
        }

    def want_workers(self) -> None:
        """Ask the pool for its workers (once): ``ready`` is set when they are, ``not_ready``
        where they cannot start. Until then Inductor compiles in this process."""
        with self._lock:
            if self._wanted:
                return
            self._wanted = True

        def done(future: concurrent.futures.Future[Any]) -> None:
            if future.cancelled() or isinstance(future.exception(), PoolClosedError):
                return  # the pool, or serving, ended first
            if future.exception() is None:
                self.ready.set()
            else:
                self.not_ready.set()
                logger.warning(
                    "the pool serving torch.compile has no workers (%s); Inductor compiles in this process",
                    future.exception(),
                )

        self.host.portal.spawn(self.host.wait_ready).add_done_callback(done)

    def parallel(self) -> bool:
        """Whether Inductor's compiles go to the pool now: once its workers have been ready
        (until then Inductor compiles in its own process, as it does while its own pool warms
        up), never from the loop's own thread (that thread would wait for itself), and not while
        the loop does not answer."""
        portal = self.host.portal
        return (
            self.ready.is_set() and not portal.closed and not portal.on_loop_thread() and not self._stalled()
        )

    def _stalled(self) -> bool:
        return time.monotonic() < self._stalled_until

    def _call(self, fn: Callable[..., Awaitable[_T]], *args: Any, timeout: float | None) -> _T:
        """``portal.call``, skipped for a while after the loop did not take a call in time
        (it is held: torch.compile on its own thread waits for a thread that waits for it)."""
        if self._stalled():
            raise PortalTimeout("the pool's event loop did not answer a moment ago")
        try:
            return self.host.portal.call(fn, *args, timeout=timeout)
        except PortalTimeout as exc:
            if exc.unstarted:
                self._stalled_until = time.monotonic() + _STALL_SKIP
            raise

    # -- caches ------------------------------------------------------------------------------------

    def cache_get(self, kind: str, inductor_key: str) -> bytes | None:
        """The value stored under Inductor's key, or None: absent, refused, or any fault."""
        self.count(f"{kind}_gets")
        key = cache_key(kind, inductor_key)
        try:
            entry, tier = self._call(self.host.find, key, timeout=_GET_TIMEOUT)
            if entry is None and kind in SINGLE_FLIGHT:
                entry = self._call(self.host.claim, key, timeout=self.host.fleet_wait + _GET_TIMEOUT)
                if entry is not None:
                    tier = "fleet"
                    self.count(f"{kind}_fleet_waits")
        except Exception as exc:  # never into torch.compile: a miss
            self._unreachable(exc)
            self.count(f"{kind}_misses")
            return None
        value = entry.blobs.get("value") if entry is not None else None
        if entry is None or value is None or entry.backend != ENTRY_BACKEND or entry.name != kind:
            self.count(f"{kind}_misses")
            return None
        self.count(f"{kind}_hits_{tier}")
        return value

    def cache_put(self, kind: str, inductor_key: str, data: bytes) -> None:
        """Store a value under Inductor's key: handed to the pool, written there (the disk now,
        the shared tier in the background); this thread does not wait."""
        if not isinstance(data, (bytes, bytearray)):
            return
        self.count(f"{kind}_puts")
        key = cache_key(kind, inductor_key)
        self._written(key)
        meta = {"cache": kind, "key_parts": cache_parts(kind, inductor_key)}
        future = self.host.portal.spawn(self.host.store, key, kind, {"value": bytes(data)}, meta)
        self._keep(future, kind)

    # -- C++ outputs -------------------------------------------------------------------------------

    def fetch_output(self, builders: Sequence[Any]) -> bool:
        """Write the last builder's output (the group's result) from the tiers; False on a
        miss (or where it cannot be keyed or written)."""
        key = build_key(builders)
        if key is None:
            return False
        try:
            entry, tier = self._call(self.host.find, key, timeout=_GET_TIMEOUT)
        except Exception as exc:
            self._unreachable(exc)
            return False
        if entry is None or entry.backend != ENTRY_BACKEND or entry.name != CPP_KIND:
            return False
        if self.host.shared and not self.host.trusted and tier not in ("disk", ""):
            return False  # host code from a tier anyone could write: never loaded (see serve())
        target = builders[-1].get_target_file_path()
        try:
            data = _unpacked(entry.blobs["output"], entry.meta)
            if problem := output_problem(target, data):
                raise ValueError(problem)
            write_output(target, data)
        except (KeyError, OSError, ValueError, zlib.error) as exc:
            self.warn_once("output", "a served C++ output is not used (%s); Inductor builds it", exc)
            return False
        self.count(f"cpp_hits_{tier}")
        return True

    def publish_output(self, builders: Sequence[Any]) -> None:
        """Store the group's output (the last builder's target) under its inputs' key. A large
        one (over ``_COMPRESS_OVER``: compressed, a second for 150 MB on a quiet machine) is published
        from a thread of its own at the workers' lower priority: the builds waiting for it go
        on at once, and it takes the CPU they leave (``drain()`` waits for it)."""
        target = builders[-1].get_target_file_path()
        if not target.endswith(SERVED_SUFFIXES):
            return
        try:
            size = os.path.getsize(target)
        except OSError:
            return
        if size <= _COMPRESS_OVER:
            self._publish(builders, target)
            return
        with self._lock:
            if self._closed:
                return  # serving ended: the pool is gone, or going
            if self._publisher is None:
                self._publisher = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="acompile-publish", initializer=_yield_cpu
                )
            publisher = self._publisher
        try:
            future = publisher.submit(self._publish, builders, target)
        except RuntimeError:  # shut down: serving ended
            return
        self._keep(future, CPP_KIND)

    def _publish(self, builders: Sequence[Any], target: str) -> None:
        parts = build_parts(builders)
        if parts is None:
            return
        key = make_key(parts)
        try:
            with open(target, "rb") as f:
                data = f.read()
        except OSError:
            return
        if problem := output_problem(target, data):
            self.warn_once("bad-output", "a C++ build's output is not published: %s", problem)
            return
        data, meta = _packed(data, {"file": os.path.basename(target), "key_parts": parts})
        self.count("cpp_puts")
        self._written(key)
        future = self.host.portal.spawn(self.host.store, key, CPP_KIND, {"output": data}, meta)
        self._keep(future, CPP_KIND)

    def build(
        self, lock_path: str, builders: Sequence[Any], build_locally: Callable[[Sequence[Any]], None]
    ) -> None:
        """Inductor's ``_worker_compile_cpp``, served: under its file lock, the group's output
        from the tiers, or else built (in Inductor's thread, or on the host pool's worker: see
        ``builds_on_pool``) and published.

        A precompiled header waits until a build needs it: Inductor asks for it before every
        kernel it loads, where a kernel whose library comes from the tiers needs none (a second
        machine builds none), and a build that needs it waits for it (``_headers_for``). It is
        built here, never served (see ``SERVED_SUFFIXES``)."""
        target = builders[-1].get_target_file_path()
        if target.endswith(_HEADER_SUFFIXES) and not os.path.exists(target):
            with self._lock:
                self._headers.setdefault(os.path.realpath(target[: -len(".gch")]), (lock_path, builders))
            return
        self._locked_build(lock_path, builders, build_locally)

    def _locked_build(
        self, lock_path: str, builders: Sequence[Any], build_locally: Callable[[Sequence[Any]], None]
    ) -> None:
        from torch._inductor.codecache import LOCK_TIMEOUT
        from torch.utils._filelock import FileLock

        with FileLock(lock_path, timeout=LOCK_TIMEOUT):
            if os.path.exists(builders[-1].get_target_file_path()):
                return  # built (or fetched) before: the group's result is what matters
            if self.fetch_output(builders):
                return
            # The group's result is missing: what is there of its steps may be what a build
            # killed part-way left (a compiler writes its output in place), and a build skips a
            # target that exists. Every step is built again.
            for builder in builders:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(builder.get_target_file_path())
            self._headers_for(builders, build_locally)
            if self.builds_on_pool and self.parallel():
                try:
                    self.run_job(_worker_build, (list(builders),), {}, _build_name(builders))
                    self.count("cpp_builds")
                except (LoopThreadError, PortalTimeout) as exc:
                    self._unreachable(exc)
                    build_locally(builders)
                    self.count("cpp_local_builds")
            else:
                build_locally(builders)
                self.count("cpp_local_builds")
            self.publish_output(builders)

    def _headers_for(self, builders: Sequence[Any], build_locally: Callable[[Sequence[Any]], None]) -> None:
        """The precompiled headers these builds include, fetched or built now; where another
        thread is building one, waited for (as Inductor on its own builds it before any kernel:
        a kernel compiled without it parses the whole header, and on a busy machine that CPU is
        the header's build's)."""
        for builder in builders:
            tokens = shlex.split(builder.get_command_line())
            for flag, value in itertools.pairwise(tokens):
                if flag != "-include":
                    continue
                header = os.path.realpath(value)
                with self._lock:
                    lock = self._header_locks.setdefault(header, threading.Lock())
                with lock:
                    with self._lock:
                        waiting = self._headers.pop(header, None)
                    if waiting is not None:
                        self._locked_build(*waiting, build_locally)

    # -- jobs --------------------------------------------------------------------------------------

    def torch_key(self) -> bytes | None:
        """Inductor's hash of torch's sources, computed once in this process (handed to the
        workers, which would otherwise each compute it again)."""
        if self._torch_key is None:
            try:
                from torch._inductor.codecache import torch_key

                self._torch_key = torch_key()
            except Exception:
                return None
        return self._torch_key

    def encode_job(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
        """A job's payload: the function (by reference), its arguments, the environment it
        reads, and what the worker needs once (the cache folder, torch's key)."""
        if fn is _worker_build:
            # A C++ build runs the compiler this process would run, as it would run it (PATH,
            # CPATH, LIBRARY_PATH ...): a host pool's worker has the environment of the process
            # that started its server, and the build's key names this one's compiler.
            env: dict[str, str | None] = {
                k: v for k, v in os.environ.items() if not k.startswith("ACOMPILE_")
            }
        else:
            env = {name: os.environ.get(name) for name in JOB_ENVIRONMENT}
            env.update({name: os.environ[name] for name in JOB_ENVIRONMENT_IF_SET if name in os.environ})
        context = dict(self.context, torch_key=self.torch_key())
        return pickle.dumps((fn, tuple(args), dict(kwargs), env, context), protocol=pickle.HIGHEST_PROTOCOL)

    def submit_job(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        name: str,
        *,
        raw_errors: bool,
        started: threading.Event | None = None,
    ) -> JobFuture:
        """Run ``fn(*args, **kwargs)`` on a pool worker; its outcome in a future (decoded on
        the thread that asks for it). ``raw_errors``: the function's own exception as it was
        raised, else wrapped as Inductor's pool wraps it (``SubprocException``)."""
        result = JobFuture(name, raw_errors, (fn, args, kwargs))
        try:
            payload = self.encode_job(fn, args, kwargs)
        except Exception as exc:
            result.set_exception(exc)  # something in the job does not pickle: that job fails
            return result
        self.count("jobs")
        raw = self.host.portal.spawn(self._run, payload, name, started=started)
        result.attach(raw, self)
        return result

    def run_job(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], name: str) -> Any:
        """``submit_job`` and wait for it (however long the job takes, once the loop took it);
        raises the function's own exception, or ``PortalTimeout`` where the loop did not take it."""
        started = threading.Event()
        future = self.submit_job(fn, args, kwargs, name, raw_errors=True, started=started)
        if not started.wait(START_TIMEOUT) and not future.done():
            future.cancel()
            self._stalled_until = time.monotonic() + _STALL_SKIP
            raise PortalTimeout(
                f"the pool's event loop did not take the job within {START_TIMEOUT:g} s", True
            )
        return future.result()

    def fan_out(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], name: str) -> None:
        """Inductor compiles a Triton kernel's configs one after the other, in one job: the
        longest kernel's job (its configs, summed) is the compile's critical path. Where the pool
        has workers to spare, each further config also gets a job of its own (Inductor's own
        compile function over that config alone), which fills Triton's cache: the kernel's job
        finds those configs compiled. Counting the configs loads the kernel here, on a thread
        of its own, not the compiling one; nothing of it is waited for."""
        if self.host.size < _FAN_OUT_MIN_WORKERS or self.host.portal.closed:
            return
        with self._lock:
            if self._fan is None:
                self._fan = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="acompile-fan-out")
            fan = self._fan
        with contextlib.suppress(RuntimeError):  # shut down: serving ended
            fan.submit(self._fan_out, fn, args, kwargs, name)

    def _fan_out(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], name: str
    ) -> None:
        from acompile._torch._worker import one_config

        load_kernel = args[0]
        try:
            configs = len(load_kernel().configs)
        except Exception as exc:  # Inductor's kernel job compiles it all the same
            self.warn_once(
                "fan-out", "cannot count the configs of %s (%s: %s)", name, type(exc).__name__, exc
            )
            return
        for index in range(1, configs):
            job = (functools.partial(one_config, load_kernel, index), *args[1:])
            self.submit_job(fn, job, kwargs, f"{name} (config {index})", raw_errors=True)
            self.count("fan_out_jobs")

    def close(self) -> None:
        """No more fan-out, nor publishing of further outputs (serving ends; those on their
        way are still published, waited for by ``drain()``)."""
        with self._lock:
            fan, self._fan = self._fan, None
            self._closed = True
            publisher = self._publisher
        if fan is not None:
            fan.shutdown(wait=False, cancel_futures=True)
        if publisher is not None:
            publisher.shutdown(wait=False)

    async def _run(self, payload: bytes, name: str) -> bytes:
        result: bytes = await self.host.run(Job(WORKER_MODULE, payload, name, URGENT))
        return result


class JobFuture(concurrent.futures.Future[Any]):
    """A served job's outcome: the worker's reply, decoded (unpickled) on the first thread
    that asks for it rather than on the event loop, and the same for every later ask.

    Where the pool could not run the job for a fault of its own (no worker can start, the pool
    left), the job runs on the asking thread instead, as Inductor runs a compile without a pool:
    acompile's faults never fail a torch.compile. A compile that crashed its worker twice, or
    ran out of its time, fails with acompile's error."""

    def __init__(
        self, name: str, raw_errors: bool, job: tuple[Callable[..., Any], Sequence[Any], dict[str, Any]]
    ) -> None:
        super().__init__()
        self.name = name
        self._raw_errors = raw_errors
        self._job: tuple[Callable[..., Any], Sequence[Any], dict[str, Any]] | None = job
        self._raw: concurrent.futures.Future[bytes] | None = None
        self._decoded: tuple[bool, Any] | None = None
        self._decode_lock = threading.Lock()

    def attach(self, raw: concurrent.futures.Future[bytes], served: Served) -> None:
        self._raw = raw

        def arrived(done: concurrent.futures.Future[bytes]) -> None:
            if done.cancelled():
                self.cancel()
                return
            error = done.exception()
            if error is not None:
                served.count("jobs_failed" if not isinstance(error, PoolError) else "jobs_local")
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if isinstance(error, PoolError):
                    self.set_result(_POOL_FAULT)  # run here, by whoever asks first
                elif error is not None:
                    self.set_exception(error)
                else:
                    self._job = None
                    self.set_result(done.result())

        raw.add_done_callback(arrived)

    def cancel(self) -> bool:
        if self._raw is not None:
            self._raw.cancel()  # stops the job: dropped if queued, its worker stopped if running
        return super().cancel()

    def _decode(self, reply: Any) -> tuple[bool, Any]:
        with self._decode_lock:
            if self._decoded is None:
                if reply is _POOL_FAULT and self._job is not None:
                    fn, args, kwargs = self._job
                    try:
                        self._decoded = (True, fn(*args, **kwargs))
                    except Exception as exc:
                        self._decoded = (False, exc)
                else:
                    self._decoded = decode_reply(reply, self.name, self._raw_errors)
                self._job = None
            return self._decoded

    def result(self, timeout: float | None = None) -> Any:
        ok, value = self._decode(super().result(timeout))
        if not ok:
            raise value
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        if error is not None:
            return error
        ok, value = self._decode(super().result(timeout))
        return None if ok else value


# A job the pool could not run for a fault of its own: it runs where it is asked for.
_POOL_FAULT = object()


def decode_reply(reply: bytes, name: str, raw_errors: bool) -> tuple[bool, Any]:
    """(True, value) or (False, the exception to raise) from a worker's reply."""
    outcome = pickle.loads(reply)
    if outcome[0] == "ok":
        return True, outcome[1]
    _, error, text = outcome
    if error is not None and raw_errors:
        return False, error
    try:
        from torch._inductor.compile_worker.subproc_pool import SubprocException

        return False, SubprocException(text, name)
    except Exception:
        return False, RuntimeError(f"An exception occurred in a compile worker:\n\nName={name}\n{text}")


def artifacts_parts(name: str) -> dict[str, Any]:
    """What the entry key of torch's Mega-Cache artifacts saved under ``name`` is made of (this
    torch's release among it: they load into no other)."""
    import torch

    return {"torch-artifacts": name, "torch": str(torch.__version__), "format": 1}


def artifacts_key(name: str) -> str:
    return make_key(artifacts_parts(name))


def _yield_cpu() -> None:
    """Lower this thread's priority to the workers' (Linux sets a nice value per thread)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + DEFAULT_NICE))


def _packed(data: bytes, meta: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """A large blob compressed (zlib's fastest level), and the meta that says so."""
    if len(data) > _COMPRESS_OVER:
        return zlib.compress(data, 1), dict(meta, encoding="zlib")
    return data, meta


def _unpacked(data: bytes, meta: dict[str, Any]) -> bytes:
    return zlib.decompress(data) if meta.get("encoding") == "zlib" else data


def _build_name(builders: Sequence[Any]) -> str:
    return os.path.basename(str(builders[-1].get_target_file_path()))


def _worker_build(builders: list[Any]) -> None:
    """On a pool worker: build each target, in order (a link after the compiles it links), as
    Inductor's ``_worker_compile_cpp`` does, without its file lock (the process that submitted
    the job holds it, and found the group's result missing). Each target is built anew, never
    taken as it is: this job may be the retry of one whose worker was killed while a compiler
    wrote that target in place."""
    for builder in builders:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(builder.get_target_file_path())
        builder.build()


# -- keys of C++ builds ---------------------------------------------------------------------------


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """What the compiler says of itself (``--version``), once per process."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.strip() or out.stderr.strip() or compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


def _machine_folders() -> list[tuple[str, str]]:
    """Folders whose paths differ between machines and processes but not what is built in them,
    by name: Inductor's cache folder, its precompiled headers' folder, the temporary folder
    (longest first: one may hold another)."""
    folders = []
    with contextlib.suppress(Exception):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        folders.append(("inductor", cache_dir()))
    with contextlib.suppress(Exception):
        from torch._inductor import codecache

        folders.append(("headers", str(getattr(codecache, "_HEADER_DIR", ""))))
    folders.append(("tmp", tempfile.gettempdir()))
    known = [(name, os.path.realpath(path)) for name, path in folders if path]
    return sorted(known, key=lambda named: len(named[1]), reverse=True)


def build_key(builders: Sequence[Any]) -> str | None:
    """The key of a group of C++ builds (``build_parts``'s hash), or None."""
    parts = build_parts(builders)
    return make_key(parts) if parts is not None else None


def build_parts(builders: Sequence[Any]) -> dict[str, Any] | None:
    """What the key of a group of C++ builds (compiles, then the link that uses their outputs)
    is made of: each command line with machine paths taken out (an input file in a machine
    folder is named by its content), the compiler's version, the machine's architecture, torch's
    version. None for a group that cannot be keyed, or whose result is not a library, object or
    precompiled header."""
    try:
        import torch

        targets = [os.path.realpath(b.get_target_file_path()) for b in builders]
        if not targets or not targets[-1].endswith(SERVED_SUFFIXES):
            return None
        folders = _machine_folders()
        commands = []
        for builder in builders:
            if getattr(builder, "_use_relative_path", False):
                return None  # a remote build's relative paths: not this machine's to serve
            commands.append(
                [_normalized(t, targets, folders) for t in shlex.split(builder.get_command_line())]
            )
        compilers = sorted({_compiler_identity(str(b._compiler)) for b in builders})
    except Exception as exc:
        logger.debug("a C++ build that cannot be keyed: %s", exc)
        return None
    parts = {
        "torch-cpp": commands,
        "compilers": compilers,
        "machine": platform.machine(),
        "torch": str(torch.__version__),
        "format": 1,
    }
    if any("native" in token for command in commands for token in command):
        # -march=native and its like compile for the CPU that builds: another CPU needs its own.
        parts["cpu"] = cpu_identity()
    return parts


def _normalized(token: str, targets: list[str], folders: list[tuple[str, str]]) -> str:
    """One token of a command line, without what ties it to this machine: a group's output is
    named by its place in the group, an input file in a machine folder by its content, another
    path there relative to the folder."""
    prefix, path = "", token
    for flag in ("-I", "-L", "-include"):
        if token.startswith(flag) and len(token) > len(flag):
            prefix, path = flag, token[len(flag) :]
            break
    if not os.path.isabs(path):
        return token
    real = os.path.realpath(path)
    if real in targets:
        return f"{prefix}<output {targets.index(real)}>"
    for name, folder in folders:
        if real == folder or real.startswith(folder + os.sep):
            if os.path.isfile(real):
                return f"{prefix}<file {_file_digest(real)}>"
            return f"{prefix}<{name}>{real[len(folder) :]}"
    return token


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
