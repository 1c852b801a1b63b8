"""The one client of a helper process (``acompile._workers.LinkedExecutor``), under both a farm's
connection and the host's pool, driven here through a link of the tests' own over the pipes of a
real helper process (tests/link_helper.py), as a new executor would hand one in: the helper is
killed and stopped for real, its jobs sent again once, moved to real local workers (the tests'
fake backend) or failed, as the policy says."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import acompile
from acompile._workers import (
    Job,
    JobCancelled,
    LinkedExecutor,
    LinkLost,
    Policy,
    Reply,
    WorkerPool,
    WorkerSettings,
    run_job,
)

pytestmark = pytest.mark.anyio

HELPER = Path(__file__).with_name("link_helper.py")


class PipeLink:
    """A helper's pipes as a ``Link``: a JSON line a request, a JSON line a reply."""

    ready = True  # its one worker is ready as it says hello

    def __init__(self, process: anyio.abc.Process, reader: BufferedByteReceiveStream, hello: dict[str, Any]):
        self.process = process
        self.reader = reader
        self.hello = hello

    @property
    def pid(self) -> int:
        return self.process.pid

    def submit(self, job: Job) -> bytes:
        request = {
            "op": "submit",
            "id": job.id,
            "value": job.payload["value"],
            "seconds": job.payload["seconds"],
        }
        return (json.dumps(request) + "\n").encode()

    def cancel(self, job_id: int) -> bytes:
        return (json.dumps({"op": "cancel", "id": job_id}) + "\n").encode()

    def promote(self, job_id: int) -> None:
        return None

    def quiesce(self) -> None:
        return None

    def wakeup(self) -> None:
        return None

    def wait_ready(self, token: int) -> None:
        return None

    async def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise LinkLost(f"its input is closed ({type(exc).__name__})") from exc

    async def tend(self) -> None:
        await anyio.sleep_forever()

    async def receive(self) -> Reply:
        try:
            line = await self.reader.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            raise LinkLost(f"the helper (pid {self.pid}) ended") from exc
        reply = json.loads(line)
        if reply["kind"] == "done":
            return Reply("done", reply["id"], ["helper", reply["pid"], reply["value"]])
        return Reply("beat")

    async def close(self, grace: float) -> None:
        if self.process.returncode is None:
            self.process.kill()
        with anyio.CancelScope(shield=True):
            await self.process.wait()
            await self.process.aclose()


