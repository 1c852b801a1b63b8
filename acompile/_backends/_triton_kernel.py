"""The Triton kernel the user gets (``TritonKernel``), and the path of every launch.

``kernel[grid](*args)`` is the hot path: a launch costs a few microseconds, so everything that
cannot change between launches is looked up once, when the kernel is loaded onto the GPU
(``_Launches``), and each launch function is generated code written for the kernel's own
parameter list (``_launch_code``). acompile's launcher (``_launcher``) takes the kernels it can;
Triton's launches the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from operator import index
from types import CodeType
from typing import TYPE_CHECKING, Any, ClassVar

from acompile._backends._memos import remembered
from acompile._backends._triton_load import TritonObjects, backend_for
from acompile._errors import DeviceUnavailableError

if TYPE_CHECKING:
    from acompile._backends._triton_spec import TritonRequest
    from acompile._cache import Entry


class TritonKernel:
    """A compiled Triton kernel: its artifacts, and ``kernel[grid](*args)`` to launch it.

    Attributes:
        name: the kernel's name.
        key: the cache key (hex), the same on every machine for the same request.
        target: the ``Target`` it was compiled for.
        cubin: the binary (bytes; ``hsaco`` for HIP targets).
        asm: every stage Triton produced (``"ttir"``, ``"ttgir"``, ``"llir"``, ``"ptx"``, ...).
        metadata: Triton's own metadata (``num_warps``, ``shared``, ...).
        compiled: the ``triton.compiler.CompiledKernel``, built exactly as Triton builds it.

    ``asm`` and ``compiled`` are built on first use: a warm start reads every kernel from the
    cache, and most are only launched (or not used at all) in that process.

    Launching loads the binary onto the current GPU on first use; without a GPU it raises
    ``DeviceUnavailableError``. Pass only the runtime arguments, in the kernel's order: the
    constexprs the kernel was compiled with are filled in.
    """

    def __init__(self, request: TritonRequest, entry: Entry, metadata: Any) -> None:
        self.name = request.name
        self.key = request.key
        self.target = request.target
        self.metadata = metadata
        self.cubin: bytes = entry.blobs[backend_for(metadata.target).binary_ext]
        self._constants = request.constants
        self._order = list(request.signature)
        # In the instance's dict, so that a copy of it (a TunedKernel) shares Triton's objects
        # and loads the binary once.
        self._triton = TritonObjects(request, entry, metadata)
        # Launch functions by grid of ints, once loaded (``__getitem__``): a launch in a loop
        # costs one look-up here.
        self._by_grid: dict[Any, Callable[..., None]] = {}
        # kernel[grid function] once loaded: a grid function is often a lambda made at every
        # call, so its launch function is made at every launch, by this (made once).
        self._by_grid_function: Callable[[Callable[..., Any]], Callable[..., None]] | None = None

    @property
    def asm(self) -> dict[str, Any]:
        """Every stage Triton produced, by extension (text; the binary as bytes)."""
        return self._triton.asm

    @property
    def compiled(self) -> Any:
        """Triton's ``CompiledKernel``, built from the entry the first time it is asked for, with
        every stage in its ``asm`` (``StageUnavailableError`` where they cannot be read)."""
        _ = self._triton.asm
        return self._triton.compiled

    def __repr__(self) -> str:
        return f"<TritonKernel {self.name} {self.target} key={self.key[:12]}…>"

    @property
    def launcher(self) -> str | None:
        """Whose launcher launches this kernel: ``"acompile"`` (its own, the default where it
        takes the kernel) or ``"triton"`` (Triton's); None until the kernel is loaded."""
        launches = self.__dict__.get("_launches")
        return None if launches is None else launches.launcher

    def load(self) -> None:
        """Load the binary onto the current GPU now (otherwise the first launch does)."""
        if "_launches" in self.__dict__:
            return
        compiled = self._triton.compiled  # its binary: loading reads no text stage
        try:
            compiled._init_handles()
        except RuntimeError as exc:
            if "active driver" in str(exc) or ("driver" in str(exc).lower() and "0 active" in str(exc)):
                raise DeviceUnavailableError(
                    f"cannot load {self.name}: no GPU or driver here ({exc}); compiled results "
                    "can still be cached and shipped"
                ) from exc
            raise
        launches = _Launches(self.name, self._triton.signature, self._constants, compiled)
        self._by_grid_function = self._grid_function_launches(launches)
        self._launches = launches
        if launches.launcher == "acompile" and not _c_subscript:
            _use_c_subscript()

    def _grid_function_launches(
        self, launches: _Launches
    ) -> Callable[[Callable[..., Any]], Callable[..., None]] | None:
        """What makes a grid function's launch once loaded (``_by_grid_function``); None where
        ``_subscript_miss`` makes it."""
        return launches.grid_function_binder()

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid](*args)``: grid is 1 to 3 ints, or, as for Triton's JIT, a callable
        given every argument by name (runtime arguments and constexprs) that returns them.

        The launch function takes the runtime arguments, by position or by name, and
        ``stream=`` (default: the current stream of the kernel's GPU). Launch functions are
        kept per grid of ints, so ``kernel[grid]`` in a loop costs one dict look-up.
        """
        # Once acompile's launcher is loaded, this is a method of C doing the same (see
        # ``_use_c_subscript``).
        try:
            launch = self._by_grid.get(grid)
        except TypeError:  # an unhashable grid (a list)
            launch = None
        if launch is not None:
            return launch
        if callable(grid) and (by_grid_function := self._by_grid_function) is not None:
            # Not kept: a grid function often closes over the caller's tensors.
            return by_grid_function(grid)
        return self._subscript_miss(grid)

    def _subscript_miss(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid]`` for a grid not in ``_by_grid``: a grid function's launch, or a grid of
        ints' (kept)."""
        if callable(grid):  # before the kernel's load
            self.load()
            by_grid_function = self._by_grid_function
            assert by_grid_function is not None
            return by_grid_function(grid)
        return self._subscript(grid)

    def _subscript(self, grid: Any) -> Callable[..., None]:
        """``kernel[grid]`` the first time for a grid of ints."""
        gx, gy, gz = _grid3(grid)
        self.load()
        launches = self._launches
        launch = launches.with_grid(gx, gy, gz)
        if isinstance(grid, (int, tuple)):
            by_grid = self._by_grid
            if len(by_grid) >= _GRIDS_KEPT:
                by_grid.clear()
            by_grid[grid] = launch
        return launch


# Launch functions kept per kernel, one per grid of ints (grids vary with the problem size).
_GRIDS_KEPT = 64
# Whether TritonKernel's ``__getitem__`` is acompile's launcher's method of C.
_c_subscript = False


def _use_c_subscript() -> None:
    """Make ``TritonKernel.__getitem__`` the launcher's method of C doing what the Python one
    does (``_by_grid``'s launch function; for a grid function, ``_by_grid_function``'s where it
    is set; else ``_subscript_miss``): about 0.2 µs less per launch, out of 4 (a Python
    ``__getitem__`` is a frame). Done once, at the first kernel acompile's launcher launches (its
    module is loaded then). A subclass whose grid functions launch otherwise keeps
    ``_by_grid_function`` None and overrides ``_subscript_miss``."""
    global _c_subscript
    from acompile._backends import _launcher

    built = _launcher.module(build=False)
    if built is not None:
        TritonKernel.__getitem__ = built.subscript(  # type: ignore[method-assign]
            TritonKernel, "_by_grid", "_by_grid_function", "_subscript_miss"
        )
        _c_subscript = True


def _grid3(grid: Any) -> tuple[int, int, int]:
    """A grid of 1 to 3 ints as the three dimensions Triton's launcher takes. Anything that is
    not an int (a float) is refused, as Triton's launcher and acompile's refuse it, never cut to
    one."""
    try:
        if type(grid) is tuple:
            size = len(grid)
            if size == 1:
                return (index(grid[0]), 1, 1)
            if size == 2:
                return (index(grid[0]), index(grid[1]), 1)
            if size == 3:
                return (index(grid[0]), index(grid[1]), index(grid[2]))
        elif isinstance(grid, int):
            return (index(grid), 1, 1)
    except TypeError:
        raise TypeError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}") from None
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or not 1 <= len(grid) <= 3:
        raise TypeError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    return _grid3(tuple(grid))


