"""Packed 3-D (temporal, height, width) MRoPE position ids of Qwen2-VL-style models.

Every sample of a packed sequence gets the positions transformers' ``get_rope_index`` gives that sample
alone, so they restart at 0 for each sample. Within a sample, text tokens count up by one; the
``<|image_pad|>`` tokens of an image with grid (t, h, w) patches take

    temporal = start + i_t,  height = start + i_h,  width = start + i_w     (over the merged t x h/m x w/m grid)

in row-major order, and the text after it continues at ``start + max(h, w) / m`` (transformers 5's rule;
for still images it equals the largest image position + 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def _image_positions(start: int, grid_thw: Sequence[int], merge_size: int) -> np.ndarray:
    """[3, t * h/m * w/m] positions of one image's tokens starting at ``start``."""
    t, h, w = (int(v) for v in grid_thw)
    gh, gw = h // merge_size, w // merge_size
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def _fill_sample(
    ids: np.ndarray, out: np.ndarray, grids: Iterator[list[int]], image_pad_id: int, merge_size: int
) -> None:
    """Positions of one sample (``out`` is its [3, n] slice), consuming its images' grids in order."""
    is_image = ids == image_pad_id
    # boundaries of runs of equal modality
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(ids)]])
    pos = 0
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        if not is_image[a]:
            out[:, a:b] = np.arange(pos, pos + b - a)
            pos += b - a
            continue
        while a < b:  # one run may hold several images placed back to back
            grid = next(grids, None)
            if grid is None:
                raise ValueError("more <|image_pad|> tokens than the image grids account for")
            n = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge_size**2
            if n > b - a:
                raise ValueError(
                    f"an image of grid {list(grid)} needs {n} <|image_pad|> tokens, found {b - a}"
                )
            out[:, a : a + n] = _image_positions(pos, grid, merge_size)
            pos += max(int(grid[1]), int(grid[2])) // merge_size
            a += n


def build_mrope_position_ids(
    input_ids: np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    image_grid_thw: np.ndarray,
    *,
    image_pad_id: int,
    merge_size: int,
) -> np.ndarray:
    """[3, len(input_ids)] int64 MRoPE positions of a packed sequence.

    Args:
        input_ids: token ids of the concatenated samples (a padding segment may be one of them).
        seq_lens: length of each sample, in order; they must sum to ``len(input_ids)``.
        image_grid_thw: [n_images, 3] grids in patches, in the order the images appear.
        image_pad_id: the ``<|image_pad|>`` token id.
        merge_size: spatial merge size of the vision tower (2 for Qwen2-VL / Qwen2.5-VL).
    """
    ids = np.asarray(input_ids).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if int(lens.sum()) != len(ids):
        raise ValueError(f"seq_lens sum to {int(lens.sum())}, the sequence has {len(ids)} tokens")
    grids = iter(np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3).tolist())
    out = np.empty((3, len(ids)), dtype=np.int64)
    start = 0
    for n in lens.tolist():
        _fill_sample(ids[start : start + n], out[:, start : start + n], grids, image_pad_id, merge_size)
        start += n
    if next(grids, None) is not None:
        raise ValueError("more image grids than images among the <|image_pad|> tokens")
    return out
