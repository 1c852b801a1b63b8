"""The worker's and the template's main loops: ``acompile._workers._main [--template]``, started
by ``WorkerPool`` (through ``_pool._BOOT``).

The worker speaks the framed protocol of ``acompile._workers._protocol`` on private copies of its stdin and
stdout, and points fd 0 at /dev/null and fd 1 at fd 2, so a compiler or a kernel module that prints
cannot corrupt the stream. fd 2 is a file the pool made (not a pipe): a compiler may write
megabytes there without ever blocking, and the worker truncates it at the start of each job, so
its tail is the job's own output.

The first message is the configuration; the worker then imports and preloads its backends (for
Triton: the import, Triton's one-time key hash, a first compile for the pool's target) and only
then says ``Ready``, so the first real job costs what the hundredth does.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import select
import signal
import stat
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from acompile import _linux, _trust
from acompile._errors import AcompileError, BackendUnavailableError, CompileError, bounded
from acompile._workers import _bytecode, _late, _protocol
from acompile._workers._config import WorkerConfig
from acompile._workers._process import lower_priority, remove_work_folder, short_backend, stderr_tail


def _die_with_parent(parent_pid: int, *, template: bool = False) -> None:
    """Go when the process that started us dies, even by SIGKILL (pipe EOF covers idle
    workers only), and take our compilers along.

    The kernel sends SIGTERM at the parent's death (PR_SET_PDEATHSIG). A worker leads its own
    process group (the pool starts it so), and its compilers (ptxas, nvcc and its cicc, c++ and
    its cc1plus) are in that group: the handler SIGKILLs the whole group, the worker with it. A
    template exits through its clean-up instead, which does the same for every worker it forked.
    Python runs the handler between bytecodes: a worker inside a long native call (an LLVM pass)
    goes when that call returns; one waiting on a compiler subprocess goes at once.
    """
    signal.signal(signal.SIGTERM, _exit_template if template else _kill_own_group)
    _linux.signal_at_parent_death(signal.SIGTERM)
    # The parent may have died before prctl took effect: then we were re-parented already.
    if parent_pid and os.getppid() != parent_pid:
        _kill_own_group()


def _kill_own_group(*_: object) -> None:
    _remove_work_folder_of_a_dead_pool(wait=_REPARENTING)
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# How long a process whose pool seems gone looks for its re-parenting (see below).
_REPARENTING = 0.5


def _remove_work_folder_of_a_dead_pool(wait: float = 0.0) -> None:
    """The pool's process, this process's parent, is gone: it was killed (SIGKILL, the OOM
    killer) and could not remove its work folder (the workers' stderr files, the template's
    socket). The template, or a spawned worker, removes it as it goes. Not a forked worker (its
    parent is the template: the pool may well be alive), which drops the folder's name as it
    starts; not a process whose pool lives (one stopped from outside).

    ``wait``: how long to look for the re-parenting. A dying parent's closed descriptors (the
    end of this process's input) and its death signal (sent as the thread that started this
    process exits, while the pool's other threads may still be going) both come a moment before
    the kernel gives this process another parent; a process stopped from outside while its pool
    lives goes that much later."""
    workdir = os.environ.get("ACOMPILE_WORKDIR")
    pool = int(os.environ.get("ACOMPILE_PARENT_PID", "0"))
    if not workdir or not pool:
        return
    deadline = time.monotonic() + wait
    while os.getppid() == pool:
        if time.monotonic() >= deadline:
            return
        time.sleep(0.002)
    remove_work_folder(workdir)  # where it is still this user's folder, not one put in its place


def _exit_template(*_: object) -> None:
    if not TemplateLoop.serving:
        _kill_own_group()  # still preloading: no worker to clean up, and a kill reads as one
    TemplateLoop.signalled = True
    raise SystemExit(1)  # through TemplateLoop.serve's clean-up, which stops every worker


def _reset_stderr() -> None:
    # Truncated only when something was written: a truncate is a metadata write of the file
    # system (a couple of microseconds, more on a journaled one) on every job, and most jobs
    # write nothing. fd 2 is opened O_APPEND: moving its offset to the end changes nothing.
    try:
        if os.lseek(2, 0, os.SEEK_END):
            os.ftruncate(2, 0)
    except OSError:
        pass  # fd 2 is not a regular file (run by hand): nothing to reset


class Worker:
    """The worker's loop: read a job, compile it with its backend, answer; one at a time."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self.backends: dict[str, ModuleType] = {}
        self.config: WorkerConfig = {}
        # Its input ended without an Exit: the pool's process is gone (it stops a worker with a
        # kill, and its template with Exit).
        self.orphaned = False

    def backend(self, name: str) -> ModuleType:
        """The backend module ``name``, imported and set up on first use."""
        module = self.backends.get(name)
        if module is None:
            module = importlib.import_module(name)
            module.setup(self.config)
            self.backends[name] = module
        return module

    def start(self, early_imports: list[str]) -> bool:
        """Read the configuration, preload, say ``Ready`` (or ``Failed``); False to exit."""
        # Import the backends named on the command line while the parent may still be preparing
        # the configuration (it sends it as soon as it has it). Best effort: a backend that
        # needs the parent's sys.path to import is imported again, for real, below.
        t0 = time.perf_counter()
        for name in early_imports:
            try:
                importlib.import_module(name)
            except Exception:
                pass
        config = _protocol.read_message(self.fd_in)
        if config is None:
            self.orphaned = True
            return False
        self.config = config
        try:
            _apply_config(config)
            for name in config.get("preload", ()):
                self.backend(name).preload(config)
        except BaseException as exc:
            _protocol.write_message(
                self.fd_out,
                _protocol.Failed(f"{type(exc).__name__}: {exc}\n{stderr_tail(2)}", traceback.format_exc()),
            )
            return False
        _reset_stderr()
        ready = _protocol.Ready(pid=os.getpid(), preload_s=time.perf_counter() - t0, threads=thread_count())
        _protocol.write_message(self.fd_out, ready)
        return True

    def serve(self) -> None:
        """Run jobs until ``Exit`` or EOF."""
        while True:
            _await_next_job(self.fd_in)
            message = _protocol.read_message(self.fd_in)
            if not isinstance(message, _protocol.RunJob):
                self.orphaned = message is None
                return  # Exit, or EOF: the pool is done with us
            job_id, backend, payload = message.id, message.backend, message.payload
            _reset_stderr()
            reply: _protocol.Done | _protocol.Error
            try:
                with _late.reporting(self.fd_out, job_id):  # its waits that are not its work
                    result = self.backend(backend).compile(payload)
            except BaseException as exc:
                reply = _protocol.Error(job_id, _as_compile_error(exc, backend, payload))
            else:
                reply = _protocol.Done(job_id, result)
            try:
                _protocol.write_message(self.fd_out, reply)
            except BrokenPipeError:
                return
            except Exception as exc:  # an unpicklable result: report it instead of dying
                err = _as_compile_error(exc, backend, payload)
                _protocol.write_message(self.fd_out, _protocol.Error(job_id, err))


