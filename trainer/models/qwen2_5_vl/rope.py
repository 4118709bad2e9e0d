"""Windows of the Qwen2.5-VL vision tower: the window order and the attention blocks (per image for
full-attention layers, per window for the others); the 2-D rotary angles per patch are
:mod:`mmpack.trainer.models.vision_common`'s.

The patches arrive in the image processor's order (merge-window-major: each 2x2 group of patches is
contiguous). The tower reorders the groups window by window so that a window's patches are contiguous,
and the attention of a layer is block-diagonal over images or windows.
"""

from __future__ import annotations

import numpy as np
import torch

from mmpack.packing.layout import block_mask as layout_block_mask


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
