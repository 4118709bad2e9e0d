"""Reads the package's modules with `ast` and finds what `tests/test_architecture.py` forbids: import cycles,
module-level mutable state, modules using another module's private names, imports that break the layer rules
(`LAYER_IMPORTS`), and calls that set up the CPU backend outside an entry point; and in the tests, a test module
imported by another (helpers live in tests/support/). No import of the package."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIRS = ("packing", "offline_packing", "dataloader", "trainer")
# The layers and what each may import besides itself: the import graph. The application layer (`mmpack.cli`,
# `mmpack.demo`, `python -m mmpack`) sits on top of the four parts; `mmpack` itself (its `__init__`, which every
# module's import runs) imports nothing of the package.
LAYER_IMPORTS: dict[str, frozenset[str]] = {
    "root": frozenset(),
    "packing": frozenset(),
    "dataloader": frozenset({"packing"}),
    "offline_packing": frozenset({"packing", "dataloader"}),
    "trainer": frozenset({"packing", "dataloader"}),
    "app": frozenset({"packing", "dataloader", "offline_packing", "trainer"}),
}
# The one crossing of the graph by a module: a module (key) may import these modules of another layer (and the
# names in them), deferred inside a function only. The trainer's data module opens --online-packing's raw source
# with the offline job's online packing (its readers, length model and kernels); no other trainer module may.
DEFERRED_EXCEPTIONS: dict[str, frozenset[str]] = {
    "mmpack.trainer.data": frozenset({"mmpack.offline_packing.online"}),
}
# Third-party packages a layer never imports (outside `if TYPE_CHECKING:`): packing is pure, no torch.
FORBIDDEN_PACKAGES: dict[str, frozenset[str]] = {
    "packing": frozenset({"torch", "torchvision", "megatron", "transformer_engine", "transformers", "apex"}),
}
# `-m MODULE` in a string or a shell script: a module started by name.
RUN_MODULE = re.compile(r"(?:^|\s)-m\s+(mmpack(?:\.\w+)*)")
DOTTED_NAME = re.compile(r"mmpack(?:\.\w+)+(?::\w+)?")
# Calls that change the object they are called on (dicts, lists, sets, OrderedDicts).
MUTATORS = frozenset(
    {"clear", "update", "pop", "popitem", "setdefault", "append", "extend", "insert", "remove", "add"}
    | {"discard", "move_to_end", "__setitem__", "__delitem__"}
)
CACHES = frozenset({"lru_cache", "cache"})


@dataclass(frozen=True)
class Module:
    """One source file of the package: its dotted name, path and syntax tree."""

    name: str
    path: Path
    tree: ast.Module
    is_package: bool


def package_modules(root: Path, dirs: tuple[str, ...], namespace: str = "mmpack") -> dict[str, Module]:
    """Every .py file under `root/<dir>` as a module `namespace.<dir>...`."""
    out: dict[str, Module] = {}
    for top in dirs:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((namespace, *(parts[:-1] if is_package else parts)))
            out[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return out


def app_modules(root: Path) -> dict[str, Module]:
    """The application layer: every .py file of `root/mmpack` itself (`mmpack`, `mmpack.cli`, `mmpack.demo...`),
    not the four parts linked into it."""
    out: dict[str, Module] = {}
    for path in sorted((root / "mmpack").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if len(parts) > 2 and parts[1] in PACKAGE_DIRS:
            continue
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return out


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement names."""
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    base = base if mod.is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _import_targets(mod: Module, node: ast.AST) -> list[str]:
    """The dotted names an import statement names (``from a import b``: ``a`` and ``a.b``); none for other
    nodes."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _resolve(mod, node)
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return []


def _imports(mod: Module, node: ast.AST, names: dict[str, Module]) -> Iterator[str]:
    """The package modules an import statement loads."""
    for target in _import_targets(mod, node):
        parts = target.split(".")
        for i in range(len(parts), 0, -1):  # a.b.c loads a.b.c and its packages a.b and a
            name = ".".join(parts[:i])
            if name in names and not mod.name.startswith(name + "."):  # not the importer's own package
                yield name


def _never_imported(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` (annotations only) and `if __name__ == "__main__":` (run as a script, where the
    module is `__main__`, not itself) hold no import of the module's own."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return True
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"


def _module_level(body: list[ast.stmt], *, deferred: bool = False) -> Iterator[ast.stmt]:
    """The statements Python runs at import: the body, into if/try/with blocks but not the blocks of
    `_never_imported`; with `deferred`, the bodies of functions and classes too."""
    for node in body:
        if isinstance(node, ast.If):
            if not _never_imported(node.test):
                yield from _module_level(node.body, deferred=deferred)
            yield from _module_level(node.orelse, deferred=deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block, deferred=deferred)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _module_level(node.body, deferred=deferred)
        elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _module_level(node.body, deferred=True)
        else:
            yield node


def find_import_cycles(modules: dict[str, Module], *, deferred: bool = False) -> list[list[str]]:
    """Each group of modules whose import-time imports form a cycle (sorted names), sorted; with `deferred`,
    the imports inside functions count too."""
    graph = {
        name: {
            t
            for node in _module_level(m.tree.body, deferred=deferred)
            for t in _imports(m, node, modules)
            if t != name
        }
        for name, m in modules.items()
    }
    return sorted(sorted(c) for c in _strongly_connected(graph) if len(c) > 1)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                out.append(group)
    return out


def _module_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in _module_level(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def module_level_state(modules: dict[str, Module]) -> list[str]:
    """`path:line: what` for each piece of module-level state: a `global` statement, a module-level name
    changed inside a function, an lru_cache/cache on a function or method (a cache kept by the module)."""
    found = []
    for m in modules.values():
        shared = _module_names(m.tree)
        for fn in (n for n in ast.walk(m.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            where = f"{m.path.name}:{fn.lineno}"
            for dec in fn.decorator_list:
                if _decorator_name(dec) in CACHES:
                    found.append(f"{where}: {fn.name} has a module-level {_decorator_name(dec)}")
            local = _local_names(fn) - {n for g in ast.walk(fn) if isinstance(g, ast.Global) for n in g.names}
            for node in ast.walk(fn):
                if isinstance(node, ast.Global):
                    found.append(f"{m.path.name}:{node.lineno}: global {', '.join(node.names)}")
                name = _changed_name(node)
                if name is not None and name in shared and name not in local:
                    found.append(f"{m.path.name}:{node.lineno}: {fn.name} changes module-level {name}")
    return sorted(set(found))


def _changed_name(node: ast.AST) -> str | None:
    """The name whose object `node` changes in place (`X[k] = v`, `del X[k]`, `X.a = v`, `X.clear()`, `next(X)`)."""
    target = None
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
            if isinstance(t, (ast.Subscript, ast.Attribute)):
                target = t.value
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            target = func.value
        elif isinstance(func, ast.Name) and func.id == "next" and node.args:
            target = node.args[0]
    return target.id if isinstance(target, ast.Name) else None


def foreign_private_uses(modules: dict[str, Module]) -> list[str]:
    """`path:line: what` for each use of another module's private name (`from m import _x`, `m._x`) and each
    import of a private module (`_kernels`) from outside its package."""
    found = []
    for m in modules.values():
        aliases: dict[str, str] = {}  # local name -> package module it names
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name.split(".")[0]] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, node)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                        if a.name.startswith("_") and not m.name.startswith(base + ".") and m.name != base:
                            found.append(f"{m.path.name}:{node.lineno}: imports private module {full}")
                    elif a.name.startswith("_") and base != m.name and base in modules:
                        found.append(f"{m.path.name}:{node.lineno}: imports {a.name} from {base}")
                private = base in modules and base.rsplit(".", 1)[-1].startswith("_")
                if private and not m.name.startswith(base.rsplit(".", 1)[0] + "."):
                    found.append(f"{m.path.name}:{node.lineno}: imports private module {base}")
        for node in ast.walk(m.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{m.path.name}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return sorted(set(found))


def imports_of_test_modules(tests_dir: Path) -> list[str]:
    """`path:line: imports NAME` for each import of a test module (`tests_dir/test_*.py`, e.g. `tests.test_x`)
    by another module under `tests_dir` (test modules, support modules, conftest): `import tests.test_x`,
    `from tests.test_x import ...`, `from tests import test_x` and relative forms, wherever the statement is
    (module level, inside functions, under `if __name__ == "__main__":`)."""
    package = tests_dir.name
    test_modules = {f"{package}.{p.stem}" for p in tests_dir.glob("test_*.py")}
    found = []
    for path in sorted(tests_dir.rglob("*.py")):
        parts = path.relative_to(tests_dir.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        mod = Module(
            ".".join(parts[:-1] if is_package else parts),
            path,
            ast.parse(path.read_text(), str(path)),
            is_package,
        )
        for node in ast.walk(mod.tree):
            for target in _import_targets(mod, node):
                for name in test_modules:
                    if (target == name or target.startswith(name + ".")) and name != mod.name:
                        where = path.relative_to(tests_dir.parent)
                        found.append(f"{where}:{node.lineno}: imports {name}")
    return sorted(set(found))


def layer_of(name: str) -> str:
    """The layer of a module of the package (dotted name): its part, `root` for `mmpack` itself, `app` for the
    application layer (every other module under `mmpack`)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1] if parts[1] in PACKAGE_DIRS else "app"


