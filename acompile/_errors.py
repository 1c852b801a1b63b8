"""The exception tree of acompile.

Every error acompile raises on purpose derives from ``AcompileError``::

    AcompileError
    ├── InvalidSpecError          (also a ValueError)  a compile request that cannot be right
    │   └── UnknownTargetError                          a target string acompile cannot read
    ├── CompileError                                    the compiler rejected the kernel
    │   ├── WorkerCrashedError                          the worker died while compiling it
    │   ├── CompileTimeoutError                         it ran past the pool's max_compile_seconds
    │   ├── CUDACompileError                            NVRTC or nvcc rejected CUDA C++ source
    │   └── CppCompileError                             the C++ compiler rejected C++ source
    ├── PoolError                                       the pool cannot take work
    │   ├── PoolClosedError                             used outside ``async with``, or after it
    │   ├── WorkerStartError                            a worker failed to start or preload
    │   ├── FarmUnreachableError                        a compile farm's cluster cannot be reached
    │   └── FarmToolchainError                          no node of a farm has this process's toolchain
    ├── KernelNotReadyError       (also a RuntimeError) a progressive kernel launched too early
    ├── BackendUnavailableError   (also an ImportError) a backend's package is not installed
    ├── DeviceUnavailableError                          loading or launching with no usable GPU
    └── UntrustedFolderError  (also a PermissionError)  a folder acompile would trust is not this user's alone

Cancellation (``anyio.get_cancelled_exc_class()``) is never translated into one of these: a
caller that cancels, or whose ``anyio.fail_after`` deadline expires, sees its own cancellation.
"""

from __future__ import annotations

from typing import Any

# What one error carries of each text (message, log, stderr tail, traceback): compilers have been
# seen to print tens of megabytes, and an error travels through pipes, logs and pickles. The whole
# compiler log goes to a file the error names (``log_path``) where it was cut.
TEXT_LIMIT = 64 * 1024


def bounded(text: str, limit: int = TEXT_LIMIT) -> str:
    """text, or its head and tail with a marker between them if it is longer than limit."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 100) // 2
    cut = len(text) - 2 * keep
    return f"{text[:keep]}\n[... {cut} characters cut ...]\n{text[len(text) - keep :]}"


def show(value: object) -> str:
    """A value's repr for a message, short however large (or deep) the value is."""
    try:
        return bounded(repr(value), 200)
    except RecursionError:
        return f"a {type(value).__name__} nested too deep to show"
    except ValueError:  # an int of more digits than Python turns into text
        return f"an integer of {value.bit_length() if isinstance(value, int) else '?'} bits"


class AcompileError(Exception):
    """Base class of every error acompile raises on purpose."""


class InvalidSpecError(AcompileError, ValueError):
    """A compile request that is wrong before any compiler sees it.

    Raised by ``CompilePool.triton()`` and friends before a worker is involved: an unknown type
    string, a missing constexpr, an object that is not a Triton JIT function, a source string
    without the named kernel, an option the backend does not know. The message says what to change.
    """


class UnknownTargetError(InvalidSpecError):
    """A target acompile cannot read, such as ``"cuda90"`` or ``"cuda:12"``."""


class CompileError(AcompileError):
    """The compiler rejected a kernel (or crashed on it).

    Attributes:
        kernel: the kernel's name.
        backend: ``"triton"``, ``"cuda"``, ``"cpp"`` ...
        log: the compiler's own message.
        stderr_tail: the last part of what the worker's compilers wrote to fd 2 during the job.
        worker_traceback: the traceback of the failure inside the worker, as text.
        log_path: where the whole log was written when ``log`` had to be cut, else None.

    The message and each text attribute are cut to ``TEXT_LIMIT`` characters (the head and the
    tail, with a marker between them), however they are set.
    """

    _BOUNDED = frozenset({"log", "stderr_tail", "worker_traceback"})
    log_path: str | None = None

    def __init__(
        self,
        message: str,
        *,
        kernel: str,
        backend: str,
        log: str = "",
        stderr_tail: str = "",
        worker_traceback: str = "",
    ) -> None:
        super().__init__(bounded(message))
        self.kernel = kernel
        self.backend = backend
        self.log = log
        self.stderr_tail = stderr_tail
        self.worker_traceback = worker_traceback

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._BOUNDED and isinstance(value, str):
            value = bounded(value)
        super().__setattr__(name, value)

    def __str__(self) -> str:
        text = super().__str__()
        if self.stderr_tail.strip():
            text += "\n--- compiler stderr (tail) ---\n" + self.stderr_tail.rstrip()
        return text

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes do not survive the default pickling of exceptions.
        return (_rebuild_compile_error, (type(self), self.args[0], self.__dict__.copy()))


def _rebuild_compile_error(cls: type[CompileError], message: str, state: dict[str, object]) -> CompileError:
    err = cls.__new__(cls)
    Exception.__init__(err, bounded(message))
    for name, value in state.items():
        setattr(err, name, value)
    return err