class Helpers:
    """Opens links to new helper processes, and remembers each one (to kill it, and to end it
    however the test ends)."""

    def __init__(self) -> None:
        self.opened: list[PipeLink] = []

    async def open(self) -> PipeLink:
        process = await anyio.open_process(
            [sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert process.stdout is not None
        reader = BufferedByteReceiveStream(process.stdout)
        hello = json.loads(await reader.receive_until(b"\n", 1 << 20))
        link = PipeLink(process, reader, hello)
        self.opened.append(link)
        return link

    def end(self) -> None:
        for link in self.opened:
            if link.process.returncode is None:
                os.kill(link.pid, signal.SIGCONT)
                link.process.kill()


@pytest.fixture
def helpers() -> Iterator[Helpers]:
    opened = Helpers()
    try:
        yield opened
    finally:
        opened.end()


@contextlib.asynccontextmanager
async def served(executor: LinkedExecutor) -> AsyncIterator[anyio.abc.TaskGroup]:
    """``executor`` served in a task group of its own, cancelled (the executor closed) on the
    way out."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(executor.serve)
        yield tg
        tg.cancel_scope.cancel()


def policy(*, at_once: bool, first: float = 30.0, silence: float = 5.0) -> Policy:
    return Policy(silence=silence, at_once=at_once, first=first, most=60.0, close_grace=1.0, abort_grace=1.0)


def job(value: int, seconds: float = 0.0) -> Job:
    """A job both a helper and the tests' fake backend on a local worker run: it gives back
    its value after its seconds (a helper's reply says it came from the helper, and which one)."""
    return Job(
        "fake_backend",
        {"name": f"j{value}", "action": "sleep", "value": value, "seconds": seconds},
        f"j{value}",
    )


def local_workers(tmp_path: Path) -> WorkerPool:
    folder = tmp_path / "work"
    folder.mkdir(mode=0o700, exist_ok=True)
    return WorkerPool(1, WorkerSettings(nice=0, fork_workers=False), str(folder))


async def _kill_after(seconds: float, link: PipeLink, sig: int = signal.SIGKILL) -> None:
    await anyio.sleep(seconds)
    os.kill(link.pid, sig)


async def test_a_helper_lost_mid_job_is_started_again_at_once_and_the_job_sent_again(
    tmp_path: Path, helpers: Helpers
) -> None:
    first = await helpers.open()
    executor = LinkedExecutor(first, helpers.open, policy(at_once=True), acompile.PoolError)
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.3, first)
        with anyio.fail_after(20):
            where, pid, value = await run_job(executor, job(7, seconds=1.0))
        assert (where, value) == ("helper", 7) and pid == helpers.opened[1].pid != first.pid
        assert len(helpers.opened) == 2
        stats = executor.stats()["jobs"]
        assert (stats["retried"], stats["done"], stats["failed"], stats["running"]) == (1, 1, 0, 0)
    assert all(link.process.returncode is not None for link in helpers.opened)  # closed on the way out


async def test_a_job_whose_helper_is_lost_twice_goes_to_local_workers(
    tmp_path: Path, helpers: Helpers
) -> None:
    # Sent again once; lost a second time, it is not sent a third time: this machine runs it.
    local = local_workers(tmp_path)
    first = await helpers.open()
    executor = LinkedExecutor(
        first, helpers.open, policy(at_once=True), acompile.PoolError, make_local=lambda: local
    )

    async def kill_both() -> None:
        await _kill_after(0.3, first)
        with anyio.fail_after(10):
            while len(helpers.opened) < 2:  # noqa: ASYNC110 (the executor opens it)
                await anyio.sleep(0.02)
        await _kill_after(0.3, helpers.opened[1])

    async with served(executor) as tg:
        tg.start_soon(kill_both)
        with anyio.fail_after(30):
            assert await run_job(executor, job(8, seconds=1.5)) == 8  # the local worker's echo
        assert local.stats()["jobs"]["done"] == 1
        # The executor connected again at once after the second loss: new jobs go there.
        with anyio.fail_after(20):
            assert (await run_job(executor, job(9)))[0] == "helper"
        assert len(helpers.opened) == 3


async def test_without_a_connection_at_once_jobs_move_to_local_workers_until_one_holds_again(
    tmp_path: Path, helpers: Helpers
) -> None:
    # The farm's policy: a loss sends the jobs in flight to local workers at once, and later
    # jobs too, until a new connection holds (first tried after policy.first seconds).
    local = local_workers(tmp_path)
    first = await helpers.open()
    executor = LinkedExecutor(
        first,
        helpers.open,
        policy(at_once=False, first=4.0),
        acompile.PoolError,
        make_local=lambda: local,
    )
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.3, first)
        with anyio.fail_after(30):
            assert await run_job(executor, job(1, seconds=1.0)) == 1  # moved here
            assert executor.lost is not None and len(helpers.opened) == 1
            assert await run_job(executor, job(2)) == 2  # while lost: here too
            while executor.lost is not None:  # noqa: ASYNC110 (its reconnect runs apart)
                await anyio.sleep(0.05)
            assert (await run_job(executor, job(3)))[0] == "helper"
        assert len(helpers.opened) == 2


async def test_without_a_fallback_a_lost_helper_fails_its_jobs_with_what_happened(
    tmp_path: Path, helpers: Helpers
) -> None:
    first = await helpers.open()
    executor = LinkedExecutor(first, helpers.open, policy(at_once=False), acompile.PoolError, fallback=False)
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.3, first)
        with (
            anyio.fail_after(20),
            pytest.raises(acompile.PoolError, match=rf"the helper \(pid {first.pid}\) ended"),
        ):
            await run_job(executor, job(4, seconds=2.0))
        with pytest.raises(acompile.PoolError, match="ended"):
            executor.submit(job(5))  # and so do later ones, until a connection holds
        assert executor.stats()["jobs"]["failed"] == 1


