"""The parent's half of the Triton backend: check a request, key it, load its result.

Nothing here compiles: ``prepare()`` turns a ``TritonSpec`` into a request with its cache key and
the payload a worker needs (see ``_triton_worker``), and ``load()`` turns a cache entry back into
a ``TritonKernel`` holding the same ``CompiledKernel`` Triton itself would build.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import weakref
from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from acompile._backends import _triton_source
from acompile._cache._entry import Entry
from acompile._cache._keys import make_key
from acompile._errors import DeviceUnavailableError, InvalidSpecError
from acompile._targets import Target, parse_target
from acompile._version import __version__

WORKER_MODULE = "acompile._backends._triton_worker"

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
    selected = {k: v for k, v in environ.items() if k.startswith("TRITON_") and k not in _ENV_IGNORED}
    selected.update(_invalidating_env_vars(environ))
    return dict(sorted(selected.items()))


def _invalidating_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    names = _invalidating_env_names()
    return {k: environ[k] for k in names if k in environ and k not in _ENV_IGNORED}


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


@functools.cache
def toolchain() -> dict[str, str]:
    """What identifies the compilers: Triton's release and the digest of its compiler files as
    its wheel records them, and the versions of the ptxas it runs. Computed once per process and
    cheap (no hash of libtriton.so): call it from a thread, as ``prepare()`` does."""
    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    try:
        files = importlib.metadata.distribution("triton").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    recorded = sorted(
        (str(f), f.hash.value)
        for f in files
        if f.hash is not None and str(f).startswith(("triton/_C/", "triton/compiler/", "triton/backends/"))
    )
    if recorded:
        for name, value in recorded:
            digest.update(f"{name}={value}\n".encode())
    else:
        # A source or editable install has no record: hash the library itself (slow, once).
        digest.update(_file_digest(os.path.join(os.path.dirname(triton.__file__), "_C")).encode())
    tools = {"triton": triton.__version__, "triton_files": digest.hexdigest()}
    try:
        from triton import knobs

        for name in ("ptxas", "ptxas_blackwell"):
            tool = getattr(knobs.nvidia, name, None)
            if tool is not None:
                tools[name] = str(tool.version)
    except Exception as exc:  # no CUDA tools bundled: the HIP build, say
        tools["ptxas"] = f"unavailable ({type(exc).__name__})"
    return tools


_toolchain_memo: dict[str, str] | None = None


def _remember_toolchain() -> dict[str, str]:
    global _toolchain_memo
    _toolchain_memo = toolchain()
    return _toolchain_memo


def _file_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TritonSpec:
    """One Triton compile request, as ``CompilePool.triton()`` takes it (see there).

    Specs are plain values: build a list of them and hand it to ``CompilePool.gather()``.
    """

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


async def prepare(spec: TritonSpec, default_target: Target | None) -> TritonRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change."""
    target = _resolve_target(spec.target, default_target)
    fn, kernel_ref = await _resolve_kernel(spec)
    signature, constants = _full_signature(fn, spec.signature, spec.constexprs or {})
    attrs = _normalize_attrs(fn, spec.attrs)
    if target.backend not in _option_names_memo:
        await anyio.to_thread.run_sync(_option_names, target.backend)  # imports the backend
    options = _check_options(target, spec)
    tools = _toolchain_memo or await anyio.to_thread.run_sync(_remember_toolchain)
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
    }
    return TritonRequest(key, fn.__name__, target, fn, signature, constants, attrs, payload, key_parts)


def _resolve_target(value: Any, default: Target | None) -> Target:
    if value is not None:
        return parse_target(value)
    if default is None:
        raise InvalidSpecError("no target: pass target='cuda:90' (or set one on the CompilePool)")
    return default


_source_kernels: dict[str, dict[str, Any]] = {}


async def _resolve_kernel(spec: TritonSpec) -> tuple[Any, dict[str, Any]]:
    from triton.runtime.jit import JITFunction

    fn = spec.fn
    if isinstance(fn, str):
        return await _kernel_from_text(fn, spec.kernel_name)
    if isinstance(fn, JITFunction):
        if spec.kernel_name is not None and spec.kernel_name != fn.__name__:
            raise InvalidSpecError(
                f"kernel_name={spec.kernel_name!r} names a kernel in a source string; the JIT "
                f"function passed is {fn.__name__!r}: drop kernel_name"
            )
        ref = _described_already(fn)
        if ref is None:
            # The first request for a function parses it and everything it calls: off the loop.
            ref = await anyio.to_thread.run_sync(_describe, fn)
        return fn, ref
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


