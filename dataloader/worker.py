"""What runs inside a loader worker: read the bins of a micro-batch, collate them, read shards ahead.

A worker owns every `num_workers`-th micro-batch of this rank (k = start + worker_id, + num_workers, ...),
so the main process can take results in order without any coordination. Shards of the upcoming
micro-batches of this rank (the order is known in advance) are got ahead: remote ones downloaded by a
prefetcher thread (the cache's per-shard locks keep two workers from downloading the same shard), local ones
read ahead by the kernel and checked by the workers in shares, from each worker's own thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import threading
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

from mmpack.dataloader.balance import ComputeBalance
from mmpack.dataloader.blend import BlendedStream, BlendStage
from mmpack.dataloader.collate import BadSampleError, CollateConfig, ImageTooLargeError, collate_bins
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.order import BatchPlan, BinSplit, StreamOrder, micro_batch_bins
from mmpack.dataloader.raw_source import RawPart, RawProducer, RawSpec
from mmpack.dataloader.readers import (
    ArrowShardReader,
    BinRecord,
    WdsShardReader,
    build_index_cache,
    open_shard_reader,
)
from mmpack.dataloader.storage import ShardError, ShardStore, StorageConfig
from mmpack.dataloader.topology import Topology
from mmpack.dataloader.transport import HANDOVER_MAX_BYTES, SlotWriter
from mmpack.packing.batch import MicroBatch
from mmpack.packing.processes import exit_with_parent


@dataclass(kw_only=True, frozen=True)
class ProducerSpec:
    """Everything a worker needs (picklable, so it also works with the spawn start method)."""

    manifest: Manifest
    topology: Topology
    plan: BatchPlan
    seed: int
    shard_window: int
    storage: StorageConfig
    collate: CollateConfig
    prefetch_shards: int
    balance: ComputeBalance | None = None  # balance="compute": the cost-balanced layout of each global batch
    # A mixture: every source (`manifest` and `storage` above are the first one's), their shares, the stage.
    sources: tuple[SourceSpec, ...] = ()
    weights: tuple[float, ...] = ()
    stage: BlendStage | None = None
    split: BinSplit | None = None  # --split: only this part's bins are read (of every source)
    raw: RawSpec | None = None  # a raw source, packed online (`manifest` then holds its rules, no shards)


@dataclass(kw_only=True, frozen=True)
class SourceSpec:
    """One source of a mixture: its manifest and where its shards are (or a raw source, packed in one buffer)."""

    manifest: Manifest
    storage: StorageConfig
    # a raw source: `manifest` is `raw_source.mixture_manifest`'s, nothing is stored
    raw: RawSpec | None = None


class ReaderPool:
    """Open shard readers of one process, least recently used closed first."""

    def __init__(self, manifest: Manifest, store: ShardStore, max_open: int) -> None:
        self.manifest, self.store, self.max_open = manifest, store, max_open
        self._open: OrderedDict[int, ArrowShardReader | WdsShardReader] = OrderedDict()
        self.prepared: set[int] = set()  # local shards `prepare` has readied in this process

    def read_bin(self, bin_id: int) -> BinRecord:
        s = self.manifest.shard_index(bin_id)
        shard = self.manifest.shards[s]
        reader = self._reader(s)
        try:
            return reader.read(bin_id - shard.first_bin)
        except (OSError, ValueError, KeyError) as e:
            raise ShardError(f"shard {shard.path}: cannot read bin {bin_id}: {e}") from e

    def _reader(self, s: int) -> ArrowShardReader | WdsShardReader:
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        shard = self.manifest.shards[s]
        for attempt in range(3):
            path = self.store.local_path(shard)
            try:
                reader = open_shard_reader(
                    path,
                    shard.format,
                    label=f"shard {shard.path}",
                    index_cache=self.store.index_cache_path(shard),
                )
                break
            except FileNotFoundError:  # evicted by another process between fetch and open
                if attempt == 2:
                    raise
            except (OSError, ValueError) as e:
                raise ShardError(f"shard {shard.path} is unreadable: {e}") from e
        if (held := len(reader)) != shard.bins:  # checked once per open, not on every read
            reader.close()
            raise ShardError(f"shard {shard.path} holds {held} bins, the manifest says {shard.bins}")
        self._open[s] = reader
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].close()
        return reader

    def prepare(self, s: int, *, cancel: threading.Event | None = None) -> bool:
        """Readies shard s ahead of use, unless another process or thread is on it (then False): fetched or
        checked by the store, and its tar index worked out into the machine-wide cache."""
        shard = self.manifest.shards[s]
        if not self.store.fetch(shard, wait=False, cancel=cancel):
            return False
        index = self.store.index_cache_path(shard)
        if index is not None and not os.path.exists(index):
            build_index_cache(self.store.verified_path(shard), index, label=f"shard {shard.path}")
        if self.store.config.is_local:  # stays so; a cached remote shard may be evicted
            self.prepared.add(s)
        return True

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


class Producer:
    """Builds micro-batch k (absolute index on this rank: step * micro_batches_per_step + micro_batch).

    While it builds micro-batches of k_start..k_end-1, their shards are got ahead: remote ones by a `Prefetcher`
    thread, local ones by `LocalReadAhead` from this thread.
    """

    def __init__(
        self,
        spec: ProducerSpec,
        k_start: int,
        k_end: int | None,
        *,
        worker: tuple[int, int] = (0, 1),
        bins_of: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        """`worker`: (id, count) of this process among the loader's workers (they share out shard checks);
        `bins_of(k)`: this dataset's bins of micro-batch k, when it is one source of a mixture."""
        self.spec = spec
        self._bins_of = bins_of
        self.stream = StreamOrder(spec.manifest, spec.seed, shard_window=spec.shard_window, split=spec.split)
        self.store = ShardStore(spec.storage)
        self.readers = ReaderPool(spec.manifest, self.store, max_open=spec.shard_window + 1)
        # bins of micro-batches the prefetcher has looked at, so `produce` does not work them out again
        self._planned: dict[int, np.ndarray] = {}
        self.prefetcher: Prefetcher | LocalReadAhead
        if spec.prefetch_shards and spec.storage.is_local:
            self.prefetcher = LocalReadAhead(self, k_start, k_end, spec.prefetch_shards, worker=worker)
        else:
            self.prefetcher = Prefetcher(self, k_start, k_end, spec.prefetch_shards)
            if spec.prefetch_shards:
                self.prefetcher.start()

    def bins(self, k: int) -> np.ndarray:
        if self._bins_of is not None:
            return self._bins_of(k)
        m = self.spec.plan.micro_batches_per_step
        return micro_batch_bins(
            self.stream, k // m, k % m, self.spec.topology, self.spec.plan, self.spec.balance
        )

    def planned_bins(self, k: int) -> np.ndarray:
        """`bins(k)`, kept for `produce(k)` (the prefetcher's thread asks first, a little ahead)."""
        bins = self._planned[k] = self.bins(k)
        return bins

    def produce(
        self, k: int, pixel_out: Callable[[int, int], np.ndarray] | None = None
    ) -> MicroBatch[np.ndarray]:
        """Micro-batch k, as numpy (`pixel_out`: where its image patches go, see `collate_bins`)."""
        bins = self.advance(k)
        try:
            records = [self.readers.read_bin(int(b)) for b in bins]
            sources = np.zeros(len(bins), dtype=np.int64)
            return collate_bins(
                records, self.spec.collate, pixel_out=pixel_out, bin_ids=bins, source_ids=sources
            )
        except ImageTooLargeError as e:  # name the shard too
            shard = self.spec.manifest.shards[
                int(self.spec.manifest.shard_of_bin(bins[e.row : e.row + 1])[0])
            ]
            raise ImageTooLargeError(f"shard {shard.path}: {e}", row=e.row) from None

    def advance(self, k: int) -> np.ndarray:
        """The consumer is at micro-batch k: read ahead from there; k's bins."""
        self.prefetcher.advance(k)
        bins = self._planned.pop(k, None)
        if bins is None:  # no prefetcher, or it has not got this far
            bins = self.bins(k)
        if len(self._planned) > 2 * Prefetcher.MAX_LOOKAHEAD_MICRO_BATCHES:  # other workers' micro-batches
            for old in [j for j in list(self._planned) if j < k]:
                self._planned.pop(old, None)
        return bins

    def storage_metrics(self) -> dict[str, int]:
        return self.store.metrics.as_dict()

    def new_shards(self, k: int, recent: OrderedDict[int, None]) -> list[int]:
        """Shards of micro-batch k not among the `recent` ones (which it updates, keeping a few)."""
        new = []
        for s in dict.fromkeys(self.spec.manifest.shard_of_bin(self.planned_bins(k)).tolist()):
            if s not in recent:
                new.append(s)
            recent[s] = None
            recent.move_to_end(s)
            if len(recent) > 2 * self.spec.shard_window:
                recent.popitem(last=False)
        return new

    def close(self) -> None:
        self.prefetcher.close()
        self.readers.close()


