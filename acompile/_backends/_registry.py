"""The backends acompile knows, by name, and loading their halves the first time they are used.

``BACKENDS`` is the one table: a backend's name (what ``preload=`` takes), its parent and worker
modules, the package whose absence makes it unusable, and its spec classes. Nothing here imports
a backend module or its compiler until asked: importing acompile must not import triton or
cuda-python. The loader knows the backends, never the other way: no backend imports this module
(each parent half names its own ``WORKER_MODULE``, which a test holds equal to the table's), so
the backends and the registry make no import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from acompile._errors import BackendUnavailableError

if TYPE_CHECKING:
    from acompile._backends._contract import ParentBackend, WorkerBackend
    from acompile._backends._cpp import CppSpec
    from acompile._backends._cuda import CudaSpec
    from acompile._backends._driver import CudaModule
    from acompile._backends._native import NativeRequest, ObjectFile, SharedLibrary
    from acompile._backends._triton_kernel import TritonKernel
    from acompile._backends._triton_spec import TritonRequest, TritonSpec


@dataclass(frozen=True)
class BackendSpec:
    """One backend: where its halves live and what it needs installed.

    Attributes:
        name: the name users give (``preload=("triton",)``) and spec classes carry.
        parent: the module of its parent half (``ParentBackend``).
        worker: the module of its worker half (``WorkerBackend``); backends may share one.
        requires: a module that must import for the backend to work at all, or None when what
            it needs depends on the request (CUDA: NVRTC for cubin, nvcc for a library).
        install: what to install when ``requires`` is missing, for the error message.
        spec_classes: the qualified names of the spec classes this backend compiles.
    """

    name: str
    parent: str
    worker: str
    requires: str | None
    install: str | None
    spec_classes: tuple[str, ...]


def _table(*backends: BackendSpec) -> Mapping[str, BackendSpec]:
    return MappingProxyType({b.name: b for b in backends})


BACKENDS: Mapping[str, BackendSpec] = _table(
    BackendSpec(
        name="triton",
        parent="acompile._backends._triton",
        worker="acompile._backends._triton_worker",
        requires="triton",
        install="pip install triton",
        spec_classes=("acompile._backends._triton_spec.TritonSpec",),
    ),
    BackendSpec(
        name="cuda",
        parent="acompile._backends._cuda",
        worker="acompile._backends._native_worker",
        requires=None,
        # NVRTC (cubin, ptx) comes with the extra; nvcc (so, o) is the CUDA toolkit's.
        install='pip install "acompile[cuda]"',
        spec_classes=("acompile._backends._cuda.CudaSpec",),
    ),
    BackendSpec(
        name="inductor",
        parent="acompile._torch._parent",
        worker="acompile._torch._worker",
        requires="torch",
        install='pip install "acompile[torch]"',
        # Jobs come from torch.compile served (acompile.inductor.serve), never from a spec.
        spec_classes=(),
    ),
    BackendSpec(
        name="cpp",
        parent="acompile._backends._cpp",
        worker="acompile._backends._native_worker",
        requires=None,
        install=None,
        spec_classes=("acompile._backends._cpp.CppSpec",),
    ),
)


def get(name: str) -> BackendSpec:
    """The backend called ``name``; ``ValueError`` naming the known ones if there is none."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    return backend


def backend_of(spec: object) -> str:
    """The name of the backend that compiles ``spec``, from its type (a spec class's
    ``backend`` attribute, checked against the table). Raises ``TypeError`` for anything else."""
    name = getattr(type(spec), "backend", None)
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is not None:
        for cls in type(spec).__mro__:
            if f"{cls.__module__}.{cls.__qualname__}" in backend.spec_classes:
                return backend.name
    raise TypeError(f"not a compile spec: {spec!r}; build one with acompile.TritonSpec, CudaSpec or CppSpec")


def _import(backend: BackendSpec, module: str) -> Any:
    try:
        if backend.requires is not None:
            importlib.import_module(backend.requires)
        return importlib.import_module(module)
    except ImportError as exc:
        package = backend.requires or module
        hint = f": {backend.install}" if backend.install else ""
        raise BackendUnavailableError(
            f"the {backend.name} backend needs the {package!r} package{hint}"
        ) from exc


@overload
def load_parent(
    name: Literal["triton"],
) -> ParentBackend[TritonSpec, TritonRequest, TritonKernel]: ...
@overload
def load_parent(
    name: Literal["cuda"],
) -> ParentBackend[CudaSpec, NativeRequest, CudaModule | SharedLibrary | ObjectFile]: ...
@overload
def load_parent(name: Literal["cpp"]) -> ParentBackend[CppSpec, NativeRequest, SharedLibrary]: ...
@overload
def load_parent(name: str) -> ParentBackend[Any, Any, Any]: ...
def load_parent(name: str) -> ParentBackend[Any, Any, Any]:
    """The parent half of backend ``name``, imported on first use (blocking: the first call
    imports the compiler's Python package; call it from a thread on a loop).

    Raises ``BackendUnavailableError`` saying what to install when the package is missing, and
    ``ValueError`` for an unknown name.
    """
    known = _parents.get(name)
    if known is not None:
        return known
    backend = get(name)
    loaded = _parents[name] = cast("ParentBackend[Any, Any, Any]", _import(backend, backend.parent))
    return loaded


# The parent halves imported already, by name: every request asks (two imports' look-ups).
_parents: dict[str, ParentBackend[Any, Any, Any]] = {}


def load_worker(name: str) -> WorkerBackend:
    """The worker half of backend ``name``, imported on first use; errors as ``load_parent``."""
    backend = get(name)
    return cast("WorkerBackend", _import(backend, backend.worker))


def worker_module(name: str) -> str:
    """The module a worker imports for backend ``name`` (workers name backends by module)."""
    return get(name).worker


if TYPE_CHECKING:
    # Each backend against the contract, checked by mypy and never run: a module conforms to a
    # protocol when its functions do.
    from acompile._backends import _cpp, _cuda, _native_worker, _triton, _triton_worker

    _triton_parent: ParentBackend[TritonSpec, TritonRequest, TritonKernel] = _triton
    _cuda_parent: ParentBackend[CudaSpec, NativeRequest, CudaModule | SharedLibrary | ObjectFile] = _cuda
    _cpp_parent: ParentBackend[CppSpec, NativeRequest, SharedLibrary] = _cpp
    _triton_half: WorkerBackend = _triton_worker
    _native_half: WorkerBackend = _native_worker
