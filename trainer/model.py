"""The vision-language model: a vision encoder whose merged patch features replace the ``<|image_pad|>``
embeddings of a megatron-core ``GPTModel`` (passed as ``decoder_input``)."""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from trainer.config import ModelConfig
from trainer.layers import MixedPrecisionLayerNorm, build_block_spec, build_layer_spec


def image_attention_mask(image_grid_thw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, 1, P, P] bool mask (True = masked) letting each patch attend to the patches of its own image only."""
    counts = (image_grid_thw[:, 0] * image_grid_thw[:, 1] * image_grid_thw[:, 2]).to(device)
    image_of_patch = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    return (image_of_patch[:, None] != image_of_patch[None, :])[None, None]


class VisionEncoder(MegatronModule):
    """Patch embedding, megatron-core transformer layers with per-image attention, 2x2 merge, MLP projector."""

    def __init__(self, config: TransformerConfig, model: ModelConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.merge_units = model.merge_size**2
        self.patch_embed = torch.nn.Linear(3 * model.patch_size**2, hidden)
        spec = build_layer_spec(AttnMaskType.arbitrary)
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config=config, layer_number=i + 1) for i in range(config.num_layers)]
        )
        self.final_norm = MixedPrecisionLayerNorm(config, hidden)
        self.projector = torch.nn.Sequential(
            torch.nn.Linear(hidden * self.merge_units, hidden * self.merge_units),
            torch.nn.GELU(),
            torch.nn.Linear(hidden * self.merge_units, model.hidden_size),
        )

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, 3*patch*patch] (merge-window-major) -> [P / merge**2, language hidden]."""
        hidden = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).unsqueeze(1)  # [P, 1, h]
        mask = image_attention_mask(image_grid_thw, hidden.device)
        for layer in self.layers:
            hidden, _ = layer(hidden, attention_mask=mask)
        hidden = self.final_norm(hidden.squeeze(1))
        merged = hidden.reshape(-1, hidden.shape[-1] * self.merge_units)
        return self.projector(merged)


class VisionLanguageModel(MegatronModule):
    """One pipeline stage of the VLM. The first stage embeds text and images; the last computes the loss."""

    def __init__(
        self,
        language_config: TransformerConfig,
        vision_config: TransformerConfig,
        model: ModelConfig,
        *,
        seq_length: int,
        pre_process: bool,
        post_process: bool,
        use_te: bool = False,
    ) -> None:
        super().__init__(language_config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.pre_process = pre_process
        self.post_process = post_process
        self.image_pad_id = model.image_pad_id
        self.vision = VisionEncoder(vision_config, model) if pre_process else None
        block = build_block_spec(get_num_layers_to_build(language_config), use_te=use_te)
        self.language_model = GPTModel(
            config=language_config,
            transformer_layer_spec=block,
            vocab_size=model.padded_vocab_size(),
            max_sequence_length=model.max_position_embeddings or seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def embed(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """Text embeddings with image features scattered into the ``<|image_pad|>`` slots -> [s, b, h]."""
        emb_module = self.language_model.embedding
        words = emb_module.word_embeddings(tokens)
        emb = words + emb_module.position_embeddings(position_ids)
        image_slots = tokens == self.image_pad_id
        num_slots = int(image_slots.sum())
        if num_slots:
            if pixel_values is None or image_grid_thw is None or self.vision is None:
                raise ValueError("batch has <|image_pad|> tokens but no pixel_values/image_grid_thw")
            features = self.vision(pixel_values, image_grid_thw).to(emb.dtype)
            if features.shape[0] != num_slots:
                raise ValueError(f"{features.shape[0]} image features for {num_slots} <|image_pad|> tokens")
            emb = emb.masked_scatter(image_slots.unsqueeze(-1), features)
        emb = emb.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            emb = emb.float()
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return emb_module.embedding_dropout(emb)
        return emb_module.embedding_dropout(emb)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] on the last stage when labels are given, hidden states elsewhere."""
        decoder_input = (
            self.embed(tokens, position_ids, pixel_values, image_grid_thw) if self.pre_process else None
        )
        return self.language_model(
            input_ids=None,
            position_ids=None,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
        )


def _global_param_names(model: torch.nn.Module) -> dict[int, str]:
    """Parameter id -> name that is the same under every TP/PP layout (decoder layers by global number)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names[id(param)] = name
    decoder = getattr(getattr(model, "language_model", None), "decoder", None)
    if decoder is not None:
        for layer in decoder.layers:
            for pname, param in layer.named_parameters():
                names[id(param)] = f"language_model.decoder.layers.{layer.layer_number - 1}.{pname}"
    return names


@torch.no_grad()
def init_layout_invariant(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Re-initialise every parameter from (seed, global name), then keep this rank's TP shard.

    The full tensor is drawn the same way under every TP x PP layout, so runs with different layouts start
    from the same model (megatron-core's own init draws per-shard and per-stage).
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    names = _global_param_names(model)
    for param in model.parameters():
        name = names[id(param)]
        leaf = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name
        if leaf == "bias" or (is_norm and leaf != "weight"):
            param.zero_()
            continue
        if is_norm:
            param.fill_(1.0)
            continue
        split = bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1
        dim = int(getattr(param, "partition_dim", 0))
        full_shape = list(param.shape)
        if split:
            full_shape[dim] *= tp_size
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        scale = std / (2.0 * num_layers) ** 0.5 if ("linear_proj" in name or "linear_fc2" in name) else std
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * scale
        if split:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        param.copy_(full)
