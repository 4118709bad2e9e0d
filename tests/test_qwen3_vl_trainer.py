"""Qwen3-VL dense through the whole path, against transformers' ``Qwen3VLForConditionalGeneration``.

One packed dataset for all tests: the real mllm_demo records (8 images) and a real video (mllm_video_demo)
packed into one bin by ``mmpack pack --model DIR``, DIR a tiny random Qwen3-VL (tied embeddings, DeepStack
from two vision layers, RoPE base 100) written by transformers with Qwen3-VL's processor configs (a small video rule) and the
Qwen3 tokenizer. transformers' loss is each sample alone with the loader's pixels and grids and
``mm_token_type_ids`` (sum of token cross-entropies over the loss tokens / their count).

- the video sample's tokens are the processor's (timestamps included, tests/support/qwen3_vl_reference.py);
- the trainer with only the qwen3_vl family registered (no Qwen2.5-VL module imported) logs that loss at TP1;
- TP2 x PP2: the same loss, gradients of the word embedding, the patch embedding and a vision block equal
  transformers'; controls: zeroed image and video features, and megatron-core's contiguous-section MRoPE in
  place of the interleaved one, change the loss by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export gives the same loss.

This file is also the torchrun worker of the TP2 x PP2 step and of the single-family run.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, SHARED_DIR

pytestmark = pytest.mark.slow

VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"
VOCAB = 151936  # Qwen3-VL's padded vocabulary: holds every id of the Qwen3 tokenizer
IMAGE_MAX_PIXELS = 50176
GRAD_PARAMS = (
    "language_model.embedding.word_embeddings.weight",
    "vision.patch_embed.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
)


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss and gradients (before the optimizer), then the loss under the two controls."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.models.vlm_stage import VisionFeatures
    from mmpack.trainer.training import Trainer, shutdown

    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    trainer.model.zero_grad_buffer()
    loss = _loss(trainer._run_schedule(batches, forward_only=False))
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    stage = trainer.model.module
    grads = {n: p.main_grad.detach().clone() for n, p in stage.named_parameters() if n in GRAD_PARAMS}
    torch.save(grads, Path(out_dir) / f"grads_tp{tp}_pp{pp}.pt")
    with torch.no_grad():
        lm = stage.language_model
        interleaved, lm.rotary_pos_emb = (
            lm.rotary_pos_emb,
            MultimodalRotaryEmbedding(stage.arch.head_dim, 1.0, rotary_base=int(stage.arch.rope_theta)),
        )
        sections = _loss(trainer._run_schedule(batches, forward_only=True))
        lm.rotary_pos_emb = interleaved
        if stage.vision is not None:
            stage.vision.register_forward_hook(
                lambda m, a, out: VisionFeatures(
                    torch.zeros_like(out.merged), tuple(map(torch.zeros_like, out.deepstack))
                )
            )
        zeroed = _loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        result = {"loss": loss, "sections_mrope": sections, "zeroed_vision": zeroed}
        (Path(out_dir) / "losses.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


def _loss(losses: list) -> float:
    """The step's loss on the last pipeline stage (NaN on the others, which compute none)."""
    if not losses:
        return float("nan")
    return sum(float(x["lm loss"][0]) for x in losses) / sum(float(x["lm loss"][1]) for x in losses)


def _only_qwen3_vl(argv: list[str]) -> None:
    """The trainer with the registry holding Qwen3-VL alone; fails if any other family module is imported."""
    from mmpack.trainer import models

    models.FAMILIES.clear()
    models.FAMILIES["qwen3_vl"] = "mmpack.trainer.models.qwen3_vl"
    from mmpack.trainer.pretrain_vlm import main

    code = main(argv)
    other = sorted(m for m in sys.modules if m.startswith("mmpack.trainer.models.qwen2"))
    if other:
        raise SystemExit(f"imported without being registered: {other}")
    raise SystemExit(code)


# -- the test side ----------------------------------------------------------------------------------------


