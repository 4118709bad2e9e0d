"""Gemma 4 family, its parts: the architecture read from a tiny random ``Gemma4Config``, the attention of a
packed bin and the rotary angles, against transformers' Gemma 4 (the whole model's parity through the trainer is
tests/test_gemma4_family.py).

The tiny config (tests/support/gemma4.py) has per-layer embeddings, KV sharing, ``attention_k_eq_v``, double-wide
MLPs, a sliding window of 16 and bidirectional image attention.

- the architecture's per-layer head sizes, KV heads, value projections, MLP widths and KV sources are those of
  transformers' modules built from the same config;
- a packed bin of three samples (an image longer than the window, two samples' images touching at a sample
  boundary): the masks of every layer kind are transformers' per-sample masks on the diagonal blocks and nothing
  across samples; attention through them equals transformers' eager attention per sample. Controls: transformers'
  masks of another window, and of causal image attention, differ from ours; another window moves the attention;
- the rotary angles of each layer type are transformers'; control: megatron-core's ``rotary_percent`` rule;
- the controls of the coming loss parity move transformers' loss of a real two-image sample.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.support import gemma4
from tests.support.shared import need_shared

pytestmark = [pytest.mark.family, pytest.mark.shared]

# (mm_token_type_ids of each sample): text 0, image soft tokens 1
SAMPLES = [
    [0] * 5 + [1] * 6 + [0] * 30 + [1] * 4 + [0] * 3,
    [0] * 3 + [1] * 25 + [0] * 12 + [1] * 5,  # an image longer than the window; ends with an image
    [1] * 7 + [0] * 10,  # starts with an image: touches the previous sample's last image
]


@pytest.fixture(scope="module")
def config() -> Any:
    need_shared(gemma4.GEMMA4_TOKENIZER_DIR, what="gemma4_tokenizer")
    return gemma4.tiny_config()


def test_arch_matches_transformers_modules(config: Any, tmp_path: Any) -> None:
    """Per-layer attention and MLP shapes of the architecture read from the config.json save_pretrained writes
    equal those of transformers' text model."""
    import torch
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel

    from mmpack.trainer.models import read_hf_config
    from mmpack.trainer.models.gemma4.config import arch_from_hf_config

    config.save_pretrained(tmp_path)
    arch = arch_from_hf_config(read_hf_config(tmp_path))
    torch.manual_seed(0)
    model = Gemma4TextModel(config.text_config)
    modes = config.text_config.kv_sharing_modes
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        assert arch.text.layer_head_dim(i) == attn.head_dim, i
        assert arch.text.layer_intermediate_size(i) == layer.mlp.gate_proj.out_features, i
        shared = modes[i] == "reuse"
        assert (arch.text.kv_source(i) != i) == shared, i
        if not shared:
            assert arch.text.layer_kv_heads(i) * attn.head_dim == attn.k_proj.out_features, i
            assert arch.text.has_value_projection(i) == (attn.v_proj is not None), i
    # the tiny config exercises what it should
    assert {arch.text.layer_intermediate_size(i) for i in range(4)} == {64, 128}
    assert {arch.text.layer_head_dim(i) for i in range(4)} == {8, 16}
    assert arch.text.kv_source(2) == 0 and arch.text.kv_source(3) == 1
    assert arch.text.bidirectional_vision and arch.text.sliding_window == gemma4.TINY_WINDOW
    assert arch.text.hidden_size_per_layer_input == 8


def test_unsupported_config_is_refused(config: Any) -> None:
    from mmpack.trainer.models.gemma4.config import arch_from_hf_config

    cfg = config.to_dict()
    cfg["text_config"] |= {
        "enable_moe_block": True,
        "num_experts": None,
    }  # the MoE variant without its experts
    with pytest.raises(ValueError, match=r"text_config\.num_experts"):
        arch_from_hf_config(cfg)
    cfg = config.to_dict()
    cfg["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(ValueError, match="use_bidirectional_attention 'all' is not supported"):
        arch_from_hf_config(cfg)
    cfg = config.to_dict()
    del cfg["text_config"]["sliding_window"]
    with pytest.raises(ValueError, match=r"text_config\.sliding_window"):
        arch_from_hf_config(cfg)


def _bin() -> tuple[Any, Any]:
    import torch

    types = torch.tensor([t for s in SAMPLES for t in s])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in SAMPLES]).cumsum(0).tolist()])
    return types, cu


def _dense(cu: Any, blocks: Any, window: int | None) -> Any:
    """Our allowed-attention matrix of the whole bin, [s, s]."""
    import torch

    from mmpack.trainer.models.gemma4.masks import segment_masks

    index, valid, allowed = segment_masks(cu, blocks, window=window)
    s = int(cu[-1])
    out = torch.zeros(s, s, dtype=torch.bool)
    for seg in range(index.shape[0]):
        n = int(valid[seg].sum())
        rows = index[seg, :n]
        out[rows[:, None], rows[None, :]] = allowed[seg, :n, :n]
    return out


def _ours(types: Any, cu: Any, window: int) -> dict[str, Any]:
    from mmpack.trainer.models.gemma4.masks import image_blocks

    blocks = image_blocks(types)
    return {"full_attention": _dense(cu, None, None), "sliding_attention": _dense(cu, blocks, window)}