class _Launches:
    """The launch functions of one loaded kernel, and those kept by grid.

    Triton's ``CompiledKernel[grid](*args)`` looks up the driver, the current device and
    stream, the launch hooks and the launcher on every call, and then the launcher takes every
    argument, constexprs included, in the kernel's order. Here everything that cannot change
    between launches is looked up once, when the kernel is loaded, and a launch function
    written for the kernel's own parameter list (generated code: the constexprs are put in their
    places without building a list per call, and a wrong number of arguments gets Python's own
    message naming them) passes them straight to Triton's launcher. What can change stays a
    per-call read: the current stream, and the launch hooks (a profiler may install one at any
    time), which Triton is told of only when there is one.
    """

    def __init__(
        self, name: str, signature: Mapping[str, str], constants: Mapping[str, Any], compiled: Any
    ) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        from acompile._backends import _launcher

        order = tuple(signature)
        self._constant_values = tuple(constants[n] for n in order if n in constants)
        self._name = name
        stream_of = driver.active.get_current_stream
        device = driver.active.get_current_device()  # the GPU _init_handles loaded the kernel onto
        chain = getattr(knobs, "HookChain", _NoHookChain)
        # acompile's launcher where it takes this kernel (see _launcher), else Triton's.
        self._fast = _launcher.kernel_for(compiled, signature, device, stream_of, knobs.runtime, chain)
        self._layout = (order, tuple(n in constants for n in order), self._fast is not None)
        self._bound = (
            name,
            compiled.run,
            compiled.function,
            compiled.packed_metadata,
            compiled.launch_metadata,
            stream_of,
            device,
            knobs.runtime,
            chain,
            _grid3,
            self._fast.launch if self._fast is not None else None,
            *self._constant_values,
        )
        self._makers: dict[bool, Callable[..., Callable[..., None]]] = {}

    @property
    def launcher(self) -> str:
        """Whose launcher launches this kernel: ``"acompile"`` or ``"triton"``."""
        return "acompile" if self._fast is not None else "triton"

    def with_grid(self, gx: int, gy: int, gz: int) -> Callable[..., None]:
        """The launch function for a grid of three ints."""
        launch = self._maker(False)(gx, gy, gz)
        if self._fast is None:
            return launch
        # The launcher's own (C) launch function: the Python one takes what it does not.
        return self._fast.bind(gx, gy, gz, launch, self._name, self._name + "[grid]")  # type: ignore[no-any-return]

    def time_parts(self, grid: Any, args: Sequence[Any], count: int) -> tuple[float, float] | None:
        """Seconds per launch of the driver's ``cuLaunchKernelEx`` alone (the arguments packed
        once, ``count`` launches in a C loop), and per packing of the arguments alone, on the
        current stream; None where Triton's launcher launches this kernel. For benchmarks: a
        whole ``kernel[grid](*args)`` set against the driver's own share of it."""
        if self._fast is None:
            return None
        gx, gy, gz = _grid3(grid)
        return self._fast.time_parts(count, gx, gy, gz, None, *args)  # type: ignore[no-any-return]

    def driver_call(self, grid: Any, args: Sequence[Any]) -> Callable[..., None] | None:
        """A function making the driver's ``cuLaunchKernelEx`` alone, the arguments packed once,
        on the current stream; None where Triton's launcher launches this kernel. For
        benchmarks: the floor of any launch made from Python. Called as ``call(grid_function,
        meta)``, it calls ``grid_function(meta)`` first, from C (the floor of a launch through a
        grid function)."""
        if self._fast is None:
            return None
        gx, gy, gz = _grid3(grid)
        return self._fast.driver_call(gx, gy, gz, None, *args)  # type: ignore[no-any-return]

    def grid_function_binder(self) -> Callable[[Callable[..., Any]], Callable[..., None]]:
        """The function making the launch function of any grid function (a grid computed from
        the arguments at each launch): the launcher's own where it takes this kernel."""
        if self._fast is None:
            return self._maker(True)
        # What the grid function is given, by name: each runtime argument's position, or a
        # constexpr's value.
        order, is_constant, _ = self._layout
        runtime = iter(range(len(order)))
        constants = iter(self._constant_values)
        meta = tuple(
            (n, (next(constants),) if constant else next(runtime))
            for n, constant in zip(order, is_constant, strict=True)
        )
        return self._fast.grid_function_binder(self._maker(True), meta, self._name, self._name + "[grid]")  # type: ignore[no-any-return]

    def _maker(self, grid_function: bool) -> Callable[..., Callable[..., None]]:
        maker = self._makers.get(grid_function)
        if maker is None:
            namespace: dict[str, Any] = {}
            exec(_launch_code(*self._layout, grid_function), namespace)
            maker = self._makers[grid_function] = namespace["maker"](*self._bound)
        return maker


