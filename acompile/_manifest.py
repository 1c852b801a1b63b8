"""Warm-up manifests: a TOML list of kernels to compile ahead of time.

::

    [defaults]                       # optional; any kernel field
    targets = ["cuda:90", "cuda:80"]
    num_warps = 4

    [[kernel]]
    kernel = "kernels.py:add_kernel"     # a file (relative to the manifest) or a module, ':' name
    signature = { x_ptr = "*fp32", y_ptr = "*fp32", out_ptr = "*fp32", n = "i32" }
    constexprs = [{ BLOCK = 256 }, { BLOCK = 1024 }]   # a table, or a list of variants
    num_warps = 4                        # also num_stages, options = { ... }, attrs = { ... }

Every (variant, target) pair is one compile request.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from acompile._backends._triton import TritonSpec
from acompile._errors import InvalidSpecError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_KERNEL_FIELDS = {
    "kernel",
    "signature",
    "constexprs",
    "targets",
    "num_warps",
    "num_stages",
    "options",
    "attrs",
}


def load_manifest(path: str | Path) -> list[TritonSpec]:
    """Read a manifest and import its kernels (blocking: imports run module code).

    Raises ``InvalidSpecError`` naming the manifest entry at fault.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidSpecError(f"no manifest at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpecError(f"{path} is not valid TOML: {exc}") from None
    unknown_top = set(data) - {"defaults", "kernel"}
    if unknown_top:
        raise InvalidSpecError(
            f"{path}: unknown section(s) {sorted(unknown_top)}; use [defaults] and [[kernel]]"
        )
    defaults = data.get("defaults", {})
    kernels = data.get("kernel", [])
    if not isinstance(kernels, list) or not kernels:
        raise InvalidSpecError(f"{path} lists no [[kernel]] entries")
    specs: list[TritonSpec] = []
    for index, raw in enumerate(kernels, 1):
        entry = {**defaults, **raw}
        where = f"{path} kernel #{index} ({entry.get('kernel', '?')})"
        unknown = set(entry) - _KERNEL_FIELDS
        if unknown:
            raise InvalidSpecError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_KERNEL_FIELDS)}"
            )
        if "kernel" not in entry or "signature" not in entry:
            raise InvalidSpecError(f'{where}: needs kernel = "file.py:name" and signature = {{...}}')
        fn = _import_kernel(entry["kernel"], path.parent, where)
        variants = entry.get("constexprs", [{}])
        if isinstance(variants, Mapping):
            variants = [variants]
        targets = entry.get("targets", [None])
        if isinstance(targets, str):
            targets = [targets]
        for target in targets:
            for constexprs in variants:
                specs.append(
                    TritonSpec(
                        fn,
                        dict(entry["signature"]),
                        dict(constexprs),
                        num_warps=entry.get("num_warps", 4),
                        num_stages=entry.get("num_stages", 3),
                        target=target,
                        attrs=entry.get("attrs"),
                        options=dict(entry.get("options", {})),
                    )
                )
    return specs


def _import_kernel(ref: str, base: Path, where: str) -> Any:
    if not isinstance(ref, str) or ":" not in ref:
        raise InvalidSpecError(
            f"{where}: kernel must read 'file.py:name' or 'package.module:name', got {ref!r}"
        )
    target, _, name = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            file = (base / target).resolve()
            if not file.is_file():
                raise InvalidSpecError(f"{where}: no file {file}")
            # Import it as a module of its folder (added to sys.path), so that workers that must
            # import it by name find it the same way.
            folder = str(file.parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module = importlib.import_module(file.stem)
            if Path(getattr(module, "__file__", "") or "").resolve() != file:
                raise InvalidSpecError(
                    f"{where}: importing {file.stem!r} found {module.__file__}, not {file}; rename the file"
                )
        else:
            module = importlib.import_module(target)
    except InvalidSpecError:
        raise
    except ModuleNotFoundError as exc:
        hint = (
            f"; {target!r} is imported by name: put the folder that holds it on PYTHONPATH, or name "
            'the file ("path/to/file.py:kernel", relative to the manifest)'
        )
        raise InvalidSpecError(f"{where}: cannot import {target!r}: {exc}{hint}") from exc
    except Exception as exc:
        raise InvalidSpecError(f"{where}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise InvalidSpecError(f"{where}: {target!r} has no {name!r}") from None
