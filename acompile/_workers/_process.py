"""Worker processes as the pool sees them: handles, stopping, and what is left of them.

A worker is a process that leads its own process group (so that stopping it stops the compilers
it started), speaks the framed protocol (``_protocol``) on a pipe or a Unix socket, and writes its
fd 2 to a file the pool made, whose tail explains a crash. ``SpawnedWorker`` is a fresh
interpreter the pool started; ``ForkedWorker`` one the template forked (the template reaps it and
reports its exit).

And what is left of them: their work folder, removed only where it is this user's
(``remove_work_folder``).
"""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from acompile._workers._protocol import MessageReceiver

if TYPE_CHECKING:
    import asyncio

    from acompile._workers._queue import Job


# Signals that say "killed from outside" (an operator, an OOM killer, a chaos test) rather than
# "the compiler crashed": a job whose worker dies of one is retried once on a fresh worker.
EXTERNAL = frozenset({-signal.SIGKILL, -signal.SIGTERM, -signal.SIGHUP, -signal.SIGINT, -signal.SIGQUIT})
STDERR_TAIL = 64 * 1024


def short_backend(backend: str) -> str:
    """A backend module's short name for messages: "acompile._backends._triton_worker" ->
    "triton_worker"."""
    return backend.rsplit(".", 1)[-1].lstrip("_")


def stderr_tail(source: str | int) -> str:
    """The last ``STDERR_TAIL`` bytes of a worker's fd 2 file, decoded: by path (the pool) or
    by an open descriptor (the worker, on its own fd 2). Empty if it cannot be read."""
    try:
        if isinstance(source, int):
            return _tail(source)
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link: not ours
        try:
            return _tail(fd)
        finally:
            os.close(fd)
    except OSError:
        return ""


def _tail(fd: int) -> str:
    size = os.fstat(fd).st_size
    start = max(0, size - STDERR_TAIL)
    return os.pread(fd, size - start, start).decode("utf-8", "replace")


def remove_work_folder(path: str) -> None:
    """Remove the work folder at ``path`` (blocking), where it is a folder of this user's: not a
    link, not another user's folder made in its place (a /tmp cleaner took ours, someone made
    one by that name), whose content is theirs to keep. (``shutil.rmtree`` follows no link
    inside, and checks that what it opens is what it looked at.)"""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        import shutil  # here: a worker that never removes one does without it (and bz2, lzma)

        shutil.rmtree(path, ignore_errors=True)


class _WorkerBase:
    pid: int
    stderr_path: str

    def __init__(self) -> None:
        self.exited = anyio.Event()
        self.stop_cause: str | None = None
        self.started = time.monotonic()
        self.stopped_since: float | None = None
        # The job it runs, the timer that stops it past the pool's time limit, and whether that
        # timer fired (the pool's to set).
        self.job: Job | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.timed_out = False
        # When its job paused (``_late.paused``), while it is paused (the pool's to set).
        self.paused_at: float | None = None

    def answer_with(self, handler: Callable[[Any], bool]) -> bool:
        """Offer each message to ``handler`` as it arrives, where this kind of worker can (True);
        what it declines goes to ``receive()``. False: ``receive()`` returns every message."""
        return False


class SpawnedWorker(_WorkerBase):
    """A worker started as a fresh interpreter; its pipes are its stdin and stdout."""

    def __init__(self, process: anyio.abc.Process, stderr_path: str) -> None:
        assert process.stdin is not None and process.stdout is not None
        super().__init__()
        self._receiver = MessageReceiver(process.stdout)
        self._send = process.stdin
        self.process = process
        self.pid = process.pid
        self.stderr_path = stderr_path

    async def send_bytes(self, data: bytes) -> None:
        """Send one encoded frame."""
        await self._send.send(data)

    def send_nowait(self, data: bytes) -> bool:
        """Send one encoded frame without waiting, where this kind of worker can: True if sent,
        False if it must go through ``send_bytes()``. Raises ``anyio.BrokenResourceError``
        when the worker's end is closed."""
        return False

    async def receive(self) -> Any:
        """The worker's next message (see ``MessageReceiver.receive`` for what it raises)."""
        return await self._receiver.receive()

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def signal_kill(self) -> None:
        if self.process.returncode is None:
            kill_group(self.pid, unreaped=True)

    async def wait_exit(self) -> None:
        await self.process.wait()
        self.exited.set()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.process.aclose()


