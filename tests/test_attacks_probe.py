"""Attacks by a kernel source string on the process that probes it.

A source string's top-level code runs, before any worker compiles it, in a short-lived process
that reports the kernel's name, Triton's cache key and its parameters (``_triton_probe``). The
attacker here is the text itself: it writes to whatever answer channel it can reach, starts
processes, fills memory, or sleeps. None of it may run code in the pool's process, outlive the
request, pass the pool's memory limit, or hold up other texts. No second user is needed, so
nothing here skips as non-root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from conftest import TARGET, subprocess_env
from kernels_for_tests import SOURCE_SIG, source_text
from processes import gone, probe_processes, until

import acompile
from acompile._backends import _triton_probe, _triton_text

pytestmark = pytest.mark.anyio

SIG = SOURCE_SIG


def source(top: str = "", n: int = 0) -> str:
    return source_text(top, n)


def pool(cache_dir: Path, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


# The processes the texts started (their pids, one a line), for the check that none is left.
@pytest.fixture
def started(tmp_path: Path) -> object:
    path = tmp_path / "started.txt"
    yield path
    pids = [int(line) for line in path.read_text().split()] if path.exists() else []
    left = []
    for pid in pids:
        if not gone(pid):
            left.append(pid)
            try:
                psutil.Process(pid).kill()  # not to leave it to the next test
            except psutil.Error:
                pass
    assert not left, f"processes a source string started outlived it: {left}"


@pytest.fixture(autouse=True)
def no_probe_left_behind() -> object:
    yield
    deadline = time.monotonic() + 2
    while (left := probe_processes()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, "a source string's probe outlived its request"


# Top-level code that writes, to every answer channel it can find, a pickle that touches the
# marker file when it is unpickled: every pipe and socket open in its own process (asyncio's
# subprocesses talk through pipes, uvloop's through sockets), and the output of the process
# above it when that is a probe too.
FORGE = """
import pickle, stat

class _Forged:
    def __reduce__(self):
        return (os.system, ("touch " + {marker!r},))

_forged = pickle.dumps(_Forged())
_targets = []
for _name in os.listdir("/proc/self/fd"):
    try:
        _fd = int(_name)
        if stat.S_ISFIFO(os.fstat(_fd).st_mode) or stat.S_ISSOCK(os.fstat(_fd).st_mode):
            _targets.append(_fd)
    except OSError:
        pass
try:
    with open(f"/proc/{{os.getppid()}}/cmdline", "rb") as _f:
        if b"_triton_probe" in _f.read():
            _targets.append(os.open(f"/proc/{{os.getppid()}}/fd/1", os.O_WRONLY))
except OSError:
    pass
