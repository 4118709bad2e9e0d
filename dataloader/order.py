"""Global bin order and rank assignment: the single place where both are decided.

The stream of bins is epoch 0's order, then epoch 1's, ... (each a permutation of all bins). Global batch
`s` is stream positions [s*G, (s+1)*G). DP rank r of D takes the contiguous slice
[r*G/D, (r+1)*G/D) of it, cut into micro-batches of B bins; or, with compute balancing, the bins that
`mmpack.dataloader.balance` lays out for it (same global batch, other split). Nothing here depends on timing, worker
count or anything but the arguments.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmpack.dataloader.balance import ComputeBalance
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.topology import Topology

DEFAULT_SHARD_WINDOW = 4


def _as_manifest(manifest: Manifest | dict[str, Any]) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else Manifest.from_dict(manifest)


def bin_order(
    manifest: Manifest | dict[str, Any], seed: int, epoch: int, *, shard_window: int = DEFAULT_SHARD_WINDOW
) -> np.ndarray:
    """The global order (int64 bin ids, a permutation of all bins) of one epoch.

    Shards are shuffled, then the bins of each window of `shard_window` consecutive shards (in shuffled
    order) are shuffled among themselves, so a reader touches only a few shards at a time.
    """
    m = _as_manifest(manifest)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed} epoch={epoch}")
    if shard_window < 1:
        raise ValueError(f"shard_window must be >= 1, got {shard_window}")
    rng = np.random.default_rng([seed, epoch])
    shard_perm = rng.permutation(len(m.shards))
    parts = []
    for start in range(0, len(shard_perm), shard_window):
        window = [m.shards[i] for i in shard_perm[start : start + shard_window]]
        ids = np.concatenate([np.arange(s.first_bin, s.first_bin + s.bins, dtype=np.int64) for s in window])
        parts.append(ids[rng.permutation(len(ids))])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


SPLIT_PARTS = ("train", "valid", "test")


@dataclass(frozen=True)
class BinSplit:
    """Megatron-LM's ``--split`` over a packed dataset's bins: the weights of (train, valid, test), the part
    this loader reads (0, 1 or 2) and the seed of the split (its own: the train and eval loaders order their
    bins with different seeds, and must split them alike)."""

    weights: tuple[float, float, float]
    part: int
    seed: int

    def __post_init__(self) -> None:
        if len(self.weights) != 3 or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(
                f"--split takes three weights >= 0, not all 0 (e.g. 969,30,1), got {self.weights}"
            )
        if self.part not in (0, 1, 2):
            raise ValueError(f"split part must be 0 (train), 1 (valid) or 2 (test), got {self.part}")

    def bins(self, num_bins: int) -> np.ndarray:
        """This part's bin ids (sorted): a pure function of (bin count, weights, seed), the parts disjoint and
        together all bins."""
        return split_bins(num_bins, self.weights, self.seed)[self.part]

    def describe(self) -> str:
        return f"{','.join(f'{w:g}' for w in self.weights)}:{SPLIT_PARTS[self.part]}"


def split_bins(num_bins: int, weights: tuple[float, ...], seed: int) -> tuple[np.ndarray, ...]:
    """Bin ids of each part of ``weights``: the bins in a seeded random order (a bin's length is not its
    part's: packing orders bins by length), cut where Megatron-LM cuts documents (each part
    round(weight / sum * n), the last boundary moved back to n)."""
    total = float(sum(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(w / total * num_bins))
    excess = bounds[-1] - num_bins
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    bounds = [min(max(b, 0), num_bins) for b in bounds]
    perm = np.random.default_rng([seed, 0x5EED5]).permutation(num_bins)
    return tuple(np.sort(perm[a:b]).astype(np.int64) for a, b in itertools.pairwise(bounds))


@dataclass(frozen=True)
class BatchPlan:
    """Batch geometry: global batch G, micro-batch B, and the derived micro-batches per step per DP rank."""

    global_batch_size: int
    micro_batch_size: int
    dp_size: int

    def __post_init__(self) -> None:
        g, b, d = self.global_batch_size, self.micro_batch_size, self.dp_size
        if g < 1 or b < 1:
            raise ValueError(f"global_batch_size and micro_batch_size must be >= 1, got {g} and {b}")
        if g % (b * d):
            raise ValueError(
                f"global_batch_size ({g}) must be divisible by micro_batch_size * dp_size ({b} * {d} = {b * d})"
            )

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)


class BinStream(Protocol):
    """A chained stream of bins: one dataset's (`StreamOrder`) or a mixture's (`mmpack.dataloader.blend`)."""

    def positions(self, start: int, count: int) -> np.ndarray:
        """Bin ids at global stream positions [start, start+count)."""
        ...


class StreamOrder:
    """The chained-epoch bin stream of one (manifest, seed); epoch orders are memoised (a few at a time)."""

    def __init__(
        self,
        manifest: Manifest,
        seed: int,
        *,
        shard_window: int = DEFAULT_SHARD_WINDOW,
        split: BinSplit | None = None,
    ) -> None:
        """``split``: the stream holds only that part's bins, in the order `bin_order` gives them."""
        if manifest.num_bins == 0:
            raise ValueError("the packed dataset has no bins")
        self.manifest, self.seed, self.shard_window = manifest, seed, shard_window
        self._member: np.ndarray | None = None
        self.num_bins = manifest.num_bins
        if split is not None:
            self._member = np.zeros(manifest.num_bins, dtype=bool)
            self._member[split.bins(manifest.num_bins)] = True
            self.num_bins = int(self._member.sum())
            if self.num_bins == 0:
                raise ValueError(
                    f"--split {split.describe()} leaves no bins of the {manifest.num_bins} in that part"
                )
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            order = bin_order(self.manifest, self.seed, epoch, shard_window=self.shard_window)
            self._epochs[epoch] = order if self._member is None else order[self._member[order]]
            while len(self._epochs) > 3:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def positions(self, start: int, count: int) -> np.ndarray:
        """Bin ids at global stream positions [start, start+count)."""
        n = self.num_bins
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, n)
            take = min(count - done, n - offset)
            out[done : done + take] = self.epoch_order(epoch)[offset : offset + take]
            done += take
        return out


