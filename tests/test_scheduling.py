"""Scheduling: which job a free worker runs next, how soon the first can run, and the cost model
that says how long a compile will take.

Real worker processes and real compiles (Triton for ``cuda:90``, no GPU needed); the fake backend
where a test must decide when a job ends.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from conftest import asyncio_only
from fake_backend import local_executor
from kernels_for_tests import ADD_SIG, add_kernel, scale_add_kernel
from processes import forked_and_fresh, until
from slow_start_backend import SLOW_START

import acompile
from acompile._backends import load_parent
from acompile._cache import COSTS_FILE, COSTS_MAX_RECORDS, CompileCosts, CostFeatures, GuardedDisk
from acompile._workers import BACKGROUND, URGENT, Job, WorkerPool, WorkerSettings

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"


def features(
    key: str, family: str = "family", size: int = 1000, warps: int = 4, stages: int = 3
) -> CostFeatures:
    return CostFeatures(key=key, family=family, size=size, num_warps=warps, num_stages=stages)


async def test_a_free_worker_runs_urgent_work_longest_first_then_background_longest_first(
    cache_dir: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    order: list[str] = []
    queued = [  # (name, lane, expected seconds), in the order they are submitted
        ("urgent-short", URGENT, 0.1),
        ("background-long", BACKGROUND, 9.0),
        ("urgent-long", URGENT, 5.0),
        ("background-short", BACKGROUND, 0.2),
        ("urgent-unknown", URGENT, 0.0),
        ("urgent-mid", URGENT, 1.0),
    ]
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
        await p.wait_ready()
        executor = local_executor(p)

        async def run(name: str, lane: int, expected: float) -> None:
            await executor.run(
                Job(FAKE, {"name": name, "action": "echo", "value": name}, name, lane, expected)
            )
            order.append(name)

        async with anyio.create_task_group() as tg:
            hold = Job(FAKE, {"name": "hold", "action": "hold", "until": str(release)}, "hold")
            tg.start_soon(executor.run, hold)
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            for i, job in enumerate(queued):
                tg.start_soon(run, *job)
                await until(lambda i=i: p.stats()["jobs"]["queued"] == i + 1)
            release.touch()
    assert order == [
        "urgent-long",
        "urgent-mid",
        "urgent-short",
        "urgent-unknown",
        "background-long",
        "background-short",
    ]


async def test_a_job_put_back_runs_before_longer_ones(cache_dir: Path, tmp_path: Path) -> None:
    """A job whose worker was quiesced keeps its turn: it goes back ahead of its lane."""
    release = tmp_path / "release"
    order: list[str] = []
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
        await p.wait_ready()
        executor = local_executor(p)

        async def run(name: str, action: str, expected: float) -> None:
            payload = {"name": name, "action": action, "until": str(release), "value": name}
            await executor.run(Job(FAKE, payload, name, URGENT, expected))
            order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "running", "hold", 0.1)
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            tg.start_soon(run, "longer", "echo", 10.0)
            await until(lambda: p.stats()["jobs"]["queued"] == 1)
            await p.quiesce()
            release.touch()
            await p.wait_ready()
    assert order == ["running", "longer"]


async def test_a_background_compile_a_caller_joins_before_it_is_queued_runs_urgent(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller who waits for a compile started in the background joins it while its expected
    time is still being read (a slow cache folder): the compile is queued urgent, and runs
    before the warm-up work queued ahead of it."""
    release, release_warm_up = tmp_path / "release", tmp_path / "release-warm-up"
    done: list[str] = []
    reading, read = anyio.Event(), anyio.Event()
    expect = CompileCosts.expect

    async def slow_expect(self: CompileCosts, f: CostFeatures) -> float:
        reading.set()
        await read.wait()
        return await expect(self, f)

    monkeypatch.setattr(CompileCosts, "expect", slow_expect)
    prepared: list[object] = []
    cpp = load_parent("cpp")
    prepare = cpp.prepare

    async def counted_prepare(*args: Any) -> Any:
        request = await prepare(*args)
        prepared.append(request)  # the caller joins (or starts) the flight without waiting again
        return request

    monkeypatch.setattr(cpp, "prepare", counted_prepare)
    spec = acompile.CppSpec('extern "C" int answer() { return 42; }')
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=()) as p:
        await p.wait_ready()
        executor = local_executor(p)

        async def hold(name: str, until_file: Path, lane: int, expected: float) -> None:
            payload = {"name": name, "action": "hold", "until": str(until_file)}
            await executor.run(Job(FAKE, payload, name, lane, expected))
            done.append(name)

        async def compile(background: bool) -> None:
            await p.compile(spec, background=background)
            done.append("background compile" if background else "waited-for compile")

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold, "running", release, URGENT, 0.0)
            await until(lambda: p.stats()["jobs"]["running"] == 1)
            tg.start_soon(hold, "warm-up", release_warm_up, BACKGROUND, 100.0)
            await until(lambda: p.stats()["jobs"]["queued"] == 1)
            tg.start_soon(compile, True)
            await reading.wait()
            tg.start_soon(compile, False)
            await until(lambda: len(prepared) == 2)
            read.set()
            await until(lambda: p.stats()["jobs"]["queued"] == 2)
            release.touch()
            # Behind the warm-up, the compile would wait for it: here, the warm-up is held.
            await until(lambda: "waited-for compile" in done, seconds=30)
            release_warm_up.touch()
    assert done[0] == "running" and done[-1] == "warm-up", done


