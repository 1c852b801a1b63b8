"""FlashInfer's JIT modules (``flashinfer-python`` 0.7), served.

Each FlashInfer kernel module is a ``JitSpec``; an nvcc module's ``build()`` writes the module's
``build.ninja`` into ``<workspace>/cached_ops/<name>/`` (generated sources into
``<workspace>/generated/<name>/``) and calls ``run_ninja(build_dir, ninja_path, verbose)``, which
``flashinfer.jit.core`` imports by name from ``flashinfer.jit.cpp_ext``. It runs ninja on every
``build()``, even where the module's ``.so`` is there: ninja's mtimes decide. Served, that call is
``ServedBuilds.run``: the ``.so`` from the tiers (ninja never runs), or built on the pool's
workers and published; FlashInfer then loads it from where it always does.

The key holds FlashInfer's version beside what ninja runs (the arch list is in its nvcc flags),
never the workspace's path, the environment's or ``$HOME``. A module built twice is not
bit-identical even by FlashInfer alone: nvcc names its temporary files by process id, and 12
bytes of the symbol table differ (``strip -s`` makes them equal); the code is the same.
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acompile._jit._library import Unsupported
from acompile._jit._ninja import Build, package_roots, package_versions, standard_roots

if TYPE_CHECKING:
    from acompile._jit._builds import ServedBuilds

NAME = "flashinfer"
MODULE = "flashinfer.jit.core"
SUPPORTED = "flashinfer-python 0.7"
_RELEASES = ((0, 7), (0, 7))


def install(builds: ServedBuilds) -> Callable[[], None]:
    """Serve FlashInfer's nvcc module builds through ``builds``; returns the undo. Raises
    ``Unsupported`` on a release outside ``SUPPORTED`` or one whose seams changed."""
    import importlib

    # From the import system's table: this runs as jit.core finishes its import, before its
    # package has the attribute.
    core: Any = importlib.import_module(MODULE)
    cpp_ext: Any = importlib.import_module("flashinfer.jit.cpp_ext")
    fi_env: Any = importlib.import_module("flashinfer.jit.env")
    fi_version: Any = importlib.import_module("flashinfer.version")

    release = str(getattr(fi_version, "__version__", "?"))
    numbers = release.split("+", 1)[0].split(".")
    try:
        major_minor = (int(numbers[0]), int(numbers[1]))
    except (IndexError, ValueError):
        raise Unsupported(f"flashinfer {release} has no release number acompile reads") from None
    if not _RELEASES[0] <= major_minor <= _RELEASES[1]:
        raise Unsupported(f"flashinfer {release} is outside the releases served ({SUPPORTED})")
    found: Callable[..., None] | None = getattr(cpp_ext, "run_ninja", None)
    if found is None or list(inspect.signature(found).parameters)[:3] != [
        "workdir",
        "ninja_file",
        "verbose",
    ]:
        raise Unsupported(f"flashinfer {release}'s jit.cpp_ext.run_ninja is not the one served")
    original: Callable[..., None] = found
    if getattr(core, "run_ninja", None) is not original:
        raise Unsupported(f"flashinfer {release}'s jit.core does not build through jit.cpp_ext.run_ninja")
    # The packages whose headers the builds include, each a root of its own: the same files at
    # another install path (another venv, a --target folder, PYTHONPATH) give the same key.
    packages = package_roots("flashinfer", "tvm_ffi")
    jobs: Callable[[], int | None] | None = getattr(cpp_ext, "_get_num_workers", None)  # MAX_JOBS
    workspace = getattr(fi_env, "FLASHINFER_WORKSPACE_DIR", None)
    if workspace is None:
        raise Unsupported(f"flashinfer {release} has no FLASHINFER_WORKSPACE_DIR")

    def served_run(workdir: Path, ninja_file: Path, verbose: bool, *args: Any, **kwargs: Any) -> None:
        def run_here() -> None:
            original(workdir, ninja_file, verbose, *args, **kwargs)

        if args or kwargs:
            # A call JitSpec.build() does not make: build_jit_specs' one ninja over every module
            # (ahead of time, max_jobs given), which is FlashInfer's own.
            run_here()
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        folder = os.path.realpath(workdir)
        build = Build(
            library=NAME,
            name=os.path.basename(folder),
            folder=folder,
            build_file=os.path.realpath(ninja_file),
            parts=package_versions("flashinfer-python", "apache-tvm-ffi"),
            roots=standard_roots(folder, ("flashinfer_workspace", str(workspace)), *packages),
            env=dict(os.environ),
            ninja=shutil.which("ninja") or "ninja",
            jobs=jobs() if jobs is not None else None,
        )

        def failed(log: str) -> Exception:
            return RuntimeError("Ninja build failed. Ninja output:\n" + log)

        builds.run(build, run_here, failed)

    core.run_ninja = served_run
    cpp_ext.run_ninja = served_run

    def undo() -> None:
        if core.run_ninja is served_run:
            core.run_ninja = original
        if cpp_ext.run_ninja is served_run:
            cpp_ext.run_ninja = original

    return undo
