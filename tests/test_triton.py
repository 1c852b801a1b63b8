"""The Triton backend with real compiles for cuda:90 (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import psutil
import pytest
import triton
from conftest import TARGET, asyncio_only, run_python, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel, broken_kernel, scale_add_kernel, slow_to_compile_kernel
from processes import gone
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import acompile

pytestmark = pytest.mark.anyio


def pool(cache_dir: Path, workers: int = 2, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


def triton_reference(
    fn: object, signature: dict[str, str], constexprs: dict[str, object], tmp: Path, **options: object
) -> object:
    full = {name: ("constexpr" if name in constexprs else signature[name]) for name in fn.arg_names}  # type: ignore[attr-defined]
    os.environ["TRITON_CACHE_DIR"] = str(tmp / "triton-ref")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return triton.compile(
                ASTSource(fn, full, constexprs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 4, "num_stages": 3, **options},
            )
    finally:
        del os.environ["TRITON_CACHE_DIR"]


# asyncio only: the subject is the compiled kernel, compared with Triton's, not the loop.
@asyncio_only
async def test_compiles_the_same_kernel_triton_compile_does(cache_dir: Path, tmp_path: Path) -> None:
    async with pool(cache_dir) as p:
        k = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 1024}, num_warps=4)
    ref = triton_reference(add_kernel, ADD_SIG, {"BLOCK": 1024}, tmp_path)
    assert k.name == "add_kernel"
    assert len(k.key) == 64 and int(k.key, 16) >= 0
    assert k.asm["ptx"] == ref.asm["ptx"]  # type: ignore[attr-defined]
    assert k.cubin == ref.asm["cubin"] and k.cubin[:4] == b"\x7fELF"  # type: ignore[attr-defined]
    assert k.metadata == ref.metadata  # type: ignore[attr-defined]
    assert isinstance(k.compiled, triton.compiler.CompiledKernel)
    assert set(vars(k.compiled)) == set(vars(ref))
    assert k.metadata.num_warps == 4 and k.target == acompile.Target("cuda", 90)


# asyncio only: the subject is the cached kernel, compared with Triton's, not the loop.
@asyncio_only
async def test_a_kernel_from_the_disk_cache_is_the_kernel_triton_compile_builds(
    cache_dir: Path, tmp_path: Path
) -> None:
    from acompile._backends import TritonKernel

    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 1024})
    async with pool(cache_dir) as p:
        compiled = await p.compile(spec)
    async with pool(cache_dir, prestart=False) as p:
        k, tier = await p.compile_with_tier(spec)
    async with pool(cache_dir, prestart=False) as p:
        other = await p.compile(spec)
    ref: Any = triton_reference(add_kernel, ADD_SIG, {"BLOCK": 1024}, tmp_path)
    assert tier == "disk" and k.key == compiled.key
    assert k.cubin == compiled.cubin == ref.asm["cubin"] and k.metadata == ref.metadata
    assert k.asm == compiled.asm and k.asm["ptx"] == ref.asm["ptx"] and "json" not in k.asm
    # Triton's CompiledKernel, built when first asked for, as Triton builds it from its files.
    ck = k.compiled
    assert isinstance(ck, triton.compiler.CompiledKernel) and set(vars(ck)) == set(vars(ref))
    assert (ck.hash, ck.name, ck.packed_metadata) == (ref.hash, ref.name, ref.packed_metadata)
    assert ck.asm is k.asm and ck.kernel is k.cubin and ck.metadata is k.metadata and k.compiled is ck
    assert ck.src.signature == ref.src.signature and ck.src.constants == ref.src.constants
    # A copy made before first use (as a TunedKernel is) shares Triton's objects with its
    # original, so that the binary is loaded once.
    twin = object.__new__(TritonKernel)
    twin.__dict__.update(other.__dict__)
    assert twin.compiled is other.compiled and twin.asm is other.asm


async def test_helpers_and_constexpr_globals_travel_without_importing_the_module(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imports.txt"
    # The workers inherit the environment: had any of them imported kernels_for_tests, it would
    # have written its pid into the marker.
    monkeypatch.setenv("ACOMPILE_TEST_IMPORT_MARKER", str(marker))
    async with pool(cache_dir) as p:
        k = await p.triton(scale_add_kernel, signature=ADD_SIG)  # BLOCK: its default, 256
        worker_pids = {c.pid for c in psutil.Process().children(recursive=True)}
    ref = triton_reference(scale_add_kernel, ADD_SIG, {"BLOCK": 256}, tmp_path)
    assert k.asm["ptx"] == ref.asm["ptx"]  # type: ignore[attr-defined]
    assert "mul.f32" in k.asm["ptx"] or "3.0" in k.asm["ttir"] or "3 " in k.asm["ttir"]
    imported_by = set(marker.read_text().split()) if marker.exists() else set()
    assert not imported_by & {str(pid) for pid in worker_pids}


_IMPORTED_KERNEL = """
import triton
import triton.language as tl

