"""Parallel autotuning of Triton kernels: compile every config at once, benchmark each as it
lands, keep the winner.

``await pool.autotune(fn, configs, signature=..., args=..., grid=..., key=...)`` (or
``autotune(pool, ...)``) runs on the pool's ``Tuner``, which holds what a pool remembers: its
record store (the cache chain), the tunings in progress and the choices made or read:

1. Each config becomes one compile request; the *tuning key* is a hash of all their cache keys
   (so of the kernel's source, the signature, every config, the compiler's versions and the
   target) and of the caller's ``key`` (problem shape and the like). The order of the configs
   does not change it.
2. ``pin`` (a table, or a JSON file of one) that names a config for this ``key`` wins: that
   config is compiled, nothing is benchmarked, nothing is stored. For bit-exact runs across
   replicas.
3. Otherwise a choice stored under the tuning key (by an earlier process, or by another replica
   through the shared tier) is taken: that config is compiled (usually a cache hit), nothing is
   benchmarked, no GPU is needed. A pool remembers the choices it made or read, and keeps to
   them for its lifetime; concurrent calls for one tuning key in a pool benchmark once.
4. Otherwise every config is asked of the pool at once, the longest expected compile first (the
   last to land bounds the call). Each config is benchmarked on the GPU as soon as it lands, off
   the event loop, while the others compile (``_Contest``): a short screening run, then a full
   run (as Triton's ``do_bench``: 25 ms of warm-up, 100 ms of launches each timed with CUDA
   events, the L2 flushed before each, median) for the leaders, those screened within 10% of
   the best; a config whose first launch is already twice as slow as the best is out after it.
   Configs that fail to compile, load or launch (``OutOfResources`` ...) are skipped and
   reported. The fastest full run wins, and is stored under the tuning key, on disk and in the
   shared tier.

Benchmarking launches the kernel on the caller's ``args`` many times, so outputs are overwritten,
and a kernel that accumulates into an output (``+=``, atomics) leaves it changed: as with
``@triton.autotune``, pass ``reset=`` (run before every launch) or use scratch tensors.

Benchmarking uses PyTorch's CUDA events, so it needs ``torch`` and a GPU of the configs' target;
compiling needs neither.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from acompile import _linux
from acompile._backends import TritonKernel, TritonRequest, TritonSpec, prepare_triton
from acompile._cache import Entry, make_key
from acompile._errors import (
    BackendUnavailableError,
    CompileError,
    DeviceUnavailableError,
    InvalidSpecError,
)
from acompile._targets import Target, local_target

__all__ = ["Pool", "Records", "Trial", "TuneResult", "TunedKernel", "Tuner", "autotune", "pin_key"]

logger = logging.getLogger("acompile")

Grid = int | Sequence[int] | Callable[[dict[str, Any]], Any]
Source = Literal["benchmark", "cache", "pin", "single"]

_FORMAT = 1
# Options a triton.Config carries besides its kwargs, with the values that mean "not set": those
# are left out of the request, so that a config's kernel has the same cache key as the same
# kernel asked for with pool.triton().
_CONFIG_OPTIONS = {"num_ctas": 1, "maxnreg": None}
# Triton's do_bench flushes the L2 with a buffer of this size before each timed launch.
_FLUSH_BYTES = 256 * 1024 * 1024
# One benchmark at a time in this process, whatever loop or pool asks: two kernels timed at once
# on one GPU would slow each other down.
_bench_lock = threading.Lock()


class Records(Protocol):
    """Where tuning choices are stored: the pool's cache chain (``TierChain``)."""

    async def get_record(self, key: str) -> Entry | None:
        """The record stored under ``key`` in any tier, or None."""

    async def put_record(self, key: str, name: str, blobs: dict[str, bytes], meta: dict[str, Any]) -> None:
        """Store a record under ``key`` in every tier."""


class Pool(Protocol):
    """What a tuning asks of the pool it runs in: ``CompilePool``, which hands itself in (it is
    the layer above: this module never imports it)."""

    @property
    def target(self) -> Target | None:
        """The pool's default target, or None for the local GPU's."""

    async def compile(self, spec: TritonSpec, *, background: bool = False) -> TritonKernel:
        """The kernel ``spec`` asks for, from the pool's cache or its workers."""

    async def autotune(self, fn: Any, configs: Any = None, **options: Any) -> TunedKernel:
        """``Tuner.autotune`` for this pool."""


class Tuner:
    """A pool's autotuning state, owned by the pool (``CompilePool.autotune`` uses it).

    Attributes:
        records: where choices are read and stored (the pool's cache chain).
        in_progress: tunings running in this pool, by tuning key: a second caller with the same
            key waits for the first and then finds its stored choice instead of benchmarking.
        choices: choices this pool has made or read, by tuning key: asked again, it answers
            without reading the cache tiers, and keeps to the same choice for its lifetime.
    """

    def __init__(self, records: Records) -> None:
        self.records = records
        self.in_progress: dict[str, anyio.Event] = {}
        self.choices: dict[str, dict[str, Any]] = {}

    async def autotune(
        self, pool: Pool, memo_dir: Path, memory_limit: int | None, fn: Any, configs: Any, **options: Any
    ) -> TunedKernel:
        """``autotune()`` for ``pool`` (running; the caller checks), whose backends keep their
        toolchain memo in ``memo_dir`` and hold what they start to ``memory_limit``."""
        return await _autotune(self, pool, memo_dir, memory_limit, fn, configs, **options)


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """What happened to one config.

    Attributes:
        index: its place in the ``configs`` given.
        config: the config as plain data: ``{"constexprs": {...}, "num_warps": 4, "num_stages": 3}``
            (and ``num_ctas``, ``maxnreg`` ... where set).
        kernel_key: the cache key of its compiled kernel.
        median_ms: the median time of one launch, where it was benchmarked (in this call, or by
            the process whose stored choice was taken).
        launches: how many timed launches ``median_ms`` is the median of, where this call
            measured it: a leader's full run (as many as fit in 100 ms), a short screening run for
            a config clearly slower than the leaders, or 1 for a config whose first launch was
            already twice as slow as the best.
        skipped: why it is out of the running, in a line (a compile error, out of resources at
            load ...), else ``None``.
        error: the exception that put it out of the running, with its whole story (a
            ``CompileError`` carries the compiler's log and the worker's traceback), if any.
    """

    index: int
    config: dict[str, Any]
    kernel_key: str
    median_ms: float | None = None
    skipped: str | None = None
    error: BaseException | None = field(default=None, compare=False, repr=False)
    launches: int | None = None

    @property
    def label(self) -> str:
        return config_label(self.config)


