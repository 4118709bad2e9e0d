"""Structure of the package, read from its source (ast): no import cycle among modules (module-level imports,
as Python runs them), no module-level mutable state, no module reaching into another module's privates, the
layers importing only downwards (every import, deferred ones and modules named by strings, `-m` and scripts
too; console scripts in the application layer), the CPU backend set up only by entry points; and of the tests:
no test module imported by another (helpers live in tests/support/). Each check has a control: a synthetic
package or tests folder that breaks the rule is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.package_structure import (
    PACKAGE_DIRS,
    Module,
    app_modules,
    cpu_backend_setups,
    entry_point_problems,
    find_import_cycles,
    foreign_private_uses,
    imports_of_test_modules,
    layer_violations,
    module_level_state,
    package_modules,
    package_references,
)

ROOT = Path(__file__).resolve().parents[1]
# The entry points that set up the CPU backend (it changes torch for the whole process): the trainer's main, the
# start of each converter rank (a process of its own), `mmpack demo`'s in-process logits check.
CPU_BACKEND_ENTRY_POINTS = [
    "mmpack.demo.cli:_export_and_compare",
    "mmpack.trainer.convert:_init_rank",
    "mmpack.trainer.pretrain_vlm:main",
]


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return package_modules(ROOT, PACKAGE_DIRS) | app_modules(ROOT)


def test_no_import_cycle(modules: dict[str, Module]) -> None:
    assert len(modules) > 100  # the whole package was read
    assert find_import_cycles(modules) == []
    # not even through the imports made inside functions (deferred to dodge a cycle)
    assert find_import_cycles(modules, deferred=True) == []


def test_layers_import_only_downwards(modules: dict[str, Module]) -> None:
    """packing imports no other part and no torch; the loader neither the trainer nor the offline job; the
    offline job and the trainer not each other; only the application layer (`mmpack.cli`, `mmpack.demo`)
    imports all four; and no string or script names a module that is not there."""
    assert {"mmpack.cli", "mmpack.demo.cli", "mmpack.__main__"} <= set(modules)
    refs = package_references(ROOT, modules)
    hows = {r.how for r in refs}
    # the walk sees each kind of reference: deferred imports, modules named by strings, `-m` in scripts
    assert {"imports", "imports (deferred)", "names (by name)", "names (-m)", "runs (-m)"} <= hows, hows
    assert layer_violations(modules, refs) == []


def test_console_scripts_live_in_the_application_layer(modules: dict[str, Module]) -> None:
    assert entry_point_problems(ROOT / "pyproject.toml", modules) == []


def test_cpu_backend_is_set_up_only_by_entry_points(modules: dict[str, Module]) -> None:
    """Not by library code and not at import: `trainer.training` and `trainer.export_check` ask
    `cpu_backend.require_backend` instead."""
    assert cpu_backend_setups(modules) == CPU_BACKEND_ENTRY_POINTS


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


def _planted(root: Path, files: dict[str, str]) -> dict[str, Module]:
    """A package tree of the real layers under `root` (the parts' folders and mmpack/), read like the real one."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for top in (*PACKAGE_DIRS, "mmpack"):
        (root / top).mkdir(exist_ok=True)
        (root / top / "__init__.py").touch()
    return package_modules(root, PACKAGE_DIRS) | app_modules(root)


CLEAN_TREE = {
    "packing/rules.py": "import numpy as np\nfrom typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n    import torch\n",
    "dataloader/load.py": "from mmpack.packing import rules\nimport torch\n",
    "offline_packing/job.py": "from mmpack.packing.rules import np\n"
    "def decode():\n    from mmpack.dataloader.load import torch\n",
    "offline_packing/run.sh": "# python -m mmpack.cli in a comment is no command\npython -m mmpack.offline_packing.job\n",
    "trainer/train.py": "import importlib\nfrom mmpack.dataloader import load\n"
    "def family(x):\n    return importlib.import_module(f'mmpack.trainer.{x}')\n",
    "mmpack/cli.py": "import importlib\nTABLE = {'pack': 'mmpack.offline_packing.job', 'train': 'mmpack.trainer.train'}\n"
    "def main():\n    return importlib.import_module(TABLE['pack'])\n",
    "mmpack/demo/__init__.py": "",
    "mmpack/demo/cli.py": '"""Runs `python -m mmpack.cli`, and names mmpack.trainer.train in a docstring."""\n'
    "from mmpack.cli import main\nCMD = ['-m', 'mmpack.trainer.train']\n",
}


def test_control_layer_violations_are_caught(tmp_path: Path) -> None:
    """Each kind of upward or forbidden reference, planted in a tree of the real layers, is caught; the clean
    tree (a TYPE_CHECKING torch in packing, scripts and docstrings that only mention modules) passes."""
    clean = _planted(tmp_path / "clean", CLEAN_TREE)
    assert layer_violations(clean, package_references(tmp_path / "clean", clean)) == []
    planted = {
        "packing/rules.py": "import torch\n",  # packing imports no torch
        "packing/pure.py": "def f():\n    import importlib\n    return importlib.import_module('torch.nn')\n",
        "packing/up.py": "def f():\n    from mmpack.dataloader import load\n",  # a deferred upward import
        "dataloader/load.py": "from mmpack.offline_packing.job import x\n",
        "offline_packing/job.py": "def f():\n    import mmpack.trainer.train\n",
        "offline_packing/run.sh": 'exec python -m mmpack.cli pack "$@"\n',  # a script runs the app layer
        "offline_packing/gone.sh": "python -m mmpack.offline_packing.moved\n",  # a stale module name
        "trainer/train.py": "import subprocess, sys\n"
        "def pack():\n    subprocess.run([sys.executable, '-m', 'mmpack.offline_packing.job'])\n"
        "def family(x):\n    import importlib\n    return importlib.import_module(f'mmpack.offline_packing.{x}')\n",
        "trainer/usage.py": "USAGE = 'then: python -m mmpack.demo.cli'\n",
        "mmpack/__init__.py": "from mmpack.packing import rules\n",  # the root imports nothing
    }
    bad = _planted(tmp_path / "bad", CLEAN_TREE | planted)
    found = layer_violations(bad, package_references(tmp_path / "bad", bad))
    expected = [
        "dataloader/load.py:1: mmpack.dataloader.load (dataloader) imports mmpack.offline_packing.job",
        "mmpack/__init__.py:1: mmpack (root) imports mmpack.packing",
        "offline_packing/gone.sh:1: offline_packing/gone.sh runs (-m) mmpack.offline_packing.moved, which is no",
        "offline_packing/job.py:2: mmpack.offline_packing.job (offline_packing) imports (deferred) mmpack.trainer",
        "offline_packing/run.sh:1: offline_packing/run.sh (offline_packing) runs (-m) mmpack.cli (app)",
        "packing/pure.py:3: mmpack.packing.pure (packing) names (import_module()) torch.nn: packing imports no",
        "packing/rules.py:1: mmpack.packing.rules (packing) imports torch: packing imports no torch",
        "packing/up.py:2: mmpack.packing.up (packing) imports (deferred) mmpack.dataloader",
        "trainer/train.py:3: mmpack.trainer.train (trainer) names (by name) mmpack.offline_packing.job",
        "trainer/train.py:6: mmpack.trainer.train (trainer) names (by name (f-string)) mmpack.offline_packing",
        "trainer/usage.py:1: mmpack.trainer.usage (trainer) names (-m) mmpack.demo.cli (app)",
    ]
    for line in expected:
        assert sum(f.startswith(line) for f in found) >= 1, (line, found)
    assert len({f.split(":")[0] + ":" + f.split(":")[1] for f in found}) == len(expected), found


ONLINE_TREE = {
    "offline_packing/online.py": "def raw_source():\n    pass\n",
    "offline_packing/job.py": "def run():\n    pass\n",
    "trainer/data.py": "def open_raw():\n    from mmpack.offline_packing.online import raw_source\n    return raw_source\n",
}


def test_control_only_the_trainer_data_module_imports_online_packing(tmp_path: Path) -> None:
    """The one exception of the graph (`DEFERRED_EXCEPTIONS`): `mmpack.trainer.data` imports
    `mmpack.offline_packing.online` inside a function; that import at its module level, its import of another
    module of the offline job, and the same import by another trainer module are each caught."""
    clean = _planted(tmp_path / "clean", ONLINE_TREE)
    assert layer_violations(clean, package_references(tmp_path / "clean", clean)) == []
    planted = {
        "trainer/data.py": "from mmpack.offline_packing import online\n"
        "def open_raw():\n    from mmpack.offline_packing.job import run\n    return run\n",
        "trainer/training.py": "def open_raw():\n    import mmpack.offline_packing.online\n",
    }
    bad = _planted(tmp_path / "bad", ONLINE_TREE | planted)
    found = layer_violations(bad, package_references(tmp_path / "bad", bad))
    expected = [
        "trainer/data.py:1: mmpack.trainer.data (trainer) imports mmpack.offline_packing ",
        "trainer/data.py:1: mmpack.trainer.data (trainer) imports mmpack.offline_packing.online ",
        "trainer/data.py:3: mmpack.trainer.data (trainer) imports (deferred) mmpack.offline_packing.job ",
        "trainer/training.py:2: mmpack.trainer.training (trainer) imports (deferred) mmpack.offline_packing.online ",
    ]
    assert [any(f.startswith(line) for f in found) for line in expected] == [True] * 4, found
    places = {":".join(f.split(":")[:2]) for f in found}
    assert places == {"trainer/data.py:1", "trainer/data.py:3", "trainer/training.py:2"}, found


def test_control_console_script_outside_the_application_layer(tmp_path: Path) -> None:
    mods = _planted(tmp_path, CLEAN_TREE | {"offline_packing/cli.py": "def main():\n    pass\n"})
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.scripts]\nmmpack = "mmpack.cli:main"\n')
    assert entry_point_problems(pyproject, mods) == []
    pyproject.write_text(
        '[project.scripts]\nmmpack = "mmpack.offline_packing.cli:main"\nold = "mmpack.offline_packing.demo:main"\n'
        '[project.entry-points.x]\nrun = "mmpack.cli:run"\n'
    )
    assert entry_point_problems(pyproject, mods) == [
        "pyproject.toml: mmpack = mmpack.offline_packing.cli:main: in offline_packing, not the application layer",
        "pyproject.toml: old = mmpack.offline_packing.demo:main: no function 'main' in a module "
        "mmpack.offline_packing.demo",
        "pyproject.toml: x:run = mmpack.cli:run: no function 'run' in a module mmpack.cli",
    ]


def test_control_cpu_backend_set_up_by_library_code_is_caught(tmp_path: Path) -> None:
    mods = _planted(
        tmp_path,
        {
            "trainer/cpu_backend.py": "def activate():\n    return True\n",
            "trainer/pretrain_vlm.py": "def main():\n    from mmpack.trainer import cpu_backend\n"
            "    cpu_backend.activate()\n",
            "trainer/training.py": "from mmpack.trainer import cpu_backend\ncpu_backend.activate()\n"
            "class Trainer:\n    def __init__(self):\n        cpu_backend.activate()\n",
            "trainer/export.py": "from mmpack.trainer.cpu_backend import activate as setup\n"
            "def group():\n    setup()\n",
            "trainer/asks.py": "from mmpack.trainer.cpu_backend import require_backend\n"
            "def group():\n    require_backend('group')\n",
        },
    )
    assert cpu_backend_setups(mods) == [
        "mmpack.trainer.export:group",
        "mmpack.trainer.pretrain_vlm:main",
        "mmpack.trainer.training:<module>",
        "mmpack.trainer.training:Trainer.__init__",
    ]
