"""``RemoteExecutor``: a pool's farm as the pool's own process sees it.

The farm's ``FarmExecutor`` runs in a process of its own, the connection process (``_broker``),
which holds the connection to Ray; this class implements ``Executor`` in the pool's process by
messages over that process's pipes. Ray is neither imported nor run here: whatever Ray does to the
process that holds a connection (it ends it 60 s after the cluster's head is lost; it blocks a
thread that calls a head that is gone), it does to the connection process, and the pool goes on.

* Entering: the connection process is started, connects (``connect_timeout``, as the farm says)
  and answers; until then nothing here waits on anything but its pipe, so a caller's deadline
  (``anyio.fail_after`` around the pool's entry or ``wait_ready()``) always fires, and a process
  abandoned that way is killed.
* Losing the cluster: when the connection process ends, or says the cluster is lost (its head
  has not answered for ``LOST_AFTER`` seconds, which it says within ``LOST_WITHIN`` seconds of
  the head's death), the farm is lost until a new connection holds. The jobs waiting on it,
  and every later one meanwhile, go to this machine's workers if the farm allows it
  (``RayFarm(local_fallback=True)``: the pool's own local workers, or local workers started
  then), or fail with ``FarmUnreachableError`` naming the address and what happened.
* Reconnecting: a new connection process is started after 2 s, then at doubling intervals up to
  a minute (each attempt first checks that the head's port answers, where the address names
  one), until one connects; new jobs then go to the farm again.
* Leaving: the connection process's input is closed; it stops the actors, disconnects (a
  cluster it started for ``"local"`` ends with it) and exits, or is killed past a bound. It also
  ends when this process dies, however (its parent-death signal).

Frames from the connection process are read with the protocol's restricted unpickler (see
``acompile._workers._protocol``), as a worker's are.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

from acompile._errors import (
    AcompileError,
    BackendUnavailableError,
    CompileError,
    FarmUnreachableError,
    PoolClosedError,
    bounded,
)
from acompile._farm._broker import LOST_AFTER, LOST_WITHIN
from acompile._farm._farm import Setup
from acompile._workers import (
    Executor,
    ExecutorStats,
    Job,
    JobCancelled,
    MessageReceiver,
    Undecodable,
    combined_stats,
    run_job,
)
from acompile._workers import JobDone as Done
from acompile._workers import JobFailed as Error
from acompile._workers import encode_frame as encode

if TYPE_CHECKING:
    from acompile._farm._farm import FarmStats, RayFarm
    from acompile._workers import Opening, WorkerSettings

__all__ = ("LOST_AFTER", "LOST_WITHIN", "RemoteExecutor", "connect", "open_farm")

logger = logging.getLogger("acompile")

# How long the connection process may take to start and import Ray, before it connects (the
# farm's connect_timeout counts from then). A second or two, on a machine that is not loaded.
_START_LIMIT = 30.0
# How long leaving waits for the connection process to stop the actors, disconnect and exit
# (it gives itself 10 s, then ends everything it started) before it is killed.
_LEAVE_LIMIT = 15.0
# How long a connection process that is connecting, or has reported the cluster lost, may take
# to end on its own (it ends what it started) before it is killed.
_ABORT_GRACE = 3.0
# What the connection process wrote to its standard error last (Ray's own complaints): kept for
# the message that says why it ended.
_STDERR_LINES = 20
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# After the farm is lost: the first attempt to connect again, and the most between two (each
# doubles the last).
_RECONNECT_FIRST = 2.0
_RECONNECT_MAX = 60.0
# How long the check that a head's port answers waits for it.
_ANSWER_WITHIN = 2.0


async def open_farm(farm: RayFarm, settings: WorkerSettings, opening: Opening) -> Executor:
    """``RayFarm.open``: connect to ``farm`` (through its connection process) and return its
    executor; where the farm cannot be reached and allows a local fallback, local workers (the
    pool's urgent ones under a ``Split``, else new ones), after one warning.

    For a farm lost later, with a local fallback, the executor moves its jobs to those local
    workers (made at the first need).

    Raises ``FarmUnreachableError`` (no fallback asked for) and ``BackendUnavailableError``
    when Ray is not installed.
    """
    # Looked for, not imported: Ray is imported by the connection process only.
    if importlib.util.find_spec("ray") is None:
        raise BackendUnavailableError('a RayFarm needs Ray: pip install "acompile[ray]"')

    def make_local() -> Executor:
        return opening.local_workers(settings)  # this machine's: the pool's own settings

    # On the farm's nodes compiling is the job, on CPUs Ray reserved for it: the idle policy
    # protects this process's event loop, which is not there.
    on_nodes = settings.replace(nice=0) if settings.nice == "idle" else settings
    try:
        return await connect(farm, on_nodes, opening.memo_dir, local=opening.fallback, make_local=make_local)
    except FarmUnreachableError as exc:
        if not farm.local_fallback:
            raise
        logger.warning("%s; compiling on this machine's workers instead (local_fallback=True)", exc)
        return opening.fallback if opening.fallback is not None else make_local()


async def connect(
    farm: RayFarm,
    settings: WorkerSettings,
    memo_dir: Path,
    *,
    local: Executor | None = None,
    make_local: Callable[[], Executor] | None = None,
) -> RemoteExecutor:
    """Start the farm's connection process, let it connect (within the farm's
    ``connect_timeout``, once it has started) and return the farm's executor.

    ``settings`` is how the farm's workers run, carried whole to the connection process and
    from there to each actor. Where the farm allows a local fallback, ``local`` is the pool's
    own local executor (served by the pool), or ``make_local`` makes one that this executor
    starts and serves when it first needs it.

    Raises ``FarmUnreachableError`` naming the address, and ``BackendUnavailableError`` where
    Ray cannot be imported.
    """
    setup = Setup(
        address=_address(farm),
        farm=farm.description(),
        memo_dir=str(memo_dir),
        sys_path=list(sys.path),
        settings=settings,
    )
    connection = await _open(farm, setup)
    return RemoteExecutor(farm, setup, *connection, local=local, make_local=make_local)


_Connection = tuple[anyio.abc.Process, MessageReceiver, dict[str, Any], deque[str]]


async def _open(farm: RayFarm, setup: Setup) -> _Connection:
    """Start a connection process with ``setup`` and wait for it to connect: the process, its
    frames, its first words (``hello``) and its last lines on standard error. Raises as
    ``connect()`` does; a process that does not connect is stopped."""
    env = dict(os.environ)
    env["ACOMPILE_PARENT_PID"] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    # Shielded: a cancellation inside open_process would lose the process object with the child
    # running. A session of its own: Ctrl-C in a terminal is this process's to handle.
    with anyio.CancelScope(shield=True):
        process = await anyio.open_process(
            [sys.executable, "-m", "acompile._farm._broker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    stderr: deque[str] = deque(maxlen=_STDERR_LINES)
    assert process.stdout is not None
    receiver = MessageReceiver(process.stdout)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_keep_stderr, process, stderr)
            try:
                assert process.stdin is not None
                await process.stdin.send(encode(setup))
                hello = await _hello(farm, process, receiver, stderr)
            except Exception as exc:
                failure = exc  # raised below as it is, not in the task group's exception group
            finally:
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _stop(process, grace=_ABORT_GRACE)
        raise
    return process, receiver, hello, stderr


def _address(farm: RayFarm) -> str:
    """The address the connection process connects to: the farm's, or, where this process is
    connected to a cluster already (its own ``ray.init()``), that cluster's."""
    ray = sys.modules.get("ray")  # never imported here: only looked at if the program did
    if ray is not None and ray.is_initialized():
        return str(ray.get_runtime_context().gcs_address)
    return farm.address


