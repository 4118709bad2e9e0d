"""The rank-aware packed loader: an iterable of micro-batches with exact, DP-size-independent resume."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmpack.dataloader.balance import BALANCE_MODES, ComputeBalance, compute_balance
from mmpack.dataloader.collate import CollateConfig
from mmpack.dataloader.manifest import Manifest, load_manifest
from mmpack.dataloader.order import DEFAULT_SHARD_WINDOW, BatchPlan, BinSplit, StreamOrder
from mmpack.dataloader.pool import run_in_process, run_workers, take_batch
from mmpack.dataloader.storage import ShardStore, StorageConfig
from mmpack.dataloader.topology import Topology
from mmpack.dataloader.worker import ProducerSpec
from mmpack.packing.batch import MicroBatch, PositionRule
from mmpack.packing.cost import CostModel

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1


@dataclass(kw_only=True, frozen=True)
class LoaderConfig:
    """Batch geometry and parallelism of one loader (see `build_loader`)."""

    micro_batch_size: int
    global_batch_size: int
    seed: int = 0
    num_workers: int = 2
    prefetch_shards: int = 4
    prefetch_batches: int = 2
    handover_batches: int = 4  # small micro-batches a worker sends per message (see pool.run_workers)
    shard_window: int = DEFAULT_SHARD_WINDOW
    num_epochs: int | None = None
    start_method: str | None = None
    balance: str = (
        "none"  # "compute": bins of each global batch laid out over ranks by cost (mmpack.dataloader.balance)
    )

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {self.balance!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_workers < 0 or self.prefetch_shards < 0 or self.prefetch_batches < 1:
            raise ValueError("num_workers and prefetch_shards must be >= 0 and prefetch_batches >= 1")
        if self.handover_batches < 1:
            raise ValueError(f"handover_batches must be >= 1, got {self.handover_batches}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (endless), got {self.num_epochs}")


class PackedLoader:
    """Iterates this rank's micro-batches from the current state.

    `state_dict()` is (epoch, bins consumed in whole global batches, micro-batches into the current step).

    It yields `micro_batches_per_step` micro-batches (`mmpack.packing.batch.MicroBatch` of tensors) per step,
    those of the topology's DP rank: a loader is built on the rank of each DP replica that reads, and the
    trainer hands the batches to that replica's TP and PP peers (`mmpack.trainer.shared_batches`, the one
    owner of that distribution).
    The state counts the micro-batches handed out, so any checkpoint resumes exactly: one taken between steps
    with any DP size, one taken inside a step with the same DP size and micro-batch size.
    """

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        topology: Topology,
        config: LoaderConfig,
        storage: StorageConfig,
        collate: CollateConfig,
        balance: ComputeBalance | None = None,
        split: BinSplit | None = None,
    ) -> None:
        self.root, self.manifest, self.topology, self.config = root, manifest, topology, config
        self.split = split
        self.plan = BatchPlan(
            global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size,
            dp_size=topology.dp_size,
        )
        self.spec = ProducerSpec(
            manifest=manifest,
            topology=topology,
            plan=self.plan,
            seed=config.seed,
            shard_window=config.shard_window,
            storage=storage,
            collate=collate,
            prefetch_shards=config.prefetch_shards,
            balance=balance,
            split=split,
        )
        if manifest.num_bins == 0:
            raise ValueError(f"packed dataset {root} has no bins")
        # bins of the stream's epoch (all, or --split's part): checks that the part is not empty
        self.num_bins = StreamOrder(manifest, config.seed, split=split).num_bins
        ShardStore(storage)  # a cache folder that cannot be written fails here, in one line, not in a worker
        self._micro_batches_done = 0  # handed out by this rank since the stream start
        self._data_wait_s = 0.0
        self._micro_batches = 0
        self._worker_metrics: dict[int, dict[str, int]] = {}
        self._active: Iterator[Any] | None = None

    # -- geometry -----------------------------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        return self.plan.micro_batches_per_step

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch (the stream chains epochs, so none are dropped)."""
        return self.num_bins // self.plan.global_batch_size

    @property
    def step(self) -> int:
        return self._micro_batches_done // self.micro_batches_per_step

    def _end_step(self) -> int | None:
        if self.config.num_epochs is None:
            return None
        return self.config.num_epochs * self.num_bins // self.plan.global_batch_size

    # -- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        n = self.num_bins
        step, in_step = divmod(self._micro_batches_done, self.micro_batches_per_step)
        consumed = step * self.plan.global_batch_size  # whole global batches
        return {
            "version": STATE_VERSION,
            "epoch": consumed // n,
            "bins_consumed_in_epoch": consumed % n,
            "bins_consumed": consumed,
            "micro_batches_in_step": in_step,
            "micro_batch_size": self.plan.micro_batch_size,
            "dp_size": self.plan.dp_size,
            "seed": self.config.seed,
            "global_batch_size": self.plan.global_batch_size,
            "shard_window": self.config.shard_window,
            "balance": self.config.balance,
            "num_bins": n,
            "manifest_fingerprint": self.manifest.fingerprint,
            "split": None if self.split is None else self.split.describe(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from `state` (seed, global batch and dataset must match; DP size too inside a step)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "shard_window", "num_bins", "manifest_fingerprint", "split"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r}, this loader has {mine[key]!r}; "
                    "resuming would change the data stream"
                )
        consumed = int(state["epoch"]) * self.num_bins + int(state["bins_consumed_in_epoch"])
        if consumed != int(state["bins_consumed"]) or consumed % self.plan.global_batch_size:
            raise ValueError(f"inconsistent loader state {state}")
        in_step = int(state.get("micro_batches_in_step", 0))  # older states lack it (saved between steps)
        if in_step:
            geometry = (state["micro_batch_size"], state["dp_size"], state.get("balance", "none"))
            if geometry != (mine["micro_batch_size"], mine["dp_size"], mine["balance"]):
                raise ValueError(
                    f"loader state was saved {in_step} micro-batches into a step with (micro_batch_size, "
                    f"dp_size, balance)={geometry}, this loader has "
                    f"{(mine['micro_batch_size'], mine['dp_size'], mine['balance'])}; "
                    "only the same ones continue a partly consumed step exactly (or save between steps)"
                )
            if not 0 < in_step < self.micro_batches_per_step:
                raise ValueError(f"inconsistent loader state {state}")
        self.close()
        self._micro_batches_done = (
            consumed // self.plan.global_batch_size * self.micro_batches_per_step + in_step
        )

    # -- metrics ------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Per-rank counters for the trainer's log line: data wait, bytes read, cache hits, ..."""
        totals: dict[str, float] = {"data_wait_s": self._data_wait_s, "micro_batches": self._micro_batches}
        for snapshot in self._worker_metrics.values():
            for key, value in snapshot.items():
                totals[key] = totals.get(key, 0) + value
        return totals

    # -- iteration ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatch[torch.Tensor]]:
        self.close()
        it = self._iterate()
        self._active = it
        return it

    def close(self) -> None:
        """Stops worker processes of an unfinished iteration."""
        if self._active is not None:
            active, self._active = self._active, None
            active.close()  # type: ignore[attr-defined]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _iterate(self) -> Iterator[MicroBatch[torch.Tensor]]:
        m = self.micro_batches_per_step
        k_start = self._micro_batches_done
        end_step = self._end_step()
        k_end = None if end_step is None else end_step * m
        source: Iterator[list[Any]]
        if self.config.num_workers == 0:
            source = run_in_process(self.spec, k_start, k_end, metrics=self._worker_metrics)
        else:
            source = run_workers(
                self.spec,
                k_start,
                k_end,
                num_workers=self.config.num_workers,
                prefetch_batches=self.config.prefetch_batches,
                handover_batches=self.config.handover_batches,
                start_method=self.config.start_method,
                metrics=self._worker_metrics,
            )
        try:
            for pair in source:
                self._data_wait_s += pair[1]
                self._micro_batches += 1
                self._micro_batches_done += 1
                yield take_batch(pair)
        finally:
            source.close()  # type: ignore[attr-defined]


