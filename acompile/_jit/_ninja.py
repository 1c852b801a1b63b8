"""A JIT library's ninja build, read through ninja itself, and the keys that name its result.

FlashInfer and torch's C++/CUDA extensions both write a ``build.ninja`` into a folder and run
ninja there. What decides the binary is what ninja would run: the commands (compilers, flags,
sources) and the files the compilers read (every header included). Neither the folder's path,
the virtual environment's, nor ``$HOME`` does, nor any mtime. So a build is keyed in two steps,
as ccache's direct mode keys a compile:

* **The direct key** (``direct_parts``): the commands ninja would run, in order, with each path
  under a named root (the build folder, the environment's site-packages, Python's prefix, the
  CUDA toolkit, the home folder: ``Build.roots``) written relative to that root, each file a
  command names (a source) by its content, each compiler by what it says of its version, and
  the library's own parts (its version, the arch list).
* **The full key** (``full_parts``): the direct key and every file the compilers read, by its
  root-relative path and content, from the list a first build recorded (``ninja -t deps``: the
  compilers' own dependency output, which both libraries' build files ask for). A second
  machine reads that list (the build's *manifest*, stored under the direct key), hashes the
  files it names in its own folders, and looks the output up: no preprocessor runs. A header that
  changed gives another full key: a miss, a build, and a new manifest.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from acompile._outputs import cpu_identity

# The key's format: a change to how keys are made changes this.
FORMAT = 1
# ninja's own queries are quick (milliseconds); this bounds a hung one.
_QUERY_TIMEOUT = 60.0


class Unrecordable(Exception):
    """A build a warm-up record cannot hold (a path outside every root, a library's callback
    that writes part of the build file): it is served, not recorded."""


class BuildUnreadable(Exception):
    """The build file cannot be read through ninja (no ninja, a file it rejects): the build is
    left to the library."""


@dataclass(frozen=True)
class Build:
    """One build a JIT library asked ninja for.

    Attributes:
        library: the library's name in acompile (``"flashinfer"``, ``"cpp_extension"``).
        name: the module's name (traces, errors, counts).
        folder: where ninja runs (its working folder).
        build_file: the build file, as ninja is given it (relative to ``folder`` or absolute).
        parts: the library's own key parts (its version, the arch list it builds for, ...).
        roots: (name, folder) pairs whose paths differ between machines but not what is built
            in them; a path inside one is keyed relative to it.
        env: the environment the library's ninja would run with (the job runs with it).
        ninja: the ninja program the library would run.
        jobs: ninja's ``-j`` as the library would give it (its ``MAX_JOBS``), or None.
        describe: how a warm-up remakes this build elsewhere: returns the library's fields of a
            warm-up record entry, every path in them rooted (``rooted_text``), with ``"embed"``
            the roots whose files the entry carries (generated sources: the warm-up box has no
            generator run to make them); raises ``Unrecordable``. None: not recorded.
    """

    library: str
    name: str
    folder: str
    build_file: str
    parts: Mapping[str, Any]
    roots: tuple[tuple[str, str], ...]
    env: Mapping[str, str] = field(repr=False, default_factory=dict)
    ninja: str = "ninja"
    jobs: int | None = None
    describe: Callable[[], dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def ninja_command(self, *args: str) -> list[str]:
        return [self.ninja, "-C", self.folder, "-f", self.build_file, *args]


@dataclass(frozen=True)
class Graph:
    """What ninja would do: its commands in order, every output, and the products (outputs no
    other step reads: what the library loads), all as absolute paths."""

    commands: tuple[str, ...]
    outputs: frozenset[str]
    products: tuple[str, ...]


def standard_roots(build_folder: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """The roots every build has: its own folder, the ones a library adds, this Python's
    environment and prefix, the CUDA toolkit, the home folder, the temporary folder. Longest
    first (one may hold another); each by its real path."""
    import sysconfig
    import tempfile

    named: list[tuple[str, str]] = [("build", build_folder), *extra]
    # Two names: on some systems the two differ (lib, lib64), and a name must say one folder.
    for scheme, name in (("purelib", "site"), ("platlib", "platsite")):
        with contextlib.suppress(KeyError):
            named.append((name, sysconfig.get_paths()[scheme]))
    import sys

    named += [("prefix", sys.prefix), ("python", sys.base_prefix)]
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if not cuda and nvcc:
        cuda = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if cuda:
        named.append(("cuda", cuda))
    named += [("home", os.path.expanduser("~")), ("tmp", tempfile.gettempdir())]
    seen: dict[str, str] = {}
    for name, path in named:
        if path and os.path.isabs(path):
            seen.setdefault(os.path.realpath(path), name)
    # A root that is "/" (a home of "/", a prefix of "/usr" is fine) would swallow every path.
    roots = [(name, path) for path, name in seen.items() if path != os.sep]
    return tuple(sorted(roots, key=lambda r: len(r[1]), reverse=True))


def package_roots(*names: str) -> tuple[tuple[str, str], ...]:
    """A root for each installed package of ``names`` (its folder, named ``pkg_<name>``), for
    the packages whose headers a library's builds include: the same files at another install
    path give the same key. A package that is not installed gives none."""
    import importlib.util

    roots = []
    for name in names:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                roots.append((f"pkg_{name}", os.path.realpath(next(iter(spec.submodule_search_locations)))))
    return tuple(roots)


def package_versions(*distributions: str) -> dict[str, str]:
    """The installed versions of ``distributions`` (a key part: headers a compile reads without
    the compiler listing them, from ``-isystem`` folders, are these packages' own)."""
    from importlib import metadata

    versions = {}
    for name in distributions:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def read_graph(build: Build) -> Graph:
    """The build as ninja sees it (ninja expands its own variables). Raises ``BuildUnreadable``."""
    commands = _ninja_out(build, "-t", "commands").splitlines()
    outputs: set[str] = set()
    for line in _ninja_out(build, "-t", "targets", "all").splitlines():
        path, sep, _rule = line.rpartition(": ")
        if sep and path:
            outputs.add(_absolute(build.folder, path))
    products = []
    # "targets depth 1": each root target (no step reads it) at the start of a line, the
    # inputs of its step indented below it.
    for line in _ninja_out(build, "-t", "targets", "depth", "1").splitlines():
        if line and not line[0].isspace():
            path, sep, _rule = line.rpartition(": ")
            if sep and path:
                products.append(_absolute(build.folder, path))
    if not products:
        raise BuildUnreadable(f"{build.build_file} names nothing to build")
    return Graph(tuple(commands), frozenset(outputs), tuple(sorted(products)))


def read_deps(build: Build, graph: Graph) -> list[str]:
    """Every file the compilers read, as ninja recorded it from their dependency output, as
    absolute paths; outputs of the build itself left out.

    Raises ``BuildUnreadable`` where a compile step recorded none (a build file without
    ``deps = gcc``, nvcc told not to write them): its key would not hold its headers, and a
    changed header would be served the old module."""
    text = _ninja_out(build, "-t", "deps")
    files: set[str] = set()
    recorded: set[str] = set()
    for line in text.splitlines():
        if line.startswith((" ", "\t")):
            path = line.strip()
            if path:
                files.add(_absolute(build.folder, path))
        elif line.strip():
            target, _, counts = line.partition(": #deps ")
            if counts and not counts.startswith("0,"):
                recorded.add(_absolute(build.folder, target))
    # Every step whose output another step reads (an object the link takes) compiled something.
    for step in sorted(graph.outputs - set(graph.products)):
        if step.endswith((".o", ".obj")) and step not in recorded:
            raise BuildUnreadable(f"ninja recorded no headers for {os.path.basename(step)}")
    return sorted(files - graph.outputs)


def direct_parts(build: Build, graph: Graph) -> dict[str, Any]:
    """What the direct key is made of (see the module's docstring), and the static archives a
    link takes, and the CPU where a command compiles for the one that builds (``-march=native``)."""
    commands = []
    compilers: set[str] = set()
    archives: list[list[str]] = []
    for command in graph.commands:
        try:
            tokens = shlex.split(command)
        except ValueError as exc:
            raise BuildUnreadable(f"a command ninja would run cannot be read: {exc}") from exc
        if not tokens:
            continue
        compilers.update(_compilers(tokens))
        commands.append([_token(t, build, graph) for t in tokens])
        archives += _static_libraries(tokens, build)
    parts = {
        "jit": build.library,
        "library": dict(build.parts),
        "commands": commands,
        "compilers": sorted(_identity(c) for c in compilers),
        "environment": _keyed_environment(build),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "format": FORMAT,
    }
    if archives:
        parts["static_libraries"] = archives
    if any("native" in token for command in commands for token in command):
        # -march=native and its like compile for the CPU that builds: another CPU needs its own.
        parts["cpu"] = cpu_identity()
    return parts


def _static_libraries(tokens: Sequence[str], build: Build) -> list[list[str]]:
    """The static archives a link takes by ``-lNAME`` from its ``-L`` folders (their code is
    copied into the module: a changed archive is another module). Shared libraries are not
    keyed: they are found again where the module is loaded (a GPU replica's driver ``libcuda``,
    not the stub a box without a GPU links)."""
    folders = [t[2:] for t in tokens if t.startswith("-L") and len(t) > 2]
    folders += [b for a, b in itertools.pairwise(tokens) if a == "-L"]
    found = []
    for token in tokens:
        if not token.startswith("-l") or len(token) <= 2 or token.startswith("-l:"):
            continue
        name = token[2:]
        for folder in folders:
            shared = os.path.join(folder, f"lib{name}.so")
            static = os.path.join(folder, f"lib{name}.a")
            if os.path.exists(shared):
                break  # the linker takes the shared one first
            if os.path.isfile(static):
                with contextlib.suppress(OSError):
                    found.append([relative_name(static, build.roots), file_digest(static)])
                break
    return found


# What the compilers read from the environment that changes what they make: nvcc's extra flags
# and host compiler. Not the search paths (CPATH, LIBRARY_PATH ...): a box without a GPU that
# warms a fleet up has its own (the headers of wheels, a libcuda stub), and what they change is
# keyed already: the headers found through them are in the manifest by content, and the CUDA
# runtime a module links follows the nvcc release, which is in the key.
_KEYED_ENVIRONMENT = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


def _keyed_environment(build: Build) -> dict[str, str]:
    keyed = {}
    for name in _KEYED_ENVIRONMENT:
        value = build.env.get(name)
        if value:
            # A host compiler named by path: the compiler's identity is what counts.
            keyed[name] = _identity(value) if name == "NVCC_CCBIN" else value
    return keyed


def full_parts(direct_key: str, build: Build, deps: Sequence[str]) -> dict[str, Any] | None:
    """The full key's parts from a manifest's list of files (root-relative names, see
    ``relative_name``), each hashed where it lies on this machine; None where one is missing or
    unreadable (then the build runs, and records a new list)."""
    files = []
    for name in deps:
        path = resolve_name(name, build.roots)
        if path is None:
            return None
        try:
            files.append([name, file_digest(path)])
        except OSError:
            return None
    return {"direct": direct_key, "files": files, "format": FORMAT}


def relative_name(path: str, roots: Iterable[tuple[str, str]]) -> str:
    """``<root>/rest`` for a path inside a root, else the real path itself."""
    real = os.path.realpath(path)
    for name, folder in roots:
        if real == folder:
            return f"<{name}>"
        if real.startswith(folder + os.sep):
            return f"<{name}>{real[len(folder) :]}"
    return real


_ROOTED = re.compile(r"^<([a-z_]+)>(/.*)?$")
# A folder in a text starts a word (or follows a short flag: -I/path) and ends one.
_START = r"(?:(?<![\w.~/-])|(?<=^-[A-Za-z]))"
_END = r"(?=/|$|[\s:;,=\"'])"
_ROOT_TOKEN = re.compile(_START + r"<([a-z_]+)>" + _END)


def rooted_text(text: str, roots: Iterable[tuple[str, str]]) -> str:
    """``text`` (a path, a flag holding paths) with each root's folder written ``<root>``,
    longest root first; where a root's folder is followed by a separator or ends a word."""
    for name, folder in roots:
        # A replacement string, its backslashes escaped: a name is [a-z_], but be exact.
        text = re.sub(_START + re.escape(folder) + _END, f"<{name}>".replace("\\", "\\\\"), text)
    return text


def looks_rooted(text: str) -> bool:
    """Whether ``text`` holds what ``unrooted_text`` would take for a root (``<home>``): such a
    text cannot be told from a rooted one."""
    return _ROOT_TOKEN.search(text) is not None


def unrooted_text(text: str, roots: Iterable[tuple[str, str]]) -> str:
    """``rooted_text`` undone with this machine's roots; ``ValueError`` naming a root it lacks."""
    folders = dict(roots)

    def folder(match: re.Match[str]) -> str:
        found = folders.get(match.group(1))
        if found is None:
            raise ValueError(f"{text!r} names the folder <{match.group(1)}>, which this machine has not")
        return found

    return _ROOT_TOKEN.sub(folder, text)


def resolve_name(name: str, roots: Iterable[tuple[str, str]]) -> str | None:
    """The path a ``relative_name`` names on this machine; None for a root it does not have."""
    match = _ROOTED.match(name)
    if match is None:
        return name if os.path.isabs(name) else None
    folders = dict(roots)
    folder = folders.get(match.group(1))
    if folder is None:
        return None
    rest = match.group(2) or ""
    if ".." in rest.split("/"):
        return None  # a manifest never names a path that climbs out of its root
    return folder + rest


# A header larger than this is not one: such a name is not keyed (a miss, and a build).
_MAX_KEYED_FILE = 256 << 20


def file_digest(path: str) -> str:
    """SHA-256 of a regular file's content, memoized by (path, size, mtime, inode): a process
    that keys several builds reads each header once. Raises ``OSError`` for anything else (a
    FIFO or a device would block or never end) and for a file over 256 MiB."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} is not a regular file")
    if info.st_size > _MAX_KEYED_FILE:
        raise OSError(f"{path} is over {_MAX_KEYED_FILE >> 20} MiB")
    return _digest(path, info.st_size, info.st_mtime_ns, info.st_ino)


@functools.lru_cache(maxsize=65536)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    h = hashlib.sha256()
    # Non-blocking: a file swapped for a FIFO since the stat above fails instead of hanging.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    with open(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _ninja_out(build: Build, *args: str) -> str:
    try:
        done = subprocess.run(
            build.ninja_command(*args),
            capture_output=True,
            text=True,
            timeout=_QUERY_TIMEOUT,
            check=False,
            env=dict(build.env) or None,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildUnreadable(f"ninja cannot read {build.build_file}: {exc}") from exc
    if done.returncode != 0:
        raise BuildUnreadable(
            f"ninja cannot read {build.build_file}: {(done.stderr or done.stdout).strip()[-500:]}"
        )
    return done.stdout


def _absolute(folder: str, path: str) -> str:
    return os.path.realpath(os.path.join(folder, path))


# Flags whose value is glued to them (-I/path, --flag=/path, -Wl,-rpath,/path).
_GLUED = re.compile(
    r"^(-I|-L|-isystem|-iquote|-idirafter|-include|-o|--?[A-Za-z][\w-]*=|-Wl,(?:[^,]*,)*)(/.+)$"
)


def _token(token: str, build: Build, graph: Graph) -> str:
    """One token of a command, without what ties it to this machine: an output by its name in
    the build folder, an input file by its content, another path relative to its root."""
    prefix, path = "", token
    if not os.path.isabs(token):
        match = _GLUED.match(token)
        if match is None:
            relative = os.path.join(build.folder, token)
            # A relative path ninja's working folder holds: an input by its content.
            if "/" in token or "." in token:
                real = os.path.realpath(relative)
                output = real in graph.outputs or (real.endswith(".d") and real[:-2] in graph.outputs)
                if not output and os.path.isfile(real):
                    return f"<file {file_digest(real)}>"
            return token
        prefix, path = match.group(1), match.group(2)
    real = os.path.realpath(path)
    if real in graph.outputs or (real.endswith(".d") and real[:-2] in graph.outputs):
        # An output, or a compiler's dependency file beside one: named, never read.
        return prefix + relative_name(real, build.roots)
    if os.path.isfile(real):
        return f"{prefix}<file {file_digest(real)}>"
    return prefix + relative_name(real, build.roots)


# Programs that are compilers or linkers: their version is part of the key.
_COMPILERS = re.compile(r"(?:^|[-/])(?:nvcc|c\+\+|g\+\+|gcc|cc|clang\+\+|clang|ld|hipcc)(?:-[\d.]+)?$")


def _compilers(tokens: Sequence[str]) -> set[str]:
    """The programs a command runs that compile or link: its first program (past a launcher
    such as ccache), nvcc's host compiler (``-ccbin``), and the system C++ compiler under nvcc."""
    found: set[str] = set()
    for token in tokens:
        if token.startswith("-"):
            break
        if _COMPILERS.search(token):
            found.add(token)
    for flag, value in itertools.pairwise(tokens):
        if flag in ("-ccbin", "--compiler-bindir"):
            found.add(value)
    for token in tokens:
        if token.startswith("--compiler-bindir="):
            found.add(token.split("=", 1)[1])
    if any(t.endswith("nvcc") for t in found):
        found.update(("gcc", "g++"))  # nvcc's default host compilers, from PATH
    return found


@functools.cache
def _identity(program: str) -> str:
    """What a compiler says of itself (``--version``), once per process; its name where it
    says nothing."""
    path = shutil.which(program) or program
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return os.path.basename(program)
    # The first lines name the release; later ones are licence text, and the program's own path
    # (which differs between machines) appears in some.
    text = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return "\n".join(line for line in text[:4] if path not in line) or os.path.basename(program)
