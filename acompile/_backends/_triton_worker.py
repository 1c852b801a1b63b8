"""The worker's half of the Triton backend: compile a request into cache-entry bytes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import triton

if TYPE_CHECKING:
    from acompile._workers import WorkerConfig

# Triton imports its code generator (and Gluon with it, ~0.1 s) at a process's first compile.
# Imported here, it comes with the backend, which a template imports while the pool is still
# preparing the workers' configuration, instead of after it, during the preload's compile.
import triton.compiler.code_generator
import triton.compiler.compiler
import triton.language as tl
import triton.runtime.cache
from triton import knobs
from triton.compiler import ASTSource

from acompile._backends._logs import save_if_long
from acompile._backends._triton_env import key_environment
from acompile._backends._triton_source import materialize
from acompile._cache import Entry
from acompile._errors import CompileError
from acompile._targets import parse_target
from acompile._workers import late_config, outside_job_time

_base_env: dict[str, str] = {}

# Triton's hash of its own binaries and sources, as Triton computes it (~0.5 s of CPU).
_TRITONS_KEY = triton.runtime.cache.triton_key
_STAND_IN = "acompile-stand-in-triton-key"
# The configuration of a worker started before the parent had its key (``_workers._late``).
_late: dict[str, Any] = {}


def setup(config: WorkerConfig) -> None:
    # A private Triton cache per worker, emptied after every compile: Triton's own cache must not
    # answer (a stale or torn group there would leak into ours), and compiles are cached by the
    # pool, not here.
    os.environ["TRITON_CACHE_DIR"] = config["triton_cache_dir"]
    knobs.cache.dir = config["triton_cache_dir"]
    knobs.compilation.always_compile = True
    _late.clear()
    if config.get("triton_key"):
        # The parent computed Triton's hash of its own binaries once (~0.5 s of CPU); take it
        # instead of paying it again here, as Triton's own preload pool does.
        _use_key(config["triton_key"])
    elif config.get("late_config"):
        # Started before the parent had it (the first time in a cache folder, hashing takes longer
        # than a worker's start): compile meanwhile, and settle each kernel's hash (_settle).
        _late.update(config)
    _base_env.update(os.environ)


def _use_key(value: str) -> None:
    triton.runtime.cache.triton_key = lambda: value


def _parents_key(wait: bool) -> str | None:
    """The key the parent computed, once it is there; None while it is not and ``wait`` is
    false. Where the parent could not compute it, this worker computes it, as Triton does."""
    prepared = late_config(_late, wait=wait)  # a wait is not the job's time
    if prepared is None:
        return None
    _late.clear()
    key = prepared.get("triton_key")
    if isinstance(key, str) and key:
        _use_key(key)
        return key
    triton.runtime.cache.triton_key = _TRITONS_KEY
    with outside_job_time():  # Triton's JIT pays it in its first compile; not this kernel's cost
        return str(_TRITONS_KEY())


@contextlib.contextmanager
def _under_stand_in() -> Iterator[list[str]]:
    """Compile under a stand-in for Triton's key; yields the list of the cache keys Triton made
    from it (one per ``triton.compile``)."""
    keys: list[str] = []
    make_key = triton.compiler.compiler.get_cache_key

    def recording(*args: Any, **kwargs: Any) -> str:
        key: str = make_key(*args, **kwargs)
        keys.append(key)
        return key

    own = triton.runtime.cache.triton_key
    triton.runtime.cache.triton_key = lambda: _STAND_IN
    triton.compiler.compiler.get_cache_key = recording
    try:
        yield keys
    finally:
        triton.compiler.compiler.get_cache_key = make_key
        triton.runtime.cache.triton_key = own


def _settle(keys: list[str], stand_in_hash: str, blobs: dict[str, bytes]) -> str | None:
    """The hash ``triton.compile`` gives this kernel under the parent's key (waited for), with
    the metadata blob rewritten to it: Triton's hash is the SHA-256 of its cache key, which
    begins with ``triton_key()``, and the metadata holds it once. None where Triton did not
    compute it that way (another release): the caller compiles again under the real key."""
    real = _parents_key(wait=True)
    assert real is not None
    if len(keys) != 1 or not keys[0].startswith(_STAND_IN + "-"):
        return None
    if hashlib.sha256(keys[0].encode()).hexdigest() != stand_in_hash:
        return None
    old = stand_in_hash.encode()
    elsewhere = any(old in blob for ext, blob in blobs.items() if ext != "json")
    if blobs.get("json", b"").count(old) != 1 or elsewhere:
        return None
    new = hashlib.sha256((real + keys[0][len(_STAND_IN) :]).encode()).hexdigest()
    blobs["json"] = blobs["json"].replace(old, new.encode())
    return new


@triton.jit
def _preload_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + 1.0, mask=mask)


def preload(config: WorkerConfig) -> None:
    """Pay the one-time costs now: the backend's set-up (MLIR contexts, libdevice, ptxas's first
    start), by compiling a small kernel for the pool's target.

    Triton's hash of its own binaries (``triton_key``) comes with the configuration, computed
    once by the parent. A template is configured before the parent has it (the first time on a
    machine, the parent hashes for 0.4-0.8 s): its warm-up compile, whose result is thrown away,
    runs under a stand-in key, and each worker it forks gets the real one (``setup``). Hashing
    here too would put the hash on the path to the first worker a second time.
    """
    target = config.get("target")
    if target is None:
        return
    src = ASTSource(
        _preload_kernel,
        {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 128},
    )
    key = triton.runtime.cache.triton_key
    if not config.get("triton_key"):
        triton.runtime.cache.triton_key = lambda: "acompile-preload"
    try:
        compiled = triton.compile(src, target=parse_target(target).to_triton(), options={"num_warps": 4})
    finally:
        triton.runtime.cache.triton_key = key
    _remove_group(compiled.metadata_group)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Compile with exactly the Triton settings the parent keyed the request with."""
    current = key_environment(os.environ)
    for name in current.keys() - env.keys():
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        for name in env.keys() | current.keys():
            if name in _base_env:
                os.environ[name] = _base_env[name]
            else:
                os.environ.pop(name, None)


