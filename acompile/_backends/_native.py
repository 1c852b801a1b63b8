"""What the CUDA C++ (``_cuda``) and C++ (``_cpp``) backends share in the parent: the request,
checking its strings, the compilers' identities, keying, and the results that are files.

Libraries and objects live in ``<cache_dir>/lib/<key>.so`` (``.o``), published atomically: a
library must be a file to be loaded, and a file that others may be loading is never rewritten.

Headers are inputs the key does not hold (it is known before the compile, which alone finds
out what the source includes). Each entry records the files its compile read (see
``_native_worker``), and an entry that comes from a cache tier is used only where every one of
them is still what it was (``stale_reason``); otherwise it is stale (``StaleEntry``): a miss,
compiled again, whose fresh entry replaces it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import shutil
import stat
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from acompile._backends._native_worker import file_digest
from acompile._cache import Entry, StaleEntry, lib_path, logs_dir, make_key, read_state, write_state
from acompile._errors import (
    BackendUnavailableError,
    CppCompileError,
    CUDACompileError,
    InvalidSpecError,
    bounded,
    show,
)
from acompile._targets import Target
from acompile._version import __version__

if TYPE_CHECKING:
    from acompile._workers import BackendConfig

# Both backends compile in one worker module: NVRTC, nvcc and the C++ compiler. The registry names
# it too (a test holds them equal): a backend never imports the registry that loads it.
WORKER_MODULE = "acompile._backends._native_worker"
# What to install for NVRTC (the registry's hint for the CUDA backend).
NVRTC_HINT = 'pip install "acompile[cuda]"'
_GLOBAL_NAME = re.compile(r"__global__\s+(?:[\w:<>,\s*&]+?\s+)?(\w+)\s*\(")


@dataclass
class NativeRequest:
    """A checked CUDA or C++ spec, keyed (see ``_contract.Request``)."""

    key: str
    name: str
    backend: str
    output: str
    payload: dict[str, Any]
    key_parts: dict[str, Any] = field(default_factory=dict)
    # Set when the pool asks for the payload, which it does only to compile the request: the
    # entry it loads next was built from the headers as they are (a worker recorded them a
    # moment ago), so they are not checked again. One that changed during that compile made the
    # entry say so (``deps_unknown``): it serves this request, and is stale for any later one.
    compiled_here: bool = False


async def setup(memo_dir: Path, target: Target | None) -> None:
    """Nothing to pay ahead: the compilers' versions are read on first use."""


async def worker_config(memo_dir: Path) -> BackendConfig:
    """Nothing: the workers need only what the payload carries."""
    return {}


async def payload(request: NativeRequest) -> dict[str, Any]:
    """The payload, made with the request (it holds the command line the worker runs)."""
    request.compiled_here = True
    return request.payload


# --- checking a spec's values ---------------------------------------------------------------------


def check_text(what: str, value: Any) -> str:
    """``value`` as a string a C compiler sees whole; ``InvalidSpecError`` otherwise."""
    if not isinstance(value, str):
        raise InvalidSpecError(f"{what} must be a string, got {type(value).__name__} {show(value)}")
    if "\0" in value:
        # C strings end at NUL: the compiler would silently see only what comes before it.
        raise InvalidSpecError(f"{what} contains a NUL character (\\0) at offset {value.index(chr(0))}")
    return value


def check_strings(what: str, values: Sequence[str]) -> list[str]:
    """A list or tuple of strings (``check_text`` each), as a list."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise InvalidSpecError(f"{what} must be a list of strings, got {show(values)}")
    return [check_text(f"{what}[{i}]", v) for i, v in enumerate(values)]


def check_source(source: Any) -> str:
    """The spec's source, non-empty."""
    text = check_text("source", source)
    if not text.strip():
        raise InvalidSpecError("source must be a non-empty string of C++/CUDA source")
    return text


def module_name(name: str | None, source: str, default: str) -> str:
    """The given name (an identifier), else the first ``__global__`` function's, else ``default``."""
    if name is not None:
        name = check_text("name", name)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InvalidSpecError(f"name must be an identifier, got {show(name)}")
        return name
    found = _GLOBAL_NAME.search(source)
    return found.group(1) if found else default


# --- the compilers ---------------------------------------------------------------------------------

_tools: dict[str, str] = {}