async def _kernel_from_text(text: str, kernel_name: str | None) -> tuple[Any, dict[str, Any]]:
    digest = hashlib.sha256(text.encode()).hexdigest()
    filename = f"<acompile-source-{digest[:16]}>"
    namespace = _source_kernels.get(digest)
    if namespace is None:

        def run() -> dict[str, Any]:
            return _triton_source.run_source_text(text, filename)

        try:
            # Off the loop: the text's own imports (triton.language, ...) may take a while.
            namespace = await anyio.to_thread.run_sync(run)
        except SyntaxError as exc:
            raise InvalidSpecError(f"the kernel source does not parse: {exc}") from exc
        except Exception as exc:
            raise InvalidSpecError(f"running the kernel source failed: {type(exc).__name__}: {exc}") from exc
        _source_kernels[digest] = namespace
    from triton.runtime.jit import JITFunction

    found = sorted(k for k, v in namespace.items() if isinstance(v, JITFunction))
    if kernel_name is None:
        if len(found) != 1:
            raise InvalidSpecError(
                f"the source defines JIT functions {found}: say which with kernel_name="
                if found
                else "the source defines no @triton.jit function"
            )
        kernel_name = found[0]
    fn = namespace.get(kernel_name)
    if not isinstance(fn, JITFunction):
        raise InvalidSpecError(
            f"the source has no @triton.jit function named {kernel_name!r}; it defines {found or 'none'}"
        )
    return fn, {"kind": "text", "text": text, "filename": filename, "name": kernel_name}


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
            if not isinstance(ty, str):
                raise InvalidSpecError(f"type of {name!r} must be a string such as '*fp32', got {ty!r}")
            try:
                str_to_ty(ty, None)
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSpecError(
                    f"unknown Triton type {ty!r} for {name!r}: use e.g. '*fp32' or '*fp16' "
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


def _normalize_attrs(fn: Any, attrs: Mapping[Any, Any] | None) -> dict[tuple[int, ...], list[list[Any]]]:
    """Triton keys attributes by parameter path ((0,) for the first); accept names too. Triton
    silently ignores attributes keyed by name, so they are translated here."""
    if not attrs:
        return {}
    names = list(fn.arg_names)
    result: dict[tuple[int, ...], list[list[Any]]] = {}
    for k, v in attrs.items():
        if isinstance(k, str):
            if k not in names:
                raise InvalidSpecError(f"attrs names {k!r}, which is not a parameter of {fn.__name__}")
            path: tuple[int, ...] = (names.index(k),)
        elif isinstance(k, int):
            path = (k,)
        elif isinstance(k, tuple) and all(isinstance(i, int) for i in k):
            path = k
        else:
            raise InvalidSpecError(f"attrs keys are parameter names or index tuples, got {k!r}")
        result[path] = [list(a) for a in v]
    return result


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
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
    known = _option_names(target.backend)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidSpecError(f"unknown Triton option(s) {unknown} for {target}; known: {sorted(known)}")
    warps = options["num_warps"]
    if not isinstance(warps, int) or warps < 1 or warps & (warps - 1):
        raise InvalidSpecError(f"num_warps must be a power of two (1, 2, 4, 8, 16, 32), got {warps!r}")
    stages = options["num_stages"]
    if not isinstance(stages, int) or stages < 1:
        raise InvalidSpecError(f"num_stages must be a positive integer, got {stages!r}")
    for name, value in options.items():
        try:
            json.dumps(value)
        except TypeError:
            raise InvalidSpecError(f"option {name}={value!r} is not a plain value") from None
    return dict(sorted(options.items()))


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
        self.load()
        grid3 = _grid3(grid, self._constants)
        launch = self.compiled[grid3]
        order, constants = self._order, self._constants
        runtime = [n for n in order if n not in constants]

        def run(*args: Any, stream: Any = None) -> None:
            if len(args) != len(runtime):
                raise TypeError(
                    f"{self.name}[grid]() takes {len(runtime)} arguments ({', '.join(runtime)}), "
                    f"got {len(args)}"
                )
            values = iter(args)
            full = [constants[n] if n in constants else next(values) for n in order]
            launch(*full, stream=stream)

        return run


def _grid3(grid: Any, constants: Mapping[str, Any]) -> tuple[int, int, int]:
    if callable(grid):
        grid = grid(dict(constants))
    if isinstance(grid, int):
        grid = (grid,)
    if not isinstance(grid, Sequence) or not 1 <= len(grid) <= 3:
        raise TypeError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    return (g[0], g[1], g[2])


def load(request: TritonRequest, entry: Entry) -> TritonKernel:
    return TritonKernel(request, entry, build_compiled_kernel(request, entry))


def build_compiled_kernel(request: TritonRequest, entry: Entry) -> Any:
    """Triton's ``CompiledKernel`` from an entry's bytes, attribute for attribute as
    ``CompiledKernel.__init__`` builds it from files (3.6 to 3.9), with no file involved."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, CompiledKernel
    from triton.compiler.compiler import AsmDict, make_backend

    metadata = json.loads(entry.blobs["json"])
    t = metadata["target"]
    metadata["target"] = GPUTarget(t["backend"], t["arch"], t["warp_size"])
    KernelMetadata = namedtuple("KernelMetadata", sorted(metadata))  # type: ignore[misc]
    md: Any = KernelMetadata(**metadata)
    backend = make_backend(md.target)
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
