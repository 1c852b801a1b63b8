"""What every benchmark shares: fresh-process runs, timing, the machine's description, tables.

A measurement runs in a fresh interpreter, ``python -m acompile._bench.<module> --child NAME
--out PATH --options JSON``: the module's ``main`` hands such a command line to ``child_main``
with its table of child functions, which runs one (a coroutine function under ``anyio.run``) and
writes what it returns as JSON. The orchestrating process starts it with ``run_child``, which
adds the wall time, the CPU seconds of the child and of every process it reaped, the load average
before it, and interpreter start -> ready where the child stamped it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def missing(*, psutil: bool = False, torch: bool = False, gpu: bool = False, ray: bool = False) -> str | None:
    """What a section needs and this environment lacks, as a user would fix it (None: nothing).

    Checked before a section runs anything, so that a missing package is one named line, not a
    row's traceback minutes in. ``gpu`` imports PyTorch (a few seconds) to ask it for a device."""
    lacking = []
    if psutil and not _importable("psutil"):
        lacking.append("psutil (pip install 'acompile[bench]')")
    if ray and not _importable("ray"):
        lacking.append("Ray (pip install 'acompile[ray]')")
    if (torch or gpu) and not _importable("torch"):
        lacking.append("PyTorch (pip install 'acompile[torch]')")
    elif gpu:
        import torch as torch_module

        if not torch_module.cuda.is_available():
            build = (
                f"PyTorch {torch_module.__version__}, CUDA {torch_module.version.cuda or 'none: a CPU build'}"
            )
            lacking.append(
                f"an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False; {build})"
            )
    return " and ".join(lacking) or None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a None in sys.modules (import blocked), a broken parent
        return False


def quiet_warnings() -> None:
    """Silence Triton's UserWarnings (``TRITON_DEFAULT_FP_FUSION`` is unset ...) in this process."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"triton(\..*)?$")
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(seconds: float | None, digits: int = 3) -> float | None:
    """Seconds as rounded milliseconds (None stays None)."""
    return None if seconds is None else round(seconds * 1000, digits)


def latency(samples: list[float]) -> dict[str, Any]:
    """p50 / p99 / max of latencies in seconds, as milliseconds."""
    return {
        "n": len(samples),
        "p50_ms": ms(percentile(samples, 0.50), 4),
        "p99_ms": ms(percentile(samples, 0.99), 4),
        "max_ms": ms(max(samples) if samples else None, 4),
    }


class LagSamples(list[float]):
    """How late each probe woke (seconds), and the pauses of CPython's full collections
    (generation 2) in the same window: a full collection stops every thread of the process, the
    loop included, and on a process that has imported Triton takes 15-25 ms. It lands in a row
    or not depending on how much the whole process allocated before, so a lag maximum is read
    next to it."""

    def __init__(self) -> None:
        super().__init__()
        self.full_gc: list[float] = []

    def clear(self) -> None:
        super().clear()
        self.full_gc.clear()


@contextlib.asynccontextmanager
async def probing() -> AsyncIterator[LagSamples]:
    """Event-loop lag while the body of the ``async with`` runs: how late each
    ``await anyio.sleep(0.001)`` of a probe task comes back, in seconds; and the full
    collections that ran meanwhile (``samples.full_gc``, seconds each)."""
    import gc

    import anyio

    samples = LagSamples()
    started: list[float] = []

    def collection(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            samples.full_gc.append(time.perf_counter() - started.pop())

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.001)
            samples.append(time.perf_counter() - t - 0.001)

    gc.callbacks.append(collection)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            try:
                yield samples
            finally:
                tg.cancel_scope.cancel()
    finally:
        with contextlib.suppress(ValueError):  # the body may have cleared gc.callbacks
            gc.callbacks.remove(collection)


def lag_figures(samples: LagSamples) -> dict[str, Any]:
    """A row's lag: p50 / p99 / max, and the full collections inside the window."""
    return {
        **latency(samples),
        "full_gc": len(samples.full_gc),
        "full_gc_max_ms": ms(max(samples.full_gc), 2) if samples.full_gc else None,
    }


