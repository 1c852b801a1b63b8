"""The worker's half of the Triton backend: compile a request into cache-entry bytes."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import triton

# Triton imports its code generator (and Gluon with it, ~0.1 s) at a process's first compile.
# Imported here, it comes with the backend, which a template imports while the pool is still
# preparing the workers' configuration, instead of after it, during the preload's compile.
import triton.compiler.code_generator
import triton.language as tl
from triton import knobs
from triton.compiler import ASTSource

from acompile._backends._logs import save_if_long
from acompile._backends._triton_source import materialize
from acompile._cache._entry import Entry
from acompile._errors import CompileError
from acompile._targets import parse_target

_base_env: dict[str, str] = {}


def setup(config: dict[str, Any]) -> None:
    # A private Triton cache per worker, emptied after every compile: Triton's own cache must not
    # answer (a stale or torn group there would leak into ours), and compiles are cached by the
    # pool, not here.
    os.environ["TRITON_CACHE_DIR"] = config["triton_cache_dir"]
    knobs.cache.dir = config["triton_cache_dir"]
    knobs.compilation.always_compile = True
    if config.get("triton_key"):
        # The parent computed Triton's hash of its own binaries once (~0.5 s of CPU); take it
        # instead of paying it again here, as Triton's own preload pool does.
        import triton.runtime.cache

        value = config["triton_key"]
        triton.runtime.cache.triton_key = lambda: value
    _base_env.update(os.environ)


@triton.jit
def _preload_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + 1.0, mask=mask)


def preload(config: dict[str, Any]) -> None:
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
    import triton.runtime.cache

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
    from acompile._backends._triton import key_environment

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
    try:
        with _environment(payload["env"]):
            compiled = triton.compile(src, target=target, options=dict(payload["options"]))
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
    meta = {"hash": compiled.hash, "triton": triton.__version__, "key_parts": payload.get("key_parts", {})}
    return Entry(key=payload["key"], backend="triton", name=payload["name"], blobs=blobs, meta=meta).encode()


def _remove_group(group: dict[str, str]) -> None:
    folders = {os.path.dirname(p) for p in group.values()}
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["compile", "preload", "setup"]
