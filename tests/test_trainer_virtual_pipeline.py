"""Interleaved (virtual) pipeline: the flags and the chunk split (no processes), and on CPU gloo processes
PP2 x VP2 training equal to one process on the same data (fp32, 1e-4 relative; control: another learning
rate is told apart), a checkpoint saved with VP2 resuming exactly with VP2 and resharding into PP1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mmpack.trainer.arguments import parse_args
from mmpack.trainer.config import ParallelConfig
from tests.support.trainer import Run, checkpoint_view, ok, train

SAVE_AT, TOTAL = 2, 4
COMMON = [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--seed", "5", "--lr", "3e-3",
    "--train-iters", str(TOTAL), "--use-distributed-optimizer",
]  # fmt: skip
VP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _parallel(*flags: str) -> ParallelConfig:
    return parse_args(["--mock-data", *flags]).parallel


def test_chunks_per_stage_from_either_flag() -> None:
    assert _parallel(*VP2).virtual_pipeline_size(4) == 2
    assert _parallel("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2").virtual_pipeline_size(8) == 2  # fmt: skip
    assert _parallel("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2").virtual_pipeline_size(8) == 2  # fmt: skip
    # one chunk per stage is the plain pipeline
    assert _parallel("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2").virtual_pipeline_size(4) is None  # fmt: skip
    assert _parallel("--pipeline-model-parallel-size", "2").virtual_pipeline_size(4) is None


def test_uneven_split_takes_chunks_per_stage() -> None:
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]
    par = _parallel(*uneven, "--virtual-pipeline-model-parallel-size", "2")
    assert par.stage_layer_counts(6) == [2, 4]
    assert par.virtual_pipeline_size(6) == 2
    with pytest.raises(ValueError, match="give --virtual-pipeline-model-parallel-size"):
        _parallel(*uneven, "--num-layers-per-virtual-pipeline-stage", "1").virtual_pipeline_size(6)
    odd = _parallel(
        "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
        "--virtual-pipeline-model-parallel-size", "2",
    )  # fmt: skip
    with pytest.raises(ValueError, match="positive multiple of 2 language layers, and the split is 1,5"):
        odd.virtual_pipeline_size(6)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size > 1"),
        ([*VP2, "--virtual-pipeline-model-parallel-size", "2"], "not both"),
        (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "0"], ">= 1"),
    ],
)
def test_bad_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parallel(*flags)


def test_micro_batches_per_step_must_fill_groups_of_pp() -> None:
    from mmpack.trainer.training import microbatches_per_step

    assert microbatches_per_step(parse_args(["--mock-data", *VP2, "--global-batch-size", "4"]), 1, 2) == 4
    odd = parse_args(["--mock-data", *VP2, "--global-batch-size", "6"])
    assert microbatches_per_step(odd, 2, None) == 3  # the plain pipeline takes any number
    with pytest.raises(ValueError, match="= 3 micro-batches per step is not a multiple of 2"):
        microbatches_per_step(odd, 2, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, packed_dataset: Callable[..., Path]) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("vpp")
    data = str(packed_dataset(n_samples=60, seed=4))
    base = ["--data-path", data, *COMMON]
    out = {
        "vp2": ok(train(2, [*base, *VP2, "--save", str(root / "ckpt"), "--save-interval", str(SAVE_AT)], root / "vp2")),
        "pp1": ok(train(1, base, root / "pp1")),
        "pp1_other_lr": ok(train(1, [*base, "--lr", "3.3e-3"], root / "lr")),
    }  # fmt: skip
    for name, nproc, layout in (("resume_vp2", 2, VP2), ("resume_pp1", 1, [])):
        (root / name).mkdir()
        view = checkpoint_view(root / "ckpt", SAVE_AT, root / name)
        out[name] = ok(train(nproc, [*base, *layout, "--load", str(view)], root / name))
    return out


def _assert_same_losses(run: Run, reference: list[dict], rel: float) -> None:
    assert [m["data_digest"] for m in run.train] == [m["data_digest"] for m in reference]
    for mine, ref in zip(run.train, reference, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=rel), (
            mine["iteration"],
            mine["loss"],
            ref["loss"],
        )


@pytest.mark.ranks
@pytest.mark.slow
def test_pp2_vp2_trains_like_one_process(runs: dict[str, Run]) -> None:
    vp2, pp1 = runs["vp2"], runs["pp1"]
    assert "world 2 = TP 1 x PP 2 x DP 1" in vp2.stdout
    assert "language layers per stage 2,2 (chunks: 0-0,2-2 | 1-1,3-3)" in vp2.stdout
    assert [m["iteration"] for m in vp2.train] == list(range(1, TOTAL + 1))
    _assert_same_losses(vp2, pp1.train, rel=1e-4)
    for mine, ref in zip(vp2.train, pp1.train, strict=True):
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


@pytest.mark.ranks
@pytest.mark.slow
def test_control_another_learning_rate_is_told_apart(runs: dict[str, Run]) -> None:
    """The comparison above can fail: with 10% more learning rate (one process, same data and weights) the
    same check raises (the losses of iterations 3 and 4 move by about 5e-4 relative)."""
    vp2, other = runs["vp2"], runs["pp1_other_lr"]
    assert [m["data_digest"] for m in other.train] == [m["data_digest"] for m in vp2.train]
    assert other.train[0]["loss"] == pytest.approx(vp2.train[0]["loss"], rel=1e-9)  # same weights at step 1
    with pytest.raises(AssertionError):
        _assert_same_losses(other, vp2.train, rel=1e-4)


@pytest.mark.ranks
@pytest.mark.slow
def test_vp2_checkpoint_resumes_exactly_and_reshards_to_pp1(runs: dict[str, Run]) -> None:
    tail = [m for m in runs["vp2"].train if m["iteration"] > SAVE_AT]
    same = runs["resume_vp2"]
    assert "at iteration 2" in same.stdout and "resharded" not in same.stdout
    assert [m["iteration"] for m in same.train] == [SAVE_AT + 1, TOTAL]
    assert [m["bins_consumed"] for m in same.train] == [m["bins_consumed"] for m in tail]
    _assert_same_losses(same, tail, rel=1e-12)
    resharded = runs["resume_pp1"]
    assert "at iteration 2 (resharded from TP 1 x PP 2 (VP 2) x DP 1)" in resharded.stdout
    _assert_same_losses(resharded, tail, rel=1e-4)
