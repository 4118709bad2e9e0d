"""No cross-contamination: the loss and gradients of one packed bin equal those of its samples run one by one.

The model runs on gloo ranks (``tests.support.ranks``, as torchrun would start them; this file is also the
worker script).
Loss convention on both sides: sum over target tokens / number of target tokens.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.ranks import checked, launch

pytestmark = [pytest.mark.ranks]

SEQ = 160


def _synthetic_bin_and_samples():
    """A bin of three synthetic samples (with images) and each sample as its own micro-batch."""
    import numpy as np

    from mmpack.packing.mrope import MRopeRule
    from mmpack.trainer.batches import SyntheticSpec, make_micro_batch, synthetic_sample
    from mmpack.trainer.data import MOCK_VOCAB

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

    rule = MRopeRule(image_pad_id=spec.image_pad_id, merge_size=spec.merge_size)
    packed = make_micro_batch([samples], SEQ, spec.pad_id, position_rule=rule)
    alone = [make_micro_batch([[s]], len(s.input_ids), spec.pad_id, position_rule=rule) for s in samples]
    return packed, alone


def _loader_bin_and_samples(data_path: str, seq: int, image_pad_id: int, merge: int):
    """The first loader micro-batch (one real bin) with >= 2 samples and an image, and each of its samples
    cut out of it as a micro-batch of its own (tokens, labels, positions, its images' patches)."""
    import dataclasses

    import torch

    from mmpack.dataloader import Topology, build_loader
    from mmpack.packing.mrope import MRopeRule

    loader = build_loader(
        data_path,
        topology=Topology(dp_rank=0, dp_size=1),
        micro_batch_size=1,
        global_batch_size=1,
        num_workers=0,
        num_epochs=1,
        position_rule=MRopeRule(image_pad_id=image_pad_id, merge_size=merge),
    )
    for batch in loader:
        cu = batch.cu_seqlens.tolist()
        real = int(batch.num_real_tokens)
        bounds = [(a, b) for a, b in itertools.pairwise(cu) if b <= real]
        if len(bounds) >= 2 and len(batch.image_grid_thw) >= 1:
            break
    else:
        raise AssertionError("no bin with two samples and an image")
    loader.close()
    grids = batch.image_grid_thw
    patches_per_image = (grids[:, 0] * grids[:, 1] * grids[:, 2]).tolist()
    tokens_per_image = [p // merge**2 for p in patches_per_image]
    patch_starts = [0, *torch.tensor(patches_per_image).cumsum(0).tolist()]
    samples, image = [], 0
    for a, b in bounds:
        toks = batch.tokens[:, a:b]
        n_img, pads = 0, int((toks == image_pad_id).sum())
        while pads > 0:
            pads -= tokens_per_image[image + n_img]
            n_img += 1
        assert pads == 0
        samples.append(
            dataclasses.replace(
                batch,
                tokens=toks,
                labels=batch.labels[:, a:b],
                loss_mask=batch.loss_mask[:, a:b],
                position_ids=batch.position_ids[:, :, a:b],  # positions restart per sample: its own alone
                cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32),
                max_seqlen=b - a,
                pixel_values=batch.pixel_values[patch_starts[image] : patch_starts[image + n_img]],
                image_grid_thw=grids[image : image + n_img],
                num_real_tokens=b - a,
            )
        )
        image += n_img
    assert image == len(grids)
    return batch, samples


def _worker(out_path: str, tp: int, source: str) -> None:
    import torch

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.batches import block_causal_mask
    from mmpack.trainer.build import build_stage_model, model_hf_config
    from mmpack.trainer.config import (
        ModelConfig,
        ParallelConfig,
        RunConfig,
        TrainConfig,
        build_megatron_configs,
    )
    from mmpack.trainer.data import dataset_info, model_inputs
    from mmpack.trainer.models.qwen2_5_vl import arch_from_hf_config
    from mmpack.trainer.training import initialize_distributed

    info = dataset_info(None if source == "synthetic" else source, SEQ if source == "synthetic" else 0)
    seq = info.seq_length
    model_cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            vision_num_layers=2, vision_hidden_size=32, vision_num_attention_heads=2,
                            init_method_std=0.2)  # fmt: skip
    cfg = RunConfig(
        model=model_cfg,
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        train=TrainConfig(seq_length=seq, seed=3),
    )
    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    initialize_distributed(cfg)
    arch = arch_from_hf_config(model_hf_config(cfg, info))
    mcfg = build_megatron_configs(cfg, arch)
    # a wide init (std 0.2) so attention is far from uniform: leaks across samples would show clearly
    model = build_stage_model(cfg, mcfg, arch, use_te=False)
    image_pad = info.image_pad_id
    merge = info.merge_size
    if source == "synthetic":
        packed, alone = _synthetic_bin_and_samples()
    else:
        packed, alone = _loader_bin_and_samples(source, seq, image_pad, merge)

    def run(batch: Any, mask_override: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = model_inputs(batch, use_thd=False)
        if mask_override is not None:
            inputs["attention_mask"] = mask_override
        per_token = model(**inputs)
        mask = batch.loss_mask
        return (per_token * mask).sum(), mask.sum()

    loss_sum, n_targets = run(packed)
    (loss_sum / n_targets).backward()
    packed_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()

    separate_sum = torch.zeros(())
    for one in alone:
        s_sum, _ = run(one)
        (s_sum / n_targets).backward()
        separate_sum = separate_sum + s_sum.detach()
    separate_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    # Negative control: plain causal attention across the whole row lets samples see each other.
    causal_only = block_causal_mask(torch.tensor([0, seq], dtype=torch.int32), 1, seq)
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
@pytest.mark.parametrize(("source", "tp"), [("synthetic", 1), ("synthetic", 2), ("loader", 2)])
def test_packed_bin_equals_samples_one_by_one(
    tmp_path: Path, packed_dataset: Callable[..., Path], source: str, tp: int
) -> None:
    """``loader``: a real bin (offline packer -> loader, real JPEG/PNG patches) cut into its samples."""
    if source == "loader":
        source = str(packed_dataset(n_samples=60, seed=4))
    out = tmp_path / "result.json"
    argv = [str(Path(__file__).resolve()), str(out), str(tp), source]
    checked(launch(tp, argv, tmp_path / "ranks", timeout_s=300))
    r = json.loads(out.read_text())
    assert r["params_without_grad"] == [], "every parameter (vision encoder included) must get a gradient"
    assert r["packed_loss"] == pytest.approx(r["separate_loss"], rel=1e-6)
    assert r["max_grad_diff"] <= 2e-6 * r["max_grad"] + 1e-8, r
    leak = abs(r["leaky_loss"] - r["packed_loss"])
    assert leak > 1e-3, f"control: with a plain causal mask the samples must leak (diff {leak})"


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
