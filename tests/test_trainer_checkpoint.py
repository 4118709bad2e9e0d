"""Checkpoint behaviour users rely on: ``--save X --load X`` on an empty folder starts at iteration 0 and
later resumes from X; a checkpoint of another model is one clear error naming both; ``--finetune`` takes the
weights only; ``--async-save`` writes complete checkpoints in the background."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.trainer import TINY, Run, checkpoint_view, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "2", "--seed", "4", "--lr", "2e-3"]


@pytest.fixture(scope="module")
def data(packed_dataset: Callable[..., Path]) -> Path:
    return packed_dataset(n_samples=40, seed=6)


@pytest.fixture(scope="module")
def same_folder(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run, Run]:
    """Two launches of the same command line with --save X --load X: 2 iterations, then up to 4."""
    root = tmp_path_factory.mktemp("same")
    ckpt = root / "ckpt"
    args = ["--data-path", str(data), *COMMON, "--save", str(ckpt), "--load", str(ckpt)]
    first = ok(train(1, [*args, "--train-iters", "2"], root / "first"))
    second = ok(train(1, [*args, "--train-iters", "4"], root / "second"))
    return ckpt, first, second


def test_empty_folder_starts_at_iteration_zero_then_resumes(same_folder: tuple[Path, Run, Run]) -> None:
    ckpt, first, second = same_folder
    assert f"no checkpoint in {ckpt}: training starts at iteration 0" in first.stdout
    assert [m["iteration"] for m in first.train] == [1, 2]
    assert f"resumed from {ckpt} at iteration 2" in second.stdout
    assert [m["iteration"] for m in second.train] == [3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_another_model_is_one_clear_error(
    same_folder: tuple[Path, Run, Run], data: Path, tmp_path: Path
) -> None:
    """What the trainer checks on --load (``checkpoint.check_model_config``: the saved model's config against
    the one this run builds from its flags), without a launch: a checkpoint of another model (here another
    --hidden-size) is one message naming both. That such a refusal reaches the user as one line, without a
    traceback, is the launch in tests/test_trainer_checkpoint_faults.py (the same path: a ValueError of the
    Trainer); the dataset's is tests/test_trainer_dataset_refusal.py."""
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.build import model_hf_config
    from mmpack.trainer.checkpoint import CheckpointMismatchError, check_model_config, load_common
    from mmpack.trainer.data import dataset_info

    ckpt, _, _ = same_folder
    view = checkpoint_view(ckpt, 2, tmp_path)  # without hf_config.json: the size flags build the model
    saved = load_common(view, 2)["model_config"]
    where = view / "iter_0000002"

    def built(*flags: str) -> dict:
        cfg = parse_args([*TINY, "--data-path", str(data), *COMMON, "--load", str(view), *flags])
        return model_hf_config(cfg, dataset_info(cfg.data.train_data, cfg.train.seq_length))

    check_model_config(saved, built(), where)  # control: the flags of the run that saved it build its model
    with pytest.raises(CheckpointMismatchError) as refused:
        check_model_config(saved, built("--hidden-size", "32"), where)
    message = str(refused.value)
    assert "\n" not in message
    assert f"checkpoint {where} holds another model than this run builds" in message
    assert "saved qwen2_5_vl (vocab_size=" in message and "hidden_size=64" in message
    assert "this run qwen2_5_vl (" in message and "hidden_size=32" in message


def test_finetune_loads_weights_only(same_folder: tuple[Path, Run, Run], data: Path, tmp_path: Path) -> None:
    ckpt, first, _ = same_folder
    view = checkpoint_view(ckpt, 2, tmp_path)
    args = ["--data-path", str(data), *COMMON, "--load", str(view), "--finetune", "--train-iters", "1"]
    tuned = ok(train(1, args, tmp_path / "tuned"))
    assert "(--finetune: starting at iteration 0)" in tuned.stdout
    assert [m["iteration"] for m in tuned.train] == [1]
    assert tuned.train[0]["data_digest"] == first.train[0]["data_digest"]  # the data stream starts afresh
    assert tuned.train[0]["loss"] < first.train[0]["loss"]  # from the trained weights, not a fresh init


def test_async_save_writes_complete_checkpoints(data: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = ["--data-path", str(data), *COMMON, "--save", str(ckpt), "--save-interval", "1", "--async-save"]
    ok(train(1, [*args, "--train-iters", "3"], tmp_path / "async"))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    for it in (1, 2, 3):
        assert (ckpt / f"iter_{it:07d}" / "metadata.json").is_file()
    resumed = ok(
        train(1, ["--data-path", str(data), *COMMON, "--load", str(ckpt), "--train-iters", "4"], tmp_path)
    )
    assert [m["iteration"] for m in resumed.train] == [4]


def test_overlapped_communication_gives_the_same_run(data: Path, tmp_path: Path) -> None:
    """--overlap-grad-reduce / --overlap-param-gather (distributed optimizer, DP2) change when the
    collectives run, not what the run computes; a checkpoint saved after a step holds the gathered
    parameters (the resume continues the run)."""
    args = ["--data-path", str(data), *COMMON, "--global-batch-size", "4", "--train-iters", "4",
            "--use-distributed-optimizer"]  # fmt: skip
    plain = ok(train(2, args, tmp_path / "plain"))
    ckpt = tmp_path / "ckpt"
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    saving = [*overlap, "--save", str(ckpt), "--save-interval", "3"]
    overlapped = ok(train(2, [*args, *saving], tmp_path / "overlapped"))
    assert overlapped.losses() == pytest.approx(plain.losses(), rel=1e-6)
    view = checkpoint_view(ckpt, 3, tmp_path)
    resumed = ok(train(2, [*args, *overlap, "--load", str(view)], tmp_path / "resumed"))
    assert resumed.losses() == pytest.approx(plain.losses()[3:], rel=1e-5)
