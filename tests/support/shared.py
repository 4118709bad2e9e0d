"""Where the tests find ../shared (the real tokenizer, chat records, videos and reference code), and the one
way a test steps aside when a prerequisite is missing: `need_shared` (a ../shared path), `need_import` (an extra's
package), `skip_or_fail` (anything else). Each skips on a developer's machine, but under ``CI=true`` fails the
test naming what is missing: CI runs every test or says why it could not."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DIR = Path(os.environ.get("MMPACK_SHARED_DIR", REPO_ROOT.parent / "shared"))
QWEN3_TOKENIZER = SHARED_DIR / "data" / "tokenizer_qwen3" / "tokenizer.json"
MLLM_DEMO_JSON = SHARED_DIR / "data" / "mllm_demo" / "data" / "mllm_demo.json"
VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"
REFERENCE_DIR = SHARED_DIR / "reference"
# every need_shared skip starts with it (the run's skip summary groups by it)
SHARED_REASON = "needs ../shared"


def in_ci() -> bool:
    """True under CI (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def skip_or_fail(reason: str) -> NoReturn:
    """Skips the test with ``reason``; under CI fails it instead (a prerequisite CI must have is missing)."""
    if in_ci():
        pytest.fail(
            f"{reason} (CI=true: a missing prerequisite fails the test instead of skipping it)", pytrace=False
        )
    pytest.skip(reason, allow_module_level=True)


def need_shared(*paths: Path, what: str) -> None:
    """Steps aside unless every path exists (file or folder) in ../shared: a skip (``needs ../shared (what):
    missing PATH, ...``), under CI a failure naming the missing paths. ``what`` says what the test needs."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        skip_or_fail(f"{SHARED_REASON} ({what}): missing {', '.join(missing)}")


def need_import(module: str, *, extra: str) -> ModuleType:
    """The imported ``module`` of the declared extra ``extra``; when it is not installed a skip naming the
    extra, under CI a failure (CI installs every extra: env.sh)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        skip_or_fail(f"needs the {extra} extra ({module}: {e}); pip install -e '.[{extra}]'")
