"""Compute-balanced assignment of a global batch's bins to DP ranks and micro-batches (`balance="compute"`).

The set of bins in global batch s is what `mmpack.dataloader.order` gives (stream positions [s*G, (s+1)*G)); only
who gets which bin changes. Each rank gets exactly G/D bins (so every rank yields the same number of
micro-batches), chosen so that the largest per-rank cost is close to the mean: balanced largest differencing
(Karmarkar-Karp with one bin per rank from each group of D, so counts stay equal), then pairwise swaps
between the costliest rank and the others. Inside a rank the same split makes its micro-batches even.
Everything is a pure function of the bins' costs and (D, B), i.e. of (manifest, seed, epoch, step, D).
Costs come from the cost model (`mmpack.packing.cost`) over each bin's seq_lens and image grid, read from the
shards' metadata (`load_bin_features`): no image is decoded.
"""

from __future__ import annotations

import heapq
import os
import threading

import numpy as np

from mmpack.dataloader.manifest import Manifest, ShardInfo
from mmpack.dataloader.storage import ShardStore, StorageConfig
from mmpack.packing.cost import DEFAULT_COST_MODEL, CostModel, add_video_features, features_from_offsets

BALANCE_MODES = ("none", "compute")
SWAP_PASSES = 256


def balanced_groups(costs: np.ndarray, num_groups: int) -> np.ndarray:
    """Split items into `num_groups` groups of equal size, evening out the groups' total costs.

    Args:
        costs: float [n], n divisible by num_groups.
    Returns:
        int64 [num_groups, n // num_groups]: item indices; each row ascending, rows by total cost descending
        (ties by first index), so the result depends on the costs alone.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if num_groups < 1 or n % num_groups:
        raise ValueError(f"{n} items cannot be split into {num_groups} equal groups")
    if num_groups == 1:
        return np.arange(n, dtype=np.int64)[None, :]
    order = np.lexsort((np.arange(n), -costs))  # costliest first, ties by index
    groups = _largest_differencing(costs, order, num_groups)
    _improve_by_swaps(costs, groups)
    rows = [sorted(g) for g in groups]
    totals = [float(costs[r].sum()) for r in rows]
    rows = [r for _, r in sorted(zip(totals, rows), key=lambda p: (-p[0], p[1][0]))]
    return np.array(rows, dtype=np.int64).reshape(num_groups, n // num_groups)


def _largest_differencing(costs: np.ndarray, order: np.ndarray, k: int) -> list[list[int]]:
    """Balanced largest differencing: each run of k items (by cost) is a partial solution of k one-item
    groups; the two partials with the largest spread are merged, costliest group with cheapest, until one
    is left."""
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for tie, start in enumerate(range(0, len(order), k)):
        members = [[int(i)] for i in order[start : start + k]]
        sums = [float(costs[m[0]]) for m in members]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, members))
    tie = len(heap)
    while len(heap) > 1:
        _, _, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        merged = sorted(
            ((sums_a[i] + sums_b[k - 1 - i], groups_a[i] + groups_b[k - 1 - i]) for i in range(k)),
            key=lambda p: (-p[0], min(p[1])),
        )
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, [g for _, g in merged]))
        tie += 1
    return heap[0][3]


def _improve_by_swaps(costs: np.ndarray, groups: list[list[int]]) -> None:
    """Repeatedly swap one item of the costliest group with one item of another group, choosing the swap
    that leaves the lower larger-of-the-two sums; stops when no swap lowers the costliest group (or after
    `SWAP_PASSES` swaps)."""
    members = np.array(groups, dtype=np.int64)  # [k groups, items per group]
    sums = costs[members].sum(axis=1)
    for _ in range(SWAP_PASSES):
        top = int(np.argmax(sums))
        mine = costs[members[top]]
        delta = mine[:, None, None] - costs[members][None, :, :]  # [i in top, other group, j in it]
        gap = (sums[top] - sums)[None, :, None]
        useful = (delta > 0) & (delta < gap)
        if not useful.any():
            break
        pair_max = np.maximum(sums[top] - delta, sums[None, :, None] + delta)
        i, other, j = np.unravel_index(int(np.argmin(np.where(useful, pair_max, np.inf))), delta.shape)
        d = float(delta[i, other, j])
        members[top, i], members[other, j] = members[other, j], members[top, i]
        sums[top] -= d
        sums[other] += d
    groups[:] = members.tolist()


def balanced_layout(costs: np.ndarray, dp_size: int, micro_batch_size: int) -> np.ndarray:
    """Positions (into the global batch) for every (rank, micro-batch, slot): int64 [D, m, B].

    Ranks get equal-count groups of even total cost; each rank's bins are split the same way into its m
    micro-batches (costliest micro-batch first).
    """
    costs = np.asarray(costs, dtype=np.float64)
    per_rank = len(costs) // dp_size
    if per_rank * dp_size != len(costs) or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch of {len(costs)} bins does not split into {dp_size} ranks of micro-batches of "
            f"{micro_batch_size}"
        )
    micro_batches = per_rank // micro_batch_size
    layout = np.empty((dp_size, micro_batches, micro_batch_size), dtype=np.int64)
    # rank order does not matter for the step time; keep it fixed by the groups' own order
    for rank, members in enumerate(balanced_groups(costs, dp_size)):
        inner = balanced_groups(costs[members], micro_batches)
        layout[rank] = members[inner]
    return layout


class ComputeBalance:
    """Per-bin costs of a dataset and the balanced layout of each global batch (last few memoised)."""

    def __init__(self, bin_costs: np.ndarray) -> None:
        self.bin_costs = np.ascontiguousarray(bin_costs, dtype=np.float64)
        if self.bin_costs.ndim != 1 or not np.isfinite(self.bin_costs).all():
            raise ValueError("bin_costs must be a 1-D array of finite costs, one per bin")
        self._memo: dict[tuple[int, int, int], np.ndarray] = {}
        self._lock = threading.Lock()  # a loader worker's prefetch thread asks for layouts too

    def __getstate__(self) -> dict[str, object]:
        return {"bin_costs": self.bin_costs}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["bin_costs"])  # type: ignore[misc]

    def costs(self, bins: np.ndarray) -> np.ndarray:
        """The cost of each bin of `bins` (ids)."""
        return self.bin_costs[bins]

    def layout(self, step: int, global_bins: np.ndarray, dp_size: int, micro_batch_size: int) -> np.ndarray:
        """Bin ids [D, m, B] of global batch `step`, whose bins (in stream order) are `global_bins`."""
        key = (step, dp_size, micro_batch_size)
        with self._lock:
            if key not in self._memo:
                positions = balanced_layout(self.costs(global_bins), dp_size, micro_batch_size)
                if len(self._memo) >= 8:
                    self._memo.pop(next(iter(self._memo)))
                self._memo[key] = np.asarray(global_bins, dtype=np.int64)[positions]
            return self._memo[key]


def load_bin_features(manifest: Manifest, storage: StorageConfig) -> np.ndarray:
    """Cost features (float64 [num_bins, 4]) of every bin, from seq_lens, image_grid_thw and video_grid_thw only.

    Arrow shards: just those two columns are read. WebDataset shards: the bin's members are read (image
    bytes included, never decoded). Each shard is fetched and checked like the loader's own reads, once per
    machine: the features are kept in the cache's `.meta/<sha256>.bin-features.npy` (a damaged file is
    recomputed), so later loaders (other ranks, restarts) neither read nor download the shard for them.
    """
    store = ShardStore(storage)
    out = np.zeros((manifest.num_bins, 4))
    for shard in manifest.shards:
        kept = os.path.join(store.meta_dir, f"{shard.sha256}.bin-features.npy") if store.meta_dir else ""
        features = _read_kept(kept, shard.bins)
        if features is None:
            features = _shard_features(store, shard)
            if len(features) != shard.bins:
                raise ValueError(
                    f"shard {shard.path} holds {len(features)} bins, the manifest says {shard.bins}"
                )
            if kept:
                _keep(kept, features)
        out[shard.first_bin : shard.first_bin + shard.bins] = features
    return out


def _read_kept(path: str, bins: int) -> np.ndarray | None:
    if not path or not os.path.exists(path):
        return None
    try:
        features = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return features if features.shape == (bins, 4) and features.dtype == np.float64 else None


def _keep(path: str, features: np.ndarray) -> None:
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(temporary, "wb") as f:
        np.save(f, features, allow_pickle=False)
    os.replace(temporary, path)


def _shard_features(store: ShardStore, shard: ShardInfo) -> np.ndarray:
    from mmpack.dataloader.readers import open_shard_reader

    path = store.local_path(shard)  # fetched (remote) or checked (local) like the loader's own reads
    label = f"shard {shard.path}"
    if shard.format == "arrow":
        return _arrow_features(path, label)
    reader = open_shard_reader(path, shard.format, label=label, index_cache=store.index_cache_path(shard))
    try:
        rows = [reader.read(i) for i in range(len(reader))]
    finally:
        reader.close()
    seq = [r["seq_lens"] for r in rows]
    grids = [np.asarray(r["image_grid_thw"]).reshape(-1, 3) for r in rows]
    videos = [np.asarray(r["video_grid_thw"]).reshape(-1, 3) for r in rows]
    features = features_from_offsets(
        np.concatenate(seq) if seq else np.zeros(0),
        np.concatenate(([0], np.cumsum([len(x) for x in seq]))),
        np.concatenate(grids) if grids else np.zeros((0, 3)),
        np.concatenate(([0], np.cumsum([len(g) for g in grids]))),
    )
    return add_video_features(
        features,
        np.concatenate(videos) if videos else np.zeros((0, 3)),
        np.concatenate(([0], np.cumsum([len(v) for v in videos]))),
    )


def _arrow_features(path: str, label: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    parts = []
    with pa.memory_map(path, "r") as source:
        shard = ipc.open_file(source)
        for b in range(shard.num_record_batches):
            batch = shard.get_batch(b)
            try:
                seq, grid = batch.column("seq_lens"), batch.column("image_grid_thw")
            except KeyError as e:
                raise ValueError(f"{label}: no {e} column; is this an mmpack shard?") from e
            seq_offsets = np.asarray(seq.offsets) - seq.offsets[0].as_py()
            grid_offsets = np.asarray(grid.offsets) - grid.offsets[0].as_py()
            grid_values = grid.flatten()
            if pa.types.is_list(grid_values.type) or pa.types.is_fixed_size_list(grid_values.type):
                grid_values = grid_values.flatten()  # one list of 3 per image: offsets count images
            else:
                grid_offsets = grid_offsets // 3  # flat (t, h, w) triples: offsets count numbers
            features = features_from_offsets(
                np.asarray(seq.flatten()), seq_offsets, np.asarray(grid_values), grid_offsets
            )
            if "video_grid_thw" in batch.schema.names:  # datasets with videos (format version 3)
                video = batch.column("video_grid_thw")
                video_offsets = np.asarray(video.offsets) - video.offsets[0].as_py()
                values = np.asarray(video.flatten().flatten())
                features = add_video_features(features, values, video_offsets)
            parts.append(features)
    return np.concatenate(parts) if parts else np.zeros((0, 4))


def compute_balance(
    manifest: Manifest, storage: StorageConfig, cost_model: CostModel | None = None
) -> ComputeBalance:
    """The `ComputeBalance` of a dataset under `cost_model` (default: `mmpack.packing.cost.DEFAULT_COST_MODEL`)."""
    model = cost_model or DEFAULT_COST_MODEL
    return ComputeBalance(model.cost(load_bin_features(manifest, storage)))
