"""Parity with transformers through the whole path: the real mllm_demo samples (Qwen3 tokenizer) packed into one
bin by `mmpack pack`, read by the loader and trained for one iteration at lr 0 with `--hf-model` (a tiny random
Qwen2.5-VL written by transformers) at TP1, TP2 and TP2 x PP2. The logged `lm loss` must equal transformers'
loss on the same samples run one by one (sum of token cross-entropies over the loss tokens / their count);
gradients of the word embedding and of vision weights must match as well; a control with the image features
zeroed must differ by far more than the tolerance.

This file is also the torchrun worker that runs one step through the trainer and dumps gradients.
"""

from __future__ import annotations

import io
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

GRAD_PARAMS = (
    "language_model.embedding.word_embeddings.weight",
    "vision.patch_embed.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
)
VOCAB = 151936  # Qwen2.5-VL's padded vocabulary: holds every id of the Qwen3 tokenizer
MAX_PIXELS = 50176


def _worker(out_dir: str, argv: list[str]) -> None:
    """One trainer step's loss and gradients (before the optimizer), then the loss with zeroed image features."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

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


def _tiny_hf_model(path: Path, special: dict[str, int]) -> Path:
    """A random Qwen2.5-VL written by transformers, with weights wide enough that every part matters."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mmpack.trainer.models.qwen2_5_vl import tiny_hf_config

    config = tiny_hf_config(
        vocab_size=VOCAB,
        image_token_id=special["image_pad"],
        vision_start_token_id=special["vision_start"],
        vision_end_token_id=special["vision_end"],
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_depth=2,
        vision_hidden_size=32,
        vision_num_heads=2,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def _pack(records: Path, tokenizer: Path, out: Path, seq_len: int) -> Path:
    from mmpack.offline_packing.cli import main as mmpack

    args = ["pack", "-i", str(records), "-o", str(out), "-L", str(seq_len), "-t", str(tokenizer)]
    assert mmpack([*args, "--max-pixels", str(MAX_PIXELS), "--no-progress"]) == 0
    return out


def _samples_of_bin(packed: Path):
    """Each sample of the first bin as the loader gives it (tokens, labels) with its images' bytes."""
    import pyarrow as pa
    import torch

    from mmpack.dataloader import Topology, build_loader

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    shard = next((packed / "shards").glob("*.arrow"))
    with pa.ipc.open_file(str(shard)) as f:
        record = f.get_batch(0)
    images = record.column("images")[0].as_py()
    image_pad = json.loads((packed / "manifest.json").read_text())["tokenizer"]["special_ids"]["image_pad"]
    cu = batch.cu_seqlens.tolist()
    real = int(batch.num_real_tokens)
    samples, next_image = [], 0
    for a, b in itertools.pairwise(cu):
        if b > real:
            break
        tokens = batch.tokens[0, a:b]
        grids = []
        pads = int((tokens == image_pad).sum())
        while pads > 0:
            g = batch.image_grid_thw[next_image]
            pads -= int(g.prod()) // 4
            grids.append(next_image)
            next_image += 1
        samples.append(
            {"tokens": tokens, "labels": batch.labels[0, a:b], "images": [images[i] for i in grids]}
        )
    assert next_image == len(images) and len(samples) >= 4
    assert sum(len(s["images"]) for s in samples) >= 4, "the bin should hold several images"
    return samples, torch.tensor(image_pad)


def _reference(hf_dir: Path, packed: Path, max_pixels: int = MAX_PIXELS) -> dict:
    """transformers' loss on each sample alone (images through Qwen2VLImageProcessorPil), summed over loss
    tokens / their count, and the gradients of that loss."""
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.train()  # no dropout in the config; gradients on
    processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_pixels)
    samples, image_pad = _samples_of_bin(packed)
    inputs = []
    for s in samples:
        kwargs = {}
        if s["images"]:
            pix = processor([Image.open(io.BytesIO(b)) for b in s["images"]], return_tensors="pt")
            kwargs = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
        inputs.append((s["tokens"], s["labels"], (s["tokens"] == image_pad).int(), kwargs))
    return loss_and_grads(model, inputs)


def loss_and_grads(model, inputs: list) -> dict:  # type: ignore[no-untyped-def]
    """transformers' loss over samples run one by one ((tokens, labels, mm_token_type_ids, model kwargs) each):
    the sum of token cross-entropies over the loss tokens / their count, and its gradients where they are on."""
    import torch
    import torch.nn.functional as F

    total, count = torch.zeros(()), 0
    for tokens, labels, types, kwargs in inputs:
        logits = model(input_ids=tokens[None], mm_token_type_ids=types[None], **kwargs).logits[0]
        keep = labels != -100
        total = total + F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
        count += int(keep.sum())
    loss = total / count
    if loss.requires_grad:
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads, "tokens": count}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from tests.support.shared import MLLM_DEMO_JSON as mllm_demo_json
    from tests.support.shared import QWEN3_TOKENIZER as qwen3_tokenizer_path

    if not (qwen3_tokenizer_path.is_file() and mllm_demo_json.is_file()):
        pytest.skip("needs ../shared (Qwen3 tokenizer and the mllm_demo records)")
    root = tmp_path_factory.mktemp("hf-parity")
    special = json.loads(qwen3_tokenizer_path.read_text())
    ids = {t["content"]: t["id"] for t in special["added_tokens"]}
    hf_dir = _tiny_hf_model(
        root / "hf",
        {
            "image_pad": ids["<|image_pad|>"],
            "vision_start": ids["<|vision_start|>"],
            "vision_end": ids["<|vision_end|>"],
        },
    )
    packed = _pack(mllm_demo_json, qwen3_tokenizer_path, root / "packed", 1024)
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] >= 4
    return root, hf_dir, packed, _reference(hf_dir, packed)


def _torchrun(nproc: int, args: list[str], cwd: Path, timeout_s: int = 600) -> Any:
    """``torchrun --nproc_per_node nproc ARGS`` on warm ranks (``tests.support.ranks``); checks every rank
    exited 0. The worker may be a test file that imports tests.*: the repository root is on its path."""
    from tests.support import ranks

    return ranks.checked(ranks.launch(nproc, args, cwd / "ranks", timeout_s=timeout_s))


def _train_args(hf_dir: Path, packed: Path, tp: int, pp: int) -> list[str]:
    return [
        "--hf-model", str(hf_dir), "--data-path", str(packed),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "0",
        "--log-interval", "1", "--num-workers", "0",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_logged_loss_equals_transformers(setup, tmp_path: Path, tp: int, pp: int) -> None:
    _, hf_dir, packed, ref = setup
    metrics = tmp_path / "metrics.jsonl"
    args = [*_train_args(hf_dir, packed, tp, pp), "--metrics-file", str(metrics)]
    proc = _torchrun(tp * pp, ["-m", "mmpack.trainer.pretrain_vlm", *args], tmp_path)
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
    from mmpack.trainer.models.qwen2_5_vl import arch_from_hf_config, stage_rules

    _, hf_dir, packed, ref = setup
    _torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *_train_args(hf_dir, packed, 2, 2)], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    gap = abs(losses["zeroed_images"] - ref["loss"]) / ref["loss"]
    print(
        f"TP2xPP2 worker loss {losses['loss']!r}, transformers {ref['loss']!r}, zeroed images {losses['zeroed_images']!r}"
    )
    assert gap > 1e-3, f"control: zeroed image features change the loss by only {gap:.2e} (relative)"

    arch = arch_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    rules = stage_rules(arch, 0, 2)
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