def compile(payload: dict[str, Any]) -> bytes:
    fn = materialize(payload["kernel"])
    src = ASTSource(fn, payload["signature"], payload["constexprs"], payload["attrs"] or None)
    target = parse_target(payload["target"]).to_triton()
    deferred = bool(_late) and _parents_key(wait=False) is None
    # Triton's list options are tuples (it hashes them): a list, as a manifest (TOML) or JSON
    # can only give one, is the same tuple.
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in payload["options"].items()}
    keys: list[str] = []
    try:
        with _environment(payload["env"]):
            if deferred:
                with _under_stand_in() as keys:
                    compiled = triton.compile(src, target=target, options=options)
            else:
                compiled = triton.compile(src, target=target, options=options)
    except Exception as exc:
        message = str(exc).strip() or type(exc).__name__
        path, saved = save_if_long(message, payload.get("log_dir"), payload["name"], payload["key"])
        err = CompileError(
            f"Triton failed to compile {payload['name']!r} for {payload['target']}:\n{message}"
            + (f"\n{saved}" if saved else ""),
            kernel=payload["name"],
            backend="triton",
            log=message,
        )
        err.log_path = path
        raise err from None
    try:
        blobs = {}
        for filename, path in compiled.metadata_group.items():
            blobs[filename.rsplit(".", 1)[-1]] = Path(path).read_bytes()
    finally:
        _remove_group(compiled.metadata_group)
    kernel_hash = compiled.hash
    if deferred:
        settled = _settle(keys, compiled.hash, blobs)
        if settled is None:
            return compile(payload)  # the parent's key is known now
        kernel_hash = settled
    meta = {"hash": kernel_hash, "triton": triton.__version__, "key_parts": payload.get("key_parts", {})}
    return Entry(key=payload["key"], backend="triton", name=payload["name"], blobs=blobs, meta=meta).encode()


def _remove_group(group: dict[str, str]) -> None:
    folders = {os.path.dirname(p) for p in group.values()}
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["compile", "preload", "setup"]
