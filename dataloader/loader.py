"""The rank-aware packed loader: an iterable of micro-batches with exact, DP-size-independent resume."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack.dataloader.balance import BALANCE_MODES, ComputeBalance, compute_balance
from mmpack.dataloader.blend import BlendedStream, BlendStage
from mmpack.dataloader.collate import CollateConfig
from mmpack.dataloader.manifest import DatasetNotFoundError, Manifest, load_manifest
from mmpack.dataloader.mixture import Mixture, MixtureLike, as_mixture, check_sources, vision_source
from mmpack.dataloader.order import DEFAULT_SHARD_WINDOW, BatchPlan, BinSplit, StreamOrder
from mmpack.dataloader.pool import run_in_process, run_workers, take_batch
from mmpack.dataloader.raw_source import (
    RawAnchor,
    RawBins,
    RawSpec,
    RawStream,
    is_raw_source,
    mixture_manifest,
    raw_bin_costs,
)
from mmpack.dataloader.storage import ShardStore, StorageConfig
from mmpack.dataloader.topology import Topology
from mmpack.dataloader.worker import ProducerSpec, SourceSpec
from mmpack.packing.batch import MicroBatch, PositionRule
from mmpack.packing.cost import DEFAULT_COST_MODEL, CostModel

if TYPE_CHECKING:
    import torch

STATE_VERSION = 2  # 2 added sources, blend_stage and source_positions (mixtures); version 1 still loads


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
        mixture: Mixture | None = None,
        sources: tuple[SourceSpec, ...] = (),
        split: BinSplit | None = None,
    ) -> None:
        """`mixture` and `sources` (one `SourceSpec` per source, `manifest`/`storage` the first's): a blend."""
        self.root, self.manifest, self.topology, self.config = root, manifest, topology, config
        self.mixture = mixture
        self.sources = sources or (SourceSpec(manifest=manifest, storage=storage),)
        self.split = split
        self.plan = BatchPlan(
            global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size,
            dp_size=topology.dp_size,
        )
        if manifest.num_bins == 0:
            raise ValueError(f"packed dataset {root} has no bins")
        # bins of each source's epoch (all, or --split's part: StreamOrder refuses an empty part)
        sizes = [self._source_order(s.manifest).num_bins for s in self.sources]
        self.shares = mixture.shares(sizes) if mixture is not None else (1.0,)
        self.epoch_bins = mixture.epoch_bins(sizes) if mixture is not None else sizes[0]
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
            sources=sources if mixture is not None else (),
            weights=self.shares if mixture is not None else (),
            stage=BlendStage(offsets=(0,) * len(self.sources)) if mixture is not None else None,
            split=split,
        )
        for source in self.sources:  # a cache folder that cannot be written fails here, in one line
            if source.raw is None:  # a raw source stores nothing
                ShardStore(source.storage)
        self._micro_batches_done = 0  # handed out by this rank since the stream start
        self._data_wait_s = 0.0
        self._micro_batches = 0
        self._worker_metrics: dict[int, dict[str, int]] = {}
        self._active: Iterator[Any] | None = None

    @property
    def source_names(self) -> tuple[str, ...]:
        """Each source's name, in `source_ids` order."""
        if self.mixture is None:
            return (self.root.rstrip("/").rsplit("/", 1)[-1] or self.root,)
        return self.mixture.names

    def _source_order(self, manifest: Manifest) -> StreamOrder:
        return StreamOrder(
            manifest, self.config.seed, shard_window=self.config.shard_window, split=self.split
        )

    def source_positions(self, position: int) -> list[int]:
        """Bins each source has given once the global stream reaches `position`."""
        if self.spec.stage is None:
            return [position]
        streams = [self._source_order(s.manifest) for s in self.sources]
        return (
            BlendedStream(streams, self.shares, self.config.seed, self.spec.stage)
            .source_positions(position)
            .tolist()
        )

    # -- geometry -----------------------------------------------------------------------------------------
    @property
    def micro_batches_per_step(self) -> int:
        return self.plan.micro_batches_per_step

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch (the stream chains epochs, so none are dropped)."""
        return self.epoch_bins // self.plan.global_batch_size

    @property
    def step(self) -> int:
        return self._micro_batches_done // self.micro_batches_per_step

    def _end_step(self) -> int | None:
        if self.config.num_epochs is None:
            return None
        return self.config.num_epochs * self.epoch_bins // self.plan.global_batch_size

    # -- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        n = self.epoch_bins
        step, in_step = divmod(self._micro_batches_done, self.micro_batches_per_step)
        consumed = step * self.plan.global_batch_size  # whole global batches
        stage = self.spec.stage or BlendStage(offsets=(0,))
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
            "manifest_fingerprint": self._fingerprint(),
            "sources": [
                {
                    "name": name,
                    "manifest_fingerprint": s.manifest.fingerprint,
                    "num_bins": s.manifest.num_bins,
                    "share": share,
                }
                for name, s, share in zip(self.source_names, self.sources, self.shares)
            ],
            "blend_stage": {"origin": stage.origin, "offsets": list(stage.offsets)},
            "source_positions": self.source_positions(consumed),
            "split": None if self.split is None else self.split.describe(),
        }

    def _fingerprint(self) -> str:
        if self.mixture is None:
            return self.manifest.fingerprint
        parts = [f"{s.manifest.fingerprint}:{share!r}" for s, share in zip(self.sources, self.shares)]
        return hashlib.sha256(",".join(parts).encode()).hexdigest()[:16]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from `state` (seed, global batch and dataset must match; DP size too inside a step).

        A mixture also continues a state of other weights or sources (the next stage of a curriculum, saved
        between steps): the new shares apply from there, each source continuing where it stopped."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"loader state version {state.get('version')} is not 1 or {STATE_VERSION}")
        mine = self.state_dict()
        same_data = all(state[k] == mine[k] for k in ("num_bins", "manifest_fingerprint"))
        keys = ("seed", "global_batch_size", "shard_window", "split") + (
            () if self.mixture is not None else ("num_bins", "manifest_fingerprint")
        )
        for key in keys:
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)!r}, this loader has {mine[key]!r}; "
                    "resuming would change the data stream"
                )
        consumed = int(state["epoch"]) * int(state["num_bins"]) + int(state["bins_consumed_in_epoch"])
        if consumed != int(state["bins_consumed"]) or consumed % self.plan.global_batch_size:
            raise ValueError(f"inconsistent loader state {state}")
        in_step = int(state.get("micro_batches_in_step", 0))  # older states lack it (saved between steps)
        if in_step:
            self._check_in_step(state, mine, in_step, same_data)
        self.close()
        if self.mixture is not None:
            self.spec = dataclasses.replace(self.spec, stage=self._stage_from(state, consumed, same_data))
        self._micro_batches_done = (
            consumed // self.plan.global_batch_size * self.micro_batches_per_step + in_step
        )

    def _check_in_step(
        self, state: dict[str, Any], mine: dict[str, Any], in_step: int, same_data: bool
    ) -> None:
        geometry = (state["micro_batch_size"], state["dp_size"], state.get("balance", "none"))
        if geometry != (mine["micro_batch_size"], mine["dp_size"], mine["balance"]) or not same_data:
            raise ValueError(
                f"loader state was saved {in_step} micro-batches into a step with (micro_batch_size, "
                f"dp_size, balance)={geometry}, this loader has "
                f"{(mine['micro_batch_size'], mine['dp_size'], mine['balance'])}; "
                "only the same ones (and the same data) continue a partly consumed step exactly (or save "
                "between steps)"
            )
        if not 0 < in_step < self.micro_batches_per_step:
            raise ValueError(f"inconsistent loader state {state}")

    def _stage_from(self, state: dict[str, Any], consumed: int, same_data: bool) -> BlendStage:
        """The blend stage that continues `state`: its own (same mixture), or a new one from `consumed` with
        each source where the state left it (a source the state does not know starts at its beginning)."""
        if same_data and "blend_stage" in state:
            saved = state["blend_stage"]
            return BlendStage(origin=int(saved["origin"]), offsets=tuple(int(o) for o in saved["offsets"]))
        if "sources" in state:
            seen = {
                s["manifest_fingerprint"]: int(p) for s, p in zip(state["sources"], state["source_positions"])
            }
        else:  # version 1: one dataset
            seen = {state["manifest_fingerprint"]: consumed}
        offsets = tuple(seen.get(s.manifest.fingerprint, 0) for s in self.sources)
        return BlendStage(origin=consumed, offsets=offsets)

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


class OnlineLoader(PackedLoader):
    """`PackedLoader` of a raw source packed online (`mmpack.dataloader.raw_source`): the same iteration, rank
    assignment, balance and collation; its state holds positions: the global position `bins_consumed` and its
    place in the stream (`epoch`, `buffer_slot`, `bin_in_buffer`), from which a resume walks on without
    packing the buffers before it."""

    def __init__(
        self,
        raw: RawSpec,
        manifest: Manifest,
        topology: Topology,
        config: LoaderConfig,
        collate: CollateConfig,
    ) -> None:
        self.root, self.manifest, self.topology, self.config = raw.source.name, manifest, topology, config
        self.mixture, self.split, self.shares = None, None, (1.0,)
        self.plan = BatchPlan(
            global_batch_size=config.global_batch_size,
            micro_batch_size=config.micro_batch_size,
            dp_size=topology.dp_size,
        )
        storage = StorageConfig(root=raw.source.name)  # no shards: nothing is stored
        self.sources = (SourceSpec(manifest=manifest, storage=storage),)
        self.epoch_bins = 0  # unknown until every buffer of an epoch is packed
        self.spec = ProducerSpec(
            manifest=manifest,
            topology=topology,
            plan=self.plan,
            seed=config.seed,
            shard_window=config.shard_window,
            storage=storage,
            collate=collate,
            prefetch_shards=0,
            raw=raw,
        )
        self._counts: dict[int, int] = {}  # bins of each buffer this process has packed (for `state_dict`)
        self._walk: RawStream | None = None
        self._micro_batches_done = 0
        self._data_wait_s = 0.0
        self._micro_batches = 0
        self._worker_metrics = {}
        self._active = None

    @property
    def steps_per_epoch(self) -> int:
        raise ValueError(f"raw source {self.root}: the steps of an epoch are known only once it is packed")

    def _end_step(self) -> int | None:
        return None

    def source_positions(self, position: int) -> list[int]:
        return [position]

    def _stream(self) -> RawStream:
        """This process's walk of the stream (bin counts only), for the state."""
        if self._walk is None:
            raw = self.spec.raw
            assert raw is not None
            source = raw.source

            def count(b: int) -> int:
                if b not in self._counts:
                    self._counts[b] = source.pack_buffer(b).num_bins
                return self._counts[b]

            self._walk = RawStream(source.num_buffers, self.config.seed, raw.anchor, count, name=source.name)
        return self._walk

    def _geometry(self) -> dict[str, Any]:
        raw = self.spec.raw
        assert raw is not None
        return {
            "version": STATE_VERSION,
            "kind": "raw",
            "micro_batch_size": self.plan.micro_batch_size,
            "dp_size": self.plan.dp_size,
            "seed": self.config.seed,
            "global_batch_size": self.plan.global_batch_size,
            "balance": self.config.balance,
            "source_fingerprint": raw.source.fingerprint,
            "num_buffers": raw.source.num_buffers,
            "split": None if raw.source.split is None else raw.source.split.describe(),
        }

    def state_dict(self) -> dict[str, Any]:
        step, in_step = divmod(self._micro_batches_done, self.micro_batches_per_step)
        consumed = step * self.plan.global_batch_size
        at = self._stream().locate(consumed)
        return self._geometry() | {
            "epoch": at.epoch,
            "buffer_slot": at.slot,
            "bin_in_buffer": at.offset,
            "bins_consumed": consumed,
            "micro_batches_in_step": in_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from `state` (of the same records, options, seed and global batch; the same micro-batch and
        DP sizes too when it was saved inside a step)."""
        mine = self._geometry()
        if state.get("kind") != "raw":
            raise ValueError(
                f"loader state is of a packed dataset, this loader reads raw source {self.root}; resume it "
                "from a state of the same raw source"
            )
        for key in ("version", "seed", "global_batch_size", "split", "source_fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)!r}, this loader has {mine[key]!r}; "
                    "resuming would change the data stream"
                )
        consumed = int(state["bins_consumed"])
        if consumed < 0 or consumed % self.plan.global_batch_size:
            raise ValueError(f"inconsistent loader state {state}")
        in_step = int(state.get("micro_batches_in_step", 0))
        if in_step:
            self._check_in_step(state, mine, in_step, True)
        self.close()
        anchor = RawAnchor(
            position=consumed,
            epoch=int(state["epoch"]),
            slot=int(state["buffer_slot"]),
            offset=int(state["bin_in_buffer"]),
        )
        raw = self.spec.raw
        assert raw is not None
        self.spec = dataclasses.replace(self.spec, raw=dataclasses.replace(raw, anchor=anchor))
        self._walk = None
        self._micro_batches_done = (
            consumed // self.plan.global_batch_size * self.micro_batches_per_step + in_step
        )


def rejects_file(rejects_dir: str | None, topology: Topology) -> str | None:
    """Where this DP rank's loader writes the rejected raw records (`rejects-dp<rank>.jsonl`), None: nowhere."""
    if rejects_dir is None:
        return None
    os.makedirs(rejects_dir, exist_ok=True)
    return os.path.join(rejects_dir, f"rejects-dp{topology.dp_rank}.jsonl")


def build_online_loader(
    source: RawBins,
    *,
    topology: Topology,
    config: LoaderConfig,
    build_attention_mask: bool = False,
    position_rule: PositionRule | None = None,
    strict_data: bool = False,
    cost_model: CostModel | None = None,
    rejects_dir: str | None = None,
) -> OnlineLoader:
    """`build_loader` of a raw source (see there)."""
    if config.num_epochs is not None:
        raise ValueError(
            f"raw source {source.name}: num_epochs is not supported for raw sources (an epoch's bins are known "
            "only once all of it is packed); stop after a number of steps instead"
        )
    manifest = Manifest.from_model(source.dataset)
    collate = dataclasses.replace(
        CollateConfig.from_manifest(
            manifest, build_attention_mask=build_attention_mask, position_rule=position_rule
        ),
        strict_data=strict_data,
    )
    raw = RawSpec(
        source=source,
        rejects_path=rejects_file(rejects_dir, topology),
        cost_model=(cost_model or DEFAULT_COST_MODEL) if config.balance == "compute" else None,
    )
    return OnlineLoader(raw, manifest, topology, config, collate)


def build_loader(
    path: MixtureLike | RawBins,
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
    strict_data: bool = False,
    rejects_dir: str | None = None,
) -> PackedLoader:
    """A loader of the packed dataset at `path` (folder or fsspec URL) for the rank `topology`, or of a
    mixture: a list of `(weight, path)` pairs or a `mmpack.dataloader.mixture.Mixture` (each source with its own
    storage options; `storage_options` is the default). Every micro-batch's `source_ids` says each row's source.

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
    A sample whose media cannot be decoded is dropped from its bin (labels masked, media blank; the batch's
    `dropped` names it), or with `strict_data` stops the loader (`collate.BadSampleError`, one line).

    A mixture may hold raw sources beside packed ones (`[(0.7, "/data/packed"), (0.3, raw_source(...))]`, or a
    `MixtureSource` with `raw=`): each is packed whole in one buffer before the loader starts
    (`raw_source.mixture_manifest`: its buffer size must hold all its records), so its bin count is known and
    its shares, epochs and state are those of a packed source; not with `split`.

    `path` may also be a raw source (`mmpack.dataloader.raw_source.RawBins`, made by
    `mmpack.offline_packing.online.raw_source(inputs, model=..., image_root=..., buffer_size=..., seq_len=...)`):
    its records are packed online, buffer by buffer, by the offline job's length model and kernels, and its
    bins go through the same rank assignment, balance and collation (an `OnlineLoader`). Records the offline
    job would reject are skipped, counted in `metrics()` (`raw_samples_rejected`, `raw_rejected.<reason>`)
    and, with `rejects_dir`, written to `<rejects_dir>/rejects-dp<rank>.jsonl`. With `split`, the records (not
    the bins) are divided before packing, each by a seeded hash of its file and index
    (`mmpack.offline_packing.online.record_parts`), and each part packs its own. Not with `num_epochs` yet.
    """
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
    if is_raw_source(path):
        if split is not None:  # the records are divided before packing: each part packs its own
            path = path.split_records(BinSplit(tuple(split[0]), split[1], split[2]))  # type: ignore[arg-type]
        return build_online_loader(
            path,
            topology=topology,
            config=config,
            build_attention_mask=build_attention_mask,
            position_rule=position_rule,
            strict_data=strict_data,
            cost_model=cost_model,
            rejects_dir=rejects_dir,
        )
    mixture = as_mixture(path)  # type: ignore[arg-type]

    def source(root: str, options: dict[str, Any] | None) -> SourceSpec:
        manifest = load_manifest(
            root, storage_options=options, shard_format=shard_format, max_attempts=max_attempts
        )
        storage = StorageConfig(
            root=root,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
            storage_options=options,
            max_attempts=max_attempts,
            download_concurrency=download_concurrency,
        )
        return SourceSpec(manifest=manifest, storage=storage)

    def raw_part(raw: RawBins | None, name: str) -> SourceSpec:  # packed whole, in one buffer
        if raw is None:
            raise ValueError(
                f"mixture source {name!r} is raw records (kind: raw) not opened: give it as MixtureSource(raw="
                "mmpack.offline_packing.online.raw_source(...)) (the trainer opens it with --online-packing)"
            )
        if split is not None:
            raise ValueError(
                f"mixture source {name!r} is raw records: --split is not supported in a mixture with raw sources "
                "yet (a raw source alone divides its records; a packed mixture its bins)"
            )
        spec = RawSpec(source=raw, rejects_path=rejects_file(rejects_dir, topology))
        return SourceSpec(manifest=mixture_manifest(raw), storage=StorageConfig(root=raw.name), raw=spec)

    sources: tuple[SourceSpec, ...]
    if mixture is None:
        assert isinstance(path, str)
        sources = (source(path, storage_options),)
    else:
        sources = tuple(
            raw_part(s.raw, name)
            if s.kind == "raw"
            else _load_source(source, s.path, name, s.storage_options or storage_options)
            for s, name in zip(mixture.sources, mixture.names)
        )
        check_sources(mixture.names, [s.manifest for s in sources])
    first = sources[0]
    collates = tuple(
        CollateConfig.from_manifest(
            s.manifest, build_attention_mask=build_attention_mask, position_rule=position_rule
        )
        for s in sources
    )
    collate = dataclasses.replace(collates[0], strict_data=strict_data)
    if mixture is not None:  # each bin decoded by its own source's rule; the shared fields an image source's
        shared = collates[vision_source([s.manifest for s in sources])]
        collate = dataclasses.replace(shared, sources=collates, strict_data=strict_data)
    costs = None
    if balance == "compute":
        parts = [
            raw_bin_costs(s.raw.source, cost_model)
            if s.raw is not None
            else compute_balance(s.manifest, s.storage, cost_model).bin_costs
            for s in sources
        ]
        costs = ComputeBalance(np.concatenate(parts))
    bin_split = None if split is None else BinSplit(tuple(split[0]), split[1], split[2])  # type: ignore[arg-type]
    if mixture is None:
        return PackedLoader(
            first.storage.root,
            first.manifest,
            topology,
            config,
            first.storage,
            collate,
            balance=costs,
            split=bin_split,
        )
    root = " ".join(f"{name}={s.path}" for s, name in zip(mixture.sources, mixture.names))
    return PackedLoader(
        root,
        first.manifest,
        topology,
        config,
        first.storage,
        collate,
        balance=costs,
        mixture=mixture,
        sources=sources,
        split=bin_split,
    )


def _load_source(load: Any, path: str, name: str, options: dict[str, Any] | None) -> SourceSpec:
    """One mixture source, an error naming it where it cannot be read."""
    try:
        return load(path, options)  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        kind = (
            DatasetNotFoundError
            if isinstance(e, DatasetNotFoundError)
            else FileNotFoundError
            if isinstance(e, FileNotFoundError)
            else ValueError
            if isinstance(e, ValueError)
            else OSError
        )
        raise kind(f"mixture source {name!r} ({path}): {e}") from e
