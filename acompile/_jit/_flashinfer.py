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

CuTe DSL kernels (``JitSpecCuteDsl``, one kernel a spec): ``build()`` calls the spec's
``compile_fn``, a closure over the caller's objects (the DSL function, its fake tensors, its
constants), and exports the compiled kernel as ``<module>/<kernel>.o`` beside a ``meta.json``
that FlashInfer's ``try_load`` compares with the spec's. No other process can run that closure,
so served, ``build()`` is ``ServedBuilds.run_kernel``: the ``.o`` from the tiers (or from the
replica that compiled it while this one waited), written with the ``meta.json`` FlashInfer
expects, else compiled here as FlashInfer does and published. The key is FlashInfer's own cache
identity (module, kernel, symbol, export format, arch, its fingerprint of the DSL stack) with
the sources' digest made again without their paths: each key file named by where it is
imported from.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acompile._jit._builds import Kernel
from acompile._jit._library import Unsupported, warn_once
from acompile._jit._ninja import (
    Build,
    Unrecordable,
    looks_rooted,
    package_roots,
    package_versions,
    relative_name,
    resolve_name,
    rooted_text,
    standard_roots,
    unrooted_text,
)
from acompile._outputs import output_problem, write_output

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
    jobs: Callable[[], int | None] | None = getattr(cpp_ext, "_get_num_workers", None)  # MAX_JOBS
    if getattr(fi_env, "FLASHINFER_WORKSPACE_DIR", None) is None:
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
            roots=_roots(fi_env, folder),
            env=dict(os.environ),
            ninja=shutil.which("ninja") or "ninja",
            jobs=jobs() if jobs is not None else None,
        )
        build = dataclasses.replace(build, describe=lambda: _describe(core, build, release))

        def failed(log: str) -> Exception:
            return RuntimeError("Ninja build failed. Ninja output:\n" + log)

        builds.run(build, run_here, failed)

    try:
        undo_kernels = _serve_cute_dsl(builds, release, fi_env)
    except Unsupported as exc:
        # Its nvcc modules are served all the same.
        warn_once("flashinfer.cute_dsl", str(exc))
        undo_kernels = None

    core.run_ninja = served_run
    cpp_ext.run_ninja = served_run

    def undo() -> None:
        if core.run_ninja is served_run:
            core.run_ninja = original
        if cpp_ext.run_ninja is served_run:
            cpp_ext.run_ninja = original
        if undo_kernels is not None:
            undo_kernels()

    return undo


def _roots(fi_env: Any, folder: str) -> tuple[tuple[str, str], ...]:
    """A module's roots: its build folder, FlashInfer's workspace, and the packages whose
    headers the builds include, each a root of its own (the same files at another install path,
    another venv, a ``--target`` folder, give the same key)."""
    workspace = ("flashinfer_workspace", str(fi_env.FLASHINFER_WORKSPACE_DIR))
    return standard_roots(folder, workspace, *package_roots("flashinfer", "tvm_ffi"))


# --- the warm-up record: what a serving process built, remade on a box without a GPU ----------

_EMBED = ("flashinfer_workspace",)  # generated sources: made by a generator the record lacks


