"""What runs on a farm's nodes: ``FarmWorker``, a Ray actor that owns a local worker pool of one.

The actor does not compile in its own process. It runs acompile's local executor (``WorkerPool``)
with one slot, so a job on a node runs exactly as it runs here: in a worker forked from a
preloaded template, its fd 2 captured (the tail travels back with an error), its compilers in the
worker's process group. That is what makes a farm job cancellable at once (Ray cannot stop an actor
method that runs native code): the driver cancels the actor's asyncio task, the local pool stops
the worker and every compiler it started, and forks a fresh one in milliseconds. The template and
the worker die with the actor (the parent-death signal), however it dies.

It is an async actor: its methods run on the actor's event loop, one job at a time (the driver
sends one), and ``stop()`` is answered meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import anyio

from acompile import _linux
from acompile._cache import logs_dir, toolchain_dir
from acompile._farm import _reaper
from acompile._version import __version__
from acompile._workers import Job, WorkerPool, remove_work_folder, run_job

if TYPE_CHECKING:
    from acompile._workers import BackendConfig, WorkerSettings

# The native backends' payloads carry the parent's compiler command; on a node it is looked up
# again by name (another machine keeps its compilers elsewhere), and its version checked.
_NATIVE_WORKER = "acompile._backends._native_worker"
# How long the reaper's first process may take to fork the reaper and exit (an interpreter's
# start without site-packages: tens of ms).
_REAPER_START = 30.0


class FarmWorker:
    """One compile slot on a node (created by the farm's driver side as a Ray actor).

    ``settings``: the pool's ``WorkerSettings`` (its target, backends, preloaded modules, the
    workers' nice value and limits), as the pool checked them, carried whole.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        from acompile._workers import WorkerSettings

        if not isinstance(settings, WorkerSettings):
            raise TypeError(f"a farm's actor is started with a WorkerSettings, got {type(settings).__name__}")
        self.settings = settings
        self.pool: WorkerPool | None = None
        self.serving: asyncio.Task[None] | None = None
        self.workdir = ""
        self.cache_root = _node_cache_root()
        self.native_versions: dict[str, str] = {}
        self.reaper: IO[bytes] | None = None  # our end of the reaper's pipe

    async def start(self) -> dict[str, Any]:
        """Start the local pool, wait for its worker's preload, and say who we are: the node,
        this process, and the toolchain that enters the cache key here."""
        import ray

        self.workdir = await anyio.to_thread.run_sync(_make_workdir)
        # Before the pool starts any process: each one inherits the mark the reaper looks for.
        self.reaper = await anyio.to_thread.run_sync(_start_reaper)
        # A pool of one, which never quiesces by itself: the farm's executor decides that.
        pool = WorkerPool(1, self.settings.replace(idle_timeout=None), self.workdir)
        memo = toolchain_dir(self.cache_root)
        pool.prepare_config_with(lambda: _worker_config(list(self.settings.backends), memo))
        self.pool = pool
        # The actor's lifetime is the pool's: no task group outlives a method call here, so the
        # pool's serve() runs in a task of its own, cancelled by stop() (or dies with the actor).
        self.serving = asyncio.get_running_loop().create_task(_serve(pool))
        pool.wakeup()
        toolchain = await anyio.to_thread.run_sync(node_toolchain, memo)
        await pool.wait_ready()
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "toolchain": toolchain,
        }

    async def run(self, backend: str, payload: Any, name: str) -> tuple[str, Any]:
        """Run one job; returns ("done", bytes) or ("error", exception).

        The job's error is returned, not raised: Ray would wrap a raised one in its own class,
        with its own message, and the caller must get the very error a local worker gives.
        """
        assert self.pool is not None
        try:
            if backend == _NATIVE_WORKER and isinstance(payload, dict):
                payload = await anyio.to_thread.run_sync(self._localize_native, payload)
            elif isinstance(payload, dict) and payload.get("log_dir"):
                # Where a log too long for an error goes: this node's cache folder (the error
                # says where; the parent's folder may not exist here).
                payload = dict(payload, log_dir=str(logs_dir(self.cache_root)))
            result = await run_job(self.pool, Job(backend, payload, name))
        except Exception as exc:
            return "error", exc
        return "done", result

    async def watch(self) -> None:
        """Never returns: the driver's call fails when this actor dies, which is how an idle
        actor's death is noticed (the driver has no job on it to fail)."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        """Stop the local pool (its worker and template, and their compilers) and remove the
        work folder; the driver kills the actor next."""
        if self.serving is not None:
            self.serving.cancel()
            try:
                await self.serving
            except asyncio.CancelledError:
                pass
        if self.reaper is not None:
            # Its pipe closed, it looks once (the pool left nothing: it finds nothing) and exits.
            pipe, self.reaper = self.reaper, None
            try:
                pipe.close()
            except OSError:
                pass
        if self.workdir:
            await anyio.to_thread.run_sync(remove_work_folder, self.workdir)

    def _localize_native(self, payload: dict[str, Any]) -> dict[str, Any]:
        """This node's compiler for a native job, and a refusal if its version differs from
        the one the key was computed with (its output would be stored under a key it does not
        match)."""
        from acompile._backends import native_tool_version
        from acompile._errors import FarmToolchainError

        kind = payload["kind"]
        payload = dict(payload, log_dir=str(logs_dir(self.cache_root)))
        if kind != "nvrtc":
            found = shutil.which(os.path.basename(payload["command"][0]))
            if found is None:
                raise FarmToolchainError(f"node {socket.gethostname()} has no {payload['command'][0]!r}")
            payload["command"] = [found, *payload["command"][1:]]
        if kind not in self.native_versions:
            self.native_versions[kind] = native_tool_version(kind)
        wanted = payload.get("key_parts", {}).get("compiler")
        if wanted is not None and self.native_versions[kind] != wanted:
            raise FarmToolchainError(
                f"node {socket.gethostname()} compiles {kind} with {self.native_versions[kind]!r}, "
                f"the request was keyed with {wanted!r}"
            )
        return payload


async def _serve(pool: WorkerPool) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.serve)


def _start_reaper() -> IO[bytes]:
    """Mark this process's environment (what the pool starts inherits it) and start the reaper
    that kills whatever carries the mark once this process is gone (see ``_reaper``); returns
    our end of its pipe."""
    mark = uuid.uuid4().hex
    os.environ[_reaper.MARK_VARIABLE] = mark
    env = {k: v for k, v in os.environ.items() if k != _reaper.MARK_VARIABLE}
    # Its stdin is the pipe: our end is close-on-exec, so only this process holds it, and its
    # close (this process's exit, however it happens) is the reaper's signal. A session of its
    # own: a signal to this actor's process group does not reach it.
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", _reaper.__file__, mark, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    process.wait(timeout=_REAPER_START)  # the reaper's first process exits once it has forked
    assert process.stdin is not None
    return process.stdin


def _node_cache_root() -> Path:
    """The node's cache folder (its toolchain memos, compile logs), checked as a pool checks
    its own: this user's alone, or ``UntrustedFolderError``."""
    from acompile._cache import default_cache_dir
    from acompile._trust import own_folder

    return own_folder(default_cache_dir(), "the node's cache folder", resolve=True)


