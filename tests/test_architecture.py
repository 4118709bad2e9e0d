"""Structure of the package, read from its source (ast): no import cycle among modules (module-level imports,
as Python runs them), no module-level mutable state, no module reaching into another module's privates.
Each check has a control: a synthetic package that breaks the rule is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.package_structure import (
    PACKAGE_DIRS,
    Module,
    find_import_cycles,
    foreign_private_uses,
    module_level_state,
    package_modules,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return package_modules(ROOT, PACKAGE_DIRS)


def test_no_import_cycle(modules: dict[str, Module]) -> None:
    assert len(modules) > 100  # the whole package was read
    assert find_import_cycles(modules) == []
    # not even through the imports made inside functions (deferred to dodge a cycle)
    assert find_import_cycles(modules, deferred=True) == []


def test_no_module_level_mutable_state(modules: dict[str, Module]) -> None:
    assert module_level_state(modules) == []


def test_no_module_uses_another_modules_privates(modules: dict[str, Module]) -> None:
    assert foreign_private_uses(modules) == []


def _synthetic(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_modules(tmp_path, ("pkg",), namespace="mmpack")


def test_controls_each_check_catches_its_violation(tmp_path: Path) -> None:
    mods = _synthetic(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from mmpack.pkg import b\nimport functools\n_SEEN = {}\n"
            "def f(x):\n    _SEEN[x] = 1\n"
            "@functools.lru_cache(maxsize=2)\ndef g(x):\n    return x\n",
            "b.py": "from mmpack.pkg.c import helper\nfrom mmpack.pkg.a import _SEEN\n",
            "c.py": "import mmpack.pkg.a as a\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from mmpack.pkg import b\n"
            "COUNT = 0\ndef helper():\n    global COUNT\n    COUNT += 1\n    a._SEEN.clear()\n"
            "def late():\n    from mmpack.pkg import b\n",
            "d.py": "def f():\n    from mmpack.pkg import e\n",
            "e.py": "import mmpack.pkg.d\n",
        },
    )
    assert find_import_cycles(mods) == [["mmpack.pkg.a", "mmpack.pkg.b", "mmpack.pkg.c"]]
    deferred = find_import_cycles(mods, deferred=True)
    assert deferred == [["mmpack.pkg.a", "mmpack.pkg.b", "mmpack.pkg.c"], ["mmpack.pkg.d", "mmpack.pkg.e"]]
    state = module_level_state(mods)
    assert any("a.py" in s and "_SEEN" in s for s in state)
    assert any("a.py" in s and "lru_cache" in s for s in state)
    assert any("c.py" in s and "global COUNT" in s for s in state)
    privates = foreign_private_uses(mods)
    assert any("b.py" in s and "_SEEN" in s for s in privates)
    assert any("c.py" in s and "a._SEEN" in s for s in privates)
    # what is not a violation: a constant read, a TYPE_CHECKING import, a function-level import
    clean = _synthetic(
        tmp_path / "clean",
        {
            "__init__.py": "",
            "a.py": "LIMITS = {'x': 1}\ndef f():\n    return dict(LIMITS)\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mmpack.pkg import c\n",
            "c.py": "from mmpack.pkg import b\ndef g():\n    from mmpack.pkg.a import f\n    return f()\n",
        },
    )
    assert find_import_cycles(clean) == find_import_cycles(clean, deferred=True) == []
    assert module_level_state(clean) == []
    assert foreign_private_uses(clean) == []
