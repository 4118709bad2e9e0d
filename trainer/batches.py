"""Micro-batches (`mmpack.packing.batch.MicroBatch`, as the loader gives them) built from samples, the packed
attention mask on the accelerator, and a synthetic stream for runs without a dataset (``--mock-data``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmpack.packing.batch import MicroBatch, PositionRule
from mmpack.packing.layout import PackedSequence, block_mask, build_packed_sequence, collate_packed


@dataclass(kw_only=True, frozen=True)
class Sample:
    """One unpacked training sample: token ids, loss mask and its images' (t, h, w) grids and patches."""

    input_ids: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # uint8 [n], 1 where the token is a target
    image_grid_thw: np.ndarray  # int64 [k, 3]
    pixel_values: np.ndarray  # float32 [patches, 3*patch*patch]


def block_causal_mask(cu_seqlens: torch.Tensor, batch: int, seq_length: int) -> torch.Tensor:
    """[B, 1, L, L] bool, True = masked: a token sees the earlier tokens of its own segment only (built on
    ``cu_seqlens``' device by `mmpack.packing.layout.block_mask`, for batches already on the accelerator)."""
    device = cu_seqlens.device
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    return block_mask(segment.reshape(batch, seq_length))[:, None]


def _pack_row(
    samples: Sequence[Sample], seq_length: int, pad_id: int, *, attention_mask: bool
) -> PackedSequence:
    """One row of samples laid out by mmpack.packing.layout, as the loader lays out a bin."""
    ids = [s.input_ids for s in samples]
    return build_packed_sequence(
        np.concatenate(ids) if ids else [],
        np.concatenate([s.loss_mask for s in samples]) if ids else [],
        [len(x) for x in ids],
        pad_to=seq_length,
        pad_id=pad_id,
        build_attention_mask=attention_mask,
    )


def make_micro_batch(
    rows: Sequence[Sequence[Sample]],
    seq_length: int,
    pad_id: int,
    *,
    attention_mask: bool = True,
    position_rule: PositionRule | None = None,
) -> MicroBatch[torch.Tensor]:
    """Pack each row's samples into one sequence of ``seq_length`` and collate the rows, as the loader does
    (positions by ``position_rule`` where given, else restarting per sample)."""
    packed = [_pack_row(r, seq_length, pad_id, attention_mask=attention_mask) for r in rows]
    layout = collate_packed(packed)
    samples = [s for r in rows for s in r]
    grids = [s.image_grid_thw for s in samples if len(s.image_grid_thw)]
    pixels = [s.pixel_values for s in samples if len(s.pixel_values)]
    patch_dim = samples[0].pixel_values.shape[1] if samples else 0
    positions = layout["position_ids"]
    image_grids = np.concatenate(grids).astype(np.int64) if grids else np.zeros((0, 3), dtype=np.int64)
    if position_rule is not None:
        positions = np.stack(
            [
                position_rule.positions(p.tokens, np.diff(p.cu_seqlens), _row_grids(row))
                for p, row in zip(packed, rows)
            ],
            axis=1,
        )
    batch = MicroBatch(
        tokens=layout["tokens"],
        labels=layout["labels"],
        loss_mask=layout["loss_mask"],
        position_ids=positions,
        cu_seqlens=layout["cu_seqlens"],
        max_seqlen=int(layout["max_seqlen"]),
        num_real_tokens=int(layout["num_real_tokens"]),
        pixel_values=np.concatenate(pixels) if pixels else np.zeros((0, patch_dim), dtype=np.float32),
        image_grid_thw=image_grids,
        pixel_values_videos=np.zeros((0, patch_dim), dtype=np.float32),
        video_grid_thw=np.zeros((0, 3), dtype=np.int64),
        second_per_grid_ts=np.zeros(0, dtype=np.float32),
        attention_mask=layout.get("attention_mask"),
        patch_positions=None if position_rule is None else position_rule.patch_positions(image_grids),
    )
    return batch.map_arrays(torch.from_numpy)


