"""Headers a C++ or CUDA source includes are inputs of its binary, though not of its key.

The key is known before anything compiles, so it holds the source, the options and the include
folders' paths, never what the headers hold. Instead the compile records every file the compiler
read besides the source (path, size, mtime, SHA-256), and an entry taken from the disk or the
shared tier is used only where each of them is still what it was: a changed, deleted or replaced
header makes the entry stale, a miss that is compiled again and replaces it. Real compilers.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import RedisServer

import acompile
from acompile._backends import _native, _native_worker  # the dependency rules, one at a time (below)
from acompile._cache import DiskTier, Entry, decode_entry

pytestmark = pytest.mark.anyio

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

SOURCE = '#include "answer.h"\nextern "C" int answer() { return ANSWER; }\n'
KERNEL = '#include "answer.h"\nextern "C" __global__ void put(int* x) { *x = ANSWER; }\n'


@pytest.fixture
def anyio_backend() -> str:
    # What is tested here is files and compilers, not the event loop: one loop is enough.
    return "asyncio"


def cpp_pool(cache_dir: Path, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=("cpp",), **kw)  # type: ignore[arg-type]


def cuda_pool(cache_dir: Path, **kw: object) -> acompile.CompilePool:
    return acompile.CompilePool(1, target="cuda:90", cache_dir=cache_dir, preload=("cuda",), **kw)  # type: ignore[arg-type]


def header(folder: Path, value: int, name: str = "answer.h") -> Path:
    """Write ``#define ANSWER value`` to ``folder/name``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#define ANSWER {value}\n")
    return path


def answer(library: acompile.SharedLibrary) -> int:
    value: int = library.answer()
    return value


def cache_stats(p: acompile.CompilePool) -> dict[str, Any]:
    return dict(p.stats()["cache"])


async def build(cache_dir: Path, include: Path) -> tuple[int, str, dict[str, Any]]:
    """One pool on ``cache_dir``: what ``answer()`` returns, where the library came from, and
    the pool's ``stats()["cache"]``."""
    async with cpp_pool(cache_dir) as p:
        library, tier = await p.compile_with_tier(acompile.CppSpec(SOURCE, include_dirs=[str(include)]))
        stats = cache_stats(p)
    return answer(library), tier, stats


# --- C++ (the system compiler, -MD) ---------------------------------------------------------------


async def test_a_changed_header_is_compiled_again_and_its_new_value_served(tmp_path: Path) -> None:
    """The reported bug: the header said 42, then 7; the next pool found the entry on disk
    (same key) and its library returned 42. Now the entry is stale: compiled again (counted in
    ``stale``), the library returns 7, and the fresh entry replaces the stale one on disk."""
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 42)
    assert (await build(cache, include))[:2] == (42, "compile")
    header(include, 7)
    value, tier, stats = await build(cache, include)
    assert (value, tier) == (7, "compile")
    assert (stats["stale"], stats["misses"], stats["disk_corrupt"]) == (1, 1, 0)
    # The replacement is what the next pool finds, and uses as it is.
    value, tier, stats = await build(cache, include)
    assert (value, tier, stats["stale"]) == (7, "disk", 0)


async def test_a_header_touched_but_not_changed_is_still_a_hit(tmp_path: Path) -> None:
    """A new mtime with the same bytes (a checkout, a copy, ``touch``): the header is hashed
    again, its digest is the recorded one, and the entry is used."""
    cache, include = tmp_path / "cache", tmp_path / "include"
    path = header(include, 42)
    await build(cache, include)
    later = time.time_ns() + 60 * 10**9
    os.utime(path, ns=(later, later))
    assert (await build(cache, include))[:2] == (42, "disk")
    # Rewritten with the same text: a new inode and mtime, the same content.
    path.unlink()
    header(include, 42)
    value, tier, stats = await build(cache, include)
    assert (value, tier, stats["stale"]) == (42, "disk", 0)


async def test_a_deleted_header_makes_the_entry_stale_and_the_compiler_says_why(tmp_path: Path) -> None:
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 42)
    await build(cache, include)
    (include / "answer.h").unlink()
    async with cpp_pool(cache) as p:
        with pytest.raises(acompile.CppCompileError, match=r"answer\.h"):
            await p.cpp(SOURCE, include_dirs=[str(include)])
        assert cache_stats(p)["stale"] == 1


async def test_a_change_in_a_header_that_a_header_includes_is_seen(tmp_path: Path) -> None:
    cache, include = tmp_path / "cache", tmp_path / "include"
    include.mkdir()
    (include / "outer.h").write_text('#include "inner/answer.h"\n')
    header(include / "inner", 42)
    source = '#include "outer.h"\nextern "C" int answer() { return ANSWER; }\n'
    async with cpp_pool(cache) as p:
        assert answer(await p.cpp(source, include_dirs=[str(include)])) == 42
    header(include / "inner", 7)
    async with cpp_pool(cache) as p:
        library, tier = await p.compile_with_tier(acompile.CppSpec(source, include_dirs=[str(include)]))
    assert (answer(library), tier) == (7, "compile")