FACTOR = tl.constexpr({factor})


# A repr hook defined here cannot travel: the workers import this module to get the kernel.
@triton.jit(repr=lambda specialization: "scaled")
def scaled(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)
"""


async def test_a_kernel_whose_module_changed_since_it_was_imported_is_refused_not_compiled_under_its_key(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "changing_kernels.py"
    module.write_text(_IMPORTED_KERNEL.format(factor="3.0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "changing_kernels", raising=False)
    import changing_kernels

    sig = {"x_ptr": "*fp32", "n": "i32"}
    async with pool(cache_dir, workers=1) as p:
        k = await p.triton(changing_kernels.scaled, signature=sig, constexprs={"BLOCK": 64})
        assert "0f40400000" in k.asm["ptx"]  # times 3.0
        # Edited on disk while this process keeps the version it imported: a worker that imports
        # it now gets another kernel (times 5.25), which must not be kept under this one's key.
        module.write_text(_IMPORTED_KERNEL.format(factor="5.25"))
        await p.quiesce()  # workers that start now import the module afresh
        with pytest.raises(acompile.CompileError, match="changed after the calling process imported it"):
            await p.triton(changing_kernels.scaled, signature=sig, constexprs={"BLOCK": 128})


_AUTOTUNED_KERNEL = """
import os

import triton
import triton.language as tl

with open(os.environ["ACOMPILE_TEST_IMPORT_MARKER"], "a") as marker:
    marker.write(f"{os.getpid()}\\n")


def configs():
    return [triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)]


@triton.autotune(configs=configs(), key=["n"])
@triton.jit
def doubled(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)
"""


async def test_an_autotuned_kernel_travels_without_importing_its_module(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel library's autotuned kernels build their configs with a function of the module
    # (which imports torch): a name its decorator uses is none the worker needs.
    marker = tmp_path / "imports.txt"
    monkeypatch.setenv("ACOMPILE_TEST_IMPORT_MARKER", str(marker))
    (tmp_path / "tuned_kernels.py").write_text(_AUTOTUNED_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tuned_kernels", raising=False)
    import tuned_kernels

    from acompile._backends import _triton_source

    fn = tuned_kernels.doubled.fn
    async with pool(cache_dir, workers=1) as p:
        k = await p.triton(
            fn, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64}, num_warps=2
        )
    ref: Any = triton_reference(fn, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64}, tmp_path, num_warps=2)
    assert k.asm["ptx"] == ref.asm["ptx"]
    assert marker.read_text().split() == [str(os.getpid())]  # imported here only, by no worker
    description = _triton_source.describe(fn)
    described = {name for names in description["namespaces"].values() for name in names}
    assert description["kind"] == "source" and "configs" not in described and "tl" in described


_TWO_KERNELS = """
import triton
import triton.language as tl


@triton.jit
def shipped(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


# A repr hook defined here cannot travel: a worker imports this module to get this kernel.
@triton.jit(repr=lambda specialization: "imported")
def imported(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) - 1.0, mask=offs < n)
"""


def test_a_worker_that_rebuilt_a_kernel_from_source_still_imports_its_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import linecache
    from collections import OrderedDict

    from acompile._backends import _triton_source

    module = tmp_path / "two_kernels.py"
    module.write_text(_TWO_KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "two_kernels", raising=False)
    import two_kernels

    shipped, imported = (
        _triton_source.describe(two_kernels.shipped),
        _triton_source.describe(two_kernels.imported),
    )
    assert (shipped["kind"], imported["kind"]) == ("source", "import")
    # Here as in a worker, which has neither imported the module nor read its file.
    monkeypatch.delitem(sys.modules, "two_kernels")
    monkeypatch.delitem(linecache.cache, str(module), raising=False)
    monkeypatch.setattr(_triton_source, "_materialized", OrderedDict())
    monkeypatch.setattr(_triton_source, "_stand_ins", {}, raising=False)
    assert _triton_source.materialize(shipped).cache_key == two_kernels.shipped.cache_key
    # The shipped kernel's lines, registered for its file, do not stand in for the whole file
    # as the module is imported (Triton reads every kernel's source as the module defines it).
    assert _triton_source.materialize(imported).cache_key == two_kernels.imported.cache_key
    assert _triton_source.materialize(shipped).cache_key == two_kernels.shipped.cache_key


_THROUGH = """
import triton
import triton.language as tl

from indirect_a import shipped as _unused  # noqa: F401


