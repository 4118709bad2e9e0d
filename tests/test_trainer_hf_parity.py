"""Parity with transformers through the whole path: the real mllm_demo samples (Qwen3 tokenizer) packed into one
bin by `mmpack pack`, read by the loader and trained for one iteration at lr 0 with `--hf-model` (a tiny random
Qwen2.5-VL written by transformers) at TP1, TP2 and TP2 x PP2. The logged `lm loss` must equal transformers'
loss on the same samples run one by one (sum of token cross-entropies over the loss tokens / their count);
gradients of the word embedding and of vision weights must match as well; a control with the image features
zeroed must differ by far more than the tolerance.

This file is also the torchrun worker that runs one step through the trainer and dumps gradients.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import qwen2_5_vl
from tests.support.hf_parity import torchrun, train_args
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_shared

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.shared]

GRAD_PARAMS = (
    "language_model.embedding.word_embeddings.weight",
    "vision.patch_embed.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
)


def _worker(out_dir: str, argv: list[str]) -> None:
    """One trainer step's loss and gradients (before the optimizer), then the loss with zeroed image features."""
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
    losses = trainer._run_schedule(batches, forward_only=False)
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    grads = {}
    for name, param in trainer.model.module.named_parameters():
        if name in GRAD_PARAMS:
            grads[name] = param.main_grad.detach().clone()
    torch.save(grads, Path(out_dir) / f"grads_tp{tp}_pp{pp}.pt")
    vision = getattr(trainer.model.module, "vision", None)
    if vision is not None:
        vision.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    with torch.no_grad():
        zeroed = trainer._run_schedule(batches, forward_only=True)
    if trainer.is_logger:
        total = sum(float(x["lm loss"][0]) for x in losses) / sum(float(x["lm loss"][1]) for x in losses)
        control = sum(float(x["lm loss"][0]) for x in zeroed) / sum(float(x["lm loss"][1]) for x in zeroed)
        (Path(out_dir) / "losses.json").write_text(json.dumps({"loss": total, "zeroed_images": control}))
    dist.barrier()
    trainer.close()
    shutdown()


# -- the test side ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The session's tiny Qwen2.5-VL, the mllm_demo records packed into one bin of 1024 tokens and
    transformers' loss and gradients on them."""
    need_shared(QWEN3_TOKENIZER, MLLM_DEMO_JSON, what="Qwen3 tokenizer and the mllm_demo records")
    hf_dir = request.getfixturevalue("qwen2_5_vl_model")
    root = tmp_path_factory.mktemp("hf-parity")
    packed = qwen2_5_vl.pack(MLLM_DEMO_JSON, QWEN3_TOKENIZER, root / "packed", 1024)
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] >= 4
    return root, hf_dir, packed, qwen2_5_vl.reference(hf_dir, packed)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_logged_loss_equals_transformers(setup, tmp_path: Path, tp: int, pp: int) -> None:
    _, hf_dir, packed, ref = setup
    metrics = tmp_path / "metrics.jsonl"
    args = [*train_args(hf_dir, packed, tp, pp), "--metrics-file", str(metrics)]
    proc = torchrun(tp * pp, ["-m", "mmpack.trainer.pretrain_vlm", *args], tmp_path)
    assert " iteration      1/     1 | lm loss:" in proc.stdout
    step = json.loads(metrics.read_text().splitlines()[0])
    print(f"TP{tp}xPP{pp}: logged lm loss {step['loss']!r}, transformers {ref['loss']!r}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5), (step["loss"], ref["loss"])


@pytest.mark.slow
def test_gradients_match_and_zeroed_images_control(setup, tmp_path: Path) -> None:
    """TP2 x PP2: word-embedding and vision gradients of the packed step equal transformers'."""
    import torch

    from mmpack.trainer.models.hf_weights import merge_tp_shards
    from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config

    _, hf_dir, packed, ref = setup
    torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *train_args(hf_dir, packed, 2, 2)], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    gap = abs(losses["zeroed_images"] - ref["loss"]) / ref["loss"]
    print(
        f"TP2xPP2 worker loss {losses['loss']!r}, transformers {ref['loss']!r}, zeroed images {losses['zeroed_images']!r}"
    )
    assert gap > 1e-3, f"control: zeroed image features change the loss by only {gap:.2e} (relative)"

    arch = arch_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    rules = FAMILY.hf.stage_rules(arch, 0, 2)
    shards = [torch.load(tmp_path / f"grads_tp{t}_pp0.pt") for t in range(2)]
    checked = 0
    for name in GRAD_PARAMS:
        for hf_name, grad in merge_tp_shards(rules[name], [s[name] for s in shards]).items():
            # the file's names -> the in-memory module names of transformers 5
            module_name = hf_name.replace("model.", "model.language_model.", 1).replace(
                "visual.", "model.visual.", 1
            )
            expected = ref["grads"][module_name]
            scale = float(expected.abs().max())
            assert scale > 0, hf_name
            diff = float((grad - expected).abs().max())
            print(f"grad {hf_name}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
            assert diff <= 1e-5 * scale, (hf_name, diff, scale)
            checked += 1
    assert checked == len(GRAD_PARAMS)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
