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
import json
import shutil
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
    executable = str(Path(args.redis_server).resolve()) if args.redis_server else None
    executable = executable or shutil.which("redis-server") or "/usr/bin/redis-server"

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
        with redis_server(executable, root / "redis") as port:
            url = f"redis://127.0.0.1:{port}"
            served = {"shared_cache": {"where": f"{url}/2", "signing_key": KEY}}
            if not args.fleet_only:
                arms["cold"] = arm("cold", "a")
                arms["inductor_redis_fill"] = arm(
                    "inductor_redis_fill", "b", env=_inductor_redis(f"{url}/1", gpu)
                )
                arms["acompile_fill"] = arm("acompile_fill", "d", served)
                # The three a second process is measured against, taken in turns (a machine's
                # drift then touches all three), each a new machine every time but local_warm.
                warm: dict[str, list[Any]] = {
                    "local_warm": [],
                    "inductor_redis_second": [],
                    "acompile_second": [],
                }
                for i in range(args.repeat):
                    warm["local_warm"].append(arm(f"local_warm{i}", "a"))
                    redis_env = _inductor_redis(f"{url}/1", gpu)
                    warm["inductor_redis_second"].append(
                        arm(f"inductor_redis_second{i}", f"c{i}", env=redis_env)
                    )
                    warm["acompile_second"].append(arm(f"acompile_second{i}", f"e{i}", served))
                for name, runs in warm.items():
                    arms[name] = _median_run(runs)
                if gpu:
                    arms["serial_cold"] = arm("serial_cold", "f", threads=1)
                    arms["pool_cold"] = arm("pool_cold", "g")
                    arms["served_threads1_cold"] = arm("served_threads1_cold", "h", {}, threads=1)
            if args.fleet:
                arms["fleet_inductor"] = _fleet(arm, args.fleet, "fi", None, _inductor_redis(f"{url}/3", gpu))
                fleet_serve = {
                    "shared_cache": {"where": f"{url}/4", "signing_key": KEY},
                    "workers": max(1, args.fleet_workers),
                }
                arms["fleet_acompile"] = _fleet(arm, args.fleet, "fa", fleet_serve, {})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "machine": harness.machine(), "arms": arms}


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
    warm = arms.get("local_warm", {})
    warm_first, warm_process = warm.get("first_call_s"), warm.get("process_to_ready_s")
    rows = []
    for name, r in arms.items():
        if name.startswith("fleet_"):
            continue
        if "crashed" in r:
            rows.append([name, "crashed", "", "", "", "", "", ""])
            continue
        served = r.get("served") or {}
        cpp = (served.get("cpp") or {}).get("builds", "")
        rows.append(
            [
                name,
                harness.fmt(r["first_call_s"]),
                harness.fmt(r.get("process_to_ready_s")),
                harness.fmt(r["first_call_s"] / warm_first if warm_first else None, ".2f") + "x",
                harness.fmt(
                    r.get("process_to_ready_s") / warm_process
                    if warm_process and r.get("process_to_ready_s")
                    else None,
                    ".2f",
                )
                + "x",
                harness.fmt(r["triton_s"]),
                str(r["inductor"].get("fxgraph_cache_miss", 0)),
                str(cpp),
            ]
        )
    lines = [
        f"torch.compile, model {document['model']}; ratios against local_warm",
        harness.table(
            [
                "arm",
                "first call s",
                "process s",
                "first/warm",
                "process/warm",
                "compile wait s",
                "graphs compiled",
                "C++ built (served)",
            ],
            rows,
        ),
    ]
    for name in ("fleet_inductor", "fleet_acompile"):
        if name in arms:
            f = arms[name]
            lines.append(
                f"{name}: {f['machines']} machines at once compiled the graph "
                f"{f['graphs_compiled']} time(s); "
                f"slowest first call {harness.fmt(f['first_call_max_s'])} s"
                + (f"; crashed: {f['crashed']}" if f["crashed"] else "")
            )
    bad = [n for n, r in arms.items() if not n.startswith("fleet_") and not r.get("outputs_match", False)]
    if bad:
        lines.append(f"outputs differ from eager (or the arm crashed): {bad}")
    return "\n".join(lines)


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
        "--repeat", type=int, default=3, help="runs of each arm a second process is measured against (median)"
    )
    parser.add_argument("--json", default="bench-results/bench-torch.json")
    parser.add_argument("--redis-server", default=None, help="the redis-server to run (default: on PATH)")
    parser.add_argument("--row-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
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
