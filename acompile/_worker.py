"""A compile worker: ``python -m acompile._worker``, started by ``CompilePool``.

The worker speaks the framed protocol of ``acompile._protocol`` on private copies of its stdin and
stdout, and points fd 0 at /dev/null and fd 1 at fd 2, so a compiler or a kernel module that prints
cannot corrupt the stream. fd 2 is a file the pool made (not a pipe): a compiler may write
megabytes there without ever blocking, and the worker truncates it at the start of each job, so
its tail is the job's own output.

The first message is the configuration; the worker then imports and preloads its backends (for
Triton: the import, Triton's one-time key hash, a first compile for the pool's target) and only
then says "ready", so the first real job costs what the hundredth does.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import time
import traceback
from types import ModuleType
from typing import Any

from acompile import _protocol
from acompile._errors import CompileError

STDERR_TAIL = 64 * 1024


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the pool's process dies, even by SIGKILL (pipe EOF covers idle workers only)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    # The parent may have died before prctl took effect: then we were re-parented already.
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def _stderr_tail() -> str:
    try:
        size = os.fstat(2).st_size
        start = max(0, size - STDERR_TAIL)
        data = os.pread(2, size - start, start)
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _reset_stderr() -> None:
    try:
        os.ftruncate(2, 0)
    except OSError:
        pass  # fd 2 is not a regular file (run by hand): nothing to reset


class Worker:
    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self.backends: dict[str, ModuleType] = {}
        self.config: dict[str, Any] = {}

    def backend(self, name: str) -> ModuleType:
        module = self.backends.get(name)
        if module is None:
            module = importlib.import_module(name)
            module.setup(self.config)
            self.backends[name] = module
        return module

    def start(self, early_imports: list[str]) -> bool:
        # Import the backends named on the command line while the parent may still be preparing
        # the configuration (it sends it as soon as it has it); an import error is reported
        # once the configuration is in.
        t0 = time.perf_counter()
        import_error: BaseException | None = None
        for name in early_imports:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                import_error = exc
                break
        config = _protocol.read_message(self.fd_in)
        if config is None:
            return False
        self.config = config
        try:
            if import_error is not None:
                raise import_error
            _apply_config(config)
            for name in config.get("preload", ()):
                self.backend(name).preload(config)
        except BaseException as exc:
            _protocol.write_message(
                self.fd_out,
                ("failed", f"{type(exc).__name__}: {exc}\n{_stderr_tail()}", traceback.format_exc()),
            )
            return False
        _reset_stderr()
        info = {"pid": os.getpid(), "preload_s": time.perf_counter() - t0}
        _protocol.write_message(self.fd_out, ("ready", info))
        return True

    def serve(self) -> None:
        while True:
            message = _protocol.read_message(self.fd_in)
            if message is None or message[0] == "exit":
                return
            _, job_id, backend, payload = message
            _reset_stderr()
            try:
                result = self.backend(backend).compile(payload)
            except BaseException as exc:
                reply = ("error", job_id, _as_compile_error(exc, backend, payload))
            else:
                reply = ("done", job_id, result)
            try:
                _protocol.write_message(self.fd_out, reply)
            except BrokenPipeError:
                return
            except Exception as exc:  # an unpicklable result: report it instead of dying
                err = _as_compile_error(exc, backend, payload)
                _protocol.write_message(self.fd_out, ("error", job_id, err))


def _as_compile_error(exc: BaseException, backend: str, payload: Any) -> CompileError:
    tb = "".join(traceback.format_exception(exc))
    tail = _stderr_tail()
    if isinstance(exc, CompileError):
        exc.stderr_tail = exc.stderr_tail or tail
        exc.worker_traceback = exc.worker_traceback or tb
        return exc
    name = getattr(payload, "name", None) or (payload.get("name") if isinstance(payload, dict) else None)
    kernel = str(name or "?")
    short = backend.rsplit(".", 1)[-1].lstrip("_")
    return CompileError(
        f"{short} failed to compile {kernel!r}: {type(exc).__name__}: {exc}",
        kernel=kernel,
        backend=short,
        log=f"{type(exc).__name__}: {exc}",
        stderr_tail=tail,
        worker_traceback=tb,
    )


def _apply_config(config: dict[str, Any]) -> None:
    # Kernels must import as they do in the parent: its sys.path, its working directory (set by
    # the pool at spawn), and its __main__ script, re-run under another name when needed.
    sys.path[:] = [p for p in config.get("sys_path", sys.path)]
    for key, value in config.get("env", {}).items():
        os.environ[key] = value


def main() -> None:
    parent_pid = int(os.environ.get("ACOMPILE_PARENT_PID", "0"))
    _die_with_parent(parent_pid)
    # Keep the protocol on private descriptors before anything can print.
    fd_in = os.dup(0)
    fd_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    niceness = int(os.environ.get("ACOMPILE_WORKER_NICE", "0"))
    parent_nice = int(os.environ.get("ACOMPILE_PARENT_NICE", "0"))
    if niceness > 0 and os.nice(0) < parent_nice + niceness:
        # Below the process that serves requests: when both want a CPU, its event loop wins.
        # (The pool usually did this already, as soon as the process existed.)
        try:
            os.nice(parent_nice + niceness - os.nice(0))
        except OSError:
            pass
    worker = Worker(fd_in, fd_out)
    if worker.start(sys.argv[1:]):
        worker.serve()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