for _fd in _targets:
    try:
        os.write(_fd, _forged)
    except OSError:
        pass
{then}
"""


@pytest.mark.parametrize("then", ["os._exit(0)", "pass"], ids=["and-exits", "and-goes-on"])
async def test_a_forged_answer_runs_no_code_in_the_pool(cache_dir: Path, tmp_path: Path, then: str) -> None:
    marker = tmp_path / "forged-answer-ran"
    text = source(FORGE.format(marker=str(marker), then=then))
    async with pool(cache_dir, prestart=False) as p:
        try:
            fn, _ = await _triton_text.kernel_from_text(text, None)
        except acompile.InvalidSpecError as exc:
            assert "answer" in str(exc) or "status" in str(exc), exc
        else:
            assert fn.__name__ == "scaled"  # the real answer, not the forged one
        assert not marker.exists(), "the forged answer ran code in the pool's process"
        # The pool is none the worse: another text compiles.
        assert (await p.triton(source(n=1), signature=SIG)).cubin
    await anyio.sleep(0.5)  # a command started late would have touched it by now
    assert not marker.exists()


# Top-level code that starts a child in its own process group (as most libraries would) and
# says which.
CHILD = """
_child = subprocess.Popen(["sleep", "300"], start_new_session=False)
with open({started!r}, "a") as _f:
    _f.write(f"{{_child.pid}}\\n")
{then}
"""


@pytest.mark.parametrize("end", ["finished", "cancelled", "timed-out"])
async def test_what_top_level_code_starts_ends_with_the_request(
    cache_dir: Path, started: Path, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    then = "" if end == "finished" else "time.sleep(60)"
    text = source(CHILD.format(started=str(started), then=then))
    if end == "timed-out":
        # Long enough for the text to start its child (a fraction of a second), then it sleeps.
        monkeypatch.setattr(_triton_text, "SOURCE_RUN_SECONDS", 2.0)
    async with pool(cache_dir, prestart=False) as p:
        if end == "finished":
            # Probed only: no worker runs the text, so whatever is left is the probe's.
            with pytest.raises(acompile.InvalidSpecError, match=r"no @triton\.jit function named 'absent'"):
                await p.triton(text, kernel_name="absent", signature=SIG)
        elif end == "cancelled":
            # Cancelled once the text has started its child and sleeps, as a caller's deadline
            # would cancel it (no need to wait out a fixed deadline for that).
            with anyio.CancelScope() as request:

                async def cancel_once_started() -> None:
                    await until(lambda: started.exists() and started.read_text().strip(), 60)
                    request.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_once_started)
                    await p.triton(text, signature=SIG)
                    raise AssertionError("the request ended before it was cancelled")
            assert request.cancelled_caught
        else:
            with pytest.raises(acompile.InvalidSpecError, match="ran longer than 2 s"):
                await p.triton(text, signature=SIG)
        pids = [int(line) for line in (await anyio.Path(started).read_text()).split()]
        assert pids, "the text started no child"
        # SIGKILL is delivered at once; the kernel takes a moment to reap.
        with anyio.move_on_after(2):
            await until(lambda: all(gone(pid) for pid in pids), 2)
        assert all(gone(pid) for pid in pids), f"orphaned: {[pid for pid in pids if not gone(pid)]}"
        assert p.stats()["workers"]["started"] == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_top_level_code_stays_under_the_pools_memory_limit(cache_dir: Path) -> None:
    text = source("_hog = bytearray(3 << 30)")
    async with pool(cache_dir, prestart=False, memory_limit="512MiB") as p:
        start = time.monotonic()
        with pytest.raises(acompile.InvalidSpecError, match=r"memory limit of 512 MiB"):
            await p.triton(text, signature=SIG)
        assert time.monotonic() - start < 30
        assert p.stats()["workers"]["started"] == 0  # stopped in the probe, not in a worker
        # The pool keeps serving.
        assert (await p.triton(source(n=2), signature=SIG)).cubin


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_slow_texts_do_not_hold_up_another_text(cache_dir: Path, tmp_path: Path) -> None:
    # As many sleeping texts as probes may start at once (two on a two-CPU machine).
    slow = max(2, os.cpu_count() or 2)
    running = [tmp_path / f"running-{i}" for i in range(slow)]
    async with pool(cache_dir, prestart=False) as p, anyio.create_task_group() as tg:

        async def sleeper(i: int) -> None:
            top = f"open({str(running[i])!r}, 'w').close(); time.sleep(60)"
            await p.triton(source(top, n=i), signature=SIG)

        for i in range(slow):
            tg.start_soon(sleeper, i)
        with anyio.fail_after(60):
            await until(lambda: all(path.exists() for path in running), 60)
        start = time.monotonic()
        with pytest.raises(acompile.InvalidSpecError, match=r"no @triton\.jit function named 'absent'"):
            with anyio.fail_after(20):  # they sleep for 60 s
                await p.triton(source(n=99), kernel_name="absent", signature=SIG)
        assert time.monotonic() - start < 15
        tg.cancel_scope.cancel()


def test_what_top_level_code_starts_dies_with_the_pools_process_even_by_sigkill(
    tmp_path: Path, started: Path
) -> None:
    """Killed with SIGKILL, the pool's process cannot stop the probe's group: the probe does, as
    the kernel tells it its parent is gone."""
    text = source(CHILD.format(started=str(started), then="time.sleep(3600)"))
    script = textwrap.dedent(
        f"""
        import anyio, acompile

        async def main():
            async with acompile.CompilePool(1, target={TARGET!r}, cache_dir={str(tmp_path / "c")!r},
                                            prestart=False) as p:
                await p.triton({text!r}, signature={SIG!r})

        anyio.run(main)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL, env=subprocess_env())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (started.exists() and started.read_text().strip()):
            time.sleep(0.01)
        pids = [int(line) for line in started.read_text().split()]
        assert pids, "the text started no child"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30  # generous: this tells "it dies" from "it stays"
        while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
            time.sleep(0.01)
        assert all(gone(pid) for pid in pids), f"orphaned: {[pid for pid in pids if not gone(pid)]}"
    finally:
        proc.kill()
        proc.wait()