class WorkerCrashedError(CompileError):
    """The worker process died while it compiled this kernel.

    Attributes (besides ``CompileError``'s):
        exit_code: the worker's exit status; negative for a signal (``-11`` is SIGSEGV).
        cause: ``"crash"`` (the compiler crashed), ``"killed"`` (killed from outside, twice),
            or ``"memory"`` (it passed the pool's ``memory_limit``).
    """

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None,
        cause: str = "crash",
        kernel: str,
        backend: str,
        log: str = "",
        stderr_tail: str = "",
        worker_traceback: str = "",
    ) -> None:
        super().__init__(
            message,
            kernel=kernel,
            backend=backend,
            log=log,
            stderr_tail=stderr_tail,
            worker_traceback=worker_traceback,
        )
        self.exit_code = exit_code
        self.cause = cause


class _SourceCompileError(CompileError):
    """Shared by the C++-family errors: where in the source the compiler pointed."""

    line: int | None = None
    source_line: str = ""


class CUDACompileError(_SourceCompileError):
    """NVRTC or nvcc rejected CUDA C++ source.

    Attributes (besides ``CompileError``'s, with ``log`` the compiler's whole log):
        line: the line of the first error the compiler reported, if it named one.
        source_line: that line of the source.
    """


class CppCompileError(_SourceCompileError):
    """The C++ compiler rejected the source (same attributes as ``CUDACompileError``)."""


class CompileTimeoutError(CompileError):
    """The compile ran longer than the pool's ``max_compile_seconds``; its worker was stopped.

    A caller's own deadline (``anyio.fail_after``) cancels the caller instead; this limit is for
    compilers that never return (ptxas has been seen to hang for half an hour).
    """


class PoolError(AcompileError):
    """The pool cannot take this work."""


class PoolClosedError(PoolError):
    """The pool is not running: used before ``async with`` entered it, or after it left.

    A pool is entered once; leaving it stops its workers for good. Make a new ``CompilePool``.
    """


class WorkerStartError(PoolError):
    """A worker process failed to start or to finish its preload (the message says why)."""


class FarmUnreachableError(PoolError):
    """Raised when entering a ``CompilePool(workers=RayFarm(...))`` whose cluster cannot be found
    or does not answer within the farm's ``connect_timeout``; the message names the address.
    ``RayFarm(local_fallback=True)`` compiles on local workers instead."""


class FarmToolchainError(PoolError):
    """No node of a compile farm compiles with this process's toolchain (Triton, ptxas,
    acompile), so none may put results under this process's keys; the message names each node
    and what differs. Raised by ``wait_ready()`` and by the requests that were waiting."""


class CompiledAfterReadyError(AcompileError):
    """A compile the server refused because it said it was ready
    (``pool.mark_ready(on_late="refuse")``): every kernel it serves should have been warmed up.

    Raised by the request (``pool.triton()`` and friends) and by a served JIT library's build
    instead of compiling; a cache hit (memory, disk, the fleet's tier) is still served. The
    message names the kernel; ``kernel`` and ``backend`` carry them.
    """

    def __init__(self, message: str, *, kernel: str = "", backend: str = "") -> None:
        super().__init__(message)
        self.kernel = kernel
        self.backend = backend


class KernelNotReadyError(AcompileError, RuntimeError):
    """A ``ProgressiveKernel`` was launched before any of its kernels existed.

    Raised by ``handle[grid](...)`` while both compiles are pending (``await handle.ready()``
    first), or once both have failed (the message names their errors, also on ``fast_error``
    and ``best_error``).
    """


class StageUnavailableError(AcompileError, LookupError):
    """A text stage of a kernel loaded from the disk cache (its PTX, an IR) cannot be read.

    A warm start reads each kernel's binary and metadata, checked, and its text stages only when
    ``kernel.asm`` first asks for them. Raised there when the entry's file no longer holds them:
    removed (``acompile prune``) or replaced by another compile's since, or damaged (then removed,
    so that the next request for the kernel compiles it again). The kernel itself still launches.
    """


class BackendUnavailableError(AcompileError, ImportError):
    """A backend's package is missing; the message names what to install."""


class DeviceUnavailableError(AcompileError):
    """Loading or launching a kernel needs a GPU and a driver, and there is none usable.

    Compiling never needs one: pass an explicit target (``target="cuda:90"``) to compile on a
    machine without a GPU; load and launch the results where a GPU is.
    """


class UntrustedFolderError(AcompileError, PermissionError):
    """A folder acompile would trust (the cache folder and its folders, whose entries hold code
    this process runs; a host pool's socket folder) belongs to another user, is writable by other
    users, or is a link another user could have made. Raised by ``CompilePool`` on entry (and
    the commands that use the folder, which exit 2); the message names the folder and its owner.
    acompile never ``chmod``-s such a folder into shape: choose a folder of your own (the default,
    ``~/.cache/acompile``, is), or share entries through a shared tier with a signing key.
    """
