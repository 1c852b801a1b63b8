"""acompile's own launcher for Triton kernels on CUDA (``_launch.c``): built once per machine,
used wherever it can launch a kernel exactly as Triton's launcher would.

The C source ships with the package and is compiled the first time a process loads a kernel on
a GPU (the C compiler and Python headers that Triton's own launcher needs are enough), into
``<cache>/launcher/<digest>/``, keyed by the source, the Python build and the CUDA header; every
later process imports it in well under a millisecond. The build runs in the background: a kernel
loaded while it runs launches through Triton's launcher, which is the fallback for everything
this one does not take:

- an argument kind other than pointers, integers and floats (tuples, tensor descriptors), a
  kernel that needs scratch memory, an instrumented kernel;
- a kernel whose parameter list, as the driver reports it, is not the one this launcher would
  pass (checked at load, for every kernel);
- a machine where the build fails (the reason is logged once, at warning level).

``ACOMPILE_LAUNCHER=triton`` turns it off (every launch goes through Triton's launcher).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from acompile import _files
from acompile._errors import UntrustedFolderError
from acompile._linux import kill_group, lower_this_thread
from acompile._trust import check_folder, own_folder

logger = logging.getLogger("acompile")

SOURCE = Path(__file__).with_name("_launch.c")

# Triton's type names -> the kinds _launch.c knows (its enum's order). As in Triton's launcher,
# i1 and u1 travel as 32-bit ints.
_KINDS: dict[str, int] = {
    "i8": 1, "i16": 2, "i32": 3, "i1": 3, "i64": 4,
    "u8": 5, "u16": 6, "u32": 7, "u1": 7, "u64": 8,
    "fp16": 9, "bf16": 10, "fp32": 11, "f32": 11, "fp64": 12,
}  # fmt: skip
_POINTER = 0
_LAUNCHER_ABI = 8  # _launch.c's ABI
_RECIPE = 2  # the build's own version (see _folder_for)

# Triton's kernels take two hidden pointers after their arguments (global and profile scratch);
# the launcher passes null for both, as Triton's does for a kernel that needs neither.
_TRAILING_POINTERS = 2

_state_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None
_building: threading.Thread | None = None


def enabled() -> bool:
    return os.environ.get("ACOMPILE_LAUNCHER", "").strip().lower() not in ("triton", "0", "off")


def module(*, wait: bool = False, build: bool = True) -> ModuleType | None:
    """The launcher's module, or None: turned off, not built yet (with ``build``, a build is
    started in the background, or awaited with ``wait``), or it cannot be built here (see
    ``problem()``)."""
    global _failed
    if _module is not None or not enabled():
        return _module
    with _state_lock:
        if _module is None and _failed is None:
            try:
                found = _import_built()
            except OSError as exc:  # the cache folder unreadable, a path too long
                _failed = f"cannot use {exc.filename or 'the launcher folder'}: {exc.strerror or exc}"
                logger.warning(
                    "acompile's launcher cannot be used (%s); kernels launch through Triton's launcher",
                    _failed,
                )
                return None
            if found is None and build and (_building is None or not _building.is_alive()):
                _start_build()
            thread = _building
        else:
            thread = None
    if wait and thread is not None:
        thread.join()
    return _module


def load_if_built() -> None:
    """Import the launcher on a thread if this machine built it already, so that the first
    launch does not. A pool for a CUDA target does this as it starts, where NVIDIA's driver is
    (not on a warm-up host compiling for a fleet). It builds nothing: a compiler running past
    the pool's exit, in a process that may never launch a kernel, would be a process nobody
    asked for; the first kernel loaded starts the build."""
    if _module is None and _failed is None and enabled() and os.path.exists("/dev/nvidiactl"):
        threading.Thread(
            target=module, kwargs={"build": False}, name="acompile-launcher", daemon=True
        ).start()


def problem() -> str | None:
    """Why the launcher cannot be used here, if it cannot."""
    if not enabled():
        return "turned off by ACOMPILE_LAUNCHER"
    return _failed


def kernel_for(
    compiled: Any,
    signature: Mapping[str, Any],
    device: int,
    stream_of: Callable[[int], int],
    knobs_runtime: Any,
    chain_type: Any,
) -> Any:
    """The launcher's ``Kernel`` for a loaded ``CompiledKernel``, or None where Triton's launcher
    must launch it (why, at debug level)."""
    built = module()
    if built is None:
        return None
    use_bridge(built)
    metadata = compiled.metadata
    why = _unsupported(metadata, signature)
    if why is None:
        names = tuple(n for n, t in signature.items() if t != "constexpr")
        kinds = bytes(_POINTER if signature[n].startswith("*") else _KINDS[signature[n]] for n in names)
        try:
            return built.Kernel(
                function=compiled.function,
                device=device,
                kinds=kinds,
                names=names,
                trailing_pointers=_TRAILING_POINTERS,
                num_warps=metadata.num_warps,
                num_ctas=getattr(metadata, "num_ctas", 1),
                shared=metadata.shared,
                cooperative=bool(getattr(metadata, "launch_cooperative_grid", False)),
                pdl=bool(getattr(metadata, "launch_pdl", False)),
                stream_of=stream_of,
                knobs=knobs_runtime,
                chain_type=chain_type,
                tensor_type=_tensor_type(),
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            why = str(exc)
    logger.debug("launching %s through Triton's launcher: %s", getattr(metadata, "name", "?"), why)
    return None


def _tensor_type() -> Any:
    """PyTorch's tensor type where PyTorch is imported (a loaded kernel's arguments come from
    it then), else None: the launcher checks a tensor's allocation once, other objects' pointers
    at every launch (a tensor holds its memory while it lives; another object may not)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return tensor if isinstance(tensor, type) else None