class Connection(Protocol):
    """A forked worker's connection, as its handle uses it: the template's ``WorkerConnection``
    (``_template`` builds on this module, so the handle names what it needs here)."""

    async def send(self, item: bytes) -> None: ...

    def send_nowait(self, item: bytes) -> None: ...

    async def receive(self) -> Any: ...

    def answer_with(self, handler: Callable[[Any], bool]) -> None: ...

    async def aclose(self) -> None: ...


class ForkedWorker(_WorkerBase):
    """A worker forked by the template; it talks over a Unix socket it connected to us."""

    def __init__(self, connection: Connection, pid: int, stderr_path: str) -> None:
        super().__init__()
        self.stream = connection
        self.pid = pid
        self.stderr_path = stderr_path
        self._returncode: int | None = None

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send(data)

    def send_nowait(self, data: bytes) -> bool:
        self.stream.send_nowait(data)
        return True

    async def receive(self) -> Any:
        """The next message the handler did not take (see ``WorkerConnection.receive``)."""
        return await self.stream.receive()

    def answer_with(self, handler: Callable[[Any], bool]) -> bool:
        self.stream.answer_with(handler)
        return True

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def set_exited(self, code: int) -> None:
        self._returncode = code
        self.exited.set()

    async def wait_exit(self) -> None:
        await self.exited.wait()  # the template says when

    def signal_kill(self) -> None:
        # The template reaps its children and tells us; until then the pid is still this one's.
        if not self.exited.is_set():
            kill_group(self.pid)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


async def stop(worker: SpawnedWorker | ForkedWorker) -> int | None:
    """Stop a worker now and wait until it is gone; returns its exit status."""
    with anyio.CancelScope(shield=True):
        worker.signal_kill()
        with anyio.move_on_after(5):
            await worker.wait_exit()
        # Whatever ended the worker (a kill from outside, a crash), the compilers it started are
        # still in its process group: they go with it. The group's id cannot be reused by another
        # process while any of them lives.
        kill_group(worker.pid)
        await worker.close()
    return worker.returncode


