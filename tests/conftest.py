"""Shared pytest fixtures: the optional ../shared data, packed datasets and the family tests' tiny models built
once per run, GPU skipping, the run's closing lines (skips by reason, time by marker: run_summary), and the
check that no process the run started outlives it (support.leftovers)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support import leftovers, run_summary
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, VIDEO_DEMO, need_shared

if TYPE_CHECKING:
    from tests.support.mixed_sources import MixedRuleSources

# Keep numba/torch from oversubscribing the 2-core CI machine when tests start subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# --online-packing's default packing cache (trainer.data.default_packing_cache) in a folder of this run, not the
# user's ~/.cache: removed when the run ends
if "MMPACK_CACHE" not in os.environ:
    os.environ["MMPACK_CACHE"] = tempfile.mkdtemp(prefix="mmpack-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MMPACK_CACHE"], ignore_errors=True)
_TIERS = pytest.StashKey[dict[str, tuple[str, ...]]]()  # test id -> its markers of run_summary.TIERS
_LEFT = pytest.StashKey[list[str]]()  # processes the run left running, described
leftovers.become_subreaper()  # orphans of the run's processes come back to this one (see pytest_sessionfinish)


@pytest.fixture(scope="session", autouse=True)
def bytecode_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every interpreter the run starts (torchrun ranks, the fork server, `python -m ...` subprocesses) keeps
    the bytecode it compiles in one cache folder outside the source trees (.pytest_cache/d/pycache). env.sh
    installs with pip --no-compile, so with PYTHONDONTWRITEBYTECODE=1 in the environment every fresh
    interpreter compiled torch, energon and transformers from source again (about 8 s of CPU per
    interpreter that imports torch); with the cache only the first one does. The prefix keeps the
    environment's wish: nothing is written into the venv or the repository's packages."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("pycache") if cache is not None else tmp_path_factory.getbasetemp() / "pycache"
    folder = Path(os.environ.setdefault("PYTHONPYCACHEPREFIX", str(folder)))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder


@pytest.fixture(scope="session")
def packed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_packed_dataset`` built once per pytest run for each (n_samples, seed, seq_len): a factory
    ``packed_dataset(n_samples=, seed=, seq_len=256) -> Path`` for tests that only read the dataset (a test that
    writes into the dataset's folder builds its own with ``make_packed_dataset``)."""
    from tests.support.trainer import make_packed_dataset

    root = tmp_path_factory.mktemp("packed-datasets")
    built: dict[tuple[int, int, int], Path] = {}

    def get(*, n_samples: int, seed: int, seq_len: int = 256) -> Path:
        key = (n_samples, seed, seq_len)
        if key not in built:
            folder = root / f"n{n_samples}-seed{seed}-len{seq_len}"
            built[key] = make_packed_dataset(folder, n_samples=n_samples, seed=seed, seq_len=seq_len)
        return built[key]

    return get


@pytest.fixture(scope="session")
def mixed_rule_sources(tmp_path_factory: pytest.TempPathFactory) -> MixedRuleSources:
    """A text source packed with `-t` alone and one image set packed twice with `--model` under two
    `--max-pixels` (``support.mixed_sources``), built once per run: they mix, each bin by its own rule."""
    from tests.support.mixed_sources import make_mixed_rule_sources

    return make_mixed_rule_sources(tmp_path_factory.mktemp("mixed-rules"))


@pytest.fixture
def qwen3_tokenizer_path() -> Path:
    """The real Qwen3 tokenizer.json from ../shared; skips the test when it is absent (fails under CI)."""
    need_shared(QWEN3_TOKENIZER, what="the Qwen3 tokenizer")
    return QWEN3_TOKENIZER


@pytest.fixture
def mllm_demo_json() -> Path:
    """The real mllm_demo records (ShareGPT) from ../shared; skips the test when they are absent (fails under
    CI)."""
    need_shared(MLLM_DEMO_JSON, what="the mllm_demo records")
    return MLLM_DEMO_JSON


# -- the family tests' models and packed demo data: built once per run, shared read-only ------------------


