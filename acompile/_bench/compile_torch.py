"""torch.compile served by acompile, against Inductor on its own: ``acompile bench --torch``.

    acompile bench --torch [--model auto|small|llama] [--fleet 8] [--json PATH] [--redis-server PATH]

Each arm is a fresh process that builds the model, compiles it with ``torch.compile`` and runs
it once (synchronized): ``first call`` is that compile and call, ``process`` the time from the
interpreter's start to its result (both sides pay the same imports and the same model build).
A "machine" is a set of folders: Inductor's cache, Triton's cache, ``TMPDIR`` (Inductor keeps
its precompiled headers there), acompile's cache. A second machine has every one of them empty.

- ``cold``: Inductor alone, a fresh machine (it fills that machine's caches);
- ``local_warm``: Inductor alone again on ``cold``'s machine: the reference;
- ``inductor_redis_fill`` / ``inductor_redis_second``: Inductor's own Redis remote caches (FX
  graph, AOTAutograd, autotune, and bundled autotune where there is a GPU) on a real
  redis-server: a first machine fills it, a second one reads it;
- ``acompile_fill`` / ``acompile_second``: the same with torch.compile served by acompile
  (``inductor.serve(shared_cache=SharedCache(..., signing_key=...))``, its defaults otherwise) on
  the same server (another database);
- where Triton compiles (a GPU): ``serial_cold`` (``compile_threads=1``, as vLLM sets it),
  ``pool_cold`` (Inductor's default pool) and ``served_threads1_cold`` (``compile_threads=1``,
  served). Every arm's ``compile wait s`` is the time the compiling thread spent in Inductor's
  Triton compiles or waiting for its compiles (``AsyncCompile.triton`` and ``AsyncCompile.wait``):
  Triton's on the critical path where there is a GPU, the C++ kernels' on a CPU;
- ``fleet_inductor`` / ``fleet_acompile``: N fresh machines starting together on an empty
  shared tier (Inductor's Redis caches; acompile's): how many of them compiled the graph.

The models: ``small`` (a CPU model of a few layers, Inductor's C++ backend), ``llama`` (a
Llama-shaped decoder from ``transformers``' config, no download: 16 layers, hidden size 2048,
bf16, 4 x 512 tokens; a GPU). ``auto``: ``llama`` where CUDA is available, else ``small``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from acompile._bench import harness

KEY = "acompile-bench-signing-key-0123456789"


# -- the child: one arm, in a fresh process ----------------------------------------------------


def _build(model: str) -> tuple[Any, Any, Any]:
    """(module, input, device) of the named model."""
    import torch

    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
            max_position_embeddings=2048,
        )
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            module = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
        ids = torch.randint(0, config.vocab_size, (4, 512), device="cuda")
        return module, ids, "cuda"

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(256, 256) for _ in range(4)])
            self.head = torch.nn.Linear(256, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.nn.functional.gelu(layer(x)) * 1.5 + x.mean(-1, keepdim=True)
            return torch.softmax(self.head(x), -1)

    torch.manual_seed(0)
    return Small().eval(), torch.randn(64, 256), "cpu"


def _time_triton(spent: list[float]) -> None:
    """Add the compiling thread's time in Inductor's Triton compiles (or waiting for them)."""
    import threading

    from torch._inductor.async_compile import AsyncCompile

    main = threading.get_ident()
    for name in ("triton", "wait"):
        original = getattr(AsyncCompile, name)

        def timed(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                if threading.get_ident() == main:
                    spent.append(time.perf_counter() - t)

        setattr(AsyncCompile, name, timed)


def compile_model(o: argparse.Namespace) -> dict[str, Any]:
    import contextlib

    import torch
    import torch._dynamo.utils

    stamps = {"imported": time.time()}
    if o.compile_threads:
        torch._inductor.config.compile_threads = o.compile_threads
    module, example, device = _build(o.model)
    spent: list[float] = []
    _time_triton(spent)
    serving: Any = contextlib.nullcontext()
    if o.serve is not None:
        from acompile import inductor
        from acompile._cache import with_shared_cache_fields

        serving = inductor.serve(**with_shared_cache_fields(o.serve))
    with serving as served, torch.no_grad():
        compiled: Any = torch.compile(module)
        t = time.perf_counter()
        out = compiled(example)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t
        stamps["ready"] = time.time()
        expected = module(example)
        logits: Any = getattr(out, "logits", out)
        reference: Any = getattr(expected, "logits", expected)
        # bf16 on a GPU rounds differently from eager: the relative error of the whole output.
        error = float((logits.float() - reference.float()).norm() / reference.float().norm())
        close = error < (5e-2 if device == "cuda" else 1e-4)
    counters = torch._dynamo.utils.counters
    return {
        "first_call_s": first,
        "triton_s": sum(spent),
        "outputs_match": close,
        "relative_error": error,
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
        "served": served.stats() if o.serve is not None else None,
        "stamps": stamps,
    }


CHILDREN = {"compile_model": compile_model}
SECTIONS = ("first", "second", "threads", "import")


# -- the orchestrator --------------------------------------------------------------------------


def _machine(root: Path, name: str) -> dict[str, str]:
    home = root / name
    folders = {
        "TORCHINDUCTOR_CACHE_DIR": home / "inductor",
        "TRITON_CACHE_DIR": home / "triton",
        "TMPDIR": home / "tmp",
        "ACOMPILE_CACHE_DIR": home / "acompile",
    }
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in folders.items()}


def _inductor_redis(url: str, gpu: bool) -> dict[str, str]:
    env = {
        "TORCHINDUCTOR_REDIS_URL": url,
        "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
    }
    if gpu:  # without a GPU, Inductor's bundled autotune cache fails the compile
        env["TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE"] = "1"
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    from acompile._bench.tiers import redis_server

    model = args.model
    if model == "auto":
        try:
            import torch

            model = "llama" if torch.cuda.is_available() else "small"
        except ImportError:
            model = "small"
    gpu = model == "llama"
    root = Path(tempfile.mkdtemp(prefix="acompile-bench-torch-"))
    arms: dict[str, Any] = {}
    notes: list[str] = []
    sections = set(args.sections.split(","))
    if "second" in sections:
        sections.add("first")  # the second machines read what the first filled
    executable = _redis_executable(args) if _needs_redis(args) else None

    def arm(
        name: str,
        machine: str,
        serve: dict[str, Any] | None = None,
        threads: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Any:
        options = {"model": model, "serve": serve, "compile_threads": threads}
        print(f"[bench --torch] {name} ...", file=sys.stderr, flush=True)
        child_env = harness.child_env(root / machine, **_machine(root, machine), **(env or {}))
        result = harness.run_child(
            "compile_torch", "compile_model", options, root / "runs" / name, child_env, args.row_timeout
        )
        print(f"[bench --torch] {name}: {_summary(result)}", file=sys.stderr, flush=True)
        return result

    try:
        with redis_server(executable, root / "redis") if executable else contextlib.nullcontext(0) as port:
            url = f"redis://127.0.0.1:{port}"
            served = {"shared_cache": {"where": f"{url}/2", "signing_key": KEY}}
            if not args.fleet_only and "first" in sections:
                # A first machine, taken in turns: Inductor alone (``cold``) and served, each on
                # fresh folders every round; the served one on a shared tier of its own each
                # round (another database), so that none of it is warm. The first round's
                # machine and tier are those the second processes below read.
                first: dict[str, list[Any]] = {"cold": [], "acompile_fill": []}
                for i in range(args.repeat):
                    first["cold"].append(arm(f"cold{i}", f"a{i}"))
                    tier = {"shared_cache": {"where": f"{url}/{2 if i == 0 else 5 + i}", "signing_key": KEY}}
                    first["acompile_fill"].append(arm(f"acompile_fill{i}", f"d{i}", tier))
                    if i == 0:
                        arms["inductor_redis_fill"] = arm(
                            "inductor_redis_fill", "b", env=_inductor_redis(f"{url}/1", gpu)
                        )
                for name, runs in first.items():
                    arms[name] = _median_run(runs)
            if not args.fleet_only and "second" in sections:
                # The three a second process is measured against, taken in turns (a machine's
                # drift then touches all three), each a new machine every time but local_warm.
                warm: dict[str, list[Any]] = {
                    "local_warm": [],
                    "inductor_redis_second": [],
                    "acompile_second": [],
                }
                for i in range(args.repeat):
                    warm["local_warm"].append(arm(f"local_warm{i}", "a0"))
                    redis_env = _inductor_redis(f"{url}/1", gpu)
                    warm["inductor_redis_second"].append(
                        arm(f"inductor_redis_second{i}", f"c{i}", env=redis_env)
                    )
                    warm["acompile_second"].append(arm(f"acompile_second{i}", f"e{i}", served))
                for name, runs in warm.items():
                    arms[name] = _median_run(runs)
            if not args.fleet_only and "threads" in sections and not gpu:
                notes.append(
                    "threads: compile_threads=1 puts Triton on the critical path, on a GPU: not run here"
                )
            if not args.fleet_only and "threads" in sections and gpu:
                # compile_threads=1, taken in turns too: Inductor serial, Inductor's own
                # pool, served. Their Triton compiles are the critical path.
                one: dict[str, list[Any]] = {
                    n: [] for n in ("serial_cold", "pool_cold", "served_threads1_cold")
                }
                for i in range(args.repeat):
                    one["serial_cold"].append(arm(f"serial_cold{i}", f"f{i}", threads=1))
                    one["pool_cold"].append(arm(f"pool_cold{i}", f"g{i}"))
                    one["served_threads1_cold"].append(
                        arm(f"served_threads1_cold{i}", f"h{i}", {}, threads=1)
                    )
                for name, runs in one.items():
                    arms[name] = _median_run(runs)
            if not args.fleet_only and "import" in sections:
                arms["import_torch"] = _import_torch(root, args.repeat)
            if args.fleet:
                arms["fleet_inductor"] = _fleet(arm, args.fleet, "fi", None, _inductor_redis(f"{url}/3", gpu))
                fleet_serve = {
                    "shared_cache": {"where": f"{url}/4", "signing_key": KEY},
                    "workers": max(1, args.fleet_workers),
                }
                arms["fleet_acompile"] = _fleet(arm, args.fleet, "fa", fleet_serve, {})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "machine": harness.machine(), "arms": arms, "notes": notes}


def _needs_redis(args: argparse.Namespace) -> bool:
    """Whether the arms asked for use a shared tier (a first machine fills one; fleets share one)."""
    sections = set(args.sections.split(","))
    return bool(args.fleet) or (not args.fleet_only and bool(sections & {"first", "second"}))


def _redis_executable(args: argparse.Namespace) -> str | None:
    if args.redis_server:
        return str(Path(args.redis_server).resolve())
    return shutil.which("redis-server") or None


_IMPORT = (
    "import json, sys, time\n"
    "t = time.perf_counter()\n"
    "import torch\n"
    "t = time.perf_counter() - t\n"
    "print(json.dumps({'import_s': t, 'modules': sorted(sys.modules)}))\n"
)
# What torch does with acompile's entry point at its import, alone in a fresh process.
_ENTRY_POINT = (
    "import json, time\n"
    "from importlib.metadata import entry_points\n"
    "(found,) = [e for e in entry_points(group='torch.backends') if e.name == 'acompile']\n"
    "t = time.perf_counter()\n"
    "found.load()()\n"
    "print(json.dumps({'entry_point_s': time.perf_counter() - t}))\n"
)


def _import_torch(root: Path, repeat: int) -> dict[str, Any]:
    """``import torch`` in a fresh process of this environment, where acompile is installed
    (torch loads its ``torch.backends`` entry point) and nothing is served, against the same
    with torch's extensions off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), taken in turns: the
    import's own time and the whole process's, medians, and the modules the first imports
    that the second does not."""
    env = harness.child_env(root / "import")
    env.pop("ACOMPILE_SERVE_TORCH", None)
    sides = {"installed": {}, "extensions_off": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    modules: dict[str, set[str]] = {}
    entry: list[float] = []

    def child(code: str, extra: dict[str, str]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1]), time.perf_counter() - t0

    try:
        for _ in range(max(repeat, 5)):
            for name, extra in sides.items():
                out, whole = child(_IMPORT, extra)
                samples[name].append((out["import_s"], whole))
                modules[name] = set(out["modules"])
            entry.append(child(_ENTRY_POINT, {})[0]["entry_point_s"])
    except (RuntimeError, ValueError) as exc:
        return {"crashed": str(exc)}
    return {
        "samples_each": len(entry),
        "entry_point_s": statistics.median(entry),
        "import_s": {n: statistics.median(i for i, _ in v) for n, v in samples.items()},
        "process_s": {n: statistics.median(w for _, w in v) for n, v in samples.items()},
        "samples": {n: [[round(i, 4), round(w, 4)] for i, w in v] for n, v in samples.items()},
        "more_modules": sorted(modules["installed"] - modules["extensions_off"]),
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose first call took the median time, with every run's times beside it."""
    good = sorted((r for r in runs if "first_call_s" in r), key=lambda r: r["first_call_s"])
    if not good:
        return runs[0]
    chosen = dict(good[(len(good) - 1) // 2])
    chosen["samples_first_call_s"] = [round(r["first_call_s"], 3) for r in runs if "first_call_s" in r]
    chosen["samples_process_s"] = [
        round(r.get("process_to_ready_s") or 0, 3) for r in runs if "first_call_s" in r
    ]
    return chosen


def _fleet(
    arm: Any, n: int, prefix: str, serve: dict[str, Any] | None, env: dict[str, str]
) -> dict[str, Any]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda i: arm(f"{prefix}{i}", f"{prefix}{i}", serve, env=env), range(n)))
    compiled = sum(r.get("inductor", {}).get("fxgraph_cache_miss", 0) for r in runs)
    first = [r["first_call_s"] for r in runs if "first_call_s" in r]
    return {
        "machines": n,
        "graphs_compiled": compiled,
        "crashed": [r["crashed"] for r in runs if "crashed" in r],
        "first_call_max_s": max(first) if first else None,
        "process_max_s": max((r.get("process_to_ready_s") or 0 for r in runs), default=None),
    }