def _reference(cfg: Any, types: Any, cu: Any) -> dict[str, Any]:
    """transformers' per-sample masks on the diagonal blocks of the bin."""
    import torch

    s = int(cu[-1])
    out = {k: torch.zeros(s, s, dtype=torch.bool) for k in ("full_attention", "sliding_attention")}
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        for kind, mask in gemma4.hf_layer_masks(cfg, types[a:b]).items():
            out[kind][a:b, a:b] = mask
    return out


@pytest.mark.parametrize("control", [None, "window", "causal_images"])
def test_packed_masks_equal_transformers_per_sample(config: Any, control: str | None) -> None:
    """Our masks of the bin are transformers' per-sample masks; a reference with another window, or causal image
    attention, differs from ours on the sliding layers (the control)."""
    types, cu = _bin()
    ours = _ours(types, cu, gemma4.TINY_WINDOW)
    reference_cfg = {
        None: config,
        "window": gemma4.tiny_config(window=gemma4.TINY_WINDOW + 8),
        "causal_images": gemma4.tiny_config(bidirectional=False),
    }[control]
    ref = _reference(reference_cfg, types, cu)
    assert bool((ours["full_attention"] == ref["full_attention"]).all())
    same = bool((ours["sliding_attention"] == ref["sliding_attention"]).all())
    assert same == (control is None), control


def test_packed_attention_equals_transformers_eager_per_sample(config: Any) -> None:
    """Attention of the whole bin through our gathered samples equals transformers' eager attention of each
    sample alone with its masks (grouped-query keys/values, both layer kinds); control: another window."""
    import torch
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    from mmpack.trainer.models.gemma4.masks import image_blocks, packed_attention

    types, cu = _bin()
    blocks = image_blocks(types)
    s, heads, kv_heads, d = int(cu[-1]), 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads
        training = False

    for kind, window in (("full_attention", None), ("sliding_attention", gemma4.TINY_WINDOW)):
        ours = packed_attention(q, k, v, cu, None if window is None else blocks, window=window, scale=1.0)
        for i in range(len(cu) - 1):
            a, b = int(cu[i]), int(cu[i + 1])
            allowed = gemma4.hf_layer_masks(config, types[a:b])[kind]
            additive = torch.zeros(b - a, b - a, dtype=torch.float64).masked_fill(~allowed, -math.inf)
            ref, _ = eager_attention_forward(
                Module(), *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), additive[None, None],
                dropout=0.0, scaling=1.0,
            )  # fmt: skip
            torch.testing.assert_close(ours[a:b], ref[0], rtol=0, atol=1e-6)  # transformers' softmax: float32
    control = packed_attention(q, k, v, cu, blocks, window=gemma4.TINY_WINDOW + 8, scale=1.0)
    assert float((control - ours).abs().max()) > 1e-2  # another window is far outside the tolerance


def test_reference_loss_moves_under_the_controls(config: Any, tmp_path: Any) -> None:
    """The parity controls are live: transformers' loss of a real two-image sample (longer than the window)
    changes by far more than the parity tolerance (1e-5 relative) with another window, and with causal instead
    of bidirectional image attention (same weights)."""
    import json

    from tests.support.shared import MLLM_DEMO_JSON

    need_shared(MLLM_DEMO_JSON, what="the mllm_demo data")
    processor = gemma4.reference_processor(gemma4.model_folder(tmp_path / "model"))
    record = json.loads(MLLM_DEMO_JSON.read_text())[0]
    inputs = gemma4.reference_inputs(processor, record, MLLM_DEMO_JSON.parent)
    assert (
        inputs["input_ids"].shape[1] > 4 * gemma4.TINY_WINDOW and int(inputs["mm_token_type_ids"].sum()) > 0
    )
    model = gemma4.tiny_model(config)
    base = gemma4.reference_loss(model, inputs)
    weights = model.state_dict()
    for other in (gemma4.tiny_config(window=gemma4.TINY_WINDOW + 8), gemma4.tiny_config(bidirectional=False)):
        control = gemma4.tiny_model(other)
        control.load_state_dict(weights)
        moved = gemma4.reference_loss(control, inputs)
        assert abs(moved - base) > 1e-4 * abs(base), (base, moved)


def test_rope_equals_transformers_per_layer_type(config: Any) -> None:
    """Our rotary angles of every layer equal transformers' cos/sin of its layer type (default RoPE on sliding
    layers, proportional RoPE with a quarter of the pairs rotated on full layers of head 16); control:
    megatron-core's ``rotary_percent`` frequencies for the full layers differ."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from mmpack.trainer.models.gemma4 import rope
    from mmpack.trainer.models.gemma4.config import arch_from_hf_config

    arch = arch_from_hf_config(config.to_dict()).text
    reference = Gemma4TextRotaryEmbedding(config.text_config)
    positions = torch.arange(40)
    for layer, kind in enumerate(arch.layer_types):
        cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[None], kind)
        ours = rope.angles(arch, layer, positions)
        torch.testing.assert_close(ours.cos(), cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin(), sin[0], rtol=0, atol=1e-6)
    full = arch.layer_types.index("full_attention")
    assert int((rope.inv_freq(arch, full) == 0).sum()) == 6  # head 16: 8 pairs, 2 rotated
    r = arch.layer_rope(full)
    control = RotaryEmbedding(
        kv_channels=arch.layer_head_dim(full), rotary_percent=r.partial_rotary_factor, rotary_base=r.theta,
        use_cpu_initialization=True,
    ).inv_freq  # fmt: skip
    rotated = rope.inv_freq(arch, full)[: control.shape[0]]
    assert float((rotated - control.cpu()).abs().max()) > 1e-3
