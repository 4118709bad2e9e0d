"""One pipeline stage of Gemma 4 (:mod:`mmpack.trainer.models.gemma4.language`'s layers): on the first stage the
vision tower and the embeddings (word embeddings times sqrt(hidden), the image soft tokens' features scattered in,
and with PLE the per-layer inputs), on the last the final norm, the tied output layer, the logit softcap and the
per-token loss.

Per-layer inputs are made on the first stage from the embeddings (with the images' features), so a later stage
cannot make its own: under pipeline parallelism each stage sends the next the hidden states with every layer's
per-layer inputs beside them, ``[s, b, hidden + layers x ple]`` (the language config's ``hidden_size`` is that
width, which is what megatron-core's schedule sends; the layers take their sizes from the architecture).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mmpack.trainer.models.gemma4.config import Gemma4Arch
from mmpack.trainer.models.gemma4.language import Decoder, Embedding, Gemma4Layer, PackedContext, layers_of
from mmpack.trainer.models.gemma4.masks import image_blocks


def _padding_row_frozen(looked_up: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """Embeddings looked up, without gradient where the id is the padding id (Gemma 4's tables are
    ``nn.Embedding``s with ``padding_idx``: that row never trains, though media soft tokens look it up)."""
    return torch.where(pads, looked_up.detach(), looked_up)


class Gemma4Language(MegatronModule):
    """The language part of a stage: ``embedding`` (first stage), ``decoder`` and ``output_layer`` (last)."""

    def __init__(
        self, config: TransformerConfig, arch: Gemma4Arch, *, pre_process: bool, post_process: bool,
        vp_stage: int | None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        text = arch.text
        self.first_layer, count = layers_of(text, config, vp_stage)
        self.embedding = Embedding(config, text) if pre_process else None
        self.decoder = Decoder(config, text, self.first_layer, count, last=post_process)
        self.output_layer = None
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                text.hidden_size, text.vocab_size, config=config, init_method=config.init_method, bias=False,
                gather_output=False, skip_bias_add=False,
                skip_weight_param_allocation=pre_process and text.tie_word_embeddings,
            )  # fmt: skip


class Gemma4Stage(MegatronModule):
    """One pipeline stage (or model chunk) of Gemma 4: per-token loss [b, s] from the last stage with labels
    (logits [b, s, vocab] without), else the hidden states (with the per-layer inputs, see the module docstring)."""

    def __init__(
        self, arch: Gemma4Arch, config: TransformerConfig, vision: torch.nn.Module | None, *, pre_process: bool,
        post_process: bool, vp_stage: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        text = arch.text
        self.arch = arch
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = text.tie_word_embeddings
        self.pre_process, self.post_process = pre_process, post_process
        self.vision = vision
        self.language_model = Gemma4Language(
            config, arch, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        self.ple = text.hidden_size_per_layer_input
        self.carries_ple = bool(self.ple) and config.pipeline_model_parallel_size > 1
        self.input_tensor: torch.Tensor | None = None
        weight = self.shared_embedding_or_output_weight() if text.tie_word_embeddings else None
        if weight is not None and config.pipeline_model_parallel_size == 1:
            weight.zero_out_wgrad = True  # type: ignore[attr-defined]
        elif weight is not None and post_process and not pre_process:
            weight.shared = True  # type: ignore[attr-defined]  # the last stage's copy of the embedding
            weight.shared_embedding = True  # type: ignore[attr-defined]
        elif weight is not None and pre_process and not post_process:
            weight.shared_embedding = True  # type: ignore[attr-defined]

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        lm = self.language_model
        if self.pre_process:
            assert lm.embedding is not None
            return lm.embedding.word_embeddings.weight
        return lm.output_layer.weight if lm.output_layer is not None else None

    # -- the first stage ----------------------------------------------------------------------------

    def _sequence_major(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, w] -> [s, b, w], this rank's part under sequence parallelism."""
        x = x.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        return x

    def _media_features(
        self, slots: torch.Tensor, pixels: torch.Tensor | None, grids: torch.Tensor | None, what: str
    ) -> torch.Tensor | None:
        count = int(slots.sum())
        if not count:
            return None
        if pixels is None or grids is None or self.vision is None:
            raise ValueError(f"the batch has {count} {what} soft tokens but no pixels or grids for them")
        if what == "video":  # each frame is an image to the tower ([t, h, w] grids: frame-major patch rows)
            grids = torch.repeat_interleave(
                torch.cat([torch.ones_like(grids[:, :1]), grids[:, 1:]], dim=1), grids[:, 0], dim=0
            )
        features = self.vision(pixels, grids)
        if features.shape[0] != count:
            raise ValueError(f"{features.shape[0]} {what} features for {count} {what} soft tokens")
        return features

    def embed(
        self, tokens: torch.Tensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(embeddings [s, b, h], per-layer inputs [s, b, layers x ple] or None), sequence-major."""
        text, emb_module = self.arch.text, self.language_model.embedding
        assert emb_module is not None
        image_slots, video_slots = tokens == self.arch.image_token_id, tokens == self.arch.video_token_id
        ids = tokens.masked_fill(image_slots | video_slots, text.pad_token_id)
        pads = (ids == text.pad_token_id).unsqueeze(-1)
        emb = _padding_row_frozen(emb_module.word_embeddings(ids), pads)
        emb = emb * torch.tensor(text.hidden_size**0.5, dtype=emb.dtype)
        for slots, pixels, grids, what in (
            (image_slots, pixel_values, image_grid_thw, "image"),
            (video_slots, pixel_values_videos, video_grid_thw, "video"),
        ):
            found = self._media_features(slots, pixels, grids, what)
            if found is not None:
                emb = emb.masked_scatter(slots.unsqueeze(-1), found.to(emb.dtype))
        ple = None
        if self.ple:
            b, s, _ = emb.shape
            table = _padding_row_frozen(emb_module.per_layer_embeddings(ids), pads)
            table = table * torch.tensor(self.ple**0.5, dtype=table.dtype)
            projected = emb_module.per_layer_projection(emb) * text.hidden_size**-0.5
            projected = emb_module.per_layer_projection_norm(
                projected.reshape(b, s, text.num_layers, self.ple)
            )
            ple = self._sequence_major((projected.reshape(b, s, -1) + table) * 2.0**-0.5)
        return self._sequence_major(emb), ple

    # -- every stage --------------------------------------------------------------------------------

    def _context(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> PackedContext:
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # [b, s]
        blocks = None
        if self.arch.text.bidirectional_vision:
            kinds = (tokens == self.arch.image_token_id).long() + 2 * (
                tokens == self.arch.video_token_id
            ).long()
            blocks = image_blocks(kinds.reshape(-1))
        return PackedContext(self.arch.text, positions, blocks)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any = None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """See the class docstring; ``attention_mask`` and ``packed_seq_params`` are not read: samples and images
        come from the positions and the tokens, so a THD micro-batch (one flattened row, as the trainer gives it with
        Transformer Engine) runs through the same per-sample attention (torch SDPA, on GPU too)."""
        h = self.arch.text.hidden_size
        if self.pre_process:
            hidden, ple = self.embed(
                tokens, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
        else:
            assert self.input_tensor is not None
            hidden, ple = self.input_tensor[..., :h], None
            if self.carries_ple:
                ple = self.input_tensor[..., h:]
        ctx = self._context(tokens, position_ids)
        layers: list[Gemma4Layer] = list(self.language_model.decoder.layers)  # type: ignore[arg-type]
        for layer in layers:
            piece = None
            if ple is not None:
                piece = ple[..., layer.layer * self.ple : (layer.layer + 1) * self.ple]
            hidden = layer(hidden, ctx, piece)
        if not self.post_process:
            return torch.cat([hidden, ple], dim=-1) if ple is not None and self.carries_ple else hidden
        return self._loss(hidden, labels)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        lm = self.language_model
        assert lm.decoder.final_layernorm is not None and lm.output_layer is not None
        hidden = lm.decoder.final_layernorm(hidden)
        tied = self.pre_process and self.arch.text.tie_word_embeddings
        weight = self.shared_embedding_or_output_weight() if tied else None
        logits = lm.output_layer(hidden, weight=weight)[0]  # [s, b, vocab / TP]
        cap = self.arch.text.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if labels is None:
            whole = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            return whole.transpose(0, 1).contiguous()
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float(), labels.transpose(0, 1).contiguous()
        )
        return loss.transpose(0, 1).contiguous()
