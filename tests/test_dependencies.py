"""Every third-party package the package code imports is declared in pyproject.toml, read from the source (ast,
no import of mmpack): a runtime dependency, or an extra's package imported only where it is needed (inside a
function or behind ``except ImportError``), or an undeclared optional one (wandb, Transformer Engine) behind
``except ImportError``. A wheel installed with its declared dependencies then imports (.ci/plain_install.sh
checks that too). Controls: synthetic sources that break each rule are caught."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("packing", "offline_packing", "dataloader", "trainer", "mmpack")
# modules imported only when their extra is installed (their import of it is at module level)
ON_DEMAND = {"offline_packing/outputs/energon_sample.py": "energon"}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class Import:
    path: str
    line: int
    module: str
    lazy: bool  # inside a function
    guarded: bool  # inside a try whose handler catches ImportError


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", req)
    assert match, req
    return normalize(match.group(0))


def declared(pyproject: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(runtime dependencies, extra -> its packages), names normalized."""
    project = tomllib.loads(pyproject.read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {k: {_requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    return core, extras


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: str, source: str) -> Iterator[Import]:
    """The absolute imports of ``source`` outside ``if TYPE_CHECKING:``, each with where it sits."""

    def visit(node: ast.AST, lazy: bool, guarded: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, lazy, guarded)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield Import(path, node.lineno, node.module, lazy, guarded)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child, lazy, guarded)
        elif isinstance(node, ast.Try):
            catches = any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                yield from visit(child, lazy, guarded or catches)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from visit(child, lazy, guarded)
        else:
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                yield from visit(child, inner, guarded)

    yield from visit(ast.parse(source), False, False)


def package_sources(root: Path) -> dict[str, str]:
    """path -> source of every module of the package (the four parts and mmpack/, links not followed)."""
    out = {}
    for part in PARTS:
        for path in sorted((root / part).rglob("*.py")):
            if not any(p.is_symlink() for p in [path, *path.parents] if root in p.parents):
                out[str(path.relative_to(root))] = path.read_text()
    return out


@cache
def _top_level_dists() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@cache
def installed_dists(module: str) -> frozenset[str]:
    """The installed distributions that provide ``module`` (for a namespace such as ``megatron``, those whose
    files hold its first two levels); empty when it is not installed."""
    top = module.split(".")[0]
    dists = _top_level_dists().get(top, [])
    if len(dists) > 1 and "." in module:
        prefix = "/".join(module.split(".")[:2])
        dists = [
            d
            for d in dists
            if any(str(f).startswith(prefix + "/") for f in importlib.metadata.files(d) or [])
        ]
    return frozenset(normalize(d) for d in dists)


def problems(
    sources: dict[str, str],
    core: set[str],
    extras: dict[str, set[str]],
    dists_of: Callable[[str], frozenset[str]],
) -> list[str]:
    """One line per third-party import the rules above do not allow."""
    in_extras = set().union(*extras.values()) if extras else set()
    out = []
    for path, source in sources.items():
        for imp in imports_of(path, source):
            top = imp.module.split(".")[0]
            if top in sys.stdlib_module_names or top in PARTS or top == "__future__":
                continue
            where = f"{imp.path}:{imp.line}: {imp.module}"
            dists = dists_of(imp.module)
            if not dists:
                if not imp.guarded:
                    out.append(f"{where}: not installed, not declared and not behind `except ImportError`")
            elif dists & core:
                continue
            elif dists & in_extras:
                if not (imp.lazy or imp.guarded or path in ON_DEMAND):
                    out.append(f"{where}: {sorted(dists)} is an extra's, imported at module level")
            elif not imp.guarded:
                out.append(f"{where}: {sorted(dists)} is not declared in pyproject.toml")
    return sorted(out)


def test_every_third_party_import_is_declared() -> None:
    sources = package_sources(ROOT)
    assert len(sources) > 100  # the whole package was read
    core, extras = declared(ROOT / "pyproject.toml")
    assert problems(sources, core, extras, installed_dists) == []


def test_control_undeclared_and_misplaced_imports_are_found() -> None:
    dists = {"jinja2": "jinja2", "yaml": "pyyaml", "numpy": "numpy", "ray": "ray", "scipy": "scipy"}

    def dists_of(module: str) -> frozenset[str]:
        top = module.split(".")[0]
        return frozenset({dists[top]}) if top in dists else frozenset()

    core, extras = {"numpy", "jinja2"}, {"ray": {"ray"}, "test": {"scipy"}}
    sources = {
        "packing/a.py": "import os\nimport numpy as np\nfrom jinja2 import sandbox\nfrom . import b\n",
        "packing/b.py": "import yaml\n",  # installed, not declared
        "packing/c.py": "import ray\n",  # an extra's, at module level
        "packing/d.py": "def f():\n    from scipy.optimize import linprog\n",  # an extra's, lazily: fine
        "packing/e.py": "try:\n    import wandb\nexcept ImportError:\n    wandb = None\n",  # optional: fine
        "packing/f.py": "import wandb\n",  # not installed, not guarded
        "packing/g.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from _typeshed import X\n",
        "packing/h.py": "def g():\n    try:\n        import yaml\n    except ModuleNotFoundError:\n        pass\n",
    }
    assert problems(sources, core, extras, dists_of) == [
        "packing/b.py:1: yaml: ['pyyaml'] is not declared in pyproject.toml",
        "packing/c.py:1: ray: ['ray'] is an extra's, imported at module level",
        "packing/f.py:1: wandb: not installed, not declared and not behind `except ImportError`",
    ]
    assert problems(sources, core | {"pyyaml", "ray"}, extras, dists_of) == [
        "packing/f.py:1: wandb: not installed, not declared and not behind `except ImportError`",
    ]


def test_declared_pins_are_the_installed_versions() -> None:
    """The runtime dependencies are pinned (==) to what this environment has installed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wrong = []
    for req in project["dependencies"]:
        name, _, version = req.partition("==")
        assert version, f"{req}: not pinned"
        name = name.split("[")[0]
        installed = importlib.metadata.version(name)
        if installed.split("+")[0] != version:
            wrong.append(f"{name}: declared {version}, installed {installed}")
    assert wrong == []
