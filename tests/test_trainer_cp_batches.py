"""Micro-batch size and context parallelism over the same bins (fp32, CPU, gloo): a global batch of 4 packed
bins (with images) trained at MBS 1, 2 and 4 (CP 1), and at MBS 2 x CP 2 (several bins flattened into one THD
sequence, split per sample), gives the same losses and gradient norms within 1e-5 at every iteration; the
CP 2 run's checkpoint resumes at CP 1 and continues it (same bins, same token checksums, same losses)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.trainer import checkpoint_view, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

SAVE_AT, TOTAL = 2, 4
COMMON = [
    "--global-batch-size", "4", "--seed", "5", "--lr", "3e-3", "--lr-warmup-iters", "1",
    "--train-iters", str(TOTAL),
]  # fmt: skip


def _same_steps(mine: list[dict], ref: list[dict]) -> None:
    assert [m["iteration"] for m in mine] == [m["iteration"] for m in ref]
    assert [m["bins_consumed"] for m in mine] == [m["bins_consumed"] for m in ref]
    for a, b in zip(mine, ref, strict=True):
        assert a["target_tokens"] == b["target_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)


def test_micro_batch_sizes_and_cp2_agree_and_cp2_resumes_at_cp1(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    data = packed_dataset(n_samples=60, seed=4)
    assert json.loads((data / "manifest.json").read_text())["counts"]["image_tokens"] > 0
    ckpt = tmp_path / "ckpt"
    base = ["--data-path", str(data), *COMMON]
    cp2 = ok(train(2, [*base, "--micro-batch-size", "2", "--context-parallel-size", "2", "--save", str(ckpt),
                       "--save-interval", str(SAVE_AT)], tmp_path / "cp2"))  # fmt: skip
    assert "x CP 2 x DP 1" in cp2.stdout
    runs = {
        mbs: ok(train(1, [*base, "--micro-batch-size", str(mbs)], tmp_path / f"mbs{mbs}"))
        for mbs in (1, 2, 4)
    }
    for mbs in (2, 4):
        _same_steps(runs[mbs].train, runs[1].train)
    _same_steps(cp2.train, runs[1].train)
    view = checkpoint_view(ckpt, SAVE_AT, tmp_path)
    resumed = ok(train(1, [*base, "--micro-batch-size", "1", "--load", str(view)], tmp_path / "resumed"))
    assert "resharded from TP 1 x PP 1 x CP 2 x DP 1" in resumed.stdout
    tail = [m for m in cp2.train if m["iteration"] > SAVE_AT]
    _same_steps(resumed.train, tail)
    # the same bins in the same micro-batches (the checksum weighs each token by its place in the micro-batch)
    assert [m["data_digest"] for m in resumed.train] == [m["data_digest"] for m in runs[1].train[SAVE_AT:]]
