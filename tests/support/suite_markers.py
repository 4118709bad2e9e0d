"""Reads the test modules with `ast` (no import, no process) and finds the tests that need what a marker says
without carrying it (tests/test_suite_markers.py): ``RANKS`` (the test starts multi-process torch.distributed
ranks) and ``SHARED`` (the test calls ``need_shared``: it needs ../shared).

A test starts ranks when its body, a function it calls, a fixture it takes, or a function those call in turn
(in its module, a tests/support/ module, conftest.py or another test module) does one of:

- calls ``tests.support.trainer.train``, ``tests.support.ranks.launch``, a fork-server process group's context
  (``tests.support.ranks.context``) or the checkpoint
  converter (``mmpack.trainer.convert.hf_to_mcore`` / ``mcore_to_hf``, which spawn their gloo ranks),
- calls a helper named ``torchrun`` or ``_torchrun`` (``tests.support.hf_parity.torchrun``, a test's own),
- names ``"torchrun"``, ``"torch.distributed.run"`` or ``"forkserver"`` (a torchrun command line, a fork-server
  context of its own).

Not seen (the modules that do it are marked by hand): ``mmpack convert`` run as a command (its argument
checks fail before any rank starts, so a string is no sign), a torchrun inside a shell script a test runs.

A test needs ../shared when its body, a function it calls or a fixture it takes (likewise, in turn) calls
``tests.support.shared.need_shared``.

A test carries a marker through its decorators, its class (decorator or ``pytestmark``) or its module's
``pytestmark``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    """A marker and the signs, in a function's own body, that a test reaching that function needs it."""

    marker: str
    calls: dict[str, frozenset[str]]  # module -> the names in it whose call is a sign
    helpers: frozenset[str] = frozenset()  # a call of a function of this name, wherever it is defined
    strings: frozenset[str] = frozenset()  # a string constant equal to one of these


RANKS = Rule(
    "ranks",
    calls={
        "tests.support.trainer": frozenset({"train"}),
        "tests.support.ranks": frozenset({"launch", "context"}),
        "mmpack.trainer.convert": frozenset({"hf_to_mcore", "mcore_to_hf"}),  # spawn their gloo ranks
    },
    helpers=frozenset({"torchrun", "_torchrun"}),
    strings=frozenset(
        {"torchrun", "torch.distributed.run", "forkserver"}
    ),  # torchrun's command, a fork server
)
SHARED = Rule("shared", calls={"tests.support.shared": frozenset({"need_shared"})})

Key = tuple[str, str]  # (module, function name)


@dataclass
class Function:
    """A function of a test or support module: what it launches itself and what it refers to."""

    module: str
    name: str
    line: int
    direct: bool  # shows the rule's sign in its own body (after `analyse`: reaches it)
    refs: set[Key] = field(default_factory=set)  # functions it calls or passes on
    fixtures: set[str] = field(default_factory=set)  # fixtures it takes (parameters, getfixturevalue)
    is_fixture: bool = False
    is_test: bool = False
    marks: set[str] = field(default_factory=set)  # its own markers plus its class's and module's