def idle_lag(seconds: float = 0.5) -> dict[str, Any]:
    """The loop lag of an idle event loop on this machine: the floor of every row's figure."""
    import anyio

    async def measure() -> dict[str, Any]:
        async with probing() as samples:
            await anyio.sleep(seconds)
        return lag_figures(samples)

    return anyio.run(measure)


def machine() -> dict[str, Any]:
    """The machine and the versions a figure depends on."""
    from acompile._sizing import usable_cpus
    from acompile._version import __version__

    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {}
    for dist in ("triton", "anyio"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        **versions,
        "acompile": __version__,
    }


def prime_page_cache() -> None:
    """Read Triton's binaries once, so the first row does not pay the disk for all rows."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(next(iter(spec.submodule_search_locations)))
    for folder in (root / "_C", root / "backends" / "nvidia" / "bin", root / "backends" / "nvidia" / "lib"):
        for path in folder.rglob("*") if folder.is_dir() else ():
            with contextlib.suppress(OSError), open(path, "rb") as f:
                while f.read(1 << 22):
                    pass


def child_env(folder: Path, **extra: str) -> dict[str, str]:
    """The environment of a fresh process: empty Triton and acompile caches of its own under
    ``folder`` (unless ``extra`` names others), and this package importable."""
    env = dict(os.environ)
    for name in ("triton-cache", "acompile-cache"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    env["TRITON_CACHE_DIR"] = str(folder / "triton-cache")
    env["ACOMPILE_CACHE_DIR"] = str(folder / "acompile-cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_child(
    module: str, name: str, options: Mapping[str, Any], folder: Path, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Run child ``name`` of ``acompile._bench.<module>`` in a fresh process and return what it
    wrote (or why it wrote nothing). The process gets a session of its own, so one that hangs is
    stopped with everything it started; its output goes to ``folder/log.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    out, log = folder / "result.json", folder / "log.txt"
    cmd = [sys.executable, "-m", f"acompile._bench.{module}", "--child", name, "--out", str(out)]
    cmd += ["--options", json.dumps(dict(options))]
    load = os.getloadavg()[0]
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as log_file:
        spawned_at, t0 = time.time(), time.perf_counter()
        child = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
        process_s = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    tail = log.read_text(errors="replace")[-3000:]
    result: dict[str, Any]
    if code is None:
        result = {"crashed": f"timed out after {timeout} s", "log_tail": tail}
    elif not out.exists():
        result = {"crashed": f"{name} exited {code} without a result", "log_tail": tail}
    else:
        result = json.loads(out.read_text())
        if tail.strip():
            result["log_tail"] = tail
    stamps = result.pop("stamps", None)
    if stamps:
        # Interpreter start (just before the spawn) -> every kernel ready, on the wall clock
        # (psutil's create time is only accurate to the boot time's whole second).
        result["process_to_ready_s"] = stamps["ready"] - spawned_at
        result["process_to_imported_s"] = stamps["imported"] - spawned_at
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    # What the child did after its row, for the report only (the bound's samples): not the row's.
    process_s -= result.pop("uncounted_s", 0.0)
    cpu -= result.pop("uncounted_cpu_s", 0.0)
    result.update(process_s=process_s, cpu_s=cpu, loadavg_before=load)
    return result


def cpu_time() -> float:
    """CPU seconds of this process and of the children it reaped (compilers), so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child_main(children: Mapping[str, Callable[[argparse.Namespace], Any]], argv: list[str]) -> int:
    """The entry of a fresh process: ``--child NAME --out PATH --options JSON``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True, choices=sorted(children))
    parser.add_argument("--out", required=True)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args(argv)
    options = argparse.Namespace(**json.loads(args.options))
    quiet_warnings()
    func = children[args.child]
    try:
        if inspect.iscoroutinefunction(func):
            import anyio

            result = anyio.run(func, options)
        else:
            result = func(options)
    except BaseException as exc:
        result = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result, default=str))
    return 0


def fmt(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    """A number for a table cell; "n/a" for None."""
    return "n/a" if value is None else format(value * scale if scale != 1.0 else value, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), "-" * len(line(header)), *map(line, rows)])
