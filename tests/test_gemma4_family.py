"""Gemma 4 (dense) through the whole path, against transformers' ``Gemma4ForConditionalGeneration``.

A tiny random Gemma 4 of 6 layers (sliding / full alternating, window 16, the last two layers sharing the keys and
values of layers 2 and 3 with double-wide MLPs, full layers with their own head size, one KV head and values equal
to keys, per-layer embeddings, bidirectional image attention, logit softcap 30, layer scalars not 1) in a model
folder of the stand-in tokenizer (tests/support/gemma4.py); the six real mllm_demo records (three images of
different sizes, each longer than the window) packed into one bin by ``mmpack pack --model`` that folder.
transformers' loss is each sample alone, its inputs made by transformers' own processor from the record (the ids
equal the packed sample's), with ``mm_token_type_ids``: the sum of token cross-entropies over the loss tokens /
their count.

- TP1: the trainer logs that loss;
- TP2 x PP2 with sequence parallelism (the first stage holds layers 0-1, the second the KV-sharing layers and their
  sources): the same loss; the gradients of the PLE table, of a sliding-window layer's query projection and of the
  vision tower's patch projection equal transformers'; controls on our side: another window, causal image
  attention and zeroed image features each move the loss by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export gives the same loss.

This file is also the torchrun worker of the multi-rank step.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import gemma4
from tests.support.hf_parity import (
    check_convert_round_trip,
    loss_and_grads,
    records_file,
    torchrun,
    train_args,
)
from tests.support.shared import MLLM_DEMO_JSON, VIDEO_DEMO, need_shared

pytestmark = [pytest.mark.family, pytest.mark.shared, pytest.mark.slow]

LAYERS = 6
FIRST_STAGE_LAYERS = 2
GRAD_PARAMS = {
    "language_model.embedding.per_layer_embeddings.weight": "model.language_model.embed_tokens_per_layer.weight",
    "language_model.decoder.layers.0.self_attention.linear_q.weight": (
        "model.language_model.layers.0.self_attn.q_proj.weight"
    ),
    # full-attention layer 1 has one KV head: its K projection and norm are whole on both TP ranks
    "language_model.decoder.layers.1.self_attention.linear_k.weight": (
        "model.language_model.layers.1.self_attn.k_proj.weight"
    ),
    "language_model.decoder.layers.1.self_attention.k_layernorm.weight": (
        "model.language_model.layers.1.self_attn.k_norm.weight"
    ),
    "vision.patch_embedder.input_proj.weight": "model.vision_tower.patch_embedder.input_proj.weight",
    # shared by the heads TP cuts: the ranks' gradients summed
    "vision.layers.0.self_attention.q_norm.weight": "model.vision_tower.encoder.layers.0.self_attn.q_norm.weight",
}

EXPERTS_OF_LAYER_0 = "language_model.decoder.layers.0.mlp.experts.local_experts."


def _global_loss(losses: list) -> float:
    """A step's loss over every data-parallel rank (``step_loss`` is this rank's micro-batches'); NaN off the last
    pipeline stage."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    total = torch.tensor(
        [sum(float(x["lm loss"][0]) for x in losses), sum(float(x["lm loss"][1]) for x in losses)],
        dtype=torch.float64,
    )
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total[0] / total[1]) if total[1] else float("nan")


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss and gradients (before the optimizer), then the loss under the controls."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    trainer.model.zero_grad_buffer()
    loss = _global_loss(trainer._run_schedule(batches, forward_only=False))
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    stage = trainer.model.module
    grads = {n: p.main_grad.detach().clone() for n, p in stage.named_parameters() if n in GRAD_PARAMS}
    torch.save(grads, Path(out_dir) / f"grads_tp{tp}_pp{pp}.pt")
    experts = {
        n: p.main_grad.detach().clone()
        for n, p in stage.named_parameters()
        if n.startswith(EXPERTS_OF_LAYER_0)
    }
    if experts:  # the MoE variant: this rank's experts of layer 0, cut over expert TP
        etp, ep = ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank()
        torch.save(experts, Path(out_dir) / f"experts_etp{etp}_ep{ep}.pt")
    attention = [layer.self_attention for layer in stage.language_model.decoder.layers]
    controls = {}
    with torch.no_grad():
        for a in attention:
            a.window = None if a.window is None else a.window + 8
        controls["window_24"] = _global_loss(trainer._run_schedule(batches, forward_only=True))
        for a in attention:
            a.window = None if a.window is None else a.window - 8
            a.bidirectional, a.was_bidirectional = False, a.bidirectional
        controls["causal_images"] = _global_loss(trainer._run_schedule(batches, forward_only=True))
        for a in attention:
            a.bidirectional = a.was_bidirectional
        if stage.vision is not None:
            stage.vision.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
        controls["zeroed_images"] = _global_loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        (Path(out_dir) / "losses.json").write_text(json.dumps({"loss": loss, **controls}))
    dist.barrier()
    trainer.close()
    shutdown()


