"""The parent's half of the Triton backend, as the pool calls it (``_contract.ParentBackend``).

Nothing here compiles: ``prepare()`` turns a ``TritonSpec`` into a request with its cache key and
the payload a worker needs (see ``_triton_worker``), and ``load()`` turns a cache entry back into
a ``TritonKernel`` holding the same ``CompiledKernel`` Triton itself would build. Each job has a
module of its own:

- ``_triton_spec``: ``TritonSpec``, ``TritonRequest``, and the checks of a spec's arguments;
- ``_triton_describe``: which kernel a spec names, its Triton key, its description for workers;
- ``_triton_text``: kernels given as source strings, run in a short-lived process;
- ``_triton_once``: work done once for the tasks of an event loop that ask at once, and the
  parse thread;
- ``_triton_env``: the environment variables that change a compile (keyed here, set in workers);
- ``_triton_load``: an entry's metadata checked, and Triton's objects rebuilt from it;
- ``_triton_kernel``: ``TritonKernel``, and the launch path;
- ``_triton_toolchain``, ``_triton_source``, ``_triton_probe``: the toolchain's identity, shipping
  a JIT function to a worker, running a source string's top-level code.

What this process remembers (Triton's toolchain, each kernel's description, source strings'
findings, option names, metadata classes, launch code, ...) is kept beside the job it serves,
each memo registered where it is made (``_memos``); ``forget()`` empties them all.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from acompile import _pacing
from acompile._backends import (
    _memos,
    _triton_describe,
    _triton_env,
    _triton_load,
    _triton_once,
    _triton_spec,
    _triton_toolchain,
)
from acompile._backends._memos import on_forget, remembered
from acompile._backends._triton_kernel import TritonKernel
from acompile._backends._triton_spec import TritonRequest
from acompile._cache import logs_dir, make_key
from acompile._version import __version__

if TYPE_CHECKING:
    from acompile._backends._triton_spec import TritonSpec
    from acompile._cache import Entry
    from acompile._targets import Target
    from acompile._workers import BackendConfig

# The module of this backend's worker half, as the registry names it too (a test holds them equal).
WORKER_MODULE = "acompile._backends._triton_worker"


async def setup(memo_dir: Path, target: Target | None) -> None:
    """Pay this process's one-time costs off the loop, before requests arrive: the toolchain's
    identity (remembered on disk), the option names and compiler backend of the target, and the
    parsing thread (started here: ``Thread.start`` waits for the thread to run)."""

    def work() -> None:
        _toolchain(memo_dir)
        _triton_env.invalidating_env_names()
        _triton_once.parse_thread().submit(int)
        if target is not None:
            _triton_spec.option_names(target.backend)
            with contextlib.suppress(Exception):  # a warm-up: loading a kernel says what is wrong
                _triton_load.backend_for(target.to_triton())

    with _pacing.quick_switches():  # imports and file walks: Python on a thread, beside the loop
        await anyio.to_thread.run_sync(work)


async def worker_config(memo_dir: Path) -> BackendConfig:
    """What workers need from the parent: Triton's own key of its binaries, computed once."""
    # Abandoned on cancellation: a pool left while this runs (the first time on a machine, it
    # hashes Triton's binaries, ~0.7 s) does not wait for it; the thread finishes and remembers
    # the result on disk for the next process.
    with _pacing.quick_switches():  # the walk of Triton's sources is Python, beside the loop
        key = await anyio.to_thread.run_sync(_triton_toolchain.triton_key, memo_dir, abandon_on_cancel=True)
    return {"triton_key": key}


# The toolchain's identity (see _triton_toolchain), worked out once a process: every key holds it.
_toolchain_memo: dict[str, str] | None = None


def _toolchain(memo_dir: Path) -> dict[str, str]:
    global _toolchain_memo
    if _toolchain_memo is None:
        _toolchain_memo = _triton_toolchain.toolchain(memo_dir)
    return _toolchain_memo


# Requests keyed already, by what they were made of (``_recall_key``): the same kernel asked
# again (a memory hit, the hot path of a server) is a dictionary look-up instead of the checks of
# its signature and options and a SHA-256 of its parts (~15 us). Bounded: the latest kept.
_PREPARED_MAX = 4096
_prepared: collections.OrderedDict[tuple[Any, ...], TritonRequest] = remembered(collections.OrderedDict())


def _typed(value: Any) -> Any:
    """``value`` as a memo's key holds it: with its type (1, 1.0 and True are equal to Python,
    not to a compile), floats by their repr (-0.0 is 0.0 to Python), sequences element by element."""
    kind = type(value)
    if kind is float:
        return (kind, repr(value))
    if kind in (tuple, list):
        return (kind, tuple(_typed(v) for v in value))
    return (kind, value)


def _recall_key(spec: TritonSpec, default_target: Target | None, memo_dir: Path) -> tuple[Any, ...] | None:
    """What a request of ``spec`` is made of, hashable; None where it cannot be told cheaply
    (a source string, a kernel whose Triton key is not known yet, a value that cannot be hashed)."""
    fn = spec.fn
    fn_hash = getattr(fn, "hash", None)
    if not isinstance(fn_hash, str) or fn_hash.startswith("recursion:") or isinstance(fn, str):
        return None  # not known yet (or being computed, on the parse thread)
    try:
        key = (
            id(fn),  # the request holds fn: the id stays its own while the memo has it
            fn_hash,  # Triton's key of its source: set again where the source is
            tuple((k, _typed(v)) for k, v in spec.signature.items()),
            tuple((k, _typed(v)) for k, v in (spec.constexprs or {}).items()),
            spec.kernel_name,
            _typed(spec.num_warps),
            _typed(spec.num_stages),
            spec.target,
            default_target,
            None if spec.attrs is None else tuple((k, _typed(v)) for k, v in spec.attrs.items()),
            tuple((k, _typed(v)) for k, v in spec.options.items()),
            tuple(_triton_env.key_environment(os.environ).items()),
            memo_dir,
        )
        hash(key)
    except (TypeError, AttributeError, RecursionError):
        return None
    return key


