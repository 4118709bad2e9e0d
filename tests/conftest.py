"""Shared pytest fixtures: the optional ../shared data and GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER

# Keep numba/torch from oversubscribing the 2-core CI machine when tests start subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture
def qwen3_tokenizer_path() -> Path:
    """The real Qwen3 tokenizer.json from ../shared; skips the test when it is absent."""
    if not QWEN3_TOKENIZER.is_file():
        pytest.skip(f"shared tokenizer not found at {QWEN3_TOKENIZER}")
    return QWEN3_TOKENIZER


@pytest.fixture
def mllm_demo_json() -> Path:
    """The real mllm_demo records (ShareGPT) from ../shared; skips the test when they are absent."""
    if not MLLM_DEMO_JSON.is_file():
        pytest.skip(f"shared mllm_demo data not found at {MLLM_DEMO_JSON}")
    return MLLM_DEMO_JSON


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when CUDA is not available."""
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
