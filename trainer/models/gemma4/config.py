"""Gemma 4's architecture as ``config.json`` (``Gemma4Config``, transformers 5) declares it.

The text model interleaves sliding-window layers with full-attention layers (``layer_types``); full-attention
layers may have their own head size (``global_head_dim``) and KV-head count (``num_global_key_value_heads``, with
``attention_k_eq_v``: those layers' values are their keys, no value projection). The last ``num_kv_shared_layers``
layers compute no keys and values: each reuses those of the last earlier layer of its own type. Per-layer
embeddings (PLE) feed every layer a ``hidden_size_per_layer_input`` slice; ``use_double_wide_mlp`` doubles the MLP
width of the KV-sharing layers. Images attend bidirectionally inside each image on sliding layers only
(``use_bidirectional_attention`` ``"vision"``); full-attention layers stay causal. The MoE variant
(``enable_moe_block``) has ``num_experts`` experts of ``moe_intermediate_size``, ``top_k_experts`` per token, beside
every layer's dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.trainer.models.qwen_moe import MoEArch

LAYER_TYPES = ("sliding_attention", "full_attention")


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(
            f"Gemma 4 config.json has no {where}{key}: give the config.json save_pretrained writes"
        )
    return cfg[key]


@dataclass(frozen=True)
class RopeArch:
    """Rotary angles of one layer type: ``default`` (every frequency) or ``proportional`` (the first
    ``partial_rotary_factor`` of the frequencies of the full head size, the others not rotated)."""

    kind: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}  # transformers' Gemma 4 defaults


def _rope(tc: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, RopeArch]:
    params: dict[str, Any] = tc.get("rope_parameters") or DEFAULT_ROPE
    out = {}
    for kind in sorted(set(layer_types)):
        p = params.get(kind)
        if not isinstance(p, dict) or p.get("rope_type", "default") not in ("default", "proportional"):
            raise ValueError(
                f"Gemma 4 config.json text_config.rope_parameters.{kind} is {p!r}: only rope_type 'default' and "
                "'proportional' are supported"
            )
        out[kind] = RopeArch(
            kind=p.get("rope_type", "default"), theta=float(p["rope_theta"]),
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)), factor=float(p.get("factor", 1.0)),
        )  # fmt: skip
    return out


@dataclass(frozen=True, kw_only=True)
class Gemma4TextArch:
    """The language model's layout (``text_config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # sliding_attention or full_attention, per layer
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_head_dims: tuple[int, ...]
    layer_kv_head_counts: tuple[int, ...]
    rms_norm_eps: float
    final_logit_softcapping: float | None
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int
    attention_k_eq_v: bool
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    bidirectional_vision: bool
    tie_word_embeddings: bool
    rope: dict[str, RopeArch]  # by layer type
    pad_token_id: int = 0  # the id media soft tokens are embedded as before their features replace them
    # the MoE variant: experts beside the dense MLP of every layer (`enable_moe_block`); None: dense
    moe: MoEArch | None = None

    def layer_rope(self, layer: int) -> RopeArch:
        return self.rope[self.layer_types[layer]]

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values ``layer`` attends to: itself, or for a KV-sharing layer the last layer
        of its type before the sharing layers."""
        first = self.first_kv_shared_layer
        if layer < first:
            return layer
        kind = self.layer_types[layer]
        earlier = [i for i in range(first) if self.layer_types[i] == kind]
        if not earlier:
            raise ValueError(
                f"Gemma 4 config.json: KV-sharing layer {layer} ({kind}) has no earlier {kind} layer to share; "
                "lower num_kv_shared_layers"
            )
        return earlier[-1]

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer]

    def layer_kv_heads(self, layer: int) -> int:
        return self.layer_kv_head_counts[layer]

    def has_value_projection(self, layer: int) -> bool:
        """False where the values are the keys (``attention_k_eq_v`` on full-attention layers)."""
        return self.is_sliding(layer) or not self.attention_k_eq_v

    def layer_intermediate_size(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if wide else 1)


@dataclass(frozen=True, kw_only=True)
class Gemma4VisionArch:
    """The vision tower's layout (``vision_config``)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float
    standardize: bool

    # the trainer's view of a tower (`mmpack.trainer.models.protocol.TowerArch`): pooling is the merge
    @property
    def spatial_merge_size(self) -> int:
        return self.pooling_kernel_size

    @property
    def temporal_patch_size(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class Gemma4Arch:
    """The whole model; the properties are the trainer's view of it (`mmpack.trainer.models.protocol.ModelArch`),
    read from the text model."""

    text: Gemma4TextArch
    vision: Gemma4VisionArch
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int
    source: dict[str, Any]

    @property
    def moe(self) -> MoEArch | None:
        return self.text.moe

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.text.intermediate_size

    @property
    def num_layers(self) -> int:
        return self.text.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.text.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.text.num_key_value_heads

    @property
    def rms_norm_eps(self) -> float:
        return self.text.rms_norm_eps

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings


def _per_layer_attention(
    tc: dict[str, Any], layer_types: tuple[str, ...], head_dim: int, kv_heads: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head size, KV heads) of every layer: ``per_layer_config`` (as save_pretrained writes it, by layer
    index) over the text config's own; without it, full-attention layers take ``global_head_dim`` (512 unless
    given) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``, as transformers' config does."""
    per_layer = tc.get("per_layer_config")
    if per_layer is None:
        full: dict[str, Any] = {"head_dim": tc.get("global_head_dim", 512)}
        if tc.get("attention_k_eq_v", False) and tc.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = tc["num_global_key_value_heads"]
        per_layer = {str(i): full for i, t in enumerate(layer_types) if t == "full_attention"}
    dims, counts = [], []
    for i in range(len(layer_types)):
        override = per_layer.get(str(i), per_layer.get(i, {})) or {}
        dims.append(int(override.get("head_dim", head_dim)))
        counts.append(int(override.get("num_key_value_heads", kv_heads)))
    return tuple(dims), tuple(counts)