async def test_a_helper_that_stops_answering_is_lost_after_its_silence(
    tmp_path: Path, helpers: Helpers
) -> None:
    # Stopped by a signal, its pipes stay open: only its silence tells.
    first = await helpers.open()
    executor = LinkedExecutor(first, helpers.open, policy(at_once=True, silence=1.0), acompile.PoolError)
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.2, first, signal.SIGSTOP)
        with anyio.fail_after(20):
            where, pid, value = await run_job(executor, job(6, seconds=0.5))
        assert (where, value) == ("helper", 6) and pid != first.pid


async def test_a_job_cancelled_in_flight_is_cancelled_there_and_ends_here_at_once(
    tmp_path: Path, helpers: Helpers
) -> None:
    first = await helpers.open()
    executor = LinkedExecutor(first, helpers.open, policy(at_once=True), acompile.PoolError)
    async with served(executor):
        slow = job(10, seconds=30.0)
        executor.submit(slow)
        await anyio.sleep(0.2)
        executor.cancel(slow)
        with anyio.fail_after(1), pytest.raises(JobCancelled):
            await slow.outcome()
        stats = executor.stats()["jobs"]
        assert (stats["cancelled"], stats["running"]) == (1, 0)
    # Shut down with a job in flight: it fails with the pool's closing, counted out.
    assert executor.stats()["jobs"]["running"] == 0


