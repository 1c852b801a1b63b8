"""The worker's half of the CUDA C++ and C++ backends: NVRTC, nvcc and the system C++ compiler.

Each compile returns cache-entry bytes; a rejected source raises ``CUDACompileError`` or
``CppCompileError`` with the compiler's log and the source line its first error points at.

The key is computed before anything compiles, so it cannot hold what the headers a source
includes hold. Each compile therefore records, in the entry's metadata, every file the compiler
read besides the source (``meta["deps"]``: path, size, mtime in ns, SHA-256), and the parent
uses an entry from a cache tier only where they are all still the same (``_native``): the way
ccache's direct mode works. gcc/clang and nvcc say what they read (``-MD -MF``); NVRTC cannot,
so its includes are resolved here as it resolves them, erring on the side of listing more.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from acompile._backends._logs import save_if_long
from acompile._cache import Entry
from acompile._errors import CppCompileError, CUDACompileError, bounded

if TYPE_CHECKING:
    from acompile._workers import WorkerConfig

_scratch = ""

# "file.cu(12): error: ..." (NVRTC, nvcc) and "file.cpp:12:5: error: ..." (gcc, clang)
_ERROR_LINE = re.compile(r"(?:\((\d+)\):?|:(\d+):\d+:)\s*(?:fatal )?error")


def setup(config: WorkerConfig) -> None:
    global _scratch
    _scratch = config.get("scratch_dir") or tempfile.gettempdir()


def preload(config: WorkerConfig) -> None:
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


# --- the files a compile read ----------------------------------------------------------------------


def file_digest(path: str, size: int) -> str | None:
    """The SHA-256 (hex) of the regular file at ``path``, which ``size`` says how long it is;
    None where it is not a regular file of that size (then it is not the file recorded).

    Opened without blocking and checked before it is read: a path swapped for a FIFO or a
    device is never read, and a file that grew is not read past what it should hold."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        digest = hashlib.sha256()
        read = 0
        while read <= size:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            read += len(chunk)
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest() if read == size else None


