"""One import namespace: the project imports only as ``mmpack.*``, so a user's own ``trainer.py`` or
``dataloader/`` neither shadows mmpack nor is shadowed by it."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmpack.demo.synthetic import train_tiny_bpe
from tests.support.shared import skip_or_fail

REPO = Path(__file__).resolve().parents[1]
PARTS = ("packing", "offline_packing", "dataloader", "trainer")


def top_level_imports_of_parts(source: str) -> list[str]:
    """The imports in ``source`` that name one of the four parts as a top-level module (``import trainer``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in PARTS]
    return found


def test_checker_flags_a_top_level_import() -> None:
    """Control: the walk below would see an old-style import."""
    assert top_level_imports_of_parts("from packing.binpack import pack_lengths\nimport trainer.data\n") == [
        "packing.binpack",
        "trainer.data",
    ]
    assert top_level_imports_of_parts("from mmpack.packing import binpack\nfrom . import x\n") == []


def test_no_module_imports_a_part_as_top_level() -> None:
    """Every Python file of the repository imports the parts as ``mmpack.<part>`` (a top-level import would
    still work from the repository root, where the folders are on sys.path, and break once installed)."""
    bad = {}
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        linked = rel.parts[0] == "mmpack" and rel.parts[1] in PARTS  # the parts, read at the top level
        if rel.parts[0] in {".venv", "build"} or linked or any(p.startswith(".") for p in rel.parts):
            continue
        found = top_level_imports_of_parts(path.read_text())
        if found:
            bad[str(rel)] = found
    assert not bad, bad


def _installed_mmpack() -> Path:
    spec = importlib.util.find_spec("mmpack")
    if spec is None or spec.origin is None:
        skip_or_fail("mmpack is not installed in this environment (pip install -e .)")
    return Path(spec.origin).resolve().parent


@pytest.mark.slow
def test_user_modules_named_like_the_parts_coexist_with_mmpack(tmp_path: Path) -> None:
    """In a folder holding its own ``trainer.py``, ``dataloader/`` and ``packing.py``, the installed mmpack
    runs (trainer entry point, console script, a small pack) and the folder's modules import as the user's."""
    _installed_mmpack()
    user = tmp_path / "user_project"
    (user / "dataloader").mkdir(parents=True)
    (user / "trainer.py").write_text("WHO = 'user trainer'\n")
    (user / "packing.py").write_text("WHO = 'user packing'\n")
    (user / "dataloader" / "__init__.py").write_text("WHO = 'user dataloader'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "import trainer, dataloader, packing\n"
        "print(trainer.WHO, dataloader.WHO, packing.WHO, sep='|')\n"
        "import mmpack.trainer.pretrain_vlm, mmpack.dataloader, mmpack.packing.binpack\n"
        "print(mmpack.dataloader.build_loader.__module__, mmpack.packing.binpack.pack_lengths.__module__, sep='|')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=user, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    users, ours = done.stdout.strip().splitlines()
    assert users == "user trainer|user dataloader|user packing"
    assert ours == "mmpack.dataloader.loader|mmpack.packing.binpack"

    # Control: a top-level `trainer` package, as the parts were installed before, is shadowed right here.
    shadowed = subprocess.run(
        [sys.executable, "-c", "import trainer.pretrain_vlm"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert shadowed.returncode != 0 and "'trainer' is not a package" in shadowed.stderr

    helped = subprocess.run(
        [sys.executable, "-m", "mmpack.trainer.pretrain_vlm", "--help"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert helped.returncode == 0 and "--tensor-model-parallel-size" in helped.stdout, helped.stderr

    records = user / "records.jsonl"
    records.write_text(
        "".join(
            f'{{"messages": [{{"role": "user", "content": "q{i}"}}, {{"role": "assistant", "content": "a"}}]}}\n'
            for i in range(8)
        )
    )
    tokenizer = train_tiny_bpe(user / "tok")
    mmpack = Path(sys.executable).parent / "mmpack"
    packed = subprocess.run(
        [
            str(mmpack),
            "pack",
            "-i",
            str(records),
            "-o",
            str(user / "packed"),
            "-L",
            "64",
            "-t",
            str(tokenizer),
        ],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert packed.returncode == 0, packed.stderr
    assert (user / "packed" / "manifest.json").is_file()