def _summary(result: dict[str, Any]) -> str:
    if "crashed" in result:
        return f"CRASHED: {result['crashed']}"
    return f"first call {result['first_call_s']:.2f} s, process {result.get('process_to_ready_s', 0):.2f} s"


def report(document: dict[str, Any]) -> str:
    arms = document["arms"]
    tabled = [n for n in arms if not n.startswith("fleet_") and n != "import_torch"]
    warm = arms.get("local_warm", {})
    warm_first, warm_process = warm.get("first_call_s"), warm.get("process_to_ready_s")
    rows = []
    for name in tabled:
        r = arms[name]
        if "crashed" in r:
            rows.append([name, "crashed", "", "", "", "", "", ""])
            continue
        served = r.get("served") or {}
        cpp_counts = served.get("cpp") or {}
        cpp = f"{cpp_counts.get('local_builds', 0)} / {cpp_counts.get('builds', 0)}" if cpp_counts else ""
        rows.append(
            [
                name,
                harness.fmt(r["first_call_s"]),
                harness.fmt(r.get("process_to_ready_s")),
                _times(r["first_call_s"], warm_first),
                _times(r.get("process_to_ready_s"), warm_process),
                harness.fmt(r["triton_s"]),
                str(r["inductor"].get("fxgraph_cache_miss", 0)),
                str(cpp),
            ]
        )
    lines = [f"torch.compile, model {document['model']}"]
    if rows:
        lines[0] += "; ratios against local_warm" if warm_first else ""
        header = ["arm", "first call s", "process s", "first/warm", "process/warm", "compile wait s"]
        header += ["graphs compiled", "C++ built here / on workers"]
        lines.append(harness.table(header, rows))
    lines += _targets(arms)
    lines += [f"- {note}" for note in document.get("notes", [])]
    for name in ("fleet_inductor", "fleet_acompile"):
        if name in arms:
            f = arms[name]
            lines.append(
                f"{name}: {f['machines']} machines at once compiled the graph "
                f"{f['graphs_compiled']} time(s); "
                f"slowest first call {harness.fmt(f['first_call_max_s'])} s"
                + (f"; crashed: {f['crashed']}" if f["crashed"] else "")
            )
    bad = [
        n
        for n, r in arms.items()
        if not n.startswith("fleet_") and n != "import_torch" and not r.get("outputs_match", False)
    ]
    if bad:
        lines.append(f"outputs differ from eager (or the arm crashed): {bad}")
    return "\n".join(lines)


