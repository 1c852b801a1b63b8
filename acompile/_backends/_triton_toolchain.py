"""What identifies Triton's compilers, computed once per cache folder and remembered there.

Two figures, both blocking (call them from a thread):

- ``toolchain(memo_dir)``: Triton's release, a digest of its compiler files as its wheel's RECORD
  lists them, and the versions of the ptxas binaries it runs. It goes into every cache key.
- ``triton_key(memo_dir)``: Triton's own ``triton_key()``, a SHA-256 of all of libtriton.so and of
  its compiler sources (~0.5 s of CPU, paid by every process that compiles). Workers are handed
  the remembered value instead of each paying for it, as Triton's own preload pool does; Triton's
  kernel hashes stay exactly what ``triton.compile`` computes.

Both are remembered in ``memo_dir`` under a name derived from the installation's identity (Triton's
version, and the size and modification time of libtriton.so and of the ptxas binaries), so an
upgrade in place computes them afresh. Paths enter that identity but never a cache key.

The memo files are read with ``read_state`` (``acompile._cache._layout``): every pool reads them
as it starts, under this module's lock, on a thread that cannot be abandoned, so a FIFO in their
place must not block that read, nor a huge file swell it. A memo that is refused, does not parse
or lacks a field is computed again (said once per process) and replaced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acompile._backends._memos import on_forget
from acompile._cache import MAX_MEMO_BYTES, read_state, write_state

logger = logging.getLogger("acompile")

_lock = threading.Lock()
_memo: dict[str, dict[str, str]] = {}


# Raised whenever what a memo holds is computed differently (2: Triton's language files digested).
_MEMO_FORMAT = 2


def _identity() -> str:
    import triton

    root = os.path.dirname(triton.__file__)
    # _MEMO_FORMAT: a memo computed by another rule (other files digested) is not this one's.
    parts: list[Any] = [_MEMO_FORMAT, triton.__version__, root]
    candidates = [os.path.join(root, "_C", name) for name in sorted(os.listdir(os.path.join(root, "_C")))]
    candidates += [os.path.join(root, "backends", "nvidia", "bin", n) for n in ("ptxas", "ptxas-blackwell")]
    for name in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        if os.environ.get(name):
            candidates.append(os.environ[name])
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        parts.append([path, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _remembered(
    memo_dir: Path, what: str, compute: Callable[[], dict[str, str]], fields: tuple[str, ...]
) -> dict[str, str]:
    """The memo ``what`` of this installation: read from ``memo_dir``, else computed and written
    there. A remembered value must be an object of text holding ``fields``."""
    with _lock:
        name = f"{what}-{_identity()}.json"
        if name in _memo:
            return _memo[name]
        path = memo_dir / name
        value = _read_memo(path, fields)
        if value is None:
            value = compute()
            try:
                write_state(path, json.dumps(value).encode())
            except OSError:
                pass  # a read-only cache folder: compute again next time
        _memo[name] = value
        return value


def _read_memo(path: Path, fields: tuple[str, ...]) -> dict[str, str] | None:
    """The memo at ``path``, or None where it is absent or not a memo (said, then replaced)."""
    try:
        data = read_state(path, MAX_MEMO_BYTES)
        if data is None:
            return None
        value = json.loads(data)
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError("not an object of text")
        missing = [field for field in fields if field not in value]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except (OSError, ValueError, RecursionError) as exc:
        logger.warning("the toolchain memo %s is ignored (%s): computed again, and replaced", path, exc)
        return None
    return value


@on_forget
def forget() -> None:
    """Forget the figures this process read or computed: the next call reads its memo file, or
    computes them, again (see ``_triton.forget``)."""
    with _lock:
        _memo.clear()


def toolchain(memo_dir: Path) -> dict[str, str]:
    return _remembered(memo_dir, "toolchain", _compute_toolchain, ("triton", "triton_files"))


def triton_key(memo_dir: Path) -> str:
    def compute() -> dict[str, str]:
        from triton.runtime.cache import triton_key as key

        return {"triton_key": key()}

    return _remembered(memo_dir, "triton-key", compute, ("triton_key",))["triton_key"]


# The files of Triton's RECORD whose hashes make ``triton_files``: those Triton's own
# ``triton_key()`` reads (its library, compiler drivers, backends, the language front end that
# becomes TTIR, and the cache module itself), so that two builds of one release never share a key.
_COMPILER_FILES = (
    "triton/_C/",
    "triton/compiler/",
    "triton/backends/",
    "triton/language/",
    "triton/runtime/cache.py",
)


def _compute_toolchain() -> dict[str, str]:
    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    try:
        files = importlib.metadata.distribution("triton").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    recorded = sorted(
        (str(f), f.hash.value) for f in files if f.hash is not None and str(f).startswith(_COMPILER_FILES)
    )
    if recorded:
        for name, value in recorded:
            digest.update(f"{name}={value}\n".encode())
    else:
        # A source or editable install has no RECORD: hash the libraries themselves.
        digest.update(_folder_digest(os.path.join(os.path.dirname(triton.__file__), "_C")).encode())
    tools = {"triton": triton.__version__, "triton_files": digest.hexdigest()}
    try:
        from triton import knobs

        for name in ("ptxas", "ptxas_blackwell"):
            tool = getattr(knobs.nvidia, name, None)
            if tool is not None:
                tools[name] = str(tool.version)
    except Exception as exc:  # no CUDA tools bundled: a HIP build, say
        tools["ptxas"] = f"unavailable ({type(exc).__name__})"
    return tools


def _folder_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
    return digest.hexdigest()
