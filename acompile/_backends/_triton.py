"""The parent's half of the Triton backend: check a request, key it, load its result.

Nothing here compiles: ``prepare()`` turns a ``TritonSpec`` into a request with its cache key and
the payload a worker needs (see ``_triton_worker``), and ``load()`` turns a cache entry back into
a ``TritonKernel`` holding the same ``CompiledKernel`` Triton itself would build.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio

from acompile._backends import _triton_source, _triton_toolchain
from acompile._backends._registry import BACKENDS
from acompile._cache._entry import Entry
from acompile._cache._keys import make_key
from acompile._cache._layout import logs_dir
from acompile._errors import DeviceUnavailableError, InvalidSpecError, bounded
from acompile._targets import Target, parse_target
from acompile._version import __version__

WORKER_MODULE = BACKENDS["triton"].worker

# TRITON_* variables that cannot change a compiled kernel (paths, caches, logging). Every other
# TRITON_* variable, and every variable Triton itself lists as cache-invalidating, is part of the
# key and is set in the worker exactly as it was in the parent when the request was keyed. Tool
# paths are left out on purpose: the key holds the tools' versions instead, which travel.
_ENV_IGNORED = frozenset(
    {
        "TRITON_CACHE_DIR",
        "TRITON_HOME",
        "TRITON_DUMP_DIR",
        "TRITON_OVERRIDE_DIR",
        "TRITON_CACHE_MANAGER",
        "TRITON_REMOTE_CACHE_BACKEND",
        "TRITON_REMOTE_CACHE_URL",
        "TRITON_REDIS_HOST",
        "TRITON_REDIS_PORT",
        "TRITON_REDIS_KEY_FORMAT",
        "TRITON_CACHE_AUTOTUNING",
        "TRITON_PRINT_AUTOTUNING",
        "TRITON_ALWAYS_COMPILE",
        "TRITON_STORE_BINARY_ONLY",
        "TRITON_KERNEL_DUMP",
        "TRITON_INTERPRET",
        "TRITON_PTXAS_PATH",
        "TRITON_PTXAS_BLACKWELL_PATH",
        "TRITON_CUOBJDUMP_PATH",
        "TRITON_NVDISASM_PATH",
        "TRITON_LIBDEVICE_PATH",
        "TRITON_LIBCUDA_PATH",
        "TRITON_CUDACRT_PATH",
        "TRITON_CUDART_PATH",
    }
)


def key_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that change what Triton compiles, as they are in environ."""
    # One pass over the names only: this runs for every request, and os.environ decodes each
    # entry it yields.
    extra = _invalidating_env_names()
    names = sorted(k for k in environ if (k.startswith("TRITON_") or k in extra) and k not in _ENV_IGNORED)
    return {k: environ[k] for k in names}


@functools.cache
def _invalidating_env_names() -> frozenset[str]:
    # Triton lists only the variables that are set; read the names it knows from its knobs.
    from triton import knobs

    names: set[str] = set()
    for group_name in dir(knobs):
        group = getattr(knobs, group_name, None)
        for attr in getattr(type(group), "__dict__", {}).values():
            key = getattr(attr, "key", None)
            if isinstance(key, str) and key.isupper():
                names.add(key)
    return frozenset(n for n in names if not n.startswith("TRITON_"))