def kill_group(pid: int, *, unreaped: bool = False) -> None:
    """SIGKILL the process group that worker pid leads (it and every compiler it started).

    ``unreaped``: the caller knows the process has not been reaped (its pid is still its own),
    and it may not lead its group yet (a spawned process makes it at its first statement): with
    no such group, the process alone is killed. Without it, no group means nothing to kill: the
    pid may already be another process's."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        if unreaped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    except PermissionError:
        # Not a group of ours (the pid was never a group leader): the process alone.
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Closable(Protocol):
    async def aclose(self) -> None: ...


async def close_quietly(stream: Closable) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except OSError:
            pass


def lower_priority(pid: int, nice: int | str) -> None:
    """Put process ``pid`` (0: this one) below this process for the CPU: ``"idle"`` is the
    ``SCHED_IDLE`` policy (nice 19 where there is none), a number is added to its nice value.

    ``SCHED_IDLE`` rather than a nice value: the kernel lets a waking task preempt a running
    one only past a granularity of a few milliseconds, whatever their nice values, so an event
    loop whose timer fires while every CPU runs a compiler would wake that late; a task under
    ``SCHED_IDLE`` is preempted at once. The processes it starts (ptxas, nvcc, forked workers)
    inherit it. Applied by the pool right away, so that the worker's start-up already yields,
    and by the worker itself, in case this was refused.
    """
    if nice == "idle":
        idle = getattr(os, "SCHED_IDLE", None)
        if idle is not None:
            try:
                if os.sched_getscheduler(pid) != idle:
                    os.sched_setscheduler(pid, idle, os.sched_param(0))
                return
            except OSError:
                pass
        nice = 19
    if not isinstance(nice, int) or nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        target = os.getpriority(os.PRIO_PROCESS, 0) + nice
        if pid == 0:
            target = int(os.environ.get("ACOMPILE_PARENT_NICE", "0")) + nice
        if os.getpriority(os.PRIO_PROCESS, pid) < target:
            os.setpriority(os.PRIO_PROCESS, pid, target)
    except OSError:
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def cpu_waits(pids: list[int]) -> tuple[list[tuple[int, int]], int]:
    """For each of ``pids``: (nanoseconds run on a CPU, nanoseconds waited for one while
    runnable) of the process and every process under it (its compilers, a template's forked
    workers), from /proc/PID/task/*/schedstat (Linux); zeros where that cannot be read. And the
    nanoseconds all of them ran, each process counted once (families overlap: a template's
    holds the workers it forked)."""
    members: dict[int, tuple[int, int]] = {}
    samples = []
    for family in families(pids):
        ran = waited = 0
        for member in family:
            if member not in members:
                members[member] = _schedstat(member)
            ran += members[member][0]
            waited += members[member][1]
        samples.append((ran, waited))
    return samples, sum(ran for ran, _ in members.values())


def _schedstat(pid: int) -> tuple[int, int]:
    ran = waited = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                fields = f.read().split()
            ran += int(fields[0])
            waited += int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    return ran, waited


def families(pids: list[int]) -> list[list[int]]:
    """For each of ``pids``: it and every process under it, found in one pass over the process
    table (the pool samples its processes twice a second, and a pass per process, as
    ``psutil.Process.children`` makes, cost the caller's process tens of milliseconds of CPU a
    second with sixteen workers on a busy machine); ``[]`` for one that is gone."""
    parents = _parent_map()
    if parents is None:
        return [_psutil_family(pid) for pid in pids]
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out: list[list[int]] = []
    for pid in pids:
        if pid not in parents:
            out.append([])
            continue
        # A pid reused while the table was read can make the map a cycle: visit each pid once.
        family, todo, seen = [], [pid], {pid}
        while todo:
            member = todo.pop()
            family.append(member)
            for child in children.get(member, ()):
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        out.append(family)
    return out


def _parent_map() -> dict[int, int] | None:
    """{pid: parent pid} of every process, from /proc (None where there is no /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    parents = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # The name is in parentheses and may hold spaces: state, then ppid, follow ")".
                parents[int(name)] = int(f.read().rpartition(b")")[2].split(maxsplit=2)[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def _psutil_family(pid: int) -> list[int]:
    import psutil  # here: workers import this module, and need none of it

    try:
        process = psutil.Process(pid)
        return [pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.Error:
        return []


def raise_priority(pids: list[int], nice: int) -> None:
    """Take processes and every process under them out of ``SCHED_IDLE``, to this process's
    nice value plus ``nice``: for idle-policy workers that other work starves."""
    target = os.getpriority(os.PRIO_PROCESS, 0) + nice
    for family in families(pids):
        for member in family:
            try:
                if os.sched_getscheduler(member) == os.SCHED_IDLE:
                    os.sched_setscheduler(member, os.SCHED_OTHER, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, member, target)
            except (OSError, AttributeError):
                continue


def sample_all(pids: list[int]) -> list[tuple[int | None, bool]]:
    return [(rss(pid), is_stopped(pid)) for pid in pids]


def rss(pid: int) -> int | None:
    """Resident memory of a process in bytes (Linux), or None."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (state T in /proc/PID/stat; Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The name is in parentheses and may hold spaces: the state follows the last ")".
            return f.read().rpartition(b")")[2].split()[0] == b"T"
    except (OSError, IndexError):
        return False


Worker = SpawnedWorker | ForkedWorker