# How long a worker under SCHED_IDLE polls for its next job before it sleeps in read(). A job
# sent to a sleeping idle-policy worker waits for it to wake (on 2 cores, 15 workers: no-op
# round trip p50 0.14 ms without the poll, 0.08 ms with it); the next job of a caller that
# awaits each result in turn comes within this. Only under SCHED_IDLE: there the poll runs on
# CPU time nothing else wanted, and never takes a CPU from the caller or a compile at normal
# priority.
_POLL_SECONDS = 200e-6
_SCHED_IDLE = getattr(os, "SCHED_IDLE", None)


def _await_next_job(fd: int) -> None:
    # Asked each time: the pool may have moved a starved worker to a normal policy.
    if _SCHED_IDLE is None or os.sched_getscheduler(0) != _SCHED_IDLE:
        return
    poller = select.poll()  # not select(): a descriptor past 1023 is out of its range
    poller.register(fd, select.POLLIN)
    deadline = time.perf_counter() + _POLL_SECONDS
    while time.perf_counter() < deadline:
        if poller.poll(0):
            return


def thread_count() -> int:
    """Threads of this process, native ones included (Python's own count misses those)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


class TemplateLoop:
    """A preloaded process that forks workers (``acompile._workers._main --template``).

    It does a worker's whole preload once (imports, Triton's set-up, a first compile), then forks
    a worker per request: a forked worker is ready in milliseconds instead of the second a fresh
    interpreter needs. Forking is safe only from a process with one thread; the template reports
    its thread count, and the pool does not ask a template with more to fork.

    It answers each ``Fork`` with ``Forked``, and sends ``Exited`` when a worker it forked is
    gone (it is their parent and reaps them). A forked worker connects to the pool's Unix socket
    (config["address"]), once it knows the socket is its pool's (``_connect_to_pool``), and
    introduces itself with ``Hello`` before its ``Ready``.
    """

    serving = False  # set once it takes fork requests (its preload is over)
    signalled = False  # stopped by SIGTERM: its parent's death signal, or someone else's

    def __init__(self, worker: Worker, helping: _bytecode.Helping | None = None) -> None:
        self.worker = worker
        self.children: set[int] = set()
        # Its bytecode helpers (see main) still running: reaped, never reported as workers.
        self.helping = helping

    def serve(self) -> None:
        import select

        TemplateLoop.serving = True

        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        # poll(), not select(): a preload that opened a thousand files leaves these descriptors
        # past select()'s range (1023), and the template would fail at every start.
        poller = select.poll()
        poller.register(self.worker.fd_in, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        self.reap()  # helpers that ended before SIGCHLD was watched
        try:
            while True:
                try:
                    readable = [fd for fd, _ in poller.poll()]
                except InterruptedError:
                    continue
                if wake_r in readable:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                if self.worker.fd_in in readable:
                    message = _protocol.read_message(self.worker.fd_in)
                    if not isinstance(message, _protocol.Fork):
                        self.worker.orphaned = message is None
                        return  # Exit, or EOF: the pool is done with us
                    slot = message.slot
                    config: WorkerConfig = {**message.config, "template_pid": os.getpid()}
                    pid = os.fork()
                    if pid == 0:
                        os.close(wake_r)
                        os.close(wake_w)
                        self.become_worker(slot, config)  # never returns
                    self.children.add(pid)
                    _protocol.write_message(self.worker.fd_out, _protocol.Forked(slot, pid))
        finally:
            # Leave no worker behind, nor any compiler one started (each leads its own process
            # group), and reap them all: when the pool sees this process exit, every worker it
            # forked is gone.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for pid in list(self.helping.pids if self.helping else ()):
                self._stop_helper(pid)
            for pid in self.children:
                _kill_group(pid)
            for pid in self.children:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
                _kill_group(pid, reaped=True)  # what outlived it in its group
            orphaned = self.worker.orphaned or TemplateLoop.signalled
            _remove_work_folder_of_a_dead_pool(wait=_REPARENTING if orphaned else 0.0)

    def _stop_helper(self, pid: int) -> None:
        assert self.helping is not None
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            self.helping.ended(pid, status)  # killed: no stamp

    def reap(self) -> None:
        while self.children or (self.helping and self.helping.pids):
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.helping and pid in self.helping.pids:
                self.helping.ended(pid, status)
                continue
            self.children.discard(pid)
            _kill_group(pid, reaped=True)  # compilers it left behind (it was killed mid-compile)
            _protocol.write_message(
                self.worker.fd_out, _protocol.Exited(pid, os.waitstatus_to_exitcode(status))
            )

    def become_worker(self, slot: int, config: WorkerConfig) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # A group of its own before anything else: killing its group must never reach the
            # template's. (A group, not a session: see _pool._BOOT.)
            os.setpgid(0, 0)
            os.close(self.worker.fd_in)
            os.close(self.worker.fd_out)
            os.environ.pop("ACOMPILE_WORKDIR", None)  # the template's to remove, not ours
            _die_with_parent(int(config["template_pid"]))
            stderr = os.open(config["stderr_path"], os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW)
            os.dup2(stderr, 2)
            os.dup2(stderr, 1)
            os.close(stderr)
            try:
                fd = _connect_to_pool(config["address"])
            except OSError as exc:
                # On its fd 2, which the pool reads into the error of this start.
                os.write(2, f"the forked worker did not connect to its pool: {exc}\n".encode())
                return
            worker = self.worker
            worker.fd_in = worker.fd_out = fd
            worker.config = {**worker.config, **config}
            hello = _protocol.Hello(slot, os.getpid(), config["token"]).pack()
            while hello:
                hello = hello[os.write(fd, hello) :]
            try:
                for module in worker.backends.values():
                    module.setup(worker.config)
            except Exception as exc:
                # Said as a spawned worker says it: the pool counts a start that fails for a
                # reason of its own (and gives up when every start does), not one killed from
                # outside, which is worth trying again as long as it takes.
                message = f"{type(exc).__name__}: {exc}\n{stderr_tail(2)}"
                _protocol.write_message(fd, _protocol.Failed(message, traceback.format_exc()))
                return
            _protocol.write_message(fd, _protocol.Ready(pid=os.getpid(), preload_s=0.0, forked=True))
            worker.serve()
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)


def _connect_to_pool(address: str) -> int:
    """A descriptor of a connection to the pool's socket at ``address``, once it is known to be
    the pool's: its folder is a private folder of this user's, and the process that listens
    there is this user's (the kernel says whose: ``SO_PEERCRED``). Checked before the token is
    sent or anything is read: what a listener of another user sent would be unpickled here.
    Raises ``OSError`` (``UntrustedFolderError`` for the folder) otherwise."""
    import socket

    _trust.check_folder(Path(os.path.dirname(address)), "the pool's work folder")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        listener = _protocol.peer_uid(sock)
        if listener != os.geteuid():
            raise PermissionError(
                f"the socket {address} is served by {_trust.user_name(listener)}, not by "
                f"{_trust.user_name(os.geteuid())}: a worker connects only to its own pool"
            )
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def _as_compile_error(exc: BaseException, backend: str, payload: Any) -> AcompileError:
    """What the pool raises for a job that failed with exc: an ``AcompileError`` that names the
    kernel, with the job's fd 2 tail and the traceback (each cut to a bounded size)."""
    tb = "".join(traceback.format_exception(exc))
    tail = stderr_tail(2)
    if isinstance(exc, CompileError):
        exc.stderr_tail = exc.stderr_tail or tail
        exc.worker_traceback = exc.worker_traceback or tb
        return exc
    name = getattr(payload, "name", None) or (payload.get("name") if isinstance(payload, dict) else None)
    kernel = str(name or "?")
    short = short_backend(backend)
    if any(cls.__name__ == "DynamicLibNotFoundError" for cls in type(exc).__mro__):
        # cuda.pathfinder found no NVRTC library in this worker (the pool's process checks first).
        return BackendUnavailableError(
            f"compiling {kernel!r} needs NVRTC, which cannot be loaded here ({bounded(str(exc), 2000)}): "
            'pip install "acompile[cuda]"'
        )
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = f"{short} failed to compile {kernel!r}: the disk is full ({exc})"
    else:
        message = f"{short} failed to compile {kernel!r}: {type(exc).__name__}: {exc}"
    return CompileError(
        message,
        kernel=kernel,
        backend=short,
        log=f"{type(exc).__name__}: {exc}",
        stderr_tail=tail,
        worker_traceback=tb,
    )


