"""acompile's own launcher (``acompile/_backends/_launch.c``), on a machine without a GPU.

The launcher is built here for real (the C compiler and Python headers of this machine) and
launches through a stand-in for the CUDA driver: a small shared library named ``libcuda.so.1``,
found first through ``LD_LIBRARY_PATH`` in a fresh interpreter, that records what a launch
passes (grid, block, shared memory, stream, attributes, each parameter's bytes) instead of
running anything. It stands in only for what cannot exist here (a GPU and its driver); what a
launch computes on a real GPU is checked by ``test_gpu.py`` on the GPU host, against Triton's
own launcher.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from acompile._backends import _launcher

FAKE_DRIVER = r"""
#include <stdint.h>
#include <string.h>
#include "cuda.h"

static size_t sizes[300];
static int nsizes;
static unsigned char params[300][8];
static int launches, fail_with, set_attribute_calls;
static CUlaunchConfig last;
static CUlaunchAttribute attrs[8];

void fake_set_params(const size_t *s, int n) { memcpy(sizes, s, n * sizeof(size_t)); nsizes = n; }
void fake_fail_next(int code) { fail_with = code; }
int fake_launches(void) { return launches; }
int fake_set_attribute_calls(void) { return set_attribute_calls; }
unsigned long long fake_param(int i) { uint64_t v = 0; memcpy(&v, params[i], 8); return v; }
unsigned fake_dim(int i) {
  unsigned d[7] = {last.gridDimX, last.gridDimY, last.gridDimZ, last.blockDimX, last.blockDimY,
                   last.blockDimZ, last.sharedMemBytes};
  return d[i];
}
unsigned long long fake_stream(void) { return (unsigned long long)(uintptr_t)last.hStream; }
unsigned fake_nattrs(void) { return last.numAttrs; }
int fake_attr(int i) { return (int)attrs[i].id; }

CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)1; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int o) { *d = o; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { *c = (CUcontext)1; return CUDA_SUCCESS; }
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  if (a == CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED && v == 1) set_attribute_calls++;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "fake failure"; return CUDA_SUCCESS; }
CUresult cuFuncGetParamInfo(CUfunction f, size_t i, size_t *offset, size_t *size) {
  if ((int)i >= nsizes) return CUDA_ERROR_INVALID_VALUE;
  *offset = 0;
  *size = sizes[i];
  return CUDA_SUCCESS;
}
/* "Device memory": addresses from 0x7f0000000000 up, one allocation; "pinned host memory" the
 * GPU can reach: 0x7e0000000000 up to there, until fake_free_pinned(); anything lower is host
 * memory the GPU cannot reach. */
