"""Kernels given as Python source strings: their top-level code runs in a process of its own, so a
deadline stops it and nothing else waits behind it; what the pool keeps of them is bounded."""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import anyio
import psutil
import pytest
import triton
from conftest import TARGET, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel
from processes import gone, probe_processes, until
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import acompile

# _triton_source and _triton_text: the bounds of their memos, each tested in its module.
from acompile._backends import _triton_source, _triton_text, forget_triton

pytestmark = pytest.mark.anyio

KERNEL = """
import os, sys
import triton
import triton.language as tl

SCALE = tl.constexpr(3.0)
{top}

@triton.jit
def scaled(x_ptr, n, BLOCK: tl.constexpr = 128):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * SCALE + {n}, mask=m)
"""


def source(n: int = 0, top: str = "") -> str:
    return KERNEL.format(n=n, top=top)


def pool(cache_dir: Path, workers: int = 1, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def no_helper_left_behind() -> object:
    yield
    assert not probe_processes(), "a source string's process outlived its request"


async def test_the_same_ptx_as_triton_and_the_text_never_runs_here(cache_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran-in.txt"
    text = source(top=f"with open({str(marker)!r}, 'a') as f: f.write(f'{{os.getpid()}}\\n')")
    async with pool(cache_dir) as p:
        k = await p.triton(text, signature={"x_ptr": "*fp32", "n": "i32"})
        again, tier = await p.compile_with_tier(acompile.TritonSpec(text, {"x_ptr": "*fp32", "n": "i32"}))
    assert again is k and tier == "memory"
    ran_in = (await anyio.Path(marker).read_text()).split()
    assert str(os.getpid()) not in ran_in  # neither the request nor the cache hit ran it here
    assert len(ran_in) == 2  # once to key it (its own process), once in the worker that compiled it

    # Triton's own compile of the same text, run here, under the same file name.
    digest = __import__("hashlib").sha256(text.encode()).hexdigest()
    filename = f"<acompile-source-{digest[:16]}>"
    fn = _triton_source.run_source_text(text, filename)["scaled"]
    linecache.cache.pop(filename)
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path / "triton-ref")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = triton.compile(
                ASTSource(fn, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128}),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4, "num_stages": 3},
            )
    finally:
        del os.environ["TRITON_CACHE_DIR"]
    assert k.asm["ptx"] == ref.asm["ptx"] and k.cubin == ref.asm["cubin"]
    assert k.name == "scaled" and k.metadata.num_warps == 4


async def test_a_deadline_stops_a_source_that_sleeps_or_spins(cache_dir: Path, tmp_path: Path) -> None:
    running = tmp_path / "running"
    fell: list[float] = []

    async def deadline_once_running(deadline: anyio.CancelScope) -> None:
        # The deadline falls as the top-level code sleeps or spins (it says it runs with a file),
        # not a fixed time after the request: that would only wait longer for the same thing.
        await until(running.exists, 60)
        deadline.deadline = anyio.current_time()
        fell.append(time.monotonic())

    async with pool(cache_dir, prestart=False) as p:
        for top in ("import time; time.sleep(20)", "while True: pass"):
            running.unlink(missing_ok=True)
            fell.clear()
            text = source(top=f"open({str(running)!r}, 'w').close()\n{top}")
            with pytest.raises(TimeoutError):
                with anyio.fail_after(60) as deadline:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(deadline_once_running, deadline)
                        await p.triton(text, signature={"x_ptr": "*fp32", "n": "i32"})
            assert time.monotonic() - fell[0] < 7, top  # stopped at once, not when it is done
            assert not probe_processes()
        # The pool is none the worse: the same kernel without the stall compiles.
        assert (await p.triton(source(), signature={"x_ptr": "*fp32", "n": "i32"})).cubin


