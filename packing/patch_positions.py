"""Per-patch (t, h, w) positions of vision patches, and the position rule of families whose language model
takes 1-D positions while their vision tower takes each patch's 3-D position (LLaVA-OneVision-2).

Patches arrive in the image processor's order (merge-window-major: each ``merge x merge`` group of patches is
contiguous, frame after frame); `block_patch_positions` gives each patch's (frame, row, column) in that order,
the ``patch_positions`` that LLaVA-OneVision-2's vision tower turns into its 3-D rotary angles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def block_patch_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """int64 [P, 3] (frame, row, column) of every patch of the grids [N, 3], in processor order."""
    out = []
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3).tolist():
        if h % merge_size or w % merge_size:
            raise ValueError(
                f"grid {[t, h, w]} is not a whole number of {merge_size}x{merge_size} merge blocks"
            )
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        shape = (t, h // merge_size, merge_size, w // merge_size, merge_size)
        blocks = [a.reshape(shape).transpose(0, 1, 3, 2, 4).reshape(-1) for a in (frames, rows, cols)]
        out.append(np.stack(blocks, axis=-1))
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 3), dtype=np.int64)


@dataclass(frozen=True)
class TextPositionRule:
    """1-D positions restarting at 0 for each sample (vision tokens count as text), written on the three
    M-RoPE axes alike (an M-RoPE whose axes agree is the 1-D RoPE), and the block-order patch positions of
    the images (`mmpack.packing.batch.PositionRule`)."""

    merge_size: int

    def positions(
        self,
        input_ids: np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        image_grid_thw: np.ndarray,
        video_grid_thw: np.ndarray | None = None,
        second_per_grid_ts: np.ndarray | Sequence[float] | None = None,
    ) -> np.ndarray:
        """[3, len(input_ids)] int64: each sample's 0, 1, 2, ... on every axis."""
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if int(lens.sum()) != len(input_ids):
            raise ValueError(f"seq_lens sum to {int(lens.sum())}, the row has {len(input_ids)} tokens")
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        flat = np.arange(len(input_ids), dtype=np.int64) - starts
        return np.broadcast_to(flat, (3, len(flat))).copy()

    def patch_positions(self, image_grid_thw: np.ndarray) -> np.ndarray:
        """[P, 3] int64 (frame, row, column) of every image patch of the micro-batch, in processor order."""
        return block_patch_positions(image_grid_thw, self.merge_size)