def _unsupported(metadata: Any, signature: Mapping[str, Any]) -> str | None:
    if getattr(getattr(metadata, "target", None), "backend", None) != "cuda":
        return "not a CUDA kernel"
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, field, 0):
            return f"it needs scratch memory ({field})"
    if getattr(metadata, "tensordesc_meta", None):
        return "it takes tensor descriptors"
    instrumentation = getattr(metadata, "instrumentation_mode", "")
    if instrumentation:
        return f"it is instrumented ({instrumentation})"
    for name, ty in signature.items():
        if not isinstance(ty, str) or (ty != "constexpr" and not ty.startswith("*") and ty not in _KINDS):
            return f"argument {name} has type {ty!r}"
    return None


# --- building -----------------------------------------------------------------------------------


def _cuda_include() -> Path | None:
    """The folder of Triton's CUDA headers (its wheel ships them), found without importing it."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "include"
    return folder if (folder / "cuda.h").is_file() else None


def _compiler() -> list[str]:
    """The C compiler's command: ``$CC`` (which may carry flags), else cc, gcc or clang."""
    chosen = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if chosen is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return shlex.split(chosen)


def _build_dir(include: Path, *, make: bool = False) -> Path:
    header = (include / "cuda.h").stat()  # a megabyte: its path, size and time stand for it
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    # The compiler's command, flags included (``CC`` may carry them; ``CFLAGS`` is not used).
    digest.update(repr(os.environ.get("CC")).encode())
    digest.update(f"{include}|{header.st_size}|{header.st_mtime_ns}|".encode())
    return _folder_for(digest, make=make)


