"""Shipping a Triton kernel to a worker without importing the module that defines it.

Kernel libraries import torch (seconds, hundreds of MB) at module level; a worker that imports
such a module to find one JIT function pays that in every worker. Instead the parent describes the
kernel: the source of every JIT function it reaches, and for each global name those functions use,
how to rebuild it (a module to import, an importable object, or a plain value). The worker rebuilds
the functions from source with their original file name and line numbers, so Triton computes the
same cache key and writes the same debug locations into the PTX. The worker checks that key; if it
differs (or anything cannot be described), it falls back to importing the module by name, and a
script's ``__main__`` is re-run under ``__mp_main__`` as multiprocessing does.

Both halves live here: ``describe()`` runs in the parent, ``materialize()`` in the worker.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import linecache
import pickle
import runpy
import sys
import textwrap
import types
from collections import OrderedDict
from typing import Any

_FUTURE_FLAGS = 0
for _name in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _name).compiler_flag

# triton.jit's arguments, and the JITFunction attribute that keeps each.
_JIT_ATTRS = {
    "do_not_specialize": "do_not_specialize",
    "do_not_specialize_on_alignment": "do_not_specialize_on_alignment",
    "debug": "debug",
    "noinline": "noinline",
    "repr": "_repr",
    "launch_metadata": "launch_metadata",
}


class NotShippable(Exception):
    """The kernel needs something a description cannot carry; import its module instead."""


def _jit_types() -> tuple[type, ...]:
    from triton.runtime.jit import JITFunction

    base = getattr(sys.modules["triton.runtime.jit"], "JITCallable", JITFunction)
    return (base,)


def _import_ref(value: Any) -> tuple[str, str] | None:
    """(module, qualname) when importing that gives back this very object."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if module in ("__main__", "__mp_main__"):
        return None
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return (module, qualname) if found is value else None


def import_ref(fn: Any) -> dict[str, Any]:
    """A description that imports the kernel's module in the worker."""
    module = fn.__module__
    main_path = None
    if module == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
    try:
        cache_key = fn.cache_key  # what this process keyed; checked against the worker's import
    except Exception:
        cache_key = None
    return {
        "kind": "import",
        "module": module,
        "qualname": fn.__qualname__,
        "main_path": main_path,
        "cache_key": cache_key,
    }


def describe(fn: Any) -> dict[str, Any]:
    """Describe a JIT function and everything it reaches, for ``materialize()`` in a worker."""
    try:
        return _Describer().run(fn)
    except NotShippable:
        return import_ref(fn)


