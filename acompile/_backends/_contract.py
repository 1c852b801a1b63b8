"""What a backend is: the two halves the pool calls, written down as protocols.

A backend is two modules, named in ``_registry.BACKENDS``:

- its **parent half** (``ParentBackend``) runs in the process that owns the ``CompilePool``. It
  checks a spec and computes its cache key (``prepare``), says what a worker needs to compile it
  (``payload``), and turns a cache entry into what the user gets back (``load``). It never
  compiles: a compile may take minutes, crash, or leak memory, and runs in a worker.
- its **worker half** (``WorkerBackend``) runs in the pool's worker processes. It imports the
  compiler once (``setup``, ``preload``, before the template forks) and turns a payload into
  cache-entry bytes (``compile``).

The halves talk only through the payload (a dict that pickles, sent on the pool's private pipe)
and the entry (bytes, the cache's format): nothing else crosses the process boundary.

Both halves are modules whose functions match these protocols; ``_registry`` checks each
backend against them statically (mypy), so a backend that drifts from the contract fails the
type check rather than a request.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from acompile._cache import Entry
    from acompile._targets import Target
    from acompile._workers import BackendConfig, WorkerConfig

SpecT = TypeVar("SpecT", contravariant=True)
RequestT = TypeVar("RequestT", bound="Request")
KernelT = TypeVar("KernelT", covariant=True)


class Spec(Protocol):
    """A compile request as a user builds it (``TritonSpec``, ``CudaSpec``, ``CppSpec``).

    Its class names its backend, so that the pool finds the backend by the spec's type.
    """

    backend: ClassVar[str]


class Request(Protocol):
    """A checked, keyed spec: what ``ParentBackend.prepare`` returns.

    The pool reads ``key`` (the cache key, which also joins identical requests in flight) and
    ``name`` (for errors, logs, stats and traces); ``key_parts`` (what the key was computed from)
    goes into the entry's metadata and the warm-up record. The rest is the backend's own.
    """

    @property
    def key(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def key_parts(self) -> dict[str, Any]: ...


class ParentBackend(Protocol[SpecT, RequestT, KernelT]):
    """The parent's half of a backend, as ``CompilePool`` calls it.

    Parameterised by the spec it takes, the request it makes and the kernel it loads, so that
    each backend is checked with its own types.
    """

    #: The module of the worker half that compiles this backend's payloads; the pool sends each
    #: payload to it by this name.
    WORKER_MODULE: str

    async def setup(self, memo_dir: Path, target: Target | None) -> None:
        """Pay the parent's one-time costs (imports, the toolchain's identity) before requests.

        Called by ``CompilePool.__aenter__`` for each backend in ``preload``, once per pool;
        ``memo_dir`` is where the backend may remember things across processes. Never called for
        a backend used without being preloaded: ``prepare`` must not depend on it.
        """
        ...

    async def worker_config(self, memo_dir: Path) -> BackendConfig:
        """What the workers' ``setup``/``preload`` need from the parent, merged into their config.

        Called by the pool when it first starts workers (not in ``__aenter__``), for each
        preloaded backend; may be slow (Triton hashes its binaries once per machine). Nothing
        waits for it: a worker that started before it was over has none of it in the config its
        ``setup`` gets, and reads it when a job needs it with
        ``acompile._workers._late.prepared(config, wait=True)`` (``{}`` where it failed). That
        wait is not the job's time: ``prepared`` tells the pool, and neither the job's time limit
        nor its remembered compile time counts it. Any other such wait inside a job (computing
        itself what the hook could not) goes in ``with acompile._workers._late.paused():``.
        """
        ...

    async def prepare(self, spec: SpecT, target: Target | None, memo_dir: Path) -> RequestT:
        """Check ``spec`` and compute its key, for every request, before any cache look-up.

        ``target`` is the pool's (a spec may name its own). Raises ``InvalidSpecError`` with what
        to change, or ``BackendUnavailableError`` when a tool the spec needs is missing. Must be
        cheap on the loop: blocking work goes to a thread, and what can be remembered is.
        """
        ...

    async def payload(self, request: RequestT) -> dict[str, Any]:
        """What the worker half's ``compile`` gets: a dict that pickles.

        Called by the pool on a miss in every cache tier, right before it queues the job.
        """
        ...

    async def load(self, request: RequestT, entry: Entry, cache_root: Path) -> KernelT:
        """Turn a cache entry (from any tier, or a worker just now) into the user's kernel.

        Called once per key and process: the pool keeps the result in its memory tier.
        ``cache_root`` is the cache folder, for a backend whose result must be a file (a
        library to ``dlopen``). Raises a ``CompileError`` subclass when the result cannot be
        used here, and ``CorruptEntry`` for an entry from a cache tier that holds nothing it can
        load (the pool counts it as damaged and compiles the request again).
        """
        ...


class WorkerBackend(Protocol):
    """The worker's half of a backend, as a worker process calls it."""

    def setup(self, config: WorkerConfig) -> None:
        """Configure the process (folders, environment) from the pool's config.

        Called once per worker process, the first time the module is used there: before
        ``preload`` for a preloaded backend, else before its first job.
        """
        ...

    def preload(self, config: WorkerConfig) -> None:
        """Import the compiler and pay its first-use costs before any job: once, in the template
        process, so that every worker forked from it starts warm (in each worker when workers
        are not forked). Called for each backend the pool was asked to preload."""
        ...

    def compile(self, payload: dict[str, Any]) -> bytes:
        """Compile one payload into cache-entry bytes (``Entry.encode()``).

        Called for each job, in a worker. A rejected kernel raises a ``CompileError``
        subclass with the compiler's log; anything else that escapes is reported as a crash of
        the compiler with the worker's traceback.
        """
        ...