def marker_names(node: ast.AST | None) -> set[str]:
    """The ``pytest.mark.NAME`` (or ``mark.NAME``) names in an expression (a decorator, a pytestmark value)."""
    found: set[str] = set()
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Attribute) and (
            (isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark")
            or (isinstance(sub.value, ast.Name) and sub.value.id == "mark")
        ):
            found.add(sub.attr)
    return found


def _pytestmark(body: Iterable[ast.stmt]) -> set[str]:
    marks: set[str] = set()
    for stmt in body:
        targets = (
            stmt.targets
            if isinstance(stmt, ast.Assign)
            else [stmt.target]
            if isinstance(stmt, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            marks |= marker_names(stmt.value)
    return marks


def _is_fixture(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
            isinstance(target, ast.Name) and target.id == "fixture"
        ):
            return True
    return False


class _Module:
    def __init__(self, name: str, tree: ast.Module, rule: Rule) -> None:
        self.name = name
        self.tree = tree
        self.rule = rule
        self.from_imports: dict[str, Key] = {}  # local name -> (module, name)
        self.module_aliases: dict[str, str] = {}  # local name -> module
        self.top_functions: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    local = alias.asname or alias.name
                    # `from tests.support import ranks` binds a module; `from x import f` a function
                    self.from_imports[local] = (node.module, alias.name)
                    self.module_aliases[local] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.module_aliases[alias.asname] = alias.name
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.top_functions.add(stmt.name)

    def resolve(self, local: str) -> Key | None:
        if local in self.top_functions:
            return (self.name, local)
        return self.from_imports.get(local)

    def shows_sign(self, body: ast.AST) -> bool:
        rule = self.rule
        for node in ast.walk(body):
            if isinstance(node, ast.Constant) and node.value in rule.strings:
                return True
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                key = self.from_imports.get(func.id)
                if func.id in rule.helpers or (key and key[1] in rule.calls.get(key[0], ())):
                    return True
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                module = self.module_aliases.get(func.value.id)
                if func.attr in rule.helpers or (module and func.attr in rule.calls.get(module, ())):
                    return True
        return False

    def references(self, body: ast.AST) -> set[Key]:
        refs: set[Key] = set()
        for node in ast.walk(body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                key = self.resolve(node.id)
                if key:
                    refs.add(key)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = self.module_aliases.get(node.value.id)
                if module:
                    refs.add((module, node.attr))
        return refs

    def functions(self) -> Iterator[Function]:
        module_marks = _pytestmark(self.tree.body)
        for stmt in self.tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield self._function(stmt, module_marks, is_test=stmt.name.startswith("test"))
            elif isinstance(stmt, ast.ClassDef):
                class_marks = module_marks | _pytestmark(stmt.body)
                for deco in stmt.decorator_list:
                    class_marks |= marker_names(deco)
                for sub in stmt.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        is_test = stmt.name.startswith("Test") and sub.name.startswith("test")
                        yield self._function(sub, class_marks, is_test=is_test, owner=stmt.name)

    def _function(
        self, fn: ast.FunctionDef | ast.AsyncFunctionDef, marks: set[str], *, is_test: bool, owner: str = ""
    ) -> Function:
        own = set(marks)
        for deco in fn.decorator_list:
            own |= marker_names(deco)
        args = fn.args
        params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {"self", "cls"}
        fixtures = set(params)
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getfixturevalue"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                fixtures.add(node.args[0].value)
        body = ast.Module(body=fn.body, type_ignores=[])
        return Function(
            module=self.name,
            name=f"{owner}::{fn.name}" if owner else fn.name,
            line=fn.lineno,
            direct=self.shows_sign(body),
            refs=self.references(body),
            fixtures=fixtures,
            is_fixture=_is_fixture(fn),
            is_test=is_test,
            marks=own,
        )


def module_name(root: Path, path: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def analyse(sources: dict[str, str], rule: Rule = RANKS) -> dict[Key, Function]:
    """Every function of ``sources`` (module name -> source), with ``direct`` widened to "reaches the rule's
    sign", through what it calls and the fixtures it takes (its own module's fixture first, then conftest's)."""
    functions: dict[Key, Function] = {}
    for name, source in sources.items():
        for fn in _Module(name, ast.parse(source), rule).functions():
            functions[(fn.module, fn.name)] = fn
    fixtures_of: dict[str, dict[str, Key]] = {}
    for key, fn in functions.items():
        if fn.is_fixture:
            fixtures_of.setdefault(fn.module, {})[fn.name] = key
    conftest = fixtures_of.get("tests.conftest", {})
    launching = {key for key, fn in functions.items() if fn.direct}
    changed = True
    while changed:
        changed = False
        for key, fn in functions.items():
            if key in launching:
                continue
            via_fixture = (fixtures_of.get(fn.module, {}).get(f) or conftest.get(f) for f in fn.fixtures)
            if any(ref in launching for ref in fn.refs) or any(k in launching for k in via_fixture if k):
                launching.add(key)
                changed = True
    for key in launching:
        functions[key].direct = True
    return functions


def unmarked(sources: dict[str, str], rule: Rule = RANKS, paths: dict[str, str] | None = None) -> list[str]:
    """``path:line: test`` for each test that reaches the rule's sign without the rule's marker."""
    paths = paths or {}
    return sorted(
        f"{paths.get(fn.module, fn.module)}:{fn.line}: {fn.name}"
        for fn in analyse(sources, rule).values()
        if fn.is_test and fn.direct and rule.marker not in fn.marks
    )


def read_tests(tests_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(module name -> source, module name -> path) of tests/*.py and tests/support/*.py."""
    root = tests_dir.parent
    files = sorted([*tests_dir.glob("*.py"), *(tests_dir / "support").glob("*.py")])
    sources = {module_name(root, p): p.read_text() for p in files}
    paths = {module_name(root, p): str(p.relative_to(root)) for p in files}
    return sources, paths
