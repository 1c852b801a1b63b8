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

A manifest may also warm torch.compile models (``[[torch]]``): each names a callable (no
arguments) that builds a model, compiles it with ``torch.compile`` and runs it; warm-up runs it
with torch.compile served by its pool, so the model's graphs and kernels land in the cache (and
the shared tier), and saves torch's Mega-Cache artifacts under ``artifacts`` where given::

    [[torch]]
    callable = "models.py:warm_llama"    # a file (relative to the manifest) or a module, ':' name
    artifacts = "llama-8b"               # optional: inductor.load_artifacts("llama-8b") reads them

And FlashInfer's kernel modules (``[[flashinfer]]``): each names a generator of FlashInfer's
and its arguments; warm-up builds the module it makes with FlashInfer served by its pool, for the
manifest's arch list (one a run: FlashInfer reads it once a process), into the cache and the
shared tier::

    [[flashinfer]]
    generator = "flashinfer.jit.activation:gen_act_and_mul_module"
    args = ["silu"]                      # and kwargs = { ... }
    arch_list = "9.0"                    # $FLASHINFER_CUDA_ARCH_LIST where left out

The format is read here (``load_manifest``) and written here: ``Recorder`` appends every kernel
request a pool served (``CompilePool(record=...)``), once per distinct request, across runs, so
that replaying the file on the next deploy compiles what production used.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import re
import stat
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acompile import _files
from acompile._backends import TritonSpec
from acompile._errors import InvalidSpecError

logger = logging.getLogger("acompile")

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


# The largest manifest read: a record of every kernel a large server ever served is a few MiB.
# Anything larger is not a manifest (a log, a disk image named by mistake) and would be read
# whole into memory before a word of it is checked.
MANIFEST_LIMIT = 64 << 20

