"""The parent's half of the CUDA C++ backend: check a ``CudaSpec``, key it, load its result.

- ``output="cubin"`` or ``"ptx"``: NVRTC (cuda-python) in a worker; the result is a
  ``CudaModule`` (``_driver``), loaded through the CUDA driver API on first use.
- ``output="so"`` or ``"o"``: nvcc in a worker; a ``.so`` is loaded with ctypes, a ``.o`` is a
  file in the cache folder (``_native.load_file``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from acompile._backends._driver import CudaModule
from acompile._backends._native import (
    WORKER_MODULE,
    NativeRequest,
    ObjectFile,
    SharedLibrary,
    check_source,
    check_strings,
    load_file,
    make_request,
    module_name,
    nvcc,
    payload,
    setup,
    verify,
    worker_config,
)
from acompile._cache import Entry
from acompile._errors import InvalidSpecError, show
from acompile._targets import Target, parse_target

__all__ = ("WORKER_MODULE", "CudaSpec", "load", "payload", "prepare", "setup", "worker_config")

_OUTPUTS = ("cubin", "ptx", "so", "o")


@dataclass(frozen=True)
class CudaSpec:
    """A CUDA C++ compile request, as ``CompilePool.cuda()`` takes it (see there)."""

    backend: ClassVar[str] = "cuda"

    source: str
    output: str = "cubin"
    arch: str | int | None = None
    options: Sequence[str] = ()
    name_expressions: Sequence[str] = ()
    name: str | None = None


def _arch(value: str | int | None, default: Target | None) -> str:
    if value is None:
        if default is None or default.backend != "cuda":
            raise InvalidSpecError("no architecture: pass arch='sm_90' (or give the pool a cuda target)")
        return str(default.arch)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidSpecError(
            f"arch must be a string such as 'sm_90' or an int such as 90, got {show(value)}"
        )
    text = str(value).lower().removeprefix("cuda:").removeprefix("sm_").removeprefix("compute_")
    suffix = "a" if text.endswith("a") else ""
    digits = text.removesuffix("a")
    if not digits.isascii() or not digits.isdigit():
        raise InvalidSpecError(f"unknown architecture {show(value)}: write e.g. 'sm_90', 90 or 'sm_90a'")
    parse_target(f"cuda:{digits}")  # the same list of known architectures as targets
    return digits + suffix


async def prepare(spec: CudaSpec, default_target: Target | None, memo_dir: Path) -> NativeRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change, or
    ``BackendUnavailableError`` when the compiler it needs is not installed."""
    source = check_source(spec.source)
    options = check_strings("options", spec.options)
    name = module_name(spec.name, source, "cuda_module")
    if not isinstance(spec.output, str) or spec.output not in _OUTPUTS:
        raise InvalidSpecError(f"output must be one of {', '.join(_OUTPUTS)}, got {show(spec.output)}")
    output = spec.output
    arch = _arch(spec.arch, default_target)
    expressions = check_strings("name_expressions", spec.name_expressions)
    kind = "nvrtc" if output in ("cubin", "ptx") else "nvcc"
    if kind == "nvcc" and expressions:
        raise InvalidSpecError("name_expressions apply to NVRTC outputs (cubin, ptx), not to nvcc's")
    command: list[str] = []
    if kind == "nvcc":
        command = [
            *nvcc(),
            f"-arch=sm_{arch}",
            *(["-shared", "-Xcompiler", "-fPIC"] if output == "so" else ["-c"]),
            *options,
        ]
    return await make_request(
        memo_dir,
        backend="cuda",
        kind=kind,
        name=name,
        source=source,
        output=output,
        arch=arch,
        options=options,
        expressions=expressions,
        include_dirs=[],
        command=command,
    )


async def load(
    request: NativeRequest, entry: Entry, cache_root: Path
) -> CudaModule | SharedLibrary | ObjectFile:
    """A ``CudaModule`` (NVRTC's outputs, loaded onto the GPU on first use), else the library or
    object file, published in the cache folder. Raises ``StaleEntry`` for an entry from a cache
    tier built from headers that have changed since (``_native.check_dependencies``)."""
    if request.output in ("cubin", "ptx"):
        await verify(request, entry)
        return CudaModule(request, entry)
    return await load_file(request, entry, cache_root)
