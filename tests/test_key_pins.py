"""The cache never serves a binary built from other inputs.

Each test here pins one part of that promise, and fails where the part is missing:

- Triton's compiler files (the digest of its wheel's RECORD) are in every key;
- a Triton kernel is keyed with the helpers it calls and the constexpr globals it reads, not
  by its own source alone;
- an entry read from disk is checked against its checksum, even where the changed byte leaves
  a binary that still loads;
- the memory tier keeps no more kernels than ``memory_cache_size``;
- processes racing on one key compile it once (fleet single flight through the shared tier).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import triton
from conftest import TARGET, RedisServer, subprocess_env
from kernels_for_tests import ADD_SIG, add_kernel

import acompile
from acompile._backends import forget_triton, prepare_triton
from acompile._cache import DiskTier, decode_entry

pytestmark = pytest.mark.anyio


def pool(cache_dir: Path, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, **kw)


def copy_entries(source: Path, destination: Path) -> None:
    """The entries of one cache folder, and nothing else of it, into a fresh one: what a bundle
    or a shared tier carries from one machine to another."""
    shutil.copytree(DiskTier(source).entries, DiskTier(destination).entries)


# --- Triton's compiler files ----------------------------------------------------------------------

# Files of Triton's compilers, one from each folder whose RECORD hashes make the digest: the
# library, the compiler driver, the CUDA backend.
COMPILER_FILES = (
    "triton/_C/libtriton.so",
    "triton/compiler/compiler.py",
    "triton/backends/nvidia/compiler.py",
    "triton/language/core.py",
)


def triton_metadata_with_another(changed: str, folder: Path) -> Path:
    """A folder holding Triton's installed metadata (METADATA, RECORD) as another build of the
    same release would have it: the hash RECORD gives the file ``changed`` differs. Put first on
    ``sys.path``, it is the metadata ``importlib.metadata`` finds for Triton."""
    dist = importlib.metadata.distribution("triton")
    record = next(f for f in dist.files or [] if f.name == "RECORD")
    installed = Path(str(record.locate())).parent
    info = folder / installed.name
    info.mkdir(parents=True)
    shutil.copy(installed / "METADATA", info / "METADATA")
    other = base64.urlsafe_b64encode(hashlib.sha256(b"another build").digest()).rstrip(b"=").decode()
    lines = []
    for line in (installed / "RECORD").read_text().splitlines():
        name, digest, size = line.rsplit(",", 2)
        if name == changed:
            assert digest.startswith("sha256=") and digest != f"sha256={other}"
            line = f"{name},sha256={other},{size}"
        lines.append(line)
    assert sum(line.startswith(f"{changed},") for line in lines) == 1
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return folder


@contextlib.contextmanager
def triton_with_another(changed: str, folder: Path) -> Iterator[None]:
    """This process sees a Triton installation whose file ``changed`` differs, as far as its
    metadata tells: the toolchain is worked out afresh, not taken from this process's memo."""
    with pytest.MonkeyPatch.context() as m:
        m.syspath_prepend(str(triton_metadata_with_another(changed, folder)))
        forget_triton()
        try:
            yield
        finally:
            forget_triton()  # what the other installation made this process remember


async def test_an_entry_built_by_other_triton_compiler_files_of_the_same_release_is_not_served(
    tmp_path: Path,
) -> None:
    """Two installations of one Triton release whose compiler files differ (a patched backend, a
    rebuilt library) key a kernel differently: the entries one built, carried over by a bundle
    or a shared tier, are not served to the other, which compiles the kernel itself. The keys
    differ by the digest of the compiler files alone."""
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 32})
    target = acompile.Target("cuda", 90)
    async with pool(tmp_path / "a") as p:
        built = await p.compile(spec)
    parts = (await prepare_triton(spec, target, tmp_path / "memo")).key_parts
    keys = {built.key}
    for i, changed in enumerate(COMPILER_FILES):
        with triton_with_another(changed, tmp_path / f"other{i}"):
            request = await prepare_triton(spec, target, tmp_path / f"memo{i}")
        keys.add(request.key)
        tools, other_tools = parts["toolchain"], request.key_parts["toolchain"]
        differ = {
            name for name in tools.keys() | other_tools.keys() if tools.get(name) != other_tools.get(name)
        }
        assert (changed, differ) == (changed, {"triton_files"})
        assert {**request.key_parts, "toolchain": None} == {**parts, "toolchain": None}
    assert len(keys) == 1 + len(COMPILER_FILES)
    assert parts["toolchain"]["triton"] == triton.__version__

    copy_entries(tmp_path / "a", tmp_path / "b")
    with triton_with_another(COMPILER_FILES[-1], tmp_path / "other-pool"):
        async with pool(tmp_path / "b") as p:
            again, tier = await p.compile_with_tier(spec)
    assert tier == "compile" and again.key != built.key


