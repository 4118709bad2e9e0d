"""Qwen3-VL-MoE with expert parallelism, against transformers' ``Qwen3VLMoeForConditionalGeneration``.

One packed dataset for all tests: the real mllm_demo records (8 images) and a real video packed into two
bins by ``mmpack pack --model DIR``, DIR a tiny random Qwen3-VL-MoE (4 experts, 2 per token, tied
embeddings, DeepStack, RoPE base 100) written by transformers. One step of both bins (global batch 2) at
lr 0; transformers' loss is each sample alone (tests/support/qwen3_vl.py), without its router
auxiliary loss (``output_router_logits`` off); the trainer's load-balancing coefficient is 0 here
(config.json's ``router_aux_loss_coef``), so that the gradients are the language loss's alone.

- EP2 (TP1, DP2): the loss, the gradients of the word embedding, a vision block and an expert equal
  transformers'; control: the experts of every layer in the wrong order change the loss;
- TP2 x EP2 (sequence parallel, experts not cut: expert TP 1): the logged loss is transformers';
- LoRA at EP2 from peft's adapters on the attention and the dense (vision and projector) linear modules: the
  loss, every adapter gradient and the loss after an Adam step are peft's on transformers (the experts are not
  adapted; tests/test_trainer_lora.py is the worker);
- ``mmpack convert`` round trip bit-exact, the export loads in transformers with the same loss.

This file is also the torchrun worker of the EP2 step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import qwen3_vl
from tests.support.hf_parity import check_convert_round_trip, model_inputs_of, records_file, torchrun
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, VIDEO_DEMO, need_shared

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.shared, pytest.mark.slow]

EXPERT = "language_model.decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
GRAD_PARAMS = (
    "language_model.embedding.word_embeddings.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
)


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss and gradients (before the optimizer), then the loss with each layer's local
    experts in reverse order."""
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
    loss = _loss(trainer._run_schedule(batches, forward_only=False))
    ep, dp = ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank()
    stage = trainer.model.module
    params = dict(stage.named_parameters())
    local = [EXPERT.format(j) for j in range(2)]
    grads = {n: params[n].main_grad.detach().clone() for n in (*GRAD_PARAMS, *local)}
    torch.save(grads, Path(out_dir) / f"grads_ep{ep}_dp{dp}.pt")
    with torch.no_grad():
        for layer in stage.language_model.decoder.layers:
            experts = layer.mlp.experts.local_experts
            a, b = experts[0].linear_fc1.weight, experts[1].linear_fc1.weight
            swapped = a.detach().clone()
            a.copy_(b)
            b.copy_(swapped)
        wrong_order = _loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        (Path(out_dir) / "losses.json").write_text(
            json.dumps({"loss": loss, "wrong_expert_order": wrong_order})
        )
    dist.barrier()
    trainer.close()
    shutdown()


def _loss(losses: list) -> float:
    """The step's loss over all DP ranks' micro-batches (the loss sums and token counts all-reduced)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sums = torch.tensor([[float(x["lm loss"][i]) for i in range(2)] for x in losses]).sum(0)
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1])


# -- the test side ----------------------------------------------------------------------------------------


def _reference(hf_dir: Path, packed: Path) -> dict:
    """transformers' loss and gradients over the samples of both bins, each alone."""
    return qwen3_vl.reference(hf_dir, packed, bins=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mmpack.cli import main as mmpack

    need_shared(
        QWEN3_TOKENIZER, MLLM_DEMO_JSON, VIDEO_DEMO, what="Qwen3 tokenizer, mllm_demo and mllm_video_demo"
    )
    root = tmp_path_factory.mktemp("qwen3-vl-moe")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    hf_dir = qwen3_vl.tiny_hf_model(root / "hf", ids, "qwen3_vl_moe", num_experts=4, moe_router_topk=2,
                                    ffn_hidden_size=48, moe_aux_loss_coeff=0)  # fmt: skip
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root)), "-o", str(packed), "-L", "640", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 2, manifest["counts"]
    assert manifest["counts"]["samples_packed"] == 7
    return {"root": root, "hf": hf_dir, "packed": packed, "ref": _reference(hf_dir, packed)}


def _train_args(setup: dict, tp: int, ep: int) -> list[str]:
    return [
        "--hf-model", str(setup["hf"]), "--data-path", str(setup["packed"]),
        "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
        "--expert-tensor-parallel-size", "1", *(["--sequence-parallel"] if tp > 1 else []),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "0",
        "--log-interval", "1", "--num-workers", "0",
    ]  # fmt: skip