async def test_system_headers_are_recorded_with_the_source_s_own(tmp_path: Path) -> None:
    """``<vector>`` and ``<algorithm>`` pull in a hundred-odd headers of the C++ library: each is
    recorded (a library upgrade changes them, and the compiler's version is all the key holds
    of it); the source itself, compiled from a work folder that is gone, is not."""
    include = tmp_path / "include"
    header(include, 42)
    source = "#include <vector>\n#include <algorithm>\n" + SOURCE
    async with cpp_pool(tmp_path / "cache") as p:
        library = await p.cpp(source, include_dirs=[str(include)])
    entry = decode_entry(DiskTier(tmp_path / "cache").path(library.key).read_bytes(), library.key)
    paths = [path for path, *_ in entry.meta["deps"]]
    assert str(include / "answer.h") in paths
    assert any(path.endswith("/vector") for path in paths) and any(p.endswith("/algorithm") for p in paths)
    assert len(paths) > 50 and not any(p.endswith(".cpp") for p in paths)
    assert all(len(d) == 4 and len(d[3]) == 64 for d in entry.meta["deps"])


async def test_an_entry_recorded_before_dependencies_were_is_compiled_once_more(tmp_path: Path) -> None:
    """Nothing says which headers it was built from: it cannot be verified, so it is stale."""
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 42)
    async with cpp_pool(cache) as p:
        library = await p.cpp(SOURCE, include_dirs=[str(include)])
    path = DiskTier(cache).path(library.key)
    old = decode_entry(path.read_bytes(), library.key)
    del old.meta["deps"]
    path.write_bytes(Entry(old.key, old.backend, old.name, old.blobs, old.meta).encode())
    assert (await build(cache, include))[:2] == (42, "compile")
    assert (await build(cache, include))[:2] == (42, "disk")


# --- nvcc (-MD) and NVRTC (its includes, resolved as it resolves them) -----------------------------


@needs_nvcc
async def test_nvcc_libraries_see_a_changed_header_of_an_include_folder(tmp_path: Path) -> None:
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 42)
    options = [f"-I{include}"]
    async with cuda_pool(cache) as p:
        first = await p.cuda(SOURCE, output="so", options=options)
        assert isinstance(first, acompile.SharedLibrary) and answer(first) == 42
    header(include, 7)
    async with cuda_pool(cache) as p:
        library, tier = await p.compile_with_tier(acompile.CudaSpec(SOURCE, output="so", options=options))
        stats = cache_stats(p)
    assert (answer(library), tier, stats["stale"]) == (7, "compile", 1)
    async with cuda_pool(cache) as p:
        library, tier = await p.compile_with_tier(acompile.CudaSpec(SOURCE, output="so", options=options))
    assert (answer(library), tier) == (7, "disk")


async def test_nvrtc_modules_see_a_changed_header_and_one_it_includes(tmp_path: Path) -> None:
    cache, include = tmp_path / "cache", tmp_path / "include"
    include.mkdir()
    (include / "answer.h").write_text('#include "deeper.h"\n#define ANSWER DEEPER\n')
    (include / "deeper.h").write_text("#define DEEPER 4242\n")
    spec = acompile.CudaSpec(KERNEL, output="ptx", arch="sm_90", options=[f"--include-path={include}"])

    async def ptx() -> tuple[str, str]:
        async with cuda_pool(cache) as p:
            module, tier = await p.compile_with_tier(spec)
        assert isinstance(module, acompile.CudaModule) and module.ptx is not None
        return module.ptx, tier

    text, tier = await ptx()
    assert tier == "compile" and ", 4242;" in text
    text, tier = await ptx()
    assert tier == "disk" and ", 4242;" in text
    (include / "deeper.h").write_text("#define DEEPER 777\n")
    text, tier = await ptx()
    assert tier == "compile" and ", 777;" in text and ", 4242;" not in text


async def test_an_nvrtc_include_named_by_a_macro_is_followed_through_its_definitions(tmp_path: Path) -> None:
    """``#include WHICH`` (as Thrust's are): every definition of the macro, in any file seen or
    in a ``-D`` option, names a header to record."""
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 4242, "first.h")
    header(include, 777, "second.h")
    source = (
        '#ifdef SECOND\n#define WHICH HEADER\n#else\n#define WHICH "first.h"\n#endif\n#include WHICH\n'
        'extern "C" __global__ void put(int* x) { *x = ANSWER; }\n'
    )
    options = [f"-I{include}", "-DSECOND", '-DHEADER="second.h"']

    async def ptx() -> tuple[str, str]:
        async with cuda_pool(cache) as p:
            module, tier = await p.compile_with_tier(
                acompile.CudaSpec(source, output="ptx", arch="sm_90", options=options)
            )
        assert isinstance(module, acompile.CudaModule) and module.ptx is not None
        return module.ptx, tier

    text, tier = await ptx()
    assert tier == "compile" and ", 777;" in text
    header(include, 4242, "first.h")  # rewritten, same bytes: still a hit
    assert (await ptx())[1] == "disk"
    header(include, 555, "second.h")
    text, tier = await ptx()
    assert tier == "compile" and ", 555;" in text


