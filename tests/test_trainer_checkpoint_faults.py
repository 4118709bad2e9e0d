"""Checkpoint faults on one small TP1 checkpoint (iterations 1..3, the run stopped by --exit-interval 3):
every iteration is committed with checksums; damaged files (zeroed bytes, truncated or missing .distcp /
.metadata / common.pt) are named in one line with the previous good iteration; a tracker pointing at a
half-written iteration falls back to the newest complete one; `mmpack convert` keeps a training run's
folder and an export folder by the ownership rule. Two trainer launches in all: the checkpoint's, and one
load that falls back and is refused."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from mmpack.packing.ownership import MARKER_NAME, FolderNotOwned, claim_folder, read_marker
from mmpack.trainer.checkpoint_commit import (
    CorruptCheckpointError,
    claim_checkpoint_folder,
    resolve_iteration,
    verify_checkpoint,
)
from tests.support.ranks import warm_start_method
from tests.support.trainer import Run, ok, train

pytestmark = pytest.mark.slow

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "2", "--seed", "4", "--lr", "2e-3"]


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, packed_dataset: Callable[..., Path]
) -> tuple[Path, Path, Run]:
    """(dataset, checkpoint folder, run): saved at 1, 2, 3; --exit-interval 3 ends the 10-iteration run."""
    root = tmp_path_factory.mktemp("faults")
    data = packed_dataset(n_samples=40, seed=6)
    ckpt = root / "ckpt"
    args = ["--data-path", str(data), *COMMON, "--train-iters", "10", "--save", str(ckpt), "--save-interval",
            "1", "--exit-interval", "3"]  # fmt: skip
    return data, ckpt, ok(train(1, args, root / "run"))


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt, dest)
    return dest


@pytest.mark.ranks
def test_exit_interval_run_commits_every_iteration(saved: tuple[Path, Path, Run]) -> None:
    _, ckpt, run = saved
    assert [m["iteration"] for m in run.train] == [1, 2, 3]
    assert f"exiting after iteration 3: --exit-interval 3 reached; checkpoint of it in {ckpt}" in run.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert read_marker(str(ckpt))["kind"] == "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [f"iter_000000{i}" for i in (1, 2, 3)]
    for i in (1, 2, 3):
        folder = ckpt / f"iter_000000{i}"
        listed = json.loads((folder / "checksums.json").read_text())["files"]
        on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != "checksums.json"}
        assert {name: e["size"] for name, e in listed.items()} == on_disk
        assert {".metadata", "common.pt", "metadata.json"} < set(listed) and any(
            ".distcp" in n for n in listed
        )


def _largest_distcp(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _zero_bytes(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\0" * 4096)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGES: dict[str, tuple[Callable[[Path], Path], Callable[[Path], None], str]] = {
    "zeroed distcp": (_largest_distcp, _zero_bytes, "does not match its checksum (zeroed or changed bytes)"),
    "truncated distcp": (_largest_distcp, _truncate, "were written (truncated or replaced)"),
    "missing distcp": (_largest_distcp, Path.unlink, "is missing"),
    "truncated .metadata": (lambda f: f / ".metadata", _truncate, "were written (truncated or replaced)"),
    "missing .metadata": (lambda f: f / ".metadata", Path.unlink, "is missing"),
    "truncated common.pt": (lambda f: f / "common.pt", _truncate, "were written (truncated or replaced)"),
}


@pytest.mark.ranks
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_file_is_named_with_the_previous_good_iteration(
    saved: tuple[Path, Path, Run], tmp_path: Path, damage: str
) -> None:
    ckpt = _copy(saved[1], tmp_path)
    assert verify_checkpoint(ckpt, 3) is None  # control: the copy as saved verifies
    pick, spoil, what = DAMAGES[damage]
    path = pick(ckpt / "iter_0000003")
    spoil(path)
    with pytest.raises(CorruptCheckpointError) as caught:
        verify_checkpoint(ckpt, 3)
    message = str(caught.value)
    assert message.startswith(f"checkpoint iteration 3 is damaged: {path} ") and what in message
    assert message.endswith(
        f"the previous complete checkpoint is iteration 2 ({ckpt / 'iter_0000002'}): to resume from it, "
        f"write 2 into {ckpt / 'latest_checkpointed_iteration.txt'}"
    )


def _half_written(ckpt: Path, iteration: int) -> Path:
    """What a crash inside a save used to leave: the iteration's shards without its last files, the tracker
    already pointing at it."""
    half = ckpt / f"iter_{iteration:07d}"
    half.mkdir()
    for p in (ckpt / "iter_0000003").glob("*.distcp"):
        shutil.copy(p, half / p.name)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return half


@pytest.mark.ranks
def test_tracker_at_a_half_written_iteration_falls_back(
    saved: tuple[Path, Path, Run], tmp_path: Path
) -> None:
    ckpt = _copy(saved[1], tmp_path)
    half = _half_written(ckpt, 4)
    assert resolve_iteration(ckpt) == (
        3,
        f"warning: {ckpt / 'latest_checkpointed_iteration.txt'} points at iteration 4, but {half} is incomplete "
        "(no checksums.json): loading iteration 3, the newest complete checkpoint",
    )
    shutil.rmtree(half)
    assert resolve_iteration(ckpt)[0] == 3 and "iter_0000004 does not exist" in str(
        resolve_iteration(ckpt)[1]
    )
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    assert resolve_iteration(ckpt) == (3, None)  # control: a complete iteration is taken as it is


@pytest.mark.ranks
def test_trainer_falls_back_then_refuses_zeroed_bytes_in_one_line(
    saved: tuple[Path, Path, Run], tmp_path: Path
) -> None:
    """The tracker at a half-written iteration 4: the trainer goes to 3, whose zeroed bytes stop it with one
    line naming the file and iteration 2 (a launch, so the line is what a user sees)."""
    data, ckpt, _ = saved
    ckpt = _copy(ckpt, tmp_path)
    _half_written(ckpt, 4)
    spoiled = _largest_distcp(ckpt / "iter_0000003")
    _zero_bytes(spoiled)
    run = train(1, ["--data-path", str(data), *COMMON, "--train-iters", "5", "--load", str(ckpt)], tmp_path)
    assert run.returncode != 0 and run.train == []  # the worker exits 2, torchrun 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_vlm: error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert errors[0].startswith(f"pretrain_vlm: error: checkpoint iteration 3 is damaged: {spoiled} does not")
    assert "the previous complete checkpoint is iteration 2" in errors[0]
    assert "trainer/checkpoint" not in run.stderr  # no traceback of the trainer's (torchrun prints its own)


@pytest.mark.ranks
def test_unreadable_shard_of_a_checkpoint_without_checksums_is_one_line(
    saved: tuple[Path, Path, Run], tmp_path: Path
) -> None:
    """Iteration 3 as saved before checksums existed (no checksums.json), its largest .distcp truncated:
    torch's reader fails with a CheckpointException (a BaseException): one line, no traceback."""
    data, ckpt, _ = saved
    ckpt = _copy(ckpt, tmp_path)
    folder = ckpt / "iter_0000003"
    (folder / "checksums.json").unlink()
    _truncate(_largest_distcp(folder))
    run = train(1, ["--data-path", str(data), *COMMON, "--train-iters", "5", "--load", str(ckpt)], tmp_path)
    assert run.returncode != 0 and run.train == []
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_vlm: error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert errors[0].startswith(f"pretrain_vlm: error: checkpoint {folder} could not be read (rank 0: ")
    assert "has no checksums.json" in errors[0]
    assert "the previous complete checkpoint is iteration 2" in errors[0]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.ranks