# --- a kernel's helpers and globals ---------------------------------------------------------------

# One kernel, in three versions of its module: as first written, with the helper it calls
# changed, and with the constexpr global it reads changed. The kernel's own source and its line
# stay the same in all three.
KERNEL_MODULE = """
import triton
import triton.language as tl

SCALE: tl.constexpr = tl.constexpr({scale})


@triton.jit
def _shift(x):
    return x + {shift}


@triton.jit
def pinned_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _shift(tl.load(x_ptr + offs, mask=mask)) * SCALE, mask=mask)
"""

VERSIONS = {
    "first": {"scale": "3.0", "shift": "1.0"},
    "helper changed": {"scale": "3.0", "shift": "2.5"},
    "global changed": {"scale": "5.25", "shift": "1.0"},
}
PINNED_SIG = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}


def load_version(folder: Path, scale: str, shift: str) -> ModuleType:
    """The module as a checkout in ``folder`` has it: same module name, same file name."""
    folder.mkdir()
    path = folder / "pinned_kernels.py"
    path.write_text(KERNEL_MODULE.format(scale=scale, shift=shift))
    spec = importlib.util.spec_from_file_location("pinned_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_kernel_is_keyed_with_the_helpers_it_calls_and_the_globals_it_reads(
    tmp_path: Path,
) -> None:
    """A kernel whose own source is unchanged, but whose helper or constexpr global is, is
    another kernel: it gets its own key and is compiled, never served the binary of the first
    version. A fresh process finds each version's own binary on disk."""
    kernels = {
        name: load_version(tmp_path / f"v{i}", **parts).pinned_kernel
        for i, (name, parts) in enumerate(VERSIONS.items())
    }
    assert len({k.fn.__code__.co_code for k in kernels.values()}) == 1  # the same kernel body
    specs = {name: acompile.TritonSpec(k, PINNED_SIG, {"BLOCK": 64}) for name, k in kernels.items()}
    async with pool(tmp_path / "cache") as p:
        built = {name: await p.compile_with_tier(s) for name, s in specs.items()}
    assert {name: tier for name, (_, tier) in built.items()} == dict.fromkeys(VERSIONS, "compile")
    assert len({k.key for k, _ in built.values()}) == len(VERSIONS)
    ptx = {name: k.asm["ptx"] for name, (k, _) in built.items()}
    # Each binary is its own version's: 1.0 + x times 3.0; 2.5 + x; times 5.25.
    assert "0f40400000" in ptx["first"] and "0f3F800000" in ptx["first"]
    assert "0f40200000" in ptx["helper changed"] and "0f40A80000" in ptx["global changed"]
    async with pool(tmp_path / "cache", prestart=False) as p:
        served = {name: await p.compile_with_tier(s) for name, s in specs.items()}
    assert {name: (k.key, tier) for name, (k, tier) in served.items()} == {
        name: (k.key, "disk") for name, (k, _) in built.items()
    }
    assert {name: k.asm["ptx"] for name, (k, _) in served.items()} == ptx


# --- the checksum of disk entries -----------------------------------------------------------------

GREETING = r"""
extern "C" const char* greeting() { return "built from this source"; }
"""


async def test_a_disk_entry_whose_library_was_changed_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """One byte of a cached library changed where the library still loads and runs (a letter of
    a string it returns): only the entry's checksum can tell. The entry is a miss, counted as
    damaged, and the library is built again from its source; the new entry replaces it."""
    async with pool(tmp_path / "a", preload=("cpp",)) as p:
        first = await p.cpp(GREETING)
    path = DiskTier(tmp_path / "a").path(first.key)
    data = bytearray(path.read_bytes())
    # Where the library's bytes start in the entry: past the header, and any blob before it.
    entry = decode_entry(bytes(data), first.key)
    offset = len(data) - entry.size  # the blobs end the entry, in their order
    for name, blob in entry.blobs.items():
        if name == "so":
            break
        offset += len(blob)
    at = offset + entry.blobs["so"].index(b"built from this source")
    assert data[at : at + 5] == b"built"
    data[at] = ord("B")  # still ASCII, still a library that loads
    path.write_bytes(bytes(data))
    # In a cache folder of its own, the library is published at a path no library of this
    # process was loaded from: what it returns is what the entry held.
    copy_entries(tmp_path / "a", tmp_path / "b")
    async with pool(tmp_path / "b", preload=("cpp",)) as p:
        again, tier = await p.compile_with_tier(acompile.CppSpec(GREETING))
        stats = p.stats()
    again.greeting.restype = ctypes.c_char_p
    assert (tier, again.greeting()) == ("compile", b"built from this source")
    assert (stats["cache"]["disk_corrupt"], stats["cache"]["misses"], stats["compiled"]) == (1, 1, 1)
    rebuilt = decode_entry(DiskTier(tmp_path / "b").path(first.key).read_bytes(), first.key)  # intact
    assert b"built from this source" in rebuilt.blobs["so"]


