"""The RICE-ViT of LLaVA-OneVision-1.5 on megatron-core: a bias-free patch embedding of 2-D patches (temporal
patch 1), one learned class token put before the patches of each image (each frame of a video), a LayerNorm
before the layers, megatron-core's local TransformerLayer (LayerNorm, exact-GELU MLP, biases) with 2-D rotary
positions, full attention within each image and its class token, the class tokens dropped after the layers,
and the patch merger (LayerNorm per patch, the ``merge x merge`` concatenation through a GELU MLP). Tensor
parallel like the language model; it runs on the first pipeline stage only.

Rotary positions: a patch's angles are those of its (row, column) (`vision_rotary_angles`, base 10000, over
the two halves of a head); a class token's are a learned vector of half a head (``class_pos_emb``), repeated
for the two halves the same way.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mmpack.trainer.models.common import LayerNorm
from mmpack.trainer.models.llava_onevision1_5.config import ROTARY_THETA, RiceViTArch
from mmpack.trainer.models.vision_common import (
    PatchMerger,
    VisionTowerBase,
    frame_lengths,
    segments,
    vision_rotary_angles,
)


class ClassToken(torch.nn.Module):
    """The class token's embedding [hidden] and its learned rotary angles [1, head_dim / 2] (replicated over
    tensor-parallel ranks); their values come from the checkpoint, or from the random init by HF name
    (``hf_weights.RandomHFWeights``) like every other weight."""

    def __init__(self, hidden_size: int, head_dim: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.zeros(hidden_size))
        self.angles = torch.nn.Parameter(torch.zeros(1, head_dim // 2))


def class_token_layout(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(patch rows, class rows) in the sequence of ``lengths``-patch segments, each after its class token."""
    starts = np.cumsum(lengths) - lengths
    class_rows = starts + np.arange(len(lengths))
    patch_rows = np.arange(int(lengths.sum())) + np.repeat(np.arange(len(lengths)) + 1, lengths)
    return patch_rows, class_rows


class RiceViT(VisionTowerBase):
    """pixel_values [P, C*p*p] (processor order) + grid_thw + patch_positions [P, 3] -> merged [P / m^2, h]."""

    def __init__(
        self, config: TransformerConfig, projector_config: TransformerConfig, arch: RiceViTArch
    ) -> None:
        super().__init__(config, arch, norm=LayerNorm, patch_bias=False, flat_patches=True)
        self.class_token = ClassToken(arch.hidden_size, arch.head_dim)
        self.pre_layernorm = LayerNorm(config, arch.hidden_size, eps=arch.layer_norm_eps)
        self.merger = PatchMerger(config, projector_config, arch.spatial_merge_size**2, after_merge=False)

    def _with_class_tokens(
        self, rows: torch.Tensor, class_row: torch.Tensor, patch_rows: np.ndarray, class_rows: np.ndarray
    ) -> torch.Tensor:
        """``rows`` [P, d] at ``patch_rows`` and ``class_row`` [d] at ``class_rows`` of one [P + S, d]."""
        order = np.empty(len(patch_rows) + len(class_rows), dtype=np.int64)
        order[patch_rows] = np.arange(len(patch_rows))
        order[class_rows] = len(patch_rows) + np.arange(len(class_rows))
        both = torch.cat([rows, class_row.to(rows.dtype).expand(len(class_rows), -1)])
        return both[torch.as_tensor(order, device=rows.device)]

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        if patch_positions is None or patch_positions.shape != (pixel_values.shape[0], 3):
            raise ValueError(
                "the RICE-ViT needs the micro-batch's patch_positions, one row per patch: build the loader with "
                "the model family's position rule (build_loader(position_rule=family.position_rule(arch)))"
            )
        grids = grid_thw.detach().cpu().numpy().astype(np.int64).reshape(-1, 3)
        lengths = frame_lengths(grids)
        patch_rows, class_rows = class_token_layout(lengths)
        angles = vision_rotary_angles(
            patch_positions[:, 1:].to(pixel_values.device), self.arch.head_dim, ROTARY_THETA
        )
        half = self.arch.head_dim // 2
        rotary = self._with_class_tokens(
            angles[:, :half], self.class_token.angles[0].float(), patch_rows, class_rows
        )
        rotary = torch.cat([rotary, rotary], dim=-1)[:, None, None, :]
        hidden = self._with_class_tokens(
            self._embed_patches(pixel_values), self.class_token.embedding, patch_rows, class_rows
        )
        hidden = self.pre_layernorm(hidden).unsqueeze(1)  # [P + S, 1, h]
        blocks = segments(lengths + 1, pixel_values.device)
        for layer in self.layers:
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=blocks)
        keep = torch.as_tensor(patch_rows, device=hidden.device)
        return self.merger(hidden.squeeze(1)[keep])
