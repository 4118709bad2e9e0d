"""A micro-batch on this context-parallel rank: its share of every packed sample in the load-balanced 2xCP
layout (the split is :mod:`mmpack.packing.context_parallel`'s), and the model inputs built from it.

Every CP rank of a DP replica receives the whole micro-batch (``mmpack.trainer.shared_batches``) and takes its
tokens, labels, loss mask and M-RoPE positions here. The vision tower then runs on all the micro-batch's images
on every CP rank, and each rank's ``<|image_pad|>`` / ``<|video_pad|>`` slots take the feature rows of their
pads (an image whose tokens straddle a chunk boundary gives each rank its own rows). Attention: on CPU the
all-gather attention (:mod:`mmpack.trainer.models.cp_attention`) with this rank's mask over the gathered keys;
with Transformer Engine its THD attention with the padded cu_seqlens of the whole sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmpack.packing.batch import MicroBatch
from mmpack.packing.context_parallel import cp_attention_allowed, split_for_cp
from mmpack.trainer.data import model_inputs


@dataclass(kw_only=True, frozen=True)
class CpRank:
    """This rank's place in its CP group and the ids the split needs."""

    cp_size: int
    cp_rank: int
    pad_id: int
    image_pad_id: int
    video_pad_id: int


def _feature_rows(
    flat_tokens: np.ndarray, local_tokens: np.ndarray, source: np.ndarray, pad: int
) -> np.ndarray:
    """For each ``pad`` token this rank holds, its ordinal among the micro-batch's ``pad`` tokens."""
    ordinal = np.cumsum(flat_tokens == pad) - 1
    return ordinal[source[local_tokens == pad]]


def cp_micro_batch(
    batch: MicroBatch[torch.Tensor], cp: CpRank, *, use_thd: bool
) -> tuple[dict[str, Any], torch.Tensor]:
    """(model keyword arguments, loss mask [1, n]) of this CP rank's share of ``batch`` (CPU tensors)."""
    cu = batch.cu_seqlens.numpy()
    part = split_for_cp(
        batch.tokens.numpy(), batch.labels.numpy(), batch.loss_mask.numpy(), batch.position_ids.numpy(), cu,
        cp_size=cp.cp_size, cp_rank=cp.cp_rank, pad_id=cp.pad_id,
    )  # fmt: skip
    shard = part.shard
    n = shard.num_tokens
    padded_lengths = np.diff(shard.padded_cu_seqlens)
    mask = (
        None if use_thd else ~torch.from_numpy(cp_attention_allowed(cu, cp.cp_size, cp.cp_rank))[None, None]
    )
    local = dataclasses.replace(
        batch,
        tokens=torch.from_numpy(part.tokens).reshape(1, n),
        labels=torch.from_numpy(part.labels).reshape(1, n),
        loss_mask=torch.from_numpy(part.loss_mask).reshape(1, n),
        position_ids=torch.from_numpy(part.position_ids).reshape(-1, 1, n),
        # THD attention (TE) takes the padded boundaries of the whole sequence and cuts them itself
        cu_seqlens=torch.from_numpy(shard.padded_cu_seqlens),
        max_seqlen=int(padded_lengths.max()) if len(padded_lengths) else 0,
        attention_mask=mask,  # [1, 1, n, CP * n]: the queries here over every rank's keys
    )
    if torch.cuda.is_available():
        local = local.map_arrays(lambda v: v.cuda(non_blocking=True))
    inputs = model_inputs(local, use_thd=use_thd)
    if use_thd:  # the pads are tokens of their sample (no loss): padded and real boundaries are one
        psp = inputs["packed_seq_params"]
        inputs["packed_seq_params"] = dataclasses.replace(
            psp, cu_seqlens_q_padded=psp.cu_seqlens_q, cu_seqlens_kv_padded=psp.cu_seqlens_kv
        )
    flat = batch.tokens.numpy().reshape(-1)
    for key, pad in (("image_rows", cp.image_pad_id), ("video_rows", cp.video_pad_id)):
        rows = _feature_rows(flat, part.tokens, shard.source, pad)
        inputs[key] = torch.from_numpy(rows).to(local.tokens.device) if len(rows) else None
    return inputs, local.loss_mask