class MixedProducer:
    """`Producer` of a mixture: one `Producer` per source reads (and reads ahead) that source's bins of each
    micro-batch; the blended order (`mmpack.dataloader.blend`) says which rows they fill."""

    def __init__(
        self, spec: ProducerSpec, k_start: int, k_end: int | None, *, worker: tuple[int, int] = (0, 1)
    ) -> None:
        self.spec = spec
        streams = [
            StreamOrder(s.manifest, spec.seed, shard_window=spec.shard_window, split=spec.split)
            for s in spec.sources
        ]
        self.stream = BlendedStream(streams, spec.weights, spec.seed, spec.stage)
        self._lock = threading.Lock()
        self._combined: OrderedDict[int, np.ndarray] = OrderedDict()
        self.parts: list[Producer | RawPart] = []
        for i, s in enumerate(spec.sources):
            own = dataclasses.replace(spec, manifest=s.manifest, storage=s.storage, sources=(), balance=None)
            if s.raw is not None:
                self.parts.append(RawPart(own, s.raw, k_start, worker=worker))
                continue
            bins_of = functools.partial(self._source_bins, i)
            self.parts.append(Producer(own, k_start, k_end, worker=worker, bins_of=bins_of))

    def combined_bins(self, k: int) -> np.ndarray:
        """Combined bin ids (`BlendedStream`) of micro-batch k (a worker's threads ask for the same k)."""
        with self._lock:
            if k not in self._combined:
                m = self.spec.plan.micro_batches_per_step
                self._combined[k] = micro_batch_bins(
                    self.stream, k // m, k % m, self.spec.topology, self.spec.plan, self.spec.balance
                )
                while len(self._combined) > 4 * Prefetcher.MAX_LOOKAHEAD_MICRO_BATCHES:
                    self._combined.popitem(last=False)
            return self._combined[k]

    def _source_bins(self, source: int, k: int) -> np.ndarray:
        src, local = self.stream.split(self.combined_bins(k))
        return local[src == source]

    def produce(
        self, k: int, pixel_out: Callable[[int, int], np.ndarray] | None = None
    ) -> MicroBatch[np.ndarray]:
        """Micro-batch k of the mixture, its rows in the blended order."""
        for part in self.parts:
            part.advance(k)
        src, local = self.stream.split(self.combined_bins(k))
        records = [self.parts[int(s)].readers.read_bin(int(b)) for s, b in zip(src, local)]
        try:
            return collate_bins(
                records, self.spec.collate, pixel_out=pixel_out, bin_ids=local, source_ids=src
            )
        except ImageTooLargeError as e:  # name the source and shard too
            part = self.parts[int(src[e.row])]
            shard = part.spec.manifest.shards[part.spec.manifest.shard_index(int(local[e.row]))]
            raise ImageTooLargeError(
                f"{part.spec.storage.root}: shard {shard.path}: {e}", row=e.row
            ) from None

    def storage_metrics(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for part in self.parts:
            for key, value in part.storage_metrics().items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def close(self) -> None:
        for part in self.parts:
            part.close()


def make_producer(
    spec: ProducerSpec, k_start: int, k_end: int | None, *, worker: tuple[int, int] = (0, 1)
) -> Producer | MixedProducer | RawProducer:
    """The producer of one dataset, of a mixture when `spec.sources` names its sources, or of a raw source."""
    if spec.raw is not None:
        return RawProducer(spec, k_start, k_end, worker=worker)
    if spec.sources:
        return MixedProducer(spec, k_start, k_end, worker=worker)
    return Producer(spec, k_start, k_end, worker=worker)


class LocalReadAhead:
    """Local shards: the kernel reads the next `ahead` shards of the coming micro-batches into the page cache
    (posix_fadvise WILLNEED, asynchronous), asked from the worker's own thread as it reaches each micro-batch.

    No thread: checking and indexing a local shard is CPU work that a thread would only contend for the GIL
    with (each of its many small system calls hands the GIL to the other thread and back). The workers share
    out that work instead: worker i of n asks for the coming shards s with s % n == i to be read, and checks
    and indexes them as soon as it has asked, without waiting for a shard another process is on. Workers reach
    the same shards at about the same time, and otherwise one checks while the others wait for it, idle.
    """

    def __init__(
        self,
        producer: Producer,
        k_start: int,
        k_end: int | None,
        ahead: int,
        *,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        self.producer, self.k_end, self.ahead = producer, k_end, ahead
        self.worker_id, self.num_workers = worker
        self.k = k_start  # the next micro-batch to look at
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._hinted: deque[int] = deque()  # the micro-batch that first needs each shard asked for

    def advance(self, k: int) -> None:
        """The consumer has reached micro-batch k: ask for shards until `ahead` are asked for past it."""
        while self._hinted and self._hinted[0] < k:
            self._hinted.popleft()
        self.k = max(self.k, k)
        limit = k + Prefetcher.MAX_LOOKAHEAD_MICRO_BATCHES
        while (
            len(self._hinted) < self.ahead and self.k < limit and (self.k_end is None or self.k < self.k_end)
        ):
            mine = []
            for s in self.producer.new_shards(self.k, self._recent):
                self._hinted.append(self.k)
                if s % self.num_workers == self.worker_id:  # one hint per shard is enough for the machine
                    self._read_ahead(self.producer.store.verified_path(self.producer.spec.manifest.shards[s]))
                    if s not in self.producer.readers.prepared:
                        mine.append(s)
            for s in mine:
                with contextlib.suppress(Exception):  # errors are reported with context on use
                    self.producer.readers.prepare(s)
            self.k += 1

    @staticmethod
    def _read_ahead(path: str) -> None:
        with contextlib.suppress(OSError):  # a hint; a missing shard is reported on use
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        pass


class Prefetcher(threading.Thread):
    """Fetches the remote shards of the coming micro-batches in stream order of first need (local ones:
    `LocalReadAhead`).

    At most `ahead` distinct shards past the consumer are fetched ahead, `threads` of them (default: the
    storage's `download_concurrency`) at once, each in a short-lived thread (nothing idles once the work is
    done). Errors here are ignored: the consumer fetches on demand and reports them with context. `close`
    stops it; running downloads give up at their next chunk or retry.
    """

    MAX_LOOKAHEAD_MICRO_BATCHES = 256
    LOOKAHEAD_WAKE_STEP = 16

    def __init__(
        self, producer: Producer, k_start: int, k_end: int | None, ahead: int, threads: int | None = None
    ) -> None:
        super().__init__(daemon=True, name="mmpack-prefetch")
        self.producer, self.k_start, self.k_end, self.ahead = producer, k_start, k_end, ahead
        self.threads = threads or producer.spec.storage.download_concurrency
        self.thread_prefix = f"mmpack-download-{id(self):x}"  # names this prefetcher's threads
        self.position = k_start  # the consumer's current micro-batch (set through `advance`)
        self.stop = threading.Event()
        self._changed = threading.Condition()  # position, running count or stop changed
        self._running = 0
        # The position at which the waiting thread can go on (none waiting: never): `advance` wakes it only
        # then, not at every micro-batch (each wake-up is a GIL hand-over with the worker's main thread).
        self._wake_at: float = float("inf")

    def advance(self, k: int) -> None:
        """The consumer has reached micro-batch k."""
        with self._changed:
            self.position = k
            if k >= self._wake_at:
                self._changed.notify_all()

    def close(self) -> None:
        self.stop.set()
        with self._changed:
            self._changed.notify_all()

    def _wait_for_room(self, k: int, fetched: deque[int], *, download: bool) -> bool:
        """Waits until micro-batch k is near enough the consumer (and, for a download, until fewer than
        `ahead` shards are fetched ahead and a download thread is free); False once stopped."""
        with self._changed:
            while not self.stop.is_set():
                while fetched and fetched[0] < self.position:
                    fetched.popleft()
                near = k - self.position < self.MAX_LOOKAHEAD_MICRO_BATCHES
                if near and not download:
                    return True
                if near and self._running < self.threads and len(fetched) < self.ahead:
                    self._running += 1
                    return True
                # Wait for the position that lets this go on (a finished download wakes it too); for room in
                # the look-ahead, a few micro-batches more, so the thread runs once per few, not per one.
                self._wake_at = k - self.MAX_LOOKAHEAD_MICRO_BATCHES + self.LOOKAHEAD_WAKE_STEP
                if near and len(fetched) >= self.ahead:
                    self._wake_at = fetched[0] + 1
                elif near:  # only a download thread is missing
                    self._wake_at = float("inf")
                self._changed.wait(timeout=1.0)
                self._wake_at = float("inf")
        return False

    def _fetch(self, s: int) -> None:
        try:  # skipped at once if another process or thread holds the shard
            self.producer.readers.prepare(s, cancel=self.stop)
        except Exception:  # the consumer fetches on demand and reports errors with context
            pass
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def run(self) -> None:
        fetched: deque[int] = deque()  # micro-batch index of each shard fetched ahead, in order
        recent: OrderedDict[int, None] = OrderedDict()
        k = self.k_start
        try:
            while self.k_end is None or k < self.k_end:
                # Never past the look-ahead, even when no new shard comes up for a long while.
                if not self._wait_for_room(k, fetched, download=False):
                    return
                for s in self.producer.new_shards(k, recent):
                    if self.producer.store.is_cached(self.producer.spec.manifest.shards[s]):
                        continue  # nothing to fetch: the reader finds it (and marks it used) when it opens it
                    if not self._wait_for_room(k, fetched, download=True):
                        return
                    name = f"{self.thread_prefix}_{s}"
                    threading.Thread(target=self._fetch, args=(s,), daemon=True, name=name).start()
                    fetched.append(k)
                k += 1
        except Exception:  # as in _fetch: the consumer reports errors
            return


def to_torch(batch: MicroBatch[np.ndarray]) -> MicroBatch[torch.Tensor]:
    """The batch's arrays as tensors sharing their memory."""
    return batch.map_arrays(torch.from_numpy)


def worker_loop(
    spec: ProducerSpec,
    worker_id: int,
    num_workers: int,
    k_start: int,
    k_end: int | None,
    conn: Any,
    slot_flags: Any,
    ahead: Any,
    stop_ev: Any,
    handover: int = 1,
) -> None:
    """Entry point of a worker process: produce micro-batches k_start+worker_id, +num_workers, ... in order.

    Batches travel through this worker's shared-memory slots (mmpack.dataloader.transport); `ahead` counts the
    batches it may still make before the consumer takes one. Messages go straight down the pipe `conn` from
    this thread (no feeder thread waiting for the GIL): each is small and few are ever unread, so sending
    does not block.

    A message is a list of up to `handover` batches (together at most `HANDOVER_MAX_BYTES`): each message
    wakes the consumer, which then takes the CPU from a worker, so small batches go several at a time.
    The worker sends what it holds before it waits for room, so the consumer never waits for a batch that
    is already made while the worker is blocked; the first batch goes alone (time to first batch). The
    `handover` batches of room beyond `prefetch_batches` serve only small batches: while batches are large
    (a group of them would pass `HANDOVER_MAX_BYTES`), the worker keeps that room to itself, so at most
    `prefetch_batches` large ones, the one being made included, are held for the consumer (memory).
    """
    exit_with_parent()  # a rank killed outright (SIGKILL, the OOM killer) takes its workers with it
    # Objects inherited from the consumer's process (forked) are never collected here: garbage among them
    # would run its finalizers in this process, where they do not belong (an fsspec filesystem's finalizer
    # closes its HTTP session on the consumer's event loop, which has no thread here, and waits a second
    # for it), and scanning them would copy their pages.
    gc.freeze()
    # one intra-op thread: workers are the parallelism (video frames are resized with torch here)
    torch.set_num_threads(1)
    producer = make_producer(spec, k_start, k_end, worker=(worker_id, num_workers))
    writer = SlotWriter(slot_flags, ahead, stop_ev)
    # Image patches are decoded straight into a slot, with room after them for the batch's other arrays.
    length = spec.collate.seq_len
    rest = spec.plan.micro_batch_size * length * (28 + (length if spec.collate.build_attention_mask else 0))

    def pixel_out(rows: int, width: int) -> np.ndarray:
        # room after them for the rest, the patches' positions included (3 int64 per patch)
        return (
            writer.stage(rows * width * 4, rest + rows * 24 + (64 << 10))
            .view(np.float32)
            .reshape(rows, width)
        )

    def send(items: list[tuple[str, int, Any, dict[str, int] | None]]) -> None:
        """One message; its last batch carries the storage counters (the consumer keeps the latest)."""
        items[-1] = (*items[-1][:3], producer.storage_metrics())
        conn.send(items)

    k = k_start + worker_id
    pending: list[tuple[str, int, Any, dict[str, int] | None]] = []
    pending_bytes = 0
    first = True
    large = False  # the last batch was large: keep `handover` batches of room unused
    parked = 0  # room taken and kept unused
    try:
        while not stop_ev.is_set() and (k_end is None or k < k_end):
            if large:
                while parked < handover and writer.try_room():
                    parked += 1
            elif parked:
                writer.give_room(parked)
                parked = 0
            if not writer.try_room():
                if pending:  # the consumer gets what is made before this worker waits
                    send(pending)
                    pending, pending_bytes = [], 0
                if not writer.wait_for_room():
                    break
            item: tuple[str, int, Any, dict[str, int] | None]
            try:
                msg = writer.put(dict(producer.produce(k, pixel_out=pixel_out).items()))
                item = ("ok", k, msg, None)
                pending_bytes += msg.nbytes
                large = msg.nbytes * handover > HANDOVER_MAX_BYTES
            except Exception as e:
                kind = (
                    "shard_error"
                    if isinstance(e, ShardError)
                    else "bad_sample"  # --strict-data: one line naming the sample
                    if isinstance(e, BadSampleError)
                    else "error"
                )
                detail = traceback.format_exc() if kind == "error" else str(e)
                item = (kind, k, detail, None)
            pending.append(item)
            k += num_workers
            last = item[0] != "ok" or (k_end is not None and k >= k_end)
            if first or last or len(pending) >= handover or pending_bytes >= HANDOVER_MAX_BYTES:
                send(pending)
                pending, pending_bytes, first = [], 0, False
            if item[0] != "ok":
                break
        # A new slot travels as a shared-memory handle served by this process: stay until the consumer is done.
        stop_ev.wait()
    except (BrokenPipeError, ConnectionResetError):  # the consumer is gone
        pass
    finally:
        producer.close()
        conn.close()
