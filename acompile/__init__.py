"""acompile: an async compile service for GPU kernels.

    async with acompile.CompilePool(target="cuda:90") as pool:
        kernel = await pool.triton(add_kernel, signature={...}, constexprs={"BLOCK": 1024})

Importing acompile imports neither Triton nor cuda-python: backends load on first use.
"""

from __future__ import annotations

import typing as _typing

from acompile import _lazy
from acompile._version import __version__ as __version__

# Each name, by the module it lives in (and its name there where it differs); see acompile._lazy.
_NAMES: dict[str, str | tuple[str, str]] = {
    "inductor": ("inductor", ""),
    "Trial": "_autotune",
    "TunedKernel": "_autotune",
    "TuneResult": "_autotune",
    "CppSpec": "_backends",
    "CudaFunction": "_backends",
    "CudaModule": "_backends",
    "CudaSpec": "_backends",
    "ObjectFile": "_backends",
    "SharedLibrary": "_backends",
    "TritonKernel": "_backends",
    "TritonSpec": "_backends",
    "BundleReport": "_cache",
    "PruneReport": "_cache",
    "SharedCache": "_cache",
    "explain_key": "_cache",
    "export_bundle": "_cache",
    "import_bundle": "_cache",
    "prune_cache": ("_cache", "prune"),
    "CompilePool": "_compiler",
    "AcompileError": "_errors",
    "BackendUnavailableError": "_errors",
    "CompileError": "_errors",
    "CompileTimeoutError": "_errors",
    "CompiledAfterReadyError": "_errors",
    "CppCompileError": "_errors",
    "CUDACompileError": "_errors",
    "DeviceUnavailableError": "_errors",
    "FarmToolchainError": "_errors",
    "FarmUnreachableError": "_errors",
    "InvalidSpecError": "_errors",
    "KernelNotReadyError": "_errors",
    "PoolClosedError": "_errors",
    "PoolError": "_errors",
    "StageUnavailableError": "_errors",
    "UnknownTargetError": "_errors",
    "UntrustedFolderError": "_errors",
    "WorkerCrashedError": "_errors",
    "WorkerStartError": "_errors",
    "RayFarm": "_farm",
    "load_manifest": "_manifest",
    "BackgroundKernel": "_progressive",
    "ProgressiveKernel": "_progressive",
    "Target": "_targets",
    "ExecutorSpec": "_workers",
    "LocalWorkers": "_workers",
    "Opening": "_workers",
    "Split": "_workers",
    "WorkerSettings": "_workers",
}
if _typing.TYPE_CHECKING:
    from acompile import inductor as inductor
    from acompile._autotune import Trial as Trial
    from acompile._autotune import TunedKernel as TunedKernel
    from acompile._autotune import TuneResult as TuneResult
    from acompile._backends import CppSpec as CppSpec
    from acompile._backends import CudaFunction as CudaFunction
    from acompile._backends import CudaModule as CudaModule
    from acompile._backends import CudaSpec as CudaSpec
    from acompile._backends import ObjectFile as ObjectFile
    from acompile._backends import SharedLibrary as SharedLibrary
    from acompile._backends import TritonKernel as TritonKernel
    from acompile._backends import TritonSpec as TritonSpec
    from acompile._cache import BundleReport as BundleReport
    from acompile._cache import PruneReport as PruneReport
    from acompile._cache import SharedCache as SharedCache
    from acompile._cache import explain_key as explain_key
    from acompile._cache import export_bundle as export_bundle
    from acompile._cache import import_bundle as import_bundle
    from acompile._cache import prune as prune_cache
    from acompile._compiler import CompilePool as CompilePool
    from acompile._errors import AcompileError as AcompileError
    from acompile._errors import BackendUnavailableError as BackendUnavailableError
    from acompile._errors import CompiledAfterReadyError as CompiledAfterReadyError
    from acompile._errors import CompileError as CompileError
    from acompile._errors import CompileTimeoutError as CompileTimeoutError
    from acompile._errors import CppCompileError as CppCompileError
    from acompile._errors import CUDACompileError as CUDACompileError
    from acompile._errors import DeviceUnavailableError as DeviceUnavailableError
    from acompile._errors import FarmToolchainError as FarmToolchainError
    from acompile._errors import FarmUnreachableError as FarmUnreachableError
    from acompile._errors import InvalidSpecError as InvalidSpecError
    from acompile._errors import KernelNotReadyError as KernelNotReadyError
    from acompile._errors import PoolClosedError as PoolClosedError
    from acompile._errors import PoolError as PoolError
    from acompile._errors import StageUnavailableError as StageUnavailableError
    from acompile._errors import UnknownTargetError as UnknownTargetError
    from acompile._errors import UntrustedFolderError as UntrustedFolderError
    from acompile._errors import WorkerCrashedError as WorkerCrashedError
    from acompile._errors import WorkerStartError as WorkerStartError
    from acompile._farm import RayFarm as RayFarm
    from acompile._manifest import load_manifest as load_manifest
    from acompile._progressive import BackgroundKernel as BackgroundKernel
    from acompile._progressive import ProgressiveKernel as ProgressiveKernel
    from acompile._targets import Target as Target
    from acompile._workers import ExecutorSpec as ExecutorSpec
    from acompile._workers import LocalWorkers as LocalWorkers
    from acompile._workers import Opening as Opening
    from acompile._workers import Split as Split
    from acompile._workers import WorkerSettings as WorkerSettings
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=True)

__all__ = (
    "AcompileError",
    "BackendUnavailableError",
    "BackgroundKernel",
    "BundleReport",
    "CUDACompileError",
    "CompileError",
    "CompilePool",
    "CompileTimeoutError",
    "CompiledAfterReadyError",
    "CppCompileError",
    "CppSpec",
    "CudaFunction",
    "CudaModule",
    "CudaSpec",
    "DeviceUnavailableError",
    "ExecutorSpec",
    "FarmToolchainError",
    "FarmUnreachableError",
    "InvalidSpecError",
    "KernelNotReadyError",
    "LocalWorkers",
    "ObjectFile",
    "Opening",
    "PoolClosedError",
    "PoolError",
    "ProgressiveKernel",
    "PruneReport",
    "RayFarm",
    "SharedCache",
    "SharedLibrary",
    "Split",
    "StageUnavailableError",
    "Target",
    "Trial",
    "TritonKernel",
    "TritonSpec",
    "TuneResult",
    "TunedKernel",
    "UnknownTargetError",
    "UntrustedFolderError",
    "WorkerCrashedError",
    "WorkerSettings",
    "WorkerStartError",
    "__version__",
    "explain_key",
    "export_bundle",
    "import_bundle",
    "inductor",
    "load_manifest",
    "prune_cache",
)
