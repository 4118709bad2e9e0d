"""The Qwen3-VL vision tower on megatron-core: Conv3d patch embedding (patch 16, with bias) plus learned
position embeddings resampled to each image's grid, transformer layers (megatron-core's local TransformerLayer
with LayerNorm, a GELU-tanh MLP and 2-D rotary positions) under full attention within each image and each
temporal patch of a video, the 2x2 patch merger (LayerNorm + megatron-core's MultimodalProjector MLP), and the
DeepStack mergers: the hidden states after the layers of ``deepstack_visual_indexes``, merged by their own
mergers (LayerNorm after the 2x2 concatenation), go to the first language layers
(:class:`mmpack.trainer.models.vlm_stage.VisionFeatures`). Tensor parallel like the language model; it runs
on the first pipeline stage only.

Position embeddings: the ``side x side`` learned grid is resampled bilinearly (corners aligned) to the image's
``h x w`` patches, as transformers' ``get_vision_interpolation_indices_and_weights`` computes it (the same
float32 operations): each patch takes four grid entries with their weights.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmpack.trainer.models.common import LayerNorm
from mmpack.trainer.models.qwen3_vl.config import Qwen3VisionArch
from mmpack.trainer.models.vision_common import (
    PatchMerger,
    VisionTowerBase,
    frame_lengths,
    patch_hw_positions,
    segments,
    vision_rotary_angles,
)
from mmpack.trainer.models.vlm_stage import VisionFeatures


def interpolation_taps(
    grid_thw: torch.Tensor, side: int, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [P, 4] into the flattened ``side x side`` grid, weights [P, 4] float32) of every patch, in
    processor order (see the module docstring)."""
    grids = grid_thw.cpu().numpy().astype(np.int64)
    positions = patch_hw_positions(grids, merge_size)
    patches = grids.prod(axis=1)
    heights, widths = np.repeat(grids[:, 1], patches), np.repeat(grids[:, 2], patches)
    taps, weights = [], []
    for index, size in ((positions[:, 0], heights), (positions[:, 1], widths)):
        index_t = torch.as_tensor(index).to(torch.float32)
        size_t = torch.as_tensor(size)
        src = index_t * (side - 1) / torch.clamp(size_t - 1, min=1)
        floor = torch.floor(src)
        offsets = torch.arange(0, 2)
        taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
        weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
    indices = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
    return indices, (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)


class Qwen3VisionTower(VisionTowerBase):
    """pixel_values [P, C*T*p*p] (processor order) + grid_thw -> :class:`VisionFeatures` (merged [P / 4, h]
    and one DeepStack tensor of that shape per ``deepstack_visual_indexes``)."""

    def __init__(
        self, config: TransformerConfig, projector_config: TransformerConfig, arch: Qwen3VisionArch
    ) -> None:
        super().__init__(config, arch, norm=LayerNorm, patch_bias=True)
        self.pos_embed = torch.nn.Embedding(arch.num_position_embeddings, arch.hidden_size)
        units = arch.spatial_merge_size**2
        self.merger = PatchMerger(config, projector_config, units, after_merge=False)
        self.deepstack_mergers = torch.nn.ModuleList(
            [
                PatchMerger(config, projector_config, units, after_merge=True)
                for _ in arch.deepstack_visual_indexes
            ]
        )

    def _position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.arch
        indices, weights = interpolation_taps(grid_thw.detach().cpu(), a.grid_side, a.spatial_merge_size)
        device = self.pos_embed.weight.device
        table = self.pos_embed(indices.to(device))  # [P, 4, h]
        return (table * weights.to(device)[:, :, None]).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        a, device = self.arch, pixel_values.device
        grids = grid_thw.detach().cpu().numpy().astype(np.int64)
        hidden = self._embed_patches(pixel_values)
        hidden = hidden + self._position_embeddings(grid_thw).to(hidden.dtype)
        positions = torch.as_tensor(patch_hw_positions(grids, a.spatial_merge_size), device=device)
        rotary = vision_rotary_angles(positions, a.head_dim, a.rope_theta)[:, None, None, :]
        frames = segments(frame_lengths(grids), device)  # full attention within each image / temporal patch
        hidden = hidden.unsqueeze(1)  # [P, 1, h]
        deepstack = []
        for i, layer in enumerate(self.layers):
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=frames)
            if i in a.deepstack_visual_indexes:
                merger = self.deepstack_mergers[a.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(hidden.squeeze(1)))
        return VisionFeatures(self.merger(hidden.squeeze(1)), tuple(deepstack))
