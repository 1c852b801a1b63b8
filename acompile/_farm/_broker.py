"""The farm's connection process: the one process of a pool that talks to Ray.

``python -m acompile._farm._broker``, started by the pool's ``RemoteExecutor`` (``_remote``) when
a pool with a farm is entered, and stopped when it is left. Ray's driver logic must not run in
the pool's own process, for what it does there:

* it ends the process: a driver whose cluster head stays unreachable for Ray's
  ``gcs_rpc_server_reconnect_timeout_s`` (60 s) is terminated by Ray, whatever else it serves;
* it blocks the caller's thread: with the head gone, Ray's calls (placing an actor, listing
  nodes) wait inside Ray, where no deadline of the caller's reaches them;
* a cluster that ``ray.init`` starts here (``RayFarm("local")``) lives as long as the thread
  that started it, so it must be started on a thread that lives as long as the pool.

So this process connects on its main thread (``ray.init`` there, before its event loop starts),
builds the farm's ``FarmExecutor`` (``_executor.connect``) and runs the pool's jobs on it, told
what to do through its standard input and answering on its standard output. Whatever Ray does
to it, the pool's process goes on: it notices the end of this process (or this process's word
that the cluster is lost) and moves the farm's pending jobs to local workers or fails them.

The head is watched from a thread of its own (``_HeadWatch``), which Ray's blocked calls on the
event loop do not hold up: a head that has not answered for ``LOST_AFTER`` seconds is reported
lost, and this process ends (with every process it started: a "local" cluster's). The report
comes within ``LOST_WITHIN`` seconds of the head's death.

The pipes carry the frames of ``acompile._workers._protocol`` (an 8-byte length, then a pickle).
Frames from the pool are read here with plain pickle: this process is the pool's, started by
it, and its standard input is a pipe only the pool holds. Frames to the pool are read there
with the protocol's restricted unpickler, which rebuilds only plain data, the protocol's
messages and acompile's errors, so that is all this process sends:

Pool to this process (the first a ``Setup``, whole: see ``_farm``; then a ``dict`` each):

* ``{"op": "submit", "id", "backend", "payload", "name", "lane", "expected"}``: run a job (its
  payload pickled on its own);
* ``{"op": "cancel" | "promote", "id"}``; ``{"op": "quiesce" | "wakeup"}``;
* ``{"op": "wait_ready", "token"}``: answered by a ``ready`` event with the same token;
* end of file: leave (stop the actors, disconnect, end a "local" cluster) and exit.

This process to the pool:

* ``{"event": "started"}``: Python and Ray are imported; connecting now;
* ``{"event": "joined"}``: connected to the cluster (``ray.init`` returned); the farm's executor
  is being built;
* ``{"event": "connected" | "stats", "stats", "farm"}``: connected, and the executor's and the
  farm's figures (``ExecutorStats``, ``FarmStats``), sent again when they change (looked at
  every ``_STATS_PERIOD`` seconds, and before each job's outcome);
* ``{"event": "failed", "error"}``: cannot connect (an acompile error); the process exits;
* ``{"event": "ran", "id", "pid", "started_at", "ended_at", "seconds", "paused"}`` then
  ``Done(id, result)`` or ``Error(id, error)``: a job's end (a cancelled one has none);
* ``{"event": "ready", "token", "error"}``: ``wait_ready()`` returned, or raised ``error``;
* ``{"event": "lost", "error"}``: the cluster's head stopped answering; the process ends.

The process's standard output is moved to a private descriptor before Ray is imported, and
descriptor 1 then points at its standard error: nothing that prints can corrupt the stream.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import anyio.abc

from acompile import _linux
from acompile._errors import AcompileError, BackendUnavailableError, CompileError, FarmUnreachableError
from acompile._workers import FrameReader, Job, JobCancelled, read_message
from acompile._workers import JobDone as Done
from acompile._workers import JobFailed as Error
from acompile._workers import encode_frame as encode

if TYPE_CHECKING:
    from acompile._farm._executor import FarmExecutor
    from acompile._farm._farm import RayFarm, Setup

# The head has not answered for this long: the cluster is lost. Ray itself waits 60 s (and then
# ends the process); a head restarted by Ray's GCS fault tolerance is back within seconds.
LOST_AFTER = 10.0
# How often the head is asked (a node listing), and how often an unanswered call is looked at
# again: it is not repeated while it is pending (Ray's own retries go on in it).
_WATCH_PERIOD = 2.0
# The head's death is reported within this: its last answer came before it died, the next
# question a period later, and silence is looked at every period.
LOST_WITHIN = LOST_AFTER + 2 * _WATCH_PERIOD
# How often the connection process says it is alive when it has nothing else to say.
BEAT_PERIOD = 2.0
# How often the figures are compared with those last sent.
_STATS_PERIOD = 0.05
# How long leaving may take (the actors stopped, the connection closed, a "local" cluster
# ended) before this process ends everything it started at once.
_LEAVE_LIMIT = 10.0
# How long the report of a lost cluster may take to reach the pool before this process ends.
_LAST_WORDS = 2.0
# How often the parent's death is looked for, besides its death signal (which Python handles
# only between bytecodes of the main thread: one blocked inside Ray would hold it).
_ORPHAN_POLL = 0.5


class _Outbox:
    """Frames to the pool, written by a thread of their own: neither the event loop nor the head's
    watch ever blocks on a pool that reads slowly (a large result), and both may send."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queue: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._write, name="acompile-farm-out", daemon=True).start()

    def put(self, message: Any) -> None:
        self._queue.put(encode(message))

    def put_frames(self, frames: bytes) -> None:
        self._queue.put(frames)

    def flush(self, limit: float) -> None:
        """Wait (at most ``limit`` seconds) until every frame put so far is written."""
        deadline = time.monotonic() + limit
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write(self) -> None:
        while True:
            view = memoryview(self._queue.get())
            try:
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError:
                _end(0)  # the pool is gone (its end of the pipe closed): nobody to serve
            finally:
                self._queue.task_done()