def tiny_hf_model(
    folder: Path, ids: dict[str, int], model_type: str = "qwen3_vl", **spec_fields: int
) -> Path:
    """A random model of a Qwen3-VL family (``model_type``) written by transformers, with weights wide
    enough that every part matters, and the model folder's processor configs and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec
    from tests import qwen3_vl_reference as ref
    from tests.test_qwen3_vl_tokens import SMALL_VIDEO_CONFIG

    spec = TinyModelSpec(
        vocab_size=VOCAB, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], num_layers=4, vision_depth=3, patch_size=16,
        tie_word_embeddings=True, **spec_fields,
    )  # fmt: skip
    config = family(model_type).tiny_hf_config(spec)
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    # a small base, so that every rotary frequency turns within a sample: a wrong frequency layout shows
    config["text_config"]["rope_parameters"]["rope_theta"] = 100.0
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:  # the tied output layer too: peaked logits, a loss that moves
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    image = {**ref.IMAGE_CONFIG, "size": {"shortest_edge": 3136, "longest_edge": IMAGE_MAX_PIXELS}}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(SMALL_VIDEO_CONFIG))
    shutil.copy(QWEN3_TOKENIZER, folder / "tokenizer.json")
    return folder


def records_file(root: Path, *, with_video: bool = True) -> Path:
    """The six mllm_demo records and (``with_video``) the first mllm_video_demo record, media copied beside
    them."""
    media = root / "media"
    media.mkdir(parents=True)
    records = json.loads(MLLM_DEMO_JSON.read_text())
    for rec in records:
        for rel in rec["images"]:
            shutil.copy(MLLM_DEMO_JSON.parent / rel, media / Path(rel).name)
        rec["images"] = [f"media/{Path(p).name}" for p in rec["images"]]
    if with_video:
        video = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())[0]
        shutil.copy(VIDEO_DEMO / video["videos"][0], media / Path(video["videos"][0]).name)
        video["videos"] = [f"media/{Path(p).name}" for p in video["videos"]]
        records.append(video)
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _samples(packed: Path) -> list[dict]:
    """Each sample of bin 0 as the loader gives it, with its slices of the image and video inputs."""
    from tests.test_trainer_video_parity import _samples as loader_samples

    return loader_samples(packed, [(True, False)] * 6 + [(False, True)])


def _reference(hf_dir: Path, packed: Path) -> dict:
    """transformers' loss on each sample alone and the gradients of that loss."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.test_trainer_hf_parity import loss_and_grads
    from tests.test_trainer_video_parity import model_inputs_of

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()  # no dropout in the config; gradients on
    return loss_and_grads(model, model_inputs_of(_samples(packed), seconds=False))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mmpack.offline_packing.cli import main as mmpack

    if not (QWEN3_TOKENIZER.is_file() and MLLM_DEMO_JSON.is_file() and VIDEO_DEMO.is_dir()):
        pytest.skip("needs ../shared (Qwen3 tokenizer, mllm_demo and mllm_video_demo)")
    root = tmp_path_factory.mktemp("qwen3-vl")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    hf_dir = tiny_hf_model(root / "hf", ids)
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root)), "-o", str(packed), "-L", "2048", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 7
    assert manifest["video_rule"]["style"] == "qwen3_vl" and manifest["counts"]["videos"] == 1
    return {"root": root, "hf": hf_dir, "packed": packed, "ref": _reference(hf_dir, packed)}


def _torchrun(nproc: int, args: list[str], cwd: Path) -> None:
    from tests.test_trainer_hf_parity import _torchrun as run

    run(nproc, args, cwd)


def _train_args(setup: dict, tp: int, pp: int) -> list[str]:
    from tests.test_trainer_hf_parity import _train_args as args

    return args(setup["hf"], setup["packed"], tp, pp)


