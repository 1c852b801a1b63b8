"""Compile targets: ``"cuda:90"`` and friends, and finding the local GPU."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from acompile._errors import DeviceUnavailableError, UnknownTargetError

# Architectures the CUDA toolchains of the supported Triton releases accept (sm_75 and newer).
CUDA_ARCHS = frozenset({75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121})
_TARGET_RE = re.compile(r"^(?P<backend>cuda|hip):(?P<arch>[0-9a-z_]+)$")


@dataclass(frozen=True, order=True)
class Target:
    """A compile target: a backend and an architecture, e.g. ``Target("cuda", 90)``."""

    backend: str
    arch: int | str
    warp_size: int = 32

    def __str__(self) -> str:
        return f"{self.backend}:{self.arch}"

    def to_triton(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def parse_target(value: object) -> Target:
    """Read a target from ``"cuda:90"``, ``"cuda:sm_80"``, ``"hip:gfx942"``, a ``Target`` or a
    Triton ``GPUTarget``. Raises ``UnknownTargetError`` with the accepted forms."""
    if isinstance(value, Target):
        return value
    if hasattr(value, "backend") and hasattr(value, "arch") and hasattr(value, "warp_size"):
        return parse_target(f"{value.backend}:{value.arch}")
    if not isinstance(value, str):
        raise UnknownTargetError(
            f"target must be a string such as 'cuda:90', got {type(value).__name__} {_show(value)}"
        )
    m = _TARGET_RE.match(value.strip().lower())
    if m is None:
        raise UnknownTargetError(
            f"unknown target {_show(value)}: write '<backend>:<arch>', such as 'cuda:90' (H100), "
            "'cuda:80' (A100) or 'hip:gfx942'"
        )
    backend, arch = m["backend"], m["arch"]
    if backend == "cuda":
        digits = arch.removeprefix("sm_").removesuffix("a")
        if not digits.isascii() or not digits.isdigit() or int(digits) not in CUDA_ARCHS:
            known = ", ".join(f"cuda:{a}" for a in sorted(CUDA_ARCHS))
            raise UnknownTargetError(f"unknown CUDA architecture in {_show(value)}; known: {known}")
        return Target("cuda", int(digits), 32)
    if not arch.startswith("gfx"):
        raise UnknownTargetError(f"unknown HIP architecture in {_show(value)}; write e.g. 'hip:gfx942'")
    return Target("hip", arch, 64)


@functools.cache
def local_target() -> Target:
    """The target of GPU 0, read through the CUDA driver (cuda-python).

    Blocks for the driver's initialisation: call it from a thread. Raises
    ``DeviceUnavailableError`` when there is no driver or no GPU.
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DeviceUnavailableError(
            "cannot find the local GPU: cuda-python is not installed; pass an explicit target "
            "such as target='cuda:90'"
        ) from exc
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # no libcuda.so at all: cuda-python raises its own loader error
        raise DeviceUnavailableError(
            f"no CUDA driver here ({type(exc).__name__}: {exc}); pass an explicit target such "
            "as target='cuda:90' to compile without a GPU"
        ) from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(
            f"no usable GPU here (cuInit: {err.name}); pass an explicit target such as "
            "target='cuda:90' to compile without one"
        )
    err, device = driver.cuDeviceGet(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(f"no GPU device 0 (cuDeviceGet: {err.name})")
    attrs = driver.CUdevice_attribute
    err, major = driver.cuDeviceGetAttribute(attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    err2, minor = driver.cuDeviceGetAttribute(attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    if err != driver.CUresult.CUDA_SUCCESS or err2 != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError("cannot read the GPU's compute capability")
    return Target("cuda", major * 10 + minor, 32)