async def prepare(spec: TritonSpec, default_target: Target | None, memo_dir: Path) -> TritonRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change."""
    recall = _recall_key(spec, default_target, memo_dir)
    if recall is not None and (known := _prepared.get(recall)) is not None:
        return known
    request = await _prepare(spec, default_target, memo_dir)
    recall = _recall_key(spec, default_target, memo_dir)  # the kernel's key is known now
    if recall is not None:
        _prepared[recall] = request
        if len(_prepared) > _PREPARED_MAX:
            _prepared.popitem(last=False)
    return request


async def _prepare(spec: TritonSpec, default_target: Target | None, memo_dir: Path) -> TritonRequest:
    target = _triton_spec.resolve_target(spec.target, default_target)
    fn, kernel_ref = await _triton_describe.resolve_kernel(spec)
    # Requests that arrive together (gather(), a warm start) are keyed a slice of the loop at a
    # time; not before: what resolve_kernel starts in a thread (the function's key) starts now.
    await _pacing.checkpoint()
    signature, constants = _triton_spec.full_signature(fn, spec.signature, spec.constexprs or {})
    attrs = _triton_spec.normalize_attrs(fn, spec.attrs, signature)
    if not _triton_spec.knows_options(target.backend):
        await anyio.to_thread.run_sync(_triton_spec.option_names, target.backend)  # imports the backend
    options = _triton_spec.check_options(target, spec)
    tools = _toolchain_memo or await anyio.to_thread.run_sync(_toolchain, memo_dir)
    env = _triton_env.key_environment(os.environ)
    key_parts = {
        "format": 1,
        "backend": "triton",
        "acompile": __version__,
        "toolchain": tools,
        "kernel": fn.cache_key,
        "name": fn.__name__,
        "signature": list(signature.items()),
        "constexprs": {k: _triton_spec.canonical(k, v) for k, v in sorted(constants.items())},
        "attrs": sorted([list(k), v] for k, v in attrs.items()),
        "options": options,
        "target": str(target),
        "env": env,
    }
    if kernel_ref is not None and kernel_ref["kind"] == "text":
        # A text's Triton key is what its own process reported: a text that lies (its top-level
        # code may patch Triton) would otherwise be keyed, and served, as another kernel. Keyed by
        # the text itself too, a lie reaches no request but those for this very text.
        key_parts["text"] = kernel_ref["digest"]
    key = make_key(key_parts)
    payload = {
        "key": key,
        "name": fn.__name__,
        "kernel": kernel_ref,
        "signature": signature,
        "constexprs": constants,
        "attrs": attrs,
        "options": options,
        "target": str(target),
        "env": env,
        # Stored with the entry, so that a miss that should have been a hit can be explained.
        "key_parts": key_parts,
        # Where a worker writes a compiler message too long for an error (see _logs).
        "log_dir": _log_dir(memo_dir),
    }
    return TritonRequest(key, fn.__name__, target, fn, signature, constants, attrs, payload, key_parts)


def prepare_ahead(specs: list[TritonSpec]) -> list[anyio.Event]:
    """Start now what ``prepare()`` of each of ``specs`` would wait for, all of it at once: the
    Triton keys of their functions, one after another on the parse thread (``gather()``).
    Returns at once, with the events set as each ends; the requests' errors are still each
    request's own."""
    return _triton_describe.keys_ahead(specs)


@remembered
@functools.lru_cache(maxsize=16)  # one path a cache folder, computed once
def _log_dir(memo_dir: Path) -> str:
    return str(logs_dir(memo_dir.parent))


async def payload(request: TritonRequest) -> dict[str, Any]:
    """The job a worker runs for request (called on a cache miss only)."""
    if request.payload["kernel"] is None:
        request.payload["kernel"] = await _triton_describe.description(request.fn)
    return request.payload


async def load(request: TritonRequest, entry: Entry, cache_root: Path) -> TritonKernel:
    """The kernel of an entry. What can be wrong with an entry that passed its checksum (one
    written by something else than a Triton worker) is found here, not at first use (``asm``,
    ``compiled``) or at the first launch: raises ``CorruptEntry``."""
    return TritonKernel(request, entry, _triton_load.kernel_metadata(entry, request.target))


def forget() -> None:
    """Forget everything this process remembered of Triton and of kernels, as if it had just
    started: the next request works each thing out again (for a test that changes what they
    hold, such as another Triton installation): every memo registered with ``_memos``.

    Not memos, and kept: the event loops' tables of work in progress (tasks are waiting on
    them), the parse thread, and the slots of source strings' processes (running probes hold
    them)."""
    _memos.forget_all()


@on_forget
def _forget_toolchain() -> None:
    global _toolchain_memo
    _toolchain_memo = None


__all__ = (
    "WORKER_MODULE",
    "forget",
    "load",
    "payload",
    "prepare",
    "prepare_ahead",
    "setup",
    "worker_config",
)