_FILE_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest's TOML, parsed (blocking). ``InvalidSpecError`` saying what is wrong: no such
    file, not a regular file, over ``MANIFEST_LIMIT``, not UTF-8, not TOML, nested too deep.

    Opened without blocking and checked before a byte is read: a FIFO without a writer would
    wait for ever, a device such as /dev/zero never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidSpecError(f"no manifest at {path}") from None
    except OSError as exc:
        raise InvalidSpecError(f"cannot read the manifest {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InvalidSpecError(f"{path} is a folder: name a manifest file (a .toml) in it")
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "a special file")
            raise InvalidSpecError(f"{path} is not a regular file ({kind}): name a manifest file (a .toml)")
        if info.st_size > MANIFEST_LIMIT:
            raise InvalidSpecError(
                f"{path} is {info.st_size / (1 << 20):.1f} MiB: a manifest is at most "
                f"{MANIFEST_LIMIT >> 20} MiB (is it the file you meant? split a larger one)"
            )
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as f:
        try:
            # One byte over the bound: a file that grows while it is read is refused too.
            raw = f.read(MANIFEST_LIMIT + 1)
        except OSError as exc:
            raise InvalidSpecError(f"cannot read the manifest {path}: {exc.strerror or exc}") from None
    if len(raw) > MANIFEST_LIMIT:
        raise InvalidSpecError(f"{path} grew past {MANIFEST_LIMIT >> 20} MiB while it was read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpecError(
            f"{path} is not a text file (not UTF-8: {exc.reason} at byte {exc.start})"
        ) from None
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpecError(f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        # TOML's parser recurses once an array or inline table: a file nested thousands deep
        # (no manifest is) would otherwise end in a traceback.
        raise InvalidSpecError(
            f"{path} nests arrays or tables too deep to be a manifest (over {sys.getrecursionlimit()} levels)"
        ) from None
    # Dotted keys (a.b.c... = 1) nest tables without the parser recursing: thousands deep, every
    # later repr() of an entry (an error message) would end in a RecursionError.
    if _depth_over(data, _MANIFEST_DEPTH):
        raise InvalidSpecError(f"{path} nests tables or arrays over {_MANIFEST_DEPTH} deep: no manifest does")
    return data


# The deepest nesting a manifest may have (its deepest field, a constexpr's tuple, is a few levels).
_MANIFEST_DEPTH = 64


def _depth_over(data: Any, limit: int) -> bool:
    """Whether tables and arrays in ``data`` nest deeper than ``limit`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def load_manifest(path: str | Path) -> list[TritonSpec]:
    """Read a manifest and import its kernels (blocking: imports run module code).

    Raises ``InvalidSpecError`` naming the manifest entry at fault.
    """
    path = Path(path)
    data = read_manifest(path)
    unknown_top = set(data) - {"defaults", "kernel", "torch", "flashinfer"}
    if unknown_top:
        raise InvalidSpecError(
            f"{path}: unknown section(s) {sorted(unknown_top)}; use [defaults], [[kernel]], [[torch]] "
            "and [[flashinfer]]"
        )
    defaults = data.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise InvalidSpecError(f"{path}: [defaults] must be a table of kernel fields")
    if unknown := set(defaults) - _KERNEL_FIELDS:
        # Named here, not as every kernel's mistake.
        raise InvalidSpecError(
            f"{path} [defaults]: unknown field(s) {sorted(unknown)}; known: {sorted(_KERNEL_FIELDS)}"
        )
    kernels = data.get("kernel", [])
    if not isinstance(kernels, list) or not (kernels or data.get("torch") or data.get("flashinfer")):
        raise InvalidSpecError(f"{path} lists no [[kernel]] (or [[torch]], [[flashinfer]]) entries")
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
        variants = entry.get("constexprs", [{}])
        if isinstance(variants, Mapping):
            variants = [variants]
        targets = entry.get("targets", [None])
        if isinstance(targets, str):
            targets = [targets]
        _check_shapes(entry, variants, targets, where)
        fn = _import_kernel(entry["kernel"], path.parent, where)
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


def _check_shapes(entry: Mapping[str, Any], variants: Any, targets: Any, where: str) -> None:
    """The shapes of a ``[[kernel]]`` entry's fields (a table, a list of tables, ...), so that a
    wrong one is named, not a ``TypeError`` from deep inside; their values are the spec's checks."""
    if not isinstance(entry["signature"], Mapping):
        raise InvalidSpecError(
            f'{where}: signature must be a table of parameter types, such as {{ x_ptr = "*fp32", n = "i32" }}'
        )
    if not isinstance(variants, list) or not all(isinstance(v, Mapping) for v in variants):
        raise InvalidSpecError(
            f"{where}: constexprs must be a table, such as {{ BLOCK = 256 }}, or a list of them "
            "(one a variant)"
        )
    if not isinstance(targets, list) or not all(t is None or isinstance(t, str) for t in targets):
        raise InvalidSpecError(f'{where}: targets must be a list of targets, such as ["cuda:90", "cuda:80"]')
    for name in ("options", "attrs"):
        if not isinstance(entry.get(name, {}), Mapping):
            raise InvalidSpecError(f"{where}: {name} must be a table")


@dataclass(frozen=True)
class TorchWarmup:
    """A ``[[torch]]`` entry: ``fn`` builds, compiles and runs a model (``ref`` names it)."""

    ref: str
    fn: Any
    artifacts: str | None = None


_TORCH_FIELDS = {"callable", "artifacts"}


def load_torch_entries(path: str | Path) -> list[TorchWarmup]:
    """The ``[[torch]]`` entries of a manifest, their callables imported (blocking). Raises
    ``InvalidSpecError`` naming the entry at fault; ``[]`` where there are none."""
    path = Path(path)
    data = read_manifest(path)
    entries = data.get("torch", [])
    if not isinstance(entries, list):
        raise InvalidSpecError(
            f"{path}: [[torch]] must be a list of tables (write [[torch]], twice brackets)"
        )
    found = []
    for index, raw in enumerate(entries, 1):
        if not isinstance(raw, Mapping):
            raise InvalidSpecError(f"{path} torch #{index}: must be a table, got {raw!r}")
        ref = raw.get("callable")
        where = f"{path} torch #{index} ({ref or '?'})"
        if unknown := set(raw) - _TORCH_FIELDS:
            raise InvalidSpecError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_TORCH_FIELDS)}"
            )
        if not isinstance(ref, str):
            raise InvalidSpecError(f'{where}: needs callable = "file.py:name"')
        artifacts = raw.get("artifacts")
        if artifacts is not None and (not isinstance(artifacts, str) or not artifacts.strip()):
            raise InvalidSpecError(f"{where}: artifacts must be a non-empty name, got {artifacts!r}")
        fn = _import_kernel(ref, path.parent, where, what="callable")
        if not callable(fn):
            raise InvalidSpecError(f"{where}: {ref!r} is not callable")
        found.append(TorchWarmup(ref, fn, artifacts))
    return found