async def _hello(
    farm: RayFarm, process: anyio.abc.Process, receiver: MessageReceiver, stderr: deque[str]
) -> dict[str, Any]:
    """The connection process's first words: started (Ray imported), joined (connected to the
    cluster), then connected (the farm's executor built). Raises what it says went wrong, or
    ``FarmUnreachableError`` when it says nothing in time or ends."""
    try:
        with anyio.fail_after(_START_LIMIT):
            message = await _next(receiver)
    except TimeoutError:
        raise FarmUnreachableError(
            f"the connection process of the farm at {farm.address!r} did not start within "
            f"{_START_LIMIT:g} s (Python and Ray imported)"
        ) from None
    if message is not None and message.get("event") == "started":
        try:
            with anyio.fail_after(farm.connect_timeout):
                message = await _next(receiver)
        except TimeoutError:
            raise FarmUnreachableError(
                f"the Ray cluster at {farm.address!r} did not accept a connection within "
                f"{farm.connect_timeout:g} s{_said(stderr)}"
            ) from None
    if message is not None and message.get("event") == "joined":
        # Connected: the farm's executor is built there (the nodes listed, within the farm's
        # connect_timeout again; this machine's toolchain described, a moment).
        try:
            with anyio.fail_after(farm.connect_timeout + _START_LIMIT):
                message = await _next(receiver)
        except TimeoutError:
            raise FarmUnreachableError(
                f"the Ray cluster at {farm.address!r} accepted a connection, but its farm was not "
                f"ready within {farm.connect_timeout + _START_LIMIT:g} s{_said(stderr)}"
            ) from None
    if message is None:
        with anyio.move_on_after(1):
            await process.wait()
        raise FarmUnreachableError(
            f"cannot connect to the Ray cluster at {farm.address!r}: {_ended(process, stderr)}"
        )
    if message.get("event") in ("failed", "lost"):
        error = message["error"]
        assert isinstance(error, AcompileError)
        raise error
    if message.get("event") != "connected":
        raise FarmUnreachableError(
            f"cannot connect to the Ray cluster at {farm.address!r}: its connection process said "
            f"{bounded(repr(message), 300)}"
        )
    return message