@triton.jit(repr=lambda specialization: "through")
def through(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)
"""


def test_a_module_that_imports_a_rebuilt_kernels_module_still_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in lines of a module a worker rebuilt a kernel of are dropped before any real
    import, not only before that module's own: another module may import it on its way."""
    import linecache
    from collections import OrderedDict

    from acompile._backends import _triton_source

    (tmp_path / "indirect_a.py").write_text(_TWO_KERNELS)
    (tmp_path / "indirect_b.py").write_text(_THROUGH)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("indirect_a", "indirect_b"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import indirect_a
    import indirect_b

    shipped, through = (
        _triton_source.describe(indirect_a.shipped),
        _triton_source.describe(indirect_b.through),
    )
    assert (shipped["kind"], through["kind"]) == ("source", "import")
    for name in ("indirect_a", "indirect_b"):  # as in a worker
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delitem(linecache.cache, str(tmp_path / f"{name}.py"), raising=False)
    monkeypatch.setattr(_triton_source, "_materialized", OrderedDict())
    monkeypatch.setattr(_triton_source, "_stand_ins", {}, raising=False)
    assert _triton_source.materialize(shipped).cache_key == indirect_a.shipped.cache_key
    assert _triton_source.materialize(through).cache_key == indirect_b.through.cache_key


# asyncio only: the subject is what the compiler makes of source text, not the loop.
@asyncio_only
async def test_a_kernel_from_source_text(cache_dir: Path) -> None:
    source = textwrap.dedent(
        """
        import triton
        import triton.language as tl

        @triton.jit
        def double(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2, mask=m)

        @triton.jit
        def halve(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 0.5, mask=m)
        """
    )
    async with pool(cache_dir) as p:
        k = await p.triton(
            source, kernel_name="halve", signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 128}
        )
        assert k.name == "halve" and ".entry halve" in k.asm["ptx"]
        with pytest.raises(
            acompile.InvalidSpecError, match=r"no @triton.jit function named 'triple'.*double.*halve"
        ):
            await p.triton(source, kernel_name="triple", signature={"x_ptr": "*fp32", "n": "i32"})
        with pytest.raises(acompile.InvalidSpecError, match="kernel_name"):
            await p.triton(source, signature={"x_ptr": "*fp32", "n": "i32"})
        with pytest.raises(acompile.InvalidSpecError, match="does not parse"):
            await p.triton("def (:", kernel_name="x", signature={})


