"""The blended order of a mixture: which source fills each position of the global stream, the one place where it
is decided (each source's own bins come in its own order, `mmpack.dataloader.order`).

Item j of source k (weights w normalised to sum 1, a seeded phase p_k in [0, 1)) sits at virtual time
(j + p_k) / w_k; the blended stream is every source's items by virtual time (ties: lower source first). So
over any n consecutive positions source k gets n * w_k items, off by at most about the number of sources:
smooth, never source after source. The stream is cut into chunks of virtual time `BLEND_CHUNK`, each worked out
on its own, so position s is found without walking the positions before it.

A stage of a curriculum starts at a global position `origin` with each source at a stream position
`offsets[k]` (what it had consumed so far): a resume with new weights starts a new stage, and each source
continues where it stopped. Everything is a pure function of (weights, seed, origin, offsets, position).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmpack.dataloader.bounded_files import short_repr
from mmpack.dataloader.order import StreamOrder

BLEND_CHUNK = 1024  # virtual time of one chunk: about this many positions


def _phases(seed: int, num_sources: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x626C656E64]).random(num_sources)


def _items_before(weights: np.ndarray, phases: np.ndarray, chunk: int) -> np.ndarray:
    """Items of each source at virtual times before chunk `chunk` starts (int64 [K])."""
    return np.maximum(0, np.ceil(chunk * BLEND_CHUNK * weights - phases)).astype(np.int64)


@dataclass(frozen=True)
class BlendChunk:
    """The positions of one chunk: `first` (global, from the stage start), source and index in that source."""

    first: int
    sources: np.ndarray
    indices: np.ndarray


def blend_chunk(weights: np.ndarray, seed: int, chunk: int) -> BlendChunk:
    """Chunk `chunk` of the blend of `weights` (normalised) under `seed`."""
    phases = _phases(seed, len(weights))
    lo, hi = _items_before(weights, phases, chunk), _items_before(weights, phases, chunk + 1)
    src = np.repeat(np.arange(len(weights), dtype=np.int64), hi - lo)
    idx = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(lo, hi)])
    times = (idx + phases[src]) / weights[src]
    order = np.lexsort((src, times))
    return BlendChunk(first=int(lo.sum()), sources=src[order], indices=idx[order])


def normalised_weights(weights: Sequence[float]) -> np.ndarray:
    """`weights` scaled to sum 1; a ValueError where one is not a finite number > 0, or is so much smaller than
    another that its share is 0 (its items would never come: the blend would look for them for ever)."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"blend weights must be positive numbers, got {short_repr(weights)}") from None
    if w.ndim != 1 or not len(w) or not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"blend weights must be positive finite numbers, got {short_repr(weights)}")
    w = w / w.max()  # the largest is 1: the sum cannot overflow (1e308 + 1e308)
    w = w / w.sum()
    if not (w > 0).all():
        raise ValueError(
            f"blend weights span too wide a range to share one stream, got {short_repr(weights)}"
        )
    return w


def blend_positions(
    weights: Sequence[float], seed: int, start: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within that source) of stage positions [start, start + count): the stateless form."""
    return BlendOrder(weights, seed).positions(start, count)


class BlendOrder:
    """`blend_chunk` over a run of positions (a few chunks memoised)."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        self.weights, self.seed = normalised_weights(weights), seed
        self._phases = _phases(seed, len(self.weights))
        self._chunks: OrderedDict[int, BlendChunk] = OrderedDict()

    def _chunk(self, c: int) -> BlendChunk:
        if c not in self._chunks:
            self._chunks[c] = blend_chunk(self.weights, self.seed, c)
            while len(self._chunks) > 4:
                self._chunks.popitem(last=False)
        return self._chunks[c]

    def _before(self, c: int) -> int:
        return int(_items_before(self.weights, self._phases, c).sum())

    def counts(self, n: int) -> np.ndarray:
        """Items of each source among the first `n` positions (int64 [K])."""
        if n == 0:
            return np.zeros(len(self.weights), dtype=np.int64)
        c = self._chunk_of(n - 1)
        chunk = self._chunk(c)
        out = _items_before(self.weights, self._phases, c)
        return out + np.bincount(chunk.sources[: n - chunk.first], minlength=len(self.weights))

    def _chunk_of(self, position: int) -> int:
        c = position // BLEND_CHUNK
        while c > 0 and self._before(c) > position:
            c -= 1
        while self._before(c + 1) <= position:
            c += 1
        return c

    def positions(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within source) of positions [start, start + count)."""
        if start < 0 or count < 0:
            raise ValueError(f"positions need start, count >= 0, got {start}, {count}")
        src, idx = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        done = 0
        c = self._chunk_of(start) if count else 0
        while done < count:
            chunk = self._chunk(c)
            lo = start + done - chunk.first
            take = min(count - done, len(chunk.sources) - lo)
            src[done : done + take] = chunk.sources[lo : lo + take]
            idx[done : done + take] = chunk.indices[lo : lo + take]
            done += take
            c += 1
        return src, idx


@dataclass(frozen=True)
class BlendStage:
    """Where the current weights took over: global stream position `origin`, each source's stream position then."""

    origin: int = 0
    offsets: tuple[int, ...] = ()


class BlendedStream:
    """The chained stream of a mixture: combined bin ids (source k's bin b is `bases[k] + b`) at global positions.

    Has the `positions(start, count)` of `StreamOrder`, so the rank assignment (`micro_batch_bins`) and compute
    balancing work on it unchanged.
    """

    def __init__(
        self,
        streams: Sequence[StreamOrder],
        weights: Sequence[float],
        seed: int,
        stage: BlendStage | None = None,
    ) -> None:
        self.streams = list(streams)
        self.blend = BlendOrder(weights, seed)
        self.stage = stage or BlendStage(offsets=(0,) * len(self.streams))
        if len(self.stage.offsets) != len(self.streams) or len(self.blend.weights) != len(self.streams):
            raise ValueError("a blend needs one weight and one offset per source")
        sizes = [s.manifest.num_bins for s in self.streams]
        self.bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._lock = threading.Lock()  # a worker's prefetch thread asks for positions too

    def source_positions(self, position: int) -> np.ndarray:
        """Each source's stream position (bins it has given) once the global stream reaches `position`."""
        if position < self.stage.origin:
            raise ValueError(f"position {position} is before this blend stage (from {self.stage.origin})")
        with self._lock:
            return np.asarray(self.stage.offsets, dtype=np.int64) + self.blend.counts(
                position - self.stage.origin
            )

    def positions(self, start: int, count: int) -> np.ndarray:
        """Combined bin ids at global stream positions [start, start + count)."""
        if start < self.stage.origin:
            raise ValueError(f"position {start} is before this blend stage (from {self.stage.origin})")
        out = np.empty(count, dtype=np.int64)
        with self._lock:
            src, idx = self.blend.positions(start - self.stage.origin, count)
            for k, stream in enumerate(self.streams):
                mine = np.flatnonzero(src == k)
                if len(mine):  # a source's items in a run of positions are consecutive in its own stream
                    first = self.stage.offsets[k] + int(idx[mine[0]])
                    out[mine] = self.bases[k] + stream.positions(first, len(mine))
        return out

    def split(self, combined: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source ids, bin ids within the source) of combined bin ids."""
        src = np.searchsorted(self.bases, np.asarray(combined, dtype=np.int64), side="right") - 1
        return src, combined - self.bases[src]
