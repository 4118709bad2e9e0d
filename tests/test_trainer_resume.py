"""Resume: a run checkpointed at iteration 10 and resumed reproduces iterations 11..20 of an uninterrupted run,
with the loader continuing exactly, also when the DP size changes (same global batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainer import Run, checkpoint_view, make_packed_dataset, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

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
    folder = ckpt / "iter_0000010"
    assert (folder / "metadata.json").is_file()  # a complete dist_checkpointing checkpoint
    assert {f.name.split("_")[2] for f in folder.glob("__*.distcp")} == {"0", "1"}  # each rank its shards
    common = torch.load(folder / "common.pt", weights_only=False)
    assert common["iteration"] == 10 and common["layout"] == {"tp": 1, "pp": 1, "dp": 2, "vp": 1, "cp": 1}
    assert {"scheduler", "model_config", "optimizer"} <= set(common)
    index = (folder / ".metadata").read_bytes()
    for key in (b"loader_state/shard_0_2", b"loader_state/shard_1_2", b"rng_state/shard_0.0.0_1.1.2"):
        assert key in index, key


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