# --- the memory tier's size -----------------------------------------------------------------------


def library(i: int) -> str:
    return f'extern "C" int which() {{ return {i}; }}\n'


async def test_the_memory_tier_keeps_memory_cache_size_kernels_and_none_with_zero(tmp_path: Path) -> None:
    """``memory_cache_size=2`` keeps the two kernels used last: a third pushes out the one used
    least recently, which then comes from disk. With 0 the memory tier keeps nothing (each
    repeat is a disk hit); a negative size is refused."""
    async with pool(tmp_path / "cache", preload=("cpp",), memory_cache_size=2) as p:
        for i in range(3):
            await p.cpp(library(i))
        kept = p.stats()["cache"]["memory_entries"]
        tiers = [(await p.compile_with_tier(acompile.CppSpec(library(i))))[1] for i in (2, 1, 0, 0)]
        assert (kept, tiers) == (2, ["memory", "memory", "disk", "memory"])
        assert p.stats()["cache"]["memory_entries"] == 2
    async with pool(tmp_path / "cache", preload=("cpp",), memory_cache_size=0) as p:
        tiers = [(await p.compile_with_tier(acompile.CppSpec(library(0))))[1] for _ in range(3)]
        stats = p.stats()["cache"]
    assert (tiers, stats["memory_entries"], stats["hits_memory"]) == (["disk"] * 3, 0, 0)
    with pytest.raises(ValueError, match="memory_cache_size"):
        pool(tmp_path / "cache", memory_cache_size=-1)


# --- fleet single flight --------------------------------------------------------------------------

RACER = """
import hashlib, json, os, sys, anyio, acompile
from kernels_for_tests import slow_to_compile_kernel

async def main():
    cache_dir, url, ready, go = sys.argv[1:5]
    shared = acompile.SharedCache(url, signing_key="a-signing-key-for-the-tests")
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, shared_cache=shared) as p:
        await p.wait_ready()
        await p.share(["0" * 64])  # connects to the shared tier: a look-up, nothing to publish
        open(ready, "w").close()
        while not os.path.exists(go):
            await anyio.sleep(0.005)
        spec = acompile.TritonSpec(slow_to_compile_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"N": 128})
        k, tier = await p.compile_with_tier(spec)
    print(json.dumps({"key": k.key, "tier": tier, "cubin": hashlib.sha256(k.cubin).hexdigest(),
                      "compiled": p.stats()["compiled"]}))

anyio.run(main)
"""


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_four_processes_racing_on_one_key_compile_it_once(tmp_path: Path, redis_server: RedisServer) -> None:
    """Four replicas, each with its own disk and one shared tier, ask for the same kernel at the
    same moment: one compiles it; the three others wait for its entry and take it from the
    shared tier instead of compiling it too. All four hold the same binary, each on its disk."""
    go = tmp_path / "go"

    def stderr_tails() -> list[str]:
        return [(tmp_path / f"err{i}").read_text()[-2000:] for i in range(4)]

    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(4):
            args = [tmp_path / f"cache{i}", redis_server.url, tmp_path / f"ready{i}", go]
            proc = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(RACER), *map(str, args)],
                stdout=stack.enter_context(open(tmp_path / f"out{i}", "w")),
                stderr=stack.enter_context(open(tmp_path / f"err{i}", "w")),
                env=subprocess_env(),
            )
            stack.callback(stop, proc)
            procs.append(proc)
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"ready{i}").exists() for i in range(4)):
            assert all(p.poll() is None for p in procs), stderr_tails()
            assert time.monotonic() < deadline, "the replicas did not start"
            time.sleep(0.01)
        go.touch()  # all four ask now
        for p in procs:
            p.wait(timeout=180)
    assert all(p.returncode == 0 for p in procs), stderr_tails()
    results = [json.loads((tmp_path / f"out{i}").read_text().strip().splitlines()[-1]) for i in range(4)]
    assert sorted(r["tier"] for r in results) == ["compile", "shared", "shared", "shared"], results
    assert sum(r["compiled"] for r in results) == 1, results
    [key] = {r["key"] for r in results}
    assert len({r["cubin"] for r in results}) == 1
    for i in range(4):
        decode_entry(DiskTier(tmp_path / f"cache{i}").path(key).read_bytes(), key)


# --- C++ and CUDA: the options and the compiler -----------------------------------------------------

