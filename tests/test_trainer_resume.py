"""Resume: a run checkpointed at iteration 10 and resumed reproduces iterations 11..20 of an uninterrupted run,
with the loader continuing exactly, also when the DP size changes (same global batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_trainer_support import Run, checkpoint_view, make_packed_dataset, ok, train

pytestmark = pytest.mark.slow

COMMON = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--seed",
    "9",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "3",
    "--train-iters",
    "20",
    "--use-distributed-optimizer",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Run]:
    root = tmp_path_factory.mktemp("resume")
    data = make_packed_dataset(root / "data", n_samples=160, seed=2)
    ckpt = root / "ckpt"
    full = ok(
        train(
            2,
            ["--data-path", str(data), *COMMON, "--save", str(ckpt), "--save-interval", "10"],
            root / "full",
        )
    )
    return data, ckpt, full


def _check_continues(resumed: Run, full: Run, rel: float) -> None:
    tail = [m for m in full.train if m["iteration"] > 10]
    assert [m["iteration"] for m in resumed.train] == list(range(11, 21))
    assert [m["data_digest"] for m in resumed.train] == [m["data_digest"] for m in tail]
    assert [m["bins_consumed"] for m in resumed.train] == [m["bins_consumed"] for m in tail]
    for mine, ref in zip(resumed.train, tail, strict=True):
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-9)
        assert mine["loss"] == pytest.approx(ref["loss"], rel=rel, abs=1e-6), (mine, ref)


def test_checkpoint_holds_every_dp_ranks_loader_state(setup: tuple[Path, Path, Run]) -> None:
    _, ckpt, _ = setup
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    files = sorted((ckpt / "iter_0000010").glob("tp*.pt"))
    assert [f.name for f in files] == ["tp00_pp00_dp00.pt", "tp00_pp00_dp01.pt"]
    assert (ckpt / "iter_0000010" / "distopt_tp00_pp00.pt").exists()  # gathered distributed-optimizer state
    states = [torch.load(f, weights_only=False) for f in files]
    assert {s["iteration"] for s in states} == {10}
    assert all(s["loader"]["bins_consumed"] == 40 for s in states)  # 10 steps x global batch 4
    assert all(key in states[0] for key in ("model", "optimizer", "scheduler", "rng"))


def test_resume_same_dp_size_is_exact(setup: tuple[Path, Path, Run], tmp_path: Path) -> None:
    data, ckpt, full = setup
    view = checkpoint_view(ckpt, 10, tmp_path)
    resumed = ok(train(2, ["--data-path", str(data), *COMMON, "--load", str(view)], tmp_path))
    assert "resumed from" in resumed.stdout
    _check_continues(resumed, full, rel=1e-6)


def test_resume_with_other_dp_size(setup: tuple[Path, Path, Run], tmp_path: Path) -> None:
    data, ckpt, full = setup
    view = checkpoint_view(ckpt, 10, tmp_path)
    resumed = ok(train(1, ["--data-path", str(data), *COMMON, "--load", str(view)], tmp_path))
    _check_continues(resumed, full, rel=1e-4)  # DP 2 -> 1 changes only the order of float sums
