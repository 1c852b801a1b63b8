"""Other JIT libraries served by acompile: FlashInfer's kernel modules and torch's C++/CUDA
extensions, beside torch.compile (``acompile._torch``).

The modules, each with one job:

* ``_library``: the contract a library plugs into, the libraries served, serving them while a
  ``serve()`` context is active (each installed as the program imports it);
* ``_ninja``: a library's ninja build read through ninja, and the keys of its result (the
  direct key, the manifest of files the compilers read, the full key);
* ``_builds``: a build served: from the tiers, else built once per fleet on the pool;
* ``_worker``: the worker half (ninja in the library's folder, on a pool worker);
* ``_flashinfer``, ``_cpp_extension``: one module a library.

Nothing here imports a library: each is imported by the program, and served from then on.
See docs/jit.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from acompile import _lazy

if TYPE_CHECKING:
    from acompile._jit._builds import ServedBuilds
    from acompile._jit._flashinfer import RECORD_FIELDS as FLASHINFER_RECORD_FIELDS
    from acompile._jit._flashinfer import remake_spec as remake_flashinfer_spec
    from acompile._jit._library import LIBRARIES, TRIGGERS, JitServing, UnsupportedJitWarning, check_names

_NAMES: dict[str, str | tuple[str, str]] = {
    "ServedBuilds": "_builds",
    "LIBRARIES": "_library",
    "TRIGGERS": "_library",
    "JitServing": "_library",
    "UnsupportedJitWarning": "_library",
    "check_names": "_library",
    "FLASHINFER_RECORD_FIELDS": ("_flashinfer", "RECORD_FIELDS"),
    "remake_flashinfer_spec": ("_flashinfer", "remake_spec"),
}
__getattr__, __dir__ = _lazy.face(__name__, _NAMES, eager=False)

__all__ = [
    "FLASHINFER_RECORD_FIELDS",
    "LIBRARIES",
    "TRIGGERS",
    "JitServing",
    "ServedBuilds",
    "UnsupportedJitWarning",
    "check_names",
    "remake_flashinfer_spec",
]
