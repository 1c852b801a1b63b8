"""Backends, one module a half, imported the first time they are used.

``_contract`` says what a backend is (a parent half and a worker half); ``_registry`` lists the
backends by name and loads their halves. The CUDA C++ backend is ``_cuda`` (keying) with
``_driver`` (loading and launching on the GPU); the C++ backend is ``_cpp``; what those two
share is ``_native``, and both compile in ``_native_worker``. Triton is ``_triton`` and
``_triton_worker``, with a module for each of their jobs (listed in ``_triton``'s docstring).

The rest of acompile takes these names from here. Each is imported from its module the first
time it is asked for (the table below): importing the package imports no backend, so that a
worker importing ``_triton_worker`` pays for this file alone, and the backends never import
this face or the registry that loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from acompile import _lazy

if TYPE_CHECKING:
    from acompile._backends._contract import ParentBackend, Request, Spec, WorkerBackend
    from acompile._backends._cpp import CppSpec
    from acompile._backends._cuda import CudaSpec
    from acompile._backends._driver import CudaFunction, CudaModule
    from acompile._backends._launcher import (
        bridge_enabled,
        bridge_problem,
        load_bridge,
        wait_for_bridge,
    )
    from acompile._backends._launcher import load_if_built as load_launcher_if_built
    from acompile._backends._launcher import module as launcher_module
    from acompile._backends._launcher import problem as launcher_problem
    from acompile._backends._native import NativeRequest, ObjectFile, SharedLibrary
    from acompile._backends._native import tool_version as native_tool_version
    from acompile._backends._registry import (
        BACKENDS,
        BackendSpec,
        backend_of,
        load_parent,
        load_worker,
        worker_module,
    )
    from acompile._backends._triton import forget as forget_triton
    from acompile._backends._triton import prepare as prepare_triton
    from acompile._backends._triton_kernel import TritonKernel
    from acompile._backends._triton_spec import TritonRequest, TritonSpec
    from acompile._backends._triton_toolchain import toolchain as triton_toolchain

# Each name, by the module it comes from.
_NAMES: dict[str, str | tuple[str, str]] = {
    "BACKENDS": "_registry",
    "BackendSpec": "_registry",
    "backend_of": "_registry",
    "load_parent": "_registry",
    "load_worker": "_registry",
    "worker_module": "_registry",
    "ParentBackend": "_contract",
    "Request": "_contract",
    "Spec": "_contract",
    "WorkerBackend": "_contract",
    "TritonSpec": "_triton_spec",
    "TritonRequest": "_triton_spec",
    "TritonKernel": "_triton_kernel",
    "CudaSpec": "_cuda",
    "CudaModule": "_driver",
    "CudaFunction": "_driver",
    "CppSpec": "_cpp",
    "NativeRequest": "_native",
    "SharedLibrary": "_native",
    "ObjectFile": "_native",
    "native_tool_version": ("_native", "tool_version"),
    "prepare_triton": ("_triton", "prepare"),
    "forget_triton": ("_triton", "forget"),
    "triton_toolchain": ("_triton_toolchain", "toolchain"),
    "load_launcher_if_built": ("_launcher", "load_if_built"),
    "launcher_module": ("_launcher", "module"),
    "launcher_problem": ("_launcher", "problem"),
    "bridge_enabled": "_launcher",
    "bridge_problem": "_launcher",
    "load_bridge": "_launcher",
    "wait_for_bridge": "_launcher",
}
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=False)


__all__ = (
    "BACKENDS",
    "BackendSpec",
    "CppSpec",
    "CudaFunction",
    "CudaModule",
    "CudaSpec",
    "NativeRequest",
    "ObjectFile",
    "ParentBackend",
    "Request",
    "SharedLibrary",
    "Spec",
    "TritonKernel",
    "TritonRequest",
    "TritonSpec",
    "WorkerBackend",
    "backend_of",
    "bridge_enabled",
    "bridge_problem",
    "forget_triton",
    "launcher_module",
    "launcher_problem",
    "load_bridge",
    "load_launcher_if_built",
    "load_parent",
    "load_worker",
    "native_tool_version",
    "prepare_triton",
    "triton_toolchain",
    "wait_for_bridge",
    "worker_module",
)
