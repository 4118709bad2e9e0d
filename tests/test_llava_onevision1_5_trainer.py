"""LLaVA-OneVision-1.5 dense through the whole path, against the reference: NeMo-AutoModel's ``RiceTransformer``
(``components/models/llava_onevision/rice_vit.py`` of the nemo-automodel 0.7.0 wheel, loaded by its path in
tests only; it imports only torch and transformers) and transformers' ``Qwen3ForCausalLM``, the image
embeddings scattered into the image-pad positions as LLaVA-OneVision-1.5 does.

One packed dataset for all tests: the real mllm_demo records (six samples, eight images) packed into one bin by
``mmpack pack --model DIR``, DIR a tiny random OneVision-1.5 (RICE-ViT patch 14, merge 2, LayerNorm eps 1e-5;
Qwen3 text, RoPE base 100) written from the reference modules' weights under the checkpoint's names, with a
Qwen2-VL-style processor config (temporal patch 1) and the Qwen3 tokenizer. The reference's loss is each
sample alone with the loader's pixels and grids (sum of token cross-entropies over the loss tokens / their
count).

- TP2 x PP2, one iteration at lr 0: the logged lm loss equals the reference's to 1e-5 relative; controls:
  zeroed vision features and zeroed patch positions move our loss, zeroed pixels and a zeroed class token move
  the reference's, by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export, loaded in the
  reference, gives the same loss.

Skips without ../shared or when the nemo-automodel wheel cannot be downloaded. This file is also the torchrun
worker of the TP2 x PP2 step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER

pytestmark = pytest.mark.slow

MODEL_TYPE = "llavaonevision1_5"
NEMO_WHEEL = "nemo-automodel==0.7.0"
RICE_VIT = "nemo_automodel/components/models/llava_onevision/rice_vit.py"
VOCAB = 151936


def _rice_vit_module(cache: Path) -> ModuleType:
    """rice_vit.py out of the nemo-automodel wheel (downloaded once into ``cache``), loaded by its path."""
    target = cache / "rice_vit.py"
    if not target.is_file():
        wheels = cache / "wheels"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), NEMO_WHEEL],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        found = sorted(wheels.glob("nemo_automodel-*.whl")) if proc.returncode == 0 else []
        if not found:
            pytest.skip(f"cannot download {NEMO_WHEEL} (the reference RiceTransformer): {proc.stderr[-300:]}")
        with zipfile.ZipFile(found[0]) as whl:
            target.write_bytes(whl.read(RICE_VIT))
    spec = importlib.util.spec_from_file_location("reference_rice_vit", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Reference:
    """RiceTransformer + Qwen3ForCausalLM (Qwen3MoeForCausalLM for a Qwen3-MoE ``text_config``) of a model
    folder's config, with the image scatter."""

    def __init__(self, rice: ModuleType, config: dict[str, Any]) -> None:
        import transformers

        text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
        self.moe = config["text_config"].get("model_type") == "qwen3_moe"
        name = "Qwen3Moe" if self.moe else "Qwen3"
        self.text_config = getattr(transformers, f"{name}Config")(**text)
        self.text_class = getattr(transformers, f"{name}ForCausalLM")
        self.visual = rice.RiceTransformer(SimpleNamespace(**config["vision_config"]))
        self.text = self.text_class(self.text_config)
        self.image_token_id = config["image_token_id"]

    def parameters(self) -> dict:
        """The modules' own tensors, to set in place (the experts stacked, as transformers holds them)."""
        return {**{f"visual.{k}": v for k, v in self.visual.state_dict().items()}, **self.text.state_dict()}

    def state_dict(self) -> dict:
        """The tensors under the checkpoint's names (``visual.*``, ``model.*``, ``lm_head.weight``); the text
        model's as its ``save_pretrained`` writes them (each expert's own tensors for Qwen3-MoE)."""
        import tempfile

        from safetensors.torch import load_file

        visual = {f"visual.{k}": v for k, v in self.visual.state_dict().items()}
        if not self.moe:
            return {**visual, **self.text.state_dict()}
        with tempfile.TemporaryDirectory() as folder:
            self.text.save_pretrained(folder)
            return {
                **visual,
                **{k: v for f in Path(folder).glob("*.safetensors") for k, v in load_file(f).items()},
            }

    def load(self, tensors: dict) -> None:
        import tempfile

        from safetensors.torch import save_file

        visual = {k.removeprefix("visual."): v for k, v in tensors.items() if k.startswith("visual.")}
        self.visual.load_state_dict(visual, strict=True)
        text = {k: v for k, v in tensors.items() if not k.startswith("visual.")}
        if not self.moe:
            self.text.load_state_dict(text, strict=True)
            return
        with tempfile.TemporaryDirectory() as folder:  # transformers stacks the experts' tensors on loading
            self.text_config.save_pretrained(folder)
            save_file({k: v.contiguous() for k, v in text.items()}, str(Path(folder) / "model.safetensors"))
            self.text = self.text_class.from_pretrained(folder, dtype=self.text_config.dtype or "float32")
        assert sorted(self.text.state_dict()) == sorted(self.text_class(self.text_config).state_dict())

    def logits(self, tokens, pixels, grids):  # type: ignore[no-untyped-def]
        embeds = self.text.model.embed_tokens(tokens[None])
        features = self.visual(pixels, grid_thw=grids)
        mask = (tokens == self.image_token_id)[None, :, None].expand_as(embeds)
        assert int(mask[0, :, 0].sum()) == features.shape[0]
        embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
        return self.text(inputs_embeds=embeds).logits[0]


