"""Raw sources: bins packed online from raw records, read behind the same seam as packed shards.

The loader reads a packed dataset's bins by id from its shards (`worker.Producer`); a raw source gives them
from its packing buffers instead (`RawProducer`), and everything after the bins (rank assignment, compute
balance, collation, `MicroBatch`) is the same. Reading, counting and packing the records is the source's
(`mmpack.offline_packing.online.RawSource`, the offline job's own functions): the loader takes any object that
meets `RawBins`, so this layer never imports the offline job.

The order is a pure function of (seed, epoch, position): epoch e takes the buffers in the order
`rng([seed, e]).permutation(num_buffers)`, and the bins of buffer b in `rng([seed, e, b]).permutation(its
bins)`; the stream chains them, epoch after epoch, and global batch s is positions [s*G, (s+1)*G) as for
packed data. A bin's id is `buffer << 32 | its index in the buffer's packing`. Where position p falls is found
by walking buffers from an anchor (a position whose epoch, buffer slot and bin within the buffer are known:
the stream start, or a resumed state's), packing each buffer on the way, so a loader state holds positions,
not samples.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import numpy as np

from mmpack.dataloader.balance import ComputeBalance
from mmpack.dataloader.collate import collate_bins
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.order import BinSplit, micro_batch_bins
from mmpack.dataloader.readers import BinRecord
from mmpack.packing.batch import MicroBatch
from mmpack.packing.cost import DEFAULT_COST_MODEL, CostModel, add_video_features, bin_cost_features
from mmpack.packing.manifest import Manifest as DatasetManifest
from mmpack.packing.manifest import ShardEntry

BIN_BITS = 32  # a raw bin id: buffer << BIN_BITS | bin index in the buffer
KEEP_BEHIND = 1 << 16  # stream positions a walk keeps behind the furthest asked for (a worker asks in order)


class PackedBuffer(Protocol):
    """The bins of one packing buffer (`mmpack.offline_packing.online.PackedBuffer`)."""

    @property
    def num_bins(self) -> int: ...

    @property
    def rejects(self) -> tuple[dict, ...]:
        """One row per record not packed: the offline job's reject row."""
        ...

    @property
    def samples_read(self) -> int: ...

    def record(self, j: int) -> BinRecord:
        """Bin j as a shard reader returns a bin."""
        ...

    def bin_features(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq_lens, image grids [n, 3], video grids [n, 3]) of bin j: what its compute cost is of."""
        ...


class RawBins(Protocol):
    """A raw source as the loader reads it (picklable: it travels to the loader's workers)."""

    @property
    def name(self) -> str: ...

    @property
    def fingerprint(self) -> str:
        """Of the records, the length model, the packing options and the buffer size."""
        ...

    @property
    def dataset(self) -> DatasetManifest:
        """The rules its bins are packed by (a manifest without shards)."""
        ...

    @property
    def num_buffers(self) -> int: ...

    @property
    def split(self) -> BinSplit | None:
        """The --split part whose records it packs (None: every record)."""
        ...

    def pack_buffer(self, buffer: int) -> PackedBuffer:
        """Buffer `buffer` packed (a pure function of the records and the source's options)."""
        ...

    def split_records(self, split: BinSplit) -> RawBins:
        """The source of one --split part's records (divided record by record, before packing)."""
        ...


def is_raw_source(obj: object) -> TypeGuard[RawBins]:
    """Whether `obj` is a raw source (`RawBins`) rather than a dataset path or mixture."""
    return callable(getattr(obj, "pack_buffer", None)) and hasattr(obj, "dataset")


@dataclass(frozen=True)
class RawAnchor:
    """A stream position whose place is known: epoch, slot (index in that epoch's buffer order) and offset (bins
    of that buffer before it)."""

    position: int = 0
    epoch: int = 0
    slot: int = 0
    offset: int = 0


@dataclass(kw_only=True, frozen=True)
class RawSpec:
    """A raw source in a loader's `ProducerSpec`: the source, where its stream is walked from, and where its
    rejects go (`rejects_path`: a JSONL file this rank's workers append to, or None)."""

    source: RawBins
    anchor: RawAnchor = RawAnchor()
    rejects_path: str | None = None
    cost_model: CostModel | None = None  # balance="compute" (the layout of `balance`) under this cost model


def buffer_order(num_buffers: int, seed: int, epoch: int) -> np.ndarray:
    """The buffers of epoch `epoch`, in order."""
    return np.random.default_rng([seed, epoch]).permutation(num_buffers)


def bins_order(num_bins: int, seed: int, epoch: int, buffer: int) -> np.ndarray:
    """The bins of buffer `buffer` in epoch `epoch`, in order."""
    return np.random.default_rng([seed, epoch, buffer]).permutation(num_bins)


class RawStream:
    """The chained-epoch bin stream of a raw source from an anchor; `count(buffer)` gives a buffer's bins
    (packing it), `visit(epoch, slot, buffer)` is told each buffer the walk reaches, once."""

    def __init__(
        self,
        num_buffers: int,
        seed: int,
        anchor: RawAnchor,
        count: Callable[[int], int],
        visit: Callable[[int, int, int], None] | None = None,
        name: str = "raw source",
    ) -> None:
        if num_buffers < 1:
            raise ValueError(f"{name}: no records")
        self.num_buffers, self.seed, self.name = num_buffers, seed, name
        self._count, self._visit = count, visit
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        # walked buffers: first position, (epoch, slot, buffer, bins)
        self._starts: list[int] = []
        self._segments: list[tuple[int, int, int, int]] = []
        self._next = (anchor.epoch, anchor.slot)
        n = self._walk_one(anchor.position - anchor.offset)
        if not 0 <= anchor.offset < max(n, 1):
            raise ValueError(
                f"{name}: loader state places position {anchor.position} at bin {anchor.offset} of epoch "
                f"{anchor.epoch}'s buffer slot {anchor.slot}, which has {n} bins: the records or options changed"
            )
        for _ in range(self.num_buffers):  # buffers of no bins (every record rejected) are passed over
            if self._starts:
                break
            self._walk_one(anchor.position)
        if not self._starts:
            raise ValueError(f"{name}: every record of the source is rejected; nothing to train on")

    def _buffer(self, epoch: int, slot: int) -> int:
        if epoch not in self._orders:
            self._orders[epoch] = buffer_order(self.num_buffers, self.seed, epoch)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return int(self._orders[epoch][slot])

    def _walk_one(self, start: int) -> int:
        """Appends the next buffer of the walk at `start`; its bin count."""
        epoch, slot = self._next
        buffer = self._buffer(epoch, slot)
        n = self._count(buffer)
        if self._visit is not None:
            self._visit(epoch, slot, buffer)
        self._next = (epoch + 1, 0) if slot + 1 == self.num_buffers else (epoch, slot + 1)
        if n:
            self._starts.append(start)
            self._segments.append((epoch, slot, buffer, n))
        return n

    def _segment(self, p: int) -> int:
        """Index of the walked buffer holding position p (walking on to it)."""
        if not self._starts or p < self._starts[0]:
            raise ValueError(f"{self.name}: position {p} is before the stream's anchor")
        empty = 0
        while p >= self._starts[-1] + self._segments[-1][3]:
            end = self._starts[-1] + self._segments[-1][3]
            empty = 0 if self._walk_one(end) else empty + 1
            if empty > self.num_buffers:
                raise ValueError(f"{self.name}: every record of the source is rejected; nothing to train on")
        if len(self._starts) > 64 and self._starts[32] + KEEP_BEHIND < p:  # forget long-passed buffers
            del self._starts[:32], self._segments[:32]
        return bisect.bisect_right(self._starts, p) - 1

    def _perm(self, epoch: int, buffer: int, n: int) -> np.ndarray:
        key = (epoch, buffer)
        if key not in self._perms:
            self._perms[key] = bins_order(n, self.seed, epoch, buffer)
            while len(self._perms) > 8:
                self._perms.popitem(last=False)
        return self._perms[key]

    def positions(self, start: int, count: int) -> np.ndarray:
        """Raw bin ids at stream positions [start, start+count)."""
        out = np.empty(count, dtype=np.int64)
        for i in range(count):
            s = self._segment(start + i)
            epoch, _, buffer, n = self._segments[s]
            out[i] = (buffer << BIN_BITS) | int(self._perm(epoch, buffer, n)[start + i - self._starts[s]])
        return out

    def locate(self, p: int) -> RawAnchor:
        """The anchor of position p."""
        s = self._segment(p)
        epoch, slot, _, _ = self._segments[s]
        return RawAnchor(position=p, epoch=epoch, slot=slot, offset=p - self._starts[s])


def note_rejects(packed: PackedBuffer, rejects_path: str | None, counters: dict[str, int]) -> dict[str, int]:
    """`counters` with a buffer's records read and rejected (by reason) added; its rejects appended to
    `rejects_path` (one write of whole lines: a rank's workers append to one file)."""
    c = dict(counters)
    c["raw_samples_read"] = c.get("raw_samples_read", 0) + packed.samples_read
    c["raw_samples_rejected"] = c.get("raw_samples_rejected", 0) + len(packed.rejects)
    for row in packed.rejects:
        key = f"raw_rejected.{row['reason']}"
        c[key] = c.get(key, 0) + 1
    if packed.rejects and rejects_path:
        lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in packed.rejects)
        fd = os.open(rejects_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
    return c


class RawBalance(ComputeBalance):
    """`ComputeBalance` of a raw source: each bin's cost from its packing buffer (no table of every bin)."""

    def __init__(self, cost_of: Callable[[np.ndarray], np.ndarray]) -> None:
        super().__init__(np.zeros(0))
        self._cost_of = cost_of

    def costs(self, bins: np.ndarray) -> np.ndarray:
        return self._cost_of(bins)


class RawProducer:
    """Builds micro-batch k of a raw source (the interface of `worker.Producer`): its bins from the packed
    buffers (the last few kept), collated as a packed dataset's."""

    MAX_BUFFERS = 3

    def __init__(
        self, spec: Any, k_start: int, k_end: int | None, *, worker: tuple[int, int] = (0, 1)
    ) -> None:
        """`spec`: the loader's `worker.ProducerSpec` with `raw` set."""
        self.spec, self.raw = spec, spec.raw
        self.worker_id, self.num_workers = worker
        self.source: RawBins = self.raw.source
        self._buffers: OrderedDict[int, PackedBuffer] = OrderedDict()
        self._counters: dict[str, int] = {}
        anchor = self.raw.anchor
        self._skip_visit = (anchor.epoch, anchor.slot) if anchor.offset else None  # its rejects are noted
        self.stream = RawStream(
            self.source.num_buffers,
            spec.seed,
            anchor,
            lambda b: self.buffer(b).num_bins,
            self._visit,
            name=f"raw source {self.source.name}",
        )
        self.balance = None if self.raw.cost_model is None else RawBalance(self.bin_costs)

    def buffer(self, b: int) -> PackedBuffer:
        if b in self._buffers:
            self._buffers.move_to_end(b)
            return self._buffers[b]
        packed = self._buffers[b] = self.source.pack_buffer(b)
        while len(self._buffers) > self.MAX_BUFFERS:
            self._buffers.popitem(last=False)
        return packed

    def _visit(self, epoch: int, slot: int, b: int) -> None:
        """The walk reached buffer b: in the first epoch, its worker counts its records and writes its rejects
        (each buffer's by one worker of the rank: b % workers)."""
        if epoch or b % self.num_workers != self.worker_id:
            return
        if self._skip_visit == (epoch, slot):  # read before the state this loader resumed from was saved
            return
        self._counters = note_rejects(self.buffer(b), self.raw.rejects_path, self._counters)

    def record(self, bin_id: int) -> BinRecord:
        return self.buffer(bin_id >> BIN_BITS).record(bin_id & ((1 << BIN_BITS) - 1))

    def bin_costs(self, bins: np.ndarray) -> np.ndarray:
        """The cost model's cost of each raw bin."""
        model = self.raw.cost_model or DEFAULT_COST_MODEL
        features = np.zeros((len(bins), 4))
        for i, b in enumerate(np.asarray(bins).tolist()):
            features[i] = cost_features(self.buffer(b >> BIN_BITS), b & ((1 << BIN_BITS) - 1))
        return np.asarray(model.cost(features), dtype=np.float64)

    def produce(
        self, k: int, pixel_out: Callable[[int, int], np.ndarray] | None = None
    ) -> MicroBatch[np.ndarray]:
        """Micro-batch k (absolute index on this rank), as numpy."""
        m = self.spec.plan.micro_batches_per_step
        bins = micro_batch_bins(self.stream, k // m, k % m, self.spec.topology, self.spec.plan, self.balance)
        records = [self.record(int(b)) for b in bins]
        sources = np.zeros(len(bins), dtype=np.int64)
        return collate_bins(records, self.spec.collate, pixel_out=pixel_out, bin_ids=bins, source_ids=sources)

    def storage_metrics(self) -> dict[str, int]:
        return dict(self._counters)

    def close(self) -> None:
        self._buffers.clear()


def mixture_manifest(source: RawBins) -> Manifest:
    """The loader's manifest of a raw source in a mixture: the rules it packs by, and the bins of its one packing
    buffer as one pseudo shard. A blend's shares (by repeat) and epochs need every source's bin count, which a
    raw source knows once all its buffers are packed: in a mixture it is packed whole, in one buffer, before the
    loader starts (once per process, or once for all with a packing cache)."""
    if source.num_buffers != 1:
        raise ValueError(
            f"mixture source {source.name!r}: a raw source in a mixture is packed in one buffer (the blend needs "
            f"its bin count), its records fill {source.num_buffers}: give a packing buffer size of at least its "
            "number of records, or pack it with `mmpack pack` and mix the packed dataset"
        )
    packed = source.pack_buffer(0)
    if packed.num_bins == 0:
        raise ValueError(f"mixture source {source.name!r}: every record is rejected; nothing to train on")
    shard = ShardEntry(
        path=f"raw-{source.fingerprint}",  # never opened: `RawPart` reads the buffer's bins
        format="arrow",
        first_bin=0,
        bins=packed.num_bins,
        samples=0,
        tokens=0,
        bytes=0,
        sha256="0" * 64,
    )
    base = Manifest.from_model(source.dataset)
    return dataclasses.replace(
        base, num_bins=packed.num_bins, shards=(shard,), fingerprint=source.fingerprint
    )


def raw_bin_costs(source: RawBins, cost_model: CostModel | None) -> np.ndarray:
    """The cost model's cost of every bin of a raw source packed in one buffer (`mixture_manifest`)."""
    packed = source.pack_buffer(0)
    features = np.stack([cost_features(packed, j) for j in range(packed.num_bins)])
    return np.asarray((cost_model or DEFAULT_COST_MODEL).cost(features), dtype=np.float64)


def cost_features(packed: PackedBuffer, j: int) -> np.ndarray:
    """The cost model's features (float [4]) of bin j of a packed buffer."""
    lens, grids, videos = packed.bin_features(j)
    features = bin_cost_features(lens, grids)[None, :]
    return add_video_features(features, videos, np.array([0, len(videos)]))[0]


class RawPart:
    """A raw source of a mixture in a loader process (a part of `worker.MixedProducer`, beside the `Producer`s
    of packed sources): its one buffer's bins read by bin id, as a shard reader gives them. When the stream
    starts at its beginning, worker 0 counts the buffer's records and rejects and writes the rejects."""

    def __init__(self, spec: Any, raw: RawSpec, k_start: int, *, worker: tuple[int, int] = (0, 1)) -> None:
        """`spec`: the loader's `worker.ProducerSpec` with this source's manifest and storage."""
        self.spec, self.raw = spec, raw
        self.readers = self  # `MixedProducer` reads a part's bins through `part.readers.read_bin`
        self._notes_rejects = worker[0] == 0 and k_start == 0
        self._packed: PackedBuffer | None = None
        self._counters: dict[str, int] = {}

    def _buffer(self) -> PackedBuffer:
        if self._packed is None:
            self._packed = self.raw.source.pack_buffer(0)
            if self._notes_rejects:
                self._counters = note_rejects(self._packed, self.raw.rejects_path, {})
        return self._packed

    def read_bin(self, bin_id: int) -> BinRecord:
        return self._buffer().record(bin_id)

    def advance(self, k: int) -> None:
        """Nothing to read ahead: the bins are in the packed buffer."""

    def storage_metrics(self) -> dict[str, int]:
        return dict(self._counters)

    def close(self) -> None:
        self._packed = None
