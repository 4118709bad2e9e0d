"""One pipeline stage of Qwen2.5-VL on megatron-core: the vision tower (first stage) whose merged patch
features replace the ``<|image_pad|>`` (for videos the ``<|video_pad|>``) embeddings, fed as ``decoder_input``
to a ``GPTModel`` with MRoPE (``position_embedding_type="mrope"``), RMSNorm, SwiGLU and grouped-query
attention with QKV bias."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from mmpack.trainer.models.common import build_block_spec
from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch, Qwen25VLMegatronConfigs
from mmpack.trainer.models.qwen2_5_vl.vision import VisionTower


class Qwen25VLModel(MegatronModule):
    """One pipeline stage, or under the interleaved pipeline one model chunk (``vp_stage``) of a stage. The
    first (chunk of the first) stage embeds text and images; the last (chunk of the last) computes the
    per-token loss."""

    def __init__(
        self,
        arch: Qwen25VLArch,
        configs: Qwen25VLMegatronConfigs,
        *,
        pre_process: bool,
        post_process: bool,
        use_te: bool = False,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__(configs.language)
        self.vp_stage = vp_stage
        self.arch = arch
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = arch.tie_word_embeddings  # read by finalize_model_grads
        self.pre_process = pre_process
        self.post_process = post_process
        self.image_pad_id = arch.image_token_id
        self.video_pad_id = arch.video_token_id
        self.vision = VisionTower(configs.vision, configs.projector, arch.vision) if pre_process else None
        block = build_block_spec(
            get_num_layers_to_build(configs.language, vp_stage=vp_stage), use_te=use_te,
            fp32_residual=configs.language.fp32_residual_connection,
        )  # fmt: skip
        self.language_model = GPTModel(
            config=configs.language,
            transformer_layer_spec=block,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="mrope",
            rotary_base=int(arch.rope_theta),
            # whole-sequence word embeddings: image features go in before embed() scatters for SP
            scatter_embedding_sequence_parallel=False,
            vp_stage=vp_stage,
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def _scatter_vision(
        self,
        emb: torch.Tensor,
        slots: torch.Tensor,
        pixels: torch.Tensor | None,
        grid_thw: torch.Tensor | None,
        what: str,
    ) -> torch.Tensor:
        """``emb`` with the vision features of ``pixels`` in the ``slots`` (the pad tokens of one kind)."""
        num_slots = int(slots.sum())
        if not num_slots:
            return emb
        if pixels is None or grid_thw is None or self.vision is None:
            raise ValueError(f"batch has <|{what}_pad|> tokens but no pixels/grids for them")
        features = self.vision(pixels, grid_thw).to(emb.dtype)
        if features.shape[0] != num_slots:
            raise ValueError(f"{features.shape[0]} {what} features for {num_slots} <|{what}_pad|> tokens")
        return emb.masked_scatter(slots.unsqueeze(-1), features)

    def embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text embeddings with image (video) features scattered into the ``<|image_pad|>``
        (``<|video_pad|>``) slots -> [s, b, h]."""
        emb_module = self.language_model.embedding
        emb = emb_module.word_embeddings(tokens)
        emb = self._scatter_vision(emb, tokens == self.image_pad_id, pixel_values, image_grid_thw, "image")
        emb = self._scatter_vision(
            emb, tokens == self.video_pad_id, pixel_values_videos, video_grid_thw, "video"
        )
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
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] on the last stage when labels are given (logits without), hidden states
        elsewhere. ``position_ids`` are the MRoPE positions [3, b, s]."""
        decoder_input = (
            self.embed(tokens, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
            if self.pre_process
            else None
        )
        return self.language_model(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
        )
