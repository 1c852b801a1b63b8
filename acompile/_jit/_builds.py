"""Ninja builds of JIT libraries, served: from the tiers where any replica built them, else
built once on the pool's workers and published.

Called on the library's thread (the engine's, a model's import) in place of the library's own
``ninja`` run, through a ``ServedBuilds`` that a ``serve()`` context owns. Nothing here raises
into the library for a fault of acompile's (a tier away, the pool gone, a build file ninja
cannot read): the library's own build then runs, as without acompile. Only the compiler's own
failure (the module does not compile) reaches the library, as the error it would have raised.

A build's path (keys: ``_ninja``'s docstring):

1. read what ninja would run; the direct key; its **manifest** (the files the compilers read, as
   the first build recorded them) from the tiers; the full key from the files on this machine;
   the module's entry from the tiers: a hit writes the products where the library loads them
   (whole, in a folder of this user's alone), and ninja never runs;
2. a miss takes the fleet's lease on the direct key (a replica that holds it is waited for, up
   to the pool's ``fleet_wait``, and its manifest then read as in 1);
3. else the build runs on a pool worker (ninja in the library's folder, the library's
   environment), its products are checked and published under the full key, then its manifest
   under the direct key (which gives the lease back).

A library may also compile a kernel in the program's own process, where its compile function is
code of the program's (a closure over the caller's objects, as FlashInfer's CuTe DSL kernels are):
no other process can run it. Such a ``Kernel`` is keyed by what the library keys its own cache
by (made portable by the library's module), looked up in the tiers and waited for across the
fleet as a module is; on a miss it is compiled where the library compiles it, and published.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from acompile._cache import make_key
from acompile._errors import AcompileError, CompileError
from acompile._jit._ninja import (
    Build,
    BuildUnreadable,
    Graph,
    Unrecordable,
    direct_parts,
    full_parts,
    read_deps,
    read_graph,
    relative_name,
    resolve_name,
)
from acompile._jit._worker import LOCK_WAIT, NINJA_FAILED, folder_lock
from acompile._outputs import output_problem, write_output
from acompile._torch import LoopThreadError, PortalTimeout
from acompile._workers import URGENT, Job

if TYPE_CHECKING:
    from acompile._torch import Served

logger = logging.getLogger("acompile")

WORKER_MODULE = "acompile._jit._worker"
BACKEND = "jit"
MODULE = "module"
MANIFEST = "manifest"
KERNEL = "kernel"
# How long a build waits for the pool's workers to be ready before it runs where the library
# would run it: a pool starts in a second or two, and a module builds for tens of seconds.
_READY_WAIT = 60.0
# A tier read: the disk (bounded), the shared tier (0.5 s an operation, up to 5 s queued).
_GET_TIMEOUT = 10.0


class _Named(Protocol):
    @property
    def library(self) -> str: ...
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Kernel:
    """A kernel a library compiles in the program's process (see the module's docstring).

    ``parts``: its key's parts (nothing of this machine's: no path, no home), or None where the
    library's module cannot key it (``unkeyed`` says why: it is then compiled as without
    acompile). ``folder``: where its files go (checked as a module's build folder is).
    ``build()``: the library's own compile and write, here. ``products()``: the files it wrote,
    by name, to publish (``OSError``/``ValueError`` where it wrote none whole). ``put(blobs)``:
    write published files where the library loads them (``OSError``/``ValueError``/``KeyError``
    where they cannot be: it is then compiled here)."""

    library: str
    name: str
    folder: str
    parts: Mapping[str, Any] | None
    build: Callable[[], None]
    products: Callable[[], dict[str, bytes]]
    put: Callable[[dict[str, bytes]], None]
    unkeyed: str = ""


def _unlocked(build: Build, why: str, where: str) -> None:
    """Say that ``build`` ran without its folder's lock (``_worker.folder_lock``), and why."""
    logger.warning(
        "acompile: the build folder %s %s; %s module %s was built %s without its lock",
        build.folder,
        why,
        build.library,
        build.name,
        where,
    )


class ServedBuilds:
    """The ninja builds of every served JIT library of one ``serve()``; thread-safe.

    ``counts`` per library: ``<lib>:hits_<tier>`` (the module from the tiers: ``disk``,
    ``shared``, ``fleet`` for one another replica built while this one waited), ``<lib>:builds``
    (on the pool), ``<lib>:local_builds`` (where the library runs it: the pool was not
    reachable, or the build file could not be read), ``<lib>:failed`` (the compiler refused),
    ``<lib>:puts``, ``<lib>:after_ready`` (builds once the server said it was ready),
    ``<lib>:in_process`` (kernels compiled in the program's process: ``run_kernel``),
    ``<lib>:unserved`` (kernels acompile could not key: compiled as without it, never published),
    ``<lib>:hits_library`` (a warm-up's kernels that the library's own cache answered)."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.ready_at: float | None = None  # when the server said it was ready (mark_ready)
        self.after_ready: list[str] = []
        # The keys of the entries (modules and manifests) this process found or stored: what a
        # warm-up makes sure the shared tier holds.
        self.keys: set[str] = set()
        self._building: dict[str, threading.Lock] = {}
        self._recorded: set[str] = set()  # direct keys in the warm-up record
        # Each module's direct key, by library and module name (the last build of that name).
        self.direct_keys: dict[str, str] = {}
        # A warm-up's: a kernel the library's own cache answered goes to the tiers all the same.
        self.publish_library_hits = False

    # -- bookkeeping ------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict[str, Any]:
        """Per library: ``hits`` by tier, ``builds``, ``local_builds``, ``failed``, ``puts``,
        ``after_ready`` (and which modules), ``keys`` (each module's direct key)."""
        with self._lock:
            counts = dict(self.counts)
            late = list(self.after_ready)
            keys = dict(self.direct_keys)
        libraries = sorted({name.split(":", 1)[0] for name in (*counts, *late, *keys)})
        out: dict[str, Any] = {}
        for lib in libraries:
            out[lib] = {
                "hits": {t: counts.get(f"{lib}:hits_{t}", 0) for t in ("disk", "shared", "fleet", "library")},
                **{
                    what: counts.get(f"{lib}:{what}", 0)
                    for what in (
                        "builds",
                        "in_process",
                        "local_builds",
                        "unserved",
                        "failed",
                        "puts",
                        "after_ready",
                    )
                },
                "built_after_ready": [n.split(":", 1)[1] for n in late if n.startswith(lib + ":")],
                # The key each module was looked up under (a warm-up record names it).
                "keys": {n.split(":", 1)[1]: k for n, k in keys.items() if n.startswith(lib + ":")},
            }
        return out

    def mark_ready(self) -> None:
        """From now on, every build is counted and named as one after ready."""
        self.ready_at = time.monotonic()

    # -- the build --------------------------------------------------------------------------------

    def run(self, build: Build, run_here: Callable[[], None], failed: Callable[[str], Exception]) -> None:
        """Serve ``build``: its products from the tiers, or built on the pool and published.
        ``run_here`` runs the library's own ninja (where acompile cannot help); ``failed(log)``
        makes the error the library raises for a build that fails."""
        lib = build.library
        if problem := folder_problem(build.folder):
            # Another user could have put objects, a build file or links there that ninja takes
            # as built: what comes out is theirs, and is neither built on the pool nor published.
            self.served.warn_once(
                f"{lib}-folder-{build.folder}",
                "acompile: a %s build is not served: %s; built as without acompile",
                lib,
                problem,
            )
            self._late(build)
            self._run_here(build, run_here)
            return
        try:
            graph = read_graph(build)
            direct = direct_parts(build, graph)
            direct_key = make_key(direct)
        except (BuildUnreadable, OSError) as exc:
            self.served.warn_once(
                f"{lib}-unreadable",
                "acompile: a %s build is not served (%s); built as without acompile",
                lib,
                exc,
            )
            self._late(build)
            self._run_here(build, run_here)
            return
        # One build of a module at a time in this process (two threads asking for one module:
        # the second finds the first one's result); other modules go on.
        with self._key_lock(lib, build.name, direct_key):
            self._run_keyed(build, graph, direct, run_here, failed)

    def _run_keyed(
        self,
        build: Build,
        graph: Graph,
        direct: dict[str, Any],
        run_here: Callable[[], None],
        failed: Callable[[str], Exception],
    ) -> None:
        direct_key = make_key(direct)
        if (deps := self._fetch(build, graph, direct_key, fleet=False)) is not None:
            self._record(build, direct_key, deps)
            return
        if (
            self._claim(direct_key) is not None
            and (deps := self._fetch(build, graph, direct_key, fleet=True)) is not None
        ):
            self._record(build, direct_key, deps)
            return
        self._late(build)
        try:
            if not self._wait_ready():
                self._run_here(build, run_here)
            else:
                try:
                    self._run_on_pool(build, graph, failed)
                except (AcompileError, PortalTimeout, LoopThreadError) as exc:
                    # Not the compiler's (``_run_on_pool`` raised that as the library's error):
                    # the pool's fault (it left, a worker died twice, a limit of the pool's, its
                    # loop did not answer): the library builds as it would without acompile.
                    self.served.unreachable(exc)
                    self._run_here(build, run_here)
        except BaseException:
            with contextlib.suppress(Exception):
                self.served.host.portal.spawn(_release, self.served.host.release, direct_key)
            raise
        self._publish(build, graph, direct)

    def _key_lock(self, lib: str, name: str, key: str) -> threading.Lock:
        """The lock of one key's build in this process (the key noted as ``name``'s)."""
        with self._lock:
            self.direct_keys[f"{lib}:{name}"] = key
            return self._building.setdefault(key, threading.Lock())

    def _claim(self, key: str) -> Any:
        """The fleet's lease on ``key``: None where this replica now holds it (or the tier
        cannot say), else the entry another replica published while this one waited."""
        try:
            return self.served.call(
                self.served.host.claim, key, timeout=self.served.host.fleet_wait + _GET_TIMEOUT
            )
        except Exception as exc:
            self.served.unreachable(exc)
            return None

    # -- a kernel compiled in the program's process -----------------------------------------------

    def run_kernel(self, kernel: Kernel) -> None:
        """Serve ``kernel``: its files from the tiers (or from the replica that held the fleet's
        lease while this one waited), else compiled here by the library and published."""
        lib = kernel.library
        problem = kernel.unkeyed if kernel.parts is None else folder_problem(kernel.folder)
        if kernel.parts is None or problem:
            self.served.warn_once(
                f"{lib}-kernel-{problem}",
                "acompile: a %s kernel is not served (%s); compiled as without acompile",
                lib,
                problem,
            )
            self._late(kernel)
            kernel.build()
            self.count(f"{lib}:unserved")  # never published: not a build of acompile's
            return
        parts = dict(kernel.parts)
        key = make_key(parts)
        with self._key_lock(lib, kernel.name, key):
            if self._fetch_kernel(kernel, key, fleet=False):
                return
            if self._claim(key) is not None and self._fetch_kernel(kernel, key, fleet=True):
                return
            self._late(kernel)
            try:
                kernel.build()
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    self.served.host.portal.spawn(_release, self.served.host.release, key)
                if isinstance(exc, Exception):
                    self.count(f"{lib}:failed")
                raise
            self.count(f"{lib}:in_process")
            try:
                self._publish_kernel(kernel, key, parts)
            except Exception as exc:  # acompile's fault (its loop gone): never the library's
                self.served.unreachable(exc)

    def publish_kernel(self, kernel: Kernel) -> None:
        """A kernel the library's own cache answered (a warm-up's: ``publish_library_hits``),
        stored in the tiers where they lack it; counted as a hit of the library's cache."""
        lib = kernel.library
        if kernel.parts is None or folder_problem(kernel.folder):
            self.count(f"{lib}:unserved")
            return
        parts = dict(kernel.parts)
        key = make_key(parts)
        with self._lock:
            self.direct_keys[f"{lib}:{kernel.name}"] = key
        self.count(f"{lib}:hits_library")
        try:
            entry, _ = self.served.call(self.served.host.find, key, timeout=_GET_TIMEOUT)
            if entry is not None and entry.backend == BACKEND and entry.name == KERNEL:
                with self._lock:
                    self.keys.add(key)
                return
            self._publish_kernel(kernel, key, parts)
        except Exception as exc:  # acompile's fault: never the library's
            self.served.unreachable(exc)

    def _fetch_kernel(self, kernel: Kernel, key: str, *, fleet: bool) -> bool:
        lib = kernel.library
        host = self.served.host
        try:
            entry, tier = self.served.call(host.find, key, timeout=_GET_TIMEOUT)
        except Exception as exc:
            self.served.unreachable(exc)
            return False
        if entry is None or entry.backend != BACKEND or entry.name != KERNEL:
            return False
        if host.shared and not host.trusted and tier not in ("disk", ""):
            return False  # host code from a tier anyone could write: never loaded
        try:
            kernel.put(dict(entry.blobs))
        except (KeyError, OSError, ValueError) as exc:
            self.served.warn_once(
                f"{lib}-kernel-output", "acompile: a served %s kernel is not used (%s); compiled", lib, exc
            )
            return False
        self.count(f"{lib}:hits_{'fleet' if fleet else tier}")
        with self._lock:
            self.keys.add(key)
        logger.info("acompile: %s kernel %s from the %s tier", lib, kernel.name, "fleet" if fleet else tier)
        return True

    def _publish_kernel(self, kernel: Kernel, key: str, parts: dict[str, Any]) -> None:
        lib = kernel.library
        host = self.served.host
        try:
            blobs = kernel.products()
        except (OSError, ValueError) as exc:
            # The library keeps the compiled kernel in memory where it could not write it (its
            # own best effort): nothing to publish; the fleet's lease is given back.
            self.served.warn_once(
                f"{lib}-kernel-publish", "acompile: a %s kernel is not published (%s)", lib, exc
            )
            host.portal.spawn(_release, host.release, key)
            return
        meta = {"library": lib, "kernel": kernel.name, "key_parts": parts}
        self.count(f"{lib}:puts")
        with self._lock:
            self.keys.add(key)
        self.served.keep(host.portal.spawn(_store_kernel, host.store, key, blobs, meta), lib)
        if host.record is not None:
            self.served.warn_once(
                f"{lib}-record-kernels",
                "acompile: %s kernels compiled in the process (%s, and any after it) are served but not "
                "recorded for warm-up: their compile function is the program's code, which a record "
                "cannot hold (warm them up by a generator that builds them)",
                lib,
                kernel.name,
            )

    def _fetch(self, build: Build, graph: Graph, direct_key: str, *, fleet: bool) -> list[str] | None:
        """Write the module's products from the tiers; the files its compilers read (as the
        manifest names them), or None on a miss or any fault."""
        lib = build.library
        host = self.served.host
        try:
            manifest, _ = self.served.call(host.find, direct_key, timeout=_GET_TIMEOUT)
            if manifest is None or manifest.backend != BACKEND or manifest.name != MANIFEST:
                return None
            deps = json.loads(manifest.blobs["deps"])
            if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
                return None
            parts = full_parts(direct_key, build, deps)
            if parts is None:
                return None
            entry, tier = self.served.call(host.find, make_key(parts), timeout=_GET_TIMEOUT)
        except Exception as exc:
            if not isinstance(exc, (KeyError, ValueError)):
                self.served.unreachable(exc)
            return None
        if entry is None or entry.backend != BACKEND or entry.name != MODULE:
            return None
        module_key = make_key(parts)
        if host.shared and not host.trusted and tier not in ("disk", ""):
            return None  # host code from a tier anyone could write: never loaded
        names = entry.meta.get("products")
        if not isinstance(names, list) or len(names) != len(graph.products):
            return None
        try:
            for index, path in enumerate(graph.products):
                if names[index] != relative_name(path, build.roots):
                    return None
                data = entry.blobs[f"product{index}"]
                if problem := output_problem(path, data):
                    raise ValueError(problem)
                write_output(path, data)
        except (KeyError, OSError, ValueError) as exc:
            self.served.warn_once(
                f"{lib}-output", "acompile: a served %s module is not used (%s); it is built", lib, exc
            )
            return None
        self.count(f"{lib}:hits_{'fleet' if fleet else tier}")
        with self._lock:
            self.keys.update((direct_key, module_key))
        logger.info("acompile: %s module %s from the %s tier", lib, build.name, "fleet" if fleet else tier)
        return deps

    def _wait_ready(self) -> bool:
        served = self.served
        portal = served.host.portal
        if portal.closed or portal.on_loop_thread():
            return False
        served.want_workers()
        deadline = time.monotonic() + _READY_WAIT
        while not served.ready.wait(0.1):
            if portal.closed or served.not_ready.is_set() or time.monotonic() >= deadline:
                return False
        return served.parallel()

    def _run_on_pool(self, build: Build, graph: Graph, failed: Callable[[str], Exception]) -> None:
        # The library's environment, less acompile's own: the signing key stays in this process,
        # and a Python the build starts (FlashInfer embeds cubins with one) is never served.
        env = {k: v for k, v in build.env.items() if not k.startswith("ACOMPILE_")}
        payload = json.dumps(
            {
                "name": build.name,
                "folder": build.folder,
                "build_file": build.build_file,
                "ninja": build.ninja,
                "jobs": build.jobs,
                "env": env,
                "products": list(graph.products),
            }
        ).encode()
        job = Job(WORKER_MODULE, payload, f"{build.name} ({build.library})", URGENT)
        started = threading.Event()
        future = self.served.host.portal.spawn(self.served.host.run, job, started=started)
        if not started.wait(5.0) and not future.done():
            future.cancel()
            raise PortalTimeout("the pool's event loop did not take the build", True)
        started_at = time.perf_counter()
        try:
            reply = future.result()
        except CompileError as exc:
            if exc.backend != NINJA_FAILED:
                raise  # the pool's fault (a time or memory limit, a worker lost): the caller's
            self.count(f"{build.library}:failed")
            raise failed(exc.log or str(exc)) from None
        except BaseException:
            future.cancel()  # this thread is interrupted: the build stops with it
            raise
        self.count(f"{build.library}:builds")
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            if unlocked := json.loads(reply).get("unlocked"):
                _unlocked(build, unlocked, "on the pool")
        logger.info(
            "acompile: %s module %s built on the pool in %.1f s",
            build.library,
            build.name,
            time.perf_counter() - started_at,
        )

    def _run_here(self, build: Build, run_here: Callable[[], None]) -> None:
        # A build of this folder on the pool that was stopped (a limit, a cancel, a dead worker)
        # may still be ending: its ninja removes what its commands left half-done, which could be
        # what the library's build has just made. Its lock is held until its last process is gone.
        with folder_lock(build.folder, LOCK_WAIT, lambda why: _unlocked(build, why, "here")):
            run_here()
        self.count(f"{build.library}:local_builds")

    def _late(self, build: _Named) -> None:
        """A build about to run (here or on the pool): counted and named once the server said it
        was ready (``Serving.mark_ready`` or the pool's ``mark_ready``); the pool's
        ``on_late="refuse"`` raises ``CompiledAfterReadyError`` into the library instead."""
        host = self.served.host
        pool_ready = host.is_ready is not None and host.is_ready()
        if self.ready_at is None and not pool_ready:
            return
        with self._lock:
            self.counts[f"{build.library}:after_ready"] += 1
            self.after_ready.append(f"{build.library}:{build.name}")
        self.served.warn_once(
            f"late-{build.library}-{build.name}",
            "acompile: %s built module %s after the server said it was ready",
            build.library,
            build.name,
        )
        if pool_ready and host.late is not None:
            host.late(f"jit:{build.library}", build.name, say=False)

    def _publish(self, build: Build, graph: Graph, direct: dict[str, Any]) -> None:
        """The products under the full key, then the manifest under the direct key (a replica
        that reads the manifest finds the module)."""
        lib = build.library
        direct_key = make_key(direct)
        try:
            deps = [relative_name(p, build.roots) for p in read_deps(build, graph)]
            parts = full_parts(direct_key, build, deps)
            if parts is None:
                raise ValueError("a file the build read is gone")
            blobs: dict[str, bytes] = {}
            for index, path in enumerate(graph.products):
                with open(path, "rb") as f:
                    data = f.read()
                if problem := output_problem(path, data):
                    raise ValueError(problem)
                blobs[f"product{index}"] = data
        except (BuildUnreadable, OSError, ValueError) as exc:
            self.served.warn_once(f"{lib}-publish", "acompile: a %s module is not published (%s)", lib, exc)
            self.served.host.portal.spawn(_release, self.served.host.release, direct_key)
            return
        key = make_key(parts)
        meta = {
            "library": lib,
            "module": build.name,
            "products": [relative_name(p, build.roots) for p in graph.products],
            # What the key was made of (acompile cache explain): the direct key and every file.
            "key_parts": parts,
        }
        host = self.served.host
        self.count(f"{lib}:puts")
        with self._lock:
            self.keys.update((direct_key, key))
        manifest_meta = {"module": build.name, "key_parts": direct}
        self.served.keep(
            host.portal.spawn(_store_both, host.store, key, blobs, meta, direct_key, deps, manifest_meta), lib
        )
        self._record(build, direct_key, deps)

    def _record(self, build: Build, direct_key: str, deps: list[str]) -> None:
        """Add the module to the pool's warm-up record (``CompilePool(record=...)``), once per
        direct key: how to remake its build (the library's ``describe``) and the generated files
        its compilers read, which a warm-up box cannot make. Blocking (a few small files read,
        one append), on the library's thread. A build that cannot be recorded is said once."""
        record = self.served.host.record
        if record is None or build.describe is None:
            return
        with self._lock:
            if direct_key in self._recorded:
                return
            self._recorded.add(direct_key)
        try:
            fields = dict(build.describe())
            embed = tuple(fields.pop("embed", ()))
            fields["files"] = _embedded(build, deps, fields.get("sources", ()), embed)
            record(direct_key, build.library, fields)
        except Exception as exc:  # Unrecordable, or a fault of acompile's: never the library's
            self.served.warn_once(
                f"{build.library}-record-{build.name}",
                "acompile: %s module %s is served but not recorded for warm-up (%s)",
                build.library,
                build.name,
                exc,
            )


async def _store_both(
    store: Callable[..., Any],
    key: str,
    blobs: dict[str, bytes],
    meta: dict[str, Any],
    direct_key: str,
    deps: list[str],
    manifest_meta: dict[str, Any],
) -> None:
    await store(key, MODULE, blobs, meta, backend=BACKEND)
    await store(direct_key, MANIFEST, {"deps": json.dumps(deps).encode()}, manifest_meta, backend=BACKEND)


async def _store_kernel(
    store: Callable[..., Any], key: str, blobs: dict[str, bytes], meta: dict[str, Any]
) -> None:
    await store(key, KERNEL, blobs, meta, backend=BACKEND)


async def _release(release: Callable[[str], None], key: str) -> None:
    release(key)


# What one record entry may carry of generated files: a generator's sources are kilobytes.
_EMBED_LIMIT = 8 << 20


def _embedded(build: Build, deps: list[str], sources: Any, embed: tuple[str, ...]) -> dict[str, str]:
    """The files under the ``embed`` roots that the build read (its compilers' dependency list,
    and its sources), by rooted name: their text."""
    wanted = sorted({*deps, *(s for s in sources if isinstance(s, str))})
    files: dict[str, str] = {}
    total = 0
    for name in wanted:
        match = re.match(r"^<([a-z_]+)>/", name)
        if match is None or match.group(1) not in embed:
            continue
        path = resolve_name(name, build.roots)
        if path is None:
            raise Unrecordable(f"{name} is not a file of this machine's")
        try:
            with open(path, "rb") as f:
                data = f.read(_EMBED_LIMIT + 1 - total)
        except OSError as exc:
            raise Unrecordable(f"{name} cannot be read ({exc})") from None
        total += len(data)
        if total > _EMBED_LIMIT:
            raise Unrecordable(f"its generated files are over {_EMBED_LIMIT >> 20} MiB")
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise Unrecordable(f"{name} is not text") from None
    return files


def folder_problem(folder: str) -> str | None:
    """Why a library's build folder is not one acompile builds in or publishes from (it, or a
    folder it is in, belongs to another user or may be written by others), or None. A missing
    folder is none: the library makes it (as this user)."""
    path = os.path.realpath(folder)
    while True:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            continue
        except OSError as exc:
            return f"{path} cannot be read ({exc})"
        break
    # The folder itself (or its nearest existing ancestor, which the library will make it in).
    if info.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o002:
        return f"{path} may be written by any user"
    return None