def _apply_config(config: WorkerConfig) -> None:
    # Kernels must import as they do in the parent: its sys.path, its working directory (set by
    # the pool at spawn), and its __main__ script, re-run under another name when needed.
    sys.path[:] = [p for p in config.get("sys_path", sys.path)]
    for key, value in config.get("env", {}).items():
        os.environ[key] = value


def _kill_group(pid: int, *, reaped: bool = False) -> None:
    """SIGKILL a forked worker and its process group (it may not have made the group yet).

    Once the worker is reaped its pid may belong to another process; its group's id cannot,
    while any member of the group lives: then only the group is signalled.
    """
    for kill in (os.killpg,) if reaped else (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _close_stray_copies_of_stdio() -> None:
    """Close every descriptor above 2 that is another copy of our stdin or stdout.

    Some event loops (uvloop) start a process with its stdin and stdout as socket pairs whose
    child ends stay open, and inheritable, under other numbers. Forked workers would inherit
    those too: the template's stdout would then reach EOF in the pool only when its last worker
    exits, and the pool would not see the template die while a worker compiles on.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return  # not Linux: no template, nothing forked
    stdio = set()
    for fd in (0, 1):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            stdio.add((st.st_dev, st.st_ino))
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if (st.st_dev, st.st_ino) in stdio:
            os.close(fd)


def main() -> None:
    # Read by acompile._lazy as acompile was imported; the processes this one starts (a
    # compiler, a backend's own Python) are not workers.
    os.environ.pop("ACOMPILE_WORKER", None)
    bytecode = os.environ.pop(_bytecode.ENV, None)
    helpers = os.environ.pop(_bytecode.HELPERS_ENV, "")
    if bytecode:
        _bytecode.install(bytecode)  # before the first import of a backend
    parent_pid = int(os.environ.get("ACOMPILE_PARENT_PID", "0"))
    _die_with_parent(parent_pid, template=sys.argv[1:2] == ["--template"])
    _close_stray_copies_of_stdio()
    # Keep the protocol on private descriptors before anything can print.
    fd_in = os.dup(0)
    fd_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Below the process that serves requests: when both want a CPU, its event loop wins.
    # (The pool usually did this already, as soon as the process existed.)
    niceness = os.environ.get("ACOMPILE_WORKER_NICE", "0")
    lower_priority(0, niceness if niceness == "idle" else int(niceness))
    args = sys.argv[1:]
    template = args[:1] == ["--template"]
    helping = None
    if template and bytecode and helpers:
        # The first template on a cache folder compiles the heavy package's sources with help
        # (forked here, before any thread exists, at this process's priority).
        helping = _bytecode.precompile(bytecode, helpers)
    worker = Worker(fd_in, fd_out)
    if worker.start(args[1:] if template else args):
        if template:
            TemplateLoop(worker, helping).serve()
        else:
            worker.serve()
    if worker.orphaned and not (template and TemplateLoop.serving):  # (a serving template did it)
        _remove_work_folder_of_a_dead_pool(wait=_REPARENTING)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
