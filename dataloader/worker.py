"""What runs inside a loader worker: read the bins of a micro-batch, collate them, read shards ahead.

A worker owns every `num_workers`-th micro-batch of this rank (k = start + worker_id, + num_workers, ...),
so the main process can take results in order without any coordination. Each worker also runs a thread
that fetches the shards of the upcoming micro-batches of this rank (the order is known in advance);
the cache's per-shard locks keep two workers from downloading the same shard.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.multiprocessing

from dataloader.collate import CollateConfig, collate_bins
from dataloader.manifest import Manifest
from dataloader.order import BatchPlan, StreamOrder, micro_batch_bins
from dataloader.readers import ArrowShardReader, BinRecord, WdsShardReader, open_shard_reader
from dataloader.storage import ShardError, ShardStore, StorageConfig
from dataloader.topology import Topology
from dataloader.transport import SlotWriter


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


class ReaderPool:
    """Open shard readers of one process, least recently used closed first."""

    def __init__(self, manifest: Manifest, store: ShardStore, max_open: int) -> None:
        self.manifest, self.store, self.max_open = manifest, store, max_open
        self._open: OrderedDict[int, ArrowShardReader | WdsShardReader] = OrderedDict()

    def read_bin(self, bin_id: int) -> BinRecord:
        s = int(self.manifest.shard_of_bin(np.array([bin_id]))[0])
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

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


class Producer:
    """Builds micro-batch k (absolute index on this rank: step * micro_batches_per_step + micro_batch).

    While it builds micro-batches of k_start..k_end-1, a `Prefetcher` thread fetches their shards ahead.
    """

    def __init__(self, spec: ProducerSpec, k_start: int, k_end: int | None) -> None:
        self.spec = spec
        self.stream = StreamOrder(spec.manifest, spec.seed, shard_window=spec.shard_window)
        self.store = ShardStore(spec.storage)
        self.readers = ReaderPool(spec.manifest, self.store, max_open=spec.shard_window + 1)
        self.prefetcher = Prefetcher(self, k_start, k_end, spec.prefetch_shards)
        if spec.prefetch_shards and not spec.storage.is_local:  # local shards are read in place
            self.prefetcher.start()

    def bins(self, k: int) -> np.ndarray:
        m = self.spec.plan.micro_batches_per_step
        return micro_batch_bins(self.stream, k // m, k % m, self.spec.topology, self.spec.plan)

    def produce(self, k: int) -> dict[str, Any]:
        self.prefetcher.position = k
        bins = self.bins(k)
        batch = collate_bins([self.readers.read_bin(int(b)) for b in bins], self.spec.collate)
        batch["bin_ids"] = bins
        return batch

    def new_shards(self, k: int, recent: OrderedDict[int, None]) -> list[int]:
        """Shards of micro-batch k not among the `recent` ones (which it updates, keeping a few)."""
        new = []
        for s in dict.fromkeys(self.spec.manifest.shard_of_bin(self.bins(k)).tolist()):
            if s not in recent:
                new.append(s)
            recent[s] = None
            recent.move_to_end(s)
            if len(recent) > 2 * self.spec.shard_window:
                recent.popitem(last=False)
        return new

    def close(self) -> None:
        self.prefetcher.stop.set()
        self.readers.close()


class Prefetcher(threading.Thread):
    """Fetches the shards of the coming micro-batches in stream order of first need.

    At most `ahead` distinct shards past the consumer are fetched ahead, `threads` of them (default: the
    storage's `download_concurrency`) downloading at once. Errors here are ignored: the consumer fetches
    on demand and reports them with context. Setting `stop` cancels queued downloads and makes running ones
    give up at their next chunk or retry.
    """

    MAX_LOOKAHEAD_MICRO_BATCHES = 256

    def __init__(
        self, producer: Producer, k_start: int, k_end: int | None, ahead: int, threads: int | None = None
    ) -> None:
        super().__init__(daemon=True, name="mmpack-prefetch")
        self.producer, self.k_start, self.k_end, self.ahead = producer, k_start, k_end, ahead
        self.threads = threads or producer.spec.storage.download_concurrency
        self.position = k_start  # the consumer's current micro-batch; written by the consumer thread
        self.stop = threading.Event()

    def _wait_for_room(self, k: int, fetched: deque[int], running: set[Future[bool]]) -> bool:
        while not self.stop.is_set():
            while fetched and fetched[0] < self.position:
                fetched.popleft()
            running.difference_update([f for f in running if f.done()])
            near = k - self.position < self.MAX_LOOKAHEAD_MICRO_BATCHES
            if near and len(running) < self.threads and len(fetched) < self.ahead:
                return True
            if len(running) >= self.threads:
                wait_futures(running, timeout=0.05, return_when=FIRST_COMPLETED)
            else:
                time.sleep(0.005)
        return False

    def _fetch(self, s: int) -> bool:
        shard = self.producer.spec.manifest.shards[s]
        try:  # skipped at once if another process or thread holds the shard
            return self.producer.store.fetch(shard, wait=False, cancel=self.stop)
        except Exception:  # the consumer fetches on demand and reports errors with context
            return False

    def run(self) -> None:
        fetched: deque[int] = deque()  # micro-batch index of each shard fetched ahead, in order
        running: set[Future[bool]] = set()
        recent: OrderedDict[int, None] = OrderedDict()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mmpack-download")
        k = self.k_start
        try:
            while self.k_end is None or k < self.k_end:
                for s in self.producer.new_shards(k, recent):
                    if not self._wait_for_room(k, fetched, running):
                        return
                    running.add(pool.submit(self._fetch, s))  # the pool starts them in submission order
                    fetched.append(k)
                k += 1
        except Exception:  # as in _fetch: the consumer reports errors
            return
        finally:
            pool.shutdown(wait=False, cancel_futures=self.stop.is_set())


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """Numpy arrays to tensors (sharing memory with the array); other values as they are."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


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
) -> None:
    """Entry point of a worker process: produce micro-batches k_start+worker_id, +num_workers, ... in order.

    Batches travel through this worker's shared-memory slots (dataloader.transport); `ahead` counts the
    batches it may still make before the consumer takes one. Messages go straight down the pipe `conn` from
    this thread (no feeder thread waiting for the GIL): each is small and few are ever unread, so sending
    does not block.
    """
    producer = Producer(spec, k_start, k_end)
    writer = SlotWriter(slot_flags, ahead, stop_ev)
    k = k_start + worker_id
    try:
        while not stop_ev.is_set() and (k_end is None or k < k_end):
            if not writer.wait_for_room():
                break
            item: tuple[str, int, Any, dict[str, int]]
            try:
                item = ("ok", k, writer.put(producer.produce(k)), producer.store.metrics.as_dict())
            except Exception as e:
                kind = "shard_error" if isinstance(e, ShardError) else "error"
                detail = str(e) if kind == "shard_error" else traceback.format_exc()
                item = (kind, k, detail, producer.store.metrics.as_dict())
            conn.send(item)
            if item[0] != "ok":
                break
            k += num_workers
        # A new slot travels as a shared-memory handle served by this process: stay until the consumer is done.
        stop_ev.wait()
    except (BrokenPipeError, ConnectionResetError):  # the consumer is gone
        pass
    finally:
        producer.close()
        conn.close()
