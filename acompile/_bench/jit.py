"""FlashInfer's modules and a torch C++ extension served by acompile, against each JIT on its
own: ``acompile bench --jit``.

    acompile bench --jit [--modules norm,silu,decode,ext] [--fleet 4] [--json PATH]

Each arm is a fresh process that builds and loads each module as the library does at first use
(FlashInfer's ``JitSpec.build_and_load()``; ``torch.utils.cpp_extension.load_inline``): a
module's ``ready s`` is that call, ``process s`` the whole process (interpreter start to exit:
imports, the served pool's start, every module). A "machine" is a set of folders: FlashInfer's
workspace, torch's extensions folder, ``$HOME``, acompile's cache. nvcc runs are counted by the
launcher FlashInfer puts before nvcc (every arm has the same one).

- ``flashinfer_cold``: the JITs alone, a fresh machine (they fill its folders);
- ``flashinfer_warm``: the JITs alone again on that machine (ninja finds everything built);
- ``flashinfer_copied``: the JITs alone on a second machine whose folders are a copy of the
  first one's at another path (what operators do today: copy the cache folder to the next host);
- ``acompile_fill``: served by acompile (``inductor.serve(shared_cache=SharedCache(...,
  signing_key=...))``, its defaults otherwise), a fresh machine on an empty shared tier (a real redis-server);
- ``acompile_second``: served, a second fresh machine on that tier, with FlashInfer's and tvm_ffi's
  packages (the headers its modules include) at another path;
- ``fleet``: N fresh machines served together on an empty tier: how many builds in all.

FlashInfer builds for ``--arch`` (default 9.0) without a GPU: it needs nvcc, the cuBLAS and
cuRAND headers (the ``nvidia-cublas``, ``nvidia-curand`` wheels: their include folder on
``CPATH``), libcudart for the link and a ``libcuda.so`` (a stub is made here where there is none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from acompile._bench import harness

KEY = "acompile-bench-signing-key-0123456789"
MODULES = ("norm", "silu", "decode", "ext")
EXTENSION = """
#include <torch/extension.h>
torch::Tensor add_one(torch::Tensor x) { return x + 1; }
"""


# -- the child: one arm, in a fresh process ----------------------------------------------------


def _spec(name: str) -> Any:
    if name == "norm":
        from flashinfer.jit.norm import gen_norm_module

        return gen_norm_module()
    if name == "silu":
        from flashinfer.jit.activation import gen_act_and_mul_module

        return gen_act_and_mul_module("silu")
    import torch
    from flashinfer.jit.attention import gen_batch_decode_module

    return gen_batch_decode_module(
        torch.float16, torch.float16, torch.float16, torch.int32, 128, 128, 0, False, False
    )


def build_modules(o: argparse.Namespace) -> dict[str, Any]:
    """Build and load each module in turn, served where ``o.serve`` says."""
    from acompile import inductor
    from acompile._cache import with_shared_cache_fields

    serving = inductor.serve(**with_shared_cache_fields(o.serve)) if o.serve is not None else None
    result: dict[str, Any] = {"modules": {}}
    try:
        if serving is not None:
            serving.__enter__()
        # Every arm imports the libraries before its first clock starts (FlashInfer imports torch
        # and much more: a second or two), so that a module's time is its build and load alone;
        # the whole process's time, imports included, is reported beside it.
        for library in ("flashinfer.jit.activation", "flashinfer.jit.attention", "flashinfer.jit.norm"):
            importlib.import_module(library)
        importlib.import_module("torch.utils.cpp_extension")

        for name in o.modules:
            row: dict[str, Any] = {}
            start = time.perf_counter()
            try:
                if name == "ext":
                    from torch.utils import cpp_extension

                    module = cpp_extension.load_inline("acompile_bench_ext", EXTENSION, functions=["add_one"])  # type: ignore[no-untyped-call]
                    import torch

                    row["ok"] = bool((module.add_one(torch.zeros(2)) == 1).all())
                else:
                    row["ok"] = _spec(name).build_and_load() is not None
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:])
            row["seconds"] = time.perf_counter() - start
            result["modules"][name] = row
    finally:
        if serving is not None:
            serving.__exit__(None, None, None)
            stats = serving.stats()
            result["jit"] = stats.get("jit", {})
            result["shared_rejected"] = (stats.get("pool") or {}).get("cache", {}).get("shared_rejected")
    return result


CHILDREN = {"build_modules": build_modules}


# -- the parent: the arms ----------------------------------------------------------------------


def toolchain(folder: Path, arch: str) -> dict[str, str] | str:
    """The environment FlashInfer builds with here, or what is missing."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "nvcc on PATH"
    headers = glob.glob(
        os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "include", "cublas_v2.h")
    )
    if not headers:
        return 'the cuBLAS and cuRAND headers (pip install "nvidia-cublas>=13,<14" "nvidia-curand>=10.4,<11")'
    cudart = glob.glob("/usr/local/cuda*/lib64/libcudart.so") + glob.glob(
        "/usr/local/cuda*/targets/*/lib/libcudart.so"
    )
    if not cudart:
        return "a CUDA toolkit's libcudart.so under /usr/local"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stub.c").write_text("void cuInit(void) {}\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so"), str(folder / "stub.c")], check=True
    )
    launcher = folder / "launch-and-count"
    launcher.write_text('#!/bin/sh\necho "$*" >> "$NVCC_COUNT"\nexec "$@"\n')
    launcher.chmod(0o755)
    return {
        "CPATH": os.pathsep.join(filter(None, [os.path.dirname(headers[0]), os.environ.get("CPATH")])),
        "LIBRARY_PATH": os.pathsep.join(
            filter(None, [os.path.dirname(cudart[0]), str(folder), os.environ.get("LIBRARY_PATH")])
        ),
        "FLASHINFER_CUDA_ARCH_LIST": arch,
        "FLASHINFER_NVCC_LAUNCHER": str(launcher),
    }