def _row_grids(row: Sequence[Sample]) -> np.ndarray:
    grids = [s.image_grid_thw for s in row if len(s.image_grid_thw)]
    return np.concatenate(grids).astype(np.int64) if grids else np.zeros((0, 3), dtype=np.int64)


@dataclass(kw_only=True, frozen=True)
class SyntheticSpec:
    """Shape of synthetic VLM samples: text over a small skewed vocabulary, some with one image."""

    vocab_size: int
    pad_id: int
    image_pad_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_len: int = 8
    max_len: int = 40
    image_probability: float = 0.5


def synthetic_sample(spec: SyntheticSpec, rng: np.random.Generator) -> Sample:
    """A prompt (no loss), optionally an image span, and an answer (loss) that echoes the prompt."""
    text_vocab = min(spec.vocab_size, 64)
    n = int(rng.integers(spec.min_len, spec.max_len + 1))
    prompt = rng.zipf(1.5, size=max(2, n // 2)).clip(1, text_vocab - 1).astype(np.int64)
    answer = prompt[::-1].copy()  # learnable: the answer reverses the prompt
    ids = [prompt]
    grids = np.zeros((0, 3), dtype=np.int64)
    width = 3 * spec.temporal_patch_size * spec.patch_size**2  # the processor's [C, T, p, p] per patch
    pixels = np.zeros((0, width), dtype=np.float32)
    if rng.random() < spec.image_probability:
        gh, gw = (spec.merge_size * int(rng.integers(1, 3)) for _ in range(2))
        grids = np.array([[1, gh, gw]], dtype=np.int64)
        pixels = rng.standard_normal((gh * gw, width)).astype(np.float32)
        n_img = gh * gw // spec.merge_size**2
        ids.append(np.array([spec.vision_start_id, *[spec.image_pad_id] * n_img, spec.vision_end_id]))
    ids.append(answer)
    input_ids = np.concatenate(ids).astype(np.int64)
    loss_mask = np.zeros(len(input_ids), dtype=np.uint8)
    loss_mask[-len(answer) :] = 1
    return Sample(input_ids=input_ids, loss_mask=loss_mask, image_grid_thw=grids, pixel_values=pixels)


def synthetic_bin(spec: SyntheticSpec, seed: int, bin_index: int, seq_length: int) -> list[Sample]:
    """The samples of synthetic bin ``bin_index``: a pure function of (seed, index), greedy-filled."""
    rng = np.random.default_rng([seed, bin_index])
    samples: list[Sample] = []
    used = 0
    while True:
        s = synthetic_sample(spec, rng)
        if used + len(s.input_ids) > seq_length:
            return samples or [s]
        samples.append(s)
        used += len(s.input_ids)


class SyntheticLoader:
    """Stream of packed synthetic micro-batches for one DP rank, with the real loader's state semantics.

    Global batch g holds bins [g*G, (g+1)*G); DP rank r takes its contiguous slice, split into micro-batches.
    State is the number of bins consumed globally, so resume works for any DP size with the same G.
    """

    def __init__(
        self,
        spec: SyntheticSpec,
        *,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        position_rule: PositionRule | None = None,
    ) -> None:
        self.spec, self.seq_length, self.seed = spec, seq_length, seed
        self.position_rule = position_rule
        self.micro, self.global_batch = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0
        self.wait_time_s = 0.0

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // self.dp_size // self.micro

    def state_dict(self) -> dict[str, int]:
        return {"epoch": 0, "bins_consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["bins_consumed"])

    def __iter__(self) -> Iterator[MicroBatch[torch.Tensor]]:
        per_rank = self.global_batch // self.dp_size
        micro_per_step = self.micro_batches_per_step
        micro_index = 0
        while True:
            first = self.consumed + self.dp_rank * per_rank + micro_index * self.micro
            rows = [
                synthetic_bin(self.spec, self.seed, first + i, self.seq_length) for i in range(self.micro)
            ]
            micro_index += 1
            if micro_index == micro_per_step:  # state counts whole global batches, updated before the yield
                micro_index = 0
                self.consumed += self.global_batch
            yield make_micro_batch(rows, self.seq_length, self.spec.pad_id, position_rule=self.position_rule)