@dataclass(frozen=True)
class TuneResult:
    """How the config of a ``TunedKernel`` was chosen.

    Attributes:
        key: the tuning key (hex) the choice is stored under.
        user_key: the caller's ``key``.
        source: ``"benchmark"`` (measured now), ``"cache"`` (a stored choice: this process, an
            earlier one, or another replica), ``"pin"`` (forced by ``pin=``), or ``"single"`` (only
            one config could compile, so there was nothing to choose).
        index: the chosen config's place in ``configs`` (``None`` for a pinned config that is
            not among them).
        config: the chosen config, as plain data (see ``Trial.config``).
        trials: one ``Trial`` per config given, in their order.
        device: the GPU the choice was measured on, where one was.
        compile_seconds: wall time from the start of this call's compiles until the last landed.
        bench_seconds: time this call spent benchmarking, most of it while configs compiled.
    """

    key: str
    user_key: Any
    source: Source
    index: int | None
    config: dict[str, Any]
    trials: tuple[Trial, ...] = ()
    device: str | None = None
    compile_seconds: float = 0.0
    bench_seconds: float = 0.0

    @property
    def timings(self) -> dict[int, float]:
        """Median milliseconds per config index, for the configs benchmarked."""
        return {t.index: t.median_ms for t in self.trials if t.median_ms is not None}

    @property
    def skipped(self) -> dict[int, str]:
        """Why each skipped config was skipped, by config index."""
        return {t.index: t.skipped for t in self.trials if t.skipped is not None}

    def as_pin(self) -> dict[str, dict[str, Any]]:
        """This choice as a ``pin=`` entry: merge entries of several results into one table (or
        a JSON file) to force the same configs everywhere without benchmarking."""
        return {pin_key(self.user_key): self.config}

    def summary(self) -> str:
        """A short table of the configs, their times and why any were skipped."""
        lines = [
            f"tuning {self.key[:16]}… key={self.user_key!r}: {self.source}, chose {config_label(self.config)}"
        ]
        for t in self.trials:
            mark = "  <- chosen" if t.index == self.index else ""
            if t.skipped is not None:
                what = "skipped: " + t.skipped.splitlines()[0][:160]
            elif t.median_ms is not None:
                what = f"{t.median_ms:.4f} ms"
                if t.launches is not None:
                    what += f" ({t.launches} timed launches)"
            else:
                what = "not measured"
            lines.append(f"  #{t.index} {t.label}: {what}{mark}")
        return "\n".join(lines)


