"""A stand-in for Triton's CUDA driver in a process without a GPU: there is no GPU here, and
Inductor's Triton compile asks for an active GPU driver (``set_driver_to_gpu``) before it
compiles for the target its kernel names itself (``DeviceProperties``: an H100/H200's sm_90).
The compile itself makes no driver call; nothing is launched or loaded.

``install(marks)`` also appends ``<pid>`` to the file ``marks`` for each ``triton.compile`` call
made in this process: which process compiled a kernel is what the tests check.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

_installed: list[str] = []


def install(marks: str) -> None:
    if _installed:
        return
    import triton
    from triton.backends import backends
    from triton.backends.nvidia.driver import CudaDriver

    class NoGpuCudaDriver(CudaDriver):  # type: ignore[misc]
        def __init__(self) -> None:  # no libcuda to load
            pass

        @classmethod
        def is_active(cls) -> bool:
            return True

    backends["nvidia"] = dataclasses.replace(backends["nvidia"], driver=NoGpuCudaDriver)
    compile_ = triton.compile

    def marked(*args: Any, **kwargs: Any) -> Any:
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        return compile_(*args, **kwargs)

    triton.compile = marked
    _installed.append(marks)
