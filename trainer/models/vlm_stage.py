"""One pipeline stage of a vision-language model on megatron-core, for every family: the vision tower (first
stage) whose merged patch features replace the ``<|image_pad|>`` (for videos the ``<|video_pad|>``)
embeddings, fed as ``decoder_input`` to the family's language ``GPTModel``.

A tower returns its merged features, or :class:`VisionFeatures` with DeepStack features too (Qwen3-VL): one
tensor per early language layer, added to the hidden states of the vision tokens after that layer (after
layer 0 the first, ...), as transformers' ``Qwen3VLTextModel`` does. They are added by forward hooks on the
language layers of the first stage, which must hold them all. :func:`build_stage` puts a family's tower and
language model together (:class:`TowerFamily`: a family that builds its stages so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from mmpack.trainer.models.protocol import ArchT, ModelFamily
from mmpack.trainer.models.qwen_lm import build_language_model, language_config
from mmpack.trainer.models.qwen_moe import mark_expert_parameters
from mmpack.trainer.models.vision_common import VLMegatronConfigs, tower_configs


@dataclass(frozen=True)
class VisionFeatures:
    """A tower's output: merged features [n, h] and DeepStack features (each [n, h], one per layer)."""

    merged: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


class VisionLanguageStage(MegatronModule):
    """One pipeline stage, or under the interleaved pipeline one model chunk (``vp_stage``) of a stage. The
    first (chunk of the first) stage embeds text and images; the last (chunk of the last) computes the
    per-token loss. ``deepstack_layers``: how many early language layers take DeepStack features."""

    def __init__(
        self, arch: Any, language_model: GPTModel, vision: torch.nn.Module | None, *, pre_process: bool,
        post_process: bool, vp_stage: int | None = None, deepstack_layers: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(language_model.config)
        self.vp_stage = vp_stage
        self.arch = arch
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = arch.tie_word_embeddings  # read by finalize_model_grads
        self.pre_process = pre_process
        self.post_process = post_process
        self.image_pad_id = arch.image_token_id
        self.video_pad_id = arch.video_token_id
        self.vision = vision
        self.language_model = language_model
        self._deepstack: list[torch.Tensor] | None = None  # this micro-batch's, during forward only
        if pre_process and deepstack_layers:
            self._hook_deepstack(deepstack_layers)

    def _hook_deepstack(self, count: int) -> None:
        layers = self.language_model.decoder.layers
        numbers = [int(layer.layer_number) for layer in layers]
        if numbers[:count] != list(range(1, count + 1)):
            raise ValueError(
                f"DeepStack adds vision features after language layers 0..{count - 1}: the first pipeline "
                f"stage (with the vision tower) must hold them, it holds {len(numbers)}; give "
                f"--decoder-first-pipeline-num-layers {count} or more"
            )
        for i in range(count):
            layers[i].register_forward_hook(self._deepstack_hook(i))

    def _deepstack_hook(self, index: int) -> Any:
        def add(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._deepstack is None:
                return output
            hidden, context = output
            return hidden + self._deepstack[index].to(hidden.dtype), context

        return add

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def _vision_features(
        self, slots: torch.Tensor, pixels: torch.Tensor | None, grid_thw: torch.Tensor | None, what: str,
        patch_positions: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> VisionFeatures | None:  # fmt: skip
        """The tower's features for the ``slots`` (the pad tokens of one kind); None without such pads.

        ``patch_positions``: the micro-batch's, for a tower that takes them. ``rows`` (context parallelism): the
        tower runs on every image of the micro-batch and the slots of this rank take the feature rows given
        (their pads' ordinals in the whole micro-batch)."""
        num_slots = int(slots.sum())
        if not num_slots:
            return None
        if pixels is None or grid_thw is None or self.vision is None:
            raise ValueError(f"batch has <|{what}_pad|> tokens but no pixels/grids for them")
        extra = {} if patch_positions is None else {"patch_positions": patch_positions}
        out = self.vision(pixels, grid_thw, **extra)
        features = out if isinstance(out, VisionFeatures) else VisionFeatures(out)
        if rows is not None:
            if len(rows) != num_slots or int(rows.max()) >= features.merged.shape[0]:
                raise ValueError(
                    f"{num_slots} <|{what}_pad|> tokens on this CP rank, {len(rows)} feature rows given for "
                    f"{features.merged.shape[0]} {what} features"
                )
            return VisionFeatures(features.merged[rows], tuple(f[rows] for f in features.deepstack))
        if features.merged.shape[0] != num_slots:
            raise ValueError(
                f"{features.merged.shape[0]} {what} features for {num_slots} <|{what}_pad|> tokens"
            )
        return features

    def _sequence_major(self, emb: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [s, b, h] in the residual dtype, this rank's part under sequence parallelism."""
        emb = emb.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            emb = emb.float()
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    def embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        patch_positions: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        video_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text embeddings with image (video) features scattered into the ``<|image_pad|>``
        (``<|video_pad|>``) slots -> [s, b, h]; DeepStack features kept for this forward's hooks.
        ``patch_positions`` (of the image patches) go to a tower that takes them; ``image_rows`` /
        ``video_rows``: under CP, the feature row of each of this rank's slots."""
        emb_module = self.language_model.embedding
        emb = emb_module.word_embeddings(tokens)
        media = [
            (tokens == self.image_pad_id, pixel_values, image_grid_thw, "image", patch_positions, image_rows),
            (tokens == self.video_pad_id, pixel_values_videos, video_grid_thw, "video", None, video_rows),
        ]
        deepstack: list[torch.Tensor] | None = None
        for slots, pixels, grids, what, positions, rows in media:
            found = self._vision_features(slots, pixels, grids, what, positions, rows)
            if found is None:
                continue
            emb = emb.masked_scatter(slots.unsqueeze(-1), found.merged.to(emb.dtype))
            if found.deepstack:
                deepstack = deepstack or [torch.zeros_like(emb) for _ in found.deepstack]
                deepstack = [
                    d.masked_scatter(slots.unsqueeze(-1), f.to(d.dtype))
                    for d, f in zip(deepstack, found.deepstack)
                ]
        self._deepstack = [self._sequence_major(d) for d in deepstack] if deepstack else None
        emb = self._sequence_major(emb)
        if self.config.sequence_parallel:
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
        patch_positions: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        video_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] on the last stage when labels are given (logits without), hidden states
        elsewhere. ``position_ids`` are the MRoPE positions [3, b, s]; ``patch_positions`` [P, 3] those of
        the image patches, for a tower that takes them (the micro-batch's, see `mmpack.packing.batch`);
        ``image_rows`` / ``video_rows`` as in :meth:`embed`."""
        decoder_input = (
            self.embed(
                tokens,
                pixel_values,
                image_grid_thw,
                pixel_values_videos,
                video_grid_thw,
                patch_positions=patch_positions,
                image_rows=image_rows,
                video_rows=video_rows,
            )
            if self.pre_process
            else None
        )
        try:
            return self.language_model(
                input_ids=None,
                position_ids=position_ids,
                attention_mask=attention_mask,
                decoder_input=decoder_input,
                labels=labels,
                packed_seq_params=packed_seq_params,
            )
        finally:
            self._deepstack = None


def build_stage(
    arch: Any, language_config: Any, tower: Callable[[], torch.nn.Module], *, pre_process: bool,
    post_process: bool, use_te: bool, vp_stage: int | None, interleaved_mrope: bool = False,
    deepstack_layers: int = 0,
) -> VisionLanguageStage:  # fmt: skip
    """One stage of a Qwen vision-language model: the Qwen language model
    (:func:`mmpack.trainer.models.qwen_lm.build_language_model`) and, on the first stage, the ``tower``; with
    ``arch.moe`` its experts are expert-parallel parameters under every EP size
    (:func:`mmpack.trainer.models.qwen_moe.mark_expert_parameters`)."""
    language_model = build_language_model(
        arch, language_config, pre_process=pre_process, post_process=post_process, use_te=use_te,
        vp_stage=vp_stage, interleaved_mrope=interleaved_mrope,
    )  # fmt: skip
    stage = VisionLanguageStage(
        arch, language_model, tower() if pre_process else None, pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage, deepstack_layers=deepstack_layers,
    )  # fmt: skip
    if arch.moe is not None:
        mark_expert_parameters(stage)
    return stage


class TowerFamily(ModelFamily[ArchT]):
    """A family whose stage is a :class:`VisionLanguageStage` (:func:`build_stage`): its vision ``tower`` (made
    from the vision and merger configs and ``arch.vision``) before the Qwen language model."""

    tower: Callable[[Any, Any, Any], torch.nn.Module]
    interleaved_mrope: bool = False  # Qwen3-VL's MRoPE (else megatron-core's sections)

    def deepstack_layers(self, arch: ArchT) -> int:
        """Early language layers that take DeepStack features from the tower (Qwen3-VL's); 0: none."""
        return 0

    def build_stage(
        self, arch: ArchT, configs: VLMegatronConfigs, *, pre_process: bool, post_process: bool,
        use_te: bool = False, vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        return build_stage(
            arch, configs.language, lambda: self.tower(configs.vision, configs.projector, arch.vision),
            pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
            interleaved_mrope=self.interleaved_mrope, deepstack_layers=self.deepstack_layers(arch),
        )  # fmt: skip


def qwen_vl_configs(
    arch: Any, common: dict[str, Any], language_extra: dict[str, Any], *, qk_norm: bool, vision_norm: str,
    vision_activation: Callable[..., torch.Tensor], vision_gated: bool, vision_norm_eps: float = 1e-6,
    vision_rotary_interleaved: bool = False,
) -> VLMegatronConfigs:  # fmt: skip
    """megatron-core configs of a vision-language model with a Qwen language model (QKV bias without QK-norm,
    Qwen2; none with it, Qwen3; its experts with ``arch.moe``) and its vision tower (``arch.vision``: depth,
    sizes, merge size) and merger (see :func:`mmpack.trainer.models.vision_common.tower_configs`)."""
    language = language_config(arch, common, language_extra, qkv_bias=not qk_norm, qk_norm=qk_norm)
    v = arch.vision
    vision, projector = tower_configs(
        depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads, ffn_hidden_size=v.intermediate_size,
        merged_size=v.hidden_size * v.spatial_merge_size**2, out_size=v.out_hidden_size, common=common,
        normalization=vision_norm, activation=vision_activation, gated=vision_gated,
        layernorm_epsilon=vision_norm_eps, rotary_interleaved=vision_rotary_interleaved,
    )  # fmt: skip
    return VLMegatronConfigs(language=language, vision=vision, projector=projector)