def _describe(core: Any, build: Build, release: str) -> dict[str, Any]:
    """A record entry's fields for the module ``build`` makes: its ``JitSpec`` as FlashInfer's
    registry holds it, every path rooted; the warm-up remakes the spec from them
    (``remake_spec``)."""
    registry = getattr(core, "jit_spec_registry", None)
    spec = registry.get_all_specs().get(build.name) if registry is not None else None
    if spec is None or type(spec).__name__ != "JitSpecNvcc":
        raise Unrecordable("FlashInfer's registry has no nvcc spec of that name")
    if os.path.realpath(spec.build_dir) != build.folder:
        raise Unrecordable(f"the spec of that name builds in {spec.build_dir}")
    if getattr(spec, "embedded_cubin_factory", None) is not None:
        raise Unrecordable("part of its build file is written by a callback of its generator's")
    roots = build.roots

    def path(p: Any) -> str:
        name = relative_name(str(p), roots)
        if not name.startswith("<"):
            raise Unrecordable(f"{p} is in no folder a warm-up box has")
        return name

    def flags(values: Any) -> list[str] | None:
        if values is None:
            return None
        if odd := [str(v) for v in values if looks_rooted(str(v))]:
            raise Unrecordable(f"a flag reads as a rooted path: {odd[0]!r}")
        return [rooted_text(str(v), roots) for v in values]

    fields: dict[str, Any] = {
        "module": spec.name,
        "release": release,
        "arch_list": _arch_list(core),
        "sources": [path(p) for p in spec.sources],
        "cflags": flags(spec.extra_cflags),
        "cuda_cflags": flags(spec.extra_cuda_cflags),
        "ldflags": flags(spec.extra_ldflags),
        "include_dirs": None
        if spec.extra_include_dirs is None
        else [path(p) for p in spec.extra_include_dirs],
        "device_linking": bool(spec.needs_device_linking),
        "cuda_cflags_by_source": None
        if spec.extra_cuda_cflags_by_source is None
        else {path(k): flags(v) for k, v in spec.extra_cuda_cflags_by_source.items()},
        "embed": _EMBED,
    }
    if not fields["arch_list"]:
        raise Unrecordable("FlashInfer has no arch list")
    return {k: v for k, v in fields.items() if v is not None}


def _arch_list(core: Any) -> str:
    """The arch list FlashInfer builds for in this process, in its own spelling (``9.0a``)."""
    arch = sorted(getattr(core.current_compilation_context, "TARGET_CUDA_ARCHS", ()))
    return " ".join(f"{major}.{minor}" for major, minor in arch)


RECORD_FIELDS = frozenset(
    {"module", "release", "arch_list", "sources", "cflags", "cuda_cflags", "ldflags", "include_dirs",
     "device_linking", "cuda_cflags_by_source", "files"}
)  # fmt: skip


