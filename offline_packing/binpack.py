"""Stage 3, binpack: choose which samples share a bin, order the bins, and cut them into shards.

Reads:  `<work>/lengths/chunk-N.{offsets,nimg,ibytes}.npy` (lengths, image counts, image bytes).
Writes: `<work>/binpack/{order,bin_offsets,shard_first_bin}.npy` then `<work>/binpack.done.json`.
        Bin b holds the samples `order[bin_offsets[b]:bin_offsets[b+1]]` (global sample indices, ascending);
        shard s holds bins `shard_first_bin[s]:shard_first_bin[s+1]`.
Run alone: `python -m mmpack.offline_packing.binpack <mmpack pack flags>`.
"""

from __future__ import annotations

import numpy as np

from mmpack.offline_packing.config import BinpackStage
from mmpack.offline_packing.lengths import load_lengths
from mmpack.offline_packing.workdir import WorkDir

STAGE = "binpack"
# Shard-size estimate per bin: token ids (4 B) + loss mask (1 B) per token, the image bytes, and a
# fixed overhead for keys, metadata and format framing.
_BYTES_PER_TOKEN = 5
_BYTES_PER_BIN = 2048


def pack_bins(
    lengths: np.ndarray, image_counts: np.ndarray, cfg: BinpackStage
) -> tuple[list[np.ndarray], str]:
    """The bins (arrays of sample indices, ascending) in output order, and the algorithm used.

    Bin order is shuffled with `cfg.seed` so that every shard mixes long and short samples (packing
    algorithms emit bins grouped by the length of their largest item).
    """
    from mmpack.packing.binpack import pack_lengths

    if len(lengths) == 0:
        return [], cfg.binpack.algorithm
    result = pack_lengths(
        lengths,
        cfg.seq_len,
        algorithm=cfg.binpack.algorithm,
        max_items_per_bin=cfg.binpack.max_samples_per_bin,
        image_counts=image_counts,
        max_images_per_bin=cfg.max_images_per_bin,
    )
    if np.any(np.asarray(result.bin_ids) < 0):
        raise AssertionError("a sample the lengths stage should have rejected reached the binpack stage")
    bins = result.bins()
    perm = np.random.default_rng(cfg.binpack.seed).permutation(len(bins))
    return [np.asarray(bins[i], dtype=np.int64) for i in perm], str(result.algorithm)


def plan_shards(bin_tokens: np.ndarray, bin_image_bytes: np.ndarray, cfg: BinpackStage) -> np.ndarray:
    """First bin of each shard (plus the end), cutting at `max_bins_per_shard` or the estimated byte limit."""
    firsts = [0]
    size, count = 0, 0
    for b, (tokens, ibytes) in enumerate(zip(bin_tokens.tolist(), bin_image_bytes.tolist())):
        est = tokens * _BYTES_PER_TOKEN + ibytes + _BYTES_PER_BIN
        if count and (count >= cfg.binpack.max_bins_per_shard or size + est > cfg.binpack.max_shard_bytes):
            firsts.append(b)
            size, count = 0, 0
        size += est
        count += 1
    firsts.append(len(bin_tokens))
    return np.asarray(firsts if len(bin_tokens) else [0], dtype=np.int64)


def run_binpack(wd: WorkDir, cfg: BinpackStage, fingerprint: str) -> dict:
    """Stage 3; returns the marker info (bins, shards, algorithm)."""
    n_chunks = len(wd.read_marker("scan")["chunks"])
    lengths, nimg, ibytes = load_lengths(wd, n_chunks)
    bins, algorithm = pack_bins(lengths, nimg, cfg)
    order = np.concatenate(bins) if bins else np.zeros(0, np.int64)
    bin_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    bin_offsets[1:] = np.cumsum([len(b) for b in bins])
    bin_tokens = np.add.reduceat(lengths[order], bin_offsets[:-1]) if bins else np.zeros(0, np.int64)
    bin_ibytes = np.add.reduceat(ibytes[order], bin_offsets[:-1]) if bins else np.zeros(0, np.int64)
    shard_first_bin = plan_shards(bin_tokens, bin_ibytes, cfg)
    d = wd.stage_dir(STAGE)  # written whole by this step: nothing to fetch first
    wd.write_npy(d / "order.npy", order)
    wd.write_npy(d / "bin_offsets.npy", bin_offsets)
    wd.write_npy(d / "shard_first_bin.npy", shard_first_bin)
    bin_ids = np.full(len(lengths), -1, dtype=np.int64)
    bin_ids[order] = np.repeat(np.arange(len(bins), dtype=np.int64), np.diff(bin_offsets))
    wd.write_npy(d / "bin_ids.npy", bin_ids)
    info = {
        "algorithm": algorithm,
        "bins": len(bins),
        "shards": len(shard_first_bin) - 1,
        "samples": len(lengths),
        "tokens": int(lengths.sum()),
    }
    wd.mark_done(STAGE, fingerprint, info)
    return info


def load_plan(wd: WorkDir) -> dict[str, np.ndarray]:
    """The arrays written by stage 3."""
    names = ("order", "bin_offsets", "shard_first_bin", "bin_ids")
    return {name: np.load(wd.stage_file(STAGE, f"{name}.npy")) for name in names}


if __name__ == "__main__":
    from mmpack.offline_packing.pipeline import stage_main

    raise SystemExit(stage_main(STAGE))
