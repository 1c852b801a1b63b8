"""A worker-side backend for tests: jobs that do what Triton will not do on demand.

Payload: {"name": str, "action": str, ...}. Real processes, real signals, real file descriptors;
only the compiler is fake. ``acompile.testing.run_job(pool, "fake_backend", payload, name)`` runs
one such job on a pool's workers, as a request would; ``local_executor()`` (parent side) is the
pool's executor, for the tests of worker processes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from acompile._errors import CompileError
from acompile._workers import late_config, outside_job_time

if TYPE_CHECKING:
    from acompile import CompilePool
    from acompile._workers import WorkerPool


def local_executor(pool: CompilePool) -> WorkerPool:
    """The pool's executor, which the tests of worker processes expect to be the local one."""
    from acompile._workers import WorkerPool

    executor = pool.executor
    assert isinstance(executor, WorkerPool)
    return executor


_config: dict[str, Any] = {}  # what this worker was configured with


def setup(config: dict[str, Any]) -> None:
    _config.clear()
    _config.update(config)


def preload(config: dict[str, Any]) -> None:
    pass


def compile(payload: dict[str, Any]) -> Any:
    action = payload["action"]
    if action == "echo":
        return payload.get("value")
    if action == "pid":
        return os.getpid()
    if action == "env":
        return {
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "env": payload.get("var") and os.environ.get(payload["var"]),
        }
    if action == "sleep":
        time.sleep(payload["seconds"])
        return os.getpid() if payload.get("pid") else payload.get("value", "slept")
    if action == "burn":
        # A compile's CPU use: busy for "cpu_s" seconds of this process's own CPU time.
        end = time.process_time() + payload["cpu_s"]
        while time.process_time() < end:
            pass
        return os.getpid()
    if action == "pause":
        # "before_s" of the job's own work, a wait that is not (as a Triton worker's for the
        # pool's late configuration) "wait_s" long, its second half in a nested block with
        # "nested", then "work_s" of the job's own.
        time.sleep(payload.get("before_s", 0.0))
        with outside_job_time():
            time.sleep(payload["wait_s"] / 2)
            with outside_job_time() if payload.get("nested") else contextlib.nullcontext():
                time.sleep(payload["wait_s"] / 2)
        time.sleep(payload.get("work_s", 0.0))
        return payload.get("value", "paused")
    if action == "pause_elsewhere":
        # paused() in a thread the job leaves running: it must tell the pool nothing.
        entered = threading.Event()

        def elsewhere() -> None:
            with outside_job_time():
                entered.set()
                time.sleep(payload["wait_s"])

        threading.Thread(target=elsewhere, daemon=True).start()
        entered.wait()
        return os.getpid()
    if action == "late":
        # What the pool's late configuration holds for this worker, as a backend reads it;
        # "config" instead of the worker's own (a file that never comes), then "work_s".
        value = late_config(payload.get("config") or _config, wait=True)
        time.sleep(payload.get("work_s", 0.0))
        return value
    if action == "hold":
        # Runs until the test creates the file named by "until": a job whose end the test decides,
        # for tests that need a job still running while they do something else. With "running",
        # it first adds its pid to that file, a line per run: the test knows which worker runs it.
        if payload.get("running"):
            with open(payload["running"], "a") as f:
                f.write(f"{os.getpid()}\n")
        while not os.path.exists(payload["until"]):
            time.sleep(0.005)
        return os.getpid() if payload.get("pid") else payload.get("value", "held")
    if action == "flood":
        # Megabytes to fd 2, as LLVM with MLIR_ENABLE_DUMP=1 does; then fail, so the tail shows.
        chunk = (b"x" * 1023 + b"\n") * 1024
        for _ in range(payload["megabytes"]):
            os.write(2, chunk)
        os.write(2, b"the last words of the compiler\n")
        if payload.get("fail"):
            raise CompileError("flooded and failed", kernel=payload["name"], backend="fake", log="see stderr")
        return "flooded"
    if action == "modules":
        # What this worker process has imported of acompile, then its public names, as a backend
        # that uses them would (they are imported at the first one used here).
        loaded = sorted(m for m in sys.modules if m.startswith("acompile"))
        import acompile

        names = (acompile.CompileError.__module__, acompile.CompilePool.__module__)
        return loaded, *names, os.environ.get("ACOMPILE_WORKER")
    if action == "import":
        # Imports a module: its value, where its bytecode belongs, whether bytecode is written.
        module = importlib.import_module(payload["module"])
        return module.VALUE, module.__cached__, sys.dont_write_bytecode
    if action == "say":
        # Words on fd 2, as a compiler's warnings; then fail, if asked, so the tail shows.
        os.write(2, payload["words"].encode() + b"\n")
        if payload.get("fail"):
            raise CompileError(
                "failed after saying something", kernel=payload["name"], backend="fake", log=""
            )
        return "said"
    if action == "print":
        print("a compiler that prints to stdout must not corrupt the protocol")
        return "printed"
    if action == "raise":
        raise ValueError(payload.get("message", "broken kernel"))
    if action == "crash":
        os.write(2, b"about to crash\n")
        os.kill(os.getpid(), getattr(signal, payload.get("signal", "SIGSEGV")))
        time.sleep(10)
    if action == "exit":
        os._exit(payload.get("code", 1))
    if action == "alloc":
        hold = bytearray(payload["megabytes"] << 20)  # zero-filled: every page is touched
        time.sleep(payload.get("seconds", 30))
        return len(hold)
    if action == "big":
        return b"\x01" * payload["bytes"]
    if action == "unpicklable":
        return lambda: None
    if action == "unreadable":
        # Pickles here; rebuilding it in the pool raises (payload "bytes": its size).
        return _Unreadable(b"\x01" * payload.get("bytes", 16), bool(payload.get("exiting")))
    if action == "garbage":
        # Bytes on the protocol stream that are no frame: the stream is out of sync.
        _protocol_fd_write(b"\xff" * 16)
        time.sleep(5)
        return "too late"
    raise ValueError(f"unknown action {action!r}")


def _rebuild(blob: bytes, exiting: bool = False) -> Any:
    if exiting:
        raise SystemExit("this result calls exit as it is rebuilt")
    raise TypeError("this result cannot be rebuilt in the pool")


class _Unreadable:
    def __init__(self, blob: bytes, exiting: bool = False) -> None:
        self.blob = blob
        self.exiting = exiting

    def __reduce__(self) -> tuple[Any, tuple[bytes, bool]]:
        return (_rebuild, (self.blob, self.exiting))


def _protocol_fd_write(data: bytes) -> None:
    import gc

    from acompile._workers._main import Worker

    worker = next(o for o in gc.get_objects() if isinstance(o, Worker))
    os.write(worker.fd_out, data)