def test_a_template_warms_up_without_hashing_triton_and_its_workers_take_the_parents_hash(
    tmp_path: Path,
) -> None:
    """A template preloads while the parent hashes Triton's binaries (0.4-0.8 s the first time on
    a machine): its warm-up compile must not hash them too, and the workers it forks take the
    parent's hash from their configuration."""
    script = textwrap.dedent(
        f"""
        import triton.runtime.cache as cache
        from acompile._backends import load_worker

        worker = load_worker("triton")

        def hashing():
            raise AssertionError("the warm-up hashed Triton's binaries")

        cache.triton_key = hashing
        worker.setup({{"triton_cache_dir": {str(tmp_path)!r}}})
        worker.preload({{"target": "cuda:90"}})
        assert cache.triton_key is hashing
        worker.setup({{"triton_cache_dir": {str(tmp_path)!r}, "triton_key": "the parent's"}})
        print(cache.triton_key())
        """
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the parent's"


def slow_triton_key(
    monkeypatch: pytest.MonkeyPatch, hold_s: float
) -> tuple[threading.Event, threading.Event]:
    """Make this process's hash of Triton's binaries (the first time in a cache folder) take
    ``hold_s`` more seconds, or until the second event returned is set; the first is set once
    the hash has begun."""
    from acompile._backends import _triton_toolchain

    hashing, release = threading.Event(), threading.Event()
    own = _triton_toolchain.triton_key

    def slow_key(memo_dir: Path) -> str:
        hashing.set()
        value = own(memo_dir)
        release.wait(hold_s)
        return value

    monkeypatch.setattr(_triton_toolchain, "triton_key", slow_key)
    return hashing, release


async def test_workers_compile_while_the_parent_still_hashes_triton_and_kernels_keep_tritons_hash(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first time on a machine, the parent hashes Triton's binaries for longer than a worker
    takes to start: workers take jobs meanwhile, and each kernel still carries the hash that
    ``triton.compile`` gives it."""

    hashing, release = slow_triton_key(monkeypatch, hold_s=120)
    async with pool(cache_dir, workers=1) as p:
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            async def compile_one() -> None:
                got.append(await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64}))

            tg.start_soon(compile_one)
            try:
                with anyio.fail_after(60):
                    while p.stats()["workers"]["busy"] < 1:  # noqa: ASYNC110 (a worker's state)
                        await anyio.sleep(0.01)
                assert hashing.is_set() and not release.is_set()
            finally:
                release.set()
    ref: Any = triton_reference(add_kernel, ADD_SIG, {"BLOCK": 64}, tmp_path)
    (k,) = got
    assert k.metadata == ref.metadata and k.metadata.hash == ref.hash
    assert k.cubin == ref.asm["cubin"] and k.compiled.hash == ref.hash


# asyncio only: the subject is a time limit's and a job time's arithmetic, not the loop.
@asyncio_only
async def test_waiting_for_the_parents_key_counts_neither_against_the_time_limit_nor_as_compile_time(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that compiled before the parent had Triton's key waits for it: that wait is not
    the job's, so ``max_compile_seconds`` does not count it, and the compile time remembered for
    the kernel (which orders later queues) is not it."""
    import json

    from acompile._cache import COSTS_FILE

    hashing, _ = slow_triton_key(monkeypatch, hold_s=4.0)
    async with pool(cache_dir, workers=1, max_compile_seconds=2.0) as p:
        k = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
    assert hashing.is_set() and k.cubin[:4] == b"\x7fELF"
    records = (
        json.loads((cache_dir / COSTS_FILE).read_text())["records"]
        if (cache_dir / COSTS_FILE).exists()
        else {}
    )
    assert all(row[0] < 2.0 for row in records.values()), records


def test_a_kernel_compiled_before_the_parents_key_is_compiled_once_and_takes_tritons_hash(
    tmp_path: Path,
) -> None:
    """A worker that started before the parent had Triton's key compiles under a stand-in and
    settles the kernel's hash when the key comes: one compile, the hash Triton gives it. Where
    Triton's cache key does not have the shape that relies on, it compiles again under the
    real key; where the parent could not compute the key, the worker computes it itself."""
    script = textwrap.dedent(
        f"""
        import os
        # The reference compile must not come from the user's Triton cache: a kernel compiled
        # there from another checkout differs in its debug information (the source's path).
        os.environ["TRITON_CACHE_DIR"] = {str(tmp_path / "reference-cache")!r}
        import json, threading, time, anyio, triton
        import triton.runtime.cache as cache
        from pathlib import Path
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from acompile import Target, TritonSpec
        from acompile._backends import load_parent, load_worker
        from acompile._cache import decode_entry
        from kernels_for_tests import ADD_SIG, add_kernel

        parent, worker = load_parent("triton"), load_worker("triton")
        tmp = Path({str(tmp_path)!r})
        request = anyio.run(
            parent.prepare, TritonSpec(add_kernel, ADD_SIG, {{"BLOCK": 64}}), Target("cuda", 90), tmp / "memo"
        )
        payload = anyio.run(parent.payload, request)
        ref = triton.compile(
            ASTSource(add_kernel, {{**ADD_SIG, "BLOCK": "constexpr"}}, {{"BLOCK": 64}}),
            target=GPUTarget("cuda", 90, 32),
        )
        real_key = cache.triton_key()
        compiles = []
        own_compile = triton.compile

        def counting(*args, **kwargs):
            compiles.append(1)
            return own_compile(*args, **kwargs)

        triton.compile = counting

        def run(late, write, delay=0.3):
            path = tmp / f"late-{{late}}.json"
            worker.setup({{"triton_cache_dir": str(tmp / "triton"), "late_config": str(path), "late_config_timeout": 60}})
            def later():
                time.sleep(delay)
                path.with_suffix(".tmp").write_text(json.dumps(write))
                os.replace(path.with_suffix(".tmp"), path)
            threading.Thread(target=later).start()
            compiles.clear()
            entry = decode_entry(worker.compile(payload))
            meta = json.loads(entry.blobs["json"])
            assert entry.meta["hash"] == meta["hash"] == ref.hash, (late, entry.meta["hash"], ref.hash)
            assert entry.blobs["cubin"] == ref.asm["cubin"]
            return len(compiles)

        print("settled", run("a", {{"triton_key": real_key}}))
        # the parent could not compute it: the worker computes it itself
        print("own", run("b", {{}}))
        # a Triton whose cache key does not begin with its triton_key(): compiled again under the
        # real key (this one puts something before it, under the stand-in only)
        make_key = triton.compiler.compiler.get_cache_key

        def reshaped(*args, **kwargs):
            key = make_key(*args, **kwargs)
            return "v2:" + key if key.startswith(worker._STAND_IN) else key

        triton.compiler.compiler.get_cache_key = reshaped
        print("again", run("c", {{"triton_key": real_key}}))
        """
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["settled", "1", "own", "1", "again", "2"]


def test_a_kernel_defined_in_a_script(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import anyio, acompile, triton, triton.language as tl

            @triton.jit
            def script_kernel(x_ptr, n, BLOCK: tl.constexpr):
                offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
                tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

            async def main():
                async with acompile.CompilePool(1, target="cuda:90", cache_dir=CACHE) as pool:
                    k = await pool.triton(script_kernel, signature={"x_ptr": "*i32", "n": "i32"}, constexprs={"BLOCK": 64})
                    print("compiled", k.name, len(k.cubin) > 0)

            if __name__ == "__main__":
                anyio.run(main)
            """
        ).replace("CACHE", repr(str(cache_dir)))
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert "compiled script_kernel True" in out.stdout


async def test_argument_mistakes_raise_before_any_worker_starts(cache_dir: Path) -> None:
    async with pool(cache_dir, prestart=False) as p:
        cases = [
            (
                dict(signature={**ADD_SIG, "n": "int"}, constexprs={"BLOCK": 64}),
                r"unknown Triton type 'int' for 'n'",
            ),
            (dict(signature=ADD_SIG), r"missing constexpr 'BLOCK'.*constexprs=\{'BLOCK': \.\.\.\}"),
            (
                dict(signature={k: v for k, v in ADD_SIG.items() if k != "n"}, constexprs={"BLOCK": 64}),
                r"missing type for parameter 'n'",
            ),
            (dict(signature={**ADD_SIG, "m": "i32"}, constexprs={"BLOCK": 64}), r"no parameter 'm'.*x_ptr"),
            (
                dict(signature=ADD_SIG, constexprs={"BLOCK": 64}, target="cuda:12"),
                r"unknown CUDA architecture",
            ),
            (
                dict(signature=ADD_SIG, constexprs={"BLOCK": 64}, target="gpu"),
                r"unknown target 'gpu'.*cuda:90",
            ),
            (
                dict(signature=ADD_SIG, constexprs={"BLOCK": 64}, num_warps=3),
                r"num_warps must be a power of two",
            ),
            (
                dict(signature=ADD_SIG, constexprs={"BLOCK": 64}, num_wraps=4),
                r"unknown Triton option\(s\) \['num_wraps'\]",
            ),
            (dict(signature=ADD_SIG, constexprs={"BLOCK": object()}), r"cannot be part of a cache key"),
        ]
        for kwargs, message in cases:
            with pytest.raises(acompile.InvalidSpecError, match=message):
                await p.triton(add_kernel, **kwargs)  # type: ignore[arg-type]

        def not_jit(x: int) -> int:
            return x

        with pytest.raises(acompile.InvalidSpecError, match="not a Triton JIT function"):
            await p.triton(not_jit, signature={"x": "i32"})
        with pytest.raises(acompile.InvalidSpecError, match="pass the inner function"):
            await p.triton(
                triton.autotune(configs=[triton.Config({"BLOCK": 64})], key=[])(add_kernel), signature=ADD_SIG
            )
        assert p.stats()["workers"]["started"] == 0
    assert issubclass(acompile.InvalidSpecError, ValueError)


async def test_deep_constexprs_and_wrong_triton_options_are_refused_in_the_parent_naming_them(
    cache_dir: Path,
) -> None:
    """A constexpr of tuples nested 1,000 deep used to end in a bare RecursionError, and an
    option of the wrong type (maxnreg="x") reached a worker and came back as Triton's pybind
    message: both are the caller's mistakes, told before any worker starts, naming what to change."""
    deep: object = 1
    for _ in range(1000):
        deep = (deep,)
    async with pool(cache_dir, prestart=False) as p:
        with pytest.raises(
            acompile.InvalidSpecError, match=r"constexpr BLOCK nests tuples more than \d+ deep"
        ):
            await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": deep})
        cases = [
            (dict(maxnreg="x"), r"option maxnreg must be an integer from 1 to 255 \(or None\), got 'x'"),
            (dict(maxnreg=0), r"option maxnreg must be an integer from 1 to 255"),
            (dict(maxnreg=True), r"option maxnreg must be an integer"),
            (dict(num_ctas=0), r"option num_ctas must be an integer from 1 to 16, got 0"),
            (dict(num_ctas="2"), r"option num_ctas must be an integer"),
            (dict(num_stages="3"), r"num_stages must be an integer from 1 to 64, got '3'"),
            (dict(num_stages=2**63), r"num_stages must be an integer from 1 to 64"),
            (dict(num_stages=10**5000), r"num_stages must be an integer from 1 to 64"),
            (dict(ptx_version=2**40), r"option ptx_version must be an integer from 0 to 2147483647"),
            (dict(max_num_imprecise_acc_default=2**70), r"option max_num_imprecise_acc_default must be"),
            (dict(enable_fp_fusion="yes"), r"option enable_fp_fusion must be True or False, got 'yes'"),
            (dict(ptx_options=7), r"option ptx_options must be a string \(or None\), got 7"),
            (dict(ptx_version=-1), r"option ptx_version must be an integer from 0 to 2147483647"),
            (
                dict(allowed_dot_input_precisions="tf32"),
                r"option allowed_dot_input_precisions must be a list of strings",
            ),
            (dict(debug=1), r"option debug must be True or False, got 1"),
        ]
        for options, message in cases:
            with pytest.raises(acompile.InvalidSpecError, match=message):
                await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64}, **options)  # type: ignore[arg-type]
        # A nested option value as deep as the constexpr above: the same clear refusal.
        with pytest.raises(acompile.InvalidSpecError, match=r"option extern_libs"):
            await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64}, extern_libs=deep)  # type: ignore[arg-type]
        assert p.stats()["workers"]["started"] == 0
    # Right values pass the checks, as Triton's own types have them.
    from acompile._backends._triton_spec import check_options

    for options in ({"maxnreg": 128}, {"maxnreg": None}, {"num_ctas": 2}, {"ptx_options": "-v"},
                    {"supported_fp8_dtypes": ["fp8e5"]},
                    {"allowed_dot_input_precisions": ["tf32", "ieee"]}, {"enable_fp_fusion": False}):  # fmt: skip
        spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, num_stages=1, options=options)
        assert check_options(acompile.Target("cuda", 90), spec)["num_stages"] == 1