@dataclass(frozen=True)
class FlashInferWarmup:
    """A ``[[flashinfer]]`` entry: ``generator(*args, **kwargs)`` makes a FlashInfer ``JitSpec``
    (``ref`` names it) that warm-up builds, for the manifest's arch list, or builds a kernel
    itself (a CuTe DSL kernel's builder, which returns the kernel). A recorded entry
    (``CompilePool(record=...)``) has the key its module was served under: ``key``."""

    ref: str
    generator: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    key: str | None = None


_FLASHINFER_FIELDS = {"generator", "args", "kwargs", "arch_list", "cute_dsl_arch"}
# The CuTe DSL's target (``sm_90a``): what a CuTe DSL kernel is compiled for where no GPU says.
CUTE_DSL_ARCH_ENV = "CUTE_DSL_ARCH"
FLASHINFER_ARCH_ENV = "FLASHINFER_CUDA_ARCH_LIST"


def load_flashinfer_entries(path: str | Path) -> list[FlashInferWarmup]:
    """The ``[[flashinfer]]`` entries of a manifest, their generators imported (blocking).

    FlashInfer reads its arch list (``$FLASHINFER_CUDA_ARCH_LIST``) once, as it is imported:
    every entry's ``arch_list`` must be the same (one warm-up run builds for one list), and it
    is set in the environment before FlashInfer is imported. Raises ``InvalidSpecError`` naming
    the entry at fault; ``[]`` where there are none."""
    import sys

    path = Path(path)
    data = read_manifest(path)
    entries = data.get("flashinfer", [])
    if not isinstance(entries, list):
        raise InvalidSpecError(
            f"{path}: [[flashinfer]] must be a list of tables (write [[flashinfer]], twice brackets)"
        )
    lists: set[str] = set()
    cute_archs: set[str] = set()
    for index, raw in enumerate(entries, 1):
        if not isinstance(raw, Mapping):
            raise InvalidSpecError(f"{path} flashinfer #{index}: must be a table, got {raw!r}")
        where = f"{path} flashinfer #{index} ({raw.get('generator') or raw.get('module', '?')})"
        if "module" in raw:
            _check_recorded(raw, where)
        elif unknown := set(raw) - _FLASHINFER_FIELDS:
            raise InvalidSpecError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_FLASHINFER_FIELDS)}"
            )
        if "module" not in raw and not isinstance(raw.get("generator"), str):
            raise InvalidSpecError(f'{where}: needs generator = "flashinfer.jit.norm:gen_norm_module"')
        if not isinstance(raw.get("args", []), list) or not isinstance(raw.get("kwargs", {}), Mapping):
            raise InvalidSpecError(f"{where}: args must be a list and kwargs a table")
        arch = raw.get("arch_list", os.environ.get(FLASHINFER_ARCH_ENV))
        cute = raw.get("cute_dsl_arch", os.environ.get(CUTE_DSL_ARCH_ENV))
        if "cute_dsl_arch" in raw and not (isinstance(cute, str) and re.fullmatch(r"sm_\d{2,3}[a-z]?", cute)):
            raise InvalidSpecError(f'{where}: cute_dsl_arch must read like "sm_90a", got {cute!r}')
        if isinstance(cute, str) and cute:
            cute_archs.add(cute)
        if isinstance(arch, str) and arch.strip():
            lists.add(" ".join(arch.split()))
        elif not (isinstance(cute, str) and cute):
            raise InvalidSpecError(
                f'{where}: needs arch_list = "9.0" (the CUDA archs to build for: a machine without a '
                f"GPU has none to detect), or ${FLASHINFER_ARCH_ENV}; a CuTe DSL kernel's builder "
                'needs cute_dsl_arch = "sm_90a" instead'
            )
    if not entries:
        return []
    if len(cute_archs) > 1:
        raise InvalidSpecError(
            f"{path}: [[flashinfer]] entries name different CuTe DSL archs {sorted(cute_archs)}: one "
            "warm-up run compiles for one (split the manifest)"
        )
    if cute_archs:
        os.environ[CUTE_DSL_ARCH_ENV] = cute_archs.pop()
    if len(lists) > 1:
        raise InvalidSpecError(
            f"{path}: [[flashinfer]] entries name different arch lists {sorted(lists)}: FlashInfer reads "
            "its arch list once a process, so one warm-up run builds for one (split the manifest; a "
            'recorded entry spells it as FlashInfer does, "9.0a": write a hand-written one the same way)'
        )
    if lists:
        (arch_list,) = lists
        current = os.environ.get(FLASHINFER_ARCH_ENV)
        if current is not None and " ".join(current.split()) != arch_list and "flashinfer" in sys.modules:
            raise InvalidSpecError(
                f"{path}: FlashInfer was imported with ${FLASHINFER_ARCH_ENV}={current!r}, not the "
                f"manifest's {arch_list!r}"
            )
        os.environ[FLASHINFER_ARCH_ENV] = arch_list
    found = []
    for index, raw in enumerate(entries, 1):
        if "module" in raw:
            from acompile._jit import remake_flashinfer_spec as remake_spec

            fields = {k: v for k, v in raw.items() if k != "key"}
            found.append(
                FlashInferWarmup(f"recorded {raw['module']}", remake_spec, (fields,), key=raw["key"])
            )
            continue
        ref = raw["generator"]
        where = f"{path} flashinfer #{index} ({ref})"
        generator = _import_kernel(ref, path.parent, where, what="generator")
        if not callable(generator):
            raise InvalidSpecError(f"{where}: {ref!r} is not callable")
        args, kwargs = tuple(raw.get("args", [])), dict(raw.get("kwargs", {}))
        found.append(FlashInferWarmup(ref, generator, args, kwargs))
    return found


