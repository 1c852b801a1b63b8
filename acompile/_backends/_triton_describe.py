"""Which kernel a Triton spec names, its Triton key, and its description for a worker.

A spec's kernel is a ``@triton.jit`` function or a source string (``_triton_text``). A function's
Triton key (``fn.cache_key``: a parse of its source and of everything it calls) is computed once,
off the loop, however many requests for it arrive together; what a worker needs to rebuild it
(``_triton_source.describe``) is worked out only on a cache miss, the same way.
"""

from __future__ import annotations

import weakref
from typing import Any

import anyio

from acompile._backends import _triton_source
from acompile._backends._memos import remembered
from acompile._backends._triton_once import ahead, once
from acompile._backends._triton_spec import TritonSpec
from acompile._backends._triton_text import kernel_from_text
from acompile._errors import InvalidSpecError, show


def _has_cache_key(fn: Any) -> bool:
    key = getattr(fn, "hash", None)  # where JITFunction keeps its computed cache_key
    return isinstance(key, str) and not key.startswith("recursion:")


async def resolve_kernel(spec: TritonSpec) -> tuple[Any, dict[str, Any] | None]:
    """The kernel ``spec`` names, with its Triton key computed, and for a source string what a
    worker gets to rebuild it (``None`` for a JIT function: see ``description``). Raises
    ``InvalidSpecError`` for anything else than a JIT function or a source string naming one."""
    from triton.runtime.jit import JITFunction

    fn = spec.fn
    if spec.kernel_name is not None and (
        not isinstance(spec.kernel_name, str) or not spec.kernel_name.isidentifier()
    ):
        raise InvalidSpecError(f"kernel_name must be a Python identifier, got {show(spec.kernel_name)}")
    if isinstance(fn, str):
        return await kernel_from_text(fn, spec.kernel_name)
    if isinstance(fn, JITFunction):
        if spec.kernel_name is not None and spec.kernel_name != fn.__name__:
            raise InvalidSpecError(
                f"kernel_name={spec.kernel_name!r} names a kernel in a source string; the JIT "
                f"function passed is {fn.__name__!r}: drop kernel_name"
            )
        if not _has_cache_key(fn):
            # Triton's key of a function parses it and everything it calls: off the loop, once,
            # however many requests for it arrive together.
            await once(("key", id(fn)), lambda: _has_cache_key(fn) or None, lambda: fn.cache_key)
        # What a worker needs to rebuild it is worked out only if a worker is needed.
        return fn, None
    inner = getattr(fn, "fn", None)
    if isinstance(inner, JITFunction) or (
        inner is not None and isinstance(getattr(inner, "fn", None), JITFunction)
    ):
        raise InvalidSpecError(
            f"{type(fn).__name__} wraps a JIT function with its own configs: pass the inner "
            "function (its .fn) with the config's constexprs and options, or use pool.autotune()"
        )
    if callable(fn):
        raise InvalidSpecError(
            f"{getattr(fn, '__qualname__', fn)!r} is not a Triton JIT function: decorate it with "
            "@triton.jit, or pass the kernel's source text with kernel_name="
        )
    raise InvalidSpecError(f"expected a @triton.jit function or a source string, got {type(fn).__name__}")


def keys_ahead(specs: list[Any]) -> list[anyio.Event]:
    """Start Triton's key of every JIT function ``specs`` name that has none yet, in one job of
    the parse thread, in their order: the requests that arrive together (``gather()``) then
    wait for a key already under way, and the thread goes from one function to the next
    without a trip through the loop. Anything but a JIT function is left to its request.
    Returns the events set as each key's work ends."""
    from triton.runtime.jit import JITFunction

    named = (getattr(spec, "fn", None) for spec in specs)
    unkeyed = {id(fn): fn for fn in named if isinstance(fn, JITFunction) and not _has_cache_key(fn)}
    fns = list(unkeyed.values())
    if not fns:
        return []
    return ahead([("key", id(fn)) for fn in fns], lambda i: fns[i].cache_key)


# Each JIT function's description for workers, with the Triton key it was built under, by the
# function's id (dropped with the function).
_described: dict[int, tuple[weakref.ref[Any], str, dict[str, Any]]] = remembered({})


async def description(fn: Any) -> dict[str, Any]:
    """What a worker needs to rebuild the JIT function ``fn`` (see ``_triton_source``): built
    on the parse thread once for all the requests that ask at the same time, and remembered."""
    ref = _described_already(fn)
    if ref is None:
        ref = await once(("describe", id(fn)), lambda: _described_already(fn), _describe, fn)
    return ref


def _described_already(fn: Any) -> dict[str, Any] | None:
    memo = _described.get(id(fn))
    alive: Any = memo[0]() if memo is not None else None
    if memo is None or alive is not fn:
        return None
    return memo[2] if memo[1] == alive.cache_key else None


def _describe(fn: Any) -> dict[str, Any]:
    """The worker's description of fn, built once per function (and again if its source
    changes, which changes its cache key)."""
    key = fn.cache_key
    ref = _triton_source.describe(fn)
    fn_id = id(fn)

    def forget(_: object) -> None:
        _described.pop(fn_id, None)

    _described[fn_id] = (weakref.ref(fn, forget), key, ref)
    return ref
