"""How the target tokens of a global batch are weighed in the loss (``--loss-reduction``).

- ``token``: every target token weighs the same (megatron-core's per-token loss; the default).
- ``sample``: each sample's mean loss over its target tokens, averaged over the samples of the global batch.
- ``square``: each token weighted by 1 / sqrt(its sample's target tokens), the weighted sum divided by the sum
  of the weights (InternVL's ``loss_reduction`` square).

Every mode is a weighted token loss ``sum(w_t * l_t) / sum(w_t)`` over the whole global batch (DP x CP x
micro-batches). A token's weight comes from its sample's target-token count, read from the packed micro-batch
(``cu_seqlens`` + ``loss_mask``) before the forward and before the context-parallel split, so a sample split
over CP ranks counts once and every CP rank agrees. megatron-core's per-token machinery
(``calculate_per_token_loss``) is kept: it sums the loss over micro-batches and ranks and divides the gradients
by the step's target-token count N, so the weights handed to the loss are ``w_t * N / sum(w)``; N and sum(w) of
the global batch are one all-reduce over the DP ranks before the schedule runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from mmpack.packing.batch import MicroBatch
from mmpack.trainer.config import LossReduction


def token_weights(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: LossReduction) -> torch.Tensor:
    """float64, ``loss_mask``'s shape: each target token's weight under ``mode`` (1, 1 / n or 1 / sqrt(n),
    n its sample's target tokens; the samples are the ``cu_seqlens`` segments of the flattened B * L tokens),
    0 on every other token."""
    mask = loss_mask.detach().reshape(-1).to(torch.float64)
    if mode == "token":
        return mask.reshape(loss_mask.shape)
    cu = cu_seqlens.detach().to(device=mask.device, dtype=torch.int64).reshape(-1)
    if int(cu[0]) != 0 or int(cu[-1]) != mask.numel():
        raise ValueError(
            f"--loss-reduction {mode}: the micro-batch's cu_seqlens run from {int(cu[0])} to {int(cu[-1])}, "
            f"not over its {mask.numel()} tokens (a malformed packed bin)"
        )
    segment = torch.repeat_interleave(torch.arange(len(cu) - 1, device=mask.device), cu.diff())
    targets = torch.zeros(len(cu) - 1, dtype=torch.float64, device=mask.device).index_add_(0, segment, mask)
    per_sample = targets.clamp(min=1.0) ** (-1.0 if mode == "sample" else -0.5)
    return (per_sample[segment] * mask).reshape(loss_mask.shape)


@dataclasses.dataclass(frozen=True)
class WeightedStep:
    """A step's micro-batches with their ``loss_mask`` holding the token weights scaled by ``scale`` = N /
    sum(w) of the global batch (``batches`` unchanged under ``token``)."""

    batches: list[MicroBatch[torch.Tensor]]
    scale: float


def weigh_step(batches: list[MicroBatch[torch.Tensor]], mode: LossReduction, dp_group: Any) -> WeightedStep:
    """This DP rank's micro-batches with the weights of ``mode`` in place of their loss masks, scaled so that
    megatron-core's division by the global batch's target-token count gives ``sum(w_t * l_t) / sum(w_t)``.
    ``dp_group``: the data-parallel group without CP (every CP rank of a replica holds the same micro-batches);
    collective over it unless ``mode`` is token."""
    if mode == "token":
        return WeightedStep(batches, 1.0)
    weights = [token_weights(b.loss_mask, b.cu_seqlens, mode) for b in batches]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
    sums = torch.tensor(
        [sum(float(b.loss_mask.sum()) for b in batches), sum(float(w.sum()) for w in weights)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(sums, group=dp_group)
    num_tokens, weight_sum = sums.tolist()
    scale = num_tokens / weight_sum if weight_sum > 0 else 0.0
    weighted = [
        dataclasses.replace(b, loss_mask=(w * scale).to(b.loss_mask.dtype))
        for b, w in zip(batches, weights, strict=True)
    ]
    return WeightedStep(weighted, scale)
