"""Observability: TensorBoard event files readable by tensorboard's own reader with loss, learning rate,
TFLOPs, data wait, params norm, zeros in the gradient and megatron-core timers; the FLOP count of packed
attention is per sample; W&B without the package is one clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmpack.packing.batch import MicroBatch
from tests.support.qwen2_5_vl import tiny_arch
from tests.support.trainer import make_packed_dataset, ok, train


@pytest.mark.ranks
@pytest.mark.slow
def test_tensorboard_events_hold_the_logged_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = make_packed_dataset(tmp_path / "data", n_samples=30, seed=3)
    tb = tmp_path / "tb"
    args = [
        "--data-path", str(data), "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--tensorboard-dir", str(tb), "--log-timers-to-tensorboard",
        "--log-params-norm", "--log-num-zeros-in-grad",
    ]  # fmt: skip
    run = ok(train(2, args, tmp_path / "run"))
    assert "TFLOPs/GPU:" in run.stdout and "data-wait ms (max over ranks)" in run.stdout
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "throughput/tflops-per-gpu", "data-wait-ms", "params-norm",
                "num-zeros", "grad-norm", "memory/max-rss-gb", "forward-backward-time", "forward-compute-time", "optimizer-time"):  # fmt: skip
        assert tag in tags, (tag, sorted(tags))
    losses = [(e.step, e.value) for e in events.Scalars("lm loss")]
    assert [s for s, _ in losses] == [1, 2, 3]
    assert [v for _, v in losses] == pytest.approx([m["loss"] for m in run.train], rel=1e-6)
    assert [e.value for e in events.Scalars("learning-rate")] == pytest.approx([m["lr"] for m in run.train])
    assert all(e.value > 0 for e in events.Scalars("throughput/tflops-per-gpu"))
    assert all(e.value >= 0 for e in events.Scalars("data-wait-ms"))
    assert all(e.value > 0 for e in events.Scalars("params-norm"))


def _batch(lengths: list[int], grids: list[list[int]] | None = None, pad: int = 0) -> MicroBatch:
    """A micro-batch of samples of these lengths (and a padding segment), with images of these grids (what
    the FLOP count reads: tokens, segments, grids; no pixels)."""
    import torch

    n = sum(lengths)
    tokens = torch.cat([torch.ones(n, dtype=torch.long), torch.full((3,), pad)])[None]
    cu = torch.tensor(np.concatenate([[0], np.cumsum([*lengths, 3])]), dtype=torch.int32)
    no_grids = torch.zeros((0, 3), dtype=torch.long)
    return MicroBatch(
        tokens=tokens, labels=tokens, loss_mask=torch.ones(tokens.shape), position_ids=tokens, cu_seqlens=cu,
        max_seqlen=max(lengths), num_real_tokens=n, pixel_values=torch.zeros((0, 1)),
        image_grid_thw=torch.tensor(grids) if grids else no_grids, pixel_values_videos=torch.zeros((0, 1)),
        video_grid_thw=no_grids, second_per_grid_ts=torch.zeros(0),
    )  # fmt: skip


def test_flops_are_the_family_formula_counted_per_sample() -> None:
    from mmpack.trainer.models.qwen2_5_vl import FAMILY
    from mmpack.trainer.observability import step_flops

    arch = tiny_arch()
    model = FAMILY.flop_model(arch)
    packed = step_flops(model, [_batch([100, 300])], pad_id=0)
    assert packed == pytest.approx(step_flops(model, [_batch([100]), _batch([300])], pad_id=0))
    as_one_sequence = step_flops(model, [_batch([400])], pad_id=0)  # control: the bin counted as one sample
    assert as_one_sequence > packed * 1.001
    # worked out by hand: 3 x forward; per token 2 * (layers * per-layer weights + logits), one causal pair
    h, g, d, f, v = (
        arch.hidden_size,
        arch.num_key_value_heads,
        arch.head_dim,
        arch.intermediate_size,
        arch.vocab_size,
    )
    weights = arch.num_layers * (h * (h + 2 * g * d) + h * h + 3 * h * f) + h * v
    attention = arch.num_layers * 4 * h * 1  # a sample of 1 token: n(n+1)/2 = 1 pair of 4h FLOPs per layer
    assert step_flops(model, [_batch([1])], pad_id=0) == pytest.approx(3 * (2 * weights + attention))
    # one image of 4 x 4 patches = one window of the tiny tower (16 patches): every layer attends over 16
    vis = arch.vision
    hv, fv, k = vis.hidden_size, vis.intermediate_size, vis.spatial_merge_size**2
    per_patch = 2 * 3 * 2 * 14 * 14 * hv + 2 * vis.depth * (4 * hv * hv + 3 * hv * fv)
    per_patch += 2 * (k * hv * k * hv + k * hv * h) / k + vis.depth * 4 * hv * 16
    image = step_flops(model, [_batch([1], [[1, 4, 4]])], pad_id=0) - step_flops(
        model, [_batch([1])], pad_id=0
    )
    assert image == pytest.approx(3 * 16 * per_patch)
    assert step_flops(model, [_batch([1], [[1, 8, 8]])], pad_id=0) > step_flops(
        model, [_batch([1], [[1, 4, 4]])], pad_id=0
    )


def test_wandb_without_the_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from mmpack.trainer.observability import MetricsSink, ObservabilityConfig

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"--wandb-project needs the wandb package \(pip install wandb\)"):
        MetricsSink(ObservabilityConfig(wandb_project="p"), is_logger=True, run_config={})
