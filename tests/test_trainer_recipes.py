"""The stage recipes in trainer/examples/ (alignment, mid-training, SFT): each script's command line parses
with the trainer's argument parser into the intended stage (launched through a stand-in for torchrun that only
records its arguments; nothing trains)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer import REPO

EXAMPLES = REPO / "trainer" / "examples"


def _recipe_argv(script: str, args: list[str], tmp_path: Path) -> list[str]:
    """The trainer arguments ``script`` would launch (after ``-m mmpack.trainer.pretrain_vlm``)."""
    record = tmp_path / "argv.json"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    env = {**os.environ, "TORCHRUN": f"{sys.executable} {launcher}", "NPROC": "8"}
    proc = subprocess.run(["bash", str(EXAMPLES / script), *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(record.read_text())
    assert argv[:4] == ["--nproc_per_node", "8", "-m", "mmpack.trainer.pretrain_vlm"], argv
    return argv[4:]


@pytest.mark.parametrize(
    ("script", "first"),
    [("qwen2_5_vl_align.sh", "/models/qwen"), ("qwen2_5_vl_midtrain.sh", "ckpt/align"),
     ("qwen2_5_vl_sft.sh", "ckpt/mid")],
)  # fmt: skip
def test_recipe_flags_parse(tmp_path: Path, script: str, first: str) -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.freeze import trainable_set

    cfg = parse_args(_recipe_argv(script, [first, "packed/", "ckpt/out", "--train-iters", "7"], tmp_path))
    assert cfg.data.data_path == "packed/" and cfg.checkpoint.save == "ckpt/out"
    assert cfg.train.train_iters == 7  # extra flags pass through and win
    assert cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size <= 8
    allowed, frozen = trainable_set(
        cfg.model.trainable_modules, freeze_vision=cfg.model.freeze_vision, freeze_llm=cfg.model.freeze_llm
    )
    trains = {m for m in ("adapter", "vision_model", "language_model") if m in allowed and m not in frozen}
    if script == "qwen2_5_vl_align.sh":
        assert cfg.model.hf_model == first and cfg.checkpoint.load is None
        assert trains == {"adapter"}
        assert not cfg.parallel.use_distributed_optimizer  # a PP stage has nothing to train (see freeze)
    else:  # weights of the previous stage, everything else fresh
        assert cfg.checkpoint.load == first and cfg.checkpoint.finetune and cfg.model.hf_model is None
        expected = (
            {"adapter", "vision_model", "language_model"}
            if "midtrain" in script
            else {"adapter", "language_model"}
        )
        assert trains == expected


def test_recipe_needs_its_arguments(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(EXAMPLES / "qwen2_5_vl_align.sh")], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: qwen2_5_vl_align.sh HF_DIR DATA_DIR" in proc.stderr
