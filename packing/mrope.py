"""Packed 3-D (temporal, height, width) MRoPE position ids of Qwen2-VL-style models.

Every sample of a packed sequence gets the positions transformers' ``get_rope_index`` gives that sample
alone, so they restart at 0 for each sample. Within a sample, text tokens count up by one; the
``<|image_pad|>`` tokens of an image with grid (t, h, w) patches take

    temporal = start + i_t,  height = start + i_h,  width = start + i_w     (over the merged t x h/m x w/m grid)

in row-major order, and the text after it continues at ``start + max(h, w) / m`` (transformers 5's rule;
for still images it equals the largest image position + 1). The ``<|video_pad|>`` tokens of a video take the
same height and width positions; its temporal positions are ``start + trunc(i_t * tokens_per_second *
second_per_grid_t)`` (Qwen2.5-VL, `mmpack.packing.video_tokens.video_temporal_positions`), and the text after it
continues at ``start + max(h, w) / m`` as after an image. Qwen3-VL writes each temporal patch of a video as
its own run of ``<|video_pad|>`` tokens between timestamp text (``video_frames_apart``): each run is placed
as an image of grid (1, h, w), as its ``get_rope_index`` splits ``video_grid_thw``.

`MRopeRule` holds a model family's choices (ids, merge size, the video rule) and computes the positions; the
model family names its rule (``ModelFamily.position_rule``) and the loader's workers run it as they collate
(`mmpack.packing.batch.PositionRule`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mmpack.packing.video_tokens import video_temporal_positions

_TEXT, _IMAGE, _VIDEO = 0, 1, 2


def _vision_positions(
    start: int, grid_thw: Sequence[int], merge_size: int, temporal: np.ndarray
) -> np.ndarray:
    """[3, t * h/m * w/m] positions of one image's or video's tokens starting at ``start``."""
    _, h, w = (int(v) for v in grid_thw)
    gh, gw = h // merge_size, w // merge_size
    tt, hh, ww = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def _fill_sample(
    ids: np.ndarray,
    out: np.ndarray,
    media: dict[int, Iterator[tuple[list[int], np.ndarray]]],
    pad_ids: dict[int, int],
    merge_size: int,
) -> None:
    """Positions of one sample (``out`` is its [3, n] slice), consuming its images' and videos' grids in order."""
    kind = np.zeros(len(ids), dtype=np.int8)
    for k, pad in pad_ids.items():
        if pad >= 0:
            kind[ids == pad] = k
    # boundaries of runs of equal modality
    edges = np.flatnonzero(np.diff(kind)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(ids)]])
    pos = 0
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        k = int(kind[a])
        if k == _TEXT:
            out[:, a:b] = np.arange(pos, pos + b - a)
            pos += b - a
            continue
        name = "image" if k == _IMAGE else "video"
        while a < b:  # one run may hold several images (videos) placed back to back
            item = next(media[k], None)
            if item is None:
                raise ValueError(f"more <|{name}_pad|> tokens than the {name} grids account for")
            grid, temporal = item
            n = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge_size**2
            if n > b - a:
                raise ValueError(
                    f"an {name} of grid {list(grid)} needs {n} <|{name}_pad|> tokens, found {b - a}"
                )
            out[:, a : a + n] = _vision_positions(pos, grid, merge_size, temporal)
            pos += max(int(grid[1]), int(grid[2])) // merge_size
            a += n


def build_mrope_position_ids(
    input_ids: np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    image_grid_thw: np.ndarray,
    *,
    image_pad_id: int,
    merge_size: int,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | Sequence[float] | None = None,
    video_pad_id: int = -1,
    tokens_per_second: float = 2.0,
    video_frames_apart: bool = False,
) -> np.ndarray:
    """[3, len(input_ids)] int64 MRoPE positions of a packed sequence.

    Args:
        input_ids: token ids of the concatenated samples (a padding segment may be one of them).
        seq_lens: length of each sample, in order; they must sum to ``len(input_ids)``.
        image_grid_thw: [n_images, 3] grids in patches, in the order the images appear.
        image_pad_id: the ``<|image_pad|>`` token id.
        merge_size: spatial merge size of the vision tower (2 for Qwen2-VL / Qwen2.5-VL).
        video_grid_thw: [n_videos, 3] grids in patches (t = temporal patches), in the order the videos appear.
        second_per_grid_ts: seconds per temporal patch of each video (None: 1.0 each; with
            ``tokens_per_second`` 1 that is Qwen2-VL's one position per temporal patch).
        video_pad_id: the ``<|video_pad|>`` token id (-1: no videos).
        tokens_per_second: the model's ``vision_config.tokens_per_second`` (2 for Qwen2.5-VL).
        video_frames_apart: each temporal patch of a video is its own run of pads (Qwen3-VL).
    """
    ids = np.asarray(input_ids).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if int(lens.sum()) != len(ids):
        raise ValueError(f"seq_lens sum to {int(lens.sum())}, the sequence has {len(ids)} tokens")
    image_grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3).tolist()
    no_videos = np.zeros((0, 3), dtype=np.int64)
    video_grids = np.asarray(video_grid_thw if video_grid_thw is not None else no_videos, dtype=np.int64)
    video_grids = video_grids.reshape(-1, 3)
    if video_frames_apart:  # one (1, h, w) grid per temporal patch; the interval does not matter
        video_grids = np.repeat(video_grids, video_grids[:, 0], axis=0)
        video_grids[:, 0] = 1
        second_per_grid_ts = None
    video_grids_list: list[list[int]] = video_grids.tolist()
    intervals = [1.0] * len(video_grids_list) if second_per_grid_ts is None else list(second_per_grid_ts)
    if len(intervals) != len(video_grids_list):
        raise ValueError(f"{len(intervals)} second_per_grid_ts for {len(video_grids_list)} video grids")
    media = {
        _IMAGE: iter([(g, np.arange(g[0])) for g in image_grids]),
        _VIDEO: iter(
            [
                (g, video_temporal_positions(g[0], float(s), tokens_per_second))
                for g, s in zip(video_grids, intervals)
            ]
        ),
    }
    pad_ids = {_IMAGE: image_pad_id, _VIDEO: video_pad_id}
    out = np.empty((3, len(ids)), dtype=np.int64)
    start = 0
    for n in lens.tolist():
        _fill_sample(ids[start : start + n], out[:, start : start + n], media, pad_ids, merge_size)
        start += n
    for k, name in ((_IMAGE, "image"), (_VIDEO, "video")):
        if next(media[k], None) is not None:
            raise ValueError(f"more {name} grids than {name}s among the <|{name}_pad|> tokens")
    return out


@dataclass(kw_only=True, frozen=True)
class MRopeRule:
    """A model family's MRoPE rule (`mmpack.packing.batch.PositionRule`): its pad ids, merge size and how its
    videos are laid out (see the module docstring); `positions` applies it to a packed sequence."""

    image_pad_id: int
    merge_size: int
    video_pad_id: int = -1
    tokens_per_second: float = 2.0
    video_frames_apart: bool = False

    def positions(
        self,
        input_ids: np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        image_grid_thw: np.ndarray,
        video_grid_thw: np.ndarray | None = None,
        second_per_grid_ts: np.ndarray | Sequence[float] | None = None,
    ) -> np.ndarray:
        """[3, len(input_ids)] int64 positions (`build_mrope_position_ids` under this rule)."""
        return build_mrope_position_ids(
            input_ids, seq_lens, image_grid_thw, image_pad_id=self.image_pad_id, merge_size=self.merge_size,
            video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts, video_pad_id=self.video_pad_id,
            tokens_per_second=self.tokens_per_second, video_frames_apart=self.video_frames_apart,
        )  # fmt: skip

    def patch_positions(self, image_grid_thw: np.ndarray) -> None:
        """None: the Qwen-VL vision towers compute their patches' positions from the grids."""
        return None
