"""The micro-batch contract: what the loader hands the trainer for one micro-batch of B packed bins of L
tokens, beside the on-disk format (`mmpack.packing.format`) it is made from.

`MicroBatch` is produced by the loader's collate (`mmpack.dataloader.collate.collate_bins`, numpy arrays in the
worker; torch tensors viewing shared memory in the consumer, `map_arrays`) and by the trainer's synthetic
batches, and consumed by the trainer; nothing else spells its fields. Shapes and dtypes (S = segments of
the flattened B * L tokens, padding included; D = 3 * temporal_patch_size * patch_size**2):

==================== ================ ===========================================================================
field                dtype, shape     meaning
==================== ================ ===========================================================================
tokens               int64 [B, L]     the bins' token ids, pad id after the last sample
labels               int64 [B, L]     next-token targets; IGNORE_INDEX (-100) where none (see `packing.layout`)
loss_mask            float32 [B, L]   1 where `labels` is a target
position_ids         int64 [B, L] or  positions of the position rule: restarting at 0 per sample (no rule), or
                     [A, B, L]        its A axes (M-RoPE: A = 3, temporal / height / width), per sample
cu_seqlens           int32 [S + 1]    segment boundaries over the flattened B * L tokens
max_seqlen           int              the longest segment
num_real_tokens      int              tokens of samples (not padding)
pixel_values         float32 [P, D]   image patches, in the order the images appear
image_grid_thw       int64 [I, 3]     (t, h, w) in patches of each image
pixel_values_videos  float32 [V, D]   video patches (the planned frames), in order
video_grid_thw       int64 [N, 3]     (t, h, w) of each video, t = temporal patches
second_per_grid_ts   float32 [N]      seconds per temporal patch of each video
bin_ids              int64 [B]        global bin index of each row in its dataset (None for synthetic batches)
source_ids           int64 [B]        index of each row's dataset in the loader's mixture (0 for one dataset;
                                      None for synthetic batches)
attention_mask       bool [B,1,L,L]   block-diagonal causal mask, True = masked (only when asked for)
patch_positions      int64 [P, 3]     (frame, row, column) of each row of `pixel_values`, in its order (only
                                      where the position rule gives them: LLaVA-OneVision-2's 3-D vision RoPE)
dropped              tuple of         the samples of these bins whose media could not be decoded: their labels
                     DroppedSample    are masked and their media blank, grids unchanged (empty: none)
==================== ================ ===========================================================================

A position rule (`PositionRule`) is the model family's: the trainer hands it to the loader, whose workers
compute the positions as they collate (`mmpack.packing.mrope.MRopeRule` for Qwen-VL models,
`mmpack.packing.patch_positions.TextPositionRule` for 1-D text positions with per-patch vision positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

A = TypeVar("A")
B = TypeVar("B")


class PositionRule(Protocol):
    """A model family's positions of one packed row (picklable: loader workers run it)."""

    def positions(
        self,
        input_ids: np.ndarray,
        seq_lens: np.ndarray,
        image_grid_thw: np.ndarray,
        video_grid_thw: np.ndarray | None = None,
        second_per_grid_ts: np.ndarray | None = None,
    ) -> np.ndarray:
        """int64 [A, len(input_ids)]: positions of a row whose samples (padding included) have `seq_lens`."""
        ...

    def patch_positions(self, image_grid_thw: np.ndarray) -> np.ndarray | None:
        """int64 [P, 3] positions of the micro-batch's image patches for the vision tower; None: it takes none."""
        ...


@dataclass(kw_only=True, frozen=True)
class DroppedSample:
    """A sample the loader dropped from its bin because one of its media could not be decoded: its labels are
    masked (no loss) and its media blank, so the bin keeps its layout."""

    sample_id: str
    bin_key: str  # the bin's key (`<shard prefix>-<bin>`)
    row: int  # the bin's row in the micro-batch
    media: str  # the medium that failed: the file as the record named it, else its place in the bin
    error: str  # why it could not be decoded (one line)