class _Broker:
    """Runs the pool's jobs on ``executor`` and reports their ends, the figures and readiness."""

    def __init__(self, executor: FarmExecutor, outbox: _Outbox) -> None:
        self.executor = executor
        self.outbox = outbox
        self.jobs: dict[int, Job] = {}  # by the pool's id of the job
        self.sent: tuple[Any, Any] | None = None  # the figures last sent
        self.tg: anyio.abc.TaskGroup | None = None

    def send_figures(self) -> bool:
        """Send the figures if they changed since they were last sent; whether it did."""
        stats, farm = self.executor.stats(), self.executor.farm_stats()
        if (stats, farm) != self.sent:
            self.sent = (stats, farm)
            self.outbox.put({"event": "stats", "stats": stats, "farm": farm})
            return True
        return False

    async def report_figures(self) -> None:
        """The figures when they change, and a beat at least every ``BEAT_PERIOD`` seconds: the
        pool takes a connection process silent for ``LOST_WITHIN`` seconds (stopped by a
        signal, its loop hung) for a lost cluster."""
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if self.send_figures():
                last = now
            elif now - last >= BEAT_PERIOD:
                self.outbox.put({"event": "beat"})
                last = now
            await anyio.sleep(_STATS_PERIOD)

    async def read(self, fd: int) -> None:
        """Serve the pool's frames until the end of its pipe."""
        os.set_blocking(fd, False)
        reader = FrameReader()
        while True:
            await anyio.wait_readable(fd)
            try:
                data = os.read(fd, max(reader.wanted(), 65536))
            except BlockingIOError:
                continue
            if not data:
                return
            reader.feed(data)
            while (parts := reader.next_parts()) is not None:
                self.handle(pickle.loads(b"".join(parts)))

    def handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "submit":
            new = Job(message["backend"], None, message["name"], message["lane"], message["expected"])
            try:
                # Pickled apart from the frame: a payload this process cannot rebuild (a class it
                # cannot import) fails its job, not the farm.
                new.payload = pickle.loads(message["payload"])
            except Exception as exc:
                what = f"the farm's connection process cannot read the job {new.name!r}"
                self.outbox.put(Error(message["id"], _sendable(exc, new, what)))
                return
            try:
                self.executor.submit(new)
            except AcompileError as exc:
                self.outbox.put(Error(message["id"], _sendable(exc, new)))
                return
            self.jobs[message["id"]] = new
            assert self.tg is not None
            self.tg.start_soon(self.report_end, message["id"], new)
        elif op == "cancel":
            if (cancelled := self.jobs.pop(message["id"], None)) is not None:
                self.executor.cancel(cancelled)
        elif op == "promote":
            if (promoted := self.jobs.get(message["id"])) is not None:
                self.executor.promote(promoted)
        elif op == "quiesce":
            self.executor.quiesce()
        elif op == "wakeup":
            self.executor.wakeup()
        elif op == "wait_ready":
            assert self.tg is not None
            self.tg.start_soon(self.report_ready, message["token"])

    async def report_end(self, job_id: int, job: Job) -> None:
        await job.done.wait()
        if self.jobs.pop(job_id, None) is None or isinstance(job.error, JobCancelled):
            return  # cancelled by the pool, which has forgotten it
        self.send_figures()  # the counts the pool reads once the outcome is in
        ran = {
            "event": "ran",
            "id": job_id,
            "pid": job.worker_pid,
            "started_at": job.started_at,
            "ended_at": job.ended_at,
            "seconds": job.seconds,
            "paused": job.paused,
        }
        try:
            if job.error is None:
                outcome = encode(Done(job_id, job.result))
            else:
                outcome = encode(Error(job_id, _sendable(job.error, job)))
        except Exception as exc:  # a result that does not pickle
            outcome = encode(Error(job_id, _sendable(exc, job, f"cannot send the result of {job.name!r}")))
        self.outbox.put_frames(encode(ran) + outcome)

    async def report_ready(self, token: int) -> None:
        error: AcompileError | None = None
        try:
            await self.executor.wait_ready()
        except Exception as exc:
            error = _sendable(exc)
        self.outbox.put({"event": "ready", "token": token, "error": error})