def test_ep2_loss_gradients_and_wrong_expert_order(setup: dict, tmp_path: Path) -> None:
    import torch

    from mmpack.trainer.models import family
    from mmpack.trainer.models.hf_weights import merge_tp_shards

    torchrun(2, [str(Path(__file__).resolve()), str(tmp_path), *_train_args(setup, 1, 2)], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    print(f"EP2: loss {losses['loss']!r}, transformers {ref['loss']!r}, controls {losses}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    gap = abs(losses["wrong_expert_order"] - ref["loss"]) / ref["loss"]
    assert gap > 1e-3, f"wrong expert order moves the loss by only {gap:.2e} (relative)"
    fam = family("qwen3_vl_moe")
    arch = fam.arch_from_hf_config(json.loads((setup["hf"] / "config.json").read_text()))
    rules = fam.hf.stage_rules(arch, 0, 1)
    shards = {ep: torch.load(tmp_path / f"grads_ep{ep}_dp{ep}.pt") for ep in range(2)}
    ours = {k: v for n in GRAD_PARAMS for k, v in merge_tp_shards(rules[n], [shards[0][n]]).items()}
    # global expert 3 is local expert 1 of EP rank 1; its [gate; up] rows are transformers' gate_up_proj[3]
    ours["expert 3"] = shards[1][EXPERT.format(1)]
    expected = {name: ref["grads"][name] for name in ours if name != "expert 3"}
    expected["expert 3"] = ref["grads"]["model.language_model.layers.1.mlp.experts.gate_up_proj"][3]
    for name, grad in ours.items():
        scale = float(expected[name].abs().max())
        diff = float((grad - expected[name]).abs().max())
        print(f"grad {name}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
        assert scale > 0 and diff <= 1e-5 * scale, (name, diff, scale)


# the linear modules LoRA adapts in this model: the language model's attention (every decoder layer's MLP is
# experts, which are not adapted) and the vision tower's and projectors' (qkv, attn.proj, linear_fc1/2)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv", "attn.proj", "linear_fc1", "linear_fc2"]


def test_lora_at_ep2_equals_peft(setup: dict, tmp_path: Path) -> None:
    """LoRA at EP2 (DP2: a bin per rank) from peft's adapter folder, against peft on transformers."""
    from tests.support.lora_parity import check_lora_step, peft_reference, run_lora_step

    pytest.importorskip("peft")
    inputs = model_inputs_of(qwen3_vl.samples(setup["packed"], bins=2), seconds=False)
    ref = peft_reference(setup["hf"], setup["packed"], inputs, LORA_TARGETS, tmp_path / "adapter")
    results = run_lora_step(ref, tmp_path, 2, _train_args(setup, 1, 2))
    # Qwen3-VL's adapter gradients are noisier in fp32 than Qwen2.5-VL's: peft's own fp32 gradients are up to
    # 1.5e-5 of a tensor's largest entry off the fp64 ones (docs/fine-tuning.md), so that entry test takes 5e-5
    # (the norm test stays at 1e-5; a misplaced adapter is off by far more than either)
    check_lora_step(ref, results, 1, 1, "LoRA at EP2", max_entry_rel=5e-5)
    assert results[0]["loss"] == results[1]["loss"]  # the whole global batch's on either DP rank
    for name, grad in results[0]["grads"].items():
        assert grad.equal(results[1]["grads"][name]), name
    assert not [n for n in results[0]["lora_params"] if ".experts." in n or ".router." in n]


@pytest.mark.parametrize(("tp", "ep"), [(2, 2)])
def test_logged_loss_is_transformers(setup: dict, tmp_path: Path, tp: int, ep: int) -> None:
    """TP2 x EP2 on two ranks (DP1; the experts spread, not cut): transformers' loss."""
    metrics = tmp_path / "metrics.jsonl"
    args = [*_train_args(setup, tp, ep), "--metrics-file", str(metrics)]
    torchrun(max(tp, ep), ["-m", "mmpack.trainer.pretrain_vlm", *args], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    ref = setup["ref"]
    print(f"TP{tp} x EP{ep}: logged lm loss {step['loss']!r}, transformers {ref['loss']!r}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    check_convert_round_trip(setup, tmp_path, 2, 1, _reference)  # TP2: the experts are cut over 2 ranks


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
