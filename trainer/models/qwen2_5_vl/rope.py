"""Positions of the Qwen2.5-VL vision tower: 2-D rotary angles per patch, the window order and the
attention blocks (per image for full-attention layers, per window for the others).

The patches arrive in the image processor's order (merge-window-major: each 2x2 group of patches is
contiguous). The tower reorders the groups window by window so that a window's patches are contiguous,
and the attention of a layer is block-diagonal over images or windows.
"""

from __future__ import annotations

import numpy as np
import torch

from mmpack.packing.layout import block_mask as layout_block_mask


def patch_hw_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """[P, 2] (row, column) of every patch in processor order."""
    out = []
    for t, h, w in grid_thw.tolist():
        grid_rows, grid_cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = grid_rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = grid_cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def window_order(
    grid_thw: np.ndarray, *, merge_size: int, window_size: int, patch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(group order, window lengths in patches).

    ``order[k]`` is the merged group (2x2 patches) placed k-th; windows are ``window_size`` pixels square,
    i.e. ``window_size / patch_size / merge_size`` groups on a side, cut row-major out of every image and
    frame; edge windows are smaller.
    """
    side = window_size // merge_size // patch_size
    unit = merge_size**2
    order: list[np.ndarray] = []
    lengths: list[int] = []
    offset = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge_size, w // merge_size
        index = np.arange(t * gh * gw).reshape(t, gh, gw) + offset
        for frame in index:
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    block = frame[r : r + side, c : c + side].reshape(-1)
                    order.append(block)
                    lengths.append(len(block) * unit)
        offset += t * gh * gw
    flat = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    return flat, np.asarray(lengths, dtype=np.int64)


def block_mask(lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """[1, 1, P, P] bool, True = masked: each patch sees the patches of its own block only
    (`mmpack.packing.layout.block_mask`, not causal)."""
    block = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device)
    )
    return layout_block_mask(block, causal=False)[None, None]


def vision_rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[P, head_dim] rotary angles: the row and column angles (head_dim / 4 frequencies each) side by side,
    repeated for the two rotated halves (megatron-core's non-interleaved layout, as transformers' axial RoPE)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [P, 2, head_dim/4]
    angles = freqs.reshape(positions.shape[0], -1)  # rows' then columns' frequencies
    return torch.cat([angles, angles], dim=-1)
