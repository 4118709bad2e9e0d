"""Structure of the package, read from its source (ast): no import cycle among modules (module-level imports,
as Python runs them), no module-level mutable state, no module reaching into another module's privates; and of
the tests: no test module imported by another (helpers live in tests/support/). Each check has a control: a
synthetic package or tests folder that breaks the rule is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.package_structure import (
    PACKAGE_DIRS,
    Module,
    find_import_cycles,
    foreign_private_uses,
    imports_of_test_modules,
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


def test_no_test_module_imports_another() -> None:
    """No module under tests/ (test modules, tests/support/, conftest) imports a tests/test_*.py module, not
    even inside a function or under ``if __name__ == "__main__":``: shared helpers live in tests/support/."""
    assert len(list((ROOT / "tests").glob("test_*.py"))) > 50  # the whole tests folder was read
    assert imports_of_test_modules(ROOT / "tests") == []


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


def test_control_test_module_imports_are_caught(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "conftest.py": "from tests.support import helpers\n",
        "test_a.py": '"""Uses tests.test_b (a docstring is no import)."""\nfrom tests.test_b import helper\n',
        "test_b.py": "from tests.support.helpers import x\nimport tests.support\nfrom tests import support\n"
        "def helper():\n    return x\n",
        "test_c.py": "def f():\n    from tests import test_b\n    return test_b\n",
        "test_d.py": "if __name__ == '__main__':\n    import tests.test_b as b\n",
        "test_e.py": "from .test_b import helper\n",
        "support/__init__.py": "",
        "support/helpers.py": "x = 1\ndef g():\n    from ..test_b import helper\n    return helper\n",
    }
    for rel, text in files.items():
        path = tmp_path / "tests" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert imports_of_test_modules(tmp_path / "tests") == [
        "tests/support/helpers.py:3: imports tests.test_b",
        "tests/test_a.py:2: imports tests.test_b",
        "tests/test_c.py:2: imports tests.test_b",
        "tests/test_d.py:2: imports tests.test_b",
        "tests/test_e.py:1: imports tests.test_b",
    ]
    # what is not a violation: imports of tests.support (any form), a module naming a test module in text
    for rel in ("test_a.py", "test_c.py", "test_d.py", "test_e.py", "support/helpers.py"):
        (tmp_path / "tests" / rel).unlink()
    assert imports_of_test_modules(tmp_path / "tests") == []
