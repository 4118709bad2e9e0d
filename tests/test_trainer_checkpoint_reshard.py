"""Resharding on load: a checkpoint saved at TP2 x PP1 x DP2 (4 ranks, distributed optimizer) resumes at
TP1 x PP2 x DP1 (2 ranks: TP, PP and DP all change) and at TP1 x PP1 x DP4 (4 ranks: fewer TP, more DP ranks),
and the iterations after the resume equal those of an uninterrupted run (fp32, 1e-4 relative) on exactly the
same data (same bins, same token checksums)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.trainer import Run, check_continues, checkpoint_view, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

SAVE_AT, TOTAL = 3, 5
COMMON = [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--seed", "5", "--lr", "3e-3",
    "--lr-warmup-iters", "2", "--train-iters", str(TOTAL), "--use-distributed-optimizer",
]  # fmt: skip


def layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, packed_dataset: Callable[..., Path]
) -> tuple[Path, Path, Run]:
    root = tmp_path_factory.mktemp("reshard")
    data = packed_dataset(n_samples=120, seed=4)
    ckpt = root / "ckpt"
    args = ["--data-path", str(data), *COMMON, *layout(2, 1), "--save", str(ckpt)]
    full = ok(train(4, [*args, "--save-interval", str(SAVE_AT)], root / "full"))  # TP2 x PP1 x DP2
    assert [m["iteration"] for m in full.train] == list(range(1, TOTAL + 1))
    return data, ckpt, full


@pytest.mark.parametrize(("nproc", "tp", "pp"), [(2, 1, 2), (4, 1, 1)])
def test_resume_under_another_layout_continues_the_run(
    saved: tuple[Path, Path, Run], tmp_path: Path, nproc: int, tp: int, pp: int
) -> None:
    data, ckpt, full = saved
    view = checkpoint_view(ckpt, SAVE_AT, tmp_path)
    resumed = ok(
        train(nproc, ["--data-path", str(data), *COMMON, *layout(tp, pp), "--load", str(view)], tmp_path)
    )
    assert f"resumed from {view} at iteration {SAVE_AT} (resharded from TP 2 x PP 1 x DP 2)" in resumed.stdout
    check_continues(resumed, full, save_at=SAVE_AT, total=TOTAL)


def test_resume_with_an_uneven_pipeline_split(saved: tuple[Path, Path, Run], tmp_path: Path) -> None:
    """Saved with the 4 language layers on one stage, resumed at TP1 x PP2 with 1 on the first stage (beside
    the vision tower) and 3 on the last: the layers are stored by global number, so the run continues
    unchanged."""
    data, ckpt, full = saved
    view = checkpoint_view(ckpt, SAVE_AT, tmp_path)
    args = ["--data-path", str(data), *COMMON, *layout(1, 2), "--load", str(view)]
    resumed = ok(train(2, [*args, "--decoder-first-pipeline-num-layers", "1"], tmp_path))
    assert "language layers per stage 1,3 |" in resumed.stdout
    check_continues(resumed, full, save_at=SAVE_AT, total=TOTAL)


def test_resume_without_optimizer_state_differs(saved: tuple[Path, Path, Run], tmp_path: Path) -> None:
    """Control: the same resume with a fresh optimizer (--no-load-optim) does not match the full run, so
    the equality above depends on the resharded optimizer state."""
    data, ckpt, full = saved
    view = checkpoint_view(ckpt, SAVE_AT, tmp_path)
    args = ["--data-path", str(data), *COMMON, *layout(1, 2), "--load", str(view), "--no-load-optim"]
    resumed = ok(train(2, args, tmp_path))  # the layout of the first resume above
    tail = [m for m in full.train if m["iteration"] > SAVE_AT]
    assert [m["data_digest"] for m in resumed.train] == [m["data_digest"] for m in tail]
    assert resumed.train[0]["loss"] == pytest.approx(tail[0]["loss"], rel=1e-4)  # same weights at the resume
    assert resumed.train[1]["loss"] != pytest.approx(tail[1]["loss"], rel=1e-4)
