"""The parent's half of the CUDA C++ and C++ backends: check a request, key it, load its result.

- ``CudaSpec`` with ``output="cubin"`` or ``"ptx"``: NVRTC (cuda-python) in a worker; the result
  is a ``CudaModule``, loaded through the CUDA driver API on first use.
- ``CudaSpec`` with ``output="so"`` or ``"o"``: nvcc in a worker; a ``.so`` is loaded with ctypes,
  a ``.o`` is a file in the cache folder.
- ``CppSpec``: the system C++ compiler (``$CXX``, else ``c++``) into a shared library, loaded
  with ctypes.

Libraries and objects live in ``<cache_dir>/lib/<key>.so`` (``.o``), published atomically: a
library must be a file to be loaded, and a file that others may be loading is never rewritten.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from acompile._cache._entry import Entry
from acompile._cache._keys import make_key
from acompile._errors import (
    BackendUnavailableError,
    CppCompileError,
    CUDACompileError,
    DeviceUnavailableError,
    InvalidSpecError,
    bounded,
)
from acompile._targets import Target, parse_target
from acompile._version import __version__

WORKER_MODULE = "acompile._backends._native_worker"
_CUDA_OUTPUTS = ("cubin", "ptx", "so", "o")
_GLOBAL_NAME = re.compile(r"__global__\s+(?:[\w:<>,\s*&]+?\s+)?(\w+)\s*\(")
NVRTC_HINT = 'pip install "acompile[cuda]"'


@dataclass(frozen=True)
class CudaSpec:
    """A CUDA C++ compile request, as ``CompilePool.cuda()`` takes it (see there)."""

    source: str
    output: str = "cubin"
    arch: str | int | None = None
    options: Sequence[str] = ()
    name_expressions: Sequence[str] = ()
    name: str | None = None


@dataclass(frozen=True)
class CppSpec:
    """A C++ compile request, as ``CompilePool.cpp()`` takes it (see there)."""

    source: str
    options: Sequence[str] = ()
    include_dirs: Sequence[str] = ()
    name: str | None = None


@dataclass
class NativeRequest:
    key: str
    name: str
    backend: str
    output: str
    payload: dict[str, Any]
    key_parts: dict[str, Any] = field(default_factory=dict)


async def setup(memo_dir: Path, target: Target | None) -> None:
    pass


async def worker_config(memo_dir: Path) -> dict[str, Any]:
    return {}


_tools: dict[str, str] = {}


def _tool_version(kind: str) -> str:
    """The compiler's own idea of its version, once per process (blocking: from a thread)."""
    if kind not in _tools:
        if kind == "nvrtc":
            _tools[kind] = _nvrtc_version()
        else:
            command = _nvcc() if kind == "nvcc" else _cxx()
            try:
                out = subprocess.run([command[0], "--version"], capture_output=True, timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                raise InvalidSpecError(f"cannot run {command[0]!r}: {exc}") from exc
            text = (out.stdout or out.stderr).decode("utf-8", "replace").strip().splitlines() or ["?"]
            _tools[kind] = text[-1 if kind == "nvcc" else 0]
    return _tools[kind]


def _nvrtc_version() -> str:
    """NVRTC's version, which also proves its library can be found and loaded here."""
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        # cuda-python missing (ImportError), or present without the NVRTC library: cuda.pathfinder
        # raises its DynamicLibNotFoundError (a RuntimeError) when it finds no libnvrtc.so.
        raise BackendUnavailableError(
            f"compiling CUDA to cubin or PTX needs NVRTC, which cannot be loaded here "
            f"({type(exc).__name__}: {bounded(str(exc), 500)}): {NVRTC_HINT}"
        ) from exc
    return f"nvrtc {major}.{minor}"


def _nvcc() -> list[str]:
    found = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    if not found:
        raise InvalidSpecError(
            "output='so' and 'o' need nvcc on PATH (or $CUDA_HOME); cubin and ptx need only NVRTC"
        )
    return [found]


def _cxx() -> list[str]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise InvalidSpecError("no C++ compiler found: install g++ or set $CXX")
    return [compiler]


def _show(value: Any) -> str:
    """A value's repr for a message, short however large the value is."""
    return bounded(repr(value), 200)


def _check_text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidSpecError(f"{what} must be a string, got {type(value).__name__} {_show(value)}")
    if "\0" in value:
        # C strings end at NUL: the compiler would silently see only what comes before it.
        raise InvalidSpecError(f"{what} contains a NUL character (\\0) at offset {value.index(chr(0))}")
    return value


def _arch(value: str | int | None, default: Target | None) -> str:
    if value is None:
        if default is None or default.backend != "cuda":
            raise InvalidSpecError("no architecture: pass arch='sm_90' (or give the pool a cuda target)")
        return str(default.arch)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidSpecError(
            f"arch must be a string such as 'sm_90' or an int such as 90, got {_show(value)}"
        )
    text = str(value).lower().removeprefix("cuda:").removeprefix("sm_").removeprefix("compute_")
    suffix = "a" if text.endswith("a") else ""
    digits = text.removesuffix("a")
    if not digits.isascii() or not digits.isdigit():
        raise InvalidSpecError(f"unknown architecture {_show(value)}: write e.g. 'sm_90', 90 or 'sm_90a'")
    parse_target(f"cuda:{digits}")  # the same list of known architectures as targets
    return digits + suffix


def _name(spec: CudaSpec | CppSpec, source: str) -> str:
    if spec.name is not None:
        name = _check_text("name", spec.name)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InvalidSpecError(f"name must be an identifier, got {_show(name)}")
        return name
    found = _GLOBAL_NAME.search(source)
    return found.group(1) if found else ("cuda_module" if isinstance(spec, CudaSpec) else "cpp_library")


def _strings(what: str, values: Sequence[str]) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise InvalidSpecError(f"{what} must be a list of strings, got {_show(values)}")
    return [_check_text(f"{what}[{i}]", v) for i, v in enumerate(values)]


async def prepare(spec: CudaSpec | CppSpec, default_target: Target | None, memo_dir: Path) -> NativeRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change, or
    ``BackendUnavailableError`` when the compiler it needs is not installed."""
    source = _check_text("source", spec.source)
    if not source.strip():
        raise InvalidSpecError("source must be a non-empty string of C++/CUDA source")
    options = _strings("options", spec.options)
    name = _name(spec, source)
    if isinstance(spec, CudaSpec):
        backend = "cuda"
        if not isinstance(spec.output, str) or spec.output not in _CUDA_OUTPUTS:
            raise InvalidSpecError(
                f"output must be one of {', '.join(_CUDA_OUTPUTS)}, got {_show(spec.output)}"
            )
        output = spec.output
        arch = _arch(spec.arch, default_target)
        expressions = _strings("name_expressions", spec.name_expressions)
        kind = "nvrtc" if output in ("cubin", "ptx") else "nvcc"
        if kind == "nvcc" and expressions:
            raise InvalidSpecError("name_expressions apply to NVRTC outputs (cubin, ptx), not to nvcc's")
        command: list[str] = []
        if kind == "nvcc":
            command = [
                *_nvcc(),
                f"-arch=sm_{arch}",
                *(["-shared", "-Xcompiler", "-fPIC"] if output == "so" else ["-c"]),
            ]
            command += options
        include_dirs: list[str] = []
    else:
        backend, output, arch, expressions, kind = "cpp", "so", "", [], "cxx"
        include_dirs = _strings("include_dirs", spec.include_dirs)
        command = [*_cxx(), "-shared", "-fPIC", *options, *(f"-I{d}" for d in include_dirs)]
    version = _tools.get(kind) or await anyio.to_thread.run_sync(_tool_version, kind)
    key_parts = {
        "format": 1,
        "backend": backend,
        "acompile": __version__,
        "compiler": version,
        "kind": kind,
        "name": name,
        "source": source,
        "output": output,
        "arch": arch,
        "options": options,
        "name_expressions": expressions,
        "include_dirs": include_dirs,
    }
    key = make_key(key_parts)
    payload = {
        "key": key,
        "backend": backend,
        "kind": kind,
        "name": name,
        "source": source,
        "output": output,
        "arch": arch,
        "options": options,
        "name_expressions": expressions,
        "command": command,
        "key_parts": key_parts,
        # Where a worker writes a compiler log too long for an error (see _logs).
        "log_dir": str(memo_dir.parent / "logs"),
    }
    return NativeRequest(key, name, backend, output, payload, key_parts)


async def payload(request: NativeRequest) -> dict[str, Any]:
    return request.payload


async def load(request: NativeRequest, entry: Entry, cache_root: Path) -> Any:
    output = request.output
    if output in ("cubin", "ptx"):
        return CudaModule(request, entry)
    path = cache_root / "lib" / f"{request.key}.{output}"
    try:
        await anyio.to_thread.run_sync(_publish, path, entry.blobs[output])
        if output == "o":
            return ObjectFile(request.name, request.key, path)
        library = await anyio.to_thread.run_sync(ctypes.CDLL, str(path))
    except OSError as exc:
        # A library is loaded from a file, and an object file is for linking: neither can stay
        # in memory only. The compile succeeded; the file it needs cannot be written (or loaded).
        cls = CppCompileError if request.backend == "cpp" else CUDACompileError
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            message = (
                f"the disk is full: cannot write {request.name!r} to {path}; "
                "free space there or give the pool another cache_dir"
            )
        else:
            message = f"cannot write or load {request.name!r} at {path}: {type(exc).__name__}: {exc}"
        raise cls(message, kernel=request.name, backend=request.backend, log=str(exc)) from exc
    return SharedLibrary(request.name, request.key, path, library)


def _publish(path: Path, data: bytes) -> None:
    """Write the file once, whole: readers (and dlopen) never see a partial one, and a failed
    write (a full disk) leaves nothing behind."""
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SharedLibrary:
    """A shared library built by nvcc or the C++ compiler and loaded with ctypes.

    Attributes: ``name``, ``key``, ``path`` (in the cache folder), ``lib`` (the ``ctypes.CDLL``);
    its functions are reachable as attributes: ``library.saxpy(...)`` (set ``argtypes`` as with
    any ctypes function).
    """

    def __init__(self, name: str, key: str, path: Path, lib: ctypes.CDLL) -> None:
        self.name, self.key, self.path, self.lib = name, key, path, lib

    def __getattr__(self, symbol: str) -> Any:
        return getattr(self.lib, symbol)

    def __repr__(self) -> str:
        return f"<SharedLibrary {self.name} {self.path}>"


class ObjectFile:
    """An object file built by nvcc: ``path`` is in the cache folder, to link against."""

    def __init__(self, name: str, key: str, path: Path) -> None:
        self.name, self.key, self.path = name, key, path

    def __repr__(self) -> str:
        return f"<ObjectFile {self.name} {self.path}>"


# --- CUDA modules through the driver API ---------------------------------------------------------


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DeviceUnavailableError(
            'loading CUDA modules needs cuda-python: pip install "cuda-python"'
        ) from exc
    return driver


_context: list[Any] = []


def _ensure_context() -> Any:
    """A current CUDA context: the caller's if there is one (PyTorch's), else device 0's primary."""
    driver = _driver()
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:
        raise DeviceUnavailableError(
            f"no CUDA driver here ({type(exc).__name__}: {exc}); compiled "
            "modules can still be cached and shipped"
        ) from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(
            f"no usable GPU here (cuInit: {err.name}); compiled modules can still be cached and shipped"
        )
    err, ctx = driver.cuCtxGetCurrent()
    if err == driver.CUresult.CUDA_SUCCESS and ctx is not None and int(ctx) != 0:
        return ctx
    if not _context:
        err, device = driver.cuDeviceGet(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DeviceUnavailableError(f"no GPU device 0 (cuDeviceGet: {err.name})")
        err, ctx = driver.cuDevicePrimaryCtxRetain(device)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DeviceUnavailableError(f"cannot open a context on GPU 0: {err.name}")
        _context.append(ctx)
    (err,) = driver.cuCtxSetCurrent(_context[0])
    return _context[0]


def _check(result: Any, what: str) -> Any:
    driver = _driver()
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err.name}")
    return result[1] if len(result) == 2 else None


