"""LLaVA-OneVision-1.5 (dense and MoE text) for the tests, against the reference: NeMo-AutoModel's
``RiceTransformer`` (``rice_vit.py`` of the nemo-automodel 0.7.0 wheel, a copy in ../shared/reference/rice_vit,
loaded by its path in tests only; it imports only torch and transformers) and transformers' ``Qwen3ForCausalLM``
(``Qwen3MoeForCausalLM`` for a Qwen3-MoE ``text_config``), the image embeddings scattered into the image-pad
positions as LLaVA-OneVision-1.5 does. Tiny random models written from the reference modules' weights under
the checkpoint's names, and the reference's loss on the samples of a packed bin.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tests.support.hf_parity import loader_samples
from tests.support.onevision import IMAGE_CONFIG
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, REFERENCE_DIR, need_shared

MODEL_TYPE = "llavaonevision1_5"
RICE_VIT = REFERENCE_DIR / "rice_vit" / "rice_vit.py"  # see ../shared/reference/rice_vit/SOURCE.md
VOCAB = 151936


def rice_vit_module() -> ModuleType:
    """The reference rice_vit.py of ../shared, loaded by its path."""
    spec = importlib.util.spec_from_file_location("rice_vit", RICE_VIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rice_and_ids() -> tuple[ModuleType, dict[str, int]]:
    """(the reference rice_vit module, the Qwen3 tokenizer's special ids); skips without ../shared."""
    need_shared(
        QWEN3_TOKENIZER, MLLM_DEMO_JSON, RICE_VIT, what="Qwen3 tokenizer, mllm_demo, reference/rice_vit"
    )
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    return rice_vit_module(), ids


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


def peft_class(rice: ModuleType) -> Any:
    """A class whose ``from_pretrained(folder)`` is the reference of a model folder as one torch module with
    the checkpoint's module names (``visual.*``, ``model.*``, ``lm_head``), the form peft adapts and saves
    (tests/support/lora_parity.py); its forward takes transformers' keywords and gives the logits."""
    import torch
    from safetensors.torch import load_file

    class PeftReference(torch.nn.Module):
        def __init__(self, ref: Reference) -> None:
            super().__init__()
            self.ref = ref
            self.visual, self.model, self.lm_head = ref.visual, ref.text.model, ref.text.lm_head

        @classmethod
        def from_pretrained(cls, folder: Path, dtype: Any = None) -> PeftReference:
            ref = Reference(rice, json.loads((Path(folder) / "config.json").read_text()))
            ref.load(load_file(str(Path(folder) / "model.safetensors")))
            return cls(ref)

        def forward(self, input_ids, pixel_values, image_grid_thw, **_: Any) -> SimpleNamespace:  # type: ignore[no-untyped-def]
            return SimpleNamespace(logits=self.ref.logits(input_ids[0], pixel_values, image_grid_thw)[None])

    return PeftReference
