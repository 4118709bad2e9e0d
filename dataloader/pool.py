"""Running the producer: in this process, or in worker processes whose batches are taken in order.

Both runners yield (micro-batch, seconds the consumer waited for it) for micro-batches k_start..k_end-1
and record each worker's storage counters in `metrics`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from dataloader.storage import ShardError
from dataloader.transport import SlotReader
from dataloader.worker import Producer, ProducerSpec, put_until_stopped, to_torch, worker_loop

Batches = Iterator[list[Any]]  # [micro-batch or None, seconds waited]
# [kind, micro-batch index, payload or error text, worker metrics, worker id]
_Item = list[Any]


def take_batch(pair: list[Any]) -> Any:
    """Removes and returns the batch of a [batch, wait_s] pair.

    Runners yield mutable pairs and the consumer takes the batch out, so no suspended generator keeps a
    reference to it: a batch's (shared) memory is released when the consumer drops it, not inside the
    next `next()` call, where it would count as data wait.
    """
    batch, pair[0] = pair[0], None
    return batch


def no_data(k_start: int, k_end: int | None) -> Batches:
    """One None per micro-batch, for pipeline stages that take no data."""
    k = k_start
    while k_end is None or k < k_end:
        yield [None, 0.0]
        k += 1


def run_in_process(
    spec: ProducerSpec, k_start: int, k_end: int | None, *, metrics: dict[int, dict[str, int]]
) -> Batches:
    """Makes every micro-batch here (num_workers=0); the wait is the time spent making it."""
    producer = Producer(spec, k_start, k_end)
    k = k_start
    try:
        while k_end is None or k < k_end:
            t0 = time.perf_counter()
            pair = [to_torch(producer.produce(k)), 0.0]
            pair[1] = time.perf_counter() - t0
            metrics[0] = producer.store.metrics.as_dict()
            yield pair
            k += 1
    finally:
        producer.close()


def run_workers(
    spec: ProducerSpec,
    k_start: int,
    k_end: int | None,
    *,
    num_workers: int,
    prefetch_batches: int,
    start_method: str | None,
    metrics: dict[int, dict[str, int]],
) -> Batches:
    """Worker w makes micro-batches k_start + w, + num_workers, ...; a thread here receives them in order."""
    n = num_workers
    method = start_method or ("fork" if sys.platform == "linux" else "spawn")
    ctx: Any = mp.get_context(method)
    stop_ev = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]  # (receiving end, sending end)
    # Batches a worker may have made ahead: the ones waiting in `ready`, one being copied out, one being written.
    num_slots = prefetch_batches + 2
    free_slots = [ctx.Semaphore(num_slots) for _ in range(n)]
    procs = [
        ctx.Process(
            target=worker_loop,
            args=(spec, w, n, k_start, k_end, pipes[w][1], free_slots[w], num_slots, stop_ev),
            daemon=True,
            name=f"mmpack-loader-{w}",
        )
        for w in range(n)
    ]
    for p in procs:
        p.start()
    for _, send_end in pipes:
        send_end.close()  # the workers hold theirs: a worker that dies shows as end of file
    conns = [recv_end for recv_end, _ in pipes]
    ready: queue.Queue[_Item] = queue.Queue(maxsize=prefetch_batches)
    halt = threading.Event()
    receiver = threading.Thread(
        target=_receive,
        args=(conns, [SlotReader(sem) for sem in free_slots], procs, k_start, k_end, ready, halt),
        daemon=True,
        name="mmpack-receive",
    )
    receiver.start()
    k = k_start
    try:
        while k_end is None or k < k_end:
            t0 = time.perf_counter()
            item = _take(
                ready, receiver, procs
            )  # [kind, micro-batch index, payload, worker metrics, worker id]
            wait_s = time.perf_counter() - t0
            kind, got_k, w = item[0], item[1], item[4]
            metrics[w] = item[3]
            if kind == "shard_error":
                raise ShardError(item[2])
            if kind != "ok":
                raise RuntimeError(f"loader worker {w} failed on micro-batch {got_k}:\n{item[2]}")
            assert got_k == k, f"worker {w} sent micro-batch {got_k}, expected {k}"
            pair = [item[2], wait_s]
            item[2] = None
            yield pair
            k += 1
    finally:
        halt.set()
        stop_ev.set()  # workers stop at once and drop unread batches (never drain: a read could block)
        receiver.join(timeout=5)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in conns:
            conn.close()


def _receive(
    conns: list[Any],
    readers: list[SlotReader],
    procs: list[Any],
    k_start: int,
    k_end: int | None,
    ready: queue.Queue[_Item],
    halt: threading.Event,
) -> None:
    """Takes batches from the workers in order into `ready`, off the consumer's critical path.

    Copying a batch out of its worker's slot (and, for a new slot, a round trip to the worker for its
    shared-memory handle) happens here, overlapping the consumer's step.
    """
    n = len(conns)
    k = k_start
    while not halt.is_set() and (k_end is None or k < k_end):
        w = (k - k_start) % n
        try:
            got = _get(conns[w], procs[w], halt)
        except Exception as e:  # a dead worker, or a batch that cannot be received: report, never hang
            got = ("error", k, _why_not_received(procs[w], e), {})
        if got is None:
            return
        kind, got_k, payload, metrics = got
        if kind == "ok":
            try:
                payload = readers[w].take(payload)
            except Exception as e:  # e.g. the worker died before handing over a new slot's memory
                kind, payload = "error", _why_not_received(procs[w], e)
        item: _Item = [kind, got_k, payload, metrics, w]
        put_until_stopped(ready, item, halt)
        del got, payload, item  # the batch's memory is released when the consumer drops it
        if kind != "ok":
            return
        k += 1


def _why_not_received(proc: Any, error: BaseException) -> str:
    """Names a worker that died (the usual reason a batch cannot be received), else the error itself."""
    proc.join(timeout=1.0)
    if not proc.is_alive():
        return f"loader worker {proc.name} exited with code {proc.exitcode} without sending its batch"
    return f"cannot receive a batch from loader worker {proc.name}: {type(error).__name__}: {error}"


def _get(conn: Any, proc: Any, halt: threading.Event) -> tuple[str, int, Any, dict[str, int]] | None:
    """The next message from one worker; None once `halt` is set."""
    while not halt.is_set():
        if conn.poll(0.1):
            try:
                return conn.recv()
            except EOFError:
                pass
        elif proc.is_alive():
            continue
        raise RuntimeError(
            f"loader worker {proc.name} exited with code {proc.exitcode} without sending its batch"
        ) from None
    return None


def _take(ready: queue.Queue[_Item], receiver: threading.Thread, procs: list[Any]) -> _Item:
    """The next received item; an error, never a hang, once the receiver or a worker is gone."""
    while True:
        try:
            return ready.get(timeout=0.5)
        except queue.Empty:
            if not receiver.is_alive() and ready.empty():
                raise RuntimeError("the loader's receiving thread stopped without a batch") from None
            # Workers live until the consumer stops them: one that is gone will never send its batch.
            for p in procs:
                if not p.is_alive():
                    raise RuntimeError(
                        f"loader worker {p.name} exited with code {p.exitcode} without sending its batch"
                    ) from None
