"""Compute balancing: the cost model, balanced equal-count groups, the per-rank layout of each global batch
(pure, complete, equal micro-batch counts), and exact resume with balancing on (simulated ranks and a real
loader)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.dataloader import Topology, build_loader, load_manifest
from mmpack.dataloader import balance as balance_module
from mmpack.dataloader.balance import ComputeBalance, balanced_groups, balanced_layout, load_bin_features
from mmpack.dataloader.order import BatchPlan, StreamOrder, micro_batch_bins
from mmpack.dataloader.storage import StorageConfig
from mmpack.demo.synthetic import build_packed_dataset
from mmpack.packing.cost import COST_FEATURES, DEFAULT_COST_MODEL, CostModel, bin_cost_features
from tests.support.loader_data import all_records, global_batches
from tests.support.storage_servers import http_server

FAST = settings(max_examples=60, deadline=None)


# -- cost model -----------------------------------------------------------------------------------------------
def test_bin_cost_features_by_hand() -> None:
    features = bin_cost_features(np.array([3, 5]), np.array([[1, 2, 4], [1, 2, 2]]))
    assert features.tolist() == [8.0, 34.0, 12.0, 80.0]


def test_default_model_makes_long_samples_cost_more_than_their_tokens() -> None:
    one_long = bin_cost_features(np.array([32768]), np.zeros((0, 3)))
    many_short = bin_cost_features(np.full(64, 512), np.zeros((0, 3)))
    assert one_long[0] == many_short[0]
    ratio = DEFAULT_COST_MODEL.cost(one_long) / DEFAULT_COST_MODEL.cost(many_short)
    assert 1.5 < ratio < 3.0  # attention is a large share at 32k for a 7B-shaped model, not all of it


def test_fit_recovers_coefficients_from_exact_times() -> None:
    rng = np.random.default_rng(0)
    features = rng.uniform(0, 1, (40, 4)) * np.array([8192, 8192**2, 4096, 4096**2])
    truth = CostModel(tokens=2e-3, sum_sq_seq_len=3e-8, image_patches=0.0, sum_sq_image_patches=1e-9)
    fitted = CostModel.fit(features, truth.cost(features))
    np.testing.assert_allclose(fitted.coefficients, truth.coefficients, rtol=1e-6, atol=1e-15)


def test_fit_keeps_coefficients_non_negative_and_bad_input_is_explained() -> None:
    rng = np.random.default_rng(1)
    features = rng.uniform(0, 1, (20, 4))
    times = features[:, 0] - 0.5 * features[:, 1] + 0.01 * rng.normal(size=20)  # least squares says b < 0
    assert (CostModel.fit(features, times).coefficients >= 0).all()
    with pytest.raises(ValueError, match=r"\[m, 4\]"):
        CostModel.fit(features[:, :3], times)
    with pytest.raises(ValueError, match="tokens"):
        CostModel(tokens=-1.0)
    with pytest.raises(ValueError, match="at least one"):
        CostModel(tokens=0.0)


# -- balanced groups ------------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 8), st.integers(1, 6), st.lists(st.floats(0, 1e6), min_size=48, max_size=48))
def test_balanced_groups_are_equal_sized_disjoint_complete_and_pure(groups, per_group, pool):
    costs = np.array(pool[: groups * per_group])
    result = balanced_groups(costs, groups)
    assert result.shape == (groups, per_group)
    assert sorted(result.ravel().tolist()) == list(range(groups * per_group))
    np.testing.assert_array_equal(result, balanced_groups(costs.copy(), groups))
    sums = costs[result].sum(axis=1)
    assert np.all(np.diff(sums) <= 1e-9 * max(1.0, sums.max()))  # costliest group first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_groups_near_the_bound_where_stream_order_is_not(seed):
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0, 1.0, 512)
    sums = costs[balanced_groups(costs, 64)].sum(axis=1)
    bound = max(costs.sum() / 64, costs.max() + np.sort(costs)[:7].sum())
    stream_order = costs.reshape(64, 8).sum(axis=1).max()  # control: today's contiguous split
    assert sums.max() <= 1.01 * bound < stream_order


def test_layout_splits_each_rank_into_even_micro_batches():
    costs = np.array([9.0, 1, 1, 1, 8, 2, 2, 2, 5, 5, 5, 5, 3, 3, 4, 4])
    layout = balanced_layout(costs, dp_size=2, micro_batch_size=2)
    assert layout.shape == (2, 4, 2)
    assert sorted(layout.ravel().tolist()) == list(range(16))
    rank_sums = costs[layout].sum(axis=(1, 2))
    assert rank_sums.max() == rank_sums.min() == costs.sum() / 2


# -- the layout of the stream ---------------------------------------------------------------------------------
def _dataset_like(num_bins: int, seed: int = 0) -> tuple[Any, ComputeBalance]:
    from mmpack.dataloader.manifest import Manifest

    shards = [
        {
            "path": f"shards/s-{i:06d}.arrow",
            "format": "arrow",
            "first_bin": 10 * i,
            "bins": 10,
            "samples": 10,
            "tokens": 10,
            "bytes": 1,
            "sha256": "0" * 64,
        }
        for i in range(num_bins // 10)
    ]
    manifest = Manifest.from_dict({"format": "mmpack-packed", "version": 2, "seq_len": 8, "shards": shards})
    costs = np.random.default_rng(seed).lognormal(0, 1.0, num_bins)
    return manifest, ComputeBalance(costs)


def _step_bins(manifest, balance, step, dp, micro, global_batch, seed=3):
    plan = BatchPlan(global_batch_size=global_batch, micro_batch_size=micro, dp_size=dp)
    stream = StreamOrder(manifest, seed)
    return [
        [
            micro_batch_bins(stream, step, j, Topology(dp_rank=r, dp_size=dp), plan, balance).tolist()
            for j in range(plan.micro_batches_per_step)
        ]
        for r in range(dp)
    ]


@pytest.mark.parametrize(("dp", "micro"), [(1, 4), (2, 2), (4, 1), (8, 2)])
def test_every_rank_of_a_grid_gets_disjoint_bins_that_complete_the_global_batch(dp, micro):
    manifest, balance = _dataset_like(200)
    stream = StreamOrder(manifest, 3)
    for step in (0, 7, 12, 13):  # 12 and 13 straddle the epoch boundary (200 bins, 16 per step)
        ranks = _step_bins(manifest, balance, step, dp, micro, 16)
        assert all(len(r) == 16 // (dp * micro) and all(len(mb) == micro for mb in r) for r in ranks)
        flat = [b for r in ranks for mb in r for b in mb]
        assert sorted(flat) == sorted(stream.positions(step * 16, 16).tolist())
        # pure: a fresh balance object over the same costs gives the same layout
        again = _step_bins(manifest, ComputeBalance(balance.bin_costs.copy()), step, dp, micro, 16)
        assert again == ranks


def test_balancing_lowers_the_slowest_rank_and_elastic_resume_keeps_the_stream():
    manifest, balance = _dataset_like(400, seed=5)
    costs = balance.bin_costs
    plain_max, balanced_max = [], []
    consumed: list[int] = []
    for step in range(10):
        dp = 4 if step < 5 else 2  # elastic: DP size changes between steps 4 and 5
        ranks = _step_bins(manifest, balance, step, dp, 1, 16)
        balanced_max.append(max(costs[list(itertools.chain(*r))].sum() for r in ranks))
        plain = _step_bins(manifest, None, step, dp, 1, 16)
        plain_max.append(max(costs[list(itertools.chain(*r))].sum() for r in plain))
        consumed += sorted(b for r in ranks for mb in r for b in mb)
    stream = StreamOrder(manifest, 3).positions(0, 160).reshape(10, 16)
    assert consumed == [b for row in stream for b in sorted(row.tolist())]
    assert sum(balanced_max) < 0.9 * sum(plain_max)


# -- a real loader ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed_dataset(tmp_path_factory.mktemp("balance"), fmt="both")


def test_bin_features_from_both_formats_match_the_records(dataset: Path, tmp_path: Path) -> None:
    records = all_records(dataset)
    want = np.array(
        [bin_cost_features(r["seq_lens"], r["image_grid_thw"]) for _, r in sorted(records.items())]
    )
    assert want[:, 2].sum() > 0  # the dataset has images
    for fmt in ("arrow", "wds"):
        manifest = load_manifest(str(dataset), shard_format=fmt)
        got = load_bin_features(manifest, StorageConfig(root=str(dataset)))
        np.testing.assert_array_equal(got, want)
    assert len(COST_FEATURES) == want.shape[1]
    with http_server(dataset.parent) as base:  # a remote dataset: shards fetched into the cache first
        url = f"{base}/{dataset.name}"
        remote = load_bin_features(load_manifest(url), StorageConfig(root=url, cache_dir=str(tmp_path)))
    np.testing.assert_array_equal(remote, want)


def test_bin_features_are_kept_per_machine(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = load_manifest(str(dataset))
    storage = StorageConfig(root=str(dataset), cache_dir=str(tmp_path))
    first = load_bin_features(manifest, storage)
    kept = sorted(tmp_path.rglob("*.bin-features.npy"))
    assert len(kept) == len(manifest.shards)
    kept[0].write_bytes(b"damaged")  # recomputed, not trusted

    calls: list[str] = []
    real = balance_module._arrow_features
    monkeypatch.setattr(
        balance_module, "_arrow_features", lambda path, label: calls.append(label) or real(path, label)
    )
    np.testing.assert_array_equal(load_bin_features(manifest, storage), first)
    assert len(calls) == 1  # only the damaged shard was read again


def _loaders(dataset: Path, dp: int, workers: int = 0) -> list[Any]:
    return [
        build_loader(
            str(dataset),
            topology=Topology(dp_rank=r, dp_size=dp),
            micro_batch_size=1,
            global_batch_size=8,
            num_workers=workers,
            seed=11,
            balance="compute",
        )
        for r in range(dp)
    ]


def test_loader_with_balancing_resumes_exactly_across_dp_sizes(dataset: Path) -> None:
    manifest = load_manifest(str(dataset))
    steps = manifest.num_bins // 8 + 2  # crosses an epoch boundary
    reference = global_batches(_loaders(dataset, 2), steps)
    plain = global_batches(
        [
            build_loader(
                str(dataset),
                topology=Topology(dp_rank=r, dp_size=2),
                micro_batch_size=1,
                global_batch_size=8,
                num_workers=0,
                seed=11,
            )
            for r in range(2)
        ],
        steps,
    )
    assert [sorted(b) for b in reference] == [sorted(b) for b in plain]  # same bins per global batch
    assert reference != plain  # ... laid out differently (the control: balancing did something)
    k = steps // 2
    first = _loaders(dataset, 4)
    head = global_batches(first, k)
    state = first[0].state_dict()
    assert state["balance"] == "compute"
    second = _loaders(dataset, 2, workers=2)  # worker processes compute the same layout
    for ld in second:
        ld.load_state_dict(state)
    tail = global_batches(second, steps - k)
    assert [sorted(b) for b in head + tail] == [sorted(b) for b in reference]
    assert tail == reference[k:]  # same DP size after resume: the exact same layout


def test_trainer_flag_reaches_the_data_config() -> None:
    from mmpack.trainer.arguments import parse_args

    assert parse_args(["--mock-data", "--balance", "compute"]).data.balance == "compute"
    assert parse_args(["--mock-data"]).data.balance == "none"
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--balance", "tokens"])


def test_trainer_cost_flag_is_four_coefficients_for_compute_balancing() -> None:
    from mmpack.trainer.arguments import parse_args

    cfg = parse_args(["--mock-data", "--balance", "compute", "--balance-cost", "1,0,0.5,1e-4"])
    assert cfg.data.balance_cost == (1.0, 0.0, 0.5, 1e-4)
    for bad in ("1,0,0", "1,0,0,-1", "1,x,0,0", "0,0,0,0"):
        with pytest.raises(SystemExit):
            parse_args(["--mock-data", "--balance", "compute", "--balance-cost", bad])
    with pytest.raises(ValueError, match="add --balance compute"):
        parse_args(["--mock-data", "--balance-cost", "1,0,0,0"])


def test_dense_cost_model_counts_windowed_vision_layers_per_patch() -> None:
    full = CostModel.dense(hidden_size=64, num_layers=2, vision_hidden_size=32, vision_layers=4)
    windowed = CostModel.dense(
        hidden_size=64,
        num_layers=2,
        vision_hidden_size=32,
        vision_layers=4,
        vision_full_attention_layers=1,
        vision_window_patches=16,
    )
    unit = 72.0 * 64**2 * 2
    assert windowed.sum_sq_image_patches == pytest.approx(12.0 * 32 * 1 / unit)
    assert full.sum_sq_image_patches == pytest.approx(4 * windowed.sum_sq_image_patches)
    assert windowed.image_patches == pytest.approx(full.image_patches + 12.0 * 32 * 16 * 3 / unit)
    # an image of 16 patches (one window) costs the same either way; a larger one costs less with windows
    one_window, large = np.array([0, 0, 16, 256.0]), np.array([0, 0, 1024, 1024.0**2])
    assert windowed.cost(one_window) == pytest.approx(full.cost(one_window))
    assert windowed.cost(large) < full.cost(large)
    dense_mask = CostModel.dense(hidden_size=64, num_layers=2, language_attention_by_sample=False)
    assert dense_mask.sum_sq_seq_len == 0 and full.sum_sq_seq_len > 0
    with pytest.raises(ValueError, match="vision_full_attention_layers"):
        CostModel.dense(hidden_size=64, num_layers=2, vision_layers=2, vision_full_attention_layers=3)


def test_trainer_cost_model_follows_the_model_and_its_attention() -> None:
    """`--balance compute` evens out the FLOPs MFU reports (one formula), here worked out by hand."""
    from mmpack.trainer.models.qwen2_5_vl import FAMILY
    from mmpack.trainer.training import balance_cost_model
    from tests.support.qwen2_5_vl import tiny_arch

    arch = tiny_arch()
    h, n, hv, lv = arch.hidden_size, arch.num_layers, arch.vision.hidden_size, arch.vision.depth
    g, d, f, fv = (
        arch.num_key_value_heads,
        arch.head_dim,
        arch.intermediate_size,
        arch.vision.intermediate_size,
    )
    # the tiny tower: windows of 2 x 2 merged units of 2 x 2 patches (16 patches), its last layer full
    assert (arch.vision.window_size, arch.vision.fullatt_block_indexes) == (56, (lv - 1,))
    with_te = balance_cost_model(FAMILY, arch, use_te=True)
    assert with_te == FAMILY.flop_model(arch)  # the count the trainer's MFU reports
    per_token = 2 * n * (h * (h + 2 * g * d) + h * h + 3 * h * f) + 2 * h * arch.vocab_size
    assert with_te.tokens == pytest.approx(per_token + 2 * h * n)
    assert with_te.sum_sq_seq_len == pytest.approx(2 * h * n)
    merger = 2 * (4 * hv * 4 * hv + 4 * hv * h) / 4
    per_patch = (
        2 * 3 * 2 * 14 * 14 * hv + 2 * lv * (4 * hv * hv + 3 * hv * fv) + merger + 4 * hv * 16 * (lv - 1)
    )
    assert with_te.image_patches == pytest.approx(per_patch)
    assert with_te.sum_sq_image_patches == pytest.approx(4 * hv)
    # without Transformer Engine the packed mask is dense: sample lengths do not change a bin's cost
    without = balance_cost_model(FAMILY, arch, use_te=False)
    assert without.sum_sq_seq_len == 0 and without.tokens == pytest.approx(per_token)
    assert (without.image_patches, without.sum_sq_image_patches) == (
        with_te.image_patches,
        with_te.sum_sq_image_patches,
    )
    assert balance_cost_model(FAMILY, arch, use_te=False, given=(1.0, 2.0, 3.0, 4.0)) == CostModel(
        tokens=1.0, sum_sq_seq_len=2.0, image_patches=3.0, sum_sq_image_patches=4.0
    )


@pytest.mark.ranks
@pytest.mark.slow
def test_trainer_logs_each_steps_dp_compute_spread(tmp_path: Path, packed_dataset: Any) -> None:
    """A real DP 2 run with balancing: every step logs the slowest and the mean rank's forward + backward
    time (gathered over the DP group) and their ratio."""
    from tests.support.trainer import ok, train

    data = packed_dataset(n_samples=40, seed=5)
    args = ["--data-path", str(data), "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--balance", "compute"]  # fmt: skip
    run = ok(train(2, args, tmp_path / "run"))
    assert "DP compute max/mean:" in run.stdout
    assert len(run.train) == 3
    for m in run.train:
        assert 0 < m["compute_ms_mean"] <= m["compute_ms_max"] <= m["step_ms"]
        assert m["dp_imbalance"] == pytest.approx(m["compute_ms_max"] / m["compute_ms_mean"])


def test_cost_model_under_context_parallelism_is_one_cp_rank_share() -> None:
    """A CP rank does 1/CP of the language model's token and attention work and the whole vision tower (run
    on every CP rank), so the vision part weighs CP times more against the text part."""
    from mmpack.trainer.models.qwen2_5_vl import FAMILY
    from mmpack.trainer.training import balance_cost_model
    from tests.support.qwen2_5_vl import tiny_arch

    arch = tiny_arch()
    whole = balance_cost_model(FAMILY, arch, use_te=True)
    cp2 = balance_cost_model(FAMILY, arch, use_te=True, cp_size=2)
    assert cp2.tokens == pytest.approx(whole.tokens / 2)
    assert cp2.sum_sq_seq_len == pytest.approx(whole.sum_sq_seq_len / 2)
    assert (cp2.image_patches, cp2.sum_sq_image_patches) == (whole.image_patches, whole.sum_sq_image_patches)
    given = balance_cost_model(FAMILY, arch, use_te=False, given=(4.0, 2.0, 3.0, 1.0), cp_size=4)
    assert given == CostModel(tokens=1.0, sum_sq_seq_len=0.5, image_patches=3.0, sum_sq_image_patches=1.0)
    # the balance it drives changes: a text-heavy and an image-heavy bin swap which costs more
    text, image = np.array([1000.0, 4e5, 0.0, 0.0]), np.array([200.0, 4e4, 64.0, 4096.0])
    tiny = CostModel(tokens=1.0, sum_sq_seq_len=0.0, image_patches=6.0, sum_sq_image_patches=0.0)
    assert tiny.cost(text) > tiny.cost(image)
    assert tiny.per_cp_rank(4).cost(text) < tiny.per_cp_rank(4).cost(image)
    with pytest.raises(ValueError, match="CP size must be >= 1"):
        tiny.per_cp_rank(0)