# -- the test side ----------------------------------------------------------------------------------------


def _reference(hf_dir: Path, packed: Path, root: Path, edit: Any = None, bins: int = 1) -> dict:
    """transformers' loss and gradients over the packed samples one by one, each from its record by transformers'
    processor (the record is found by its ids); ``edit``: a change to transformers' model first (a control)."""
    from transformers import Gemma4Config

    from tests.support.hf_parity import loader_samples

    processor = gemma4.reference_processor(hf_dir)
    model = gemma4.tiny_model(Gemma4Config.from_pretrained(hf_dir))
    model.load_state_dict(_hf_weights(hf_dir), strict=False)
    if edit is not None:
        edit(model)
    records = [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]
    by_ids = {}
    for record in records:
        inputs = gemma4.reference_inputs(processor, record, root)
        by_ids[tuple(inputs["input_ids"][0].tolist())] = inputs
    samples = loader_samples(packed, layout=[(True, False)] * len(records), bins=bins)
    ref_inputs = []
    for s in samples:
        inputs = dict(by_ids[tuple(s["tokens"].tolist())])  # KeyError: the packed ids are not the processor's
        ids, types = inputs.pop("input_ids")[0], inputs.pop("mm_token_type_ids")[0]
        ref_inputs.append((ids, s["labels"], types, inputs))
    model.train()  # no dropout in Gemma 4; train mode only to keep gradients on
    return loss_and_grads(model, ref_inputs)