@forked_and_fresh
async def test_workers_preload_while_the_parent_prepares_their_configuration(
    tmp_path: Path, fork_workers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the parent computes for the workers (Triton's hash of its binaries, 0.4-0.8 s the
    first time on a machine) must not come before their preload: a template preloads while it
    runs. Each worker gets the result: with its configuration, or, started before the result
    was there, from the pool's late configuration when a job needs it."""
    markers = tmp_path / "markers"
    markers.mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("ACOMPILE_TEST_MARKER_DIR", str(markers))
    settings = WorkerSettings(preload=("preload_marker_backend",), nice=0, fork_workers=fork_workers)
    workers = WorkerPool(2, settings, str(tmp_path / "work"))

    async def hook() -> dict[str, Any]:
        if fork_workers:  # the template's preload must not wait for this
            with anyio.fail_after(30):
                while not any(markers.iterdir()):  # noqa: ASYNC110 (polls the file system)
                    await anyio.sleep(0.01)
        return {"from_hook": "prepared"}

    workers.prepare_config_with(hook)
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        workers.wakeup()
        with anyio.fail_after(60):
            said = [await workers.run(Job("preload_marker_backend", None, f"j{i}")) for i in range(4)]
            await workers.wait_ready()
        tg.cancel_scope.cancel()
    assert said == ["prepared"] * 4


@forked_and_fresh
async def test_a_configuration_that_never_comes_does_not_hold_the_workers(
    tmp_path: Path, fork_workers: bool
) -> None:
    """What the parent prepares for the workers (Triton's hash of its binaries) hangs, on a
    stalled file system say: workers start and run jobs without it (a job that needs it reads it
    when the pool gives up on it, past preload_timeout, and computes it then)."""
    settings = WorkerSettings(nice=0, fork_workers=fork_workers, preload_timeout=60.0)
    workers = WorkerPool(2, settings, str(tmp_path))

    async def hook() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    workers.prepare_config_with(hook)
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        workers.wakeup()
        with anyio.fail_after(30):
            assert await workers.run(Job(FAKE, {"name": "j", "action": "echo", "value": 3}, "j")) == 3
        tg.cancel_scope.cancel()


# asyncio only: the subject is the time limit's arithmetic (13 s of waits in each run), not the
# loop; a wait's messages cross uvloop's pipes in test_triton's wait for the parent's key.
@asyncio_only
@forked_and_fresh
async def test_a_wait_that_is_not_the_jobs_work_counts_neither_against_its_time_limit_nor_as_its_time(
    tmp_path: Path, fork_workers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker waits inside a job for something that is not the job's work (the pool's late
    configuration, Triton's hash of its binaries which the pool could not hand it): the job's
    time limit does not count the wait, nor does the compile time the pool remembers for the
    kernel; nested waits count once; a wait that never ends still meets the limit, once it has
    lasted as long as preloading may; a wait in a thread the job left running tells the pool
    nothing (its message would come after the job's reply)."""
    settings = WorkerSettings(nice=0, fork_workers=fork_workers, max_compile_seconds=1.0, preload_timeout=3.0)
    workers = WorkerPool(1, settings, str(tmp_path))
    checks = []
    # Each worker's time-limit timer (a method of the runner that serves the worker's slot).
    from acompile._workers._pool import LocalRunner

    own_check = LocalRunner._check_deadline

    def check_deadline(runner: LocalRunner) -> None:
        checks.append(time.perf_counter())
        own_check(runner)

    monkeypatch.setattr(LocalRunner, "_check_deadline", check_deadline)
    never = str(tmp_path / "never.json")
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        workers.wakeup()
        with anyio.fail_after(60):
            assert await workers.run(Job(FAKE, {"name": "w", "action": "echo", "value": 0}, "w")) == 0
        cases = [
            {"action": "pause", "wait_s": 2.0, "work_s": 0.3},
            {"action": "pause", "wait_s": 1.5, "work_s": 0.3, "nested": True},
            {"action": "pause", "before_s": 0.7, "wait_s": 1.5},
            # A backend reading the pool's late configuration as the contract says.
            {"action": "late", "config": {"late_config": never, "late_config_timeout": 2.0}, "work_s": 0.3},
        ]
        for payload in cases:
            job = Job(FAKE, {"name": "j", **payload}, "j")
            checks.clear()
            with anyio.fail_after(60):
                await workers.run(job)
            assert 0.25 <= job.seconds < 1.0, (payload, job.seconds)
            # The time limit's timer waits out a pause instead of looking again and again.
            assert len(checks) <= 3, (payload, len(checks))
        with anyio.fail_after(60):
            pid = await workers.run(Job(FAKE, {"name": "t", "action": "pause_elsewhere", "wait_s": 0.3}, "t"))
            # The next job runs while the thread's wait ends; its worker is still the one:
            # nothing came from it out of turn.
            next_job = {"name": "n", "action": "sleep", "seconds": 0.6, "pid": True}
            assert await workers.run(Job(FAKE, next_job, "n")) == pid
        hung = Job(FAKE, {"name": "hung", "action": "pause", "wait_s": 600}, "hung")
        t0 = time.perf_counter()
        with anyio.fail_after(60), pytest.raises(acompile.CompileTimeoutError):
            await workers.run(hung)
        assert 3.9 <= time.perf_counter() - t0 < 30
        assert await workers.run(Job(FAKE, {"name": "k", "action": "echo", "value": 1}, "k")) == 1
        tg.cancel_scope.cancel()


@forked_and_fresh
async def test_a_worker_started_after_the_configuration_failed_does_not_wait_for_it(
    tmp_path: Path, fork_workers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the parent prepares for the workers failed, and its file could not be written
    either: a worker started afterwards (a replacement) computes what it needs at once instead
    of waiting late_config_timeout for a file that will never come."""
    import signal

    settings = WorkerSettings(nice=0, fork_workers=fork_workers, preload_timeout=20.0)
    workers = WorkerPool(1, settings, str(tmp_path))

    first_ran = anyio.Event()

    async def hook() -> dict[str, Any]:
        await first_ran.wait()  # over after the template and the first worker started
        raise RuntimeError("no key here")

    def unwritable(path: str, prepared: dict[str, Any]) -> None:
        raise OSError(30, "Read-only file system")

    workers.prepare_config_with(hook)
    monkeypatch.setattr(workers.runners, "_write_late_config", unwritable)
    assert workers.config["late_config_timeout"] == 10
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        workers.wakeup()
        with anyio.fail_after(60):
            first = await workers.run(Job(FAKE, {"name": "p", "action": "pid"}, "p"))
        first_ran.set()
        await until(lambda: workers.config["late_config"] == "")
        os.kill(first, signal.SIGKILL)
        t0 = time.perf_counter()
        with anyio.fail_after(60):
            assert await workers.run(Job(FAKE, {"name": "l", "action": "late"}, "l")) == {}
        assert time.perf_counter() - t0 < 5
        tg.cancel_scope.cancel()


def test_a_late_configuration_that_is_not_the_pools_reads_as_none_at_once(tmp_path: Path) -> None:
    """What a worker reads as the pool's late configuration: the JSON object the pool wrote;
    anything else in its place (a FIFO, a folder, garbage, a list) reads at once as nothing, and
    so does a file that never comes, after the configuration's wait."""
    from acompile._workers import late_config

    path = tmp_path / "late-config.json"
    config = {"late_config": str(path), "late_config_timeout": 0.3}
    assert late_config(config, wait=False) is None
    t0 = time.monotonic()
    assert late_config(config, wait=True) == {}
    assert 0.3 <= time.monotonic() - t0 < 5
    os.mkfifo(path)
    assert late_config(config, wait=True) == {}  # would block in open() without O_NONBLOCK
    path.unlink()
    path.mkdir()
    assert late_config(config, wait=True) == {}
    path.rmdir()
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        assert late_config(config, wait=True) == {}
    path.write_text('{"triton_key": "k"}')
    assert late_config(config, wait=False) == {"triton_key": "k"}
    assert late_config({}, wait=True) == {}


@forked_and_fresh
async def test_the_first_worker_takes_jobs_while_the_others_start(tmp_path: Path, fork_workers: bool) -> None:
    settings = WorkerSettings(preload=("slow_start_backend",), nice=0, fork_workers=fork_workers)
    workers = WorkerPool(3, settings, str(tmp_path))
    async with anyio.create_task_group() as tg:
        tg.start_soon(workers.serve)
        t0 = time.monotonic()
        workers.wakeup()
        pids = [await workers.run(Job(FAKE, {"name": f"j{i}", "action": "pid"}, f"j{i}")) for i in range(3)]
        first_jobs = time.monotonic() - t0
        ready_then = workers.stats()["workers"]["started"]
        await workers.wait_ready()
        tg.cancel_scope.cancel()
    assert ready_then == 1, "the slow workers should still be starting"
    assert first_jobs < SLOW_START, f"the jobs waited {first_jobs:.1f} s for every worker to start"
    assert len(set(pids)) == 1  # all on the one worker that was ready


async def test_compile_times_are_remembered_in_the_cache_folder_for_the_next_pool(cache_dir: Path) -> None:
    specs = [
        acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 128}),
        acompile.TritonSpec(scale_add_kernel, ADD_SIG, {"BLOCK": 64}, num_warps=2),
    ]
    async with acompile.CompilePool(2, target="cuda:90", cache_dir=cache_dir) as p:
        kernels = await p.gather(*specs)
    document = json.loads((cache_dir / COSTS_FILE).read_text())
    recorded = document["records"]
    assert {k.key[:16] for k in kernels} == set(recorded)
    assert all(0 < row[0] < 60 for row in recorded.values())

    # The next pool (another process would do the same) expects what was measured, and adds to it.
    shutil.rmtree(cache_dir / "v1")
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir) as p:
        costs = CompileCosts(GuardedDisk(cache_dir))
        for kernel in kernels:
            row = recorded[kernel.key[:16]]
            assert await costs.expect(features(kernel.key[:16])) == pytest.approx(row[0], abs=1e-3)
        await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 512})
    assert len(json.loads((cache_dir / COSTS_FILE).read_text())["records"]) == 3


