"""On a CUDA machine: the CPU backend stays off, NCCL is used, and with Transformer Engine the packed batch
goes to attention as THD with cu_seqlens. Skipped without CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.trainer import train

pytestmark = [pytest.mark.ranks, pytest.mark.gpu, pytest.mark.slow]


def test_single_gpu_bf16_training(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = ["--mock-data", "--seq-length", "128", "--micro-batch-size", "2", "--train-iters", "3", "--bf16"]
    run = train(1, args, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "backend cuda/nccl" in run.stdout
    try:
        import transformer_engine  # noqa: F401

        assert "THD cu_seqlens (TE)" in run.stdout
    except ImportError:
        assert "block-diagonal mask" in run.stdout
    assert len(run.losses()) == 3 and all(math.isfinite(x) for x in run.losses())
