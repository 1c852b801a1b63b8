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
import logging
import os
import pickle
import signal
import subprocess
import sys
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
    bounded,
)
from acompile._farm._broker import LOST_AFTER, LOST_WITHIN
from acompile._farm._farm import Setup
from acompile._workers import (
    DEFAULT_NICE,
    Executor,
    Job,
    LinkedExecutor,
    LinkLost,
    MessageReceiver,
    Policy,
    Reply,
    Undecodable,
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

    # On the farm's nodes compiling is the job, on CPUs Ray reserved for it: the idle policy and
    # the default nice value protect this process's event loop, which is not there.
    on_nodes = settings.replace(nice=0) if settings.nice in ("idle", DEFAULT_NICE) else settings
    try:
        executor = await connect(
            farm, on_nodes, opening.memo_dir, local=opening.fallback, make_local=make_local
        )
    except FarmUnreachableError as exc:
        if not farm.local_fallback:
            raise
        logger.warning("%s; compiling on this machine's workers instead (local_fallback=True)", exc)
        return opening.fallback_or_local(settings)
    # Its connection process stops with serve(); where that never runs (the pool's entry failed
    # after this), with the pool's exit.
    opening.stack.push_async_callback(executor.aclose)
    return executor


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
    return RemoteExecutor(farm, setup, connection, local=local, make_local=make_local)


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


class _PipeLink:
    """A connection process as the farm's ``Link`` (``acompile._workers.LinkedExecutor``):
    frames over its pipes, its standard error kept for the message that says why it ended."""

    ready = False  # the farm says when it is ready to each wait, by its token

    def __init__(self, connection: _Connection) -> None:
        self.process, self.receiver, self.hello, self.stderr = connection

    def submit(self, job: Job) -> bytes:
        try:
            payload = pickle.dumps(job.payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise CompileError(
                f"the farm cannot send {job.name!r}: {type(exc).__name__}: {exc}",
                kernel=job.name,
                backend=job.backend.rsplit(".", 1)[-1].lstrip("_"),
            ) from exc
        return encode(
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

    def cancel(self, job_id: int) -> bytes:
        return encode({"op": "cancel", "id": job_id})

    def promote(self, job_id: int) -> bytes:
        return encode({"op": "promote", "id": job_id})

    def quiesce(self) -> bytes:
        return encode({"op": "quiesce"})

    def wakeup(self) -> bytes:
        return encode({"op": "wakeup"})

    def wait_ready(self, token: int) -> bytes:
        return encode({"op": "wait_ready", "token": token})

    async def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise LinkLost("its connection process does not take frames") from exc

    async def tend(self) -> None:
        await _keep_stderr(self.process, self.stderr)
        await anyio.sleep_forever()

    async def receive(self) -> Reply:
        try:
            message = await self.receiver.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            with anyio.move_on_after(1):
                await self.process.wait()
            raise LinkLost(_ended(self.process, self.stderr)) from None
        if type(message) is Done:
            return Reply("done", message.id, message.result)
        if type(message) is Error:
            return Reply("error", message.id, message.error)
        if type(message) is dict:
            event = message.get("event")
            if event == "stats":
                return Reply("stats", value=message["stats"], extra=message["farm"])
            if event == "ran":
                return Reply("ran", message["id"], message)
            if event == "ready":
                return Reply("ready", message["token"], message["error"])
            if event == "lost":
                error = message["error"]
                assert isinstance(error, FarmUnreachableError)
                return Reply("lost", value=error)
            return Reply("beat")
        reason = message.error if isinstance(message, Undecodable) else type(message).__name__
        raise LinkLost(f"its connection process sent what the pool cannot read ({reason})")

    async def close(self, grace: float) -> None:
        await _stop(self.process, grace=grace)


class RemoteExecutor(LinkedExecutor):
    """The farm's executor in the pool's process: a ``LinkedExecutor`` over the connection
    process's pipes, where the farm's ``FarmExecutor`` runs. Built by ``connect()``; ``serve()``
    runs in the pool's task group and stops the connection process on the way out. See the
    module's docstring for what happens when the cluster is lost."""

    def __init__(
        self,
        farm: RayFarm,
        setup: Setup,
        connection: _Connection,
        *,
        local: Executor | None,
        make_local: Callable[[], Executor] | None,
    ) -> None:
        self.farm = farm
        self._setup = setup  # what a connection process is given (a new one, to reconnect)
        link = _PipeLink(connection)
        self._farm_stats: FarmStats = link.hello["farm"]
        super().__init__(
            link,
            self._connect_again_to_farm,
            _POLICY,
            self._unreachable,
            local=local,
            make_local=make_local,
            fallback=farm.local_fallback,
        )
        farm.executor = self

    def farm_stats(self) -> FarmStats:
        """What ``RayFarm.stats()`` returns while (and after) this executor serves."""
        stats = dict(self._farm_stats)
        stats["connected"] = bool(stats.get("connected")) and self.lost is None and not self._closed
        if not stats["connected"]:
            stats["queued"] = 0  # the connection process's last word: its queue went with it
        return stats  # type: ignore[return-value]

    def on_stats(self, reply: Reply) -> None:
        self._farm_stats = reply.extra

    def _unreachable(self, what: str) -> FarmUnreachableError:
        return FarmUnreachableError(f"lost the Ray cluster at {self.farm.address!r}: {what}")

    async def _connect_again_to_farm(self) -> _PipeLink | None:
        """A new connection process, where the head's port answers (where the address names
        one): a connection process costs a second or two of CPU (Python and Ray imported)."""
        if not await _answers(self._setup.address):
            return None
        link = _PipeLink(await _open(self.farm, self._setup))
        self._farm_stats = link.hello["farm"]
        return link


# The farm's connection as a LinkedExecutor meets a loss: the connection process beats every
# BEAT_PERIOD (silent for LOST_WITHIN, it is stopped or hung); a lost cluster's jobs go to local
# workers (or fail) at once, and a new connection is tried after 2 s, then at doubling intervals
# up to a minute (a head coming back takes its time; each attempt costs a process).
_POLICY = Policy(
    silence=LOST_WITHIN,
    at_once=False,
    first=_RECONNECT_FIRST,
    most=_RECONNECT_MAX,
    close_grace=_LEAVE_LIMIT,
    abort_grace=_ABORT_GRACE,
)


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