@dataclass(frozen=True)
class MicroBatch(Generic[A]):
    """One micro-batch (see the module docstring for every field); `A` is np.ndarray or torch.Tensor."""

    tokens: A
    labels: A
    loss_mask: A
    position_ids: A
    cu_seqlens: A
    max_seqlen: int
    num_real_tokens: int
    pixel_values: A
    image_grid_thw: A
    pixel_values_videos: A
    video_grid_thw: A
    second_per_grid_ts: A
    bin_ids: A | None = None
    source_ids: A | None = None
    attention_mask: A | None = None
    patch_positions: A | None = None
    dropped: tuple[DroppedSample, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        """(B, L): bins and tokens per bin."""
        b, length = self.tokens.shape  # type: ignore[attr-defined]
        return int(b), int(length)

    def map_arrays(self, fn: Callable[[A], B]) -> MicroBatch[B]:
        """The batch with `fn` applied to every array (to torch, to a device, a slice)."""
        mapped = {k: v if isinstance(v, (int, tuple)) or v is None else fn(v) for k, v in self.items()}
        return MicroBatch(**mapped)  # type: ignore[arg-type]  # each field keeps its kind

    def items(self) -> list[tuple[str, Any]]:
        """(field name, value) of every field, in field order (what the loader's transport moves)."""
        return list(vars(self).items())

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


DTYPES = {
    "tokens": "int64",
    "labels": "int64",
    "loss_mask": "float32",
    "position_ids": "int64",
    "cu_seqlens": "int32",
    "pixel_values": "float32",
    "image_grid_thw": "int64",
    "pixel_values_videos": "float32",
    "video_grid_thw": "int64",
    "second_per_grid_ts": "float32",
    "bin_ids": "int64",
    "source_ids": "int64",
    "attention_mask": "bool",
    "patch_positions": "int64",
}


def contract_problems(batch: MicroBatch[Any]) -> list[str]:
    """What in `batch` breaks the contract of the module docstring (dtypes, shapes, counts); [] if nothing."""
    out = []
    b, length = batch.shape
    for name, dtype in DTYPES.items():
        value = getattr(batch, name)
        if value is not None and str(value.dtype).removeprefix("torch.") != dtype:
            out.append(f"{name}: dtype {value.dtype}, want {dtype}")
    want: dict[str, tuple[int, ...]] = {
        "tokens": (b, length),
        "labels": (b, length),
        "loss_mask": (b, length),
    }
    want |= {"bin_ids": (b,), "source_ids": (b,), "attention_mask": (b, 1, length, length)}
    for name, shape in want.items():
        value = getattr(batch, name)
        if value is not None and tuple(value.shape) != shape:
            out.append(f"{name}: shape {tuple(value.shape)}, want {shape}")
    positions = tuple(batch.position_ids.shape)  # type: ignore[attr-defined]
    if positions[-2:] != (b, length) or len(positions) not in (2, 3):
        out.append(f"position_ids: shape {positions}, want ({b}, {length}) or (A, {b}, {length})")
    cu = batch.cu_seqlens
    if int(cu[0]) != 0 or int(cu[-1]) != b * length:  # type: ignore[index]
        out.append(f"cu_seqlens must run from 0 to B * L = {b * length}")
    n_videos = len(batch.video_grid_thw)  # type: ignore[arg-type]
    for name, rows in (("pixel_values", batch.image_grid_thw), ("pixel_values_videos", batch.video_grid_thw)):
        need = int(np.prod(np.asarray(rows).reshape(-1, 3), axis=1).sum())
        if len(getattr(batch, name)) != need:
            out.append(f"{name}: {len(getattr(batch, name))} rows, the grids need {need}")
    if batch.patch_positions is not None:
        shape = tuple(batch.patch_positions.shape)  # type: ignore[attr-defined]
        if shape != (len(batch.pixel_values), 3):  # type: ignore[arg-type]
            out.append(f"patch_positions: shape {shape}, want ({len(batch.pixel_values)}, 3)")  # type: ignore[arg-type]
    if any(not 0 <= d.row < b for d in batch.dropped):
        out.append(f"dropped: rows {[d.row for d in batch.dropped]}, want rows of the {b} bins")
    if len(batch.second_per_grid_ts) != n_videos:  # type: ignore[arg-type]
        out.append(f"second_per_grid_ts: {len(batch.second_per_grid_ts)} values for {n_videos} videos")  # type: ignore[arg-type]
    return out