async def test_unknown_kernels_are_guessed_from_the_same_kernel_then_from_their_size(tmp_path: Path) -> None:
    disk = GuardedDisk(tmp_path)
    await disk.open()
    costs = CompileCosts(disk)
    unknown_small, unknown_big = features("a", "f1", size=500), features("b", "f2", size=20000)
    assert await costs.expect(unknown_big) > await costs.expect(unknown_small) > 0
    costs.record(features("m1", "matmul", stages=3), 2.0)
    costs.record(features("s1", "softmax", stages=1), 0.1)
    # The same kernel with other options: its family's time, scaled by the options.
    more_stages = await costs.expect(features("m2", "matmul", stages=5))
    assert more_stages > 2.0
    assert await costs.expect(features("m3", "matmul", stages=3)) == pytest.approx(2.0)
    # A kernel never seen, as heavy as both: between them, from what was measured here.
    assert 0.1 < await costs.expect(features("x", "new", stages=2)) < 2.0


async def test_a_damaged_cost_file_is_ignored_and_replaced(tmp_path: Path) -> None:
    disk = GuardedDisk(tmp_path)
    await disk.open()
    path = tmp_path / COSTS_FILE
    for damage in (
        b"\x00\xff not json",
        b'{"format": 1, "records": [1, 2]}',
        b'{"format": 1, "records": {"k": "x"}}',
    ):
        path.write_bytes(damage)
        costs = CompileCosts(disk)
        guess = await costs.expect(features("k"))
        assert guess == await CompileCosts(disk).expect(features("k"))  # the prior: nothing read
        assert costs.record(features("k"), 1.5)
        await costs.save()
        assert await CompileCosts(disk).expect(features("k")) == pytest.approx(1.5)