class _Describer:
    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.seen: dict[int, tuple[str, str]] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.jit_types = _jit_types()

    def run(self, fn: Any) -> dict[str, Any]:
        root = self.add_function(fn)
        return {
            "kind": "source",
            "root": root,
            "functions": self.functions,
            "namespaces": self.namespaces,
            "cache_key": fn.cache_key,
            "fallback": import_ref(fn),
        }

    def add_function(self, fn: Any) -> tuple[str, str]:
        if id(fn) in self.seen:
            return self.seen[id(fn)]
        py = fn.fn
        code = py.__code__
        space = f"{fn.__module__}:{code.co_filename}"
        ref = (space, py.__name__)
        self.seen[id(fn)] = ref
        raw = "".join(fn.raw_src)
        jit_args = {arg: getattr(fn, attr) for arg, attr in _JIT_ATTRS.items() if hasattr(fn, attr)}
        try:
            pickle.dumps(jit_args)
        except Exception as exc:  # a custom repr or launch_metadata hook defined in a script
            raise NotShippable(f"{py.__name__}'s JIT arguments") from exc
        self.functions.append(
            {
                "space": space,
                "module": fn.__module__,
                "name": py.__name__,
                "file": code.co_filename,
                "line": fn.starting_line_number,
                "source": raw,
                "flags": code.co_flags & _FUTURE_FLAGS,
                "jit": jit_args,
            }
        )
        namespace = self.namespaces.setdefault(space, {})
        scope = dict(py.__globals__)
        if py.__closure__:
            scope.update(zip(code.co_freevars, (c.cell_contents for c in py.__closure__), strict=True))
        tree = ast.parse(textwrap.dedent(raw))
        node = tree.body[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Its decorators never run in the worker (``_exec_text`` makes them inert) and are
            # no part of Triton's key (its source starts at ``def``): the names they use, such
            # as an autotuner's configs built by a function of the module, are not described.
            # Described, they would have each worker import that module (a kernel library's
            # imports torch: seconds of every worker's first job) for nothing.
            node.decorator_list = []
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for name in sorted(names):
            if name not in scope or name in namespace:
                continue
            namespace[name] = self.describe_value(scope[name])
        return ref

    def describe_value(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, self.jit_types) and hasattr(value, "fn"):
            return ("fn", *self.add_function(value))
        if isinstance(value, types.ModuleType):
            if value.__name__ in ("__main__", "__mp_main__"):
                raise NotShippable(value.__name__)
            return ("module", value.__name__)
        ref = _import_ref(value)
        if ref is not None:
            return ("import", *ref)
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise NotShippable(repr(value)) from exc
        return ("value", value)


# --- the worker's half --------------------------------------------------------------------------

# The kernels this worker has built, most recent last. Bounded: a long-lived worker may be sent
# any number of distinct source strings; a kernel dropped here is built again if asked for.
MATERIALIZED_SIZE = 256
_materialized: OrderedDict[str, Any] = OrderedDict()


def _remember(memo: str, fn: Any) -> None:
    _materialized[memo] = fn
    while len(_materialized) > MATERIALIZED_SIZE:
        old, _ = _materialized.popitem(last=False)
        if old.startswith("<acompile-source-"):
            # Registered by run_source_text for this text only (and again if it comes back).
            linecache.cache.pop(old.rsplit(":", 1)[0], None)


def materialize(ref: dict[str, Any]) -> Any:
    """The JIT function a description names, built once per worker and remembered."""
    if ref["kind"] == "import":
        return _import(ref)
    if ref["kind"] == "text":
        return _from_text(ref)
    memo = ref["cache_key"] + repr(ref["root"])
    fn = _materialized.get(memo)
    if fn is None:
        fn = _build(ref)
        if fn.cache_key != ref["cache_key"]:
            # The rebuilt kernel is not the one the parent keyed: import the real one instead.
            fn = _import(ref["fallback"])
        _remember(memo, fn)
    else:
        _materialized.move_to_end(memo)
    return fn


def _import(ref: dict[str, Any]) -> Any:
    module_name = ref["module"]
    if module_name == "__main__":
        module = sys.modules.get("__mp_main__")
        if module is None:
            if not ref.get("main_path"):
                raise ImportError("the kernel is defined in an interactive __main__ that has no file")
            _drop_stand_ins(also="__main__")
            # As multiprocessing does: re-run the script under another name, so its
            # `if __name__ == "__main__":` block stays asleep.
            namespace = runpy.run_path(ref["main_path"], run_name="__mp_main__")
            module = types.ModuleType("__mp_main__")
            module.__dict__.update(namespace)
            sys.modules["__mp_main__"] = module
    else:
        if module_name not in sys.modules:
            _drop_stand_ins()
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    expected = ref.get("cache_key")
    if expected is not None and getattr(obj, "cache_key", expected) != expected:
        # Compiled, it would be kept under the key of a kernel it is not.
        raise ImportError(
            f"{ref['qualname']} as module {module_name!r} defines it in the worker is not the kernel "
            "the calling process has (Triton's keys differ): its source, or a global it uses, "
            "changed after the calling process imported it. Restart that process, or pass the "
            "kernel's source text with kernel_name="
        )
    return obj


def _from_text(ref: dict[str, Any]) -> Any:
    memo = ref["filename"] + ":" + ref["name"]
    fn = _materialized.get(memo)
    if fn is None:
        fn = run_source_text(ref["text"], ref["filename"])[ref["name"]]
        _remember(memo, fn)
    else:
        _materialized.move_to_end(memo)
    return fn


def run_source_text(text: str, filename: str) -> dict[str, Any]:
    """Execute kernel source text as a module named after ``filename``; returns its namespace.

    The text is registered with linecache first: Triton reads a JIT function's source through
    ``inspect``, which finds it there.
    """
    lines = text.splitlines(keepends=True)
    linecache.cache[filename] = (len(text), None, lines, filename)
    namespace: dict[str, Any] = {"__name__": f"acompile_source_{abs(hash(filename)):x}", "__file__": filename}
    exec(compile(text, filename, "exec", dont_inherit=True), namespace)
    return namespace


def _build(ref: dict[str, Any]) -> Any:
    import triton

    spaces: dict[str, dict[str, Any]] = {}
    for fn_desc in ref["functions"]:
        spaces.setdefault(
            fn_desc["space"],
            {"__name__": fn_desc["module"], "__file__": fn_desc["file"], "__builtins__": __builtins__},
        )
    # Values first: annotations and defaults are evaluated when a `def` runs.
    for space, names in ref["namespaces"].items():
        namespace = spaces.setdefault(space, {"__builtins__": __builtins__})
        for name, desc in names.items():
            kind = desc[0]
            if kind == "module":
                namespace[name] = importlib.import_module(desc[1])
            elif kind == "import":
                namespace[name] = _import({"module": desc[1], "qualname": desc[2]})
            elif kind == "value":
                namespace[name] = desc[1]
    _register_lines(ref["functions"])
    built: dict[tuple[str, str], Any] = {}
    for fn_desc in ref["functions"]:
        namespace = spaces[fn_desc["space"]]
        namespace["__acompile_keep__"] = _keep
        code = compile(
            _exec_text(fn_desc["source"], fn_desc["line"]),
            fn_desc["file"],
            "exec",
            flags=fn_desc["flags"],
            dont_inherit=True,
        )
        exec(code, namespace)
        jit_fn = triton.jit(namespace[fn_desc["name"]], **fn_desc["jit"])
        namespace[fn_desc["name"]] = jit_fn
        built[(fn_desc["space"], fn_desc["name"])] = jit_fn
    # Names that refer to JIT functions, possibly under another name or in another namespace.
    for space, names in ref["namespaces"].items():
        for name, desc in names.items():
            if desc[0] == "fn":
                spaces[space][name] = built[(desc[1], desc[2])]
    return built[tuple(ref["root"])]


def _keep(fn: Any) -> Any:
    return fn


def _exec_text(raw: str, line: int) -> str:
    """The function's source, placed on its original lines, with its decorators made inert.

    Python gives a decorated function the line of its first decorator, and Triton hashes that
    line; keeping one placeholder decorator there keeps the line. The JIT wrapping itself is
    re-applied with the original arguments. An indented def (a kernel defined inside a function
    or class) gets an ``if 1:`` block on the line above it.
    """
    lines = raw.splitlines(keepends=True)
    tree = ast.parse(textwrap.dedent(raw))
    node = tree.body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    def_line = node.lineno  # 1-based, in raw's coordinates
    indent = lines[def_line - 1][: len(lines[def_line - 1]) - len(lines[def_line - 1].lstrip())]
    if node.decorator_list:
        lines[0] = indent + "@__acompile_keep__\n"
        for i in range(1, def_line - 1):
            lines[i] = "\n"
    if line < 2 and indent:
        raise ValueError("an indented kernel on the first line of its file")
    pad = "\n" * (line - 2) + ("if 1:\n" if indent else "\n") if line >= 2 else ""
    return pad + "".join(lines)


# The files whose lines ``_register_lines`` put in linecache, by the module that defines them.
# Such an entry holds the shipped functions' lines only, blanks elsewhere, and stands in for the
# file: a later import of the module itself (a kernel that cannot travel, or whose rebuilt key
# differs) would have Triton read its other functions' source there, and fail ("@jit functions
# should be defined in a Python file"). ``_drop_stand_ins`` removes them before such an import.
_stand_ins: dict[str, set[str]] = {}


def _drop_stand_ins(also: str | None = None) -> None:
    """Before a real import: the stand-ins of every module not imported yet (the import may reach
    any of them, directly or through its own imports), and of ``also``."""
    for module_name in [m for m in _stand_ins if m not in sys.modules or m == also]:
        for filename in _stand_ins.pop(module_name):
            entry = linecache.cache.get(filename)
            if entry is not None and len(entry) == 4 and entry[1] is None:  # still ours
                del linecache.cache[filename]


def _register_lines(functions: list[dict[str, Any]]) -> None:
    """Put each function's lines where its file had them, for ``inspect.getsourcelines``."""
    by_file: dict[str, list[dict[str, Any]]] = {}
    for fn_desc in functions:
        by_file.setdefault(fn_desc["file"], []).append(fn_desc)
        _stand_ins.setdefault(fn_desc["module"], set()).add(fn_desc["file"])
    for filename, descs in by_file.items():
        lines: list[str] = []
        existing: Any = linecache.cache.get(filename)
        if existing is not None and len(existing) == 4 and existing[1] is None:
            lines = list(existing[2])
        for fn_desc in descs:
            src_lines = fn_desc["source"].splitlines(keepends=True)
            start = fn_desc["line"] - 1
            if len(lines) < start + len(src_lines):
                lines.extend("\n" for _ in range(start + len(src_lines) - len(lines)))
            lines[start : start + len(src_lines)] = src_lines
        # mtime None: linecache never checks this entry against the disk (which may not exist).
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