async def _next(receiver: MessageReceiver) -> dict[str, Any] | None:
    """The connection process's next event (a dict), None if it ended (or sent what cannot be
    read: it is ours, so that is as good as its end)."""
    try:
        message = await receiver.receive()
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
        return None
    return message if type(message) is dict else None


async def _keep_stderr(process: anyio.abc.Process, lines: deque[str]) -> None:
    """Keep the last lines the connection process writes to its standard error (read, so that
    it never blocks on a full pipe)."""
    assert process.stderr is not None
    partial = b""
    try:
        async for chunk in process.stderr:
            *complete, partial = (partial + chunk).split(b"\n")
            for line in complete:
                text = line.decode(errors="replace").rstrip()
                if text:
                    lines.append(text)
                    logger.debug("farm connection process: %s", text)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # closed by _stop(), or gone with the process


def _said(stderr: deque[str]) -> str:
    """Ray's last complaints, for an error that would otherwise say only "not in time": a
    cluster that refuses this client (its token authentication, another Ray version) says why
    there, and nowhere else."""
    return f"; Ray said: {bounded(' | '.join(stderr), 1500)}" if stderr else ""


def _ended(process: anyio.abc.Process, stderr: deque[str]) -> str:
    """How the connection process ended, with its last words on standard error."""
    code = process.returncode
    how = (
        "is still running"
        if code is None
        else f"was killed by signal {-code}"
        if code < 0
        else f"exited with status {code}"
    )
    text = f"its connection process (pid {process.pid}) {how}"
    if stderr:
        text += ": " + bounded(" | ".join(stderr), 1500)
    return text


async def _stop(process: anyio.abc.Process, grace: float) -> None:
    """Stop the connection process: its input closed (it leaves on its own: connected, after
    stopping the actors and disconnecting; connecting, at once), and past ``grace`` seconds it
    is told to end everything it started at once (SIGTERM), then its process group is killed (a
    "local" cluster's GCS and raylet are in it)."""
    if process.returncode is None:
        try:
            assert process.stdin is not None
            await process.stdin.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # it ended already
        with anyio.move_on_after(grace):
            await process.wait()
    if process.returncode is None:
        # While it lives, its group's id is its own: nobody else's group can be hit.
        try:
            os.killpg(process.pid, signal.SIGTERM)  # it ends everything it started, at once
        except ProcessLookupError:
            pass
        with anyio.move_on_after(2):
            await process.wait()
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        # It ended first (killed): what it started for "local" (Ray's agents) is still in its
        # group, which lives on, under its id, while any of them does; nothing else can be.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    await process.aclose()