async def test_processes_sharing_a_cache_folder_merge_their_costs(tmp_path: Path) -> None:
    disk = GuardedDisk(tmp_path)
    await disk.open()
    one, two = CompileCosts(disk), CompileCosts(disk)
    await one.expect(features("x"))  # both have read the (empty) file
    await two.expect(features("x"))
    one.record(features("a"), 1.0)
    two.record(features("b"), 2.0)
    await one.save()
    await two.save()  # merges what the other wrote since
    third = CompileCosts(disk)
    assert await third.expect(features("a")) == pytest.approx(1.0)
    assert await third.expect(features("b")) == pytest.approx(2.0)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no temporary left


async def test_the_cost_file_keeps_the_newest_records_only(tmp_path: Path) -> None:
    disk = GuardedDisk(tmp_path)
    await disk.open()
    old = {f"old{i}": [0.5, "family", 1000, 4, 3, 1] for i in range(COSTS_MAX_RECORDS)}
    (tmp_path / COSTS_FILE).write_text(json.dumps({"format": 1, "records": old}))
    costs = CompileCosts(disk)
    await costs.expect(features("x"))
    for i in range(5):
        costs.record(features(f"new{i}"), 1.0)
    await costs.save()
    kept = json.loads((tmp_path / COSTS_FILE).read_text())["records"]
    assert len(kept) == COSTS_MAX_RECORDS
    assert all(f"new{i}" in kept for i in range(5))