class SlowHelpers(Helpers):
    """Helpers whose second and later opens take ``delay`` seconds (a server slow to start)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def open(self) -> PipeLink:
        if self.opened:
            await anyio.sleep(self.delay)
        return await super().open()


async def test_leaving_while_a_lost_helper_is_replaced_ends_its_jobs(tmp_path: Path) -> None:
    # The jobs of a lost helper, on their way to the next one, end with the pool (they were
    # dropped: a caller waited for ever, and "running" stayed 1).
    helpers = SlowHelpers(delay=30.0)
    try:
        first = await helpers.open()
        executor = LinkedExecutor(first, helpers.open, policy(at_once=True), acompile.PoolError)
        slow = job(11, seconds=5.0)
        async with served(executor) as tg:
            executor.submit(slow)
            tg.start_soon(_kill_after, 0.3, first)
            await anyio.sleep(1.0)  # lost; the new helper takes 30 s to come
        with anyio.fail_after(2), pytest.raises(acompile.PoolClosedError):
            await slow.outcome()
        assert executor.stats()["jobs"]["running"] == 0
    finally:
        helpers.end()


async def test_a_caller_that_leaves_while_its_helper_is_replaced_cancels_its_job(tmp_path: Path) -> None:
    # Cancelled on its way to the next helper, it goes nowhere (it was sent again, and ran with
    # nobody waiting, counted done).
    helpers = SlowHelpers(delay=1.0)
    try:
        first = await helpers.open()
        executor = LinkedExecutor(first, helpers.open, policy(at_once=True), acompile.PoolError)
        slow = job(12, seconds=1.0)
        async with served(executor) as tg:
            tg.start_soon(_kill_after, 0.3, first)
            with anyio.move_on_after(0.6):
                await run_job(executor, slow)
            assert isinstance(slow.error, JobCancelled)
            await anyio.sleep(2.5)  # the new helper is up: nothing of the job reached it
            stats = executor.stats()["jobs"]
            assert (stats["cancelled"], stats["done"], stats["running"], stats["retried"]) == (1, 0, 0, 0), (
                stats
            )
            tg.cancel_scope.cancel()
    finally:
        helpers.end()


async def test_frames_written_for_a_lost_helper_never_reach_the_next(
    tmp_path: Path, helpers: Helpers
) -> None:
    # Stopped with its input full, a helper leaves frames queued here: sent to its successor,
    # they ran jobs twice (once as frames, once sent again).
    runs: dict[int, int] = {}
    opened = helpers.open

    async def counting() -> PipeLink:
        link = await opened()
        receive = link.receive

        async def counted() -> Reply:
            reply = await receive()
            if reply.kind == "done" and len(helpers.opened) > 1 and link is helpers.opened[-1]:
                runs[reply.id] = runs.get(reply.id, 0) + 1
            return reply

        link.receive = counted  # type: ignore[method-assign]
        return link

    first = await counting()
    executor = LinkedExecutor(first, counting, policy(at_once=True, silence=2.0), acompile.PoolError)
    async with served(executor):
        os.kill(first.pid, signal.SIGSTOP)
        jobs = [
            Job("fake_backend", {"name": f"b{i}", "value": "x" * 20_000, "seconds": 0.0}, f"b{i}")
            for i in range(20)
        ]
        for each in jobs:
            executor.submit(each)
            await anyio.sleep(0.01)  # one write at a time: the first fills the pipe, the others wait
        with anyio.fail_after(30):
            for each in jobs:
                await each.outcome()
        await anyio.sleep(1.0)  # what else the new helper was sent, it has answered by now
    assert runs and max(runs.values()) == 1, runs


async def test_a_helper_back_lets_the_local_workers_finish_what_moved_to_them(
    tmp_path: Path, helpers: Helpers
) -> None:
    # Quiesced as the helper came back, the fallback killed its running job and ran it again.
    local = local_workers(tmp_path)
    first = await helpers.open()
    executor = LinkedExecutor(
        first, helpers.open, policy(at_once=False, first=0.5), acompile.PoolError, make_local=lambda: local
    )
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.3, first)
        with anyio.fail_after(30):
            assert await run_job(executor, job(13, seconds=3.0)) == 13  # on the local worker
        assert executor.lost is None  # back meanwhile
        assert local.stats()["workers"]["restarts"] == {}, local.stats()["workers"]


async def test_a_helper_that_reported_jobs_in_flight_counts_none_once_lost(
    tmp_path: Path, helpers: Helpers
) -> None:
    # A helper that reports its own figures (a farm's executor): lost, its last queued and
    # running counts are no one's (they stayed for good). Done and failed are the jobs this
    # process saw end (none here: its report of 5 done is of no job sent from here), never the
    # helper's last word (a farm's head lost said 0 failed for 56 jobs failed here).
    from acompile._workers import idle_stats

    first = await helpers.open()
    reported = idle_stats(1)
    reported["jobs"].update(queued=2, running=1, done=5)
    first.hello = {**first.hello, "stats": reported}
    executor = LinkedExecutor(first, helpers.open, policy(at_once=False), acompile.PoolError, fallback=False)
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.1, first)
        with anyio.fail_after(10):
            while executor.lost is None:  # noqa: ASYNC110 (its reader sees the end)
                await anyio.sleep(0.05)
        jobs = executor.stats()["jobs"]
        assert (jobs["queued"], jobs["running"], jobs["done"]) == (0, 0, 0), jobs


async def test_an_opener_that_fails_in_any_way_is_no_connection_yet(tmp_path: Path, helpers: Helpers) -> None:
    # An error the opener did not expect (a server that closed during its hello) ended the pool.
    local = local_workers(tmp_path)
    first = await helpers.open()

    async def broken() -> PipeLink:
        raise anyio.BrokenResourceError

    executor = LinkedExecutor(
        first, broken, policy(at_once=True), acompile.PoolError, make_local=lambda: local
    )
    async with served(executor) as tg:
        tg.start_soon(_kill_after, 0.3, first)
        with anyio.fail_after(30):
            assert await run_job(executor, job(14, seconds=1.0)) == 14  # moved to the local worker
            assert await run_job(executor, job(15)) == 15
        tg.cancel_scope.cancel()