@dataclass(frozen=True)
class TritonSpec:
    """One Triton compile request, as ``CompilePool.triton()`` takes it (see there).

    Specs are plain values: build a list of them and hand it to ``CompilePool.gather()``.
    """

    backend: ClassVar[str] = "triton"

    fn: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] | None = None
    kernel_name: str | None = None
    num_warps: int = 4
    num_stages: int = 3
    target: str | Target | None = None
    attrs: Mapping[Any, Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TritonRequest:
    key: str
    name: str
    target: Target
    fn: Any
    signature: dict[str, str]
    constants: dict[str, Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    payload: dict[str, Any]
    key_parts: dict[str, Any]


async def setup(memo_dir: Path, target: Target | None) -> None:
    """Pay this process's one-time costs off the loop, before requests arrive: the toolchain's
    identity (remembered on disk) and the option names of the target's backend."""

    def work() -> None:
        _toolchain(memo_dir)
        _invalidating_env_names()
        if target is not None:
            _option_names(target.backend)

    await anyio.to_thread.run_sync(work)


async def worker_config(memo_dir: Path) -> dict[str, Any]:
    """What workers need from the parent: Triton's own key of its binaries, computed once."""
    # Abandoned on cancellation: a pool left while this runs (the first time on a machine, it
    # hashes Triton's binaries, ~0.7 s) does not wait for it; the thread finishes and remembers
    # the result on disk for the next process.
    key = await anyio.to_thread.run_sync(_triton_toolchain.triton_key, memo_dir, abandon_on_cancel=True)
    return {"triton_key": key}


_toolchain_memo: dict[str, str] | None = None


def _toolchain(memo_dir: Path) -> dict[str, str]:
    global _toolchain_memo
    if _toolchain_memo is None:
        _toolchain_memo = _triton_toolchain.toolchain(memo_dir)
    return _toolchain_memo


async def prepare(spec: TritonSpec, default_target: Target | None, memo_dir: Path) -> TritonRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change."""
    target = _resolve_target(spec.target, default_target)
    fn, kernel_ref = await _resolve_kernel(spec)
    signature, constants = _full_signature(fn, spec.signature, spec.constexprs or {})
    attrs = _normalize_attrs(fn, spec.attrs, signature)
    if target.backend not in _option_names_memo:
        await anyio.to_thread.run_sync(_option_names, target.backend)  # imports the backend
    options = _check_options(target, spec)
    tools = _toolchain_memo or await anyio.to_thread.run_sync(_toolchain, memo_dir)
    env = key_environment(os.environ)
    key_parts = {
        "format": 1,
        "backend": "triton",
        "acompile": __version__,
        "toolchain": tools,
        "kernel": fn.cache_key,
        "name": fn.__name__,
        "signature": list(signature.items()),
        "constexprs": {k: _canonical(k, v) for k, v in sorted(constants.items())},
        "attrs": sorted([list(k), v] for k, v in attrs.items()),
        "options": options,
        "target": str(target),
        "env": env,
    }
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
        "log_dir": str(logs_dir(memo_dir.parent)),
    }
    return TritonRequest(key, fn.__name__, target, fn, signature, constants, attrs, payload, key_parts)


def _resolve_target(value: Any, default: Target | None) -> Target:
    if value is not None:
        return parse_target(value)
    if default is None:
        raise InvalidSpecError("no target: pass target='cuda:90' (or set one on the CompilePool)")
    return default


def _has_cache_key(fn: Any) -> bool:
    key = getattr(fn, "hash", None)  # where JITFunction keeps its computed cache_key
    return isinstance(key, str) and not key.startswith("recursion:")


async def payload(request: TritonRequest) -> dict[str, Any]:
    """The job a worker runs for request (called on a cache miss only)."""
    if request.payload["kernel"] is None:
        fn = request.fn
        ref = _described_already(fn)
        if ref is None:
            ref = await _once(("describe", id(fn)), lambda: _described_already(fn), _describe, fn)
        request.payload["kernel"] = ref
    return request.payload


async def _resolve_kernel(spec: TritonSpec) -> tuple[Any, dict[str, Any] | None]:
    from triton.runtime.jit import JITFunction

    fn = spec.fn
    if spec.kernel_name is not None and (
        not isinstance(spec.kernel_name, str) or not spec.kernel_name.isidentifier()
    ):
        raise InvalidSpecError(f"kernel_name must be a Python identifier, got {_show(spec.kernel_name)}")
    if isinstance(fn, str):
        return await _kernel_from_text(fn, spec.kernel_name)
    if isinstance(fn, JITFunction):
        if spec.kernel_name is not None and spec.kernel_name != fn.__name__:
            raise InvalidSpecError(
                f"kernel_name={spec.kernel_name!r} names a kernel in a source string; the JIT "
                f"function passed is {fn.__name__!r}: drop kernel_name"
            )
        if not _has_cache_key(fn):
            # Triton's key of a function parses it and everything it calls: off the loop, once,
            # however many requests for it arrive together.
            await _once(("key", id(fn)), lambda: _has_cache_key(fn) or None, lambda: fn.cache_key)
        # What a worker needs to rebuild it is worked out only if a worker is needed.
        return fn, None
    inner = getattr(fn, "fn", None)
    if isinstance(inner, JITFunction) or (
        inner is not None and isinstance(getattr(inner, "fn", None), JITFunction)
    ):
        raise InvalidSpecError(
            f"{type(fn).__name__} wraps a JIT function with its own configs: pass the inner "
            "function (its .fn) with the config's constexprs and options, or use pool.autotune()"
        )
    if callable(fn):
        raise InvalidSpecError(
            f"{getattr(fn, '__qualname__', fn)!r} is not a Triton JIT function: decorate it with "
            "@triton.jit, or pass the kernel's source text with kernel_name="
        )
    raise InvalidSpecError(f"expected a @triton.jit function or a source string, got {type(fn).__name__}")


_in_progress: dict[Any, anyio.Event] = {}
# Parsing kernels is pure Python: run concurrently in many threads, they would queue the event
# loop's thread behind them for the GIL. One at a time keeps the loop's waits short.
_parse_limiter = anyio.CapacityLimiter(1)


async def _once(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """Run work(*args) in a thread, once for all the tasks that ask for key at the same time;
    the others wait and then read the result with done()."""
    while (pending := _in_progress.get(key)) is not None:
        await pending.wait()
        result = done()
        if result is not None:
            return result
    event = _in_progress[key] = anyio.Event()
    try:
        return await anyio.to_thread.run_sync(work, *args, limiter=_parse_limiter)
    finally:
        del _in_progress[key]
        event.set()


_described: dict[int, tuple[weakref.ref[Any], str, dict[str, Any]]] = {}


def _described_already(fn: Any) -> dict[str, Any] | None:
    memo = _described.get(id(fn))
    alive: Any = memo[0]() if memo is not None else None
    if memo is None or alive is not fn:
        return None
    return memo[2] if memo[1] == alive.cache_key else None


def _describe(fn: Any) -> dict[str, Any]:
    """The worker's description of fn, built once per function (and again if its source
    changes, which changes its cache key)."""
    key = fn.cache_key
    ref = _triton_source.describe(fn)
    fn_id = id(fn)

    def forget(_: object) -> None:
        _described.pop(fn_id, None)

    _described[fn_id] = (weakref.ref(fn, forget), key, ref)
    return ref


class SourceKernel:
    """What the pool's process knows of a kernel defined in a source string.

    The string itself runs in a short-lived process (``_triton_probe``), never here; this holds
    what came back: the name, Triton's cache key, the parameters. It stands in for the JIT
    function wherever this process needs one (keying, checking, Triton's launcher). Workers run
    the string themselves to compile it.
    """

    launch_metadata = None

    def __init__(self, info: dict[str, Any], digest: str) -> None:
        self.__name__ = self.__qualname__ = info["name"]
        self.__module__ = f"acompile_source_{digest[:16]}"
        self.cache_key: str = info["cache_key"]
        self.arg_names: list[str] = list(info["arg_names"])
        self.params = [_SourceParam(*p) for p in info["params"]]

    def __repr__(self) -> str:
        return f"<SourceKernel {self.__name__} from {self.__module__}>"


@dataclass(frozen=True)
class _SourceParam:
    name: str
    is_constexpr: bool
    has_default: bool
    default: Any


# Source string and kernel name -> (found JIT functions, kernel), for the most recent ones: a
# cache hit of a source-string kernel costs a hash of the text, not a process. Bounded, as a
# server may be sent any number of distinct sources.
SOURCE_MEMO_SIZE = 256
_source_memo: OrderedDict[tuple[str, str | None], tuple[list[str], SourceKernel | None]] = OrderedDict()
# The longest a source string's top-level code may run (importing torch on a busy machine takes
# seconds); a caller's own deadline usually comes first.
SOURCE_RUN_SECONDS = 300.0
# Source strings run at most this many at once, each in its own process.
_probe_limiter = anyio.CapacityLimiter(max(2, os.cpu_count() or 2))


async def _kernel_from_text(text: str, kernel_name: str | None) -> tuple[Any, dict[str, Any]]:
    if "\0" in text:
        raise InvalidSpecError("the kernel source contains a NUL character (\\0)")
    digest = await _digest(text)
    filename = f"<acompile-source-{digest[:16]}>"
    memo = (digest, kernel_name)
    known = _source_memo.get(memo)
    if known is None:
        known = await _once_async(
            ("source", memo), lambda: _source_memo.get(memo), _probe, text, filename, memo
        )
    else:
        _source_memo.move_to_end(memo)
    found, fn = known
    if fn is None:
        if kernel_name is None:
            raise InvalidSpecError(
                f"the source defines JIT functions {found}: say which with kernel_name="
                if found
                else "the source defines no @triton.jit function"
            )
        raise InvalidSpecError(
            f"the source has no @triton.jit function named {kernel_name!r}; it defines {found or 'none'}"
        )
    return fn, {"kind": "text", "text": text, "filename": filename, "name": fn.__name__}


async def _digest(text: str) -> str:
    if len(text) < 1 << 20:
        return hashlib.sha256(text.encode()).hexdigest()
    return await anyio.to_thread.run_sync(lambda: hashlib.sha256(text.encode()).hexdigest())


_in_flight: dict[Any, anyio.Event] = {}


async def _once_async(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """await work(*args) once for all the tasks that ask for key at the same time; the others
    wait and read the result with done(). If the one doing it is cancelled, another takes over."""
    while (pending := _in_flight.get(key)) is not None:
        await pending.wait()
        result = done()
        if result is not None:
            return result
    event = _in_flight[key] = anyio.Event()
    try:
        return await work(*args)
    finally:
        del _in_flight[key]
        event.set()


async def _probe(
    text: str, filename: str, memo: tuple[str, str | None]
) -> tuple[list[str], SourceKernel | None]:
    """Run the text in a fresh process (see ``_triton_probe``) and remember what it reports."""
    request = pickle.dumps(
        {"text": text, "filename": filename, "kernel_name": memo[1], "sys_path": list(sys.path)}
    )
    env = dict(os.environ, ACOMPILE_PARENT_PID=str(os.getpid()))
    async with _probe_limiter:
        stderr = await anyio.to_thread.run_sync(tempfile.TemporaryFile)
        try:
            answer, code = await _run_probe(request, env, stderr)
            if answer is None:
                tail = await anyio.to_thread.run_sync(_tail, stderr)
                raise InvalidSpecError(
                    f"running the kernel source failed: its process ended with status {code}"
                    + (f"\n{tail}" if tail.strip() else "")
                )
        finally:
            stderr.close()
    if not answer["ok"]:
        if answer["kind"] == "syntax":
            raise InvalidSpecError(f"the kernel source does not parse: {answer['message']}")
        raise InvalidSpecError(
            f"running the kernel source failed: {answer['message']}\n{answer.get('traceback', '')}".rstrip()
        )
    kernel = answer["kernel"]
    result = (answer["found"], SourceKernel(kernel, memo[0]) if kernel is not None else None)
    _source_memo[memo] = result
    while len(_source_memo) > SOURCE_MEMO_SIZE:
        _source_memo.popitem(last=False)
    return result


async def _run_probe(
    request: bytes, env: dict[str, str], stderr: Any
) -> tuple[dict[str, Any] | None, int | None]:
    process = await anyio.open_process(
        [sys.executable, "-m", "acompile._backends._triton_probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
    )
    try:
        with anyio.fail_after(SOURCE_RUN_SECONDS):
            assert process.stdin is not None and process.stdout is not None
            await process.stdin.send(request)
            await process.stdin.aclose()
            chunks = []
            async for chunk in process.stdout:
                chunks.append(chunk)
            code = await process.wait()
    except TimeoutError:
        raise InvalidSpecError(
            f"the kernel source's top-level code ran longer than {SOURCE_RUN_SECONDS:.0f} s"
        ) from None
    finally:
        if process.returncode is None:
            # Cancelled (the caller's deadline) or timed out: the text's process goes now.
            with anyio.CancelScope(shield=True):
                process.kill()
                await process.wait()
        with anyio.CancelScope(shield=True):
            await process.aclose()
    data = b"".join(chunks)
    if code != 0 or not data:
        return None, code
    return pickle.loads(data), code


def _tail(f: Any, limit: int = 8192) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return str(f.read().decode("utf-8", "replace"))


_valid_types: set[str] = set()


def _full_signature(
    fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's full signature (every parameter in order, constexprs as "constexpr") and the
    constexpr values, defaults filled in."""
    if not isinstance(signature, Mapping):
        raise InvalidSpecError(
            f"signature must map parameter names to Triton types, got {type(signature).__name__}"
        )
    if not isinstance(constexprs, Mapping):
        raise InvalidSpecError(f"constexprs must map names to values, got {type(constexprs).__name__}")
    from triton.language import str_to_ty

    params = {p.name: p for p in fn.params}
    for name in [*signature, *constexprs]:
        if not isinstance(name, str):
            raise InvalidSpecError(
                f"signature and constexprs are keyed by parameter names (strings), got {_show(name)}"
            )
        if name not in params:
            raise InvalidSpecError(
                f"{fn.__name__} has no parameter {name!r}; its parameters are {list(params)}"
            )
    both = set(signature) & {k for k, v in signature.items() if v != "constexpr"} & set(constexprs)
    if both:
        raise InvalidSpecError(
            f"{sorted(both)} appear in both signature and constexprs: a parameter is either "
            "a runtime argument (signature) or a compile-time value (constexprs)"
        )
    full: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for name, param in params.items():
        if name in constexprs:
            full[name] = "constexpr"
            constants[name] = constexprs[name]
        elif name in signature and signature[name] != "constexpr":
            ty = signature[name]
            if not isinstance(ty, str) or "\0" in ty:
                raise InvalidSpecError(f"type of {name!r} must be a string such as '*fp32', got {_show(ty)}")
            try:
                if ty not in _valid_types:
                    str_to_ty(ty, None)
                    _valid_types.add(ty)
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSpecError(
                    f"unknown Triton type {_show(ty)} for {name!r}: use e.g. '*fp32' or '*fp16' "
                    "(pointers), 'i32', 'i64', 'u32', 'fp32', 'bf16', 'i1'"
                ) from None
            full[name] = ty
        elif param.is_constexpr and param.has_default:
            full[name] = "constexpr"
            constants[name] = param.default
        elif param.is_constexpr:
            raise InvalidSpecError(
                f"missing constexpr {name!r} of {fn.__name__}: pass constexprs={{{name!r}: ...}}"
            )
        else:
            raise InvalidSpecError(
                f"missing type for parameter {name!r} of {fn.__name__}: add it to signature, "
                f"e.g. signature={{..., {name!r}: 'i32'}}"
            )
    return full, constants


def _normalize_attrs(
    fn: Any, attrs: Mapping[Any, Any] | None, signature: Mapping[str, str]
) -> dict[tuple[int, ...], list[list[Any]]]:
    """Triton keys attributes by parameter path ((0,) for the first); accept names too. Triton
    silently ignores attributes keyed by name, so they are translated here. Each value is a list
    of [name, value] pairs, such as ``[["tt.divisibility", 16]]``."""
    if attrs is None:
        return {}
    if not isinstance(attrs, Mapping):
        raise InvalidSpecError(f"attrs must map parameter names or indices to attributes, got {_show(attrs)}")
    names = list(fn.arg_names)
    result: dict[tuple[int, ...], list[list[Any]]] = {}
    for k, v in attrs.items():
        if isinstance(k, str):
            if k not in names:
                raise InvalidSpecError(
                    f"attrs names {_show(k)}, which is not a parameter of {fn.__name__}; "
                    f"its parameters are {names}"
                )
            path: tuple[int, ...] = (names.index(k),)
        elif isinstance(k, int) and not isinstance(k, bool):
            path = (k,)
        elif isinstance(k, tuple) and k and all(isinstance(i, int) and not isinstance(i, bool) for i in k):
            path = k
        else:
            raise InvalidSpecError(f"attrs keys are parameter names or index tuples, got {_show(k)}")
        if not 0 <= path[0] < len(names) or any(i < 0 for i in path):
            raise InvalidSpecError(
                f"attrs index {_show(k)} is out of range: {fn.__name__} has {len(names)} parameters "
                f"(0 to {len(names) - 1})"
            )
        if signature.get(names[path[0]]) == "constexpr":
            raise InvalidSpecError(
                f"attrs[{_show(k)}]: {names[path[0]]!r} is a constexpr; "
                "attributes apply to runtime parameters"
            )
        result[path] = _attr_pairs(k, v)
    return result


def _attr_pairs(k: Any, v: Any) -> list[list[Any]]:
    wrong = InvalidSpecError(
        f"attrs[{_show(k)}] must be a list of [name, value] pairs such as "
        f"[['tt.divisibility', 16]], got {_show(v)}"
    )
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise wrong
    pairs = []
    for pair in v:
        if (
            isinstance(pair, (str, bytes))
            or not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or "\0" in pair[0]
        ):
            raise wrong
        value = pair[1]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidSpecError(
                f"attrs[{_show(k)}]: the value of {pair[0]!r} must be an int or a string, got {_show(value)}"
            )
        pairs.append([pair[0], value])
    return pairs


_option_names_memo: dict[str, frozenset[str]] = {}


def _option_names(backend: str) -> frozenset[str]:
    names = _option_names_memo.get(backend)
    if names is None:
        if backend == "cuda":
            from triton.backends.nvidia.compiler import CUDAOptions as options_cls
        else:
            from triton.backends.amd.compiler import HIPOptions as options_cls
        names = _option_names_memo[backend] = frozenset(options_cls.__dataclass_fields__)
    return names


def _check_options(target: Target, spec: TritonSpec) -> dict[str, Any]:
    if not isinstance(spec.options, Mapping) or not all(isinstance(k, str) for k in spec.options):
        raise InvalidSpecError(f"options must map option names to values, got {_show(spec.options)}")
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
    known = _option_names(target.backend)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidSpecError(
            f"unknown Triton option(s) {_show(unknown)} for {target}; known: {sorted(known)}"
        )
    warps = options["num_warps"]
    # bool is an int to Python, and True would be a cache key of its own for num_warps=1.
    if not isinstance(warps, int) or isinstance(warps, bool) or warps not in (1, 2, 4, 8, 16, 32):
        raise InvalidSpecError(
            f"num_warps must be a power of two from 1 to 32 (1, 2, 4, 8, 16, 32), got {_show(warps)}"
        )
    stages = options["num_stages"]
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise InvalidSpecError(f"num_stages must be a positive integer, got {_show(stages)}")
    for name, value in options.items():
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidSpecError(f"option {name}={_show(value)} is not a plain value") from None
        if "\\u0000" in text:
            raise InvalidSpecError(f"option {name} contains a NUL character (\\0)")
    return dict(sorted(options.items()))


def _show(value: Any) -> str:
    """A value's repr for a message, short however large the value is."""
    return bounded(repr(value), 200)


def _canonical(name: str, value: Any) -> Any:
    """A JSON form of a constexpr value that tells 1, 1.0 and True apart."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, (tuple, list)):
        return ["tuple", [_canonical(name, v) for v in value]]
    inner = getattr(value, "value", None)
    if type(value).__name__ == "constexpr":
        return _canonical(name, inner)
    cache_key = getattr(value, "cache_key", None)
    if isinstance(cache_key, str):
        return ["obj", type(value).__name__, cache_key]
    if type(value).__module__.startswith("triton.language"):
        return ["triton", type(value).__name__, str(value)]
    raise InvalidSpecError(
        f"constexpr {name}={value!r} ({type(value).__name__}) cannot be part of a cache key: "
        "use ints, floats, bools, strings, tuples of those, or Triton dtypes"
    )


# --- loading --------------------------------------------------------------------------------


class TritonKernel:
    """A compiled Triton kernel: its artifacts, and ``kernel[grid](*args)`` to launch it.

    Attributes:
        name: the kernel's name.
        key: the cache key (hex), the same on every machine for the same request.
        target: the ``Target`` it was compiled for.
        cubin: the binary (bytes; ``hsaco`` for HIP targets).
        asm: every stage Triton produced (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ...).
        metadata: Triton's own metadata (``num_warps``, ``shared``, ...).
        compiled: the ``triton.compiler.CompiledKernel``, built exactly as Triton builds it.

    Launching loads the binary onto the current GPU on first use; without a GPU it raises
    ``DeviceUnavailableError``. Pass only the runtime arguments, in the kernel's order: the
    constexprs the kernel was compiled with are filled in.
    """

    def __init__(self, request: TritonRequest, entry: Entry, compiled: Any) -> None:
        self.name = request.name
        self.key = request.key
        self.target = request.target
        self.compiled = compiled
        self.asm = compiled.asm
        self.metadata = compiled.metadata
        self.cubin: bytes = compiled.kernel
        self._constants = request.constants
        self._order = list(request.signature)

    def __repr__(self) -> str:
        return f"<TritonKernel {self.name} {self.target} key={self.key[:12]}…>"

    def load(self) -> None:
        """Load the binary onto the current GPU now (otherwise the first launch does)."""
        try:
            self.compiled._init_handles()
        except RuntimeError as exc:
            if "active driver" in str(exc) or ("driver" in str(exc).lower() and "0 active" in str(exc)):
                raise DeviceUnavailableError(
                    f"cannot load {self.name}: no GPU or driver here ({exc}); compiled results "
                    "can still be cached and shipped"
                ) from exc
            raise

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid](*args)``: grid is 1 to 3 ints, or, as for Triton's JIT, a callable
        given every argument by name (runtime arguments and constexprs) that returns them."""
        self.load()
        order, constants = self._order, self._constants
        runtime = [n for n in order if n not in constants]
        fixed = None if callable(grid) else self.compiled[_grid3(grid)]

        def run(*args: Any, stream: Any = None) -> None:
            if len(args) != len(runtime):
                raise TypeError(
                    f"{self.name}[grid]() takes {len(runtime)} arguments ({', '.join(runtime)}), "
                    f"got {len(args)}"
                )
            values = iter(args)
            full = [constants[n] if n in constants else next(values) for n in order]
            launch = fixed
            if launch is None:
                launch = self.compiled[_grid3(grid(dict(zip(order, full, strict=True))))]
            launch(*full, stream=stream)

        return run


def _grid3(grid: Any) -> tuple[int, int, int]:
    if isinstance(grid, int):
        grid = (grid,)
    if not isinstance(grid, Sequence) or not 1 <= len(grid) <= 3:
        raise TypeError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    return (g[0], g[1], g[2])


async def load(request: TritonRequest, entry: Entry, cache_root: Path) -> TritonKernel:
    return TritonKernel(request, entry, build_compiled_kernel(request, entry))


_metadata_types: dict[tuple[str, ...], Any] = {}
_backends: dict[Any, Any] = {}


def build_compiled_kernel(request: TritonRequest, entry: Entry) -> Any:
    """Triton's ``CompiledKernel`` from an entry's bytes, attribute for attribute as
    ``CompiledKernel.__init__`` builds it from files (3.6 to 3.9), with no file involved."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, CompiledKernel
    from triton.compiler.compiler import AsmDict, make_backend

    metadata = json.loads(entry.blobs["json"])
    t = metadata["target"]
    metadata["target"] = GPUTarget(t["backend"], t["arch"], t["warp_size"])
    fields = tuple(sorted(metadata))
    KernelMetadata = _metadata_types.get(fields)
    if KernelMetadata is None:
        # Triton makes a class per kernel; one per field list reads the same and saves a class
        # creation per kernel loaded from the cache.
        KernelMetadata = _metadata_types[fields] = namedtuple("KernelMetadata", fields)
    md: Any = KernelMetadata(**metadata)
    backend = _backends.get(md.target)
    if backend is None:
        backend = _backends[md.target] = make_backend(md.target)
    binary_ext = backend.binary_ext
    asm = AsmDict(
        {
            ext: data if ext == binary_ext else data.decode()
            for ext, data in entry.blobs.items()
            if ext != "json"
        }
    )
    ck = CompiledKernel.__new__(CompiledKernel)
    # 3.9's __del__ reads these: set them before anything can fail.
    ck.module = None
    ck._module_pid = None
    ck.function = None
    ck._run = None
    ck.src = ASTSource(request.fn, request.signature, request.constants, request.attrs or None)
    ck.metadata = md
    ck.packed_metadata = backend.pack_metadata(md)
    ck.hash = md.hash
    ck.name = md.name
    ck.asm = asm
    ck.metadata_group = {}
    ck.kernel = asm[binary_ext]
    if "_module_pid" not in CompiledKernel.__init__.__code__.co_names:
        del ck._module_pid  # Triton before 3.9 has no such attribute
    return ck