def test_the_findings_are_read_as_data_and_checked() -> None:
    """What the pool accepts of a probe: one header with its token, then JSON of a closed shape;
    parameters' defaults in a closed set of types. Even with the token, nothing else passes."""
    import triton.language as tl

    defaults: list[Any] = [
        None,
        True,
        7,
        2.5,
        float("inf"),
        "s",
        (1, (2.0, "x")),
        [3],
        tl.float16,
        tl.constexpr(4),
    ]
    params = [[f"a{i}", True, True, _triton_probe.encode_value(v)] for i, v in enumerate(defaults)]
    kernel = {
        "name": "k",
        "cache_key": "ab12" * 16 + "7",
        "arg_names": [p[0] for p in params],
        "params": params,
    }
    body = json.dumps({"ok": True, "found": ["k"], "kernel": kernel}).encode()
    _, token = _triton_probe.make_request("", "<f>", None, [])
    header = f"acompile-probe 1 {token} 0 0 {len(body)}\n".encode()
    status, found = _triton_probe.read_envelope(header + body, token)
    answer = _triton_probe.read_answer(found)
    back = [p[3] for p in answer["kernel"]["params"]]
    assert status == 0 and back[:8] == defaults[:8]
    assert back[8] == tl.float16 and isinstance(back[9], tl.constexpr) and back[9].value == 4

    # The envelope: another token, bytes after the findings, a second header, a cut answer.
    other = "0" * 64
    for data in (
        f"acompile-probe 1 {other} 0 0 {len(body)}\n".encode() + body,
        header + body + b"x",
        b"\x80\x04junk" + header + body,
        f"acompile-probe 1 {token} 0 1 0\n".encode(),
    ):
        with pytest.raises(_triton_probe.BadAnswer):
            _triton_probe.read_envelope(data, token)

    # The findings: anything outside their shape.
    deep: Any = 1
    for _ in range(20):
        deep = ["tuple", [deep]]

    def with_default(value: Any) -> bytes:
        bad = dict(kernel, arg_names=["a"], params=[["a", True, True, value]])
        return json.dumps({"ok": True, "found": ["k"], "kernel": bad}).encode()

    for bad_body in (
        with_default(["pickle", "gASV"]),
        with_default({"__reduce__": "os.system"}),
        with_default(["dtype", "not-a-dtype"]),
        with_default(deep),
        json.dumps({"ok": True, "found": ["k"], "kernel": dict(kernel, name="os.system")}).encode(),
        json.dumps({"ok": True, "found": ["k"], "kernel": dict(kernel, cache_key="x y")}).encode(),
        json.dumps({"ok": "yes"}).encode(),
        json.dumps({"ok": False, "kind": "pickle", "message": "m"}).encode(),
        b"[" * 100_000,
        b"\x80\x04\x95",
    ):
        with pytest.raises(_triton_probe.BadAnswer):
            _triton_probe.read_answer(bad_body)
    # A default of another type is not sent: that constexpr is the caller's to pass.
    with pytest.raises(_triton_probe._NotSent):
        _triton_probe.encode_value(object())


async def test_a_text_that_lies_about_its_key_is_never_served_as_another(
    cache_dir: Path, tmp_path: Path
) -> None:
    """A text's Triton key is what its own process reports, and its top-level code may patch
    Triton to report another kernel's. Compiled first, such a text must not be what an honest
    request for that other kernel is served: each text is keyed by its own bytes too."""
    from acompile._cache import decode_entry

    honest_text = source()
    async with pool(tmp_path / "scratch") as p:
        honest = await p.triton(honest_text, signature=SIG)
    (path,) = [f for f in (tmp_path / "scratch" / "v1").rglob(honest.key)]
    triton_key = decode_entry(path.read_bytes(), honest.key).meta["key_parts"]["kernel"]
    liar = source(
        top=f"triton.runtime.jit.JITFunction.cache_key = property(lambda self: {triton_key!r})",
        n=7,  # another kernel: it adds 7
    )
    async with pool(cache_dir) as p:
        lied = await p.triton(liar, signature=SIG)
        served = await p.triton(honest_text, signature=SIG)
    assert lied.key != honest.key
    assert served.key == honest.key and served is not lied