static int pinned_freed;
void fake_free_pinned(void) { pinned_freed = 1; }
/* One more "device memory" range, where a test needs a real buffer's addresses to be it. */
static CUdeviceptr extra_start, extra_end;
void fake_add_device_range(unsigned long long start, unsigned long long end) { extra_start = start; extra_end = end; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) {
  int extra = p >= extra_start && p < extra_end;
  int pinned = !extra && p >= 0x7e0000000000ull && p < 0x7f0000000000ull;
  if ((!extra && p < 0x7e0000000000ull) || (pinned && pinned_freed)) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr start = extra ? extra_start : pinned ? 0x7e0000000000ull : 0x7f0000000000ull;
  size_t size = extra ? (size_t)(extra_end - extra_start) : 0x10000000000ull;
  if (a == CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
    *(unsigned int *)data = pinned ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
  else if (a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
    *(CUdeviceptr *)data = start;
  else if (a == CU_POINTER_ATTRIBUTE_RANGE_SIZE)
    *(size_t *)data = size;
  else
    *(CUdeviceptr *)data = p;
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernel_params, void **extra) {
  if (fail_with) { CUresult r = fail_with; fail_with = 0; return r; }
  launches++;
  last = *config;
  memcpy(attrs, config->attrs, config->numAttrs * sizeof(CUlaunchAttribute));
  memset(params, 0, sizeof(params));
  for (int i = 0; i < nsizes; i++) memcpy(params[i], kernel_params[i], sizes[i]);
  return CUDA_SUCCESS;
}
"""

SETUP = r"""
import ctypes, gc, struct, sys
from acompile._backends import _launcher

launch = _launcher._load(_launcher.build())
fake = ctypes.CDLL("libcuda.so.1")  # the stand-in: the launcher opens this same library
fake.fake_param.restype = ctypes.c_ulonglong
fake.fake_stream.restype = ctypes.c_ulonglong
fake.fake_dim.restype = ctypes.c_uint
KINDS = launch.KINDS.split(",")
SIZES = {"*": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
         "fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}


class Chain:  # stands in for triton.knobs.HookChain
    def __init__(self):
        self.calls = []


class Knobs:
    launch_enter_hook = None
    launch_exit_hook = None


class Tensor:
    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


streams = []


def stream_of(device):
    streams.append(device)
    return 0xABC


def kernel(types, trailing=2, **options):
    sizes = [SIZES[t] for t in types] + [8] * trailing
    fake.fake_set_params((ctypes.c_size_t * len(sizes))(*sizes), len(sizes))
    settings = dict(function=0x1234, device=3, kinds=bytes(KINDS.index(t) for t in types),
                    names=tuple(f"a{i}" for i in range(len(types))), trailing_pointers=2,
                    num_warps=4, num_ctas=1, shared=1024, cooperative=False, pdl=False,
                    stream_of=stream_of, knobs=Knobs, chain_type=Chain)
    settings.update(options)
    return launch.Kernel(**settings)


def fallback(*args, **kwargs):
    fallback.calls.append((args, kwargs))
fallback.calls = []
"""

SCRIPT = (
    SETUP
    + r"""

# Every kind, packed as Triton's launcher packs it.
types = ["*", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "fp16", "bf16", "fp32", "fp64"]
k = kernel(types)
f = k.bind(7, 2, 1, fallback, "k", "k[grid]")
x = Tensor(0x7F0000001000)
values = [x, -5, -300, -70000, -(2**40), 200, 60000, 4_000_000_000, 2**64 - 1, 1.5, -2.5, 3.25, 1e300]
f(*values)
assert fake.fake_launches() == 1 and not fallback.calls
raw = [fake.fake_param(i) for i in range(len(types) + 2)]
expected = [0x7F0000001000, 0xFB, 0xFED4, (-70000) & 0xFFFFFFFF, (-(2**40)) & (2**64 - 1), 200, 60000,
            4_000_000_000, 2**64 - 1, struct.unpack("<H", struct.pack("<e", 1.5))[0],
            struct.unpack("<I", struct.pack("<f", -2.5))[0] >> 16, struct.unpack("<I", struct.pack("<f", 3.25))[0],
            struct.unpack("<Q", struct.pack("<d", 1e300))[0], 0, 0]
assert raw == expected, [hex(v) for v in raw]
assert [fake.fake_dim(i) for i in range(7)] == [7, 2, 1, 128, 1, 1, 1024]
assert fake.fake_stream() == 0xABC and streams == [3], streams
assert fake.fake_nattrs() == 0

# Pointers: an int, None, a tensor; host memory refused by name; no launch on any error.
k2 = kernel(["*", "*", "i32"])
g = k2.bind(1, 1, 1, fallback, "g", "g[grid]")
g(0x7F0000002000, None, 1, stream=0x55)
assert fake.fake_param(0) == 0x7F0000002000 and fake.fake_param(1) == 0 and fake.fake_stream() == 0x55
errors = {
    "host": lambda: g(Tensor(0x1000), None, 1),
    "overflow": lambda: g(None, None, 2**31),
    "negative unsigned": lambda: kernel(["u8"]).bind(1, 1, 1, fallback, "u", "u")(-1),
    "not an int": lambda: g(None, None, "1"),
    "not a pointer": lambda: g(object(), None, 1),
    "bad data_ptr": lambda: g(Tensor("x"), None, 1),
    "not a float": lambda: kernel(["fp32"]).bind(1, 1, 1, fallback, "h", "h")("x"),
    "bad stream": lambda: g(None, None, 1, stream="s"),
}
seen = {}
before = fake.fake_launches()
for what, call in errors.items():
    try:
        call()
    except Exception as exc:
        seen[what] = f"{type(exc).__name__}: {exc}"
assert fake.fake_launches() == before, "a refused launch reached the driver"
assert seen["host"].startswith("ValueError: argument a0: pointer 0x1000 is not memory the GPU can access"), seen
assert seen["overflow"] == "OverflowError: argument a2: 2147483648 does not fit the kernel's i32 parameter", seen
assert seen["negative unsigned"] == "OverflowError: argument a0: -1 does not fit the kernel's u8 parameter", seen
assert seen["not an int"] == "TypeError: argument a2: an integer parameter takes an int, got str", seen
assert seen["not a pointer"].startswith("TypeError: argument a0: a pointer parameter takes a tensor"), seen
assert seen["bad data_ptr"] == "TypeError: argument a0: data_ptr() returned str, not an int", seen
assert seen["not a float"] == "TypeError: argument a0: a float parameter takes a number, got str", seen
assert seen["bad stream"].startswith("TypeError: stream must be a CUDA stream handle"), seen

# What the launcher does not take goes to the Python launch function, untouched.
g(None, None, a2=1)
g(None, None)
g(None, None, 1, 2)
Knobs.launch_enter_hook = Chain()  # an empty hook chain is no hook
g(None, None, 1)
Knobs.launch_enter_hook.calls.append(print)  # a hook: Triton's launcher must call it
g(None, None, 1)
Knobs.launch_enter_hook = None
Knobs.launch_exit_hook = lambda metadata: None
g(None, None, 1)
Knobs.launch_exit_hook = None
assert fallback.calls == [((None, None), {"a2": 1}), ((None, None), {}), ((None, None, 1, 2), {}),
                          ((None, None, 1), {}), ((None, None, 1), {})], fallback.calls

# A grid function: given every parameter by name in the kernel's order, constexprs included;
# what it returns is the grid; what the launcher does not take goes to make(grid)'s function.
def bind_grid_function(k, grid, make, meta, name, qualname):  # a binder's launch of one grid function
    return k.grid_function_binder(make, meta, name, qualname)(grid)
made = []
def make(grid):
    made.append(grid)
    return fallback
seen_meta = []
def grid_fn(meta):
    seen_meta.append(list(meta.items()))
    return (meta["a2"] + meta["BLOCK"] - 1) // meta["BLOCK"], 3
gf = bind_grid_function(k2, grid_fn, make, (("a0", 0), ("BLOCK", (64,)), ("a1", 1), ("a2", 2)), "g", "g[grid]")
gf(None, None, 1000)
assert seen_meta == [[("a0", None), ("BLOCK", 64), ("a1", None), ("a2", 1000)]], seen_meta
assert [fake.fake_dim(i) for i in range(3)] == [16, 3, 1] and fake.fake_param(2) == 1000 and not made
class Index:
    def __index__(self):
        return 5
for grid, dims in ((7, [7, 1, 1]), ([2, 2], [2, 2, 1]), ((Index(), 1, 4), [5, 1, 4])):
    bind_grid_function(k2, lambda meta, grid=grid: grid, make, (), "g", "g[grid]")(None, None, 1)
    assert [fake.fake_dim(i) for i in range(3)] == dims, (grid, dims)
for grid, error in (((1, 2, 3, 4), "TypeError: grid must be an int or a tuple of 1 to 3 ints, got (1, 2, 3, 4)"),
                    ("8", "TypeError: grid must be an int or a tuple of 1 to 3 ints, got '8'"),
                    ((1.5,), "TypeError: grid must be an int or a tuple of 1 to 3 ints, got (1.5,)"),
                    ((-2,), "ValueError: grid x dimension -2 is out of range"),
                    ((1, 2**70), "ValueError: grid y dimension 1180591620717411303424 is out of range"),
                    ([1, 1, -2**64], "ValueError: grid z dimension -18446744073709551616 is out of range"),
                    (2**64, "ValueError: grid x dimension 18446744073709551616 is out of range")):
    try:
        bind_grid_function(k2, lambda meta, grid=grid: grid, make, (), "g", "g[grid]")(None, None, 1)
    except Exception as exc:
        assert f"{type(exc).__name__}: {exc}" == error, (grid, exc)
    else:
        raise AssertionError(f"grid {grid!r} was taken")
class Clearing:  # changes the grid list while it is read
    def __index__(self):
        grid_list.clear()
        return 2
grid_list = [Clearing(), 3, 4]
bind_grid_function(k2, lambda meta: grid_list, make, (), "g", "g[grid]")(None, None, 1)
assert [fake.fake_dim(i) for i in range(3)] == [2, 3, 4]
def failing_grid(meta):
    raise ZeroDivisionError("in the grid")
try:
    bind_grid_function(k2, failing_grid, make, (), "g", "g[grid]")(None, None, 1)
except ZeroDivisionError:
    pass
else:
    raise AssertionError("the grid function's error was lost")
fallback.calls.clear()
gf(None, None, a2=5)
assert made == [grid_fn] and fallback.calls == [((None, None), {"a2": 5})], (made, fallback.calls)
for meta, error in (((("a0", 9),), "ValueError"), ((("a0",),), "TypeError"), ((("a0", "x"),), "TypeError")):
    try:
        bind_grid_function(k2, grid_fn, make, meta, "g", "g")
    except Exception as exc:
        assert type(exc).__name__ == error, (meta, exc)
    else:
        raise AssertionError(f"meta {meta!r} was taken")

# A grid function's launch made from a binder, once per kernel: each grid function is its own
# launch's; a name given twice, or a binder given no function, is an error.
binder = k2.grid_function_binder(make, (("a0", 0), ("BLOCK", (64,)), ("a1", 1), ("a2", 2)), "g", "g[grid]")
seen_meta.clear()
binder(grid_fn)(None, None, 1000)
binder(lambda meta: (meta["a2"], 2))(None, None, 7)
assert seen_meta == [[("a0", None), ("BLOCK", 64), ("a1", None), ("a2", 1000)]], seen_meta
assert [fake.fake_dim(i) for i in range(3)] == [7, 2, 1] and fake.fake_param(2) == 7
# Each launch's grid function gets a dict of its own: one kept and changed later, or changed
# during the call, changes no other launch's. A tuple of int subclasses or bools reads as ints.
kept = []
def keeping(meta):
    kept.append(meta)
    meta["BLOCK"], meta["a2"] = 1, -1
    del meta["a0"]
    return (meta["a2"] + 4,)
binder(keeping)(None, None, 5)
kept[0].clear()
kept[0]["a1"] = "changed"
seen_meta.clear()
binder(grid_fn)(None, None, 9)
assert seen_meta == [[("a0", None), ("BLOCK", 64), ("a1", None), ("a2", 9)]], seen_meta
class Int(int):
    pass
binder(lambda meta: (Int(4), True, Int(2)))(None, None, 1)
assert [fake.fake_dim(i) for i in range(3)] == [4, 1, 2]
for attempt, error in ((lambda: binder(5), "TypeError: kernel[grid]: a binder takes a callable grid"),
                       (lambda: binder(), "TypeError: a binder takes one grid function"),
                       (lambda: k2.grid_function_binder(make, (("a0", 0), ("a0", 1)), "g", "g"),
                        "ValueError: grid_function_binder: 'a0' is named twice")):
    try:
        attempt()
    except Exception as exc:
        assert f"{type(exc).__name__}: {exc}" == error, exc
    else:
        raise AssertionError(f"{error}: taken")

# An empty grid launches nothing; a cluster and cooperative launch carry their attributes.
launched = fake.fake_launches()
k2.bind(0, 5, 1, fallback, "g", "g")(None, None, 1)
k2.launch(4, 0, 1, None, None, None, 1)
assert fake.fake_launches() == launched
k3 = kernel(["i32"], num_ctas=2, cooperative=True, pdl=True)
k3.launch(3, 1, 1, 9, 1)
assert [fake.fake_dim(i) for i in range(3)] == [6, 1, 1] and fake.fake_nattrs() == 4
try:
    k3.launch(-1, 1, 1, None, 1)
except ValueError as exc:
    assert "grid x dimension -1 is out of range" in str(exc)
else:
    raise AssertionError("a negative grid was taken")
# A grid that fits, but not once counted in CTAs of its clusters: refused, never wrapped.
launched = fake.fake_launches()
for attempt in (lambda: k3.launch(0x40000000, 1, 1, 9, 1), lambda: k3.driver_call(0x40000000, 1, 1, 9, 1)):
    try:
        attempt()
    except ValueError as exc:
        assert "grid x dimension 1073741824 is out of range for clusters of 2 CTAs" in str(exc), exc
    else:
        raise AssertionError("a grid past the driver's, in CTAs, was taken")
assert fake.fake_launches() == launched
k3.launch(0x3FFFFFFF, 1, 1, 9, 1)
assert fake.fake_dim(0) == 0x7FFFFFFE

# The driver's call alone (for benchmarks): the arguments packed once, each call one launch
# with the same grid, stream, attributes and parameters as the launch function's.
attrs = [fake.fake_attr(i) for i in range(4)]
call = k3.driver_call(3, 1, 1, 9, 41)
launched = fake.fake_launches()
call()
call()
assert fake.fake_launches() == launched + 2 and fake.fake_param(0) == 41 and fake.fake_stream() == 9
assert [fake.fake_dim(i) for i in range(3)] == [6, 1, 1] and fake.fake_nattrs() == 4
assert [fake.fake_attr(i) for i in range(4)] == attrs, attrs
# With a grid function and its meta: the function called first, from C, then the same launch.
seen = []
call(lambda meta: seen.append(meta) or (1,), {"BLOCK": 64})
assert seen == [{"BLOCK": 64}] and fake.fake_launches() == launched + 3 and fake.fake_param(0) == 41
try:
    call(lambda meta: 1 // 0, {})
except ZeroDivisionError:
    assert fake.fake_launches() == launched + 3  # its error, and no launch
else:
    raise AssertionError("a grid function's error was lost")
for attempt in (lambda: call(1), lambda: call(1, 2, 3), lambda: k3.driver_call(3, 1, 1, 9)):
    try:
        attempt()
    except TypeError:
        pass
    else:
        raise AssertionError("a driver call took a wrong number of arguments")

# A cluster of 16 is allowed on the function first, as Triton's launcher does.
assert fake.fake_set_attribute_calls() == 0
kernel(["i32"], num_ctas=16)
assert fake.fake_set_attribute_calls() == 1

# An error raised by an argument's own conversion is not dressed up as a wrong type.
class Interrupting:
    def __index__(self):
        raise KeyboardInterrupt
    def __float__(self):
        raise KeyboardInterrupt
for types in (["i32"], ["u32"], ["fp32"]):
    try:
        kernel(types).launch(1, 1, 1, None, Interrupting())
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError(f"{types}: the interrupt was swallowed")

# A driver error is an error naming it, and the next launch works.
fake.fake_fail_next(700)
try:
    g(None, None, 1)
except RuntimeError as exc:
    assert "cuLaunchKernelEx failed: CUDA error 700: fake failure" in str(exc), exc
else:
    raise AssertionError("a failed launch was not reported")
g(None, None, 1)

# A kernel whose parameters are not the ones this launcher passes is refused at load.
sizes = [8, 4, 8]  # the driver reports a pointer, an i32 and only one hidden pointer
fake.fake_set_params((ctypes.c_size_t * 3)(*sizes), 3)
settings = dict(function=1, device=0, kinds=bytes([0, 3]), names=("p", "n"), trailing_pointers=2,
                num_warps=4, num_ctas=1, shared=0, cooperative=False, pdl=False, stream_of=stream_of,
                knobs=Knobs, chain_type=Chain)
for kinds, why in ((bytes([0, 3]), "parameter 3"), (bytes([0, 4]), "parameter 1 of the kernel has 4 bytes, not 8")):
    try:
        launch.Kernel(**{**settings, "kinds": kinds})
    except RuntimeError as exc:
        assert why in str(exc) or "CUDA error" in str(exc), exc
    else:
        raise AssertionError("a mismatched kernel was taken")

# Pinned host memory the GPU reaches is checked at every launch, never remembered as GPU memory
# is: once freed, its addresses may hold an ordinary CPU allocation.
h = kernel(["*"], tensor_type=Tensor).bind(1, 1, 1, fallback, "h", "h[grid]")
pinned = Tensor(0x7E0000001000)
h(pinned)
h(Tensor(0x7F0000005000))  # GPU memory: remembered
fake.fake_free_pinned()
h(Tensor(0x7F0000006000))  # the same GPU allocation: launched
try:
    h(pinned)
except ValueError as exc:
    assert "is not memory the GPU can access" in str(exc), exc
else:
    raise AssertionError("freed pinned memory was launched")

# No reference leaked or freed twice over many launches.
t = Tensor(0x7F0000003000)
n = 123456789
quiet = k2.bind(1, 1, 1, lambda *args, **kwargs: None, "g", "g[grid]")
quiet_grid = bind_grid_function(k2, lambda meta: (meta["a2"] % 7 + 1,), lambda grid: (lambda *a, **kw: None), (("a2", 2),), "g", "g")
quiet_binder = k2.grid_function_binder(lambda grid: (lambda *a, **kw: None), (("a2", 2),), "g", "g")
before = (sys.getrefcount(t), sys.getrefcount(n), sys.getrefcount(fallback))
for _ in range(10000):
    quiet(t, t, n)
    quiet(t, t, n=n)
    quiet_grid(t, t, n)
    quiet_grid(t, t, n=n)
for _ in range(1000):
    k2.bind(1, 1, 1, fallback, "g", "g[grid]")
    quiet_binder(lambda meta: (meta["a2"] % 7 + 1,))(t, t, n)
gc.collect()
after = (sys.getrefcount(t), sys.getrefcount(n), sys.getrefcount(fallback))
assert after == before, (before, after)
print("ok", repr(f))
"""
)


BRIDGE_SCRIPT = (
    SETUP
    + r"""
import os
import threading
import torch
from torch.overrides import TorchFunctionMode

bridge = _launcher.load_bridge()
x = torch.empty(1 << 20)
base = x.data_ptr()
fake.fake_add_device_range(ctypes.c_ulonglong(base), ctypes.c_ulonglong(base + 4 * (1 << 20)))  # its "GPU memory"
view = x[5:]


class Sub(torch.Tensor):
    pass


sub = x.as_subclass(Sub)
# The bridge reads what data_ptr() reads...
for t in (x, view, torch.nn.Parameter(x)):
    assert bridge.tensor_pointer(t) == t.data_ptr()
# ...and leaves to data_ptr() what it would not read by the same path.
assert bridge.tensor_pointer(sub) is None and bridge.tensor_pointer(3) is None
assert bridge.tensor_pointer(Tensor(0x7F0000001000)) is None
with TorchFunctionMode():
    assert bridge.tensor_pointer(x) is None
assert bridge.tensor_pointer(torch.eye(2).to_sparse()) is None  # data_ptr() raises

k = kernel(["*", "*"])
f = k.bind(1, 1, 1, fallback, "f", "f[grid]")
real = torch.Tensor.data_ptr
torch.Tensor.data_ptr = lambda self: 0x7F00000F0000  # seen only by a launch through data_ptr()
try:
    f(view, sub)
    assert (fake.fake_param(0), fake.fake_param(1)) == (0x7F00000F0000, 0x7F00000F0000)
    assert not launch.tensor_pointer_in_use()
    launch.use_tensor_pointer(bridge.TENSOR_POINTER)
    f(view, sub)  # the exact tensor through the bridge, the subclass through data_ptr()
    assert (fake.fake_param(0), fake.fake_param(1)) == (base + 20, 0x7F00000F0000), hex(fake.fake_param(0))
    with TorchFunctionMode():  # a mode sees data_ptr() called, as without the bridge
        f(view, view)
    assert fake.fake_param(0) == 0x7F00000F0000
finally:
    torch.Tensor.data_ptr = real
try:  # a tensor data_ptr() refuses: its own error, not a launch
    f(torch.eye(2).to_sparse(), None)
except RuntimeError as exc:
    assert "sparse" in str(exc).lower() or "storage" in str(exc).lower(), exc
else:
    raise AssertionError("a sparse tensor was launched")
for wrong, error in ((3, TypeError), (launch.use_tensor_pointer, TypeError)):
    try:
        launch.use_tensor_pointer(wrong)
    except error:
        pass
    else:
        raise AssertionError(f"use_tensor_pointer took {wrong!r}")
assert launch.tensor_pointer_in_use()
launch.use_tensor_pointer(None)
assert not launch.tensor_pointer_in_use()


def started():  # the bridge's thread, run to its end
    for thread in threading.enumerate():
        if thread.name == "acompile-torch-bridge":
            thread.join()


# What a kernel's load does: the bridge in use once it is imported (built already here).
_launcher.use_bridge(launch)
started()
assert launch.tensor_pointer_in_use() and _launcher.bridge_problem() is None
launch.use_tensor_pointer(None)
os.environ["ACOMPILE_TORCH_BRIDGE"] = "off"
_launcher.use_bridge(launch)
started()
assert not launch.tensor_pointer_in_use() and "ACOMPILE_TORCH_BRIDGE" in _launcher.bridge_problem()
del os.environ["ACOMPILE_TORCH_BRIDGE"]
os.environ["CXX"] = "/nonexistent/c++"  # another compiler: another build, which fails
_launcher.use_bridge(launch)
started()
assert not launch.tensor_pointer_in_use() and "/nonexistent/c++" in _launcher.bridge_problem()
print("ok")
"""
)


HOOKS_SCRIPT = (
    SETUP
    + r"""
import random
from triton import knobs

runtime, HookChain = knobs.runtime, knobs.HookChain
Runtime = type(runtime)
names = ("launch_enter_hook", "launch_exit_hook")
of_class = {n: Runtime.__dict__[n] for n in names}  # Triton's own chains
spare = [HookChain(), HookChain()]
chains = [*of_class.values(), *spare]


class SubChain(HookChain):
    pass


class SubRuntime(Runtime):
    pass


def hook(*args):
    pass


f = kernel([], knobs=runtime, chain_type=HookChain).bind(1, 1, 1, fallback, "f", "f[grid]")


def expected():  # what getattr says of the hooks now: Triton's launcher must call one, or not
    try:
        for name in names:
            h = getattr(runtime, name)
            if h is not None and not (type(h) is HookChain and len(h.calls) == 0):
                return "to Triton's launcher"
        return "launched"
    except AttributeError:
        return "AttributeError"


def launched():
    before = fake.fake_launches(), len(fallback.calls)
    try:
        f()
    except AttributeError:
        return "AttributeError"
    after = fake.fake_launches(), len(fallback.calls)
    assert after[0] - before[0] + after[1] - before[1] == 1
    return "launched" if after[0] > before[0] else "to Triton's launcher"


def reset():
    for name, chain in of_class.items():
        setattr(Runtime, name, chain)
    for attr in ("calls", "__get__"):
        if attr in HookChain.__dict__:
            delattr(HookChain, attr)
    for chain in chains:
        chain.__class__ = HookChain
        chain.__dict__.clear()
        chain.__dict__.update(calls=[], reversed=False)
    runtime.__class__ = Runtime
    runtime.__dict__.clear()
    for name in names:
        if name in SubRuntime.__dict__:
            delattr(SubRuntime, name)


def store(obj, value):  # an assignment as a library writes it, run often enough to be specialized
    obj.launch_enter_hook = value


def store_calls(chain, value):
    chain.calls = value


for _ in range(100):
    store(Runtime(), None)
    store_calls(HookChain(), [])


def set_property():
    HookChain.calls = property(lambda self: [hook])


def with_scope():
    with runtime.scope():
        runtime.launch_exit_hook = hook
        assert launched() == "to Triton's launcher"


# A hook installed in any way, between two launches of a kernel bound earlier, is seen by the
# next launch; so is any change of what the hooks are read from.
changes = {
    "HookChain.add": lambda: runtime.launch_enter_hook.add(hook),
    "an exit hook added": lambda: runtime.launch_exit_hook.add(hook),
    "a function assigned": lambda: setattr(runtime, "launch_exit_hook", hook),
    "a chain with calls assigned": lambda: (spare[0].add(hook), store(runtime, spare[0])),
    "the knobs' dict changed": lambda: runtime.__dict__.update(launch_exit_hook=hook),
    "the knobs' dict replaced": lambda: setattr(runtime, "__dict__", {"launch_enter_hook": hook}),
    "the class's chain replaced": lambda: setattr(Runtime, "launch_exit_hook", hook),
    "the knobs' class": lambda: (setattr(SubRuntime, "launch_enter_hook", hook), setattr(runtime, "__class__", SubRuntime)),
    "a chain's calls replaced": lambda: store_calls(of_class["launch_enter_hook"], [hook]),
    "a chain's calls deleted": lambda: delattr(of_class["launch_exit_hook"], "calls"),
    "a chain's dict replaced": lambda: setattr(of_class["launch_enter_hook"], "__dict__", {"calls": [hook]}),
    "a chain's class": lambda: setattr(of_class["launch_exit_hook"], "__class__", SubChain),
    "HookChain.calls a property": set_property,
    "HookChain a descriptor": lambda: setattr(HookChain, "__get__", lambda self, obj, cls: hook),
    "knobs.runtime.scope()": with_scope,
    "nothing": lambda: None,
}
for what, change in changes.items():
    reset()
    assert launched() == launched() == "launched", what  # the second launch reads what the first kept
    change()
    for _ in range(3):
        assert launched() == expected(), (what, expected())
    assert what in ("nothing", "knobs.runtime.scope()") or expected() != "launched", what

# Random changes, each followed by launches.
rng = random.Random(5)
steps = [
    lambda: rng.choice(chains).calls.append(hook),
    lambda: rng.choice(chains).calls.clear(),
    lambda: rng.choice(chains).calls.clear(),
    lambda: store(runtime, rng.choice([None, hook, *chains])),
    lambda: setattr(runtime, rng.choice(names), rng.choice([None, *chains])),
    lambda: runtime.__dict__.pop(rng.choice(names), None),
    lambda: runtime.__dict__.__setitem__("unrelated", rng.random()),
    lambda: setattr(Runtime, rng.choice(names), rng.choice([None, *chains])),
    lambda: store_calls(rng.choice(chains), rng.choice([[], [hook]])),
    lambda: setattr(rng.choice(chains), "__class__", rng.choice([HookChain, SubChain])),
    lambda: setattr(runtime, "__class__", rng.choice([Runtime, SubRuntime])),
    lambda: setattr(SubRuntime, rng.choice(names), rng.choice([None, *chains])),
    reset,
]
reset()
for _ in range(3000):
    rng.choice(steps)()
    for _ in range(2):
        assert launched() == expected()

# A key other than a str in the knobs' dict, of a hook's name's hash, whose n-th comparison
# installs the other hook: in the middle of the launch's generic read (n = 1), or of the
# launcher's own read of what it keeps (n = 2). Every launch after sees it.
for key_name, other in (names, names[::-1]):
    for n in (1, 2):
        reset()

        class Key:
            seen = 0

            def __hash__(self):
                return hash(key_name)

            def __eq__(self, value):
                Key.seen += 1
                if Key.seen == n:
                    spare[1].add(hook)
                    runtime.__dict__[other] = spare[1]
                return False

        runtime.__dict__[Key()] = 1
        for _ in range(6):
            fired = Key.seen >= n
            outcome = launched()
            assert not fired or outcome == expected() == "to Triton's launcher", (key_name, n)
        assert Key.seen >= n

# A launch made from Python code run in the middle of another launch's read of the hooks (a key's
# comparison, in the generic read or in the launcher's own): no reference kept twice or lost.
reset()


def counts():
    chains_of_class = list(of_class.values())
    held = (runtime.__dict__, Runtime, *chains_of_class, *(c.__dict__ for c in chains_of_class))
    return [sys.getrefcount(o) for o in (*held, *(c.calls for c in chains_of_class))]


launched(), launched()
before = counts()
for n in (1, 2, 3):

    class Reentrant:
        seen = 0

        def __hash__(self):
            return hash("launch_enter_hook")

        def __eq__(self, value):
            Reentrant.seen += 1
            if Reentrant.seen == n:
                f()
            return False

    runtime.__dict__[Reentrant()] = 1
    went_to_triton = len(fallback.calls)
    for _ in range(3):
        f()
    assert len(fallback.calls) == went_to_triton
    del runtime.__dict__[next(key for key in runtime.__dict__ if isinstance(key, Reentrant))]
launched(), launched()
gc.collect()
assert counts() == before, (before, counts())

# Where the launcher keeps what it read (CPython 3.10 to 3.12), launches read the knobs' dict no
# more once it is kept (a key that counts its comparisons is not compared again).
reset()


class Counting:
    seen = 0

    def __hash__(self):
        return hash("launch_enter_hook")

    def __eq__(self, value):
        Counting.seen += 1
        return False


runtime.__dict__[Counting()] = 1
launched(), launched()
before = Counting.seen
for _ in range(5):
    assert launched() == "launched"
assert (Counting.seen == before) == (sys.version_info < (3, 13)), (before, Counting.seen)
print("ok")
"""
)


def _cli_launcher(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ)
    environment.pop("ACOMPILE_TORCH_BRIDGE", None)
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-m", "acompile", "launcher", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )


@pytest.fixture(scope="module")
def built_by_the_cli(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A cache folder where ``acompile launcher`` built the launcher and the bridge to PyTorch
    (as an image's build step would), and what it printed."""
    pytest.importorskip("torch")
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    cache = tmp_path_factory.mktemp("built") / "cache"
    done = _cli_launcher(cache)
    assert done.returncode == 0, done.stderr[-4000:]
    return cache, done.stdout.splitlines()


def test_acompile_launcher_builds_the_launcher_and_the_bridge_ahead_and_says_why_not(
    built_by_the_cli: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """``acompile launcher`` (an image's build step, no GPU) builds both into the cache folder
    and prints their paths; run again, it finds them built; a bridge it cannot build is exit
    status 1 with the reason."""
    cache, lines = built_by_the_cli
    assert [line.split(":")[0] for line in lines] == ["launcher", "bridge to PyTorch"], lines
    assert all(re.search(r" \(built in \d+\.\d s\)$", line) for line in lines), lines
    paths = [Path(line.split(": ", 1)[1].rsplit(" (", 1)[0]) for line in lines]
    assert paths[0].name.startswith("_launch.") and paths[1].name.startswith("_torch_bridge.")
    assert all(p.is_file() and p.is_relative_to(cache / "launcher") for p in paths), paths
    again = _cli_launcher(cache)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"{line.rsplit(' (', 1)[0]} (built already)" for line in lines]
    broken = _cli_launcher(cache, CXX="/nonexistent/c++")  # another compiler: another build
    assert broken.returncode == 1, broken.stdout
    assert broken.stdout.startswith("launcher: ")  # the launcher, a C build, is still there
    assert "the bridge to PyTorch is not built" in broken.stderr and "/nonexistent/c++" in broken.stderr


def test_a_library_whose_load_would_end_the_process_is_refused_at_its_build(tmp_path: Path) -> None:
    """A sanitizer in ``CC`` (a developer's shell): the launcher builds, and loading it ends the
    process (the sanitizer's runtime exits one that did not load it first). The build is
    checked in a fresh Python first: refused with what that process said, nothing put in the
    cache, and the process that asked goes on (launches then go through Triton's launcher).
    The bridge to PyTorch goes through the same build and check (``_compile``): left out here,
    its C++ build takes ten seconds."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    probe = tmp_path / "probe.c"
    probe.write_text("int f(void) { return 1; }\n")
    if subprocess.run(
        ["gcc", "-fsanitize=address", "-shared", "-fPIC", str(probe), "-o", str(tmp_path / "probe.so")],
        capture_output=True,
    ).returncode:
        pytest.skip("gcc cannot build with AddressSanitizer here")
    cache = tmp_path / "cache"
    done = _cli_launcher(cache, CC="gcc -fsanitize=address", ACOMPILE_TORCH_BRIDGE="off")
    assert done.returncode == 1, (done.stdout, done.stderr)  # exited by itself: it was not loaded
    line = next((x for x in done.stderr.splitlines() if "the launcher is not built" in x), "")
    assert "does not load in a fresh Python" in line, done.stderr[-3000:]
    assert "CC='gcc -fsanitize=address'" in line, done.stderr[-3000:]
    assert "ASan runtime does not come first" in done.stderr, done.stderr[-3000:]
    assert not list(cache.glob("launcher/*/*.so")), "a library that ends its loader was kept"


def test_the_load_check_of_a_build_imports_from_the_callers_sys_path(tmp_path: Path) -> None:
    """The fresh Python that loads a library before it is kept imports what it needs (PyTorch,
    for the bridge) from the caller's sys.path as it is now: a server that put its packages on
    it at run time still gets its libraries. Shown with the launcher's build and a module that
    only a folder added at run time holds."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "only_on_my_path.py").write_text("")
    code = textwrap.dedent(f"""
        import sys
        from acompile._backends import _launcher
        folder, target, command, probe = _launcher._launcher_build()
        probe = probe._replace(first=("only_on_my_path",))
        try:
            _launcher._compile(command, target, probe)
        except RuntimeError as exc:
            assert "No module named 'only_on_my_path'" in str(exc), exc
        else:
            raise AssertionError("the check imported what the caller cannot")
        sys.path.insert(0, {str(tmp_path / "mine")!r})
        _launcher._compile(command, target, probe)
        print("ok")
    """)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_tensors_addresses_are_read_through_the_bridge_to_pytorch_where_it_reads_as_data_ptr(
    fake_driver: Path, built_by_the_cli: tuple[Path, list[str]]
) -> None:
    """The bridge to PyTorch is built here for real, against this PyTorch's headers: a launch
    takes an exact tensor's address from it, as data_ptr() reads it, and leaves everything else
    (a subclass, a torch function mode, a tensor data_ptr() refuses) to data_ptr()."""
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ACOMPILE_CACHE_DIR": str(built_by_the_cli[0]),
    }
    env.pop("ACOMPILE_TORCH_BRIDGE", None)
    done = subprocess.run(
        [sys.executable, "-c", BRIDGE_SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_a_grid_of_something_else_than_ints_is_refused_not_cut_to_ints() -> None:
    """kernel[grid] with a float in the grid is refused, as Triton's launcher refuses it (and
    acompile's, for a grid function's result), never truncated to a smaller grid."""
    from acompile._backends._triton_kernel import _grid3

    assert _grid3((4, True, 2)) == (4, 1, 2) and _grid3(7) == (7, 1, 1) and _grid3([2, 3]) == (2, 3, 1)
    for grid in ((1.5,), (2, 2.0), 3.0, [1, 0.5, 1]):
        with pytest.raises(TypeError, match="grid must be an int or a tuple of 1 to 3 ints"):
            _grid3(grid)


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    include = _launcher._cuda_include()
    if include is None:
        pytest.skip("Triton's CUDA headers are not installed")
    folder = tmp_path_factory.mktemp("fake-driver")
    (folder / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run(
        [
            "cc",
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{include}",
            str(folder / "fake.c"),
            "-o",
            str(folder / "libcuda.so.1"),
        ],
        check=True,
    )
    return folder


def test_the_launcher_builds_here_and_passes_what_tritons_launcher_passes(
    fake_driver: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("ok <launch k[grid] grid=(7, 2, 1)>"), done.stdout
    assert list((tmp_path / "cache" / "launcher").glob("*/_launch*.so")), "not built into the cache"


def test_a_launch_hook_installed_at_any_time_is_seen_by_the_next_launch(
    fake_driver: Path, tmp_path: Path
) -> None:
    """Triton's launch hooks are read at every launch of a kernel bound earlier: installed in any
    way between two launches (HookChain.add, an assignment on the knobs or their class, a chain's
    `calls` or dict replaced, knobs.runtime.scope()), a hook sends the next launch to Triton's
    launcher, which calls it, as getattr reads the hooks at that moment. Where the launcher
    keeps what it read while none of it changes (CPython 3.10 to 3.12), it reads no more once
    kept."""
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", HOOKS_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_a_damaged_launcher_in_the_cache_is_built_again(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import glob, os
        from acompile._backends import _launcher
        first = _launcher.build()
        first.write_bytes(first.read_bytes()[:4096])  # truncated, as by a full disk
        assert _launcher.module(wait=True) is not None, _launcher.problem()
        # A FIFO at the checksum's path: no wait on it, a rebuild (in a fresh state).
        checksum = first.with_name(first.name + ".sha256")
        checksum.unlink()
        os.mkfifo(checksum)
        _launcher._module = None
        assert _launcher.module(wait=True) is not None, _launcher.problem()
        print("ok")
    """)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache")}
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_launcher_is_off_where_asked_and_says_why_it_cannot_build(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import os, sys
        from acompile._backends import _launcher
        # What a pool does as it starts: import a launcher built already, never build one.
        assert _launcher.module(build=False) is None and _launcher._building is None
        assert not os.path.exists(os.path.join(os.environ["ACOMPILE_CACHE_DIR"], "launcher"))
        os.environ["ACOMPILE_LAUNCHER"] = "triton"
        assert _launcher.module(wait=True) is None and _launcher.problem() == "turned off by ACOMPILE_LAUNCHER"
        del os.environ["ACOMPILE_LAUNCHER"]
        os.environ["CC"] = "/nonexistent/cc"
        assert _launcher.module(wait=True) is None
        print(_launcher.problem())
    """)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # A cache folder it cannot use (a name too long here) is a reason, not an error at a launch.
    unusable = textwrap.dedent("""
        from acompile._backends import launcher_module, launcher_problem
        assert launcher_module(wait=True) is None
        print(launcher_problem())
    """)
    env_long = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / ("z" * 300))}
    long = subprocess.run(
        [sys.executable, "-c", unusable], capture_output=True, text=True, timeout=60, env=env_long
    )
    assert long.returncode == 0, long.stderr[-3000:]
    assert "File name too long" in long.stdout + long.stderr, (long.stdout, long.stderr)
    if _launcher._cuda_include() is None:
        assert "Triton's CUDA headers are not installed" in done.stdout
    else:
        assert "/nonexistent/cc" in done.stdout, done.stdout
        # ...and the fallback is said once, at warning level, not raised at a launch.
        assert "kernels launch through Triton's" in done.stderr, done.stderr


def test_the_launcher_builds_below_the_callers_priority(tmp_path: Path) -> None:
    """The build runs in the caller's process, the first time a kernel loads (a model server's
    start-up): its compiler runs at nice 19, below the event loop, which keeps its own."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    seen = tmp_path / "nice.txt"
    wrapper = tmp_path / "cc"
    # Field 19 of /proc/PID/stat is the nice value (the name, field 2, has no spaces here).
    wrapper.write_text(f'#!/bin/sh\ncut -d" " -f19 /proc/$$/stat > {seen}\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    code = textwrap.dedent("""
        import os
        from acompile._backends import launcher_module, launcher_problem
        assert launcher_module(wait=True) is not None, launcher_problem()
        print(os.getpriority(os.PRIO_PROCESS, 0))
    """)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"), "CC": str(wrapper)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(os.getpriority(os.PRIO_PROCESS, 0))  # the caller: unchanged
    assert seen.read_text().strip() == "19"


BRIDGE_LOADS = """
from acompile._backends import _launcher
try:
    print(_launcher.load_bridge().__file__)
except (ImportError, RuntimeError) as exc:
    print(type(exc).__name__, exc)
"""


def test_the_bridge_is_built_once_for_processes_starting_together_and_again_where_it_does_not_load(
    tmp_path: Path,
) -> None:
    """Processes starting together on a fresh cache (a server's ranks) build the bridge once,
    not each (it takes up to 1 GB). A library at its path that does not load (another library,
    with a checksum to match) is removed and built again: the next process loads it. Something
    in the way that is not a file fails at once, with no build."""
    pytest.importorskip("torch")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "c++"
    wrapper.write_text(f'#!/bin/sh\necho "$$" >> {log}\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(wrapper)}
    env.pop("ACOMPILE_TORCH_BRIDGE", None)

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", BRIDGE_LOADS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def compiles() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    together = [start() for _ in range(3)]
    outputs = [p.communicate(timeout=240) for p in together]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1 and all(p.returncode == 0 for p in together), outputs
    target = Path(paths.pop())
    assert target.is_file(), outputs
    assert compiles() == 1, "processes starting together each built the bridge"

    # Another library in its place, its checksum written to match (a foreign file, or one from
    # a broken build): removed and built again; this process keeps the failed one loaded.
    other = Path(torch_lib()) / "libc10.so"
    target.write_bytes(other.read_bytes())
    checksum = target.with_name(target.name + ".sha256")
    checksum.write_text(hashlib.sha256(other.read_bytes()).hexdigest())
    first = subprocess.run(
        [sys.executable, "-c", BRIDGE_LOADS], capture_output=True, text=True, env=env, timeout=240
    )
    assert first.stdout.startswith("ImportError") and "the next process loads" in first.stdout, first
    assert compiles() == 2
    second = subprocess.run(
        [sys.executable, "-c", BRIDGE_LOADS], capture_output=True, text=True, env=env, timeout=240
    )
    assert second.stdout.strip() == str(target), second
    assert compiles() == 2, "the rebuilt bridge was built yet again"

    # A folder where the library goes: refused by name, without a build.
    target.unlink()
    target.mkdir()
    third = subprocess.run(
        [sys.executable, "-c", BRIDGE_LOADS], capture_output=True, text=True, env=env, timeout=240
    )
    assert third.stdout.startswith("RuntimeError") and "is in the way" in third.stdout, third
    assert compiles() == 2


def torch_lib() -> str:
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "lib")


def test_the_bridge_to_pytorch_is_never_built_or_loaded_in_a_folder_another_user_controls() -> None:
    """The bridge is a library loaded into this process, as the launcher is: in a cache folder
    another user made first (writable by anyone, even), it is neither built nor loaded, and the
    refusal says whose the folder is."""
    pytest.importorskip("torch")
    from attacker import as_nobody, shared_folder
    from conftest import subprocess_env

    code = textwrap.dedent("""
        from acompile._backends import _launcher
        try:
            _launcher.load_bridge()
        except OSError as exc:
            print(type(exc).__name__, exc)
        else:
            print("loaded")
    """)
    with shared_folder() as shared:
        theirs = shared / "cache"
        as_nobody(os.mkdir, str(theirs), 0o777)
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(ACOMPILE_CACHE_DIR=str(theirs)),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("UntrustedFolderError") and "nobody" in done.stdout, done.stdout
        assert not any(theirs.iterdir()), "the bridge's folders were made in nobody's folder"


def _compiler_adding(tmp_path: Path, name: str, c_source: str) -> str:
    """A ``CC`` that builds what it is asked to, with ``c_source`` linked in (a constructor: code
    that runs as the library is loaded)."""
    extra = tmp_path / f"{name}.c"
    extra.write_text(textwrap.dedent(c_source))
    wrapper = tmp_path / f"cc-{name}"
    wrapper.write_text(f'#!/bin/sh\nexec gcc "$@" {extra}\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _build_in_a_fresh_python(tmp_path: Path, cc: str, timeout: float) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent("""
        from acompile._backends import _launcher
        try:
            print("built", _launcher.build())
        except RuntimeError as exc:
            print("failed", exc)
    """)
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"), "CC": cc}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_library_that_starts_a_daemon_as_it_loads_does_not_hold_up_its_build(tmp_path: Path) -> None:
    """The library starts a process of its own at load, in a session of its own, that keeps the
    load check's output open (a library's helper server): the build ends when the check does.
    It waited for that output to close, past the check's timeout, for ever, holding the build
    lock that every other process building it waits for."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    pid_file = tmp_path / "daemon.pid"
    cc = _compiler_adding(
        tmp_path,
        "daemon",
        f"""
        #include <stdio.h>
        #include <unistd.h>
        __attribute__((constructor)) static void start_daemon(void) {{
            if (fork() == 0) {{
                setsid();
                if (fork() == 0) {{
                    FILE *f = fopen("{pid_file}", "w");
                    fprintf(f, "%d\\n", getpid());
                    fclose(f);
                    sleep(300);
                }}
                _exit(0);
            }}
        }}
        """,
    )
    try:
        done = _build_in_a_fresh_python(tmp_path, cc, timeout=60)
        assert done.returncode == 0 and done.stdout.startswith("built "), (done.stdout, done.stderr[-3000:])
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_compiler_that_says_why_it_failed_in_another_encoding_is_quoted(tmp_path: Path) -> None:
    """A compiler's message in bytes that are not UTF-8 (a Latin-1 locale, a path's bytes): the
    build fails with that message, the odd bytes replaced. It failed with a UnicodeDecodeError,
    which said nothing of the compiler."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    wrapper = tmp_path / "cc-latin1"
    wrapper.write_bytes(b"#!/bin/sh\nprintf 'erreur: fichier \\351trange\\n' >&2\nexit 1\n")
    wrapper.chmod(0o755)
    done = _build_in_a_fresh_python(tmp_path, str(wrapper), timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("failed ") and "erreur: fichier \ufffdtrange" in done.stdout, done.stdout


def test_the_load_check_ends_with_the_process_that_asked_for_the_build(tmp_path: Path) -> None:
    """The process building the launcher is SIGKILLed while the fresh Python it started loads a
    library that never finishes loading: that Python goes too. It stayed, for ever."""
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    pid_file = tmp_path / "loader.pid"
    cc = _compiler_adding(
        tmp_path,
        "stuck",
        f"""
        #include <stdio.h>
        #include <unistd.h>
        __attribute__((constructor)) static void stuck(void) {{
            FILE *f = fopen("{pid_file}", "w");
            fprintf(f, "%d\\n", getpid());
            fclose(f);
            for (;;) pause();
        }}
        """,
    )
    code = "from acompile._backends import _launcher; _launcher.build()"
    env = {**os.environ, "ACOMPILE_CACHE_DIR": str(tmp_path / "cache"), "CC": cc}
    caller = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().endswith("\n"):
            assert time.monotonic() < deadline and caller.poll() is None, "the load check did not start"
            time.sleep(0.02)
        loader = int(pid_file.read_text())
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while _alive(loader):
            assert time.monotonic() < deadline, "the load check outlived the process that started it"
            time.sleep(0.02)
    finally:
        caller.kill()
        caller.wait()
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SUBSCRIPT_SCRIPT = r"""
import anyio, acompile
from acompile._backends import _launcher, _triton_kernel
from acompile import TritonKernel
from kernels_for_tests import add_kernel

launch = _launcher._load(_launcher.build())

# The method of C on a class of its own: the table's launch function, else for a grid function
# the binder's, else the miss method's.
class K:
    def __init__(self):
        self._by_grid, self.misses, self._by_grid_function = {}, [], None
    def _subscript_miss(self, grid):
        self.misses.append(grid)
        if grid == "boom":
            raise ZeroDivisionError("from the miss")
        return ("made", grid)
K.__getitem__ = launch.subscript(K, "_by_grid", "_by_grid_function", "_subscript_miss")
try:  # the names are the process's: another class naming others is refused, not rewired
    launch.subscript(K, "_table", "_by_grid_function", "_subscript_miss")
except ValueError as exc:
    assert "('_by_grid', '_by_grid_function', '_subscript_miss')" in str(exc), exc
else:
    raise AssertionError("other names were taken")
assert type(K.__dict__["__getitem__"]).__name__ == "method_descriptor"
k = K()
marker = object()
k._by_grid[(7, 2)] = marker
k._by_grid[5] = marker
assert k[(7, 2)] is marker and k[5] is marker and k.misses == []
assert k[(7, 3)] == ("made", (7, 3)) and k[[7, 2]] == ("made", [7, 2])  # a list: unhashable, a miss
assert k.misses == [(7, 3), [7, 2]]
def grid_function(meta):
    return (1,)
assert k[grid_function] == ("made", grid_function)  # no binder yet (not loaded): the miss
k._by_grid_function = lambda grid: ("bound", grid)
assert k[grid_function] == ("bound", grid_function) and k[(7, 4)] == ("made", (7, 4))
k._by_grid[grid_function] = marker  # the table first, whatever the grid
assert k[grid_function] is marker
del k._by_grid[grid_function]
k._by_grid_function = None
k._by_grid[(9,)] = None  # None kept: a miss, as for the Python one
assert k[(9,)] == ("made", (9,))
k.misses.clear()
try:
    k["boom"]
except ZeroDivisionError as exc:
    assert str(exc) == "from the miss"
else:
    raise AssertionError("the miss method's error was lost")
class BadHash:
    def __hash__(self):
        raise ValueError("no hash")
try:
    k[BadHash()]
except ValueError as exc:  # not a TypeError: said as it is, no miss
    assert str(exc) == "no hash" and len(k.misses) == 1
else:
    raise AssertionError("a hash's error was lost")
k._by_grid = None  # not a dict: every grid a miss
assert k[(7, 2)] == ("made", (7, 2))
del k._by_grid
try:
    k[1]
except AttributeError as exc:
    assert "_by_grid" in str(exc)
else:
    raise AssertionError("no table, no error")
try:
    K.__getitem__(object(), 1)
except TypeError:
    pass
else:
    raise AssertionError("another class's object was taken")
class Sub(K):
    def _subscript_miss(self, grid):
        return "sub"
assert Sub()[(1,)] == "sub"

# On acompile's TritonKernel (compiled for real, no GPU here): the same answers as its Python
# __getitem__, which it replaces.
async def compile_one():
    async with acompile.CompilePool(1, target="cuda:90") as pool:
        return await pool.triton(add_kernel, signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                                 "out_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64})
kernel = anyio.run(compile_one)
python_getitem = TritonKernel.__dict__["__getitem__"]
def answers():
    out = []
    for grid in ((4,), [4], lambda meta: (1,), (1.5,)):
        try:
            kernel[grid]
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out
before = answers()
_triton_kernel._use_c_subscript()
assert TritonKernel.__dict__["__getitem__"] is not python_getitem
assert type(TritonKernel.__dict__["__getitem__"]).__name__ == "method_descriptor"
after = answers()
assert after == before and len(after) == 4, (before, after)
assert after[0].startswith("DeviceUnavailableError") and after[3].startswith("TypeError: grid must be"), after
kernel._by_grid[(4,)] = marker  # what a load keeps there
assert kernel[(4,)] is marker
kernel._by_grid_function = lambda grid: ("bound", grid)  # what a load sets
assert kernel[grid_function] == ("bound", grid_function)
TritonKernel.__getitem__ = python_getitem
assert kernel[(4,)] is marker and kernel[grid_function] == ("bound", grid_function)
_triton_kernel._use_c_subscript()
try:
    kernel[4]  # another key: a miss, which loads
except acompile.DeviceUnavailableError:
    pass
else:
    raise AssertionError("grid 4 was taken as (4,)")
print("ok")
"""


def test_a_kernels_subscript_made_in_c_answers_as_the_python_one(tmp_path: Path) -> None:
    """`kernel[grid]` at every launch: the launcher makes TritonKernel's `__getitem__` a method
    of C (a fifth of a microsecond less per launch), which must answer every grid as the Python
    one does: the launch kept for it, else the miss path's launch or error."""
    pytest.importorskip("triton")
    if _launcher._cuda_include() is None:
        pytest.skip("Triton's CUDA headers are not installed")
    from conftest import subprocess_env

    done = subprocess.run(
        [sys.executable, "-c", SUBSCRIPT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(ACOMPILE_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