def _times(value: float | None, anchor: float | None) -> str:
    return f"{value / anchor:.2f}x" if value and anchor else ""


def _pair(label: str, ours: dict[str, Any] | None, anchor: dict[str, Any] | None, anchor_name: str) -> str:
    """One target's line: first call and whole process, ours against the anchor, with samples."""
    if not ours or not anchor or "first_call_s" not in ours or "first_call_s" not in anchor:
        return f"{label}: n/a (an arm crashed or did not run)"
    parts = []
    for key, samples, what in (
        ("first_call_s", "samples_first_call_s", "first call"),
        ("process_to_ready_s", "samples_process_s", "process"),
    ):
        a, b = ours.get(key), anchor.get(key)
        ratio = harness.fmt(a / b if a and b else None, ".2f")
        seen = f" (samples {ours.get(samples, [])} vs {anchor.get(samples, [])})" if samples in ours else ""
        parts.append(f"{what} {harness.fmt(a)} vs {harness.fmt(b)} s = {ratio}x{seen}")
    return f"{label} / {anchor_name}: " + "; ".join(parts)


def _targets(arms: dict[str, Any]) -> list[str]:
    """The rows the targets are read from (medians of the runs taken in turns)."""
    lines = ["", "targets' rows (medians; whole process beside the first call):"]
    if "acompile_fill" in arms:
        lines.append(
            _pair("- first machine, served", arms.get("acompile_fill"), arms.get("cold"), "Inductor alone")
        )
    if "local_warm" in arms:
        lines.append(
            _pair(
                "- second machine, served", arms.get("acompile_second"), arms.get("local_warm"), "local warm"
            )
        )
    if "served_threads1_cold" in arms:
        waits = {
            n: arms.get(n, {}).get("triton_s") for n in ("served_threads1_cold", "serial_cold", "pool_cold")
        }
        firsts = {n: arms.get(n, {}).get("first_call_s") for n in waits}
        lines.append(
            "- compile_threads=1, the compiling thread's wait for Triton: served "
            f"{harness.fmt(waits['served_threads1_cold'])} s, "
            f"Inductor serial {harness.fmt(waits['serial_cold'])} s, "
            f"Inductor's own pool (default threads) {harness.fmt(waits['pool_cold'])} s; first calls "
            + " / ".join(harness.fmt(v) for v in firsts.values())
            + " s"
        )
    imported = arms.get("import_torch")
    if imported and "crashed" not in imported:
        i, w = imported["import_s"], imported["process_s"]
        more = imported["more_modules"]
        lines.append(
            f"- import torch, acompile installed, not serving (medians of {imported['samples_each']}, "
            "taking turns): its entry point, loaded and called "
            f"as torch does, {imported['entry_point_s'] * 1e3:.2f} ms; {len(more)} more module(s) "
            f"than with torch's extensions off: {', '.join(more) or 'none'}. import torch itself "
            f"{i['installed'] * 1e3:.0f} vs {i['extensions_off'] * 1e3:.0f} ms with extensions off "
            f"(whole process {w['installed'] * 1e3:.0f} vs {w['extensions_off'] * 1e3:.0f} ms; off also "
            "skips torch's own look-up of every installed package's entry points)"
        )
    elif imported:
        lines.append(f"- import torch: crashed: {imported['crashed']}")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return harness.child_main(CHILDREN, argv)
    parser = argparse.ArgumentParser(
        prog="acompile bench --torch",
        description="torch.compile served by acompile, against Inductor on its own: each arm a fresh "
        "process; first call, and interpreter start to its result (docs/torch.md says what each arm is).",
    )
    parser.add_argument(
        "--model",
        choices=("auto", "small", "llama"),
        default="auto",
        help="small: a CPU model (Inductor's C++ backend); llama: a Llama-shaped decoder on a GPU "
        "(transformers' config, no download); auto: llama where CUDA is available (default)",
    )
    parser.add_argument("--fleet", type=int, default=8, help="machines starting together (0: none)")
    parser.add_argument("--fleet-workers", type=int, default=1, help="workers of each fleet machine's pool")
    parser.add_argument("--fleet-only", action="store_true", help="run only the fleets' arms")
    parser.add_argument(
        "--sections",
        default="first,second,threads,import",
        help="comma-separated, of: first (a first machine, served and Inductor alone), second "
        "(second machines against local warm; runs first too), threads (compile_threads=1, on a "
        "GPU), import (import torch with acompile installed) (default: all)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each arm a second process is measured against (median)"
    )
    parser.add_argument("--json", default="bench-results/bench-torch.json")
    parser.add_argument("--redis-server", default=None, help="the redis-server to run (default: on PATH)")
    parser.add_argument("--row-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not 1 <= args.repeat <= 10:
        parser.error("--repeat is 1 to 10 (each first machine's round takes a database of its own)")
    if unknown := set(args.sections.split(",")) - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(unknown)}; choose among {', '.join(SECTIONS)}")
    if _needs_redis(args) and _redis_executable(args) is None:
        print(
            "acompile bench --torch: the first and second machines and the fleets share a Redis "
            "tier: install redis-server, or give --redis-server PATH (--sections import or "
            "threads with --fleet 0 need none)",
            file=sys.stderr,
        )
        return 2
    executable = _redis_executable(args) if args.redis_server else None
    if executable is not None and not os.access(executable, os.X_OK):
        print(
            f"acompile bench --torch: --redis-server {args.redis_server}: not an executable file",
            file=sys.stderr,
        )
        return 2
    if need := harness.missing(torch=True):
        print(f"acompile bench --torch: needs {need}", file=sys.stderr)
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
