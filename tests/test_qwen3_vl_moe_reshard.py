"""Resharding a mixture of experts over EP: a random Qwen3-VL-MoE (4 experts, 2 per token, load-balancing
loss on) saved at EP2 x PP2 (DP2) resumes at EP1 x PP1 (DP1, the same global batch), and one saved at EP1 x PP1
resumes at EP2 x PP2: the iteration after the resume equals that of the uninterrupted run (fp32, 1e-4 relative)
on the same bins."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer import check_continues, checkpoint_view, make_packed_dataset, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.slow]

MOE = [
    "--model-type", "qwen3_vl_moe", "--num-experts", "4", "--moe-router-topk", "2",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--seed", "5", "--lr", "3e-3",
    "--train-iters", "2",
]  # fmt: skip


def layout(ep: int, pp: int) -> list[str]:
    return ["--expert-model-parallel-size", str(ep), "--pipeline-model-parallel-size", str(pp)]


@pytest.mark.parametrize(
    ("saved", "resumed"), [((2, 2), (1, 1)), ((1, 1), (2, 2))], ids=["ep2pp2-to-ep1pp1", "ep1pp1-to-ep2pp2"]
)
def test_moe_checkpoint_reshards_over_ep(
    saved: tuple[int, int], resumed: tuple[int, int], tmp_path: Path
) -> None:
    data = make_packed_dataset(tmp_path / "data", n_samples=24, seed=4)
    ckpt = tmp_path / "ckpt"
    args = ["--data-path", str(data), *MOE]
    ranks = {(2, 2): 4, (1, 1): 1}  # EP x PP; DP fills the rest (EP2 x PP2: DP2)
    full = ok(
        train(
            ranks[saved],
            [*args, *layout(*saved), "--save", str(ckpt), "--save-interval", "1"],
            tmp_path / "full",
        )
    )
    assert [m["iteration"] for m in full.train] == [1, 2]
    view = checkpoint_view(ckpt, 1, tmp_path)
    again = ok(train(ranks[resumed], [*args, *layout(*resumed), "--load", str(view)], tmp_path / "resumed"))
    assert f"resumed from {view} at iteration 1" in again.stdout
    print(f"full {[m['loss'] for m in full.train]}, resumed {[m['loss'] for m in again.train]}")
    check_continues(again, full, save_at=1, total=2)
