"""Running the producer: in this process, or in worker processes whose batches are taken in order.

Both runners yield (micro-batch, seconds the consumer waited for it) for micro-batches k_start..k_end-1
and record each worker's storage counters in `metrics`.
"""

from __future__ import annotations

import multiprocessing as mp
import select
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from mmpack.dataloader.collate import BadSampleError
from mmpack.dataloader.storage import ShardError
from mmpack.dataloader.transport import SlotReader, new_slot_flags
from mmpack.dataloader.worker import ProducerSpec, make_producer, to_torch, worker_loop
from mmpack.packing.batch import MicroBatch
from mmpack.packing.processes import ProcessDiedError, describe_exit

Batches = Iterator[list[Any]]  # [micro-batch, seconds waited]


def take_batch(pair: list[Any]) -> Any:
    """Removes and returns the batch of a [batch, wait_s] pair.

    Runners yield mutable pairs and the consumer takes the batch out, so no suspended generator keeps a
    reference to it: a batch's (shared) memory is released when the consumer drops it, not inside the
    next `next()` call, where it would count as data wait.
    """
    batch, pair[0] = pair[0], None
    return batch


def run_in_process(
    spec: ProducerSpec, k_start: int, k_end: int | None, *, metrics: dict[int, dict[str, int]]
) -> Batches:
    """Makes every micro-batch here (num_workers=0); the wait is the time spent making it."""
    producer = make_producer(spec, k_start, k_end)
    k = k_start
    try:
        while k_end is None or k < k_end:
            t0 = time.perf_counter()
            pair = [to_torch(producer.produce(k)), 0.0]
            pair[1] = time.perf_counter() - t0
            metrics[0] = producer.storage_metrics()
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
    handover_batches: int = 1,
) -> Batches:
    """Worker w makes micro-batches k_start + w, + num_workers, ...; they are taken here in order.

    Each worker runs up to `prefetch_batches + handover_batches` small micro-batches ahead, sent up to
    `handover_batches` per message, or `prefetch_batches` large ones (see `worker_loop`). Taking one is a small message whose arrays are
    views of the worker's shared memory (no copy), done in the consumer's thread: a receiving thread would
    add a GIL hand-off per batch for no gain.
    """
    n = num_workers
    method = start_method or ("fork" if sys.platform == "linux" else "spawn")
    ctx: Any = mp.get_context(method)
    stop_ev = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]  # (receiving end, sending end)
    # made ahead, plus the ones being gathered into one message
    ahead = [ctx.Semaphore(prefetch_batches + handover_batches) for _ in range(n)]
    flags = [new_slot_flags(ctx) for _ in range(n)]
    procs = [
        ctx.Process(
            target=worker_loop,
            args=(spec, w, n, k_start, k_end, pipes[w][1], flags[w], ahead[w], stop_ev, handover_batches),
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
    pollers = []  # one poll object per pipe, kept: `Connection.poll` builds a selector at every call
    for conn in conns:
        pollers.append(select.poll())
        pollers[-1].register(conn.fileno(), select.POLLIN)
    readers = [SlotReader(flags[w], ahead[w]) for w in range(n)]
    received: list[deque[Any]] = [deque() for _ in range(n)]  # per worker: batches not yet taken
    watch = _WorkerWatch(procs)
    k = k_start
    try:
        while k_end is None or k < k_end:
            w = (k - k_start) % n
            t0 = time.perf_counter()
            watch.check()  # a dead worker ends the job now, not once its batches would be next
            try:
                if not received[w]:
                    received[w].extend(_get(conns[w], watch, pollers[w]))
                kind, got_k, payload, worker_metrics = received[w].popleft()
                if kind == "ok":
                    payload = MicroBatch(**readers[w].take(payload))
            except ProcessDiedError:
                raise
            except Exception as e:  # a batch that cannot be received: report, never hang
                raise RuntimeError(_why_not_received(procs[w], e)) from None
            wait_s = time.perf_counter() - t0
            if worker_metrics is not None:  # a message's last batch carries its worker's counters
                metrics[w] = worker_metrics
            if kind == "shard_error":
                raise ShardError(payload)
            if kind == "bad_sample":
                raise BadSampleError(payload)
            if kind != "ok":
                raise RuntimeError(f"loader worker {w} failed on micro-batch {got_k}:\n{payload}")
            assert got_k == k, f"worker {w} sent micro-batch {got_k}, expected {k}"
            pair = [payload, wait_s]
            del payload  # the batch's memory is released when the consumer drops it
            yield pair
            k += 1
    finally:
        stop_ev.set()  # workers stop at once and drop unread batches (never drain: a read could block)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():  # SIGKILL: a worker may have inherited the trainer's SIGTERM handler
                p.kill()
                p.join(timeout=5)
        for conn in conns:
            conn.close()


class _WorkerWatch:
    """Raises :class:`ProcessDiedError` naming a worker once one has ended: workers stay until the consumer
    stops them, so any exit before that means one died (killed, out of memory). Looks at most every
    `interval_s` (one `waitpid` per worker)."""

    def __init__(self, procs: list[Any], interval_s: float = 0.1) -> None:
        self.procs, self.interval_s, self.next_s = procs, interval_s, 0.0

    def check(self, *, now: bool = False) -> None:
        t = time.monotonic()
        if not now and t < self.next_s:
            return
        self.next_s = t + self.interval_s
        for proc in self.procs:
            if proc.exitcode is not None:
                raise ProcessDiedError(
                    f"loader worker {proc.name} (pid {proc.pid}) {describe_exit(proc.exitcode)}; the loader "
                    "stops (its batches cannot be made elsewhere)"
                )


def _why_not_received(proc: Any, error: BaseException) -> str:
    """Names a worker that died (the usual reason a batch cannot be received), else the error itself."""
    proc.join(timeout=1.0)
    if not proc.is_alive():
        return f"loader worker {proc.name} {describe_exit(proc.exitcode)} without sending its batch"
    return f"cannot receive a batch from loader worker {proc.name}: {type(error).__name__}: {error}"


def _get(conn: Any, watch: _WorkerWatch, poller: Any) -> list[tuple[str, int, Any, dict[str, int] | None]]:
    """The next message (one or more batches) from one worker; an error, never a hang, once any is gone.

    `poller`: a `select.poll` with the pipe's descriptor registered (readable, or closed by a dead worker)."""
    while not poller.poll(100):
        watch.check(now=True)
    return conn.recv()  # type: ignore[no-any-return]