async def test_a_grid_of_the_wrong_shape_is_refused_before_the_kernel_is_loaded(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        k = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
    # Loading needs a GPU; a wrong grid is the caller's mistake, told the same with or without one.
    for grid in [(1, 2, 3, 4), (), "4", 2.0]:
        with pytest.raises(TypeError, match=r"grid must be an int or a tuple of 1 to 3 ints"):
            k[grid]


async def test_a_broken_kernel_is_a_compile_error_and_the_pool_goes_on(cache_dir: Path) -> None:
    async with pool(cache_dir, workers=1) as p:
        with pytest.raises(acompile.CompileError) as info:
            await p.triton(broken_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64})
        err = info.value
        assert err.kernel == "broken_kernel" and err.backend == "triton"
        assert "undefined_name" in str(err) and "undefined_name" in err.log
        assert "broken_kernel" in str(err) and "cuda:90" in str(err)
        k = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
        assert k.cubin
        assert p.stats()["workers"]["restarts"] == {}
        # A failure is not cached: asking again compiles again and fails the same way.
        with pytest.raises(acompile.CompileError):
            await p.triton(broken_kernel, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64})


# asyncio only: the subject is what reaches the compiler, not the loop.
@asyncio_only
async def test_targets_and_options_reach_the_compiler(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        k80, k90 = await p.gather(
            acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}, target="cuda:80"),
            acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}, num_warps=8),
        )
    assert ".target sm_80" in k80.asm["ptx"] and k80.metadata.num_warps == 4
    assert ".target sm_90a" in k90.asm["ptx"] and k90.metadata.num_warps == 8
    assert k80.key != k90.key