@pytest.fixture(scope="session")
def qwen2_5_vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL written by transformers (``support.qwen2_5_vl.tiny_hf_model``, the Qwen3
    tokenizer's special ids): the folder of the image parity, video parity and context-parallel tests."""
    from tests.support import qwen2_5_vl

    need_shared(QWEN3_TOKENIZER, what="the Qwen3 tokenizer")
    folder = tmp_path_factory.mktemp("qwen2_5_vl") / "hf"
    return qwen2_5_vl.tiny_hf_model(folder, qwen2_5_vl.qwen3_special_ids())


@pytest.fixture(scope="session")
def qwen2_5_vl_video_bin(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(``qwen2_5_vl_model``, one packed bin of a real image sample and a real video sample with the Qwen3
    tokenizer and a small video rule: ``support.qwen2_5_vl.pack_image_video_bin``)."""
    from tests.support import qwen2_5_vl

    need_shared(
        QWEN3_TOKENIZER, MLLM_DEMO_JSON, VIDEO_DEMO, what="Qwen3 tokenizer, mllm_demo and mllm_video_demo"
    )
    hf_dir = request.getfixturevalue("qwen2_5_vl_model")
    return hf_dir, qwen2_5_vl.pack_image_video_bin(tmp_path_factory.mktemp("qwen2_5_vl-video-bin"))


@pytest.fixture(scope="session")
def qwen3_vl_packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Qwen3-VL (``support.qwen3_vl.tiny_hf_model``) and the six mllm_demo records with the
    first mllm_video_demo record packed into one bin of 2048 tokens by ``mmpack pack --model`` that folder:
    ``{"root", "hf", "packed"}``."""
    from mmpack.cli import main as mmpack
    from tests.support.hf_parity import records_file
    from tests.support.qwen3_vl import tiny_hf_model

    need_shared(
        QWEN3_TOKENIZER, MLLM_DEMO_JSON, VIDEO_DEMO, what="Qwen3 tokenizer, mllm_demo and mllm_video_demo"
    )
    root = tmp_path_factory.mktemp("qwen3-vl")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    hf_dir = tiny_hf_model(root / "hf", ids)
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root)), "-o", str(packed), "-L", "2048", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    return {"root": root, "hf": hf_dir, "packed": packed}


@pytest.fixture(scope="session")
def onevision2_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Tiny random LLaVA-OneVision-2 folders (``support.onevision.tiny_hf_model``), each built once per run:
    a factory ``onevision2_model(model_type="llava_onevision2", **fields) -> Path`` (``fields``: its
    geometry, by default patch 14, merge 2, images up to 50176 pixels, and spec fields); skips without the
    Qwen3 tokenizer or the reference."""
    from tests.support import onevision

    built: dict[tuple, Path] = {}

    def get(model_type: str = "llava_onevision2", **fields: int) -> Path:
        fields = {"patch_size": 14, "merge_size": onevision.MERGE, "max_pixels": 50176, **fields}
        key = (model_type, *sorted(fields.items()))
        if key not in built:
            onevision.need_reference()
            ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
            folder = tmp_path_factory.mktemp(model_type) / "hf"
            built[key] = onevision.tiny_hf_model(folder, ids, model_type, **fields)
        return built[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remember each test's markers of ``run_summary.TIERS`` (the run's time by marker); skip tests marked
    `gpu` when CUDA is not available."""
    config.stash[_TIERS] = {
        item.nodeid: tuple(m for m in run_summary.TIERS if item.get_closest_marker(m)) for item in items
    }
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No process the run started is left running: what still runs (its fixtures torn down, after a grace) is
    named at the end of the run, stopped, and fails the run."""
    from tests.support.ranks import fork_server_pids

    left = leftovers.leftover_processes(keep=fork_server_pids())
    if left:
        session.config.stash[_LEFT] = [leftovers.describe(p) for p in left]
        leftovers.stop(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Generator[None, None, None]:
    """Two lines at the end of every run, after the short test summary, just before pytest's closing line: the
    skips grouped by reason (``skipped: 12 (needs ../shared: 10, needs CUDA: 2)``) and the suite's time by
    marker (``time by marker: ranks 512 s (88 tests), ...``)."""
    yield
    reports = [rep for replist in terminalreporter.stats.values() for rep in replist]
    skipped = terminalreporter.stats.get("skipped", [])
    tiers = terminalreporter.config.stash.get(_TIERS, {})
    terminalreporter.write_line(run_summary.skip_line(run_summary.skip_reason(rep) for rep in skipped))
    durations = run_summary.durations_of(reports)
    terminalreporter.write_line(run_summary.marker_time_line(durations, tiers))
    terminalreporter.write_line(run_summary.file_time_line(durations))
    left = terminalreporter.config.stash.get(_LEFT, [])
    if left:
        terminalreporter.write_line(
            f"FAILED: {len(left)} process(es) started by this run still ran at its end (stopped now):",
            red=True,
        )
        for line in left:
            terminalreporter.write_line(f"  {line}")