def _machine(root: Path, name: str) -> dict[str, str]:
    home = root / name
    folders = {
        "HOME": home / "home",
        "FLASHINFER_WORKSPACE_BASE": home / "workspace",
        "TORCH_EXTENSIONS_DIR": home / "extensions",
        "ACOMPILE_CACHE_DIR": home / "acompile",
    }
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {**{k: str(v) for k, v in folders.items()}, "NVCC_COUNT": str(home / "nvcc-runs")}


def _nvcc_runs(env: dict[str, str]) -> int:
    path = Path(env["NVCC_COUNT"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def _moved_packages(root: Path) -> str:
    """FlashInfer's and tvm_ffi's packages copied to another folder (first on PYTHONPATH of the
    arm that uses it): the headers its modules include, installed at another path."""
    import importlib.util

    folder = root / "other-site-packages"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("flashinfer", "tvm_ffi"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations
        shutil.copytree(next(iter(spec.submodule_search_locations)), folder / name, symlinks=True)
    return str(folder)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from acompile._bench.tiers import redis_server

    root = Path(tempfile.mkdtemp(prefix="acompile-bench-jit-"))
    tools = toolchain(root / "toolchain", args.arch)
    assert isinstance(tools, dict)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    executable = str(Path(args.redis_server).resolve()) if args.redis_server else None
    executable = executable or shutil.which("redis-server") or "/usr/bin/redis-server"
    arms: dict[str, Any] = {}

    def arm(name: str, machine: str, serve: dict[str, Any] | None, **extra: str) -> dict[str, Any]:
        print(f"[bench --jit] {name} ...", file=sys.stderr, flush=True)
        env = {**tools, **_machine(root, machine), **extra}
        child_env = harness.child_env(root / machine, **env)
        if extra.get("PYTHONPATH_FIRST"):
            child_env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH_FIRST"], child_env["PYTHONPATH"]])
        options = {"serve": serve, "modules": modules}
        before = _nvcc_runs(env)  # a machine used again has its earlier runs counted
        result = harness.run_child(
            "jit", "build_modules", options, root / "runs" / name, child_env, args.row_timeout
        )
        result["nvcc"] = _nvcc_runs(env) - before
        print(f"[bench --jit] {name}: {_summary(result)}", file=sys.stderr, flush=True)
        return result

    try:
        with redis_server(executable, root / "redis") as port:
            url = f"redis://127.0.0.1:{port}"
            served = {"shared_cache": {"where": f"{url}/1", "signing_key": KEY}}
            arms["flashinfer_cold"] = arm("flashinfer_cold", "a", None)
            arms["flashinfer_warm"] = arm("flashinfer_warm", "a", None)
            # The first machine's folders, copied whole to another path (times kept).
            for sub in ("workspace", "extensions", "home"):
                shutil.copytree(root / "a" / sub, root / "b" / sub, symlinks=True, dirs_exist_ok=True)
            arms["flashinfer_copied"] = arm("flashinfer_copied", "b", None)
            arms["acompile_fill"] = arm("acompile_fill", "c", served)
            moved = _moved_packages(root)
            arms["acompile_second"] = arm("acompile_second", "d", served, PYTHONPATH_FIRST=moved)
            if args.fleet:
                fleet_serve = {"shared_cache": {"where": f"{url}/2", "signing_key": KEY}, "workers": 1}
                with concurrent.futures.ThreadPoolExecutor(args.fleet) as pool:
                    runs = list(pool.map(lambda i: arm(f"fleet{i}", f"f{i}", fleet_serve), range(args.fleet)))
                arms["fleet"] = {
                    "machines": args.fleet,
                    "builds": {
                        lib: sum(r.get("jit", {}).get(lib, {}).get("builds", 0) for r in runs)
                        + sum(r.get("jit", {}).get(lib, {}).get("local_builds", 0) for r in runs)
                        for lib in ("flashinfer", "cpp_extension")
                    },
                    "nvcc": sum(r["nvcc"] for r in runs),
                    "process_max_s": max((r.get("process_s") or 0 for r in runs), default=None),
                    "crashed": [r["crashed"] for r in runs if "crashed" in r],
                }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "modules": modules,
        "arch": args.arch,
        "machine": harness.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "arms": arms,
    }


def _summary(result: dict[str, Any]) -> str:
    if "crashed" in result:
        return f"CRASHED: {result['crashed']}"
    parts = [f"{n} {m['seconds']:.2f} s{'' if m['ok'] else ' FAILED'}" for n, m in result["modules"].items()]
    return f"{', '.join(parts)}; nvcc {result['nvcc']}; process {result.get('process_s', 0):.2f} s"


_LABELS = {
    "flashinfer_cold": "JITs alone, a fresh machine",
    "flashinfer_warm": "JITs alone, that machine again (local warm)",
    "flashinfer_copied": "JITs alone, that machine's folders copied to another path (the anchor)",
    "acompile_fill": "served, a fresh machine on an empty shared tier",
    "acompile_second": "served, a second machine (packages at another path)",
}


def report(document: dict[str, Any]) -> str:
    arms, modules = document["arms"], document["modules"]
    machine = document["machine"]
    lines = [
        f"JITs served (acompile bench --jit), arch {document['arch']}, on {machine.get('usable_cpus')} CPUs "
        f"({machine.get('cpu_model', '?')}), {document.get('date', '')}",
        "",
    ]
    header = ["arm", *[f"{m} ready s" for m in modules], "nvcc runs", "built by acompile", "process s"]
    rows = []
    for name, label in _LABELS.items():
        r = arms.get(name)
        if r is None:
            continue
        if "crashed" in r:
            rows.append([label, *["CRASHED"] * len(modules), "", "", ""])
            continue
        cells = [
            harness.fmt(r["modules"][m]["seconds"]) + ("" if r["modules"][m]["ok"] else " FAILED")
            for m in modules
        ]
        jit = r.get("jit") or {}
        built = sum(c.get("builds", 0) + c.get("local_builds", 0) for c in jit.values()) if jit else None
        rows.append(
            [
                label,
                *cells,
                str(r["nvcc"]),
                "" if built is None else str(built),
                harness.fmt(r.get("process_s")),
            ]
        )
    lines.append(harness.table(header, rows))
    fleet = arms.get("fleet")
    if fleet:
        one = arms.get("acompile_fill", {})
        lines += [
            "",
            f"{fleet['machines']} machines served together on an empty tier: builds in all "
            f"{fleet['builds']} (one machine builds {len([m for m in modules if m != 'ext'])} FlashInfer "
            f"module(s) and {int('ext' in modules)} extension); nvcc runs in all {fleet['nvcc']} "
            f"(one machine alone: {one.get('nvcc', 'n/a')}); "
            f"slowest process {harness.fmt(fleet['process_max_s'])} s"
            + (f"; crashed: {fleet['crashed']}" if fleet["crashed"] else ""),
        ]
    second = arms.get("acompile_second", {})
    if "modules" in second:
        worst = max(m["seconds"] for m in second["modules"].values())
        lines += [
            "",
            f"target (a second machine: 0 nvcc runs, each module ready in <= 1 s): nvcc {second['nvcc']}, "
            f"slowest module {worst:.3f} s: {'met' if second['nvcc'] == 0 and worst <= 1.0 else 'NOT met'}",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(
        prog="acompile bench --jit",
        description="FlashInfer's modules and a torch C++ extension served by acompile, against each JIT "
        "alone: each arm a fresh process (docs/jit.md says what each arm is).",
    )
    parser.add_argument(
        "--modules",
        default=",".join(MODULES),
        help="comma-separated, of: norm, silu (FlashInfer's silu_and_mul), decode (a batch decode "
        "module, fp16, head dim 128), ext (a torch C++ extension through load_inline); default: all",
    )
    parser.add_argument("--arch", default="9.0", help="FlashInfer's CUDA arch list (default 9.0)")
    parser.add_argument(
        "--fleet", type=int, default=4, help="machines served together on an empty tier (0: none)"
    )
    parser.add_argument("--json", default="bench-results/bench-jit.json")
    parser.add_argument("--redis-server", default=None, help="the redis-server to run (default: on PATH)")
    parser.add_argument("--row-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules.split(",") if m.strip() and m.strip() not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown}; modules are: {', '.join(MODULES)}")
    if need := harness.missing(torch=True):
        print(f"acompile bench --jit: needs {need}", file=sys.stderr)
        return 2
    try:
        import flashinfer.jit.core  # noqa: F401
    except ImportError:
        print('acompile bench --jit: needs FlashInfer (pip install "acompile[flashinfer]")', file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        problem = toolchain(Path(scratch), args.arch)
    if isinstance(problem, str):
        print(f"acompile bench --jit: needs {problem}", file=sys.stderr)
        return 2
    if not (args.redis_server or shutil.which("redis-server")):
        print("acompile bench --jit: needs redis-server on PATH (or --redis-server)", file=sys.stderr)
        return 2
    document = run(args)
    text = report(document)
    document["report"] = text
    print(text)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    from acompile._outputs import write_own_file

    # --json names a file of this user's: never written through another user's link.
    write_own_file(path, json.dumps(document, indent=2, default=str).encode())
    print(f"\nresults written to {path}")
    crashed = [n for n, r in document["arms"].items() if r.get("crashed")]
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