ANSWER_CPP = 'extern "C" int answer() { return ANSWER; }\n'


async def test_a_cpp_library_is_keyed_with_its_compile_options(tmp_path: Path) -> None:
    """``-DANSWER=1`` and ``-DANSWER=2`` are two libraries: the second is compiled, not served
    the first one's (and a CUDA source's options are in its key alike)."""
    async with pool(tmp_path / "c") as p:
        one = await p.cpp(ANSWER_CPP, options=["-DANSWER=1"])
        two, tier = await p.compile_with_tier(acompile.CppSpec(ANSWER_CPP, ("-DANSWER=2",)))
        cuda = 'extern "C" __global__ void k(int *x) { *x = ANSWER; }\n'
        first = await p.cuda(cuda, options=["-DANSWER=1"], arch="sm_90")
        second, cuda_tier = await p.compile_with_tier(
            acompile.CudaSpec(cuda, options=("-DANSWER=2",), arch="sm_90")
        )
    assert tier == "compile" and (one.answer(), two.answer()) == (1, 2)
    assert cuda_tier == "compile" and first.key != second.key


def test_a_cpp_library_is_keyed_with_its_compilers_version(tmp_path: Path) -> None:
    """The same source and options through a compiler that says another version (``$CXX``: a
    wrapper around the same g++, as an upgraded compiler would be): compiled again, not served
    from the cache folder the first one filled."""
    wrapper = tmp_path / "cxx"
    wrapper.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "g++ (acompile test) 99.1.0"; exit 0; fi\nexec g++ "$@"\n'
    )
    wrapper.chmod(0o755)
    code = f"""
import anyio, acompile
async def main():
    async with acompile.CompilePool(1, target="cuda:90", cache_dir={str(tmp_path / "c")!r}) as p:
        lib, tier = await p.compile_with_tier(acompile.CppSpec({ANSWER_CPP!r}, ("-DANSWER=3",)))
        print(tier, lib.answer())
anyio.run(main)
"""
    tiers = []
    for cxx in ("g++", str(wrapper), str(wrapper)):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(CXX=cxx),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        tiers.append(done.stdout.split())
    assert tiers == [["compile", "3"], ["compile", "3"], ["disk", "3"]]


async def test_triton_settings_outside_triton_star_that_change_a_compile_are_in_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton reads ``PTXAS_OPTIONS`` (and lists it, with the others it reads outside
    ``TRITON_*``, as changing a compile): a kernel compiled with it set is another entry."""
    spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64})
    async with pool(tmp_path / "c") as p:
        _, plain = await p.compile_with_tier(spec)
        monkeypatch.setenv("PTXAS_OPTIONS", "--warn-on-spills")
        _, with_options = await p.compile_with_tier(spec)
        monkeypatch.delenv("PTXAS_OPTIONS")
        _, again = await p.compile_with_tier(spec)
    assert (plain, with_options, again) == ("compile", "compile", "memory")


def test_every_memo_of_tritons_parent_half_is_one_that_forgetting_empties() -> None:
    """``forget_triton()`` empties every memo of Triton's parent half: each registers itself where
    it is made, and a new module-level memo that does not is found here (a list of them kept in
    one function missed new ones)."""
    import collections
    import importlib
    import sys

    import acompile._backends._triton  # noqa: F401 (with every module of its parent half)
    from acompile._backends import _memos

    registered = {id(getattr(forget, "__self__", forget)) for forget in _memos._FORGETTERS}
    # Kept apart, on purpose: the worker half's built kernels and the files whose lines it
    # registered (a worker's, not the parent's); the toolchain's figures, forgotten under their
    # lock by their module's own forget(); and the toolchain held in a global, forgotten by the
    # function that sets it (both registered).
    apart = {
        ("acompile._backends._triton_source", "_materialized"),
        ("acompile._backends._triton_source", "_stand_ins"),
        ("acompile._backends._triton_toolchain", "_memo"),
        ("acompile._backends._triton", "_toolchain_memo"),
    }
    unregistered = [
        (module, name)
        for module in sorted(m for m in sys.modules if m.startswith("acompile._backends._triton"))
        for name, value in vars(importlib.import_module(module)).items()
        if name.startswith("_")
        and not name.startswith("__")
        and not name.isupper()
        and (isinstance(value, (dict, set, list, collections.OrderedDict)) or hasattr(value, "cache_clear"))
        and id(value) not in registered
        and (module, name) not in apart
    ]
    assert not unregistered, f"memos forget_triton() would not empty: {unregistered}"
    spec_module = importlib.import_module("acompile._backends._triton_spec")
    spec_module._option_names_memo["probe"] = frozenset()
    forget_triton()
    assert "probe" not in spec_module._option_names_memo