def _hf_weights(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny model folder, the packed records and transformers' loss and gradients on them."""
    return _packed_model(tmp_path_factory.mktemp("gemma4"), gemma4.tiny_config(layers=LAYERS))


def _packed_model(root: Path, config: Any, seq_len: int = 2048) -> dict:
    import torch

    from mmpack.cli import main as mmpack

    need_shared(gemma4.GEMMA4_TOKENIZER_DIR, MLLM_DEMO_JSON, what="gemma4_tokenizer and mllm_demo")
    hf = gemma4.model_folder(root / "hf")
    model = gemma4.tiny_model(config)
    with (
        torch.no_grad()
    ):  # layer scalars, norms and router scales away from their defaults, so that rules count
        for i, layer in enumerate(model.model.language_model.layers):
            layer.layer_scalar.fill_(0.75 + 0.125 * i)
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(hf)
    records = records_file(root, with_video=False)
    packed = root / "packed"
    args = [
        "pack",
        "-i",
        str(records),
        "-o",
        str(packed),
        "-L",
        str(seq_len),
        "--model",
        str(hf),
        "--no-progress",
    ]
    assert mmpack(args) == 0
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    assert counts["samples_packed"] == 6 and (seq_len < 2048 or counts["bins"] == 1)
    bins = counts["bins"]
    ref = _reference(hf, packed, root, bins=bins)
    return {"root": root, "hf": hf, "packed": packed, "bins": bins, "ref": ref}


@pytest.mark.ranks
def test_tp1_trainer_logs_transformers_loss(setup: dict, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    args = [*train_args(setup["hf"], setup["packed"], 1, 1), "--metrics-file", str(metrics)]
    torchrun(1, ["-m", "mmpack.trainer.pretrain_vlm", *args], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    ref = setup["ref"]
    print(f"TP1: logged loss {step['loss']!r}, transformers {ref['loss']!r}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.ranks
def test_tp2_pp2_loss_gradients_and_controls(setup: dict, tmp_path: Path) -> None:
    import torch

    from mmpack.trainer.models import family_of, read_hf_config
    from mmpack.trainer.models.hf_weights import merge_tp_shards

    args = [
        *train_args(setup["hf"], setup["packed"], 2, 2), "--sequence-parallel",
        "--decoder-first-pipeline-num-layers", str(FIRST_STAGE_LAYERS),
    ]  # fmt: skip
    torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    print(f"TP2xPP2: loss {losses['loss']!r}, transformers {ref['loss']!r}, controls {losses}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for control in ("window_24", "causal_images", "zeroed_images"):
        gap = abs(losses[control] - ref["loss"]) / ref["loss"]
        # each control fails the 1e-5 comparison above (they move the loss by 3e-5 to 1e-3 here)
        assert gap > 1e-5, f"control {control}: the loss moves by only {gap:.2e} (relative)"
    config = read_hf_config(setup["hf"])
    fam = family_of(config)
    arch = fam.arch_from_hf_config(config)
    rules = fam.hf.part_rules(arch, first=True, last=False, layers=(0, FIRST_STAGE_LAYERS))
    shards = [torch.load(tmp_path / f"grads_tp{t}_pp0.pt") for t in range(2)]
    for name, hf_name in GRAD_PARAMS.items():
        [(merged_name, grad)] = merge_tp_shards(rules[name], [s[name] for s in shards]).items()
        assert merged_name == hf_name
        expected = ref["grads"][hf_name]
        scale = float(expected.abs().max())
        diff = float((grad - expected).abs().max())
        print(f"grad {hf_name}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
        # transformers' own gradients move by up to 1.6e-5 of the largest entry (7e-6 in norm) with SDPA in place
        # of eager attention and the samples in reverse order: fp32's floor on this model, so 5e-5 here
        assert scale > 0 and diff <= 5e-5 * scale, (hf_name, diff, scale)


@pytest.mark.ranks
def test_video_record_packs_with_the_rules_tokens_and_trains_a_step(setup: dict, tmp_path: Path) -> None:
    """A real video packed by the model folder's Gemma 4 video rule holds the rule's soft tokens (transformers'
    frame sampling and size rule, tests/support/gemma4.py), and the trainer takes one step on it at TP1 (each frame
    through the tower)."""
    import math

    from mmpack.cli import main as mmpack

    need_shared(VIDEO_DEMO, what="mllm_video_demo")
    record = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())[0]
    (tmp_path / "video.jsonl").write_text(json.dumps(record) + "\n")
    packed = tmp_path / "packed"
    args = ["pack", "-i", str(tmp_path / "video.jsonl"), "--image-root", str(VIDEO_DEMO), "-o", str(packed)]
    assert mmpack([*args, "-L", "4096", "--model", str(setup["hf"]), "--no-progress"]) == 0
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    processor = gemma4.reference_processor(setup["hf"])
    _, frames, per_frame = gemma4.reference_video_text(processor, VIDEO_DEMO / record["videos"][0])
    print(f"video: {len(frames)} frames x {per_frame} soft tokens; packed {counts['video_tokens']}")
    assert counts["videos"] == 1 and counts["video_tokens"] == len(frames) * per_frame
    metrics = tmp_path / "metrics.jsonl"
    train = [*train_args(setup["hf"], packed, 1, 1), "--metrics-file", str(metrics)]
    torchrun(1, ["-m", "mmpack.trainer.pretrain_vlm", *train], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    assert step["target_tokens"] > 0 and math.isfinite(step["loss"])


@pytest.mark.ranks
def test_checkpoint_saved_at_tp2_pp2_resumes_at_tp1(setup: dict, tmp_path: Path) -> None:
    """Three steps at lr > 0 (Adam) at TP2 x PP2 with SP, saved after the first; resumed at TP1 x PP1 the run goes on
    with the uninterrupted run's bins and losses. Control: the same resume without the optimizer state departs
    from it at the third step."""
    from mmpack.cli import main as mmpack
    from tests.support.trainer import check_continues, checkpoint_view, ok, train

    packed = tmp_path / "packed"
    args = ["pack", "-i", str(setup["root"] / "records.jsonl"), "-o", str(packed), "-L", "512"]
    assert mmpack([*args, "--model", str(setup["hf"]), "--no-progress"]) == 0
    common = [
        "--hf-model", str(setup["hf"]), "--data-path", str(packed), "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "3", "--lr", "3e-3", "--seed", "5", "--num-workers", "0",
    ]  # fmt: skip
    ckpt = tmp_path / "ckpt"
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    first = ["--decoder-first-pipeline-num-layers", str(FIRST_STAGE_LAYERS)]
    saving = ["--save", str(ckpt), "--save-interval", "1"]
    full = ok(train(4, [*common, *layout, *first, *saving], tmp_path / "full", tiny=False))
    view = checkpoint_view(ckpt, 1, tmp_path)
    resumed = ok(train(1, [*common, "--load", str(view)], tmp_path / "resumed", tiny=False))
    assert "resharded from TP 2 x PP 2" in resumed.stdout
    check_continues(resumed, full, save_at=1, total=3)
    print("full", [m["loss"] for m in full.train], "resumed", [m["loss"] for m in resumed.train])
    fresh = ok(train(1, [*common, "--load", str(view), "--no-load-optim"], tmp_path / "fresh", tiny=False))
    assert fresh.train[1]["loss"] != pytest.approx(full.train[2]["loss"], rel=1e-4)


@pytest.mark.ranks
def test_convert_round_trip_is_bit_exact(setup: dict, tmp_path: Path) -> None:
    """``mmpack convert`` HF -> megatron-core (TP2 x PP2, layer scalars included) -> HF gives back every tensor bit
    for bit, and the export gives transformers' loss again."""

    def reference(export: Path, packed: Path) -> dict:
        for name in gemma4.FOLDER_FILES:  # the processor's files, which the export does not write
            shutil.copy(setup["hf"] / name, export / name)
        return _reference(export, packed, setup["root"])

    check_convert_round_trip(setup, tmp_path, 2, 2, reference)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])


# -- the MoE variant --------------------------------------------------------------------------------------

EXPERTS = 4


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny MoE Gemma 4 (4 layers, 4 experts beside each dense MLP, 2 per token, PLE and KV sharing as above)."""
    # two bins: EP2 x TP2 on 4 ranks is DP 2 for the dense parameters
    return _packed_model(
        tmp_path_factory.mktemp("gemma4-moe"), gemma4.tiny_config(experts=EXPERTS), seq_len=512
    )


@pytest.mark.ranks
def test_moe_at_ep2_tp2_equals_transformers_with_expert_gradients(moe_setup: dict, tmp_path: Path) -> None:
    """EP2 x TP2 (sequence parallel, expert TP 2): transformers' loss, and the gradient of every expert of layer 0
    (its two EP ranks' experts, cut over expert TP) within 5e-5 of the largest entry; control: transformers' model
    with two experts' weights swapped gives another loss."""
    import torch

    from mmpack.trainer.models import family_of, read_hf_config
    from mmpack.trainer.models.hf_weights import merge_tp_shards

    assert moe_setup["bins"] == 2
    args = [
        *train_args(moe_setup["hf"], moe_setup["packed"], 2, 1), "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--global-batch-size", "2",
    ]  # fmt: skip
    torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = moe_setup["ref"]

    def swap(model: Any) -> None:
        experts = model.model.language_model.layers[0].experts
        with torch.no_grad():
            for p in (experts.gate_up_proj, experts.down_proj):
                p[[0, 1]] = p[[1, 0]].clone()

    swapped = _reference(moe_setup["hf"], moe_setup["packed"], moe_setup["root"], edit=swap, bins=2)["loss"]
    print(f"MoE EP2xTP2: loss {losses['loss']!r}, transformers {ref['loss']!r}, swapped experts {swapped!r}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert abs(swapped - ref["loss"]) / ref["loss"] > 1e-5
    config = read_hf_config(moe_setup["hf"])
    fam = family_of(config)
    assert fam.model_type == "gemma4_moe"
    rules = fam.hf.part_rules(fam.arch_from_hf_config(config), first=True, last=True, layers=(0, 4))
    expected_all = ref["grads"]["model.language_model.layers.0.experts.gate_up_proj"]
    per_rank = EXPERTS // 2
    for ep in range(2):
        shards = [torch.load(tmp_path / f"experts_etp{t}_ep{ep}.pt") for t in range(2)]
        for local in range(per_rank):
            expert = ep * per_rank + local
            ours = f"{EXPERTS_OF_LAYER_0}{local}.linear_fc1.weight"
            rule = rules[f"{EXPERTS_OF_LAYER_0}{expert}.linear_fc1.weight"]
            [(_, grad)] = merge_tp_shards(rule, [s[ours] for s in shards]).items()
            expected = expected_all[expert]
            scale, diff = float(expected.abs().max()), float((grad - expected).abs().max())
            print(f"expert {expert} gate_up gradient: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
            assert scale > 0 and diff <= 5e-5 * scale, (expert, diff, scale)


@pytest.mark.ranks
def test_moe_convert_round_trip_is_bit_exact(moe_setup: dict, tmp_path: Path) -> None:
    """``mmpack convert`` of the MoE variant, HF -> megatron-core (TP2 x PP2: experts cut over TP) -> HF, gives back
    every tensor bit for bit (router scales, stacked experts), and the export gives transformers' loss again."""

    def reference(export: Path, packed: Path) -> dict:
        for name in gemma4.FOLDER_FILES:
            shutil.copy(moe_setup["hf"] / name, export / name)
        return _reference(export, packed, moe_setup["root"], bins=moe_setup["bins"])

    check_convert_round_trip(moe_setup, tmp_path, 2, 2, reference)


def test_moe_at_tp1_and_thd_micro_batches_in_process(moe_setup: dict) -> None:
    """One rank, in process: a micro-batch of the MoE model's two bins gives transformers' loss (the MoE variant at
    TP1), and the same micro-batch flattened to one THD row (padded to a multiple of 3, as with Transformer Engine
    under SP) gives the same per-token losses. Control: the same THD row with the second bin's first sample
    counting on from the first bin's last one (one sample across the bins) gives other losses."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mmpack.dataloader import Topology, build_loader
    from mmpack.trainer import cpu_backend
    from mmpack.trainer.config import RunConfig, build_megatron_configs
    from mmpack.trainer.data import model_inputs, pad_flat_batch
    from mmpack.trainer.export_check import one_rank_group
    from mmpack.trainer.models import family_of, read_hf_config

    hf, packed = moe_setup["hf"], moe_setup["packed"]
    config = read_hf_config(hf)
    fam = family_of(config)
    arch = fam.arch_from_hf_config(config)
    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=2, global_batch_size=2,
        num_workers=0, num_epochs=1, position_rule=fam.position_rule(arch),
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    assert batch is not None and batch.tokens.shape[0] == 2
    flat = pad_flat_batch(batch, 3, arch.text.pad_token_id)
    assert flat.tokens.numel() > batch.tokens.numel()  # a padding segment was added
    cpu_backend.activate()
    with one_rank_group():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        stage = fam.build_stage(
            arch, build_megatron_configs(RunConfig(), arch).model, pre_process=True, post_process=True
        )
        fam.hf.load_stage_weights(stage, hf, arch, tp_rank=0, tp_size=1)
        stage.eval()
        with torch.no_grad():
            dense = stage(**model_inputs(batch, use_thd=False))
            inputs = model_inputs(flat, use_thd=True)
            thd = stage(**inputs)
            row = batch.tokens.shape[1]
            positions = inputs["position_ids"].clone()
            first = positions[0, 0, row:]
            end = row + int(torch.nonzero(first[1:] == 0)[0]) + 1  # the second bin's first sample
            positions[:, :, row:end] += positions[0, 0, row - 1] + 1
            merged = stage(**(inputs | {"position_ids": positions}))
    mask = batch.loss_mask.float()
    loss = float((dense * mask).sum() / mask.sum())
    print(f"MoE TP1 in process: loss {loss!r}, transformers {moe_setup['ref']['loss']!r}")
    assert loss == pytest.approx(moe_setup["ref"]["loss"], rel=1e-5)
    n = batch.tokens.numel()
    assert torch.allclose(thd.reshape(-1)[:n], dense.reshape(-1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(merged.reshape(-1)[:n], dense.reshape(-1), rtol=1e-6, atol=1e-6)
