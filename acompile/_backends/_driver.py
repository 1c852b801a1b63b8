"""The CUDA driver layer: loading NVRTC's cubins and PTX onto the GPU and launching kernels.

cuda-python's driver bindings are imported on first use, not with acompile: compiling needs no
GPU, and a process that only compiles (a build server) never loads the driver.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from acompile._errors import DeviceUnavailableError

if TYPE_CHECKING:
    from acompile._backends._native import NativeRequest
    from acompile._cache import Entry


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
        """The kernel ``name`` (a name or a name expression), loading the module first if need
        be; ``DeviceUnavailableError`` without a GPU."""
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