def _folder_for(digest: Any, *, make: bool) -> Path:
    """``<cache>/launcher/<digest>/``: a library's folder, keyed by what built it (``digest``,
    completed here with this Python's build)."""
    from acompile._cache import default_cache_dir

    digest.update(f"{sys.version}|{sys.implementation.cache_tag}|{sysconfig.get_platform()}".encode())
    # How libraries are built and checked: one built before a fresh Python had to load it first
    # (``_compile``) may end the process that loads it, and is never loaded.
    digest.update(f"|recipe {_RECIPE}".encode())
    # The library is loaded into this process: its folders must be this user's alone, as the
    # cache folder's are (acompile._trust); UntrustedFolderError (an OSError) otherwise.
    # Made only to build (``make``): a pool that merely looks for a launcher makes nothing.
    root = default_cache_dir()
    if make or os.path.lexists(root):
        root = own_folder(root, "the cache folder", resolve=True, make=make)
    folder = root
    for name in ("launcher", digest.hexdigest()[:32]):
        folder = folder / name
        if make:
            own_folder(folder, "the launcher's folder")
        elif os.path.lexists(folder):
            check_folder(folder, "the launcher's folder")
    return folder


def _artifact(folder: Path) -> Path:
    return folder / f"_launch{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _checksum_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".sha256")