def remake_spec(fields: dict[str, Any]) -> Any:
    """The ``JitSpec`` a record entry describes, on this machine (blocking: imports FlashInfer,
    writes the entry's generated files into this FlashInfer's workspace). ``ValueError`` where
    it cannot be the recorded module here: another FlashInfer release, another arch list, a
    folder this machine has not."""
    import importlib

    core: Any = importlib.import_module(MODULE)
    fi_env: Any = importlib.import_module("flashinfer.jit.env")
    release = str(importlib.import_module("flashinfer.version").__version__)
    if fields.get("release") != release:
        raise ValueError(
            f"recorded with flashinfer {fields.get('release')}, this is {release}: the module built "
            "here would not be the one the servers load"
        )
    here = _arch_list(core)
    if here != fields.get("arch_list"):
        raise ValueError(
            f"recorded for the arch list {fields.get('arch_list')!r}, FlashInfer builds for {here!r} here"
        )
    name = fields["module"]
    jit_dir = os.path.realpath(fi_env.FLASHINFER_JIT_DIR)
    folder = os.path.realpath(os.path.join(jit_dir, name))
    if os.path.dirname(folder) != jit_dir:
        raise ValueError(f"{name!r} is not a module's name: its build folder would be {folder}")
    roots = _roots(fi_env, folder)

    def path(rooted: str) -> Path:
        found = resolve_name(rooted, roots)
        if found is None:
            raise ValueError(f"{rooted} names a folder this machine has not")
        return Path(found)

    def flags(values: list[str] | None) -> list[str] | None:
        return None if values is None else [unrooted_text(v, roots) for v in values]

    for rooted, text in sorted(fields.get("files", {}).items()):
        if not rooted.startswith(tuple(f"<{r}>/" for r in _EMBED)):
            raise ValueError(f"{rooted}: a record writes generated files into FlashInfer's workspace only")
        target = path(rooted)
        if rooted.endswith("/") or target.is_dir():
            raise ValueError(f"{rooted} names a folder, not a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        core.write_if_different(target, text)
    by_source = fields.get("cuda_cflags_by_source")
    spec = core.JitSpecNvcc(
        name=name,
        sources=[path(p) for p in fields["sources"]],
        extra_cflags=flags(fields.get("cflags")),
        extra_cuda_cflags=flags(fields.get("cuda_cflags")),
        extra_ldflags=flags(fields.get("ldflags")),
        extra_include_dirs=None
        if fields.get("include_dirs") is None
        else [path(p) for p in fields["include_dirs"]],
        needs_device_linking=bool(fields.get("device_linking", False)),
        extra_cuda_cflags_by_source=None
        if by_source is None
        else {path(k).resolve(): flags(v) for k, v in by_source.items()},
    )
    core.jit_spec_registry.register(spec)
    return spec


# --- CuTe DSL kernels ---------------------------------------------------------------------------

_CUTE_ATTRIBUTES = (
    "module_name", "kernel_name", "module_dir_name", "module_dir", "object_path", "meta_path",
    "symbol", "enable_tvm_ffi", "expected_meta", "lock_path",
)  # fmt: skip
# FlashInfer's digests of the kernels' sources this process made, and the files each was made
# of: a kernel is keyed by its files' contents and import names, never their paths.
_HASHED_LIMIT = 4096


def _serve_cute_dsl(builds: ServedBuilds, release: str, fi_env: Any) -> Callable[[], None]:
    """Serve FlashInfer's CuTe DSL kernels through ``builds.run_kernel``; returns the undo.
    Raises ``Unsupported`` where a seam is missing."""
    import importlib

    try:
        cute: Any = importlib.import_module("flashinfer.jit.cute_dsl_core")
        source: Any = importlib.import_module("flashinfer.jit._cute_dsl_source")
    except ImportError as exc:
        raise Unsupported(f"flashinfer {release} has no CuTe DSL core acompile reads ({exc})") from None
    spec_class = getattr(cute, "JitSpecCuteDsl", None)
    original_build = getattr(spec_class, "build", None)
    original_try_load = getattr(spec_class, "try_load", None)
    original_hash = getattr(source, "_hash_source_files", None)
    missing = [
        name
        for name, there in (
            ("JitSpecCuteDsl.build", callable(original_build)),
            ("JitSpecCuteDsl.try_load", callable(original_try_load)),
            ("_cute_dsl_source._hash_source_files", callable(original_hash)),
            ("_cute_dsl_source._key_sources", callable(getattr(source, "_key_sources", None))),
            ("_cute_dsl_source._initializer_digest", callable(getattr(source, "_initializer_digest", None))),
            ("cute_dsl_core._read_meta", callable(getattr(cute, "_read_meta", None))),
        )
        if not there
    ]
    if getattr(cute, "_hash_source_files", None) is not original_hash:
        missing.append("cute_dsl_core._hash_source_files (not _cute_dsl_source's)")
    if missing:
        raise Unsupported(f"flashinfer {release}'s CuTe DSL seams changed (missing: {', '.join(missing)})")
    assert spec_class is not None and original_hash is not None
    assert original_build is not None and original_try_load is not None
    hashed: dict[str, tuple[str, ...]] = {}
    lock = threading.Lock()

    def hash_sources(paths: Any) -> str:
        digest: str = original_hash(paths)
        with lock:
            if len(hashed) < _HASHED_LIMIT:
                hashed.setdefault(digest, tuple(str(p) for p in paths))
        return digest

    def served_build(spec: Any) -> None:
        if not all(hasattr(spec, a) for a in _CUTE_ATTRIBUTES):
            original_build(spec)
            return
        kernel = _kernel(spec)
        builds.run_kernel(kernel)

    def _kernel(spec: Any) -> Kernel:
        files = hashed.get(str(spec.expected_meta.get("source_sha256")))
        parts: dict[str, Any] | None = None
        unkeyed = ""
        if files is None:
            unkeyed = "its sources were hashed before acompile served FlashInfer"
        else:
            try:
                digest, changed = _portable_digest(source, files, str(spec.module_dir))
                if changed:
                    # The module in memory may be the file as it was: what it compiles is not
                    # what the file's key would name.
                    unkeyed = f"{changed} changed after this process started"
                else:
                    parts = _kernel_parts(spec, release, digest)
            except (OSError, SyntaxError, TypeError, ValueError) as exc:
                unkeyed = f"its sources cannot be read again ({exc})"
        return Kernel(
            library=NAME,
            name=str(spec.name),
            folder=os.path.realpath(spec.module_dir),
            parts=parts,
            build=lambda: original_build(spec),
            products=lambda: _kernel_products(spec),
            put=lambda blobs: _put_kernel(cute, spec, blobs),
            unkeyed=unkeyed,
        )

    def served_try_load(spec: Any) -> Any:
        loaded = original_try_load(spec)
        if (
            loaded is not None
            and builds.publish_library_hits
            and all(hasattr(spec, a) for a in _CUTE_ATTRIBUTES)
        ):
            # A warm-up: FlashInfer's own cache had the kernel (a box warm from running without
            # acompile, or a second warm-up): it goes to the tiers all the same.
            builds.publish_kernel(_kernel(spec))
        return loaded

    spec_class.build = served_build
    spec_class.try_load = served_try_load
    source._hash_source_files = hash_sources
    cute._hash_source_files = hash_sources

    def undo() -> None:
        if spec_class.__dict__.get("build") is served_build:
            spec_class.build = original_build
        if spec_class.__dict__.get("try_load") is served_try_load:
            spec_class.try_load = original_try_load
        if source._hash_source_files is hash_sources:
            source._hash_source_files = original_hash
        if cute._hash_source_files is hash_sources:
            cute._hash_source_files = original_hash

    return undo


def _kernel_parts(spec: Any, release: str, sources: str) -> dict[str, Any]:
    # FlashInfer's own fingerprint of the DSL stack hashes each distribution's RECORD whole,
    # and a RECORD holds the hashes of the scripts in the venv's bin/ (their first line names
    # the venv's path) and of the installer's own files: another in its place (``_dsl_stack``).
    meta = {
        k: v for k, v in dict(spec.expected_meta).items() if k not in ("source_sha256", "cute_dsl_version")
    }
    return {
        "library": NAME,
        "kind": "cute_dsl",
        "flashinfer": release,
        "module": str(spec.module_dir_name),
        "kernel": str(spec.kernel_name),
        "symbol": str(spec.symbol),
        "tvm_ffi": bool(spec.enable_tvm_ffi),
        "meta": meta,  # its arch (and whatever else FlashInfer adds to its check)
        "stack": _dsl_stack(),
        # The DSL's own settings read from the environment (not its folders and logs).
        "environment": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and not any(w in k for w in _CUTE_ENV_NOT_CODE)
        },
        "sources": sources,
    }