async def _worker_config(backends: list[str], memo: Path) -> BackendConfig:
    """What the local workers need from this process (Triton's key of its binaries), computed
    on this node: its binaries are the ones the workers run."""
    from acompile._backends import load_parent

    extra: BackendConfig = {}
    for name in backends:
        backend = await anyio.to_thread.run_sync(load_parent, name)
        extra.update(await backend.worker_config(memo))
    return extra


def node_toolchain(memo: Path) -> dict[str, Any]:
    """What enters the cache keys of this node's results besides the request: acompile's version
    and Triton's toolchain (its release, its compiler files, ptxas), whether or not Triton is
    preloaded (a pool may send Triton jobs to workers that load it on first use)."""
    from acompile._backends import triton_toolchain

    return {"acompile": __version__, "triton": triton_toolchain(memo)}


def _make_workdir() -> str:
    """A work folder for this actor's pool: a private folder of its own in the node's temporary
    folder, with a name nobody can guess (``WorkerPool.make_workdir``). Not in a folder the
    node's actors share: that one's name is known in advance, another user who made it first
    owns it, and could swap an actor's folder in it for their own (its sockets, its stderr
    files). The folders of this user's actors that are gone (killed, so they never cleaned up)
    are removed on the way: found by name (this user's prefix and a pid no process has), and
    removed only where they are this user's folders, not links (``remove_work_folder``)."""
    prefix = f"acompile-farm-{os.getuid()}-"
    temporary = os.path.realpath(tempfile.gettempdir())
    for name in os.listdir(temporary):
        pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not _linux.pid_alive(int(pid)):
            remove_work_folder(os.path.join(temporary, name))
    return WorkerPool.make_workdir(f"{prefix}{os.getpid()}-")