class TunedKernel(TritonKernel):
    """The winning config's ``TritonKernel`` (launch it the same way: ``kernel[grid](*args)``),
    with how it was chosen in ``.tuning`` (a ``TuneResult``) and the config in ``.config``.

    It shares the compiled kernel (and its module, once loaded) with the pool's cache.
    """

    tuning: TuneResult

    def __init__(self, kernel: TritonKernel, tuning: TuneResult) -> None:
        # No TritonKernel.__init__: take the cached kernel's state as it is, so that both load
        # the binary once. A separate object, though: the same kernel can win for several keys.
        self.__dict__.update(kernel.__dict__)
        self.tuning = tuning
        # A grid function launches through _subscript_miss here (with the tuning's meta), not
        # through the kernel's binder: none is ever set (_grid_function_launches).
        self._by_grid_function = None

    def _grid_function_launches(self, launches: Any) -> None:
        return None

    @property
    def config(self) -> dict[str, Any]:
        return self.tuning.config

    def _subscript_miss(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid](*args)`` (a grid of ints kept: TritonKernel's), where a callable grid
        gets the same meta as during tuning: the runtime arguments by name, the constexprs,
        ``num_warps`` and ``num_stages``."""
        if not callable(grid):
            return super()._subscript_miss(grid)
        self.load()
        runtime = [n for n in self._order if n not in self._constants]
        fixed = {**self._constants, **{k: v for k, v in self.config.items() if k != "constexprs"}}

        def run(*args: Any, stream: Any = None) -> None:
            meta = {**dict(zip(runtime, args, strict=False)), **fixed}
            TritonKernel.__getitem__(self, _grid_tuple(grid(meta)))(*args, stream=stream)

        return run

    def __repr__(self) -> str:
        return (
            f"<TunedKernel {self.name} {self.target} [{config_label(self.config)}] "
            f"({self.tuning.source}) key={self.key[:12]}…>"
        )


# --- configs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "constexprs": dict(self.constexprs),
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **self.options,
        }


def config_label(config: Mapping[str, Any]) -> str:
    """``"BLOCK=128 num_warps=4 num_stages=3"`` for a config in its plain-data form."""
    parts = [f"{k}={v}" for k, v in dict(config.get("constexprs") or {}).items()]
    parts += [f"{k}={v}" for k, v in config.items() if k != "constexprs"]
    return " ".join(parts)


def _normalize_config(config: Any, where: str) -> _Config:
    """A ``triton.Config`` or a dict ``{"constexprs": {...}, "num_warps": .., "num_stages": ..,
    other Triton options}``, as one form."""
    if isinstance(config, Mapping):
        rest = dict(config)
        constexprs = rest.pop("constexprs", None) or {}
        if not isinstance(constexprs, Mapping):
            raise InvalidSpecError(f"{where}: 'constexprs' must map names to values, got {constexprs!r}")
        num_warps = rest.pop("num_warps", 4)
        num_stages = rest.pop("num_stages", 3)
        options = rest
    elif hasattr(config, "kwargs") and hasattr(config, "num_warps") and hasattr(config, "num_stages"):
        # A triton.Config (duck-typed: importing Triton is not this module's business).
        if getattr(config, "pre_hook", None) is not None:
            raise InvalidSpecError(
                f"{where} has a pre_hook: configs are compiled in other processes and benchmarked "
                "without hooks; pass reset= to prepare the arguments before each launch instead"
            )
        if getattr(config, "ir_override", None) is not None:
            raise InvalidSpecError(f"{where} has an ir_override, which acompile does not compile")
        constexprs = config.kwargs or {}
        if not isinstance(constexprs, Mapping):
            raise InvalidSpecError(f"{where}: its kwargs must map names to values, got {constexprs!r}")
        num_warps = config.num_warps if config.num_warps is not None else 4
        num_stages = config.num_stages if config.num_stages is not None else 3
        options = {}
        for name, unset in _CONFIG_OPTIONS.items():
            value = getattr(config, name, unset)
            if value != unset:
                options[name] = value
    else:
        raise InvalidSpecError(
            f"{where} is {type(config).__name__}: pass triton.Config objects or dicts such as "
            "{'constexprs': {'BLOCK': 128}, 'num_warps': 4, 'num_stages': 3}"
        )
    return _Config(dict(constexprs), num_warps, num_stages, dict(sorted(options.items())))


def pin_key(user_key: Any) -> str:
    """The form of a tuning ``key`` in a ``pin=`` table or file: its JSON with sorted keys, so
    ``(1024, 512)`` and ``[1024, 512]`` are ``"[1024, 512]"``, ``{"M": 8}`` is ``'{"M": 8}'``."""
    try:
        return json.dumps(user_key, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidSpecError(
            f"key={user_key!r} must be JSON data (numbers, strings, lists, dicts: shapes, dtype "
            f"names as strings ...): {exc}"
        ) from None


async def _pin_table(pin: Mapping[Any, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The pin table with its keys in ``pin_key`` form (a file's keys may be written any way
    that parses as the same JSON)."""
    if isinstance(pin, (str, os.PathLike)):
        path = anyio.Path(os.fspath(pin))
        try:
            text = await path.read_text()
        except OSError as exc:
            raise InvalidSpecError(f"cannot read the pin file {str(path)!r}: {exc}") from exc
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise InvalidSpecError(f"the pin file {str(path)!r} is not JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise InvalidSpecError(
                f"the pin file {str(path)!r} must hold a JSON object mapping keys to a config "
                f"index or config, got {type(loaded).__name__}"
            )
        pin = loaded
    if not isinstance(pin, Mapping):
        raise InvalidSpecError(f"pin must be a mapping or the path of a JSON file, got {type(pin).__name__}")
    table: dict[str, Any] = {}
    for k, v in pin.items():
        table.setdefault(pin_key(k), v)
    for k, v in pin.items():
        if isinstance(k, str):
            # A key written as JSON text: '[1024, 512]', '{"M":8}' (any spacing or order).
            try:
                table.setdefault(pin_key(json.loads(k)), v)
            except (ValueError, InvalidSpecError):
                pass
    return table


def _pinned_config(value: Any, configs: list[_Config]) -> tuple[int | None, _Config]:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < len(configs):
            raise InvalidSpecError(f"pin names config #{value}, but there are {len(configs)} configs")
        return value, configs[value]
    config = _normalize_config(value, "the pinned config")
    return (configs.index(config) if config in configs else None), config


# --- the tuning -----------------------------------------------------------------------------


async def autotune(pool: Pool, fn: Any, configs: Sequence[Any] | None = None, **options: Any) -> TunedKernel:
    """``pool.autotune(fn, configs, **options)``: see ``_autotune`` for the arguments."""
    return await pool.autotune(fn, configs, **options)


async def _autotune(
    tuner: Tuner,
    pool: Pool,
    memo_dir: Path,
    memory_limit: int | None,
    fn: Any,
    configs: Sequence[Any] | None,
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any] | None = None,
    args: Sequence[Any] = (),
    grid: Grid,
    key: Any = None,
    pin: Mapping[Any, Any] | str | os.PathLike[str] | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
    reset: Callable[[], Any] | None = None,
    retune: bool = False,
    target: str | Target | None = None,
    kernel_name: str | None = None,
    attrs: Mapping[Any, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> TunedKernel:
    """Choose the fastest of ``configs`` for ``fn`` and return it compiled, as a ``TunedKernel``.

    Args:
        fn: a ``@triton.jit`` function or source text (as for ``pool.triton()``), or a
            ``@triton.autotune`` kernel (its configs are used where ``configs`` is ``None``).
        configs: ``triton.Config`` objects (their ``kwargs`` are constexprs; ``num_warps``,
            ``num_stages``, ``num_ctas``, ``maxnreg`` compile options; no ``pre_hook``), or
            dicts ``{"constexprs": {...}, "num_warps": 4, "num_stages": 3, **options}``.
        signature: Triton type of each runtime parameter, as for ``pool.triton()``.
        constexprs: compile-time values common to every config (a config may not repeat one).
        args: the runtime arguments to benchmark with (tensors on the GPU, scalars), in the
            kernel's order without constexprs. Benchmarking overwrites outputs (see ``reset``).
        grid: the launch grid: a tuple, or ``grid(meta)`` with meta the runtime arguments by
            name, the config's constexprs, ``num_warps`` and ``num_stages`` (as Triton's grids).
        key: JSON data naming the problem (shapes, dtype names ...): a choice is stored and
            looked up per kernel, configs, target and ``key``.
        pin: ``{key: config index or config}`` or the path of a JSON file of that; keys are
            written as ``pin_key(key)`` (JSON text). A pinned key is compiled with its config:
            no lookup, no benchmark, nothing stored. Keys not in the table tune as usual.
        warmup, repeats: at most this many launches before timing, and timed (the median is
            taken); ``None``: as many as fit in 25 ms and 100 ms (a screening run: 2 and 5 ms),
            as Triton's ``do_bench``.
        reset: called (in the benchmarking thread) before every launch, outside the timed region:
            to zero an accumulator, restore an in-place input ...
        retune: benchmark even if a choice is stored (the new one replaces it).
        target, kernel_name, attrs, options: as for ``pool.triton()``; ``options`` are common to
            every config.

    Raises:
        InvalidSpecError: a wrong argument or config (before any compile).
        CompileError: no config compiled (or none could run on the GPU); the message lists why
            for each, and ``.failures`` maps config index to reason.
        DeviceUnavailableError: benchmarking is needed and there is no GPU (or PyTorch cannot see
            it); every config compiled before this is raised, so they are cached.
        BackendUnavailableError: there is a GPU but PyTorch, whose CUDA events time the
            launches, is not installed.
    """
    if configs is None:
        inner = getattr(fn, "fn", None)
        found = getattr(fn, "configs", None)
        if inner is None or found is None:
            raise InvalidSpecError("configs=None works only for a @triton.autotune kernel: pass configs")
        fn, configs = inner, found
    elif hasattr(fn, "configs") and hasattr(fn, "fn"):
        fn = fn.fn  # a @triton.autotune kernel given with configs of the caller's own
    if isinstance(configs, (str, bytes)) or not isinstance(configs, Sequence) or not configs:
        raise InvalidSpecError("configs must be a non-empty list of triton.Config or config dicts")
    for name, value in (("warmup", warmup), ("repeats", repeats)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
            raise InvalidSpecError(
                f"{name} must be a {'non-negative' if name == 'warmup' else 'positive'} "
                f"integer or None, got {value!r}"
            )
    if reset is not None and not callable(reset):
        raise InvalidSpecError(f"reset must be a callable (or None), got {reset!r}")
    if not callable(grid) and not isinstance(grid, (int, Sequence)):
        raise InvalidSpecError(f"grid must be a tuple of ints or a callable(meta), got {grid!r}")
    user_pin = pin_key(key)
    common = dict(constexprs or {})
    common_options = dict(options or {})
    for reserved in ("num_warps", "num_stages"):
        if reserved in common_options:
            raise InvalidSpecError(f"{reserved} is set per config, not in options=")
    normalized = [_normalize_config(c, f"config #{i}") for i, c in enumerate(configs)]

    def spec_of(config: _Config, where: str) -> TritonSpec:
        clash = sorted(set(config.constexprs) & set(common))
        if clash:
            raise InvalidSpecError(
                f"{where} sets constexpr(s) {clash} that constexprs= also sets: tune them in the "
                "configs or fix them in constexprs=, not both"
            )
        clash = sorted(set(config.options) & set(common_options))
        if clash:
            raise InvalidSpecError(f"{where} sets option(s) {clash} that options= also sets")
        return TritonSpec(
            fn,
            signature,
            {**common, **config.constexprs},
            kernel_name,
            config.num_warps,
            config.num_stages,
            target,
            attrs,
            {**common_options, **config.options},
        )

    specs = [spec_of(c, f"config #{i}") for i, c in enumerate(normalized)]
    requests = []
    for i, spec in enumerate(specs):
        try:
            with _linux.under_memory_limit(memory_limit):
                requests.append(await prepare_triton(spec, pool.target, memo_dir))
        except InvalidSpecError as exc:
            raise type(exc)(f"config #{i} ({config_label(normalized[i].as_dict())}): {exc}") from exc
    runtime = [n for n in requests[0].signature if n not in requests[0].constants]
    if args and len(args) != len(runtime):
        raise InvalidSpecError(
            f"args holds {len(args)} values; {requests[0].name} takes {len(runtime)} runtime "
            f"arguments ({', '.join(runtime)})"
        )
    tuning_key = make_key(
        {
            "autotune": _FORMAT,
            "kernel_keys": sorted({r.key for r in requests}),
            "user_key": key,
            "target": str(requests[0].target),
        }
    )
    tune = _Tuning(
        tuner, pool, normalized, specs, requests, runtime, tuning_key, key, args, grid, warmup, repeats, reset
    )

    if pin is not None:
        table = await _pin_table(pin)
        if user_pin in table:
            index, config = _pinned_config(table[user_pin], normalized)
            spec = specs[index] if index is not None else spec_of(config, "the pinned config")
            return await tune.finish(await pool.compile(spec), "pin", index, config)

    flights = tuner.in_progress
    while (pending := flights.get(tuning_key)) is not None:
        await pending.wait()  # the same tuning, already running: wait for its stored choice
    done = flights[tuning_key] = anyio.Event()
    try:
        if not retune:
            stored = await tune.stored_choice()
            if stored is not None:
                return stored
        return await tune.run()
    finally:
        del flights[tuning_key]
        done.set()


class _Tuning:
    """One call's state, once its arguments are checked."""

    def __init__(
        self,
        tuner: Tuner,
        pool: Pool,
        configs: list[_Config],
        specs: list[TritonSpec],
        requests: list[TritonRequest],
        runtime: list[str],
        key: str,
        user_key: Any,
        args: Sequence[Any],
        grid: Grid,
        warmup: int | None,
        repeats: int | None,
        reset: Callable[[], Any] | None,
    ) -> None:
        self.tuner = tuner
        self.pool = pool
        self.configs = configs
        self.specs = specs
        self.requests = requests
        self.runtime = runtime
        self.key = key
        self.user_key = user_key
        self.args = tuple(args)
        self.grid = grid
        self.warmup = warmup
        self.repeats = repeats
        self.reset = reset
        self.name = requests[0].name
        self.target = requests[0].target

    def trials(
        self,
        times: Mapping[int, float] | None = None,
        skipped: Mapping[int, str] | None = None,
        errors: Mapping[int, BaseException] | None = None,
        launches: Mapping[int, int] | None = None,
    ) -> tuple[Trial, ...]:
        times, skipped, errors, launches = times or {}, skipped or {}, errors or {}, launches or {}
        return tuple(
            Trial(i, c.as_dict(), r.key, times.get(i), skipped.get(i), errors.get(i), launches.get(i))
            for i, (c, r) in enumerate(zip(self.configs, self.requests, strict=True))
        )

    async def finish(
        self,
        kernel: TritonKernel,
        source: Source,
        index: int | None,
        config: _Config,
        trials: tuple[Trial, ...] | None = None,
        device: str | None = None,
        compile_seconds: float = 0.0,
        bench_seconds: float = 0.0,
    ) -> TunedKernel:
        result = TuneResult(
            self.key,
            self.user_key,
            source,
            index,
            config.as_dict(),
            trials if trials is not None else self.trials(),
            device,
            compile_seconds,
            bench_seconds,
        )
        return TunedKernel(kernel, result)

    # -- a stored choice -------------------------------------------------------------------------

    def duplicates(self) -> dict[int, str]:
        """Configs that compile to the same kernel as an earlier one (tried once, as that one)."""
        first: dict[str, int] = {}
        same: dict[int, str] = {}
        for i, r in enumerate(self.requests):
            if r.key in first:
                same[i] = f"the same kernel as config #{first[r.key]}"
            else:
                first[r.key] = i
        return same

    def by_index(self, by_kernel_key: Mapping[str, Any]) -> dict[int, Any]:
        """Values stored per kernel key, per config index here (the first config of each)."""
        found: dict[int, Any] = {}
        seen: set[str] = set()
        for i, r in enumerate(self.requests):
            if r.key in by_kernel_key and r.key not in seen:
                found[i] = by_kernel_key[r.key]
            seen.add(r.key)
        return found

    async def stored_choice(self) -> TunedKernel | None:
        """The choice made for this tuning key before: by this pool (remembered), else by any
        process sharing its cache tiers (a record on disk or in the shared tier)."""
        memo = self.tuner.choices
        choice = memo.get(self.key)
        try:
            if choice is None:
                entry = await self.tuner.records.get_record(self.key)
                if entry is None:
                    return None
                if entry.backend != "record":
                    raise ValueError(f"a {entry.backend!r} entry, not a record")
                choice = json.loads(entry.blobs["choice"])
                if not isinstance(choice, dict):
                    raise TypeError("not a JSON object")
            kernel_key = choice["kernel_key"]
            index = next(i for i, r in enumerate(self.requests) if r.key == kernel_key)
            times = {i: float(ms) for i, ms in self.by_index(choice["timings_ms"]).items()}
            skipped = {i: str(why) for i, why in self.by_index(choice["skipped"]).items()}
            device = choice.get("device")
        except (KeyError, ValueError, TypeError, AttributeError, StopIteration) as exc:
            logger.warning(
                "the stored tuning choice %s… of %s is unusable (%s: %s); tuning again",
                self.key[:16],
                self.name,
                type(exc).__name__,
                exc,
            )
            return None
        memo[self.key] = choice
        t0 = time.perf_counter()
        kernel = await self.pool.compile(self.specs[index])
        logger.debug("%s: stored tuning choice #%d for key %r", self.name, index, self.user_key)
        return await self.finish(
            kernel,
            "cache",
            index,
            self.configs[index],
            self.trials(times, {**skipped, **self.duplicates()}),
            device if isinstance(device, str) else None,
            time.perf_counter() - t0,
        )

    # -- compile everything, benchmarking each config as it lands --------------------------------

    async def run(self) -> TunedKernel:
        duplicates = self.duplicates()
        skipped: dict[int, str] = dict(duplicates)
        failures: dict[int, CompileError] = {}
        errors: dict[int, BaseException] = {}
        kernels: dict[int, TritonKernel] = {}
        # The last compile to land bounds the whole call: the longest expected go first.
        order = sorted(
            (i for i in range(len(self.requests)) if i not in duplicates),
            key=lambda i: -_expected_compile_cost(self.configs[i]),
        )
        landed, ready = anyio.create_memory_object_stream[int](len(order))
        fatal: list[Exception] = []
        t0 = time.perf_counter()
        compile_seconds = 0.0

        async def compile_one(i: int, landed: MemoryObjectSendStream[int]) -> None:
            nonlocal compile_seconds
            with landed:
                try:
                    kernels[i] = await self.pool.compile(self.specs[i])
                except CompileError as exc:
                    failures[i] = errors[i] = exc
                    skipped[i] = f"compile failed: {_reason(exc)}"
                except Exception as exc:  # the pool shut down, a worker could not start ...
                    fatal.append(exc)
                    tg.cancel_scope.cancel()
                    return
                else:
                    landed.send_nowait(i)  # never blocks: the buffer holds every config
                compile_seconds = time.perf_counter() - t0
                logger.debug("autotune %s: config #%d landed at %.3f s", self.name, i, compile_seconds)

        contest: _Contest | None = None
        no_bench: Exception | None = None
        # Errors are kept and raised after the task group, which would wrap them in a group.
        with ready:
            async with anyio.create_task_group() as tg:
                for i in order:
                    tg.start_soon(compile_one, i, landed.clone())
                landed.close()
                try:
                    if len(order) > 1:
                        try:
                            contest = await self._contest(len(order), kernels, skipped, errors)
                        except (DeviceUnavailableError, BackendUnavailableError, InvalidSpecError) as exc:
                            no_bench = exc  # raised only if two configs or more compile
                    if contest is not None:
                        await contest.follow(ready)
                except Exception as exc:
                    fatal.append(exc)
                    tg.cancel_scope.cancel()
        if fatal:
            raise fatal[0]
        if not kernels:
            raise self._none_worked(failures, skipped, errors, "compiled")
        if len(kernels) == 1:
            # Nothing to choose from: like @triton.autotune with one config, nothing is stored.
            ((index, kernel),) = kernels.items()
            measured = contest.times() if contest is not None else {}
            launches = contest.launches if contest is not None else {}
            return await self.finish(
                kernel,
                "single",
                index,
                self.configs[index],
                self.trials(measured, skipped, errors, launches),
                compile_seconds=compile_seconds,
                bench_seconds=contest.seconds if contest is not None else 0.0,
            )
        if contest is None:
            assert no_bench is not None
            raise no_bench
        await contest.confirm_leaders()
        if not contest.confirmed:
            raise self._none_worked(failures, skipped, errors, "ran")
        confirmed = contest.confirmed
        index = min(confirmed, key=lambda i: (confirmed[i], i))
        times = contest.times()
        await self._store(
            index, times, {i: w for i, w in skipped.items() if i not in duplicates}, contest.device[1]
        )
        logger.info(
            "autotuned %s for key %r: #%d %s, %.4f ms (%d configs, %d skipped, %d timed in full; "
            "compiles landed over %.2f s, benchmark %.2f s alongside)",
            self.name,
            self.user_key,
            index,
            config_label(self.configs[index].as_dict()),
            times[index],
            len(self.configs),
            len(skipped),
            len(confirmed),
            compile_seconds,
            contest.seconds,
        )
        return await self.finish(
            kernels[index],
            "benchmark",
            index,
            self.configs[index],
            self.trials(times, skipped, errors, contest.launches),
            contest.device[1],
            compile_seconds,
            contest.seconds,
        )

    async def _contest(
        self,
        count: int,
        kernels: Mapping[int, TritonKernel],
        skipped: dict[int, str],
        errors: dict[int, BaseException],
    ) -> _Contest:
        """The benchmark of ``count`` configs on this machine's GPU, ready for the first one to
        land; raises when there is no GPU to run them on."""
        device = await self._device(count)
        flush = await anyio.to_thread.run_sync(_prepare_gpu, device)
        return _Contest(self, device, flush, kernels, skipped, errors)

    def _none_worked(
        self,
        failures: dict[int, CompileError],
        skipped: dict[int, str],
        errors: dict[int, BaseException],
        verb: str,
    ) -> CompileError:
        """The error when no config is left: the first compile error (its class, log and
        traceback) saying why each config is out; ``.failures`` maps index to reason and
        ``.errors`` index to exception."""
        listing = "\n".join(
            f"  #{i} {config_label(self.configs[i].as_dict())}: {why}" for i, why in sorted(skipped.items())
        )
        message = f"no config of {self.name} {verb} ({len(self.configs)} tried):\n{listing}"
        if failures:
            first = failures[min(failures)]
            # Its own type and attributes (log, worker traceback ...), with the whole story.
            error = _with_message(first, message)
        else:
            error = CompileError(message, kernel=self.name, backend="triton")
        error.failures = dict(sorted(skipped.items()))
        error.errors = dict(sorted(errors.items()))
        return error

    def grid_of(self, index: int) -> tuple[int, ...]:
        """The launch grid of config ``index``."""
        grid = self.grid
        if callable(grid):
            request = self.requests[index]
            config = self.configs[index]
            meta = {
                **dict(zip(self.runtime, self.args, strict=False)),
                **request.constants,
                "num_warps": config.num_warps,
                "num_stages": config.num_stages,
                **config.options,
            }
            try:
                grid = grid(meta)
            except Exception as exc:
                raise InvalidSpecError(
                    f"grid(meta) failed for config #{index}: {type(exc).__name__}: {exc}"
                ) from exc
        return _grid_tuple(grid)

    async def _device(self, count: int) -> tuple[int, str]:
        """The GPU to benchmark on (index, name); raises when there is none."""
        hint = (
            f"benchmarking the {count} configs of {self.name} needs a GPU; those that compiled "
            f"are in the cache. Pin a config (pin={{{pin_key(self.user_key)!r}: index}}), or tune once on "
            f"a GPU machine sharing this cache: the choice is stored under tuning key "
            f"{self.key[:16]}… and found here without a GPU"
        )
        wanted = _tensor_device(self.args)
        info = await anyio.to_thread.run_sync(_gpu_info, wanted, hint)
        index, name, capability = info
        if not self.args and self.runtime:
            raise InvalidSpecError(
                f"benchmarking needs the kernel's runtime arguments: pass args=({', '.join(self.runtime)})"
            )
        if self.target.backend == "cuda" and capability != self.target.arch:
            raise DeviceUnavailableError(
                f"the configs are compiled for {self.target} and the GPU here ({name}) is "
                f"sm_{capability}: a choice is measured on the target it is stored for. Tune on a "
                f"GPU of that target, or use the pool's default (local) target"
            )
        return index, name

    async def _store(self, index: int, times: dict[int, float], skipped: dict[int, str], device: str) -> None:
        choice = {
            "format": _FORMAT,
            "kernel_key": self.requests[index].key,
            "config": self.configs[index].as_dict(),
            # By kernel key: the same configs in another order are the same tuning.
            "timings_ms": {self.requests[i].key: ms for i, ms in times.items()},
            "skipped": {self.requests[i].key: why for i, why in skipped.items()},
            "device": device,
            "user_key": self.user_key,
            "tuned_at": time.time(),
        }
        data = json.dumps(choice, sort_keys=True, default=repr).encode()
        self.tuner.choices[self.key] = json.loads(data)
        await self.tuner.records.put_record(
            self.key, self.name, {"choice": data}, {"user_key": self.user_key}
        )


class _Contest:
    """The benchmark of one tuning, run on the GPU while its configs compile.

    Each config is screened as soon as it lands: a short run (about 5 ms of launches), or
    its first launch alone when that is already twice as slow as the best screened. The leaders,
    screened within 10% of the best, each get a full run (25 ms of warm-up, 100 ms of timed
    iterations, as Triton's ``do_bench``); the GPU does those whenever no config waits to be
    screened, so that they overlap the compiles still running. The fastest full run wins: a
    screening only decides who is left out, never who wins.
    """

    def __init__(
        self,
        tuning: _Tuning,
        device: tuple[int, str],
        flush: Any,
        kernels: Mapping[int, TritonKernel],
        skipped: dict[int, str],
        errors: dict[int, BaseException],
    ) -> None:
        self.tuning = tuning
        self.device = device
        self.flush = flush
        self.kernels = kernels
        self.skipped = skipped
        self.errors = errors
        self.screened: dict[int, float] = {}
        self.confirmed: dict[int, float] = {}
        self.launches: dict[int, int] = {}
        self.seconds = 0.0
        self.screen = _Budget(_SCREEN_WARMUP_MS, _SCREEN_TIMED_MS, tuning.warmup, tuning.repeats)
        self.full = _Budget(_FULL_WARMUP_MS, _FULL_TIMED_MS, tuning.warmup, tuning.repeats)

    async def follow(self, landed: MemoryObjectReceiveStream[int]) -> None:
        """Screen each config that lands, and run leaders in full while none waits; returns
        when every compile has ended."""
        while True:
            try:
                index = landed.receive_nowait()
            except anyio.WouldBlock:
                leader = self.unconfirmed_leader()
                if leader is not None:
                    await self.measure(leader, self.full)
                    continue
                try:
                    index = await landed.receive()
                except anyio.EndOfStream:
                    return
            except anyio.EndOfStream:
                return
            await self.measure(index, self.screen)

    async def confirm_leaders(self) -> None:
        """Run in full every leader not yet run in full (once all are screened)."""
        while (leader := self.unconfirmed_leader()) is not None:
            await self.measure(leader, self.full)

    def unconfirmed_leader(self) -> int | None:
        """The best screened config within the leaders' margin that has no full run yet."""
        if not self.screened:
            return None
        bar = min(self.screened.values()) * _LEADER_MARGIN
        waiting = [i for i, ms in self.screened.items() if ms <= bar and i not in self.confirmed]
        return min(waiting, key=lambda i: (self.screened[i], i), default=None)

    def times(self) -> dict[int, float]:
        """Each measured config's median: its full run's where it had one."""
        return {**self.screened, **self.confirmed}

    async def measure(self, index: int, budget: _Budget) -> None:
        tuning = self.tuning
        full = budget is self.full
        hopeless_ms = None
        if not full and self.screened:
            hopeless_ms = min(self.screened.values()) * _HOPELESS
        grid = tuning.grid_of(index)
        t0 = time.perf_counter()
        try:
            ms, launches = await anyio.to_thread.run_sync(
                _benchmark,
                self.kernels[index],
                grid,
                tuning.args,
                tuning.reset,
                self.device,
                self.flush,
                budget,
                hopeless_ms,
            )
        except DeviceUnavailableError:
            raise
        except Exception as exc:  # OutOfResources, a launch error ...: this config only
            self.screened.pop(index, None)
            self.errors[index] = exc
            self.skipped[index] = f"could not run: {type(exc).__name__}: {_reason(exc)}"
            logger.info("autotune %s: config #%d skipped: %s", tuning.name, index, self.skipped[index])
            return
        finally:
            self.seconds += time.perf_counter() - t0
        (self.confirmed if full else self.screened)[index] = ms
        self.launches[index] = launches
        logger.debug(
            "autotune %s: config #%d %s: %.4f ms (median of %d) in %.1f ms",
            tuning.name,
            index,
            "run in full" if full else "screened",
            ms,
            launches,
            (time.perf_counter() - t0) * 1e3,
        )


def _expected_compile_cost(config: _Config) -> float:
    """A guess at how long a config takes to compile, to start the longest first.

    Triton unrolls each warp's share of a tile, pipelined over ``num_stages``: compile time grows
    with the product of the config's integer constexprs (its block sizes) and ``num_stages``,
    over ``num_warps``. On the autotune benchmark's 18 matmul configs this ranks the compile
    times with a rank correlation of 0.98. Only the order matters.
    """
    size = math.prod(v for v in config.constexprs.values() if type(v) is int and v > 1)
    return size * config.num_stages / config.num_warps


def _grid_tuple(grid: Any) -> tuple[int, ...]:
    if isinstance(grid, int):
        return (grid,)
    if not isinstance(grid, Sequence) or not 1 <= len(grid) <= 3:
        raise InvalidSpecError(f"the grid must be an int or 1 to 3 ints, got {grid!r}")
    return tuple(int(g) for g in grid)


def _reason(exc: BaseException) -> str:
    """Why exc happened, in a line: the last line of its message (Triton ends with the error
    itself, after the source excerpt), with where in the source if it says so."""
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    where = next((line[3:].rstrip(":") for line in lines if re.fullmatch(r"at \d+:\d+:", line)), None)
    return lines[-1] + (f" (at {where})" if where and len(lines) > 1 else "")


def _with_message(error: CompileError, message: str) -> CompileError:
    """A copy of error (same class and attributes) that says message."""
    clone = copy.copy(error)
    clone.args = (message,)
    clone.__cause__ = error
    return clone


# --- on the GPU (in threads: never on the event loop) ---------------------------------------


def _tensor_device(args: Sequence[Any]) -> int | None:
    """The CUDA device of the first GPU tensor among args, if any."""
    for a in args:
        device = getattr(a, "device", None)
        if getattr(device, "type", None) == "cuda":
            index = getattr(device, "index", None)
            return index if isinstance(index, int) else None
    return None


def _gpu_info(wanted: int | None, hint: str) -> tuple[int, str, int]:
    """(device index, name, compute capability as 90) of the GPU to benchmark on."""
    try:
        import torch
    except ImportError:
        try:
            local_target()
        except DeviceUnavailableError as exc:
            why = str(exc).split("; pass an explicit target")[0]
            raise DeviceUnavailableError(f"{hint}. (No GPU here: {why}.)") from None
        raise BackendUnavailableError(
            "benchmarking times launches with PyTorch's CUDA events: install torch "
            f"(pip install torch). ({hint})"
        ) from None
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"{hint}. (PyTorch sees no CUDA device here.)")
    index = wanted if wanted is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return index, str(torch.cuda.get_device_name(index)), major * 10 + minor


def _prepare_gpu(device: tuple[int, str]) -> Any:
    """The buffer that flushes the L2 before each timed launch, once Triton's driver has started:
    its first use builds and loads its C utilities (a compile of its own with a cold cache),
    better done while the configs compile than when the first lands."""
    import torch
    from triton.runtime import driver

    driver.active.get_current_device()
    return torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=f"cuda:{device[0]}")


# A screening run: enough launches for a median good to a few percent, at little GPU time.
_SCREEN_WARMUP_MS = 2.0
_SCREEN_TIMED_MS = 5.0
# A full run, as Triton's do_bench measures (its warmup=25, rep=100).
_FULL_WARMUP_MS = 25.0
_FULL_TIMED_MS = 100.0
_MIN_REPEATS = 5
# A config screened within this factor of the best is a leader and gets a full run: wider than
# a screening's noise (a few percent), narrow enough that few configs need one.
_LEADER_MARGIN = 1.10
# A config whose first timed launch takes this many times the best screened median is out after
# it: one sample, but a factor of two is far beyond a launch's noise.
_HOPELESS = 2.0


@dataclass(frozen=True)
class _Budget:
    """How much GPU time one run of a config may take. As in Triton's ``do_bench``, the warm-up
    and the timed launches each fill a time budget, sized from one timed iteration, with at
    least five timed launches; otherwise the slowest configs of a space would take most of its
    time. ``warmup`` and ``repeats`` (the caller's) cap the counts."""

    warmup_ms: float
    timed_ms: float
    warmup: int | None = None
    repeats: int | None = None

    def counts(self, iteration_ms: float) -> tuple[int, int]:
        """(warm-up launches, timed launches) for an iteration (flush and launch) of
        ``iteration_ms``."""
        warmup = max(1, int(self.warmup_ms / iteration_ms))
        repeats = max(_MIN_REPEATS, int(self.timed_ms / iteration_ms))
        if self.warmup is not None:
            warmup = min(warmup, self.warmup)
        if self.repeats is not None:
            repeats = min(repeats, self.repeats)
        return warmup, repeats


def _benchmark(
    kernel: TritonKernel,
    grid: tuple[int, ...],
    args: tuple[Any, ...],
    reset: Callable[[], Any] | None,
    device: tuple[int, str],
    flush: Any,
    budget: _Budget,
    hopeless_ms: float | None,
) -> tuple[float, int]:
    """(median milliseconds of one launch, timed launches it is the median of).

    A launch to check that the config runs, one timed iteration (an L2 flush and a launch) to
    size the budget, warm-up launches, then each timed launch between two CUDA events, the L2
    flushed (outside the events) before each; ``reset`` runs before every launch. A config whose
    sizing launch takes more than ``hopeless_ms`` is timed by that launch alone.
    """
    import torch

    with _bench_lock, torch.cuda.device(device[0]):
        launch = kernel[grid]  # loads the binary: OutOfResources and the like are raised here
        if reset is not None:
            reset()
        launch(*args)
        torch.cuda.synchronize()  # a launch that fails does so here, before any timing
        if reset is not None:
            reset()
        # One timed iteration sizes the budgets, as in do_bench: the flush and the launch.
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]  # type: ignore[no-untyped-call]
        marks[0].record()
        flush.zero_()
        marks[1].record()
        launch(*args)
        marks[2].record()
        torch.cuda.synchronize()
        launch_ms = max(marks[1].elapsed_time(marks[2]), 1e-3)
        if hopeless_ms is not None and launch_ms > hopeless_ms:
            return launch_ms, 1
        warmup, repeats = budget.counts(max(marks[0].elapsed_time(marks[2]), 1e-3))
        for _ in range(warmup):
            if reset is not None:
                reset()
            launch(*args)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]  # type: ignore[no-untyped-call]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]  # type: ignore[no-untyped-call]
        for start, end in zip(starts, ends, strict=True):
            if reset is not None:
                reset()
            flush.zero_()
            start.record()
            launch(*args)
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    median = float(statistics.median(times))
    if not math.isfinite(median):
        raise RuntimeError(f"timing gave {median}")
    return median, repeats
