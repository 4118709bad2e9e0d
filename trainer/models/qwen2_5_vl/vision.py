"""The Qwen2.5-VL vision tower on megatron-core: Conv3d patch embedding, transformer layers (megatron-core's
local TransformerLayer with RMSNorm, SwiGLU and 2-D rotary positions) under window / full attention, and
the 2x2 patch merger (RMSNorm + megatron-core's MultimodalProjector MLP). Tensor parallel like the language
model; it runs on the first pipeline stage only.

Attention is block-diagonal (never across images, and within windows for the windowed layers): the blocks go
to attention as cu_seqlens (:class:`mmpack.trainer.models.segment_attention.SegmentAttention`), never as a dense
[P, P] mask.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mmpack.trainer.models.common import RMSNorm
from mmpack.trainer.models.qwen2_5_vl.config import VisionArch
from mmpack.trainer.models.qwen2_5_vl.rope import window_order
from mmpack.trainer.models.vision_common import (
    VisionTowerBase,
    frame_lengths,
    merger_mlp,
    patch_hw_positions,
    segments,
    vision_rotary_angles,
)


class PatchMerger(MegatronModule):
    """RMSNorm, then each 2x2 group of patch features (concatenated) through a GELU MLP."""

    def __init__(
        self, vision_config: TransformerConfig, projector_config: TransformerConfig, merge_units: int
    ):
        super().__init__(projector_config)
        self.merged_size = vision_config.hidden_size * merge_units
        self.ln_q = RMSNorm(vision_config, vision_config.hidden_size, eps=1e-6)
        self.projector = merger_mlp(projector_config, self.merged_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.projector(self.ln_q(hidden).reshape(-1, self.merged_size))


class VisionTower(VisionTowerBase):
    """pixel_values [P, C*T*p*p] (processor order) + image_grid_thw -> [P / merge**2, language hidden]."""

    def __init__(
        self, config: TransformerConfig, projector_config: TransformerConfig, arch: VisionArch
    ) -> None:
        super().__init__(config, arch, norm=RMSNorm, patch_bias=False)
        self.merger = PatchMerger(config, projector_config, arch.spatial_merge_size**2)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        a, device = self.arch, pixel_values.device
        grids = image_grid_thw.detach().cpu().numpy().astype(np.int64)
        unit = a.spatial_merge_size**2
        order, window_lengths = window_order(
            grids, merge_size=a.spatial_merge_size, window_size=a.window_size, patch_size=a.patch_size
        )
        # full attention within each image and each frame pair of a video (per temporal patch), as transformers
        image_lengths = frame_lengths(grids)
        patch_order = torch.as_tensor((order[:, None] * unit + np.arange(unit)).reshape(-1), device=device)
        positions = torch.as_tensor(patch_hw_positions(grids, a.spatial_merge_size), device=device)

        hidden = self._embed_patches(pixel_values)[patch_order]
        angles = vision_rotary_angles(positions[patch_order], a.head_dim, a.rope_theta)
        rotary = angles[:, None, None, :]  # [P, 1, 1, head_dim], megatron-core's [s, b, 1, d]
        # windows are contiguous after the reordering, and every image is a run of whole windows
        windows, images = (segments(lengths, device) for lengths in (window_lengths, image_lengths))
        hidden = hidden.unsqueeze(1)  # [P, 1, h]
        for i, layer in enumerate(self.layers):
            blocks = images if i in a.fullatt_block_indexes else windows
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=blocks)
        merged = self.merger(hidden.squeeze(1))
        return merged[torch.as_tensor(np.argsort(order), device=device)]
