"""The OneVision-Encoder of LLaVA-OneVision-2 on megatron-core: a bias-free patch embedding of 2-D patches
(temporal patch 1), a LayerNorm before the layers, megatron-core's local TransformerLayer (LayerNorm, exact-GELU
MLP, biases) with 3-D rotary positions, attention within windows of ``frame_windows_size`` frames of each
image or video, and the patch merger (LayerNorm per patch, the ``merge x merge`` concatenation through a GELU
MLP). No class token, no learned position embeddings. Tensor parallel like the language model; it runs on
the first pipeline stage only.

Rotary positions: each patch's (frame, row, column) comes with the micro-batch (``patch_positions``, made
by the loader's workers, `mmpack.packing.patch_positions`). Half a head's frequencies are split 4:6:6 among
the three (each part with its own ``theta ** (-i / part)`` ladder), repeated for the second half; the angles
turn adjacent channel pairs (megatron-core's interleaved rotary layout), as the reference encoder does.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmpack.trainer.models.common import LayerNorm
from mmpack.trainer.models.llava_onevision2.config import OneVisionEncoderArch
from mmpack.trainer.models.vision_common import PatchMerger, VisionTowerBase, segments


def rotary_angles(patch_positions: torch.Tensor, arch: OneVisionEncoderArch) -> torch.Tensor:
    """[P, head_dim] float32 angles of patches at (frame, row, column) ``patch_positions`` [P, 3]."""
    parts = []
    for axis, size in enumerate(arch.rotary_split):
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(size, dtype=torch.float32) / size))
        parts.append(patch_positions[:, axis].float()[:, None] * inv_freq.to(patch_positions.device))
    half = torch.cat(parts, dim=-1)
    return torch.cat([half, half], dim=-1)


def window_lengths(grid_thw: np.ndarray, frames: int) -> np.ndarray:
    """Patches of each attention window: ``frames`` frames of an image or video at a time (the rest last)."""
    out: list[int] = []
    for t, h, w in grid_thw.tolist():
        full, rest = divmod(t, frames) if frames > 0 else (0, t)
        out += [frames * h * w] * full + ([rest * h * w] if rest else [])
    return np.asarray(out, dtype=np.int64)


class OneVisionEncoder(VisionTowerBase):
    """pixel_values [P, C*p*p] (processor order) + grid_thw + patch_positions [P, 3] -> merged [P / m^2, h]."""

    def __init__(
        self, config: TransformerConfig, projector_config: TransformerConfig, arch: OneVisionEncoderArch
    ) -> None:
        super().__init__(config, arch, norm=LayerNorm, patch_bias=False, flat_patches=True)
        self.pre_layernorm = LayerNorm(config, arch.hidden_size, eps=arch.layer_norm_eps)
        self.merger = PatchMerger(config, projector_config, arch.spatial_merge_size**2, after_merge=False)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        if patch_positions is None:
            raise ValueError(
                "the OneVision-Encoder needs the micro-batch's patch_positions: build the loader with the "
                "model family's position rule (build_loader(position_rule=family.position_rule(arch)))"
            )
        if patch_positions.shape != (pixel_values.shape[0], 3):
            raise ValueError(
                f"patch_positions of shape {tuple(patch_positions.shape)} for {pixel_values.shape[0]} patches"
            )
        grids = grid_thw.detach().cpu().numpy().astype(np.int64).reshape(-1, 3)
        hidden = self.pre_layernorm(self._embed_patches(pixel_values))
        rotary = rotary_angles(patch_positions.to(pixel_values.device), self.arch)[:, None, None, :]
        windows = segments(window_lengths(grids, self.arch.frame_windows_size), pixel_values.device)
        hidden = hidden.unsqueeze(1)  # [P, 1, h]
        for layer in self.layers:
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=windows)
        return self.merger(hidden.squeeze(1))
