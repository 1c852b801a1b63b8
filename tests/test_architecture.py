"""The package's import graph keeps the shape docs/architecture.md draws.

Every module of ``acompile`` is parsed (nothing is imported), and every import of the package is
an edge: those at the top of a module, those inside functions (they run later, but they run) and
those under ``if TYPE_CHECKING:`` (a type checker follows them, and a circle there is a circle a
reader has to untangle). ``from acompile._cache import TierChain`` is an edge to the package's face
(``acompile/_cache/__init__.py``), whose own imports are its edges; ``from acompile._cache import
_chain`` is an edge to the submodule. Names a module loads from a string (``importlib``, a table
of module names) are no edge: that is how a registry stays cheap and below its users. A face's
table (``_NAMES``, read by ``acompile._lazy.face``) is the exception: each module it names is an
edge of the face, since an eager face imports them all with the package.

Three rules, each its own test:

* no import circle;
* no import runs back up a layer (``LAYERS``, the table docs/architecture.md shows);
* outside a package, the package's names come from its face, never from its private modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = "acompile"

# The layers, bottom to top. A module may import modules of lower layers, and modules of its own
# layer only within its own package (base modules among themselves). An entry names a module or
# a package (then every module inside it). docs/architecture.md shows the same table.
BASE = (
    "acompile._errors",
    "acompile._version",
    "acompile._lazy",
    "acompile._files",
    "acompile._outputs",
    "acompile._linux",
    "acompile._sizing",
    "acompile._targets",
    "acompile._trust",
    "acompile._pacing",
    "acompile._observe",
)
LAYERS: tuple[tuple[str, ...], ...] = (
    BASE,
    ("acompile._cache",),
    ("acompile._workers",),
    ("acompile._backends",),
    ("acompile._farm",),
    ("acompile._torch",),
    ("acompile._jit",),
    ("acompile._autotune", "acompile._progressive", "acompile._manifest"),
    ("acompile._compiler",),
    ("acompile.inductor",),
    ("acompile",),
    ("acompile.testing", "acompile.metrics"),
    ("acompile.asgi",),
    ("acompile._bench",),
    ("acompile.cli",),
    ("acompile.__main__",),
)


@dataclass(frozen=True)
class Edge:
    """One import of a module of the package by another."""

    source: str
    target: str
    path: Path
    line: int
    # "", "TYPE_CHECKING" or "in a function": where the import statement sits.
    where: str

    def __str__(self) -> str:
        at = f"{self.path.relative_to(ROOT)}:{self.line}"
        return f"{self.source} -> {self.target}  ({at}{', ' + self.where if self.where else ''})"


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name; a package by its face's name."""
    modules: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _is_face(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _package_of(module: str) -> str:
    """The package a module belongs to: itself for a face, else its parent."""
    return module if _is_face(module) else module.rpartition(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main_block(test: ast.expr) -> bool:
    """``__name__ == "__main__"``: what runs only when the module is a program (``python -m``)."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of a module, with where it sits, but those of its
    ``if __name__ == "__main__":`` block: that block runs only when the module is run as a
    program (``python -m``), never when another module imports it, so its imports are the
    program's, at the top like ``acompile/__main__.py``'s, and not the module's."""

    Statement = tuple[ast.Import | ast.ImportFrom, str]

    def walk(nodes: Iterable[ast.AST], where: str, top: bool) -> Iterator[Statement]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, where
            elif isinstance(node, ast.If) and top and _is_main_block(node.test):
                continue
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "TYPE_CHECKING", False)
                yield from walk(node.orelse, where, top)
            else:
                # Anything else holds its imports as they are: a lazy face's
                # ``if TYPE_CHECKING or _lazy.eager(__name__):`` runs them at run time too.
                function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                inner = where or ("in a function" if function else "")
                yield from walk(ast.iter_child_nodes(node), inner, False)

    yield from walk(tree.body, "", True)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _target(name: str) -> str | None:
    """The module an import of ``name`` runs: the longest prefix that is a module."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _edges() -> tuple[list[Edge], list[str]]:
    """The graph's edges, and the imports of the package that name no module of it."""
    edges: list[Edge] = []
    unresolved: list[str] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, where in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _resolve(module, node)
                # A name that is a submodule imports the submodule; any other name comes from
                # the module itself (a package's face).
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                    for alias in node.names
                ]
            for name in dict.fromkeys(names):
                if name != PACKAGE and not name.startswith(PACKAGE + "."):
                    continue
                target = _target(name)
                if target is None:
                    unresolved.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
                elif target != module:
                    edges.append(Edge(module, target, path, node.lineno, where))
    return edges, unresolved