def tool_version(kind: str) -> str:
    """The compiler's own idea of its version, once per process (blocking: from a thread)."""
    if kind not in _tools:
        if kind == "nvrtc":
            _tools[kind] = _nvrtc_version()
        else:
            command = nvcc() if kind == "nvcc" else cxx()
            try:
                out = subprocess.run([command[0], "--version"], capture_output=True, timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                raise InvalidSpecError(f"cannot run {command[0]!r}: {exc}") from exc
            text = (out.stdout or out.stderr).decode("utf-8", "replace").strip().splitlines() or ["?"]
            _tools[kind] = text[-1 if kind == "nvcc" else 0]
    return _tools[kind]


def _nvrtc_version() -> str:
    """NVRTC's version, which also proves its library can be found and loaded here."""
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        # cuda-python missing (ImportError), or present without the NVRTC library: cuda.pathfinder
        # raises its DynamicLibNotFoundError (a RuntimeError) when it finds no libnvrtc.so.
        raise BackendUnavailableError(
            f"compiling CUDA to cubin or PTX needs NVRTC, which cannot be loaded here "
            f"({type(exc).__name__}: {bounded(str(exc), 500)}): {NVRTC_HINT}"
        ) from exc
    return f"nvrtc {major}.{minor}"


def nvcc() -> list[str]:
    """nvcc's command; ``InvalidSpecError`` when it is on neither PATH nor ``$CUDA_HOME``."""
    found = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    if not found:
        raise InvalidSpecError(
            "output='so' and 'o' need nvcc on PATH (or $CUDA_HOME); cubin and ptx need only NVRTC"
        )
    return [found]


def cxx() -> list[str]:
    """The C++ compiler's command: ``$CXX``, else ``c++``, else ``g++``."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise InvalidSpecError("no C++ compiler found: install g++ or set $CXX")
    return [compiler]


async def make_request(
    memo_dir: Path,
    *,
    backend: str,
    kind: str,
    name: str,
    source: str,
    output: str,
    arch: str,
    options: list[str],
    expressions: list[str],
    include_dirs: list[str],
    command: list[str],
) -> NativeRequest:
    """Key a checked spec and build its payload.

    ``kind`` is the compiler (``"nvrtc"``, ``"nvcc"``, ``"cxx"``): its version is part of the
    key, read once per process (in a thread: it may run the compiler).
    """
    version = _tools.get(kind) or await anyio.to_thread.run_sync(tool_version, kind)
    # The key's parts, in this order, are what existing caches were keyed with: keep them.
    key_parts = {
        "format": 1,
        "backend": backend,
        "acompile": __version__,
        "compiler": version,
        "kind": kind,
        "name": name,
        "source": source,
        "output": output,
        "arch": arch,
        "options": options,
        "name_expressions": expressions,
        "include_dirs": include_dirs,
    }
    key = make_key(key_parts)
    payload = {
        "key": key,
        "backend": backend,
        "kind": kind,
        "name": name,
        "source": source,
        "output": output,
        "arch": arch,
        "options": options,
        "name_expressions": expressions,
        "command": command,
        "key_parts": key_parts,
        # Where a worker writes a compiler log too long for an error (see _logs).
        "log_dir": str(logs_dir(memo_dir.parent)),
    }
    return NativeRequest(key, name, backend, output, payload, key_parts)


# --- the headers an entry was built from -----------------------------------------------------------

# Headers this process found, by path, with the size and mtime they had then and the digest
# they had: a header touched but not changed (a checkout, a copy) is hashed once per process,
# however many entries include it.
_verified: dict[str, tuple[int, int, str]] = {}


def stale_reason(meta: dict[str, Any]) -> str | None:
    """Why the entry with this metadata may not be what its source builds now, or None where
    every file its compile read (``meta["deps"]``) is as it was (blocking: from a thread).

    One ``stat`` per file: the same size and mtime, and it is trusted; another mtime (or an
    mtime that is the same on another machine, where a header was written at another time),
    and it is hashed, and must have the recorded digest. Missing, not a regular file, another
    size or another digest: stale. An entry without the record (made before it was kept), or
    whose record says what its compile read is not known, is stale too: nothing can show it
    is not. A header that appeared where the compiler did not look before (earlier in the
    include path) is not seen, as it is not by ccache.
    """
    deps = meta.get("deps")
    if deps is None:
        return "it was built before the headers a compile reads were recorded"
    unknown = meta.get("deps_unknown")
    if unknown:
        return f"the headers it was built from are not known: {bounded(str(unknown), 300)}"
    if not isinstance(deps, list):
        return "its list of headers is malformed"
    for dep in deps:
        if not (
            isinstance(dep, list)
            and len(dep) == 4
            and isinstance(dep[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in dep[1:3])
            and isinstance(dep[3], str)
        ):
            return f"its list of headers is malformed: {show(dep)}"
        path, size, mtime_ns, digest = dep
        try:
            info = os.stat(path)
        except (OSError, ValueError) as exc:
            return f"{path} is gone ({getattr(exc, 'strerror', None) or exc})"
        if not stat.S_ISREG(info.st_mode):
            return f"{path} is not a regular file any more"
        if info.st_size != size:
            return f"{path} changed since it was built (its size)"
        if info.st_mtime_ns == mtime_ns or _verified.get(path) == (size, info.st_mtime_ns, digest):
            continue
        try:
            actual = file_digest(path, size)
        except (OSError, ValueError) as exc:
            return f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})"
        if actual != digest:
            return f"{path} changed since it was built"
        _verified[path] = (size, info.st_mtime_ns, digest)
    return None


def check_dependencies(request: NativeRequest, entry: Entry) -> None:
    """Raise ``StaleEntry`` where the entry came from a cache tier and a file its compile read
    is not what it was (blocking: from a thread). An entry this request just compiled is not
    checked (see ``NativeRequest.compiled_here``)."""
    if request.compiled_here:
        return
    reason = stale_reason(entry.meta)
    if reason is not None:
        raise StaleEntry(f"{request.name!r} was built from other headers: {reason}")


async def verify(request: NativeRequest, entry: Entry) -> None:
    """``check_dependencies`` off the event loop; no thread at all for an entry whose compile
    read no file but its source (nothing to look at)."""
    if request.compiled_here or (entry.meta.get("deps") == [] and not entry.meta.get("deps_unknown")):
        return
    await anyio.to_thread.run_sync(check_dependencies, request, entry)


# --- results that are files ------------------------------------------------------------------------


async def load_file(request: NativeRequest, entry: Entry, cache_root: Path) -> SharedLibrary | ObjectFile:
    """Publish a library or object file in ``<cache_root>/lib`` and load it (a library) with
    ctypes, once the entry's headers are checked (``check_dependencies``; raises ``StaleEntry``),
    all in one thread. A file that cannot be written or loaded is a compile error of the
    request's kind."""
    output = request.output
    path = lib_path(cache_root, request.key, output)
    try:
        return await anyio.to_thread.run_sync(_install, request, entry, path)
    except OSError as exc:
        # A library is loaded from a file, and an object file is for linking: neither can stay
        # in memory only. The compile succeeded; the file it needs cannot be written (or loaded).
        cls = CppCompileError if request.backend == "cpp" else CUDACompileError
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            message = (
                f"the disk is full: cannot write {request.name!r} to {path}; "
                "free space there or give the pool another cache_dir"
            )
        else:
            message = f"cannot write or load {request.name!r} at {path}: {type(exc).__name__}: {exc}"
        raise cls(message, kernel=request.name, backend=request.backend, log=str(exc)) from exc


# The libraries this process loaded, by path: the SHA-256 of the bytes it loaded from each. And
# a lock per path, so that two loads of one key decide and record together.
_loaded: dict[str, str] = {}
_path_locks: dict[str, threading.Lock] = {}


def _install(request: NativeRequest, entry: Entry, path: Path) -> SharedLibrary | ObjectFile:
    """``load_file``'s blocking half: check, publish, load."""
    check_dependencies(request, entry)
    data = entry.blobs[request.output]
    if request.output == "o":
        _publish(path, data)
        return ObjectFile(request.name, request.key, path)
    digest = hashlib.sha256(data).hexdigest()
    with _path_locks.setdefault(str(path), threading.Lock()):
        _publish(path, data)
        if _loaded.get(str(path), digest) != digest:
            # dlopen() hands back the library this process already loaded from a path, whatever
            # the file there holds now: a key rebuilt in this process (its headers changed) is
            # loaded from a file of its own, named by its bytes. The key's file holds the new
            # build for other processes.
            path = path.with_name(f"{request.key}.{digest[:16]}.{request.output}")
            _publish(path, data)
        library = ctypes.CDLL(str(path))
        _loaded.setdefault(str(path), digest)
    return SharedLibrary(request.name, request.key, path, library)


def _publish(path: Path, data: bytes) -> None:
    """Write the file once, whole: readers (and dlopen) never see a partial one, and a failed
    write (a full disk) leaves nothing behind. What is there already is read only up to the
    size of ``data``; anything else in its place (a folder, a FIFO, a link) is replaced."""
    with contextlib.suppress(OSError):  # refused (not this file): written afresh
        if read_state(path, len(data)) == data:
            return
    write_state(path, data)


class SharedLibrary:
    """A shared library built by nvcc or the C++ compiler and loaded with ctypes.

    Attributes: ``name``, ``key``, ``path`` (in the cache folder), ``lib`` (the ``ctypes.CDLL``);
    its functions are reachable as attributes: ``library.saxpy(...)`` (set ``argtypes`` as with
    any ctypes function).
    """

    def __init__(self, name: str, key: str, path: Path, lib: ctypes.CDLL) -> None:
        self.name, self.key, self.path, self.lib = name, key, path, lib

    def __getattr__(self, symbol: str) -> Any:
        return getattr(self.lib, symbol)

    def __repr__(self) -> str:
        return f"<SharedLibrary {self.name} {self.path}>"


class ObjectFile:
    """An object file built by nvcc: ``path`` is in the cache folder, to link against."""

    def __init__(self, name: str, key: str, path: Path) -> None:
        self.name, self.key, self.path = name, key, path

    def __repr__(self) -> str:
        return f"<ObjectFile {self.name} {self.path}>"
