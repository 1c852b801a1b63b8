"""The parent's half of the C++ backend: check a ``CppSpec``, key it, load its library.

The system C++ compiler (``$CXX``, else ``c++``) builds a shared library in a worker; the
parent publishes it in the cache folder and loads it with ctypes (``_native.load_file``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from acompile._backends._native import (
    WORKER_MODULE,
    NativeRequest,
    SharedLibrary,
    check_source,
    check_strings,
    cxx,
    load_file,
    make_request,
    module_name,
    payload,
    setup,
    worker_config,
)
from acompile._cache import Entry
from acompile._targets import Target

__all__ = ("WORKER_MODULE", "CppSpec", "load", "payload", "prepare", "setup", "worker_config")


@dataclass(frozen=True)
class CppSpec:
    """A C++ compile request, as ``CompilePool.cpp()`` takes it (see there)."""

    backend: ClassVar[str] = "cpp"

    source: str
    options: Sequence[str] = ()
    include_dirs: Sequence[str] = ()
    name: str | None = None


async def prepare(spec: CppSpec, default_target: Target | None, memo_dir: Path) -> NativeRequest:
    """Check a spec and compute its key; raises ``InvalidSpecError`` with what to change, or
    when no C++ compiler is found. The target plays no part: the library is for this host."""
    source = check_source(spec.source)
    options = check_strings("options", spec.options)
    name = module_name(spec.name, source, "cpp_library")
    include_dirs = check_strings("include_dirs", spec.include_dirs)
    command = [*cxx(), "-shared", "-fPIC", *options, *(f"-I{d}" for d in include_dirs)]
    return await make_request(
        memo_dir,
        backend="cpp",
        kind="cxx",
        name=name,
        source=source,
        output="so",
        arch="",
        options=options,
        expressions=[],
        include_dirs=include_dirs,
        command=command,
    )


async def load(request: NativeRequest, entry: Entry, cache_root: Path) -> SharedLibrary:
    """The library, published in the cache folder and loaded with ctypes."""
    library = await load_file(request, entry, cache_root)
    # A C++ request's output is always "so": never an object file.
    assert isinstance(library, SharedLibrary)
    return library