def text_arch(tc: dict[str, Any]) -> Gemma4TextArch:
    where = "text_config."
    layers = int(_need(tc, "num_hidden_layers", where))
    layer_types = tuple(_need(tc, "layer_types", where))
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad or len(layer_types) != layers:
        raise ValueError(
            f"Gemma 4 config.json text_config.layer_types must list {layers} of {', '.join(LAYER_TYPES)} "
            f"(got {len(layer_types)} entries{', unknown ' + ', '.join(bad) if bad else ''})"
        )
    moe = None
    if tc.get("enable_moe_block"):
        from mmpack.trainer.models.qwen_moe import MoEArch

        moe = MoEArch(
            num_experts=int(_need(tc, "num_experts", where)), top_k=int(_need(tc, "top_k_experts", where)),
            ffn_hidden_size=int(_need(tc, "moe_intermediate_size", where)),
        )  # fmt: skip
    bidir = tc.get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise ValueError(
            f"Gemma 4 config.json text_config.use_bidirectional_attention {bidir!r} is not supported "
            "(null or 'vision')"
        )
    kv_heads = int(_need(tc, "num_key_value_heads", where))
    head_dim = int(_need(tc, "head_dim", where))
    head_dims, kv_counts = _per_layer_attention(tc, layer_types, head_dim, kv_heads)
    arch = Gemma4TextArch(
        vocab_size=int(_need(tc, "vocab_size", where)),
        hidden_size=int(_need(tc, "hidden_size", where)),
        intermediate_size=int(_need(tc, "intermediate_size", where)),
        num_layers=layers,
        num_attention_heads=int(_need(tc, "num_attention_heads", where)),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_head_dims=head_dims,
        layer_kv_head_counts=kv_counts,
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        layer_types=layer_types,
        sliding_window=int(_need(tc, "sliding_window", where)),
        final_logit_softcapping=tc.get("final_logit_softcapping"),
        vocab_size_per_layer_input=int(tc.get("vocab_size_per_layer_input") or 0),
        hidden_size_per_layer_input=int(tc.get("hidden_size_per_layer_input") or 0),
        attention_k_eq_v=bool(tc.get("attention_k_eq_v", False)),
        num_kv_shared_layers=int(tc.get("num_kv_shared_layers", 0)),
        use_double_wide_mlp=bool(tc.get("use_double_wide_mlp", False)),
        bidirectional_vision=bidir == "vision",
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", True)),
        rope=_rope(tc, layer_types),
        pad_token_id=int(tc.get("pad_token_id") or 0),
        moe=moe,
    )
    for layer in range(arch.first_kv_shared_layer, layers):
        arch.kv_source(layer)
    return arch


def vision_arch(vc: dict[str, Any]) -> Gemma4VisionArch:
    where = "vision_config."
    return Gemma4VisionArch(
        hidden_size=int(_need(vc, "hidden_size", where)),
        intermediate_size=int(_need(vc, "intermediate_size", where)),
        depth=int(_need(vc, "num_hidden_layers", where)),
        num_heads=int(_need(vc, "num_attention_heads", where)),
        num_key_value_heads=int(_need(vc, "num_key_value_heads", where)),
        head_dim=int(_need(vc, "head_dim", where)),
        patch_size=int(_need(vc, "patch_size", where)),
        pooling_kernel_size=int(_need(vc, "pooling_kernel_size", where)),
        position_embedding_size=int(_need(vc, "position_embedding_size", where)),
        rms_norm_eps=float(vc.get("rms_norm_eps", 1e-6)),
        standardize=bool(vc.get("standardize", False)),
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> Gemma4Arch:
    """:class:`Gemma4Arch` of a ``Gemma4ForConditionalGeneration`` ``config.json`` dict; ValueError naming the
    missing or unsupported field otherwise."""
    if cfg.get("model_type") != "gemma4":
        raise ValueError(f"config.json model_type {cfg.get('model_type')!r} is not gemma4")
    return Gemma4Arch(
        text=text_arch(_need(cfg, "text_config", "")),
        vision=vision_arch(_need(cfg, "vision_config", "")),
        image_token_id=int(_need(cfg, "image_token_id", "")),
        boi_token_id=int(_need(cfg, "boi_token_id", "")),
        eoi_token_id=int(_need(cfg, "eoi_token_id", "")),
        video_token_id=int(_need(cfg, "video_token_id", "")),
        source=cfg,
    )