def tiny_hf_model(
    folder: Path, rice: ModuleType, ids: dict[str, int], model_type: str = MODEL_TYPE, **spec_fields: Any
) -> Path:
    """A random OneVision-1.5 (config from ``model_type``'s tiny config, ``spec_fields`` on top of the sizes
    here) with weights wide enough that every part matters, the processor config and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec
    from tests.test_llava_onevision2_trainer import IMAGE_CONFIG

    spec = TinyModelSpec(
        vocab_size=VOCAB, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], num_layers=4, vision_depth=2, vision_num_heads=2,
        vision_hidden_size=64, patch_size=14, merge_size=2, **spec_fields,
    )  # fmt: skip
    config = family(model_type).tiny_hf_config(spec)
    # a small base, so that every rotary frequency turns within a sample
    config["text_config"]["rope_parameters"]["rope_theta"] = 100.0
    torch.manual_seed(0)
    model = Reference(rice, config)
    with torch.no_grad():
        for name, param in model.parameters().items():
            if name == "visual.class_pos_emb":
                continue  # learned rotary angles: keep their N(0, 1) start
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name or name == "visual.class_embedding":
                param.normal_(0.0, 0.3)
            elif name.endswith("attn.qkv.weight"):
                param.normal_(0.0, 0.3)  # sharp vision attention: the class token and positions matter
            elif ".mlp.experts." in name or name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)  # MoE variant: experts and routing that move the loss
            else:
                param.normal_(0.0, 0.08)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    shutil.copy(QWEN3_TOKENIZER, folder / "tokenizer.json")
    return folder


def reference_loss(hf_dir: Path, packed: Path, rice: ModuleType, *, edit: Any = None, bins: int = 1) -> dict:
    """The reference's loss over the samples of the first ``bins`` bins one by one; ``edit``: a function of
    the loaded :class:`Reference` and the sample's pixels, giving the pixels to use (controls)."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from tests.test_trainer_video_parity import _samples as loader_samples

    model = Reference(rice, json.loads((hf_dir / "config.json").read_text()))
    model.load(load_file(str(hf_dir / "model.safetensors")))
    model.visual.eval(), model.text.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for s in loader_samples(packed, [(True, False)] * 6, bins=bins):
            pixels, grids = s["image"]
            logits = model.logits(s["tokens"], pixels if edit is None else edit(model, pixels), grids)
            keep = s["labels"] != -100
            total += F.cross_entropy(logits[keep].float(), s["labels"][keep], reduction="sum").double()
            count += int(keep.sum())
    return {"loss": float(total / count), "tokens": count}


def rice_and_ids(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(the reference rice_vit module, the Qwen3 tokenizer's special ids); skips without ../shared."""
    if not (QWEN3_TOKENIZER.is_file() and MLLM_DEMO_JSON.is_file()):
        pytest.skip("needs ../shared (Qwen3 tokenizer, mllm_demo)")
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: download per session
    folder = cache.mkdir("nemo_automodel_rice_vit") if cache else tmp_path_factory.mktemp("nemo_automodel")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    return _rice_vit_module(Path(folder)), ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    from mmpack.offline_packing.cli import main as mmpack
    from tests.test_qwen3_vl_trainer import records_file

    rice, ids = rice_and_ids(request, tmp_path_factory)
    root = tmp_path_factory.mktemp("onevision1_5")
    hf_dir = tiny_hf_model(root / "hf", rice, ids)
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root, with_video=False)), "-o", str(packed), "-L", "2048"]
    assert mmpack([*args, "--model", str(hf_dir), "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 6
    ref = reference_loss(hf_dir, packed, rice)
    return {"root": root, "hf": hf_dir, "packed": packed, "rice": rice, "ref": ref}


def _zero_class_token(model: Reference, pixels):  # type: ignore[no-untyped-def]
    model.visual.class_embedding.data.zero_()
    model.visual.class_pos_emb.data.zero_()
    return pixels


def test_tp2_pp2_loss_equals_the_reference_and_controls_move_it(setup: dict, tmp_path: Path) -> None:
    from tests.test_trainer_hf_parity import _torchrun, _train_args

    args = _train_args(setup["hf"], setup["packed"], 2, 2)
    _torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    ref_controls = {
        "ref zeroed pixels": reference_loss(
            setup["hf"], setup["packed"], setup["rice"], edit=lambda m, p: p * 0
        )["loss"],
        "ref zeroed class token": reference_loss(
            setup["hf"], setup["packed"], setup["rice"], edit=_zero_class_token
        )["loss"],
    }
    print(f"TP2xPP2: loss {losses['loss']!r}, reference {ref['loss']!r}; controls {losses}, {ref_controls}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    controls = {k: losses[k] for k in ("zeroed_vision", "zeroed_patch_positions")} | ref_controls
    for name, value in controls.items():
        gap = abs(value - ref["loss"]) / ref["loss"]
        assert gap > 1e-3, f"control {name}: the loss moves by only {gap:.2e} (relative)"


def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    from tests.test_qwen3_vl_trainer import check_convert_round_trip

    check_convert_round_trip(
        setup, tmp_path, 2, 2, lambda hf, packed: reference_loss(hf, packed, setup["rice"])
    )


if __name__ == "__main__":
    from tests.test_llava_onevision2_trainer import _worker

    _worker(sys.argv[1], sys.argv[2:])