async def test_a_large_gather_starts_its_requests_over_several_steps_of_the_loop(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting a request (its task, its first step: the cache look-up) costs the event loop
    50-80 us: a gather that started a hundred in one step would hold the loop for milliseconds.
    The requests here are stand-ins that note the loop's step at which they start."""
    from acompile._compiler import _SPAWN_SLICE

    steps = 0
    started: list[int] = []

    async def compile(self: acompile.CompilePool, spec: Any, *, background: bool = False) -> Any:
        started.append(steps)
        return spec

    async def tick() -> None:
        nonlocal steps
        while True:
            await anyio.lowlevel.checkpoint()
            steps += 1

    monkeypatch.setattr(acompile.CompilePool, "compile", compile)
    async with acompile.CompilePool(
        1, target="cuda:90", cache_dir=cache_dir, preload=(), prestart=False
    ) as p:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            assert await p.gather(*range(4 * _SPAWN_SLICE)) == list(range(4 * _SPAWN_SLICE))
            tg.cancel_scope.cancel()
    assert len(set(started)) >= 4


async def test_a_gather_on_idle_workers_starts_its_longest_compile_first(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a worker idle, the first request of a gather to arrive would go straight to it; the
    gather holds its jobs until all have arrived (or 50 ms), so the one expected longest, here
    the last given, starts first. The 50 ms are made 30 s here: on a loaded machine the four
    look-ups may take longer, and what is tested is the order once they are in."""
    monkeypatch.setattr("acompile._compiler._BATCH_WAIT", 30.0)
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128, 256, 512)]
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir) as p:
        keys = [k.key for k in await p.gather(*specs)]
    shutil.rmtree(cache_dir / "v1")  # compiled again below; their times, as if measured:
    document = json.loads((cache_dir / COSTS_FILE).read_text())
    for key, seconds in zip(keys, (0.1, 0.2, 0.3, 9.0), strict=True):
        document["records"][key[:16]][0] = seconds
    (cache_dir / COSTS_FILE).write_text(json.dumps(document))
    trace = tmp_path / "trace.json"
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir) as p:
        await p.wait_ready()
        async with p.trace(trace):
            await p.gather(*specs)
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    jobs = sorted(
        (e for e in events if e["ph"] == "X" and tracks[e["tid"]].startswith("worker")), key=lambda e: e["ts"]
    )
    assert [e["args"]["key"] for e in jobs] == [keys[3], keys[2], keys[1], keys[0]]