def _face_table(path: Path) -> dict[str, tuple[str, str]] | None:
    """A face's ``_NAMES`` table (name -> (submodule, name there)), None for a module without one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_NAMES" and node.value is not None:
            table = ast.literal_eval(node.value)
            return {
                name: (where, name) if isinstance(where, str) else tuple(where)
                for name, where in table.items()
            }
    return None


def _face_edges() -> list[Edge]:
    """The modules each face's table names: an eager face imports them with the package."""
    edges = []
    for module, path in MODULES.items():
        table = _face_table(path) if _is_face(module) else None
        for submodule, _ in dict.fromkeys((table or {}).values()):
            edges.append(Edge(module, f"{module}.{submodule}", path, 1, "face table"))
    return edges


EDGES, UNRESOLVED = _edges()
EDGES += _face_edges()


def _strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    out: dict[str, list[str]] = {node: [] for node in nodes}
    for edge in edges:
        out[edge.source].append(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(out[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(out[successor])))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _inside(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its modules (``acompile`` stands for its face
    alone here: every module is inside it)."""
    return module == package or (package != PACKAGE and module.startswith(package + "."))


def _layer(module: str) -> int | None:
    """The index in ``LAYERS`` of the entry that holds ``module`` (the longest one that does)."""
    holding = [
        (len(entry), number)
        for number, layer in enumerate(LAYERS)
        for entry in layer
        if _inside(module, entry)
    ]
    return max(holding)[1] if holding else None


def _runs_back_up(edge: Edge) -> bool:
    source, target = edge.source, edge.target
    source_layer, target_layer = _layer(source), _layer(target)
    assert source_layer is not None and target_layer is not None, edge
    if target_layer > source_layer:
        return True
    if target_layer < source_layer:
        return False
    if source_layer == 0:
        return False
    # The same layer: only within one package. A module importing its own package's face (not
    # a submodule of it) reaches up to what the face gathers, above itself.
    source_package = _package_of(source)
    if _is_face(target) and target == source_package and source != target:
        return True
    same_package = source_package == _package_of(target) and source_package != PACKAGE
    return not (same_package or source == target)


def test_every_module_has_a_layer() -> None:
    missing = [module for module in MODULES if _layer(module) is None]
    assert not missing, "modules in no layer (add them to LAYERS and docs/architecture.md):\n" + "\n".join(
        missing
    )


def test_every_import_of_the_package_names_one_of_its_modules() -> None:
    assert not UNRESOLVED, "imports of modules that do not exist:\n" + "\n".join(UNRESOLVED)


def test_no_import_circle() -> None:
    components = _strongly_connected(list(MODULES), EDGES)
    lines = []
    for component in components:
        members = set(component)
        lines.append("circle: " + ", ".join(component))
        lines += [f"    {edge}" for edge in EDGES if edge.source in members and edge.target in members]
    assert not components, f"{len(components)} import circles:\n" + "\n".join(lines)


def test_no_import_runs_back_up_a_layer() -> None:
    upward = [edge for edge in EDGES if _runs_back_up(edge)]
    assert not upward, f"{len(upward)} imports run back up a layer:\n" + "\n".join(map(str, upward))


def test_packages_are_reached_through_their_faces() -> None:
    # A package's private module imported from outside the package: its names should come from
    # the package's face. acompile's own top-level modules (the base) are not a package's.
    reach_ins = [
        edge
        for edge in EDGES
        if not _is_face(edge.target)
        and _package_of(edge.target) != PACKAGE
        and not _inside(edge.source, _package_of(edge.target))
    ]
    lines = "\n".join(map(str, reach_ins))
    assert not reach_ins, f"{len(reach_ins)} imports reach into another package's private modules:\n{lines}"


def test_the_layer_table_in_the_docs_is_this_one() -> None:
    # docs/architecture.md lists the layers bottom to top, one row each, in a table whose first
    # column is the layer's number: the same modules in the same order as LAYERS.
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| [^|]+ \| ([^|]+) \|", text, flags=re.MULTILINE)
    documented = [
        {name if name == PACKAGE else f"{PACKAGE}.{name}" for name in re.findall(r"`([^`]+)`", modules)}
        for _, modules in rows
    ]
    assert [int(number) for number, _ in rows] == list(range(len(rows))), rows
    assert documented == [set(layer) for layer in LAYERS], (
        "docs/architecture.md's layer table and LAYERS in this test disagree"
    )


def test_each_face_table_and_its_type_checking_imports_agree() -> None:
    # A face's names are loaded from its table at run time and read by type checkers from its
    # TYPE_CHECKING imports: a name in one and not the other, or from another module, is a face
    # that lies to one of them.
    faces = 0
    for module, path in MODULES.items():
        table = _face_table(path) if _is_face(module) else None
        if table is None:
            continue
        faces += 1
        typed: dict[str, tuple[str, str]] = {}
        for node, where in _imports(ast.parse(path.read_text())):
            if where == "TYPE_CHECKING" and isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for alias in node.names:
                    name = alias.asname or alias.name
                    if base == module:  # from acompile import inductor: the submodule itself
                        typed[name] = (alias.name, "")
                    else:
                        typed[name] = (base.removeprefix(module + "."), alias.name)
        assert typed == table, f"{module}: its _NAMES table and its TYPE_CHECKING imports differ"
    assert faces >= 5  # acompile, _cache, _workers, _backends, _torch


# --- how work reaches a worker ------------------------------------------------------------------

# Each executor class (and each helper that makes one), and the functions that may call it: an
# executor spec's ``open`` (or what it calls), never the pool. ``CompilePool`` chooses no
# executor: it opens its spec.
EXECUTOR_BUILDERS = {
    "WorkerPool": {
        ("acompile._workers._open", "local_workers"),
        # A farm's actor runs a pool of one on its node: the farm's executor's workers.
        ("acompile._farm._actor", "start"),
    },
    "local_workers": {
        ("acompile._workers._open", "open"),  # LocalWorkers.open
        ("acompile._workers._open", "fallback_or_local"),
        ("acompile._farm._remote", "make_local"),  # a lost farm's fallback, in open_farm
        ("acompile._torch._hostpool", "local"),  # a lost host pool's, in HostPool.open
    },
    "fallback_or_local": {
        ("acompile._farm._remote", "open_farm"),
        ("acompile._torch._hostpool", "open"),  # no host pool to be had
    },
    "SplitExecutor": {("acompile._workers._open", "open")},
    "RemoteExecutor": {("acompile._farm._remote", "connect")},
    "FarmExecutor": {("acompile._farm._executor", "connect")},
    "HostPoolExecutor": {("acompile._torch._hostpool", "open")},
    # Tests' executor in front of another (acompile.testing.Interposed).
    "InterposedExecutor": {("acompile.testing", "open")},
}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """The names a module imports under another name (``import X as Y``: Y -> X)."""
    return {
        alias.asname: alias.name.rpartition(".")[2]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if alias.asname
    }


def _calls(tree: ast.Module) -> Iterator[tuple[ast.Call, str]]:
    """Every call in a module, with the innermost function it is made in ("" at the top)."""

    def walk(node: ast.AST, function: str) -> Iterator[tuple[ast.Call, str]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                yield child, function
            yield from walk(child, inner)

    yield from walk(tree, "")


def _called_name(call: ast.Call, aliases: dict[str, str]) -> str:
    """The name a call calls, through the module's import aliases."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return aliases.get(name, name)


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


CALLS = {
    module: [(call, function, _called_name(call, _aliases(tree))) for call, function in _calls(tree)]
    for module, tree in ((module, _parsed(path)) for module, path in MODULES.items())
}


def test_only_an_executor_spec_builds_an_executor() -> None:
    # One place chooses how a job reaches a worker: the spec the pool was given (workers=...),
    # in its open(). An executor built anywhere else is a second route.
    found: dict[str, set[tuple[str, str]]] = {name: set() for name in EXECUTOR_BUILDERS}
    stray = []
    for module, calls in CALLS.items():
        for call, function, name in calls:
            if name in EXECUTOR_BUILDERS:
                found[name].add((module, function))
                if (module, function) not in EXECUTOR_BUILDERS[name]:
                    where = f"{MODULES[module].relative_to(ROOT)}:{call.lineno}"
                    stray.append(f"{where} {name}() in {function or 'the module'}")
    assert not stray, "executors built outside an executor spec's open():\n" + "\n".join(stray)
    # And each builder named here still builds it (a table that names what no longer happens
    # would let a new route through unseen).
    assert found == EXECUTOR_BUILDERS


def _names_settings(node: ast.expr) -> bool:
    """Whether an argument is the worker settings (a name or attribute that ends in settings)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lower().endswith("settings")


def test_the_pool_opens_its_executor_spec_in_one_call() -> None:
    # Any ``something.open(..., settings, ...)`` is a spec being opened, whatever holds it.
    opens = [
        (module, function, call.lineno)
        for module, calls in CALLS.items()
        for call, function, name in calls
        if name == "open" and isinstance(call.func, ast.Attribute) and any(map(_names_settings, call.args))
    ]
    where = {(module, function) for module, function, _ in opens}
    # CompilePool's entry opens its spec; a spec made of specs opens them in its own open (Split
    # its two halves, acompile.testing's Interposed the one it wraps); nothing else opens one.
    assert where == {
        ("acompile._compiler", "__aenter__"),
        ("acompile._workers._open", "open"),
        ("acompile.testing", "open"),
    }, opens
    assert sum(module == "acompile._compiler" for module, _, _ in opens) == 1


def test_worker_settings_cross_every_process_boundary_as_the_one_type() -> None:
    # The worker settings travel whole: to the local workers, into the farm's connection process
    # (its Setup, pickled on its pipe), to each Ray actor. No dict of settings, no **config.
    import inspect
    import pickle

    from acompile._farm._actor import FarmWorker
    from acompile._farm._executor import FarmExecutor, connect
    from acompile._farm._farm import Setup
    from acompile._workers import WorkerPool, WorkerSettings

    # Annotations are text here (``from __future__ import annotations``), the type's name.
    assert Setup.__annotations__["settings"] == "WorkerSettings"
    for function in (FarmWorker.__init__, FarmExecutor.__init__, WorkerPool.__init__, connect):
        parameters = inspect.signature(function).parameters.values()
        assert "WorkerSettings" in {p.annotation for p in parameters}, function
        assert inspect.Parameter.VAR_KEYWORD not in {p.kind for p in parameters}, function
    settings = WorkerSettings(target="cuda:90", backends=("triton",), nice=3, memory_limit=1 << 30)
    assert pickle.loads(pickle.dumps(settings)) == settings
    with pytest.raises(Exception, match=r"cannot assign"):
        settings.nice = 4  # type: ignore[misc]
    # No dict of settings left in the farm (the ActorConfig that was one): its TypedDicts are
    # the stats it reports.
    typed_dicts = {
        node.name
        for module, path in MODULES.items()
        if _inside(module, "acompile._farm")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "TypedDict" for b in node.bases)
    }
    assert typed_dicts == {"NodeStats", "FarmStats"}
    # And at run time: the farm's Setup and its actors take nothing else (a dict of the same
    # fields is refused, where a test of a farm would see it).
    with pytest.raises(TypeError, match="carries a WorkerSettings, got dict"):
        Setup(address="local", farm={}, memo_dir="/", sys_path=[], settings={"nice": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="started with a WorkerSettings, got dict"):
        FarmWorker({"nice": 0})  # type: ignore[arg-type]