def record_dependencies(paths: Iterable[str], *, started_ns: int) -> dict[str, Any]:
    """The metadata that says which files a compile read: ``{"deps": [[path, size, mtime_ns,
    sha256], ...]}``, plus ``"deps_unknown"`` (why) where what the compiler read is not known.

    A file changed after the compile began (``started_ns``, wall-clock) may have been read
    before the change or after it: the binary matches one of two contents, and only one can be
    recorded. Such an entry serves the request that made it, and says its headers are unknown,
    so that no later request takes it from a cache tier (ccache refuses the same race). The
    change time counts too: a file renamed over a header keeps its own, older, mtime.
    """
    deps: list[list[Any]] = []
    unknown: str | None = None
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            before = os.stat(path)
            digest = file_digest(path, before.st_size)
            after = os.stat(path)
        except OSError as exc:
            unknown = unknown or f"{path} could not be read after the compile ({exc.strerror})"
            continue
        if digest is None or (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            unknown = unknown or f"{path} changed while it was being compiled"
            continue
        if max(after.st_mtime_ns, after.st_ctime_ns) >= started_ns:
            unknown = unknown or f"{path} changed while it was being compiled"
        deps.append([path, after.st_size, after.st_mtime_ns, digest])
    meta: dict[str, Any] = {"deps": deps}
    if unknown is not None:
        meta["deps_unknown"] = unknown
    return meta


def depfile_paths(text: str) -> list[str]:
    """The prerequisites of the first rule of a Make dependency file (``-MD -MF``), unescaped:
    ``\\ `` is a space, ``\\#`` a ``#``, ``$$`` a ``$``; a backslash at a line's end
    continues it. gcc writes ``target: deps``, nvcc ``target : deps``."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    rule = text.split("\n", 1)[0]
    words: list[str] = []
    word: list[str] = []
    i = 0
    while i < len(rule):
        char = rule[i]
        if char == "\\" and i + 1 < len(rule) and rule[i + 1] in " \t#":
            word.append(rule[i + 1])
            i += 2
            continue
        if char == "$" and rule[i + 1 : i + 2] == "$":
            word.append("$")
            i += 2
            continue
        if char in " \t":
            if word:
                words.append("".join(word))
                word = []
        else:
            word.append(char)
        i += 1
    if word:
        words.append("".join(word))
    # Past the target: the first word that ends the target list (":"), or is only ":".
    for at, found in enumerate(words):
        if found.endswith(":"):
            return words[at + 1 :]
    return []


# "#include "a.h"", "#include <a.h>", "#include_next <a.h>", "#include NAME" (the rest of the line)
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include(?:_next)?\b[ \t]*(.*)$", re.MULTILINE)
# "#define NAME body" (object-like) and "#define NAME(args) body" (function-like: the "(")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(\(?)[ \t]*(.*)$", re.MULTILINE)
# A string literal (never expanded), or an identifier that is not the tail of a number or name.
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|(?<!\w)[A-Za-z_]\w*')
_COMMENT = re.compile(r"//.*|/\*.*?\*/")
# How many spellings one computed include may have (every definition of every macro in it).
_MAX_SPELLINGS = 256


def _spellings(
    text: str, defines: dict[str, set[str]], function_like: set[str], depth: int = 0
) -> set[str] | None:
    """Every text ``text`` can become when each object-like macro in it is replaced by any of
    its definitions (in any file seen: ``#if`` is not evaluated), or None where that cannot be
    told without a preprocessor: a function-like macro, ``#`` or ``##``, too many spellings."""
    if "#" in text or depth > 16:
        return None
    spellings = {""}
    at = 0
    for token in _TOKEN.finditer(text):
        name = token.group()
        choices = {name}
        if name in function_like:
            return None
        if not name.startswith('"') and name in defines:
            choices = set()
            for body in defines[name]:
                expanded = _spellings(body, defines, function_like, depth + 1)
                if expanded is None:
                    return None
                choices |= expanded
        between = text[at : token.start()]
        spellings = {done + between + choice for done in spellings for choice in choices}
        if len(spellings) > _MAX_SPELLINGS:
            return None
        at = token.end()
    return {done + text[at:] for done in spellings}


def _first_part(name: str) -> str:
    """``"cuda"`` for ``"cuda/std/cstdint"``, ``"/"`` for an absolute name."""
    return "/" if name.startswith("/") else name.split("/", 1)[0]


def _header_name(spelling: str) -> str | None:
    """``a.h`` for ``"a.h"`` or ``<a.h>``; None for anything else."""
    spelling = spelling.strip()
    close = {'"': '"', "<": ">"}.get(spelling[:1])
    if close is None or not spelling.endswith(close) or len(spelling) < 3:
        return None
    return spelling[1:-1].strip()


def nvrtc_includes(source: str, options: Sequence[str], cwd: str) -> tuple[list[str], str | None]:
    """The files an NVRTC compile of ``source`` may read, and why that is not known (or None).

    NVRTC has no ``-MD`` and no way to say which headers it opened, so its ``#include`` lines
    are followed here, through the folders NVRTC searches: for the program (named relatively,
    so in the process's working folder, which NVRTC searches for quoted includes), the
    ``-I``/``--include-path`` folders, and the folder of each header found. This errs on the
    side of more: ``#if`` is not evaluated (a header behind a false condition is listed too),
    and a name found in several folders is listed in each, so the list holds every file NVRTC
    can have read; extra entries cost a ``stat`` on each hit, never a wrong binary. Headers
    NVRTC carries inside itself are no files: its version, in the key, covers them.

    An include named by a macro (``#include NAME``, as Thrust's are) is followed through every
    definition of every object-like macro in it, found in any file seen or in a ``-D`` option.
    One that needs more of a preprocessor (a function-like macro, ``#``, ``##``, a name defined
    nowhere) leaves the headers unknown: the entry serves its own request, and is compiled again
    for the next.
    """
    folders: list[str] = [cwd]
    # Header names to look for, by their first part ("cuda" for "cuda/std/cstdint"; "/" for an
    # absolute one): a folder is searched only for the names whose first part it holds.
    names: dict[str, set[str]] = {}
    defines: dict[str, set[str]] = {}
    function_like: set[str] = set()
    value_of = iter(options)
    for option in value_of:
        for flag, kind in (
            ("--include-path", "folder"),
            ("--pre-include", "file"),
            ("--define-macro", "define"),
            ("-include", "file"),
            ("-isystem", "folder"),
            ("-I", "folder"),
            ("-D", "define"),
        ):
            if option == flag:
                value = next(value_of, "")
            elif option.startswith(flag + "="):
                value = option[len(flag) + 1 :]
            elif flag in ("-I", "-D") and option.startswith(flag):
                value = option[2:]
            else:
                continue
            if not value:
                break
            if kind == "folder":
                folders.append(os.path.join(cwd, value))
            elif kind == "file":
                names.setdefault(_first_part(value), set()).add(value)
            else:
                name, _, body = value.partition("=")
                if "(" in name:
                    function_like.add(name.split("(", 1)[0])
                else:
                    defines.setdefault(name, set()).add(body if _ else "1")
            break

    computed: set[str] = set()
    found: dict[tuple[int, int], str] = {}  # (device, inode): a file reached by two paths is one
    paths: list[str] = []
    tried: dict[str, set[str]] = {}  # by folder, the names looked for there
    listings: dict[str, set[str]] = {}
    texts = [source]
    while texts:
        for text in texts:
            # Lines continued with a backslash are one line to the preprocessor.
            text = text.replace("\\\r\n", "").replace("\\\n", "")
            for match in _DEFINE.finditer(text):
                name, paren, body = match.groups()
                if paren:
                    function_like.add(name)
                else:
                    defines.setdefault(name, set()).add(_COMMENT.sub("", body).strip())
            for match in _INCLUDE.finditer(text):
                rest = _COMMENT.sub("", match.group(1)).strip()
                literal = _header_name(rest)
                if literal is not None:
                    names.setdefault(_first_part(literal), set()).add(literal)
                elif rest:
                    computed.add(rest)
        texts = []
        # The macros seen so far name headers too (a later round may add definitions).
        for rest in computed:
            for spelling in _spellings(rest, defines, function_like) or ():
                literal = _header_name(spelling)
                if literal is not None:
                    names.setdefault(_first_part(literal), set()).add(literal)
        # Every name in every folder: new folders (those of headers just found) and new names
        # are tried on the next round, until a round finds no new file. A name whose first part
        # is not in the folder's listing is not there: no stat for it (most are not).
        for folder in list(folders):
            listing = listings.get(folder)
            if listing is None:
                try:
                    listing = listings[folder] = {*os.listdir(folder), "/", ".", ".."}
                except OSError:
                    listing = listings[folder] = {"/"}
            done = tried.setdefault(folder, set())
            for first in [first for first in names if first in listing]:
                for name in list(names[first]):
                    if name in done:
                        continue
                    done.add(name)
                    path = os.path.join(folder, name)
                    try:
                        info = os.stat(path)
                        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) in found:
                            continue
                        with open(path, "rb") as f:
                            texts.append(f.read().decode("utf-8", "replace"))
                    except (OSError, ValueError):
                        continue
                    found[(info.st_dev, info.st_ino)] = path
                    paths.append(path)
                    if os.path.dirname(path) not in folders:
                        folders.append(os.path.dirname(path))

    # With every definition in: an include that still names no header cannot be followed.
    for rest in sorted(computed):
        spellings = _spellings(rest, defines, function_like)
        if spellings is None or any(_header_name(s) is None for s in spellings):
            return (
                paths,
                f"#include {bounded(rest, 80)} names its header in a way only a preprocessor can follow",
            )
    return paths, None


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
        started = time.time_ns()
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
    paths, unknown = nvrtc_includes(payload["source"], payload["options"], os.getcwd())
    meta = {"lowered": lowered, "arch": arch, **record_dependencies(paths, started_ns=started)}
    if unknown is not None:
        meta.setdefault("deps_unknown", unknown)
    # Warnings travel with the result; a flood of them is cut as an error's log is.
    return {payload["output"]: binary, "log": bounded(log).encode()}, meta


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
        # The compiler lists every file it read (system headers too: -MD, not -MMD) as a Make
        # rule; ours come last, so that they win over any the options hold.
        depfile = os.path.join(folder, "out.d")
        deps_flags = ["-MD", "-MF", depfile, "-MT", "out"]
        command = [*payload["command"], *deps_flags, "-o", output, source]
        doing = f"running {command[0]}"
        started = time.time_ns()
        # Bytes, decoded leniently: a compiler may quote the source's bytes in any encoding.
        done = subprocess.run(command, capture_output=True, cwd=folder)
        log = (done.stdout + done.stderr).decode("utf-8", "replace").replace(folder + os.sep, "")
        if done.returncode != 0:
            raise _fail(payload, log, "nvcc" if payload["kind"] == "nvcc" else "the C++ compiler")
        doing = "reading the compiler's output"
        with open(output, "rb") as f:
            binary = f.read()
        meta = {"arch": payload.get("arch"), **_tool_dependencies(depfile, folder, started)}
    except OSError as exc:
        raise _disk_error(payload, exc, doing) from None
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return {payload["output"]: binary, "log": bounded(log).encode()}, meta


def _tool_dependencies(depfile: str, folder: str, started: int) -> dict[str, Any]:
    """``record_dependencies`` for what the compiler's dependency file lists, less the source
    and anything else in the work folder (it is removed next: nothing there is an input a
    later request could change)."""
    try:
        with open(depfile, encoding="utf-8", errors="surrogateescape") as f:
            listed = depfile_paths(f.read())
    except FileNotFoundError:
        return {"deps": [], "deps_unknown": "the compiler wrote no dependency list (-MD -MF)"}
    inside = os.path.join(folder, "")
    # Relative paths are relative to where the compiler ran: the work folder.
    paths = [os.path.join(folder, path) for path in listed]
    return record_dependencies((p for p in paths if not p.startswith(inside)), started_ns=started)
