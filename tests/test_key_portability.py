"""A kernel's key does not depend on where its file lives: a library installed in another folder,
or a checkout moved, finds the kernels an earlier process compiled.

docs/caching.md promises that no machine path enters the key. It does not promise that a kernel
passed as a source string shares its key with the same kernel in a file (Triton's key of a
function includes its line number, and the string is its own file): a source-string kernel's
key is checked to be stable across processes and working directories instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import subprocess_env

KERNEL_MODULE = '''
"""Kernels of a library, wherever it is installed."""

import triton
import triton.language as tl

OFFSET: tl.constexpr = tl.constexpr(2)


@triton.jit
def _shifted(x):
    return x + OFFSET


@triton.jit
def shift_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _shifted(tl.load(x_ptr + offs, mask=mask)), mask=mask)
'''

SIGNATURE = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}

FILE_SCRIPT = """
import json, sys, anyio, acompile
from portable_kernels import shift_kernel

async def main():
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=sys.argv[1], prestart=False) as p:
        spec = acompile.TritonSpec(shift_kernel, {signature}, {{"BLOCK": 128}})
        k, tier = await p.compile_with_tier(spec)
        print(json.dumps({{"key": k.key, "tier": tier, "file": shift_kernel.fn.__code__.co_filename}}))

anyio.run(main)
"""

SOURCE_SCRIPT = """
import json, sys, anyio, acompile

async def main():
    async with acompile.CompilePool(1, target="cuda:90", cache_dir=sys.argv[1], prestart=False) as p:
        source = open(sys.argv[2]).read()
        spec = acompile.TritonSpec(source, {signature}, {{"BLOCK": 128}}, kernel_name="shift_kernel")
        k, tier = await p.compile_with_tier(spec)
        print(json.dumps({{"key": k.key, "tier": tier}}))

anyio.run(main)
"""


def run_in_fresh_process(script: str, cwd: Path, *args: object, path: Path | None = None) -> dict[str, str]:
    env = subprocess_env()
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script.format(signature=SIGNATURE)), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads(out.stdout)
    return result


def test_moving_the_kernels_file_keeps_its_key_and_its_cache_entry(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    first = tmp_path / "site-a" / "lib"
    first.mkdir(parents=True)
    (first / "portable_kernels.py").write_text(KERNEL_MODULE)
    before = run_in_fresh_process(FILE_SCRIPT, first, cache_dir, path=first)

    moved = tmp_path / "elsewhere" / "deeper" / "lib"
    moved.parent.mkdir(parents=True)
    shutil.move(first, moved)
    assert not (first / "portable_kernels.py").exists()
    after = run_in_fresh_process(FILE_SCRIPT, tmp_path, cache_dir, path=moved)

    assert before["file"] != after["file"] and after["file"].startswith(str(moved))
    assert before["tier"] == "compile"
    assert after == {**before, "tier": "disk", "file": after["file"]}


def test_a_source_string_kernel_keeps_its_key_across_processes_and_folders(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    text = tmp_path / "a" / "kernel_source.txt"
    text.parent.mkdir()
    text.write_text(KERNEL_MODULE)
    before = run_in_fresh_process(SOURCE_SCRIPT, text.parent, cache_dir, text)
    moved = tmp_path / "b" / "elsewhere.txt"
    moved.parent.mkdir()
    shutil.move(text, moved)
    after = run_in_fresh_process(SOURCE_SCRIPT, tmp_path, cache_dir, moved)
    assert (before["tier"], after["tier"]) == ("compile", "disk")
    assert after["key"] == before["key"]