async def test_an_nvrtc_include_only_a_preprocessor_can_follow_is_never_reused(tmp_path: Path) -> None:
    """``#include STR(name)``: a function-like macro. The entry's headers are not known, so it
    serves the request that compiled it and is never taken from a cache tier (correct, if
    slower)."""
    cache, include = tmp_path / "cache", tmp_path / "include"
    header(include, 42)
    source = (
        "#define STR(x) #x\n#define XSTR(x) STR(x)\n#include XSTR(answer.h)\n"
        'extern "C" __global__ void put(int* x) { *x = ANSWER; }\n'
    )
    spec = acompile.CudaSpec(source, output="ptx", arch="sm_90", options=[f"-I{include}"])
    for _ in range(2):
        async with cuda_pool(cache) as p:
            module, tier = await p.compile_with_tier(spec)
        assert tier == "compile" and isinstance(module, acompile.CudaModule) and module.ptx is not None
        assert ", 42;" in module.ptx


def test_the_nvrtc_resolver_finds_cccl_and_thrust_headers_named_by_macros() -> None:
    """Where the CUDA toolkit is installed: CUB pulls in Thrust, whose includes are macros."""
    cccl = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if not (cccl / "cccl" / "cub").is_dir():
        pytest.skip("no CCCL headers here")
    paths, unknown = _native_worker.nvrtc_includes(
        "#include <cub/block/block_reduce.cuh>\n", [f"-I{cccl}", f"-I{cccl / 'cccl'}"], os.getcwd()
    )
    assert unknown is None and len(paths) > 100
    assert any(p.endswith("thrust/system/cuda/detail/execution_policy.h") for p in paths)


# --- the shared tier: another machine's entry ------------------------------------------------------


async def test_a_shared_entry_is_used_where_the_headers_hold_the_same_bytes(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Another machine (a cache folder of its own) has the header at the same path, written at
    another time: the same bytes, so the shared entry is used. Where the bytes differ, the entry
    is stale there: compiled again, and the fresh entry replaces it in the shared tier."""
    include = tmp_path / "include"
    shared = {
        "shared_cache": acompile.SharedCache(redis_server.url, signing_key=b"a-signing-key-for-the-tests")
    }

    async def on(machine: str) -> tuple[int, str]:
        async with cpp_pool(tmp_path / machine, **shared) as p:
            library, tier = await p.compile_with_tier(acompile.CppSpec(SOURCE, include_dirs=[str(include)]))
        return answer(library), tier

    header(include, 42)
    assert await on("a") == (42, "compile")
    path = header(include, 42)
    later = time.time_ns() + 60 * 10**9
    os.utime(path, ns=(later, later))
    assert await on("b") == (42, "shared")
    header(include, 7)
    assert await on("c") == (7, "compile")
    assert await on("d") == (7, "shared")  # c's entry replaced a's


# --- the parts, one at a time --------------------------------------------------------------------


def test_a_make_rule_is_read_with_its_escapes() -> None:
    rule = "dep: /src/x.cpp /usr/include/a\\ b.h \\\n /opt/c$$d.h /opt/e\\#f.h\n\n/opt/g.h:\n"
    assert _native_worker.depfile_paths(rule) == [
        "/src/x.cpp",
        "/usr/include/a b.h",
        "/opt/c$d.h",
        "/opt/e#f.h",
    ]


def test_a_header_changed_while_it_was_compiled_is_not_trusted_later(tmp_path: Path) -> None:
    """Its mtime is after the compile began: the compiler may have read the old bytes or the
    new ones, so the entry records that its headers are not known, and is never reused."""
    path = header(tmp_path, 1)
    meta = _native_worker.record_dependencies([str(path)], started_ns=time.time_ns() - 10**9)
    assert meta["deps_unknown"] and "while" in meta["deps_unknown"]
    assert _native.stale_reason(meta) is not None
    meta = _native_worker.record_dependencies([str(path)], started_ns=time.time_ns() + 10**9)
    assert "deps_unknown" not in meta and _native.stale_reason(meta) is None
    path.write_text("#define ANSWER 2\n")  # same size, another digest
    os.utime(path, ns=(meta["deps"][0][2], meta["deps"][0][2]))  # and the recorded mtime back
    # Size and mtime as recorded: trusted, unread (the documented limit of the one-stat check).
    assert _native.stale_reason(meta) is None
    os.utime(path, ns=(1, 1))
    assert "changed" in (_native.stale_reason(meta) or "")


def test_a_dependency_that_is_not_a_regular_file_is_stale_and_never_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    meta = {"deps": [[str(fifo), 10, 1, "0" * 64]]}
    assert "not a regular file" in (_native.stale_reason(meta) or "")
    assert "malformed" in (_native.stale_reason({"deps": [["x", "y"]]}) or "")
    assert _native.stale_reason({}) is not None  # recorded before dependencies were
