"""Readers and comparisons over packed datasets and loader streams, shared by the loader tests: two streams of
micro-batches compared field by field, every bin of a dataset read straight from its shards, the global
batches of DP ranks run in lockstep."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmpack.dataloader import load_manifest
from mmpack.dataloader.readers import open_shard_reader

if TYPE_CHECKING:
    from mmpack.dataloader import PackedLoader


def assert_same(a: list[Any], b: list[Any]) -> None:
    """Two streams of micro-batches are equal, field by field."""
    assert len(a) == len(b) > 0
    for one, other in zip(a, b):
        x, y = dict(one.items()), dict(other.items())
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def take(it: Iterator[Any], n: int) -> list[Any]:
    return list(itertools.islice(it, n))


def all_records(path: Path, fmt: str = "arrow") -> dict[int, dict[str, Any]]:
    """Every bin of the dataset read straight from the shards, by global bin id."""
    m = load_manifest(str(path), shard_format=fmt)
    out = {}
    for s in m.shards:
        r = open_shard_reader(str(path / s.path), s.format, label=s.path)
        for i in range(s.bins):
            out[s.first_bin + i] = r.read(i)
        r.close()
    return out


def global_batches(loaders: list[PackedLoader], steps: int) -> list[list[int]]:
    """Runs DP ranks in lockstep; returns each step's global batch (bin ids in rank order)."""
    its = [iter(ld) for ld in loaders]
    out = []
    for _ in range(steps):
        batch: list[int] = []
        for ld, it in zip(loaders, its):
            for b in take(it, ld.micro_batches_per_step):
                batch += b.bin_ids.tolist()
        out.append(batch)
    for ld in loaders:
        ld.close()
    return out
