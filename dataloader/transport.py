"""Moving micro-batches from a worker process to the consumer through reused shared-memory slots.

Pickling a batch through a pipe copies it three times and wakes both processes per 64 KiB; sending tensors
as torch shared-memory handles costs a new segment and a round trip to the sender per tensor. Instead each
worker owns `num_slots` shared-memory buffers, allocated once and grown only when a batch does not fit. The
worker copies a batch's arrays into its next slot and sends a small message (slot index, array layout,
non-array values); the consumer copies the arrays out into tensors of its own and frees the slot, so the
batches it hands on never alias memory a worker will overwrite.

Slots are used round-robin and freed in the same order (each worker's batches are received in order), so a
semaphore counting free slots is all the synchronisation needed. A slot travels through the queue as a
tensor only when it is new or has grown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 64  # array offsets inside a slot, so any dtype view is aligned


@dataclass(frozen=True)
class SlotMessage:
    """What travels through the queue for one batch."""

    slot: int
    buffer: torch.Tensor | None  # the slot's shared buffer when new or grown since its last use
    arrays: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (key, dtype str, shape, byte offset)
    values: dict[str, Any]  # everything that is not a numpy array, sent by value
    order: tuple[str, ...]  # the batch's keys in their original order


def _layout(batch: dict[str, Any]) -> tuple[list[tuple[str, np.ndarray, int]], int]:
    """The arrays of `batch` with their byte offsets in a slot, and the bytes they need."""
    placed = []
    end = 0
    for key, value in batch.items():
        if isinstance(value, np.ndarray):
            arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d arrays 0-d
            placed.append((key, arr, end))
            end += -(-arr.nbytes // ALIGN) * ALIGN
    return placed, end


class SlotWriter:
    """The worker side: writes batches into its slots, waiting for a free one."""

    def __init__(self, num_slots: int, free_slots: Any, stop: Any) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots, self.free_slots, self.stop = num_slots, free_slots, stop
        self._buffers: list[torch.Tensor | None] = [None] * num_slots
        self._next = 0

    def put(self, batch: dict[str, Any]) -> SlotMessage | None:
        """Copies `batch` into the next slot once the consumer has freed it; None if stopped meanwhile."""
        while not self.free_slots.acquire(timeout=0.1):
            if self.stop.is_set():
                return None
        slot, self._next = self._next, (self._next + 1) % self.num_slots
        placed, need = _layout(batch)
        buf = self._buffers[slot]
        fresh = buf is None or buf.numel() < need
        if fresh:
            # Grow with headroom (batches vary with the images they hold) so regrowth stays rare.
            size = max(ALIGN, 1 << math.ceil(math.log2(max(need, 1) * 5 // 4 + 1)))
            buf = torch.empty(size, dtype=torch.uint8).share_memory_()
            self._buffers[slot] = buf
        assert buf is not None
        view = buf.numpy()
        for _, arr, offset in placed:
            view[offset : offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        return SlotMessage(
            slot=slot,
            buffer=buf if fresh else None,
            arrays=tuple((key, arr.dtype.str, arr.shape, offset) for key, arr, offset in placed),
            values={k: v for k, v in batch.items() if not isinstance(v, np.ndarray)},
            order=tuple(batch),
        )


class SlotReader:
    """The consumer side of one worker: copies a batch out of its slot into tensors, then frees the slot."""

    def __init__(self, free_slots: Any) -> None:
        self.free_slots = free_slots
        self._buffers: dict[int, np.ndarray] = {}

    def take(self, msg: SlotMessage) -> dict[str, Any]:
        if msg.buffer is not None:
            self._buffers[msg.slot] = msg.buffer.numpy()
        view = self._buffers.get(msg.slot)
        if view is None:
            raise RuntimeError(f"batch in slot {msg.slot} arrived before the slot's buffer")
        arrays: dict[str, Any] = {}
        try:
            for key, dtype, shape, offset in msg.arrays:
                dt = np.dtype(dtype)
                count = math.prod(shape)
                if count:
                    arr = np.frombuffer(view, dtype=dt, count=count, offset=offset).reshape(shape).copy()
                else:
                    arr = np.empty(shape, dtype=dt)
                arrays[key] = torch.from_numpy(arr)
        finally:
            self.free_slots.release()
        return {key: arrays[key] if key in arrays else msg.values[key] for key in msg.order}