def _import_built() -> ModuleType | None:
    """Import the launcher if this machine built it already (called under ``_state_lock``)."""
    global _module, _failed
    include = _cuda_include()
    if include is None:
        _failed = "Triton's CUDA headers are not installed"
        return None
    try:
        path = _artifact(_build_dir(include))
    except UntrustedFolderError as exc:
        _failed = str(exc)
        logger.warning(
            "acompile's launcher is not loaded (%s); kernels launch through Triton's launcher", exc
        )
        return None
    except OSError as exc:
        _failed = f"cannot read the launcher's source: {exc}"
        return None
    if not path.is_file() or not _intact(path):
        return None
    try:
        _module = _load(path)
    except ImportError as exc:  # damaged (a truncated file, another build's): build it again
        logger.debug("rebuilding acompile's launcher: %s", exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return _module


def _intact(path: Path) -> bool:
    """Whether the library at ``path`` is, byte for byte, what a build wrote (its checksum
    beside it); a damaged or half-written one is removed. Loading a damaged shared library can
    crash the process (a truncated one, with SIGBUS)."""
    try:
        recorded = _read_regular(_checksum_path(path), 64).decode("ascii", "replace").strip()
        if recorded == hashlib.sha256(_read_regular(path, 1 << 24)).hexdigest():
            return True
    except OSError:
        pass
    if os.path.lexists(path):
        logger.debug("rebuilding %s: damaged or incomplete", path)
    for stale in (path, _checksum_path(path)):
        with contextlib.suppress(OSError):
            stale.unlink()
    return False


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit``; never waits on a FIFO or a device someone
    left at the path (OSError instead)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("acompile._launch", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    if getattr(built, "ABI", None) != _LAUNCHER_ABI:
        raise ImportError(f"{path} is not this version's launcher")
    return built


def _start_build() -> None:
    global _building
    _building = threading.Thread(target=_build_in_background, name="acompile-launcher-build", daemon=True)
    _building.start()


def _build_in_background() -> None:
    global _module
    lower_this_thread()  # the compiler it runs too: the caller's event loop comes first
    try:
        built = _built_and_loaded(*_launcher_build(), _load)
    except Exception as exc:  # whatever it was, launches go on through Triton's launcher; said once
        _give_up(exc)
        return
    with _state_lock:
        _module = built


def _give_up(exc: BaseException) -> None:
    global _failed
    with _state_lock:
        _failed = str(exc)
    logger.warning(
        "acompile's launcher could not be built (%s); kernels launch through Triton's launcher", exc
    )


def build() -> Path:
    """Compile ``_launch.c`` for this Python into the cache (unless there already) and return
    the extension's path. Processes that build at once take turns (a lock in its folder): the
    first builds, the others find it built."""
    folder, target, command, probe = _launcher_build()
    _ensure_built(folder, target, command, probe)
    return target


def _launcher_build() -> tuple[Path, Path, list[str], _Probe]:
    """The launcher's folder, library, compiler command and load check (see ``_built_and_loaded``)."""
    include = _cuda_include()
    if include is None:
        raise RuntimeError("Triton's CUDA headers are not installed")
    folder = _build_dir(include, make=True)
    command = [
        *_compiler(),
        "-O2", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Werror=implicit-function-declaration",
        f"-I{sysconfig.get_paths()['include']}", f"-I{include}", str(SOURCE), "-ldl",
    ]  # fmt: skip
    return folder, _artifact(folder), command, _Probe("acompile._launch", _LAUNCHER_ABI, "CC")


class _Probe(NamedTuple):
    """How a fresh Python loads a library just built: as the extension module ``name``, whose
    ``ABI`` must be ``abi``, after importing ``first`` (what the library links against); and
    the environment variable that names its compiler (for the messages)."""

    name: str
    abi: int
    variable: str
    first: tuple[str, ...] = ()


def _built_and_loaded(
    folder: Path, target: Path, command: list[str], probe: _Probe, load: Callable[[Path], ModuleType]
) -> ModuleType:
    """The library ``target``, built by ``command`` unless this machine built it already, loaded
    by ``load``. Processes that build at once take turns (a lock in ``folder``): the first
    builds. A library there that does not load is removed and built again; where it still does
    not load in this process (the one that failed stays loaded under its name), the next
    process loads the new one."""
    for attempt in range(2):
        _ensure_built(folder, target, command, probe)
        try:
            return load(target)
        except ImportError as exc:
            if attempt:
                raise ImportError(f"{exc}; the next process loads the one built again") from exc
            logger.debug("building %s again: %s", target, exc)
            for stale in (target, _checksum_path(target)):
                with contextlib.suppress(OSError):
                    stale.unlink()
    raise AssertionError("unreachable")


def _ensure_built(folder: Path, target: Path, command: list[str], probe: _Probe) -> None:
    """Build ``target`` with ``command`` unless an intact one is there, under ``folder``'s lock."""
    with _build_lock(folder):
        if not (target.is_file() and _intact(target)):
            _compile(command, target, probe)


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Held while a library of ``folder`` is checked and built: processes starting together on
    a fresh machine (a server's ranks) build it once, not each (the bridge's build takes up to
    1 GB of memory)."""
    fd = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


# The compilers running now, by process group: killed if this process exits before they end
# (a daemon thread's build would leave them running for nobody).
_compiling: set[int] = set()


@atexit.register
def _stop_compilers() -> None:
    for pgid in list(_compiling):
        kill_group(pgid)


def _compile(command: list[str], target: Path, probe: _Probe) -> None:
    """Run the compiler ``command`` (its output's ``-o`` added) into a scratch file beside
    ``target``, check that a fresh Python loads it (``probe``), then put the library in place
    with its checksum. Called with the folder's build lock held.

    The check keeps out a library whose load would end this process: a sanitizer in ``CC`` or
    ``CXX`` (its runtime exits a process that did not load it first), a compiler for another
    machine, a broken toolchain. Such a build fails like any other, with what the fresh process
    said."""
    if not command or command[0].startswith("-"):
        raise RuntimeError(f"no compiler in the command {shlex.join(command)!r} (is CC or CXX empty?)")
    for path in (target, _checksum_path(target)):
        if os.path.lexists(path) and not (path.is_symlink() or path.is_file()):
            raise RuntimeError(f"{path} is in the way (not a file acompile can replace): remove it")
    _remove_stale_scratch(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        out = Path(scratch) / target.name
        command = [*command, "-o", str(out)]
        try:
            returncode, stderr = _run(command, 300)
        except FileNotFoundError:
            raise RuntimeError(f"no compiler at {command[0]!r} ({_named_by(probe.variable)})") from None
        if returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({returncode}): {stderr.strip()[-2000:]}")
        if not out.is_file():
            raise RuntimeError(f"{command[0]} exited 0 and wrote no library")
        check = [sys.executable, "-c", _PROBE, str(os.getpid()), str(out), probe.name, str(probe.abi)]
        check += probe.first
        # The probe imports what this process would (its sys.path, which may have been changed
        # after it started; imports skip entries that are not text), and nothing else.
        importable = [entry for entry in sys.path if isinstance(entry, str)]
        returncode, stderr = _run(check, 120, json.dumps(importable))
        if returncode != 0:
            how = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
            raise RuntimeError(
                f"the library {command[0]} built ({_named_by(probe.variable)}) does not load in a "
                f"fresh Python ({how}), so it is not used: loading it could end this process. "
                f"{probe.variable} must build libraries that load as they are (no sanitizer flags, "
                f"for one). What that process said: {stderr.strip()[-2000:]}"
            )
        library = out.read_bytes()
        # The checksum first: a library in place always has its checksum beside it (a reader
        # between the two writes sees the new checksum and no library, or an older one that
        # does not match it, and builds too: never a library it would take for damaged). The
        # library keeps the mode a compiler gives its output.
        _files.write_whole(_checksum_path(target), hashlib.sha256(library).hexdigest().encode())
        _files.write_whole(target, library, mode=0o777)


# What a fresh Python runs to check a library just built: argv is the caller's pid, the library's
# path, the module's name, its ABI, and the modules to import first; its input, the caller's
# sys.path. It ends with the caller (PR_SET_PDEATHSIG), even SIGKILLed: a library that never
# finishes loading would keep it for ever.
_PROBE = """
import ctypes, importlib, importlib.util, json, os, signal, sys
caller, path, name, abi, *first = sys.argv[1:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
except (AttributeError, OSError):
    pass
if os.getppid() != int(caller):
    sys.exit("the process that asked for this check has ended")
sys.path[:] = json.loads(sys.stdin.read())
for module in first:
    importlib.import_module(module)
spec = importlib.util.spec_from_file_location(name, path)
built = importlib.util.module_from_spec(spec)
spec.loader.exec_module(built)
if getattr(built, "ABI", None) != int(abi):
    sys.exit(f"{path} is not the library this version needs (ABI {getattr(built, 'ABI', None)}, not {abi})")
"""


def _named_by(variable: str) -> str:
    """Where the compiler's command came from, for a message."""
    given = os.environ.get(variable)
    return f"{variable}={given!r}" if given else f"{variable} is not set: found on PATH"


def _run(command: list[str], timeout: float, given: str = "") -> tuple[int, str]:
    """Run ``command`` in a session of its own, its input ``given``, killed with what it started
    (a compiler's cc1plus) past ``timeout`` seconds or at this process's exit; its exit status
    (negative: the signal that ended it) and the end of its stderr.

    Its input and stderr are files, not pipes, and what ends is the command itself: a process
    it leaves running that keeps them open (a daemon a library starts as it loads, in a session
    of its own) holds nothing up. Its stderr may be in any encoding (bytes that are not UTF-8
    are replaced)."""
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stderr:
        stdin.write(given.encode())
        stdin.seek(0)
        process = subprocess.Popen(
            command, stdin=stdin, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
        _compiling.add(process.pid)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(process.pid)  # not reaped yet: the group is still the command's
            process.wait()
            raise RuntimeError(f"{command[0]} did not finish in {timeout:g} s") from None
        except BaseException:
            kill_group(process.pid)
            raise
        finally:
            _compiling.discard(process.pid)
        stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 16384))  # megabytes of it: the end
        return process.returncode, stderr.read().decode(errors="replace")


def _remove_stale_scratch(folder: Path) -> None:
    """Scratch folders of builds killed an hour ago or more (a build's own lasts seconds)."""
    cutoff = time.time() - 3600
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith("tmp") and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        shutil.rmtree(entry.path, ignore_errors=True)


# --- the bridge to PyTorch's tensors ------------------------------------------------------------

BRIDGE_SOURCE = Path(__file__).with_name("_torch_bridge.cpp")
_BRIDGE_ABI = 1

_bridge_thread: threading.Thread | None = None
_bridge_failed: str | None = None
_OFF = ("0", "off", "no", "false", "none", "disable", "disabled")


def bridge_enabled() -> bool:
    return os.environ.get("ACOMPILE_TORCH_BRIDGE", "").strip().lower() not in _OFF


def use_bridge(launcher: ModuleType) -> None:
    """Once PyTorch is imported, have ``launcher`` read tensors' addresses through acompile's
    bridge to PyTorch (``_torch_bridge.cpp``) instead of calling ``data_ptr()``: on a thread,
    the bridge this machine built already is imported, or it is built (once per PyTorch build,
    a C++ compiler's ten seconds or so, at the lowest priority). Launches call ``data_ptr()``
    until then, and for good where it cannot be built (the reason at debug level, and from
    ``bridge_problem()``). Called at each kernel's load; a process forked meanwhile starts
    its own."""
    global _bridge_thread
    if _bridge_failed is not None or "torch" not in sys.modules or not bridge_enabled():
        return
    thread = _bridge_thread
    if (thread is not None and thread.is_alive()) or launcher.tensor_pointer_in_use():
        return
    with _state_lock:
        if _bridge_thread is not thread:
            return  # another thread started one meanwhile
        _bridge_thread = threading.Thread(
            target=_bridge_in_background, args=(launcher,), name="acompile-torch-bridge", daemon=True
        )
        _bridge_thread.start()


def wait_for_bridge() -> bool:
    """Wait for the bridge's import or build, if one was started; whether launches read tensors'
    addresses through it now (for benchmarks: the steady state, and a build left complete)."""
    thread = _bridge_thread
    if thread is not None:
        thread.join()
    launcher = _module
    return launcher is not None and bool(launcher.tensor_pointer_in_use())


def bridge_problem() -> str | None:
    """Why launches read tensors' addresses through ``data_ptr()``, if they do for good."""
    if _module is not None and _module.tensor_pointer_in_use():
        return None
    if not bridge_enabled():
        return "turned off by ACOMPILE_TORCH_BRIDGE"
    return _bridge_failed


def _bridge_in_background(launcher: ModuleType) -> None:
    global _bridge_failed
    lower_this_thread()  # the compiler it runs too: the caller's event loop comes first
    try:
        bridge = load_bridge()
        launcher.use_tensor_pointer(bridge.TENSOR_POINTER)
    except Exception as exc:  # whatever it was, launches go on through data_ptr(); said where asked
        _bridge_failed = str(exc)
        logger.debug("launches read tensors' addresses through data_ptr(): %s", exc)


def load_bridge() -> ModuleType:
    """The bridge's module, built here first unless this machine built it already for this
    PyTorch (see ``_built_and_loaded``)."""
    torch = sys.modules.get("torch") or importlib.import_module("torch")
    root = Path(str(torch.__file__)).parent
    include, lib = root / "include", root / "lib"
    if not (include / "torch" / "csrc" / "autograd" / "python_variable.h").is_file():
        raise RuntimeError(f"PyTorch's C++ headers are not installed (no {include})")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    library = lib / "libtorch_python.so"
    stat_ = library.stat()
    digest = hashlib.sha256()
    digest.update(BRIDGE_SOURCE.read_bytes())
    digest.update(repr((compiler, abi)).encode())
    version = f"{torch.__version__}|{getattr(torch.version, 'git_version', '')}"
    digest.update(f"{version}|{library}|{stat_.st_size}|{stat_.st_mtime_ns}|".encode())
    folder = _folder_for(digest, make=True)
    target = folder / f"_torch_bridge{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    probe = _Probe("acompile._torch_bridge", _BRIDGE_ABI, "CXX", first=("torch",))
    command = [
        *shlex.split(compiler),
        "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{include}", str(BRIDGE_SOURCE),
        f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_python", "-lc10",
    ]  # fmt: skip
    return _built_and_loaded(folder, target, command, probe, _import_bridge)


def _import_bridge(target: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("acompile._torch_bridge", target)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {target}")
    bridge = importlib.util.module_from_spec(spec)  # where an extension's library is opened
    spec.loader.exec_module(bridge)
    if getattr(bridge, "ABI", None) != _BRIDGE_ABI:
        raise ImportError(f"{target} is not this version's bridge")
    return bridge
