"""Backends, one module a half, imported the first time they are used.

``_contract`` says what a backend is (a parent half and a worker half); ``_registry`` lists the
backends by name and loads their halves. The CUDA C++ backend is ``_cuda`` (keying) with
``_driver`` (loading and launching on the GPU); the C++ backend is ``_cpp``; what those two
share is ``_native``, and both compile in ``_native_worker``. Triton is ``_triton`` and
``_triton_worker``, with helpers of its own.
"""

from __future__ import annotations

from acompile._backends._registry import BACKENDS as BACKENDS
from acompile._backends._registry import BackendSpec as BackendSpec
from acompile._backends._registry import backend_of as backend_of
from acompile._backends._registry import load_parent as load_parent
from acompile._backends._registry import load_worker as load_worker
from acompile._backends._registry import worker_module as worker_module