# Words in the names of the CuTe DSL's environment variables that say where it writes or what it
# logs, not what it compiles.
_CUTE_ENV_NOT_CODE = ("DIR", "PATH", "LOG", "DUMP", "CACHE", "KEEP", "PRINT", "ARCH")


@functools.cache
def _dsl_stack() -> str:
    """What FlashInfer's ``_get_cute_dsl_version`` fingerprints, without a path: Python's ABI,
    and torch, TVM-FFI and every ``nvidia-cutlass-dsl*`` distribution by name, version, and the
    hashes of the files it installed inside the environment's packages (not its scripts in
    ``bin/``, not its ``.dist-info`` bookkeeping, which names the installer)."""
    import importlib.metadata
    import sysconfig

    stack = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in {"torch", "apache-tvm-ffi"} or name.startswith("nvidia-cutlass-dsl"):
            lines = sorted(
                line
                for line in (dist.read_text("RECORD") or "").splitlines()
                if line and not line.startswith("../") and ".dist-info/" not in line.split(",", 1)[0]
            )
            digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
            stack.append(f"{name}=={dist.version}:{digest}")
    return ";".join(
        [str(sys.implementation.cache_tag), str(sysconfig.get_config_var("SOABI")), *sorted(set(stack))]
    )


def _portable_digest(source: Any, paths: tuple[str, ...], folder: str) -> tuple[str, str | None]:
    """FlashInfer's digest of a kernel's sources (``_hash_source_files``) made again with each
    file named by where it is imported from (``<import>/pkg/mod.py``), not by its path, each
    name and content framed by its length; and the first of them that changed after this
    process started (or None)."""
    files, initializers = source._key_sources(tuple(paths))
    names = _import_names(folder)
    started = _process_started()
    sha = hashlib.sha256()
    changed: str | None = None

    def framed(data: bytes) -> None:
        sha.update(len(data).to_bytes(8, "little") + data)

    for name, path in sorted((names(p), p) for p in files):
        with open(path, "rb") as f:
            if changed is None and os.fstat(f.fileno()).st_mtime > started + _START_SLACK:
                changed = name
            framed(name.encode())
            framed(f.read())
    for name, path in sorted((names(p), p) for p in initializers):
        framed(f"{name} (initializer)".encode())
        framed(str(source._initializer_digest(Path(path), initializers[path])).encode())
    return sha.hexdigest(), changed