def test_convert_refuses_a_training_runs_folder(
    saved: tuple[Path, Path, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.cli import main as mmpack

    ckpt = _copy(saved[1], tmp_path)
    hf = tmp_path / "hf"  # refused before the HF folder is read
    assert mmpack(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(ckpt)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        f"mmpack convert: error: --out {ckpt} holds the checkpoints of a training run (up to iteration 3): "
        "converting into it would point its latest_checkpointed_iteration.txt at iteration 0 and the next --load "
        "would restart the run there; give a new folder"
    ]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not (ckpt / "iter_0000000").exists() and not (ckpt / "iter_0000000.tmp").exists()


@pytest.mark.ranks
def test_export_replaces_an_earlier_sharded_export(saved: tuple[Path, Path, Run], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from mmpack.trainer.convert import mcore_to_hf

    out = tmp_path / "export"
    claim_folder(str(out), "hf-export")  # an earlier mmpack export, sharded, and a file of the user's
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in shards:
        (out / name).write_bytes(b"old shard")
    index = {"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "README.md").write_text("mine")
    mcore_to_hf(str(saved[1]), str(out), start_method=warm_start_method())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MARKER_NAME, "README.md", "config.json", "model.safetensors"]
    )
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask  # as any file, not 0600
    assert (out / "README.md").read_text() == "mine"
    assert "model.embed_tokens.weight" in load_file(str(out / "model.safetensors"))


@pytest.mark.ranks
def test_export_into_a_foreign_folder_is_refused(
    saved: tuple[Path, Path, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.cli import main as mmpack

    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's model")
    assert mmpack(["convert", "mcore-to-hf", "--ckpt", str(saved[1]), "--out", str(out)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(
        f"mmpack convert: error: HF export folder (--out) {out} is not empty and was not made by mmpack"
    ), errors
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the user's model"


def test_save_folder_claim(tmp_path: Path) -> None:
    """What the trainer does with --save before its first step: a foreign folder is refused; one the
    trainer wrote before folders were marked (only its layout in it) is adopted."""
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x")
    with pytest.raises(
        FolderNotOwned, match=r"checkpoint folder \(--save\) .* is not empty and was not made"
    ):
        claim_checkpoint_folder(foreign, role="checkpoint folder (--save)")
    assert not (foreign / MARKER_NAME).exists()
    legacy = tmp_path / "old-run"
    (legacy / "iter_0000010").mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("10")
    (legacy / "hf_config.json").write_text("{}")
    claim_checkpoint_folder(legacy, role="checkpoint folder (--save)")
    assert read_marker(str(legacy))["kind"] == "checkpoint"