def test_a_source_strings_process_dies_with_the_pools_process_even_by_sigkill(tmp_path: Path) -> None:
    """The process running a source string's top-level code is the pool's process's child, not
    a worker's: killed with SIGKILL, the pool cannot stop it, so the kernel does."""
    marker = tmp_path / "running"  # the source's top-level code is running (past the probe's start)
    top = f"import time; open({str(marker)!r}, 'w').close(); time.sleep(3600)"
    script = textwrap.dedent(
        f"""
        import anyio, acompile

        async def main():
            async with acompile.CompilePool(1, target={TARGET!r}, cache_dir={str(tmp_path)!r}, prestart=False) as p:
                await p.triton({source(top=top)!r},
                               signature={{"x_ptr": "*fp32", "n": "i32"}})

        anyio.run(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.01)
        probes = [
            child
            for child in psutil.Process(proc.pid).children(recursive=True)
            if "_triton_probe" in " ".join(child.cmdline())
        ]
        assert marker.exists() and probes, "no process ran the source string"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30  # generous: this tells "it dies" from "it stays"
        while time.monotonic() < deadline and not all(gone(p.pid) for p in probes):
            time.sleep(0.01)
        assert all(gone(p.pid) for p in probes), [p.pid for p in probes if not gone(p.pid)]
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_a_stalled_source_does_not_hold_up_other_requests(cache_dir: Path) -> None:
    stalled_done = False
    async with pool(cache_dir, workers=2) as p, anyio.create_task_group() as tg:
        stalled = anyio.CancelScope()

        async def stall() -> None:
            nonlocal stalled_done
            with stalled:
                await p.triton(
                    source(top="import time; time.sleep(60)"), signature={"x_ptr": "*fp32", "n": "i32"}
                )
                stalled_done = True

        tg.start_soon(stall)
        with anyio.fail_after(50):  # "did not hang": it would take 60 s behind the stalled one
            # Another source string, and a JIT function, both compiled while it sleeps.
            other = await p.triton(source(n=7), signature={"x_ptr": "*fp32", "n": "i32"})
            jit = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
        assert other.cubin and jit.cubin and not stalled_done
        stalled.cancel()
    assert not stalled_done


async def test_errors_in_the_source_are_invalid_spec_errors(cache_dir: Path) -> None:
    sig = {"x_ptr": "*fp32", "n": "i32"}
    async with pool(cache_dir, prestart=False) as p:
        with pytest.raises(
            acompile.InvalidSpecError, match=r"running the kernel source failed: ZeroDivisionError"
        ):
            await p.triton(source(top="1 / 0"), signature=sig)
        with pytest.raises(acompile.InvalidSpecError, match=r"its process ended with status 3\n.*going away"):
            await p.triton(
                source(top="sys.stderr.write('going away'); sys.stderr.flush(); os._exit(3)"), signature=sig
            )
        with pytest.raises(acompile.InvalidSpecError, match=r"no @triton.jit function named 'other'.*scaled"):
            await p.triton(source(), kernel_name="other", signature=sig)
        assert p.stats()["workers"]["started"] == 0


async def test_what_the_pool_keeps_of_source_strings_is_bounded(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_triton_text, "SOURCE_MEMO_SIZE", 3)
    forget_triton()
    big = "# " + "padding " * 12_000  # ~100 KB a source
    async with pool(cache_dir, prestart=False) as p:
        for i in range(8):
            text = source(n=i, top=big)
            fn, _ = await _triton_text.kernel_from_text(text, None)
            assert fn.__name__ == "scaled" and len(_triton_text._source_memo) <= 3
        assert p.stats()["workers"]["started"] == 0
    # Only small facts are kept, never the text or what it defined.
    assert not any(str(name).startswith("<acompile-source-") for name in linecache.cache)


def test_a_worker_keeps_a_bounded_number_of_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton_source, "MATERIALIZED_SIZE", 4)
    monkeypatch.setattr(_triton_source, "_materialized", type(_triton_source._materialized)())
    names = []
    for i in range(10):
        text = source(n=i)
        name = f"<acompile-source-test{i:011d}>"
        names.append(name)
        fn = _triton_source.materialize({"kind": "text", "text": text, "filename": name, "name": "scaled"})
        assert fn.__name__ == "scaled"
        assert len(_triton_source._materialized) <= 4
    assert [n for n in names if n in linecache.cache] == names[-4:]
    for name in names[-4:]:
        linecache.cache.pop(name, None)


async def test_a_huge_triton_error_is_cut_and_saved_whole(cache_dir: Path) -> None:
    text = KERNEL.replace("    offs = ", "    # " + "noise " * 40_000 + "\n    undefined_thing\n    offs = ")
    text = text.format(n=0, top="")
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.CompileError) as info:
            await p.triton(text, signature={"x_ptr": "*fp32", "n": "i32"})
    err = info.value
    assert err.kernel == "scaled" and err.backend == "triton"
    assert "undefined_thing" in err.log and "characters cut" in err.log
    for part in (err.args[0], err.log, err.stderr_tail, err.worker_traceback):
        assert len(part) <= 64 * 1024
    assert err.log_path is not None and err.log_path in str(err)
    whole = await anyio.Path(err.log_path).read_text()
    assert whole.count("noise") == 40_000 and "undefined_thing" in whole