# asyncio only: the subject is what the compiler and the cache make of the kernel, not the loop.
@asyncio_only
async def test_a_hip_kernel_compiles_and_comes_back_from_the_disk_cache(cache_dir: Path) -> None:
    """AMD's targets are compiled here (no GPU needed) and cached like CUDA's: their metadata
    has no CUDA launch flags, and the cached entry loads as it was compiled."""
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 256}, target="hip:gfx942")
    async with pool(cache_dir) as p:
        compiled, tier = await p.compile_with_tier(spec)
    assert tier == "compile" and str(compiled.target) == "hip:gfx942"
    assert compiled.cubin[:4] == b"\x7fELF" and "amdgcn" in compiled.asm
    async with pool(cache_dir, prestart=False) as p:
        cached, tier = await p.compile_with_tier(spec)
        assert p.stats()["cache"]["disk_corrupt"] == 0
    assert tier == "disk" and cached.cubin == compiled.cubin and cached.metadata == compiled.metadata


# asyncio only: the subject is the error a kernel's load gives, not the loop.
@asyncio_only
async def test_a_compiled_kernel_this_process_cannot_load_is_a_compile_error(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result Triton's loader here would not take (another Triton's metadata, say; faked by
    requiring a field no kernel has) is an AcompileError naming the kernel, not a bare
    ValueError out of the cache's internals."""
    from acompile._backends import _triton_load

    monkeypatch.setitem(_triton_load._FIELD_TYPES, "no_such_field", _triton_load._INT)
    for _ in range(2):
        async with pool(cache_dir, prestart=False) as p:
            with pytest.raises(
                acompile.CompileError, match=r"add_kernel compiled, .*cannot be loaded.*no_such_field"
            ) as caught:
                await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 256})
            # Not kept: the next pool compiles it again, and finds no damaged entry on its way.
            assert p.stats()["cache"]["disk_corrupt"] == 0 and p.stats()["compiled"] == 1
        assert caught.value.kernel == "add_kernel" and caught.value.backend == "triton"