def _check_recorded(raw: Mapping[str, Any], where: str) -> None:
    """A recorded ``[[flashinfer]]`` entry (what a serving process built): its fields' shapes."""
    from acompile._jit import FLASHINFER_RECORD_FIELDS as RECORD_FIELDS

    if unknown := set(raw) - RECORD_FIELDS - {"key"}:
        raise InvalidSpecError(f"{where}: unknown field(s) {sorted(unknown)} in a recorded module entry")
    strings = ("module", "release", "arch_list", "key")
    lists = ("sources", "cflags", "cuda_cflags", "ldflags", "include_dirs")
    if not all(isinstance(raw.get(k), str) for k in strings):
        raise InvalidSpecError(f"{where}: a recorded module entry needs {', '.join(strings)} (strings)")
    if not re.fullmatch(r"[0-9a-f]{64}", raw["key"]):
        raise InvalidSpecError(f"{where}: key must be 64 hex digits")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", raw["module"]) or ".." in raw["module"]:
        # It names the module's build folder in FlashInfer's workspace: a name, never a path.
        raise InvalidSpecError(f"{where}: module must be a module's name, got {raw['module']!r}")
    if not raw.get("sources"):
        raise InvalidSpecError(f"{where}: a recorded module entry needs its sources")
    for k in lists:
        value = raw.get(k, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidSpecError(f"{where}: {k} must be a list of strings")
    if not isinstance(raw.get("device_linking", False), bool):
        raise InvalidSpecError(f"{where}: device_linking must be true or false")
    files, by_source = raw.get("files", {}), raw.get("cuda_cflags_by_source", {})
    if not isinstance(files, Mapping) or not all(isinstance(v, str) for v in files.values()):
        raise InvalidSpecError(f"{where}: files must be a table of texts")
    if not isinstance(by_source, Mapping) or not all(
        isinstance(v, list) and all(isinstance(f, str) for f in v) for v in by_source.values()
    ):
        raise InvalidSpecError(f"{where}: cuda_cflags_by_source must be a table of lists of strings")


def _import_kernel(ref: str, base: Path, where: str, what: str = "kernel") -> Any:
    if not isinstance(ref, str) or ":" not in ref:
        raise InvalidSpecError(
            f"{where}: {what} must read 'file.py:name' or 'package.module:name', got {ref!r}"
        )
    target, _, name = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            file = (base / target).resolve()
            if not file.is_file():
                raise InvalidSpecError(f"{where}: no file {file}")
            # Import it by its module's name: a file in a package (folders with __init__.py) as
            # a module of that package, the folder that holds the package added to sys.path, so
            # that workers that must import it by name find it the same way, and it is the
            # module a server imports (its kernels' keys name its module).
            folder, dotted = file.parent, [file.stem]
            while (folder / "__init__.py").is_file() and folder.parent != folder:
                dotted.insert(0, folder.name)
                folder = folder.parent
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            module = importlib.import_module(".".join(dotted))
            if Path(getattr(module, "__file__", "") or "").resolve() != file:
                raise InvalidSpecError(
                    f"{where}: importing {'.'.join(dotted)!r} found {module.__file__}, not {file}; rename "
                    "the file"
                )
        else:
            module = importlib.import_module(target)
    except InvalidSpecError:
        raise
    except ModuleNotFoundError as exc:
        hint = (
            f"; {target!r} is imported by name: put the folder that holds it on PYTHONPATH, or name "
            f'the file ("path/to/file.py:{what}", relative to the manifest)'
        )
        raise InvalidSpecError(f"{where}: cannot import {target!r}: {exc}{hint}") from exc
    except Exception as exc:
        raise InvalidSpecError(f"{where}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise InvalidSpecError(f"{where}: {target!r} has no {name!r}") from None


# --- writing: the record of what a pool served -------------------------------------------------

# The comment on a record's entry compiled after the server said it was ready.
AFTER_READY_NOTE = "# asked for after the server said it was ready: the warm-up missed it"
# A kernel's key is a comment above its fields; a module's, a field of its own (warm-up checks it).
_KEY_LINE = re.compile(r'^(?:# key: |key = ")([0-9a-f]{64})"?$', re.MULTILINE)


class Recorder:
    """Appends what a pool served to a manifest: Triton requests, JIT libraries' modules.
    Blocking (the pool calls it from a thread). Several processes may share one file (the
    ranks of a server under ``acompile run --record``): each append holds a lock on the file,
    and an entry another process recorded meanwhile is not recorded twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: set[str] | None = None
        self._read_to = 0  # how far this process has read the file for keys
        self._identity: tuple[int, int] | None = None  # the file read (device, inode)

    def recorded(self, key: str) -> bool:
        """Whether ``key`` is known to be recorded already (cheap, without reading the file: a
        False may still turn out recorded when ``add`` reads it)."""
        seen = self._seen
        return seen is not None and key in seen

    def add(self, request: Any, spec: Any, *, after_ready: bool = False) -> bool:
        """Record one Triton request (once per key); False if it cannot be written as a
        manifest entry, or was recorded already. ``after_ready``: it was compiled after the
        server said it was ready (a comment says so: what the warm-up missed)."""
        text = _manifest_entry(request, spec)
        if text is not None and after_ready:
            text = text.replace("\n[[kernel]]\n", f"\n[[kernel]]\n{AFTER_READY_NOTE}\n", 1)
        return text is not None and self._append(request.key, text)

    def add_module(self, key: str, library: str, fields: Mapping[str, Any]) -> bool:
        """Record one JIT library's module (``[[<library>]]``, once per direct key); False if
        it was recorded already. ``ValueError`` where a field is not plain data."""
        lines = [f'\n[[{library}]]\nkey = "{key}"\n']
        for name, value in fields.items():
            text = _toml(value)
            if text is None:
                raise ValueError(f"a {library} record's field {name} is not plain data")
            lines.append(f"{name} = {text}\n")
        return self._append(key, "".join(lines))

    def _append(self, key: str, text: str) -> bool:
        """Append one entry under the file's lock. ``OSError`` where the record cannot be
        written: the file is not this user's regular file (a link, another user's), its lock
        stays held by another process past ``_LOCK_WAIT``, the disk refuses the entry (which is
        then cut off again: a record is never left with half an entry)."""
        with self._lock:
            if self._seen is not None and key in self._seen and self._same_file():
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o600)
            with open(fd, "ab+") as f:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    raise PermissionError(f"{self.path} is not a file of this user's")
                if not _files.lock_within(fd, _LOCK_WAIT):  # released as the file closes
                    raise TimeoutError(f"{self.path} stayed locked by another process for {_LOCK_WAIT:g} s")
                size = f.seek(0, os.SEEK_END)
                identity = (info.st_dev, info.st_ino)
                if self._seen is None or size < self._read_to or identity != self._identity:
                    # A first look, or another file now (replaced, cut short): read it whole.
                    self._seen, self._read_to, self._identity = set(), 0, identity
                if size > self._read_to:  # what others appended since: their keys too
                    f.seek(self._read_to)
                    self._seen.update(_KEY_LINE.findall(f.read().decode("utf-8", "replace")))
                    self._read_to = size
                if key in self._seen:
                    return False
                if size == 0:
                    text = (
                        "# What an acompile pool served; replay with `acompile warmup <this file>`,\n"
                        "# the folders its kernels are imported from on PYTHONPATH (as the server had).\n"
                    ) + text
                try:
                    f.write(text.encode("utf-8"))
                    f.flush()
                except BaseException:
                    with contextlib.suppress(OSError):
                        f.truncate(size)
                    raise
                self._read_to = f.tell()
                self._seen.add(key)
            return True

    def _same_file(self) -> bool:
        """Whether the record is still the file last read, and no shorter (not replaced by an
        edited copy, not cut): what was read of it still holds."""
        try:
            info = os.lstat(self.path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self._identity and info.st_size >= self._read_to


# How long an append waits for another process's lock on the record.
_LOCK_WAIT = 10.0


def _toml_string(value: str) -> str:
    # JSON's escapes are TOML's, but for a character outside the BMP (JSON writes it as a
    # surrogate pair, which TOML refuses) and DEL (TOML wants it escaped).
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        items = [_toml(v) for v in value]
        return None if any(i is None for i in items) else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, dict):
        pairs: list[str] = []
        for k, v in value.items():
            text = _toml(v)
            if text is None:
                return None
            pairs.append(f"{_toml_string(str(k))} = {text}")
        return "{ " + ", ".join(pairs) + " }"
    return None


def _manifest_entry(request: Any, spec: Any) -> str | None:
    fn = request.fn
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__", "__mp_main__") or module.startswith("acompile_source_"):
        file = getattr(getattr(fn, "fn", None), "__code__", None)
        if file is None or not os.path.isfile(file.co_filename):
            logger.debug("cannot record %s: it is not defined in a file", request.name)
            return None
        where = f"{os.path.abspath(file.co_filename)}:{fn.__name__}"
    else:
        where = f"{module}:{fn.__qualname__}"
    runtime = {k: v for k, v in request.signature.items() if v != "constexpr"}
    fields = {
        "kernel": where,
        "signature": runtime,
        "constexprs": dict(spec.constexprs or {}),
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "targets": [str(request.target)],
    }
    if spec.options:
        fields["options"] = dict(spec.options)
    lines = [f"\n[[kernel]]\n# key: {request.key}\n"]
    for name, value in fields.items():
        text = _toml(value)
        if text is None:
            logger.debug("cannot record %s: %s is not plain data", request.name, name)
            return None
        lines.append(f"{name} = {text}\n")
    return "".join(lines)


__all__ = ["Recorder", "load_manifest"]