def _sendable(exc: BaseException, job: Job | None = None, what: str = "") -> AcompileError:
    """``exc`` as the pool's reading accepts it: an error of ``acompile._errors`` as it is,
    anything else as a ``CompileError`` that carries its class and text."""
    from acompile import _errors

    if isinstance(exc, AcompileError) and type(exc).__module__ == _errors.__name__:
        return exc
    text = f"{what or 'the farm failed'}: {type(exc).__name__}: {str(exc).strip()}"
    if job is None:
        return AcompileError(text)
    backend = job.backend.rsplit(".", 1)[-1].lstrip("_")
    return CompileError(text, kernel=job.name, backend=backend, log=str(exc))


class _HeadWatch:
    """Asks the cluster's head for its nodes every ``_WATCH_PERIOD`` seconds, from a thread that
    nothing on the event loop can hold up, and reports the cluster lost once the head has not
    answered for ``LOST_AFTER`` seconds."""

    def __init__(self, address: str, outbox: _Outbox) -> None:
        self.address = address
        self.outbox = outbox

    def start(self) -> None:
        threading.Thread(target=self._run, name="acompile-farm-head", daemon=True).start()

    def _run(self) -> None:
        import ray

        answered = time.monotonic()
        call: _Call | None = None
        while True:
            if call is None:
                call = _Call(ray.nodes)
            finished = call.done.wait(_WATCH_PERIOD)
            if finished:
                if call.ok:
                    answered = time.monotonic()
                call = None
            silent = time.monotonic() - answered
            if silent > LOST_AFTER:
                error = FarmUnreachableError(
                    f"lost the Ray cluster at {self.address!r}: its head has not answered for {silent:.0f} s"
                )
                self.outbox.put({"event": "lost", "error": error})
                self.outbox.flush(_LAST_WORDS)
                _end(1)
            if finished:
                time.sleep(_WATCH_PERIOD)


