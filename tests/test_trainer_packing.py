"""No cross-contamination: the loss and gradients of one packed bin equal those of its samples run one by one.

The model runs in gloo processes started by torchrun (this file is also the worker script).
Loss convention on both sides: sum over target tokens / number of target tokens.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEQ = 160


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(out_path: str, tp: int) -> None:
    import numpy as np
    import torch

    from trainer.batches import SyntheticSpec, block_causal_mask, make_micro_batch, synthetic_sample
    from trainer.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig, build_megatron_configs
    from trainer.data import MOCK_VOCAB, model_inputs
    from trainer.model import VisionLanguageModel, init_layout_invariant
    from trainer.training import initialize_distributed

    model_cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vision_num_layers=1,
        vision_hidden_size=32,
        vision_num_attention_heads=2,
        vocab_size=MOCK_VOCAB["vocab_size"],
        image_pad_id=MOCK_VOCAB["image_pad"],
    )
    cfg = RunConfig(
        model=model_cfg,
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        train=TrainConfig(seq_length=SEQ, seed=3),
    )
    initialize_distributed(cfg)
    mcfg = build_megatron_configs(cfg)
    model = VisionLanguageModel(
        mcfg.language, mcfg.vision, model_cfg, seq_length=SEQ, pre_process=True, post_process=True
    )
    init_layout_invariant(model, 3, 0.02, model_cfg.num_layers)
    spec = SyntheticSpec(
        vocab_size=MOCK_VOCAB["vocab_size"],
        pad_id=MOCK_VOCAB["pad"],
        image_pad_id=MOCK_VOCAB["image_pad"],
        vision_start_id=MOCK_VOCAB["vision_start"],
        vision_end_id=MOCK_VOCAB["vision_end"],
        min_len=20,
        max_len=40,
        image_probability=0.7,
    )
    rng = np.random.default_rng(11)
    samples = [synthetic_sample(spec, rng) for _ in range(3)]
    assert sum(len(s.input_ids) for s in samples) < SEQ  # leaves a padding segment too
    assert sum(len(s.image_grid_thw) for s in samples) >= 2, "want several images in the bin"

    def run(batch: dict, mask_override: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = model_inputs(batch, use_thd=False)
        if mask_override is not None:
            inputs["attention_mask"] = mask_override
        per_token = model(**inputs)
        mask = batch["loss_mask"]
        return (per_token * mask).sum(), mask.sum()

    packed = make_micro_batch([samples], SEQ, spec.pad_id)
    loss_sum, n_targets = run(packed)
    (loss_sum / n_targets).backward()
    packed_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()

    separate_sum = torch.zeros(())
    for s in samples:
        alone = make_micro_batch([[s]], len(s.input_ids), spec.pad_id)
        s_sum, _ = run(alone)
        (s_sum / n_targets).backward()
        separate_sum = separate_sum + s_sum.detach()
    separate_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    # Negative control: plain causal attention across the whole row lets samples see each other.
    causal_only = block_causal_mask(torch.tensor([0, SEQ], dtype=torch.int32), 1, SEQ)
    with torch.no_grad():
        leaky_sum, _ = run(packed, causal_only)

    grad_diff = max(float((packed_grads[k] - separate_grads[k]).abs().max()) for k in packed_grads)
    grad_scale = max(float(g.abs().max()) for g in separate_grads.values())
    missing = [k for k, g in separate_grads.items() if float(g.abs().max()) == 0.0]
    result = {
        "packed_loss": float(loss_sum / n_targets),
        "separate_loss": float(separate_sum / n_targets),
        "leaky_loss": float(leaky_sum / n_targets),
        "max_grad_diff": grad_diff,
        "max_grad": grad_scale,
        "params_without_grad": missing,
        "num_params": len(packed_grads),
    }
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_bin_equals_samples_one_by_one(tmp_path: Path, tp: int) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(tp),
        "--master_port",
        str(_free_port()),
        str(Path(__file__).resolve()),
        str(out),
        str(tp),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["params_without_grad"] == [], "every parameter (vision encoder included) must get a gradient"
    assert r["packed_loss"] == pytest.approx(r["separate_loss"], rel=1e-5)
    assert r["max_grad_diff"] <= 1e-5 * r["max_grad"] + 1e-8, r
    assert abs(r["leaky_loss"] - r["packed_loss"]) > 1e-4, "control: without the block mask samples leak"


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