@dataclass(frozen=True)
class Reference:
    """One place that loads `target`: an import statement (at module level or deferred inside a function), a
    module named by a string (`importlib.import_module`, `runpy`, a `-m` command line, a table of names) or
    a shell script's `-m`. `base` is what must exist as a module (for `from a import b`: `a`)."""

    where: str  # path:line
    source: str  # the module (or script) it is in
    layer: str
    target: str
    how: str
    type_only: bool = False  # under `if TYPE_CHECKING:`: named for annotations, never loaded
    base: str = ""


def _docstring_ids(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _type_checking_ids(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:` (named for annotations, never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in {
            getattr(node.test, a, "") for a in ("id", "attr")
        }:
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _named_modules(node: ast.AST) -> Iterator[tuple[str, str]]:
    """(name, how) for each module a string names: a call of import_module / __import__ / run_module with a
    constant name (any package), a string that is a dotted name of ours (`mmpack.a.b`, `mmpack.a:main`), a `-m`
    command line, an f-string that starts with one of our names (`f"mmpack.a.{x}"`: the package it is under)."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        fname = (
            func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        )
        name = node.args[0].value
        loads = fname in ("import_module", "__import__", "run_module") and isinstance(name, str)
        if loads and not name.startswith("mmpack"):  # ours are found as strings below
            yield name, f"{fname}()"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if DOTTED_NAME.fullmatch(node.value):
            yield node.value.split(":")[0], "by name"
        for match in RUN_MODULE.finditer(node.value):
            yield match.group(1), "-m"
    if isinstance(node, ast.JoinedStr) and len(node.values) > 1 and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        if re.fullmatch(r"mmpack(?:\.\w+)*\.", head):
            yield head.rstrip("."), "by name (f-string)"


def module_references(mod: Module, root: Path) -> Iterator[Reference]:
    """Every module `mod` loads or names: each import statement wherever it is (module level, inside
    functions, under `if __name__ == "__main__":`, under `if TYPE_CHECKING:`, marked type_only) and each
    module named by a string (`_named_modules`; docstrings excluded)."""
    rel = mod.path.relative_to(root)
    layer = layer_of(mod.name)
    at_import = {id(n) for n in _module_level(mod.tree.body)}
    docs, type_only = _docstring_ids(mod.tree), _type_checking_ids(mod.tree)
    for node in ast.walk(mod.tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            typed = id(node) in type_only
            how = (
                "imports (type only)"
                if typed
                else "imports"
                if id(node) in at_import
                else "imports (deferred)"
            )
            if isinstance(node, ast.Import):  # each name must be a module
                pairs = [(alias.name, alias.name) for alias in node.names]
            else:  # `from a import b`: `a` must be a module, `b` may be one
                pairs = [(target, _resolve(mod, node)) for target in _import_targets(mod, node)]
            for target, base in pairs:
                yield Reference(f"{rel}:{line}", mod.name, layer, target, how, typed, base)
        elif id(node) not in docs:
            for target, how in _named_modules(node):
                yield Reference(f"{rel}:{line}", mod.name, layer, target, f"names ({how})", False, target)


def script_references(root: Path, dirs: tuple[str, ...] = PACKAGE_DIRS) -> Iterator[Reference]:
    """The `-m MODULE` of every shell script shipped in a part (comment lines left out)."""
    for top in dirs:
        for path in sorted((root / top).rglob("*.sh")):
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                for match in RUN_MODULE.finditer(line):
                    where = f"{path.relative_to(root)}:{line_no}"
                    name = match.group(1)
                    yield Reference(where, str(path.relative_to(root)), top, name, "runs (-m)", False, name)


def layer_violations(modules: dict[str, Module], references: list[Reference]) -> list[str]:
    """`path:line: what` for each reference that breaks a layer rule (`LAYER_IMPORTS`, `FORBIDDEN_PACKAGES`)
    or names a module of ours that does not exist (a stale string or script after a move)."""
    found = []
    for ref in references:
        top = ref.target.split(".")[0]
        if top != "mmpack":
            if top in FORBIDDEN_PACKAGES.get(ref.layer, ()) and not ref.type_only:
                found.append(
                    f"{ref.where}: {ref.source} ({ref.layer}) {ref.how} {ref.target}: {ref.layer} imports no {top}"
                )
            continue
        if ref.base and ref.base not in modules:
            found.append(f"{ref.where}: {ref.source} {ref.how} {ref.base}, which is no module of the package")
            continue
        target_layer = layer_of(ref.target)
        if ref.how == "imports (deferred)" and _excepted(ref.source, ref.target):
            continue
        # every module's import runs `mmpack` (the root), which in turn imports nothing
        allowed = {"root"} if ref.layer == "root" else {ref.layer, "root", *LAYER_IMPORTS[ref.layer]}
        if target_layer not in allowed:
            may = ", ".join(sorted(LAYER_IMPORTS[ref.layer])) or "nothing of the other layers"
            found.append(
                f"{ref.where}: {ref.source} ({ref.layer}) {ref.how} {ref.target} ({target_layer}); "
                f"{ref.layer} may import {may}"
            )
    return sorted(set(found))


def _excepted(source: str, target: str) -> bool:
    """Whether `DEFERRED_EXCEPTIONS` lets module `source` import `target` (a module or a name in it)."""
    return any(target == m or target.startswith(m + ".") for m in DEFERRED_EXCEPTIONS.get(source, ()))


def package_references(root: Path, modules: dict[str, Module]) -> list[Reference]:
    """Every reference of every module in `modules` and of every shell script in the parts under `root`."""
    refs = [r for m in modules.values() for r in module_references(m, root)]
    return refs + list(script_references(root))


def entry_point_problems(pyproject: Path, modules: dict[str, Module]) -> list[str]:
    """`what` for each console script or entry point of `pyproject` that does not name a function defined in a
    module of the application layer (the commands live above the four parts)."""
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    points = dict(project.get("scripts", {}))
    for group, entries in project.get("entry-points", {}).items():
        points |= {f"{group}:{k}": v for k, v in entries.items()}
    found = []
    for name, value in sorted(points.items()):
        module, _, func = value.partition(":")
        mod = modules.get(module)
        defined = mod is not None and any(
            isinstance(n, ast.FunctionDef) and n.name == func for n in mod.tree.body
        )
        if not defined:
            found.append(f"{pyproject.name}: {name} = {value}: no function {func!r} in a module {module}")
        elif layer_of(module) != "app":
            found.append(
                f"{pyproject.name}: {name} = {value}: in {layer_of(module)}, not the application layer"
            )
    return found


def _qualified_functions(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """(node, the qualified name of the innermost function or class holding it; "<module>" at module level)."""
    stack: list[tuple[ast.AST, str]] = [(tree, "<module>")]
    while stack:
        node, where = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if where == "<module>" else f"{where}.{child.name}"
            yield child, where
            stack.append((child, inner))


def cpu_backend_setups(modules: dict[str, Module]) -> list[str]:
    """`module:function` for each place that sets up the CPU backend (a call of `cpu_backend.activate` or of an
    `activate` imported from it); `module:<module>` for a call at import time."""
    found = set()
    for m in modules.values():
        imported = {
            a.asname or a.name
            for n in ast.walk(m.tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("cpu_backend")
            for a in n.names
            if a.name == "activate"
        }
        for node, where in _qualified_functions(m.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            by_module = (
                isinstance(func, ast.Attribute)
                and func.attr == "activate"
                and isinstance(func.value, ast.Name)
                and func.value.id == "cpu_backend"
            )
            if by_module or (isinstance(func, ast.Name) and func.id in imported):
                found.add(f"{m.name}:{where}")
    return sorted(found)