class _Call:
    """A blocking call in a daemon thread of its own: a call to a head that is gone waits inside
    Ray, and is abandoned to it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.done = threading.Event()
        self.ok = False
        self._fn = fn
        threading.Thread(target=self._run, name="acompile-farm-call", daemon=True).start()

    def _run(self) -> None:
        try:
            self._fn()
            self.ok = True
        except Exception:
            pass
        finally:
            self.done.set()


def _descendants() -> list[int]:
    """Every process under this one (from ``/proc``): a "local" cluster's GCS, raylet, agents and
    workers (the workers are the raylet's children, each in a process group of its own)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []  # no /proc: a "local" cluster's processes end with their raylet, in time
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # The name is in parentheses and may hold spaces: the parent is the second
                # field after them.
                parent = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(name))
    found: list[int] = []
    stack = [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _end(status: int) -> NoReturn:
    """End this process now, and every process it started (all of them found before any is
    killed: a killed raylet's workers would otherwise be re-parented out of reach)."""
    for pid in _descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(status)


def _end_after(seconds: float) -> None:
    """``_end(0)`` in ``seconds`` unless this process has ended by then."""
    timer = threading.Timer(seconds, _end, (0,))
    timer.daemon = True
    timer.start()


def _die_with_parent(parent: int) -> None:
    """End when the pool's process ends, however it ends: its death signal (SIGTERM, handled
    between bytecodes of the main thread) and a thread that looks for the re-parenting (for a
    main thread held inside Ray)."""
    signal.signal(signal.SIGTERM, lambda *_: _end(0))
    _linux.signal_at_parent_death(signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_POLL)
        _end(0)

    threading.Thread(target=watch, name="acompile-farm-orphan", daemon=True).start()


def _fail(outbox: _Outbox, exc: BaseException, address: str) -> NoReturn:
    """Tell the pool why this process cannot connect (an acompile error as it is, anything else
    as ``FarmUnreachableError``), and end."""
    if not isinstance(exc, AcompileError):
        exc = FarmUnreachableError(
            f"cannot connect to the Ray cluster at {address!r}: {type(exc).__name__}: {str(exc).strip()}"
        )
    outbox.put({"event": "failed", "error": _sendable(exc)})
    outbox.flush(_LAST_WORDS)
    _end(1)


def _leave_on_eof(fd: int, connected: threading.Event) -> None:
    """Until this process has connected, the pool's closing its end of the input (it gave up on
    the connection: its deadline passed) ends this process at once, whatever the main thread
    waits for inside Ray. The pool writes nothing before it hears that this process connected, so
    that the input becomes readable before then means its end."""

    def watch() -> None:
        while not connected.is_set():
            readable, _, _ = select.select([fd], [], [], 0.2)
            if readable and not connected.is_set():
                _end(0)

    threading.Thread(target=watch, name="acompile-farm-eof", daemon=True).start()


def _initialize(farm: RayFarm, address: str) -> None:
    """Blocking, on the main thread: connect this process to the cluster (``ray.init``), or
    start a local one for ``"local"``. Raises ``FarmUnreachableError``."""
    from acompile._farm import _executor

    _executor._connect(farm, time.monotonic() + farm.connect_timeout, address)


async def _serve(
    farm: RayFarm, setup: Setup, fd_in: int, outbox: _Outbox, connected: threading.Event
) -> None:
    from acompile._farm import _executor

    try:
        executor = await _executor.connect(farm, setup.settings, Path(setup.memo_dir))
    except Exception as exc:
        _fail(outbox, exc, farm.address)
    broker = _Broker(executor, outbox)
    broker.sent = (executor.stats(), executor.farm_stats())
    connected.set()  # before the pool hears it: from then on, its frames are read here
    outbox.put({"event": "connected", "stats": broker.sent[0], "farm": broker.sent[1]})
    async with anyio.create_task_group() as tg:
        broker.tg = tg
        tg.start_soon(executor.serve)
        tg.start_soon(broker.report_figures)
        await broker.read(fd_in)
        # The pool is leaving: the actors are stopped (by serve(), cancelled), then the
        # connection closed; past the limit, everything goes at once.
        _end_after(_LEAVE_LIMIT)
        tg.cancel_scope.cancel()


def main() -> None:
    parent = int(os.environ.get("ACOMPILE_PARENT_PID", "0"))
    # Keep the protocol on private descriptors before anything can print.
    fd_in, fd_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the pool's to handle
    _linux.set_name("acompile-farm")
    if parent:
        _die_with_parent(parent)
        if os.getppid() != parent:
            _end(0)  # the pool died before its death signal was set
    outbox = _Outbox(fd_out)
    setup = read_message(fd_in)
    if setup is None:
        _end(0)
    sys.path[:] = setup.sys_path
    connected = threading.Event()
    _leave_on_eof(fd_in, connected)
    try:
        import ray
    except ImportError as exc:
        error = BackendUnavailableError(f'a RayFarm needs Ray: pip install "acompile[ray]" ({exc})')
        _fail(outbox, error, setup.address)
    outbox.put({"event": "started"})
    from acompile._farm._farm import RayFarm

    farm = RayFarm(**setup.farm)
    try:
        _initialize(farm, setup.address)
    except Exception as exc:
        _fail(outbox, exc, setup.address)
    # ray.init, on the main thread, installed a SIGTERM handler of its own.
    signal.signal(signal.SIGTERM, lambda *_: _end(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outbox.put({"event": "joined"})
    _HeadWatch(setup.address, outbox).start()
    status = 0
    try:
        anyio.run(_serve, farm, setup, fd_in, outbox, connected)
    except BaseException:
        traceback.print_exc()  # the pool's message says why this process ended: its last lines
        status = 1
    # Left: disconnect (a "local" cluster ends with it), bounded.
    _end_after(_LEAVE_LIMIT)
    ray.shutdown()
    _end(status)


if __name__ == "__main__":
    main()
