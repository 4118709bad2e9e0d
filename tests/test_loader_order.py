"""Global bin order and rank assignment, on manifests without files (pure functions only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.dataloader import (
    BatchPlan,
    Manifest,
    StreamOrder,
    Topology,
    bin_order,
    bins_for,
    micro_batch_bins,
)
from mmpack.packing.format import FORMAT_NAME, FORMAT_VERSION


def fake_manifest(shard_bins: list[int], fmt: str = "arrow") -> Manifest:
    shards, first = [], 0
    for i, n in enumerate(shard_bins):
        shards.append(
            {
                "path": f"shards/t-{i:06d}.{'arrow' if fmt == 'arrow' else 'tar'}",
                "format": fmt,
                "first_bin": first,
                "bins": n,
                "samples": n,
                "tokens": 0,
                "bytes": 1,
                "sha256": f"{i:064x}",
            }
        )
        first += n
    raw = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "seq_len": 64, "shards": shards}
    return Manifest.from_dict(raw)


SHARDS = [7, 5, 9, 3, 8, 4, 6, 6]  # 48 bins, uneven shards


def test_bin_order_is_a_deterministic_permutation() -> None:
    m = fake_manifest(SHARDS)
    a = bin_order(m, seed=3, epoch=0)
    assert a.dtype == np.int64
    assert sorted(a.tolist()) == list(range(48))
    np.testing.assert_array_equal(a, bin_order(m, seed=3, epoch=0))
    np.testing.assert_array_equal(a, bin_order(m.raw, seed=3, epoch=0))  # plain dict works too
    assert not np.array_equal(a, bin_order(m, seed=3, epoch=1))
    assert not np.array_equal(a, bin_order(m, seed=4, epoch=0))


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_bin_order_keeps_windows_of_shards_together(window: int) -> None:
    m = fake_manifest(SHARDS)
    order = bin_order(m, seed=0, epoch=0, shard_window=window)
    # The order must be a concatenation of blocks, each holding all bins of at most `window` shards.
    remaining = {i: s.bins for i, s in enumerate(m.shards)}
    block: set[int] = set()
    blocks = 0
    for s in m.shard_of_bin(order).tolist():
        block.add(s)
        remaining[s] -= 1
        assert len(block) <= window
        if len(block) == window and all(remaining[x] == 0 for x in block):
            block, blocks = set(), blocks + 1
    assert all(v == 0 for v in remaining.values())
    assert blocks == len(SHARDS) // window
    if window == 1:
        runs = [k for k, _ in itertools.groupby(m.shard_of_bin(order).tolist())]
        assert len(runs) == len(SHARDS)


GRID = [(dp, tp, pp) for dp in (1, 2, 3, 4) for tp in (1, 2) for pp in (1, 3)]


@pytest.mark.parametrize(("dp", "tp", "pp"), GRID)
@pytest.mark.parametrize("micro", [1, 2])
def test_grid_ranks_split_each_epoch_exactly(dp: int, tp: int, pp: int, micro: int) -> None:
    m = fake_manifest(SHARDS)
    global_batch = 12 if 12 % (micro * dp) == 0 else micro * dp * 2
    if m.num_bins % global_batch:
        pytest.skip("grid point does not tile the epoch")
    plan = BatchPlan(global_batch_size=global_batch, micro_batch_size=micro, dp_size=dp)
    stream = StreamOrder(m, seed=5)
    steps = m.num_bins // global_batch
    per_rank: dict[tuple[int, int, int], list[np.ndarray]] = {}
    for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
        topo = Topology(dp_rank=d, dp_size=dp, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
        per_rank[(d, t, p)] = [
            micro_batch_bins(stream, s, mb, topo, plan)
            for s in range(steps)
            for mb in range(plan.micro_batches_per_step)
        ]
    counts = {len(v) for v in per_rank.values()}
    assert counts == {steps * plan.micro_batches_per_step}  # same number of micro-batches everywhere
    for (d, _t, _p), mbs in per_rank.items():
        assert all(len(x) == micro for x in mbs)
        ref = per_rank[(d, 0, 0)]
        assert all(np.array_equal(a, b) for a, b in zip(mbs, ref))  # the TP and PP peers of a DP rank agree
    dp_bins = [np.concatenate(per_rank[(d, 0, 0)]) for d in range(dp)]
    for a, b in itertools.combinations(dp_bins, 2):
        assert not set(a.tolist()) & set(b.tolist())
    union = np.concatenate(dp_bins)
    assert sorted(union.tolist()) == list(range(m.num_bins))


def test_global_batch_is_the_same_for_every_dp_size() -> None:
    m = fake_manifest(SHARDS)
    stream = StreamOrder(m, seed=1)
    for step in range(10):  # crosses epoch boundaries (48 bins / 8 per batch = 6 steps per epoch)
        batches = []
        for dp in (1, 2, 4):
            plan = BatchPlan(global_batch_size=8, micro_batch_size=2, dp_size=dp)
            parts = [
                micro_batch_bins(stream, step, mb, Topology(dp_rank=r, dp_size=dp), plan)
                for r in range(dp)
                for mb in range(plan.micro_batches_per_step)
            ]
            batches.append(np.concatenate(parts))
        assert all(np.array_equal(batches[0], b) for b in batches[1:])
        np.testing.assert_array_equal(batches[0], stream.positions(step * 8, 8))


def test_epochs_chain_without_losing_bins() -> None:
    m = fake_manifest([5, 5])  # 10 bins, global batch 4: batches straddle epochs
    stream = StreamOrder(m, seed=0)
    plan = BatchPlan(global_batch_size=4, micro_batch_size=4, dp_size=1)
    topo = Topology(dp_rank=0, dp_size=1)
    flat = np.concatenate(
        [micro_batch_bins(stream, s, 0, topo, plan) for s in range(5)]
    )  # 20 bins = 2 epochs
    np.testing.assert_array_equal(flat[:10], bin_order(m, 0, 0))
    np.testing.assert_array_equal(flat[10:], bin_order(m, 0, 1))


def test_bins_for_matches_stream_form() -> None:
    m = fake_manifest(SHARDS)
    topo = Topology(dp_rank=1, dp_size=2, tp_rank=1, tp_size=2)
    plan = BatchPlan(global_batch_size=8, micro_batch_size=2, dp_size=2)
    got = bins_for(m, 7, 3, 1, topo, micro_batch_size=2, global_batch_size=8)
    np.testing.assert_array_equal(got, micro_batch_bins(StreamOrder(m, 7), 3, 1, topo, plan))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dp_rank": 2, "dp_size": 2},
        {"dp_rank": 0, "dp_size": 0},
        {"dp_rank": 0, "dp_size": 1, "tp_rank": 1},
        {"dp_rank": 0, "dp_size": 1, "pp_rank": -1, "pp_size": 2},
    ],
)
def test_topology_rejects_bad_ranks(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Topology(**kwargs)


def test_plan_rejects_indivisible_batch() -> None:
    with pytest.raises(ValueError, match="divisible"):
        BatchPlan(global_batch_size=10, micro_batch_size=2, dp_size=3)


def test_from_megatron_needs_initialised_state() -> None:
    with pytest.raises(RuntimeError, match="not initialised"):
        Topology.from_megatron()


@settings(max_examples=60, deadline=None)
@given(
    shard_bins=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    seed=st.integers(0, 2**31),
    window=st.integers(1, 5),
    dp=st.sampled_from([1, 2, 4]),
    micro=st.sampled_from([1, 2]),
    steps_before=st.integers(0, 6),
)
def test_any_split_and_resume_point_reproduces_the_stream(
    shard_bins: list[int], seed: int, window: int, dp: int, micro: int, steps_before: int
) -> None:
    m = fake_manifest(shard_bins)
    global_batch = dp * micro * 2
    stream = StreamOrder(m, seed, shard_window=window)
    order = bin_order(m, seed, 0, shard_window=window)
    assert sorted(order.tolist()) == list(range(m.num_bins))
    plan = BatchPlan(global_batch_size=global_batch, micro_batch_size=micro, dp_size=dp)
    for step in (steps_before, steps_before + 1):
        got = np.concatenate(
            [
                micro_batch_bins(stream, step, mb, Topology(dp_rank=r, dp_size=dp), plan)
                for r in range(dp)
                for mb in range(plan.micro_batches_per_step)
            ]
        )
        # A fresh stream object (as after a restart) gives the same global batch.
        np.testing.assert_array_equal(
            got, StreamOrder(m, seed, shard_window=window).positions(step * global_batch, global_batch)
        )
