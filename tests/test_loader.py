"""The loader end to end on a real packed dataset on local disk: output contract, ranks, resume."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmpack.dataloader import PackedLoader, Topology, bin_order, build_loader, load_manifest
from mmpack.demo.synthetic import build_packed_dataset
from mmpack.packing.batch import contract_problems
from mmpack.packing.image_tokens import ImageTokenRule, image_to_patches
from mmpack.packing.layout import build_packed_sequence
from tests.support.loader_data import all_records, assert_same, global_batches, take

IGNORE = -100


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed_dataset(tmp_path_factory.mktemp("loader"), fmt="both")


def loader(path: Path | str, topo: Topology, **kw: Any) -> PackedLoader:
    kw.setdefault("micro_batch_size", 2)
    kw.setdefault("global_batch_size", 4)
    kw.setdefault("num_workers", 0)
    return build_loader(str(path), topology=topo, **kw)


def reference_mask(cu: np.ndarray, total: int) -> np.ndarray:
    seg = np.searchsorted(cu, np.arange(total), side="right")
    causal = np.arange(total)[None, :] <= np.arange(total)[:, None]
    return ~((seg[:, None] == seg[None, :]) & causal)


def check_contract(
    batch: Any, records: dict[int, dict[str, Any]], seq_len: int, pad_id: int, image_pad_id: int
) -> None:
    assert contract_problems(batch) == []
    b = len(batch.bin_ids)
    for value in (batch.tokens, batch.labels, batch.position_ids):
        assert value.shape == (b, seq_len) and value.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.float32
    assert torch.equal(batch.loss_mask, (batch.labels != IGNORE).float())
    cu = batch.cu_seqlens.numpy()
    assert batch.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == b * seq_len
    assert np.all(np.diff(cu) > 0) and set(range(0, b * seq_len + 1, seq_len)) <= set(cu.tolist())
    assert int(batch.max_seqlen) == int(np.diff(cu).max())
    tokens, labels = batch.tokens.numpy().reshape(-1), batch.labels.numpy().reshape(-1)
    pos = batch.position_ids.numpy().reshape(-1)
    for a, e in itertools.pairwise(cu.tolist()):
        np.testing.assert_array_equal(pos[a:e], np.arange(e - a))  # positions restart per sample
        assert labels[e - 1] == IGNORE  # no label crosses a sample boundary
        inner = labels[a : e - 1]
        hit = inner != IGNORE
        np.testing.assert_array_equal(inner[hit], tokens[a + 1 : e][hit])
    assert not np.any(labels[tokens == image_pad_id] == image_pad_id)
    n_real = 0
    grids, pixel_rows = [], []
    rule = ImageTokenRule()
    for row, bin_id in enumerate(batch.bin_ids.tolist()):
        rec = records[bin_id]
        ref = build_packed_sequence(
            rec["input_ids"],
            rec["loss_mask"],
            rec["seq_lens"],
            pad_to=seq_len,
            pad_id=pad_id,
            ignore_ids=(image_pad_id,),
        )
        np.testing.assert_array_equal(batch.tokens[row].numpy(), ref.tokens)
        np.testing.assert_array_equal(batch.labels[row].numpy(), ref.labels)
        np.testing.assert_array_equal(batch.position_ids[row].numpy(), ref.position_ids)
        n_real += len(rec["input_ids"])
        for data, g in zip(rec["images"], rec["image_grid_thw"]):
            grids.append(g.tolist())
            pixel_rows.append(image_to_patches(Image.open(io.BytesIO(data)), rule, grid_thw=tuple(g)))
    assert int(batch.num_real_tokens) == n_real
    assert batch.image_grid_thw.dtype == torch.int64 and batch.image_grid_thw.tolist() == grids
    assert batch.pixel_values.dtype == torch.float32
    assert batch.pixel_values.shape == (sum(int(np.prod(g)) for g in grids), rule.patch_dim)
    if pixel_rows:
        np.testing.assert_allclose(batch.pixel_values.numpy(), np.concatenate(pixel_rows), atol=1e-6)
    # The i-th image fills the i-th run of <|image_pad|> tokens (row-major over [B, L]).
    is_pad = np.concatenate([[False], tokens == image_pad_id, [False]]).astype(np.int8)
    starts, ends = np.flatnonzero(np.diff(is_pad) == 1), np.flatnonzero(np.diff(is_pad) == -1)
    assert (ends - starts).tolist() == [g[1] * g[2] // 4 for g in grids]
    if batch.attention_mask is not None:
        mask = batch.attention_mask
        assert mask.shape == (b, 1, seq_len, seq_len) and mask.dtype == torch.bool
        for row in range(b):
            row_cu = cu[(cu >= row * seq_len) & (cu <= (row + 1) * seq_len)] - row * seq_len
            np.testing.assert_array_equal(mask[row, 0].numpy(), reference_mask(row_cu, seq_len))


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_output_contract_against_layout(dataset: Path, fmt: str) -> None:
    m = load_manifest(str(dataset))
    records = all_records(dataset, fmt)
    ld = loader(
        dataset, Topology(dp_rank=0, dp_size=1), num_epochs=1, shard_format=fmt, build_attention_mask=True
    )
    batches = list(ld)
    assert len(batches) == m.num_bins // 4 * 2
    with_images = 0
    for batch in batches:
        check_contract(batch, records, m.seq_len, m.pad_id, m.image_pad_id)
        with_images += len(batch.image_grid_thw) > 0
    assert with_images > 0
    seen = torch.cat([b.bin_ids for b in batches]).numpy()
    np.testing.assert_array_equal(seen, bin_order(m, 0, 0)[: len(seen)])


def test_formats_and_worker_counts_give_the_same_stream(dataset: Path) -> None:
    topo = Topology(dp_rank=1, dp_size=2)
    streams = []
    for fmt, workers in (("arrow", 0), ("wds", 0), ("arrow", 2), ("wds", 3)):
        ld = loader(dataset, topo, global_batch_size=8, shard_format=fmt, num_workers=workers, seed=3)
        streams.append(take(iter(ld), 9))
        ld.close()
    for other in streams[1:]:
        assert_same(streams[0], other)


def test_grid_of_ranks_covers_each_epoch(dataset: Path) -> None:
    m = load_manifest(str(dataset))
    global_batch = 4
    steps = m.num_bins // global_batch
    for dp, tp, pp in [(1, 1, 1), (2, 2, 1), (4, 1, 3), (2, 1, 2)]:
        per_rank = {}
        for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
            topo = Topology(dp_rank=d, dp_size=dp, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
            ld = loader(dataset, topo, micro_batch_size=1, global_batch_size=global_batch, num_epochs=1)
            per_rank[(d, t, p)] = list(ld)
            assert len(per_rank[(d, t, p)]) == steps * ld.micro_batches_per_step
        for (d, _t, _p), batches in per_rank.items():  # the TP and PP peers of a DP rank read its bins
            ref = per_rank[(d, 0, 0)]
            assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(batches, ref))
        ids = [torch.cat([b.bin_ids for b in per_rank[(d, 0, 0)]]).tolist() for d in range(dp)]
        assert sum(len(x) for x in ids) == steps * global_batch
        flat = list(itertools.chain(*ids))
        assert len(set(flat)) == len(flat)
        assert set(flat) == set(bin_order(m, 0, 0)[: steps * global_batch].tolist())


def dp_loaders(dataset: Path, dp: int, micro: int, **kw: Any) -> list[PackedLoader]:
    return [
        loader(dataset, Topology(dp_rank=r, dp_size=dp), micro_batch_size=micro, global_batch_size=8, **kw)
        for r in range(dp)
    ]


@pytest.mark.parametrize(("dp_before", "dp_after", "workers"), [(2, 2, 0), (4, 2, 0), (2, 4, 1)])
def test_resume_is_exact_also_across_dp_sizes(
    dataset: Path, dp_before: int, dp_after: int, workers: int
) -> None:
    m = load_manifest(str(dataset))
    total_steps = 2 * m.num_bins // 8 + 1  # crosses at least one epoch boundary
    reference = global_batches(dp_loaders(dataset, 1, 1, seed=11), total_steps)
    k = total_steps // 2
    first = dp_loaders(dataset, dp_before, 1, seed=11, num_workers=workers)
    head = global_batches(first, k)
    states = [ld.state_dict() for ld in first]
    assert all(s == states[0] for s in states)
    assert states[0]["bins_consumed"] == 8 * k
    assert states[0]["epoch"] == 8 * k // m.num_bins
    second = dp_loaders(dataset, dp_after, 2 if dp_after == 2 else 1, seed=11, num_workers=workers)
    for ld in second:
        ld.load_state_dict(states[0])
    tail = global_batches(second, total_steps - k)
    assert head + tail == reference
    flat = [x for batch in reference for x in batch]  # the stream is epoch 0's order, then epoch 1's, ...
    chained = np.concatenate([bin_order(m, 11, e) for e in range(3)])
    assert flat == chained[: len(flat)].tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_inside_a_step_is_exact(dataset: Path, workers: int) -> None:
    kw: dict[str, Any] = {"micro_batch_size": 1, "global_batch_size": 8, "seed": 4, "num_workers": workers}
    topo = Topology(dp_rank=1, dp_size=2)

    def ids(ld: PackedLoader, n: int) -> list[list[int]]:
        out = [b.bin_ids.tolist() for b in take(iter(ld), n)]
        ld.close()
        return out

    reference = ids(loader(dataset, topo, **kw), 10)
    first = loader(dataset, topo, **kw)
    head = ids(first, 6)  # step 0, then 2 of step 1's 4 micro-batches
    state = first.state_dict()
    assert state["bins_consumed"] == 8 and state["micro_batches_in_step"] == 2
    second = loader(dataset, topo, **kw)
    second.load_state_dict(state)
    assert head + ids(second, 4) == reference
    for other in (Topology(dp_rank=0, dp_size=1), Topology(dp_rank=0, dp_size=4)):
        with pytest.raises(ValueError, match="2 micro-batches into a step"):
            loader(dataset, other, **kw).load_state_dict(state)


def test_state_mismatch_is_refused(dataset: Path) -> None:
    ld = loader(dataset, Topology(dp_rank=0, dp_size=1), seed=1)
    state = ld.state_dict()
    other = loader(dataset, Topology(dp_rank=0, dp_size=1), seed=2)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    bigger = loader(dataset, Topology(dp_rank=0, dp_size=1), global_batch_size=8, seed=1)
    with pytest.raises(ValueError, match="global_batch_size"):
        bigger.load_state_dict(state)


def test_metrics_count_wait_and_bytes(dataset: Path) -> None:
    ld = loader(dataset, Topology(dp_rank=0, dp_size=1), num_workers=2, num_epochs=1)
    n = sum(1 for _ in ld)
    metrics = ld.metrics()
    assert metrics["micro_batches"] == n
    assert metrics["data_wait_s"] > 0
    assert metrics["bytes_read"] > 0


def test_bad_arguments_are_explained(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="divisible"):
        loader(dataset, Topology(dp_rank=0, dp_size=3), micro_batch_size=1, global_batch_size=4)
    with pytest.raises(FileNotFoundError, match="no packed dataset"):
        loader(tmp_path, Topology(dp_rank=0, dp_size=1))
    with pytest.raises(ValueError, match="download_concurrency must be >= 1"):
        loader(dataset, Topology(dp_rank=0, dp_size=1), download_concurrency=0)


def test_dead_worker_is_an_error_not_a_hang(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from mmpack.dataloader import worker

    real = worker.Producer.produce

    def produce_or_die(self: worker.Producer, k: int, **kw: Any) -> dict[str, Any]:
        if k == 3:
            os._exit(3)  # a worker killed from outside (OOM killer, segfault) sends nothing
        return real(self, k, **kw)

    monkeypatch.setattr(worker.Producer, "produce", produce_or_die)  # inherited by forked workers
    ld = loader(dataset, Topology(dp_rank=0, dp_size=1), num_workers=2)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        take(iter(ld), 10)
    # The dying worker may take its last unsent batch with it; the state never counts a batch not handed out.
    assert ld.state_dict()["bins_consumed"] in (0, 4)


def test_shard_with_other_bin_count_than_manifest_fails_naming_it(dataset: Path) -> None:
    from dataclasses import replace

    from mmpack.dataloader import ShardError, ShardStore, StorageConfig
    from mmpack.dataloader.worker import ReaderPool

    m = load_manifest(str(dataset))
    wrong = replace(m.shards[0], bins=m.shards[0].bins + 1)
    pool = ReaderPool(
        replace(m, shards=(wrong, *m.shards[1:])), ShardStore(StorageConfig(root=str(dataset))), 2
    )
    with pytest.raises(ShardError, match=f"{wrong.path} holds {wrong.bins - 1} bins, the manifest says"):
        pool.read_bin(0)
    pool.close()
