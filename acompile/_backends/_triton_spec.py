"""A Triton compile request as the user writes it (``TritonSpec``), and its checks.

Every check here runs in the pool's process before any key is computed, and says what to change
(``InvalidSpecError``): the signature against the kernel's parameters, the attributes, the
options against the target's, and the constexpr values a key can hold. ``TritonRequest`` is what
a spec becomes once checked and keyed (``_triton.prepare``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from acompile._backends._memos import remembered
from acompile._errors import InvalidSpecError, show
from acompile._targets import Target, parse_target


@dataclass(frozen=True)
class TritonSpec:
    """One Triton compile request, as ``CompilePool.triton()`` takes it (see there).

    Specs are plain values: build a list of them and hand it to ``CompilePool.gather()``.
    """

    backend: ClassVar[str] = "triton"

    fn: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] | None = None
    kernel_name: str | None = None
    num_warps: int = 4
    num_stages: int = 3
    target: str | Target | None = None
    attrs: Mapping[Any, Any] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TritonRequest:
    """A checked, keyed ``TritonSpec`` (see ``_contract.Request``): the kernel (a JIT function,
    or a ``SourceKernel`` standing in for a source string's), Triton's full signature and
    constexprs, the attributes by parameter path, what a worker gets, and what the key holds."""

    key: str
    name: str
    target: Target
    fn: Any
    signature: dict[str, str]
    constants: dict[str, Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    payload: dict[str, Any]
    key_parts: dict[str, Any]


def resolve_target(value: Any, default: Target | None) -> Target:
    """The spec's own target, else the pool's; ``InvalidSpecError`` when neither names one."""
    if value is not None:
        return parse_target(value)
    if default is None:
        raise InvalidSpecError("no target: pass target='cuda:90' (or set one on the CompilePool)")
    return default


# The Triton types already parsed once: a type string is checked by Triton's own parser, ~10 us.
_valid_types: set[str] = remembered(set())


def full_signature(
    fn: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's full signature (every parameter in order, constexprs as "constexpr") and the
    constexpr values, defaults filled in."""
    if not isinstance(signature, Mapping):
        raise InvalidSpecError(
            f"signature must map parameter names to Triton types, got {type(signature).__name__}"
        )
    if not isinstance(constexprs, Mapping):
        raise InvalidSpecError(f"constexprs must map names to values, got {type(constexprs).__name__}")
    from triton.language import str_to_ty

    params = {p.name: p for p in fn.params}
    for name in [*signature, *constexprs]:
        if not isinstance(name, str):
            raise InvalidSpecError(
                f"signature and constexprs are keyed by parameter names (strings), got {show(name)}"
            )
        if name not in params:
            raise InvalidSpecError(
                f"{fn.__name__} has no parameter {name!r}; its parameters are {list(params)}"
            )
    both = set(signature) & {k for k, v in signature.items() if v != "constexpr"} & set(constexprs)
    if both:
        raise InvalidSpecError(
            f"{sorted(both)} appear in both signature and constexprs: a parameter is either "
            "a runtime argument (signature) or a compile-time value (constexprs)"
        )
    full: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for name, param in params.items():
        if name in constexprs:
            full[name] = "constexpr"
            constants[name] = constexprs[name]
        elif name in signature and signature[name] != "constexpr":
            ty = signature[name]
            if not isinstance(ty, str) or "\0" in ty:
                raise InvalidSpecError(f"type of {name!r} must be a string such as '*fp32', got {show(ty)}")
            try:
                if ty not in _valid_types:
                    str_to_ty(ty, None)
                    _valid_types.add(ty)
            except (KeyError, IndexError, ValueError, TypeError):
                raise InvalidSpecError(
                    f"unknown Triton type {show(ty)} for {name!r}: use e.g. '*fp32' or '*fp16' "
                    "(pointers), 'i32', 'i64', 'u32', 'fp32', 'bf16', 'i1'"
                ) from None
            full[name] = ty
        elif param.is_constexpr and param.has_default:
            full[name] = "constexpr"
            constants[name] = param.default
        elif param.is_constexpr:
            raise InvalidSpecError(
                f"missing constexpr {name!r} of {fn.__name__}: pass constexprs={{{name!r}: ...}}"
            )
        else:
            raise InvalidSpecError(
                f"missing type for parameter {name!r} of {fn.__name__}: add it to signature, "
                f"e.g. signature={{..., {name!r}: {_example_type(name)!r}}}"
            )
    return full, constants


def normalize_attrs(
    fn: Any, attrs: Mapping[Any, Any] | None, signature: Mapping[str, str]
) -> dict[tuple[int, ...], list[list[Any]]]:
    """Triton keys attributes by parameter path ((0,) for the first); accept names too. Triton
    silently ignores attributes keyed by name, so they are translated here. Each value is a list
    of [name, value] pairs, such as ``[["tt.divisibility", 16]]``."""
    if attrs is None:
        return {}
    if not isinstance(attrs, Mapping):
        raise InvalidSpecError(f"attrs must map parameter names or indices to attributes, got {show(attrs)}")
    names = list(fn.arg_names)
    result: dict[tuple[int, ...], list[list[Any]]] = {}
    for k, v in attrs.items():
        if isinstance(k, str):
            if k not in names:
                raise InvalidSpecError(
                    f"attrs names {show(k)}, which is not a parameter of {fn.__name__}; "
                    f"its parameters are {names}"
                )
            path: tuple[int, ...] = (names.index(k),)
        elif isinstance(k, int) and not isinstance(k, bool):
            path = (k,)
        elif isinstance(k, tuple) and k and all(isinstance(i, int) and not isinstance(i, bool) for i in k):
            path = k
        else:
            raise InvalidSpecError(f"attrs keys are parameter names or index tuples, got {show(k)}")
        if not 0 <= path[0] < len(names) or any(i < 0 for i in path):
            raise InvalidSpecError(
                f"attrs index {show(k)} is out of range: {fn.__name__} has {len(names)} parameters "
                f"(0 to {len(names) - 1})"
            )
        if signature.get(names[path[0]]) == "constexpr":
            raise InvalidSpecError(
                f"attrs[{show(k)}]: {names[path[0]]!r} is a constexpr; attributes apply to runtime parameters"
            )
        result[path] = _attr_pairs(k, v)
    return result


def _attr_pairs(k: Any, v: Any) -> list[list[Any]]:
    wrong = InvalidSpecError(
        f"attrs[{show(k)}] must be a list of [name, value] pairs such as "
        f"[['tt.divisibility', 16]], got {show(v)}"
    )
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise wrong
    pairs = []
    for pair in v:
        if (
            isinstance(pair, (str, bytes))
            or not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or "\0" in pair[0]
        ):
            raise wrong
        value = pair[1]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidSpecError(
                f"attrs[{show(k)}]: the value of {pair[0]!r} must be an int or a string, got {show(value)}"
            )
        pairs.append([pair[0], value])
    return pairs


# The options each of Triton's compiler backends takes, by backend name ("cuda", "hip").
_option_names_memo: dict[str, frozenset[str]] = remembered({})
# And the kind of value each takes (see ``_option_kind``), read off the same dataclass.
_option_kinds_memo: dict[str, dict[str, tuple[str, bool]]] = remembered({})


def option_names(backend: str) -> frozenset[str]:
    """The options Triton's compiler for ``backend`` takes. The first call for a backend imports
    Triton's compiler for it: make it from a thread (see ``knows_options``)."""
    names = _option_names_memo.get(backend)
    if names is None:
        if backend == "cuda":
            from triton.backends.nvidia.compiler import CUDAOptions as options_cls
        else:
            from triton.backends.amd.compiler import HIPOptions as options_cls
        fields = options_cls.__dataclass_fields__
        _option_kinds_memo[backend] = {name: _option_kind(name, f) for name, f in fields.items()}
        names = _option_names_memo[backend] = frozenset(fields)
    return names


# Options whose value Triton takes in a range narrower than its type says: outside it, the
# compile fails in a worker with a message of Triton's (or ptxas's) that names no option.
# (low, high): inclusive; None for no bound.
_OPTION_RANGES: dict[str, tuple[int, int | None]] = {
    "maxnreg": (1, 255),  # registers a thread: ptxas's .maxnreg, at most 255 on every NVIDIA GPU
    "num_ctas": (1, 16),  # a thread block cluster: 16 at most (8 portable)
    "kpack": (1, 2),
}
# Options typed loosely in Triton's dataclass: CUDA's says bool, yet the value is a count.
_OPTION_KIND_OVERRIDES = {"max_num_imprecise_acc_default": "int"}


def _option_kind(name: str, field_: Any) -> tuple[str, bool]:
    """The kind of value an option of Triton's takes, from its dataclass field: "int", "bool",
    "str", "strs" (a list of strings), "map" (names to strings) or "any" (a type this does not
    check: its value need only be plain), and whether None is allowed."""
    import dataclasses
    import typing

    annotation = field_.type
    nullable = field_.default is None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union and type(None) in args:
        nullable = True
        rest = [a for a in args if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else Any
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if field_.default is dataclasses.MISSING and field_.default_factory is dataclasses.MISSING:
        nullable = False
    kind = _OPTION_KIND_OVERRIDES.get(name)
    if kind is None:
        if annotation is bool:
            kind = "bool"
        elif annotation is int:
            kind = "int"
        elif annotation is str:
            kind = "str"
        elif (origin or annotation) in (tuple, list) and all(a in (str, Ellipsis) for a in args):
            kind = "strs"
        elif (origin or annotation) is dict:
            kind = "map"
        else:
            kind = "any"
    return kind, nullable


# Software pipelining stages: Triton's autotuners try up to 7; more is no kernel anyone builds,
# and past a C int Triton fails in pybind's words.
_MAX_STAGES = 64
# Triton hands its integer options to C++ as an int: anything larger fails there in pybind's
# words, which name no option.
_C_INT_MAX = 2**31 - 1


def _check_option(name: str, value: Any, kind: str, nullable: bool) -> None:
    """``InvalidSpecError`` naming the option where ``value`` is not of its ``kind`` (see
    ``_option_kind``) or out of its range: Triton would fail on it in a worker, in words of
    its own (a pybind signature), or worse take it."""
    if value is None and nullable:
        return
    either = " (or None)" if nullable else ""
    if kind == "int":
        low, high = _OPTION_RANGES.get(name, (0, _C_INT_MAX))
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= low
            and (high is None or value <= high)
        ):
            return
        if high is not None:
            wanted = f"an integer from {low} to {high}"
        else:
            wanted = "a non-negative integer" if low == 0 else f"an integer of at least {low}"
        raise InvalidSpecError(f"option {name} must be {wanted}{either}, got {show(value)}")
    if kind == "bool" and not isinstance(value, bool):
        raise InvalidSpecError(f"option {name} must be True or False{either}, got {show(value)}")
    if kind == "str" and not isinstance(value, str):
        raise InvalidSpecError(f"option {name} must be a string{either}, got {show(value)}")
    if kind == "strs" and (
        isinstance(value, (str, bytes))
        or not isinstance(value, (list, tuple))
        or not all(isinstance(v, str) for v in value)
    ):
        raise InvalidSpecError(
            f'option {name} must be a list of strings{either}, such as ["a", "b"], got {show(value)}'
        )
    if kind == "map" and (
        not isinstance(value, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise InvalidSpecError(f"option {name} must map names to strings{either}, got {show(value)}")


def knows_options(backend: str) -> bool:
    """Whether ``option_names(backend)`` is remembered already (a dict read, no import)."""
    return backend in _option_names_memo


def check_options(target: Target, spec: TritonSpec) -> dict[str, Any]:
    """The spec's options with num_warps and num_stages, sorted, each checked: known to the
    target's compiler, of the right type and range, and a plain (JSON) value for the key."""
    if not isinstance(spec.options, Mapping) or not all(isinstance(k, str) for k in spec.options):
        raise InvalidSpecError(f"options must map option names to values, got {show(spec.options)}")
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
    known = option_names(target.backend)
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidSpecError(
            f"unknown Triton option(s) {show(unknown)} for {target}; known: {sorted(known)}"
        )
    warps = options["num_warps"]
    # bool is an int to Python, and True would be a cache key of its own for num_warps=1.
    if not isinstance(warps, int) or isinstance(warps, bool) or warps not in (1, 2, 4, 8, 16, 32):
        raise InvalidSpecError(
            f"num_warps must be a power of two from 1 to 32 (1, 2, 4, 8, 16, 32), got {show(warps)}"
        )
    stages = options["num_stages"]
    if not isinstance(stages, int) or isinstance(stages, bool) or not 1 <= stages <= _MAX_STAGES:
        raise InvalidSpecError(f"num_stages must be an integer from 1 to {_MAX_STAGES}, got {show(stages)}")
    kinds = _option_kinds_memo.get(target.backend, {})
    for name, value in options.items():
        if name in kinds:
            _check_option(name, value, *kinds[name])
        if type(value) is int or type(value) is bool or (type(value) is str and "\0" not in value):
            continue  # a plain value as it is (most are): nothing to encode to know it
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidSpecError(f"option {name}={show(value)} is not a plain value") from None
        except RecursionError:
            raise InvalidSpecError(
                f"option {name} nests lists or tables too deep to be a plain value"
            ) from None
        if "\\u0000" in text:
            raise InvalidSpecError(f"option {name} contains a NUL character (\\0)")
    return dict(sorted(options.items()))


# How deep a constexpr's tuples may nest: far more than any kernel's, and far enough under
# Python's recursion limit that a key (and Triton's own walks of the value) are computed.
CONSTEXPR_DEPTH = 32


def canonical(name: str, value: Any, depth: int = 0) -> Any:
    """A JSON form of a constexpr value that tells 1, 1.0 and True apart."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, (tuple, list)):
        if depth >= CONSTEXPR_DEPTH:
            raise InvalidSpecError(
                f"constexpr {name} nests tuples more than {CONSTEXPR_DEPTH} deep: no kernel takes such a "
                "value (is it built by a loop that does not end?)"
            )
        return ["tuple", [canonical(name, v, depth + 1) for v in value]]
    inner = getattr(value, "value", None)
    if type(value).__name__ == "constexpr":
        if depth >= CONSTEXPR_DEPTH:
            raise InvalidSpecError(f"constexpr {name} nests constexprs more than {CONSTEXPR_DEPTH} deep")
        return canonical(name, inner, depth + 1)
    cache_key = getattr(value, "cache_key", None)
    if isinstance(cache_key, str):
        return ["obj", type(value).__name__, cache_key]
    if type(value).__module__.startswith("triton.language"):
        return ["triton", type(value).__name__, str(value)]
    raise InvalidSpecError(
        f"constexpr {name}={value!r} ({type(value).__name__}) cannot be part of a cache key: "
        "use ints, floats, bools, strings, tuples of those, or Triton dtypes"
    )


def _example_type(name: str) -> str:
    """A type to show for a parameter left out of a signature: a pointer for a name that reads
    as one (``x_ptr``), else an integer."""
    return "*fp32" if name.lower().endswith("ptr") else "i32"