def build_loader(
    path: str,
    *,
    topology: Topology,
    micro_batch_size: int,
    global_batch_size: int,
    seed: int = 0,
    num_workers: int = 2,
    cache_dir: str | None = None,
    cache_limit_bytes: int = 16 << 30,
    prefetch_shards: int = 4,
    storage_options: dict[str, Any] | None = None,
    build_attention_mask: bool = False,
    num_epochs: int | None = None,
    shard_format: str | None = None,
    shard_window: int = DEFAULT_SHARD_WINDOW,
    prefetch_batches: int = 2,
    handover_batches: int = 4,
    start_method: str | None = None,
    max_attempts: int = 6,
    download_concurrency: int = 4,
    balance: str = "none",
    cost_model: CostModel | None = None,
    position_rule: PositionRule | None = None,
    split: tuple[tuple[float, float, float], int, int] | None = None,
) -> PackedLoader:
    """A loader of the packed dataset at `path` (folder or fsspec URL) for the rank `topology`.

    `num_epochs=None` streams epochs endlessly (Megatron style, stop after train-iters); otherwise the
    loader stops after the last whole global batch of `num_epochs` epochs. `shard_format` picks "arrow" or
    "wds" shards when the dataset has both (default: arrow). `download_concurrency`: shard downloads each
    worker keeps in flight (remote datasets). `balance="compute"` lays out each global batch's bins over DP
    ranks and micro-batches so per-rank cost (`cost_model`, default `mmpack.packing.cost.DEFAULT_COST_MODEL`) is even;
    the bins of each global batch stay the same, so resume (also with another DP size) stays exact.
    `handover_batches`: up to this many small micro-batches travel from a worker in one message (fewer
    wake-ups of the consumer); each worker runs up to `prefetch_batches + handover_batches` small
    micro-batches ahead, or `prefetch_batches` large ones (together over 4 MiB per message), the one being
    made included. `position_rule`: the model family's positions (`mmpack.packing.batch.PositionRule`, e.g.
    `mmpack.packing.mrope.MRopeRule`), computed in the loader workers; None: positions restart at 0 per sample.
    `split`: (weights, part, split seed) of Megatron-LM's --split: the loader reads only that part's bins
    (`mmpack.dataloader.order.split_bins`; 0 train, 1 valid, 2 test; the same split seed splits alike).
    """
    manifest = load_manifest(
        path, storage_options=storage_options, shard_format=shard_format, max_attempts=max_attempts
    )
    config = LoaderConfig(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        seed=seed,
        num_workers=num_workers,
        prefetch_shards=prefetch_shards,
        prefetch_batches=prefetch_batches,
        handover_batches=handover_batches,
        shard_window=shard_window,
        num_epochs=num_epochs,
        start_method=start_method,
        balance=balance,
    )
    storage = StorageConfig(
        root=path,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
        storage_options=storage_options,
        max_attempts=max_attempts,
        download_concurrency=download_concurrency,
    )
    collate = CollateConfig.from_manifest(
        manifest, build_attention_mask=build_attention_mask, position_rule=position_rule
    )
    costs = compute_balance(manifest, storage, cost_model) if balance == "compute" else None
    bin_split = None if split is None else BinSplit(tuple(split[0]), split[1], split[2])  # type: ignore[arg-type]
    return PackedLoader(path, manifest, topology, config, storage, collate, balance=costs, split=bin_split)
