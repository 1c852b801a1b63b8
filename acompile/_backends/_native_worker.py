"""The worker's half of the CUDA C++ and C++ backends: NVRTC, nvcc and the system C++ compiler.

Each compile returns cache-entry bytes; a rejected source raises ``CUDACompileError`` or
``CppCompileError`` with the compiler's log and the source line its first error points at.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from acompile._backends._logs import save_if_long
from acompile._cache._entry import Entry
from acompile._errors import CppCompileError, CUDACompileError, bounded

_scratch = ""

# "file.cu(12): error: ..." (NVRTC, nvcc) and "file.cpp:12:5: error: ..." (gcc, clang)
_ERROR_LINE = re.compile(r"(?:\((\d+)\):?|:(\d+):\d+:)\s*(?:fatal )?error")


def setup(config: dict[str, Any]) -> None:
    global _scratch
    _scratch = config.get("scratch_dir") or tempfile.gettempdir()


def preload(config: dict[str, Any]) -> None:
    from cuda.bindings import nvrtc  # noqa: F401 - the import is the preload


def compile(payload: dict[str, Any]) -> bytes:
    kind = payload["kind"]
    if kind == "nvrtc":
        blobs, meta = _nvrtc(payload)
    else:
        blobs, meta = _tool(payload)
    meta["key_parts"] = payload.get("key_parts", {})
    return Entry(
        key=payload["key"], backend=payload["backend"], name=payload["name"], blobs=blobs, meta=meta
    ).encode()


_DISK_FULL = "No space left on device"


def _error_class(payload: dict[str, Any]) -> type[CppCompileError | CUDACompileError]:
    return CppCompileError if payload["backend"] == "cpp" else CUDACompileError


def _fail(payload: dict[str, Any], log: str, what: str) -> Exception:
    match = _ERROR_LINE.search(log)
    line = int(match.group(1) or match.group(2)) if match else None
    source_lines = payload["source"].splitlines()
    source_line = source_lines[line - 1].strip() if line and 0 < line <= len(source_lines) else ""
    where = f" at line {line}: {source_line}" if line else ""
    first = next((ln.strip() for ln in log.splitlines() if "error" in ln), log.strip()[:500])
    full = ""
    if _DISK_FULL in log:
        full = "the disk is full: "
    path, saved = save_if_long(log, payload.get("log_dir"), payload["name"], payload["key"])
    err = _error_class(payload)(
        f"{full}{what} rejected {payload['name']!r}{where}\n{first[:2000]}" + (f"\n{saved}" if saved else ""),
        kernel=payload["name"],
        backend=payload["backend"],
        log=log,
    )
    err.line, err.source_line, err.log_path = line, source_line, path
    return err


def _disk_error(payload: dict[str, Any], exc: OSError, doing: str) -> Exception:
    """A compile that cannot write its files: a compile error that says why, not a bare OSError."""
    why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else f"{type(exc).__name__}: {exc}"
    return _error_class(payload)(
        f"cannot compile {payload['name']!r}: {why} ({doing} in {_scratch})",
        kernel=payload["name"],
        backend=payload["backend"],
        log=str(exc),
    )


def _nvrtc(payload: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, Any]]:
    from cuda.bindings import nvrtc

    def check(result: Any) -> Any:
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {err.name}")
        return result[1] if len(result) == 2 else result[1:]

    err, prog = nvrtc.nvrtcCreateProgram(
        payload["source"].encode(), f"{payload['name']}.cu".encode(), 0, [], []
    )
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC cannot create a program: {err.name}")
    try:
        for expr in payload["name_expressions"]:
            check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        arch = payload["arch"]
        target = f"--gpu-architecture={'sm' if payload['output'] == 'cubin' else 'compute'}_{arch}"
        options = [target.encode(), *(o.encode() for o in payload["options"])]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        size = check(nvrtc.nvrtcGetProgramLogSize(prog))
        log_buf = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, log_buf))
        log = log_buf.rstrip(b"\0 ").decode("utf-8", "replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise _fail(payload, log, "NVRTC")
        if payload["output"] == "cubin":
            size = check(nvrtc.nvrtcGetCUBINSize(prog))
            binary = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, binary))
        else:
            size = check(nvrtc.nvrtcGetPTXSize(prog))
            binary = b" " * size
            check(nvrtc.nvrtcGetPTX(prog, binary))
            binary = binary.rstrip(b"\0")
        lowered = {
            e: check(nvrtc.nvrtcGetLoweredName(prog, e.encode())).decode()
            for e in payload["name_expressions"]
        }
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    # Warnings travel with the result; a flood of them is cut as an error's log is.
    return {payload["output"]: binary, "log": bounded(log).encode()}, {"lowered": lowered, "arch": arch}


def _tool(payload: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, Any]]:
    doing = "making a work folder"
    folder = None
    try:
        os.makedirs(_scratch, exist_ok=True)
        folder = tempfile.mkdtemp(dir=_scratch)
        suffix = ".cu" if payload["kind"] == "nvcc" else ".cpp"
        source = os.path.join(folder, payload["name"] + suffix)
        doing = "writing the source"
        with open(source, "w", encoding="utf-8") as f:
            f.write(payload["source"])
        output = os.path.join(folder, "out." + payload["output"])
        command = [*payload["command"], "-o", output, source]
        doing = f"running {command[0]}"
        # Bytes, decoded leniently: a compiler may quote the source's bytes in any encoding.
        done = subprocess.run(command, capture_output=True, cwd=folder)
        log = (done.stdout + done.stderr).decode("utf-8", "replace").replace(folder + os.sep, "")
        if done.returncode != 0:
            raise _fail(payload, log, "nvcc" if payload["kind"] == "nvcc" else "the C++ compiler")
        doing = "reading the compiler's output"
        with open(output, "rb") as f:
            binary = f.read()
    except OSError as exc:
        raise _disk_error(payload, exc, doing) from None
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return {payload["output"]: binary, "log": bounded(log).encode()}, {"arch": payload.get("arch")}