class RemoteExecutor:
    """The farm's executor in the pool's process; implements ``acompile._workers.Executor`` by
    messages to the connection process, where the farm's ``FarmExecutor`` runs. Built by
    ``connect()``; ``serve()`` runs in the pool's task group and stops the connection process on
    the way out. See the module's docstring for what happens when the cluster is lost."""

    def __init__(
        self,
        farm: RayFarm,
        setup: Setup,
        process: anyio.abc.Process,
        receiver: MessageReceiver,
        hello: dict[str, Any],
        stderr: deque[str],
        *,
        local: Executor | None,
        make_local: Callable[[], Executor] | None,
    ) -> None:
        self.farm = farm
        self._setup = setup  # what a connection process is given (a new one, to reconnect)
        self._process = process
        self._receiver = receiver
        self._stderr = stderr
        self._stats: ExecutorStats = hello["stats"]
        self._farm_stats: FarmStats = hello["farm"]
        # The counts of the connections lost before this one (jobs done, workers started...),
        # added to this one's: a pool's counts never go back.
        self._carried: ExecutorStats | None = None
        self._jobs: dict[int, Job] = {}  # sent to the farm, not ended
        self._ran: dict[int, dict[str, Any]] = {}  # where and when a job ran, before its outcome
        self._tokens = itertools.count()
        self._waiting: dict[int, list[Any]] = {}  # wait_ready() calls: [event, error]
        self._frames: list[bytes] = []  # to the connection process, not written yet
        self._written = anyio.Event()  # set when frames wait to be written
        self._lost: FarmUnreachableError | None = None
        self._closed = False
        self._local = local
        self._make_local = make_local
        self._own_local = False  # whether self._local was made (and is served) here
        self._tg: anyio.abc.TaskGroup | None = None
        farm.executor = self

    # -- the caller's side -------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Send ``job`` to the farm; once the farm is lost, give it to local workers (where the
        farm allows it) or raise ``FarmUnreachableError``. Raises ``PoolClosedError`` after
        shutdown."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._lost is not None:
            self._fallback_or_raise().submit(job)
            return
        try:
            payload = pickle.dumps(job.payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            # Something in the request does not serialize: that request fails, nothing else.
            job.finish(
                error=CompileError(
                    f"the farm cannot send {job.name!r}: {type(exc).__name__}: {exc}",
                    kernel=job.name,
                    backend=job.backend.rsplit(".", 1)[-1].lstrip("_"),
                )
            )
            return
        job.state = "queued"
        self._jobs[job.id] = job
        self._send(
            {
                "op": "submit",
                "id": job.id,
                "backend": job.backend,
                "payload": payload,
                "name": job.name,
                "lane": job.lane,
                "expected": job.expected_seconds,
            }
        )

    async def run(self, job: Job) -> Any:
        """Submit ``job`` and return its result, or raise its error; cancelled, the job is
        cancelled where it is."""
        return await run_job(self, job)

    def cancel(self, job: Job) -> None:
        """Nobody waits for ``job``: it is cancelled on the farm (dropped if queued, stopped if
        running) and ends here at once, or where it went after the farm was lost."""
        if self._jobs.pop(job.id, None) is not None:
            self._ran.pop(job.id, None)
            self._send({"op": "cancel", "id": job.id})
            job.finish(error=JobCancelled(job.name))
        elif self._local is not None:
            self._local.cancel(job)

    def promote(self, job: Job) -> None:
        """Move a queued background job to the urgent lane, where it is queued."""
        if job.id in self._jobs:
            self._send({"op": "promote", "id": job.id})
        elif self._local is not None:
            self._local.promote(job)

    def quiesce(self) -> None:
        """Release the farm's actors (and local workers started after the farm was lost)."""
        if self._lost is None:
            self._send({"op": "quiesce"})
        if self._own_local and self._local is not None:
            self._local.quiesce()

    def wakeup(self) -> None:
        """Start the farm's actors (once the farm is lost, the local workers that replace it)."""
        if self._lost is None:
            self._send({"op": "wakeup"})
        elif (local := self._fallback()) is not None:
            local.wakeup()

    async def wait_ready(self) -> None:
        """Wait until every slot of the farm has a preloaded actor; raises what the farm raises
        (``FarmToolchainError``, ``WorkerStartError``), and, once it is lost, waits for the local
        workers that replace it or raises ``FarmUnreachableError``."""
        if self._closed:
            raise PoolClosedError("the pool has shut down; make a new CompilePool")
        if self._lost is None:
            token = next(self._tokens)
            waiting: list[Any] = [anyio.Event(), None]
            self._waiting[token] = waiting
            self._send({"op": "wait_ready", "token": token})
            try:
                await waiting[0].wait()
            finally:
                self._waiting.pop(token, None)
            if waiting[1] is not None:
                raise waiting[1]
            if self._closed:
                raise PoolClosedError("the pool shut down while waiting for the farm")
            if self._lost is None:
                return
        await self._fallback_or_raise().wait_ready()

    def stats(self) -> ExecutorStats:
        """The farm's figures as the connection process last sent them (actors for workers;
        resident memory is not measured on remote nodes), with those of the local workers
        started here after the farm was lost."""
        stats = self._stats if self._carried is None else combined_stats(self._carried, self._stats)
        if self._own_local and self._local is not None:
            return combined_stats(self._local.stats(), stats)
        return stats

    def farm_stats(self) -> FarmStats:
        """What ``RayFarm.stats()`` returns while (and after) this executor serves."""
        stats = dict(self._farm_stats)
        stats["connected"] = bool(stats.get("connected")) and self._lost is None and not self._closed
        return stats  # type: ignore[return-value]

    # -- the connection process ------------------------------------------------------------------

    async def serve(self) -> None:
        """Exchange frames with the connection process until cancelled. When it ends or says the
        cluster is lost, move or fail the farm's jobs (serving the local workers that replace
        it, where the farm allows them), then connect again until a connection holds: new jobs
        go to the farm again from then on. On the way out, stop the connection process."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                while True:
                    async with anyio.create_task_group() as connection:
                        connection.start_soon(self._write)
                        connection.start_soon(_keep_stderr, self._process, self._stderr)
                        error = await self._read()
                        await self._lose(error)
                        connection.cancel_scope.cancel()
                    await self._reconnect()
        finally:
            self._closed = True
            for job in self._jobs.values():
                job.finish(error=PoolClosedError("the pool shut down before this job ran"))
            self._jobs.clear()
            for waiting in self._waiting.values():
                waiting[0].set()
            with anyio.CancelScope(shield=True):
                await _stop(self._process, grace=_LEAVE_LIMIT)

    def _send(self, message: dict[str, Any]) -> None:
        """Queue a frame for the connection process (written by ``_write``, in the pool's task
        group: the callers are not async)."""
        if self._lost is None and not self._closed:
            self._frames.append(encode(message))
            self._written.set()

    async def _write(self) -> None:
        assert self._process.stdin is not None
        while True:
            await self._written.wait()
            self._written = anyio.Event()
            frames, self._frames = self._frames, []
            try:
                await self._process.stdin.send(b"".join(frames))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return  # it ended: the reader tells why

    async def _read(self) -> FarmUnreachableError:
        """Take the connection process's frames until it ends or says the cluster is lost;
        returns the error that says so."""
        while True:
            try:
                # It beats every BEAT_PERIOD seconds: silent this long, it is stopped by a signal
                # or hung, and the farm is as lost as if it had ended.
                with anyio.fail_after(LOST_WITHIN):
                    message = await self._receiver.receive()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                with anyio.move_on_after(1):
                    await self._process.wait()
                return self._unreachable(_ended(self._process, self._stderr))
            except TimeoutError:
                return self._unreachable(
                    f"its connection process (pid {self._process.pid}) has not answered for "
                    f"{LOST_WITHIN:g} s (stopped by a signal, or hung)"
                )
            if type(message) is Done:
                self._finish(message.id, result=message.result)
            elif type(message) is Error:
                self._finish(message.id, error=message.error)
            elif type(message) is dict:
                event = message.get("event")
                if event == "stats":
                    self._stats, self._farm_stats = message["stats"], message["farm"]
                elif event == "ran":
                    self._ran[message["id"]] = message
                elif event == "ready":
                    waiting = self._waiting.get(message["token"])
                    if waiting is not None:
                        waiting[1] = message["error"]
                        waiting[0].set()
                elif event == "lost":
                    error = message["error"]
                    assert isinstance(error, FarmUnreachableError)
                    return error
            else:
                reason = message.error if isinstance(message, Undecodable) else type(message).__name__
                return self._unreachable(f"its connection process sent what the pool cannot read ({reason})")

    def _unreachable(self, what: str) -> FarmUnreachableError:
        return FarmUnreachableError(f"lost the Ray cluster at {self.farm.address!r}: {what}")

    def _finish(self, job_id: int, result: Any = None, error: BaseException | None = None) -> None:
        job = self._jobs.pop(job_id, None)
        ran = self._ran.pop(job_id, None)
        if job is None:
            return  # cancelled here before it ended there
        if ran is not None:
            job.worker_pid = ran["pid"]
            # perf_counter is the machine's monotonic clock on Linux: the same in both processes.
            job.started_at, job.ended_at = ran["started_at"], ran["ended_at"]
            job.seconds, job.paused = ran["seconds"], ran["paused"]
        job.finish(result=result, error=error)

    async def _lose(self, error: FarmUnreachableError) -> None:
        """The farm is gone: its jobs go to local workers or fail, and so will later ones."""
        self._lost = error
        self._stats = _without_workers(self._stats)
        jobs = sorted(self._jobs.values(), key=lambda job: job.id)
        self._jobs.clear()
        self._ran.clear()
        for waiting in self._waiting.values():
            waiting[0].set()
        with anyio.CancelScope(shield=True):
            await _stop(self._process, grace=_ABORT_GRACE)
        local = self._fallback()
        if local is None:
            logger.error("%s; %d farm jobs fail (local_fallback=True would move them)", error, len(jobs))
            for job in jobs:
                job.finish(error=error)
            return
        logger.warning(
            "%s; its %d pending jobs and every later one go to this machine's workers (local_fallback=True)",
            error,
            len(jobs),
        )
        for job in jobs:
            job.state = "new"
            try:
                local.submit(job)
            except AcompileError as exc:
                job.finish(error=exc)

    async def _reconnect(self) -> None:
        """Connect again after the farm was lost: attempts ``_RECONNECT_FIRST`` seconds apart,
        doubling to ``_RECONNECT_MAX``, until a connection process connects; then the farm
        serves new jobs again (jobs moved to local workers meanwhile finish there, and local
        workers started for the outage are quiesced: they wake if work comes back to them).
        Where the address names a host and port, an attempt first checks here that the port
        answers: a connection process costs a second or two of CPU (Python and Ray imported)."""
        lost_at = time.monotonic()
        delay = _RECONNECT_FIRST
        while True:
            await anyio.sleep(delay)
            delay = min(delay * 2, _RECONNECT_MAX)
            if not await _answers(self._setup.address):
                continue
            try:
                connection = await _open(self.farm, self._setup)
            except (AcompileError, OSError) as exc:
                logger.debug(
                    "the Ray cluster at %r does not take a connection yet: %s", self.farm.address, exc
                )
                continue
            break
        self._carried = _carried(self._carried, self._stats)
        self._process, self._receiver, hello, self._stderr = connection
        self._stats, self._farm_stats = hello["stats"], hello["farm"]
        self._lost = None
        if self._own_local and self._local is not None:
            self._local.quiesce()
        logger.warning(
            "connected to the Ray cluster at %r again, %.0f s after it was lost: new jobs go to the farm",
            self.farm.address,
            time.monotonic() - lost_at,
        )

    def _fallback(self) -> Executor | None:
        """The local workers that replace a lost farm (started here at the first need, unless
        the pool has its own); None where the farm allows no fallback."""
        if not self.farm.local_fallback:
            return None
        if self._local is None and self._make_local is not None and self._tg is not None:
            self._local = self._make_local()
            self._own_local = True
            self._tg.start_soon(self._local.serve)
        return self._local

    def _fallback_or_raise(self) -> Executor:
        assert self._lost is not None
        local = self._fallback()
        if local is None:
            raise self._lost
        return local


def _carried(before: ExecutorStats | None, lost: ExecutorStats) -> ExecutorStats:
    """What a lost connection's figures add to the next ones': its counts (workers started and
    restarted, jobs done, failed, cancelled, retried, their durations), with ``before`` (the
    connections lost earlier); none of its slots, workers or jobs in flight (gone with it, or
    moved)."""
    workers = dict(_without_workers(lost)["workers"])
    workers["size"] = 0
    jobs = dict(lost["jobs"])
    jobs.update(queued=0, running=0)
    counts: ExecutorStats = {**lost, "workers": workers, "jobs": jobs}  # type: ignore[typeddict-item]
    return counts if before is None else combined_stats(before, counts)


async def _answers(address: str) -> bool:
    """Whether the head at ``address`` takes a TCP connection, where the address names a host
    and port (``HOST:PORT``, ``ray://HOST:PORT``) and ``RAY_ADDRESS`` does not override it;
    True where it cannot be told here (``auto``, ``local``: the connection process finds out)."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        return True
    if not host or port is None:
        return True
    try:
        with anyio.fail_after(_ANSWER_WITHIN):
            stream = await anyio.connect_tcp(host, port)
    except (OSError, TimeoutError):
        return False
    await stream.aclose()
    return True


def _without_workers(stats: ExecutorStats) -> ExecutorStats:
    """A lost farm's last figures: no actor of it is alive or busy any more."""
    workers = dict(stats["workers"])
    workers.update(alive=0, busy=0, awake=False)
    return {**stats, "workers": workers}  # type: ignore[typeddict-item]
