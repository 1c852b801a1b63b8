"""A user's type checker sees acompile's types through an editable install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

USER_SCRIPT = """
import acompile

SRC = "__global__ void k(float* x) { x[0] = 1.0f; }"


async def main() -> None:
    async with acompile.CompilePool(target="cuda:90") as pool:
        spec = acompile.TritonSpec("...", {"x": "*fp32"}, kernel_name="k")
        reveal_type(await pool.triton("...", signature={"x": "*fp32"}))
        reveal_type(await pool.cuda(SRC))
        reveal_type(await pool.cuda(SRC, output="ptx"))
        reveal_type(await pool.cuda(SRC, output="so"))
        reveal_type(await pool.cuda(SRC, output="o"))
        reveal_type(await pool.cpp("int f() { return 1; }"))
        reveal_type(await pool.gather(spec, spec))
        reveal_type(await pool.gather(spec, return_exceptions=True))
        reveal_type(await pool.compile(spec))
        reveal_type(pool.stats()["cache"]["hits_shared"])
        pool.stats()["no_such_field"]
"""


def test_mypy_finds_acompile_in_an_editable_install(tmp_path: Path) -> None:
    # The project as it is, installed the way the README says (`pip install -e .`) into a fresh
    # environment; a copy, so that the install's by-products stay out of the working tree.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "acompile", project / "acompile", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "-e",
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    user = tmp_path / "user"  # somewhere else: not the project's folder
    user.mkdir()
    (user / "script.py").write_text(textwrap.dedent(USER_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", str(python), "--no-incremental", "script.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=user,
        env=env,
    )
    # (older mypy versions spell builtins with their module)
    revealed = [t.replace("builtins.", "") for t in re.findall(r'Revealed type is "(.*)"', out.stdout)]
    assert "Cannot find implementation" not in out.stdout, out.stdout
    assert revealed[:10] == [
        "acompile._backends._triton_kernel.TritonKernel",
        "acompile._backends._driver.CudaModule",
        "acompile._backends._driver.CudaModule",
        "acompile._backends._native.SharedLibrary",
        "acompile._backends._native.ObjectFile",
        "acompile._backends._native.SharedLibrary",
        "list[acompile._backends._triton_kernel.TritonKernel]",
        "list[acompile._backends._triton_kernel.TritonKernel | acompile._errors.AcompileError]",
        "acompile._backends._triton_kernel.TritonKernel",
        "int",
    ], out.stdout
    assert 'has no key "no_such_field"' in out.stdout  # a typo in a stats field is an error