class CudaModule:
    """CUDA C++ compiled by NVRTC: the binary, and its kernels once loaded onto the GPU.

    Attributes:
        name, key: the module's name and cache key.
        cubin: the binary (``output="cubin"``), or None; ``ptx``: the PTX text, or None.
        log: NVRTC's log (warnings).
        lowered_names: each name expression given, mapped to its mangled name.

    ``module["saxpy"]`` (or ``module.function("saxpy")``, or a name expression such as
    ``module["scale<float>"]``) loads the module onto the current GPU on first use and returns a
    ``CudaFunction``; without a GPU it raises ``DeviceUnavailableError``.
    """

    def __init__(self, request: NativeRequest, entry: Entry) -> None:
        self.name = request.name
        self.key = request.key
        self.cubin: bytes | None = entry.blobs.get("cubin")
        ptx = entry.blobs.get("ptx")
        self.ptx: str | None = ptx.decode() if ptx is not None else None
        self.log = entry.blobs.get("log", b"").decode("utf-8", "replace")
        self.lowered_names: dict[str, str] = dict(entry.meta.get("lowered", {}))
        self._module: Any = None
        self._functions: dict[str, CudaFunction] = {}

    def __repr__(self) -> str:
        return f"<CudaModule {self.name} key={self.key[:12]}…>"

    def load(self) -> None:
        """Load the module onto the current GPU now (otherwise the first function lookup does)."""
        if self._module is None:
            _ensure_context()
            driver = _driver()
            image = self.cubin if self.cubin is not None else (self.ptx or "").encode() + b"\0"
            self._module = _check(driver.cuModuleLoadData(image), f"loading {self.name}")

    def function(self, name: str) -> CudaFunction:
        fn = self._functions.get(name)
        if fn is None:
            self.load()
            symbol = self.lowered_names.get(name, name)
            handle = _check(_driver().cuModuleGetFunction(self._module, symbol.encode()), f"finding {name!r}")
            fn = self._functions[name] = CudaFunction(name, handle)
        return fn

    __getitem__ = function