class _NoHookChain:
    """Stands in for ``triton.knobs.HookChain`` where Triton has none: no hook is one."""

    calls: ClassVar[list[Any]] = []


@remembered
@functools.lru_cache(maxsize=256)
def _launch_code(
    order: tuple[str, ...], is_constant: tuple[bool, ...], fast: bool, grid_function: bool
) -> CodeType:
    """The compiled source of ``maker(name, launcher, ...)``, which returns the function making
    a launch function for a grid (of three ints, or a grid function). Kernels of the same
    parameter list share it: compiling it costs a fraction of a millisecond, at first launch.
    With ``fast``, a launch with no hook installed goes through acompile's launcher
    (``_l_fast(x, y, z, stream, *runtime arguments)``), else through Triton's."""
    runtime = [n for n, constant in zip(order, is_constant, strict=True) if not constant]
    # The kernel's parameter names make the launch function's, so that errors and keyword
    # arguments read as the kernel does; where one would shadow what the body uses (every
    # other name there starts with "_l_"), positional names stand in.
    if any(n.startswith("_l_") or n == "stream" for n in runtime):
        runtime = [f"_l_arg{i}" for i in range(len(runtime))]
    names, constant_names = iter(runtime), iter(f"_l_c{i}" for i in range(sum(is_constant)))
    args = [next(constant_names) if constant else next(names) for constant in is_constant]
    passed = "".join(f", {a}" for a in args)
    runtime_passed = "".join(f", {n}" for n in runtime)
    params = "".join(f"{n}, " for n in runtime)
    constants = "".join(f", _l_c{i}" for i in range(sum(is_constant)))
    if grid_function:
        meta = ", ".join(f"{n!r}: {a}" for n, a in zip(order, args, strict=True))
        grid_params, grid_line = "_l_grid", f"\n            _l_x, _l_y, _l_z = _l_grid3(_l_grid({{{meta}}}))"
    else:
        grid_params, grid_line = "_l_x, _l_y, _l_z", ""
    if fast:
        plain_launch = f"_l_fast(_l_x, _l_y, _l_z, stream{runtime_passed})"
    else:
        plain_launch = f"_l_run(_l_x, _l_y, _l_z, stream, _l_function, _l_packed, None, None, None{passed})"
    source = f"""
def maker(_l_name, _l_run, _l_function, _l_packed, _l_metadata, _l_stream_of, _l_device, _l_knobs,
          _l_chain, _l_grid3, _l_fast{constants}):
    def make({grid_params}):
        def _l_launch({params}*, stream=None):{grid_line}
            if stream is None:
                stream = _l_stream_of(_l_device)
            _l_enter = _l_knobs.launch_enter_hook
            _l_exit = _l_knobs.launch_exit_hook
            if (_l_enter is None or (_l_enter.__class__ is _l_chain and not _l_enter.calls)) and (
                _l_exit is None or (_l_exit.__class__ is _l_chain and not _l_exit.calls)
            ):
                {plain_launch}
            else:
                _l_md = _l_metadata((_l_x, _l_y, _l_z), stream{passed})
                _l_run(_l_x, _l_y, _l_z, stream, _l_function, _l_packed, _l_md, _l_enter, _l_exit{passed})

        _l_launch.__name__, _l_launch.__qualname__ = _l_name, _l_name + "[grid]"
        return _l_launch

    return make
"""
    return compile(source, "<acompile launch>", "exec")