async def test_the_switch_interval_is_short_while_kernels_are_parsed_and_put_back_after(
    cache_dir: Path,
) -> None:
    """Parsing a kernel (pure Python, on the pool's thread) competes with the event loop for the
    GIL: while it runs, the interpreter switches threads every 0.5 ms, not every 5, and what was
    set before is back after it; a value set meanwhile by someone else, or a shorter one, stays."""
    from acompile._backends import _triton_once

    seen: list[float] = []

    def work() -> str:
        seen.append(sys.getswitchinterval())
        return "parsed"

    def theirs() -> str:
        sys.setswitchinterval(0.002)  # the application's own, set while a parse runs
        return "parsed"

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert await _triton_once.once(("switch-test", 1), lambda: None, work) == "parsed"
        assert seen == [pytest.approx(0.0005)] and sys.getswitchinterval() == pytest.approx(0.005)
        await _triton_once.once(("switch-test", 2), lambda: None, theirs)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        sys.setswitchinterval(0.0001)  # shorter than ours: never raised
        seen.clear()
        await _triton_once.once(("switch-test", 3), lambda: None, work)
        assert seen == [pytest.approx(0.0001)] and sys.getswitchinterval() == pytest.approx(0.0001)
        # Put back exactly: 0.007 reads back as 0.006999999999999999, which set again would be
        # 6998 microseconds (the interpreter truncates).
        sys.setswitchinterval(0.007)
        users = sys.getswitchinterval()
        async with pool(cache_dir, prestart=False) as p:
            await p.triton(scale_add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
        assert sys.getswitchinterval() == users
    finally:
        sys.setswitchinterval(before)


_SOURCE = """
import triton
import triton.language as tl

@triton.jit
def doubled(x_ptr, n, BLOCK: tl.constexpr = 128):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2, mask=m)
"""


def test_pools_on_event_loops_in_several_threads_parse_the_same_kernel_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each thread's loop has its own pool; all ask for the same kernel while its parse runs
    (made slow, so that they overlap). Waiting for another loop's parse must not raise asyncio's
    'bound to a different event loop'."""
    import asyncio
    import time

    from acompile._backends import _triton_describe, forget_triton

    describe = _triton_describe._describe

    def slow_describe(fn: Any) -> dict[str, Any]:
        time.sleep(0.3)
        return describe(fn)

    monkeypatch.setattr(_triton_describe, "_describe", slow_describe)
    forget_triton()
    results: dict[int, str] = {}
    start = threading.Barrier(3)

    async def one(i: int) -> None:
        async with acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path / f"c{i}", prestart=False) as p:
            start.wait()
            k = await p.triton(add_kernel, signature=ADD_SIG, constexprs={"BLOCK": 64})
            # A source string too: its process, and the wait for it, are per loop as well.
            start.wait()
            s = await p.triton(_SOURCE, signature={"x_ptr": "*fp32", "n": "i32"})
            results[i] = f"{k.name} {s.name}"

    def run(i: int) -> None:
        try:
            asyncio.run(one(i))
        except BaseException as exc:  # reported below, with the thread's number
            results[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == dict.fromkeys(range(3), "add_kernel doubled"), results


async def test_gather_many_at_once_and_single_flight(cache_dir: Path) -> None:
    specs = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (64, 128, 256, 512)]
    async with pool(cache_dir) as p:
        kernels = await p.gather(*specs, *specs, *specs)
        stats = p.stats()
    assert [k.metadata.num_warps for k in kernels] == [4] * 12
    assert [k.key for k in kernels[:4]] == [k.key for k in kernels[4:8]] == [k.key for k in kernels[8:]]
    assert kernels[0] is kernels[4] is kernels[8]
    assert stats["compiled"] == 4 and stats["jobs"]["done"] == 4


async def test_gather_with_return_exceptions(cache_dir: Path) -> None:
    good = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    bad = acompile.TritonSpec(broken_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64})
    async with pool(cache_dir) as p:
        results = await p.gather(good, bad, return_exceptions=True)
        assert results[0].name == "add_kernel" and isinstance(results[1], acompile.CompileError)
        with pytest.raises(acompile.CompileError):
            await p.gather(good, bad)


async def test_a_cancelled_caller_leaves_the_shared_compile_to_the_others(cache_dir: Path) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 2048})
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        got: list[object] = []
        async with anyio.create_task_group() as tg:

            async def patient() -> None:
                got.append(await p.compile(spec))

            async def impatient() -> None:
                with anyio.fail_after(0.01):
                    await p.compile(spec)

            tg.start_soon(patient)
            await anyio.lowlevel.checkpoint()
            with pytest.raises(TimeoutError):
                await impatient()
        assert len(got) == 1 and got[0].name == "add_kernel"  # type: ignore[attr-defined]
        stats = p.stats()
        assert stats["workers"]["restarts"] == {} and stats["compiled"] == 1


async def test_when_every_caller_gives_up_the_compile_stops(cache_dir: Path) -> None:
    """A compile that would run for tens of seconds: once its only caller leaves, its worker (the
    only way to stop a compiler) is gone within seconds, long before the compile could end."""

    slow = acompile.TritonSpec(slow_to_compile_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"N": 600})
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        # Forked workers are the template's children (the template is ours).
        me = os.getpid()
        workers = [c for c in psutil.Process().children(recursive=True) if c.ppid() != me]
        assert len(workers) == 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(p.compile, slow)
            with anyio.fail_after(30):
                while p.stats()["jobs"]["running"] == 0:  # noqa: ASYNC110 - no event for it
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # the only caller leaves
        with anyio.fail_after(10):
            # The worker that ran it is gone (the compile was stopped, not left to finish), and
            # the pool says why.
            def stopped() -> bool:
                return gone(workers[0].pid) and p.stats()["workers"]["restarts"] == {"abandoned": 1}

            while not stopped():  # noqa: ASYNC110 - processes have no event to wait on
                await anyio.sleep(0.01)
        assert p.stats()["jobs"]["cancelled"] == 1
        # Nothing was cached, and the pool goes on with a fresh worker.
        k = await p.compile(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 4096}))
        assert k.cubin


async def test_environment_that_changes_code_is_in_the_key_and_reaches_the_worker(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 128})
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
        off = await p.compile(spec)
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
        on = await p.compile(spec)
    assert off.key != on.key
    # Set after the workers started: the worker compiled with the request's setting anyway.
    assert off.metadata.enable_fp_fusion is False and on.metadata.enable_fp_fusion is True


async def test_an_urgent_request_for_queued_warmup_work_jumps_the_queue(cache_dir: Path) -> None:
    warmup = [acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": b}) for b in (32, 64, 128, 256, 512, 1024)]
    finished: list[str] = []
    async with pool(cache_dir, workers=1) as p:
        await p.wait_ready()
        async with anyio.create_task_group() as tg:

            async def background(spec: acompile.TritonSpec) -> None:
                await p.compile(spec, background=True)
                finished.append(f"warmup{spec.constexprs['BLOCK']}")  # type: ignore[index]

            for spec in warmup:
                tg.start_soon(background, spec)
            with anyio.fail_after(30):
                while p.stats()["jobs"]["queued"] < 5:  # noqa: ASYNC110 - the queue has no event to wait on
                    await anyio.sleep(0.01)
            # The last queued warm-up spec, asked for by someone who waits for it.
            await p.compile(warmup[-1])
            finished.append("urgent")
    assert finished.index("urgent") <= 2, finished


async def test_a_request_asked_again_is_keyed_as_if_for_the_first_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path (the same kernel asked again) reuses the request keyed the first time. It must
    never hand one variant another's key: values Python holds equal (1, True, 1.0; 0.0 and -0.0)
    are other compiles, and an environment variable that changes a compile, or the kernel's source
    changed in place, makes another key. Each key is checked against one computed afresh."""
    from acompile._backends import _triton

    target = acompile.Target("cuda", 90)
    memo = tmp_path / "memo"
    memo.mkdir()

    async def twice(spec: acompile.TritonSpec) -> str:
        first = await _triton.prepare(spec, target, memo)
        again = await _triton.prepare(spec, target, memo)
        assert again.key == first.key == (await _triton._prepare(spec, target, memo)).key
        return first.key

    keys = [
        await twice(acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": value}))
        for value in (64, 1, True, 1.0, 0.0, -0.0)
    ]
    assert len(set(keys)) == len(keys), keys
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert await twice(spec) not in keys
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    assert await twice(spec) == keys[0]
    # The source changed in place (as Triton's own tools do): another key.
    source = tmp_path / "k.py"
    source.write_text(
        "import triton, triton.language as tl\n\n"
        "@triton.jit\ndef k(x_ptr, BLOCK: tl.constexpr):\n    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)\n"
    )
    import importlib.util

    loaded = importlib.util.spec_from_file_location("memo_kernel_for_test", source)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    fn = module.k
    before = await twice(acompile.TritonSpec(fn, {"x_ptr": "*fp32"}, {"BLOCK": 64}))
    fn._unsafe_update_src(fn.src.replace("1.0", "2.0"))
    assert await twice(acompile.TritonSpec(fn, {"x_ptr": "*fp32"}, {"BLOCK": 64})) != before