# A file written within this long before the process started can read as written after it
# (the start time is known to a clock tick, the boot time to a second).
_START_SLACK = 2.0


@functools.cache
def _process_started() -> float:
    """When this process started (wall clock), from ``/proc``; now where that cannot be read."""
    import time

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _import_names(folder: str) -> Callable[[str], str]:
    """A file's name as a key holds it: a loaded module's file by the module's name
    (``<import>/pkg/mod.py`` for ``pkg.mod``, however its folder is found on ``sys.path``);
    another file under the longest folder of ``sys.path`` that holds it, ``<import>/`` and its
    path from there; else rooted as a build's files are."""
    modules: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        dotted_name = getattr(module, "__name__", None)
        if isinstance(file, str) and isinstance(dotted_name, str) and file.endswith(".py"):
            dotted = dotted_name.replace(".", "/")
            tail = f"{dotted}/__init__.py" if os.path.basename(file) == "__init__.py" else f"{dotted}.py"
            modules.setdefault(os.path.realpath(file), "<import>/" + tail)
    entries = sorted(
        {os.path.realpath(p or os.getcwd()) for p in sys.path if isinstance(p, str)}, key=len, reverse=True
    )
    roots = standard_roots(folder)

    def name(path: Any) -> str:
        real = os.path.realpath(str(path))
        if real in modules:
            return modules[real]
        for entry in entries:
            if real.startswith(entry + os.sep):
                return "<import>" + real[len(entry) :]
        return relative_name(real, roots)

    return name


def _kernel_products(spec: Any) -> dict[str, bytes]:
    """The ``.o`` FlashInfer exported (it writes none where its export failed: it then keeps
    the kernel in memory)."""
    path = str(spec.object_path)
    with open(path, "rb") as f:
        data = f.read()
    if problem := output_problem(path, data):
        raise ValueError(problem)
    return {"object": data}


def _put_kernel(cute: Any, spec: Any, blobs: dict[str, bytes]) -> None:
    """A published ``.o`` written where FlashInfer's ``try_load`` finds it, as its own export
    writes one: a module of stale kernels (another DSL stack or sources) wiped first, the
    object, then the module's ``meta.json`` (its commit marker) as this spec expects it."""
    data = blobs["object"]
    object_path = str(spec.object_path)
    if problem := output_problem(object_path, data):
        raise ValueError(problem)
    if os.path.isdir(spec.module_dir) and cute._read_meta(spec.meta_path) != spec.expected_meta:
        shutil.rmtree(spec.module_dir, ignore_errors=True)
    write_output(object_path, data)
    if cute._read_meta(spec.meta_path) != spec.expected_meta:
        write_output(str(spec.meta_path), json.dumps(spec.expected_meta, indent=2).encode())