def micro_batch_bins(
    stream: BinStream,
    step: int,
    micro_batch: int,
    topology: Topology,
    plan: BatchPlan,
    balance: ComputeBalance | None = None,
) -> np.ndarray:
    """Global bin ids of micro-batch `micro_batch` of global step `step` on this rank.

    Only the DP coordinate counts (TP and PP peers of a DP rank read the same bins). `step` counts global
    batches from the stream start.
    With `balance`, the same global batch is laid out over ranks and micro-batches by cost
    (`mmpack.dataloader.balance`) instead of in stream order.
    """
    if plan.dp_size != topology.dp_size:
        raise ValueError(f"plan is for dp_size={plan.dp_size}, topology has dp_size={topology.dp_size}")
    if not 0 <= micro_batch < plan.micro_batches_per_step:
        raise ValueError(f"micro_batch must be in [0, {plan.micro_batches_per_step}), got {micro_batch}")
    if balance is not None:
        global_bins = stream.positions(step * plan.global_batch_size, plan.global_batch_size)
        layout = balance.layout(step, global_bins, plan.dp_size, plan.micro_batch_size)
        return layout[topology.dp_rank, micro_batch].copy()
    per_rank = plan.global_batch_size // plan.dp_size
    start = step * plan.global_batch_size + topology.dp_rank * per_rank + micro_batch * plan.micro_batch_size
    return stream.positions(start, plan.micro_batch_size)


def bins_for(
    manifest: Manifest | dict[str, Any],
    seed: int,
    step: int,
    micro_batch: int,
    topology: Topology,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    shard_window: int = DEFAULT_SHARD_WINDOW,
) -> np.ndarray:
    """Stateless convenience form of `micro_batch_bins` (builds the epoch order each call)."""
    plan = BatchPlan(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_size=topology.dp_size
    )
    stream = StreamOrder(_as_manifest(manifest), seed, shard_window=shard_window)
    return micro_batch_bins(stream, step, micro_batch, topology, plan)