class CudaFunction:
    """A kernel of a loaded ``CudaModule``; ``fn(grid, block, *args, shared_mem=0, stream=None)``.

    Pointer arguments: anything with ``data_ptr()`` (PyTorch tensors) or
    ``__cuda_array_interface__`` (CuPy, Numba), or a ``CUdeviceptr``. Scalars carry their C type:
    ``ctypes.c_float(2.0)``, ``ctypes.c_int32(n)``, or NumPy scalars (``np.float32(2.0)``). A bare
    Python int or float is refused: its C type would be a guess.
    """

    def __init__(self, name: str, handle: Any) -> None:
        self.name, self.handle = name, handle

    def __call__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        *args: Any,
        shared_mem: int = 0,
        stream: Any = None,
    ) -> None:
        driver = _driver()
        values = [_kernel_arg(i, a) for i, a in enumerate(args)]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        _check(
            driver.cuLaunchKernel(
                self.handle, *g, *b, shared_mem, _stream_handle(stream), ctypes.addressof(pointers), 0
            ),
            f"launching {self.name}",
        )

    launch = __call__


def _dim3(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d > 0 for d in dims):
        raise TypeError(f"{what} must be a positive int or 1 to 3 of them, got {value!r}")
    dims += [1] * (3 - len(dims))
    return (dims[0], dims[1], dims[2])


def _kernel_arg(index: int, value: Any) -> ctypes._SimpleCData[Any]:
    if isinstance(value, ctypes._SimpleCData):
        return value
    if hasattr(value, "data_ptr"):
        return ctypes.c_void_p(value.data_ptr())
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is not None:
        return ctypes.c_void_p(interface["data"][0])
    if type(value).__name__ == "CUdeviceptr":
        return ctypes.c_void_p(int(value))
    if type(value).__module__ == "numpy":
        import numpy as np

        return np.ctypeslib.as_ctypes_type(value.dtype)(value.item())  # type: ignore[no-any-return]
    raise TypeError(
        f"kernel argument {index} ({type(value).__name__} {value!r}): pass device memory (a tensor, an "
        "object with __cuda_array_interface__) or a scalar with its C type, e.g. ctypes.c_int32(n)"
    )


def _stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if handle is not None:
        return int(handle)
    return int(stream)
