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
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_memo: dict[str, dict[str, str]] = {}


def _identity() -> str:
    import triton

    root = os.path.dirname(triton.__file__)
    parts: list[Any] = [triton.__version__, root]
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


def _remembered(memo_dir: Path, what: str, compute: Any) -> dict[str, str]:
    with _lock:
        name = f"{what}-{_identity()}.json"
        if name in _memo:
            return _memo[name]
        path = memo_dir / name
        value: dict[str, str]
        try:
            value = json.loads(path.read_text())
            if not isinstance(value, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):
            value = compute()
            try:
                memo_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
                tmp.write_text(json.dumps(value))
                os.replace(tmp, path)
            except OSError:
                pass  # a read-only cache folder: compute again next time
        _memo[name] = value
        return value


def toolchain(memo_dir: Path) -> dict[str, str]:
    return _remembered(memo_dir, "toolchain", _compute_toolchain)


def triton_key(memo_dir: Path) -> str:
    def compute() -> dict[str, str]:
        from triton.runtime.cache import triton_key as key

        return {"triton_key": key()}

    return _remembered(memo_dir, "triton-key", compute)["triton_key"]


def _compute_toolchain() -> dict[str, str]:
    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    try:
        files = importlib.metadata.distribution("triton").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    recorded = sorted(
        (str(f), f.hash.value)
        for f in files
        if f.hash is not None and str(f).startswith(("triton/_C/", "triton/compiler/", "triton/backends/"))
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