def test_packed_video_tokens_are_the_processors(setup: dict) -> None:
    """The packed video sample holds the processor's expansion of its video (timestamps and frames)."""
    from tests import qwen3_vl_reference as ref
    from tests.test_qwen3_vl_tokens import SMALL_VIDEO_CONFIG

    proc = ref.processor(QWEN3_TOKENIZER, SMALL_VIDEO_CONFIG)
    video = ref.video_inputs(proc, VIDEO_DEMO / "mllm_demo_data" / "1.mp4")
    expected = proc.tokenizer(proc.replace_video_token(video, video_idx=0))["input_ids"]
    [sample] = [s for s in _samples(setup["packed"]) if "video" in s]
    tokens = sample["tokens"].tolist()
    starts = [i for i in range(len(tokens)) if tokens[i : i + len(expected)] == expected]
    assert len(starts) == 1, "the processor's video tokens are not in the packed sample"
    assert sample["video"][1].tolist() == video["video_grid_thw"].tolist()


def test_trainer_with_only_this_family_registered_logs_transformers_loss(setup: dict, tmp_path: Path) -> None:
    """TP1: the trainer imports and runs with the registry holding only qwen3_vl; its loss is transformers'."""
    metrics = tmp_path / "metrics.jsonl"
    args = [*_train_args(setup, 1, 1), "--metrics-file", str(metrics)]
    _torchrun(1, [str(Path(__file__).resolve()), "--only-qwen3-vl", *args], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    ref = setup["ref"]
    print(f"TP1 (qwen3_vl alone registered): logged lm loss {step['loss']!r}, transformers {ref['loss']!r}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_tp2_pp2_loss_gradients_and_controls(setup: dict, tmp_path: Path) -> None:
    import torch

    from mmpack.trainer.models.hf_weights import merge_tp_shards
    from mmpack.trainer.models.qwen3_vl import FAMILY, arch_from_hf_config

    _torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *_train_args(setup, 2, 2)], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    print(f"TP2xPP2: loss {losses['loss']!r}, transformers {ref['loss']!r}, controls {losses}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for control in ("sections_mrope", "zeroed_vision"):
        gap = abs(losses[control] - ref["loss"]) / ref["loss"]
        assert gap > 1e-3, f"control {control}: the loss moves by only {gap:.2e} (relative)"
    arch = arch_from_hf_config(json.loads((setup["hf"] / "config.json").read_text()))
    rules = FAMILY.stage_rules(arch, 0, 2)
    shards = [torch.load(tmp_path / f"grads_tp{t}_pp0.pt") for t in range(2)]
    for name in GRAD_PARAMS:
        [(hf_name, grad)] = merge_tp_shards(rules[name], [s[name] for s in shards]).items()
        expected = ref["grads"][hf_name]
        scale = float(expected.abs().max())
        diff = float((grad - expected).abs().max())
        print(f"grad {hf_name}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
        assert scale > 0 and diff <= 1e-5 * scale, (hf_name, diff, scale)


def check_convert_round_trip(setup: dict, tmp_path: Path, tp: int, pp: int, reference) -> None:
    """``mmpack convert`` HF -> megatron-core at TP x PP -> HF gives back every tensor bit for bit, and the export
    (with the processor and tokenizer files) gives `reference`'s loss; shared with the MoE family's test."""
    from safetensors.torch import load_file

    from mmpack.trainer.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(str(setup["hf"]), str(tmp_path / "mcore"), tp, pp)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "export"))
    original, exported = (load_file(str(d / "model.safetensors")) for d in (setup["hf"], tmp_path / "export"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and exported[name].equal(tensor), name
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        if (setup["hf"] / name).is_file():  # a folder without videos has no video processor config
            shutil.copy(setup["hf"] / name, tmp_path / "export" / name)
    assert reference(tmp_path / "export", setup["packed"])["loss"] == setup["ref"]["loss"]


def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    check_convert_round_trip(setup, tmp_path, 2, 2, _reference)


if __name__ == "__main__":
    if sys.argv[1] == "--only-qwen3-vl":
        _only_qwen3_vl(sys.argv[2:])
    else:
        _worker(sys.argv[1], sys.argv[2:])
