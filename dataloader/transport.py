"""Moving micro-batches from a worker process to the consumer through reused shared-memory slots, zero-copy.

Pickling a batch through a pipe copies it three times; sending tensors as torch shared-memory handles costs
a new segment and a round trip to the sender per tensor. Instead each worker writes a batch's arrays into
one of its shared-memory slots (allocated once, reused) and sends a small message: slot id, array layout,
non-array values. The consumer's tensors are views of the slot, so receiving costs no copy.

A slot is reused only once the consumer has dropped every tensor and view of the batch it holds: the
batch's arrays all hang off one per-batch array whose finalizer clears the slot's flag in a shared byte
array. A consumer that keeps batches simply keeps their slots; the worker allocates new ones (and past
`MAX_SLOTS` sends batches by value), so holding batches never stalls the workers. How far a worker runs
ahead is bounded separately, by a semaphore the consumer releases as it takes each batch.

Slots hold in memory what their batch needs, not the largest batch seen: a slot's buffer may be larger (room
to grow), but the pages past the current batch are given back (madvise MADV_REMOVE on the shared mapping), and
a free slot too small for a batch is replaced by a larger buffer under the same id rather than kept beside it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 64  # array offsets inside a slot, so any dtype view is aligned
MAX_SLOTS = 1024  # per worker; beyond that (a consumer holding that many batches) batches travel by value
HANDOVER_MAX_BYTES = 4 << 20  # a message carries several batches only while they are this small together
TRIM_MIN_BYTES = 1 << 20  # pages past a slot's batch are given back once they are at least this many
IN_PLACE_MIN_BYTES = 4096  # an array smaller than this is copied into the slot even when made in place
_MADV_REMOVE = 9  # linux: free the shared memory behind a range of a shared mapping


def _load_libc() -> Any:
    """The C library (for madvise), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def _give_back_pages(buffer: torch.Tensor, start: int, end: int) -> bool:
    """Frees the shared pages of bytes [start, end) of `buffer` (rounded inwards to pages); False if the
    system refused (the pages then stay, which costs memory, not correctness)."""
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi <= lo:
        return True
    if _LIBC is None:
        return False
    addr = buffer.data_ptr()
    if addr % page:
        return False
    return bool(_LIBC.madvise(ctypes.c_void_p(addr + lo), ctypes.c_size_t(hi - lo), _MADV_REMOVE) == 0)


@dataclass(frozen=True)
class SlotMessage:
    """What travels through the pipe for one batch."""

    slot: int  # -1: no slot, the arrays are in `values`
    buffer: torch.Tensor | None  # the slot's shared buffer, when the slot is new or has a new buffer
    arrays: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (key, dtype str, shape, byte offset)
    nbytes: int  # bytes of the slot the arrays span
    values: dict[str, Any]  # everything not in the slot, sent by value
    order: tuple[str, ...]  # the batch's keys in their original order


def new_slot_flags(ctx: Any) -> Any:
    """The shared per-slot 'held by the consumer' flags of one worker (0 = free)."""
    return ctx.RawArray("B", MAX_SLOTS)


def _layout(batch: dict[str, Any], first: str | None = None) -> tuple[list[tuple[str, np.ndarray, int]], int]:
    """The arrays of `batch` with their byte offsets in a slot (`first` at offset 0), and the bytes they need."""
    placed = []
    end = 0
    keys = list(batch) if first is None else [first] + [k for k in batch if k != first]
    for key in keys:
        value = batch[key]
        if isinstance(value, np.ndarray):
            arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d arrays 0-d
            placed.append((key, arr, end))
            end += -(-arr.nbytes // ALIGN) * ALIGN
    return placed, end


class SlotWriter:
    """The worker side: waits until it may run one more batch ahead, then writes it into a free slot."""

    def __init__(self, flags: Any, ahead: Any, stop: Any) -> None:
        self.flags, self.ahead, self.stop = flags, ahead, stop
        self._buffers: list[torch.Tensor] = []  # slot id -> its shared buffer
        # slot id -> bytes of it that may be in memory (written, not given back)
        self._resident: list[int] = []
        self._unsent: set[int] = set()  # slots whose (new) buffer the consumer has not been sent yet
        self._staged = -1  # the slot `stage` handed out for the next batch
        self._dtype_names: dict[np.dtype, str] = {}  # `dtype.str` builds its string anew at each call

    def wait_for_room(self) -> bool:
        """Blocks until the consumer has taken enough batches; False if stopped meanwhile."""
        while not self.ahead.acquire(timeout=0.1):
            if self.stop.is_set():
                return False
        return True

    def try_room(self) -> bool:
        """Takes room for one more batch if there is some now (never blocks)."""
        return bool(self.ahead.acquire(False))

    def give_room(self, n: int) -> None:
        """Gives back room for `n` batches taken with `try_room` and not used."""
        for _ in range(n):
            self.ahead.release()

    def resident_bytes(self) -> int:
        """Bytes of this worker's slots that may be in memory."""
        return sum(self._resident)

    def stage(self, nbytes: int, room_after: int = 0) -> np.ndarray:
        """The first `nbytes` of a free slot (uint8), for the next batch's largest array to be written in
        place: `put` leaves it there (no copy). The slot has room for `room_after` more bytes after it.
        With every slot held, a private array (which `put` copies or sends as usual)."""
        slot = self._free_slot(nbytes + room_after)
        if slot < 0:
            return np.empty(nbytes, dtype=np.uint8)
        self._ensure(slot, nbytes + room_after)
        self._staged = slot
        return self._buffers[slot].numpy()[:nbytes]

    def put(self, batch: dict[str, Any]) -> SlotMessage:
        """Copies `batch` into a free slot (a new one if none fits) and returns the message announcing it; an
        array written in place (`stage`) stays where it is."""
        staged, self._staged = self._staged, -1
        in_place = None
        if staged >= 0:
            start = self._buffers[staged].data_ptr()
            for key, value in batch.items():
                # Small arrays are not looked at (looking up an address costs about as much as copying them).
                big = isinstance(value, np.ndarray) and value.nbytes >= IN_PLACE_MIN_BYTES
                if big and value.ctypes.data == start:
                    in_place = key
                    break
        placed, need = _layout(batch, first=in_place)
        values = {k: v for k, v in batch.items() if not isinstance(v, np.ndarray)}
        slot = staged if in_place is not None else self._free_slot(need)
        if slot < 0:  # every slot is held by the consumer: send by value
            return SlotMessage(
                slot=-1, buffer=None, arrays=(), nbytes=0, values=dict(batch), order=tuple(batch)
            )
        before = self._buffers[slot] if slot < len(self._buffers) else None
        self._ensure(slot, need)  # may give the slot a new buffer: then the array made in place is copied too
        moved = self._buffers[slot] is not before
        view = self._buffers[slot].numpy()
        for key, arr, offset in placed:
            if arr.nbytes and (moved or key != in_place):
                view[offset : offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        if self._resident[slot] - need >= TRIM_MIN_BYTES:
            if _give_back_pages(self._buffers[slot], need, self._resident[slot]):
                self._resident[slot] = need
        else:
            self._resident[slot] = max(self._resident[slot], need)
        self.flags[slot] = 1  # held until the consumer drops the batch
        new_buffer = slot in self._unsent
        self._unsent.discard(slot)
        return SlotMessage(
            slot=slot,
            buffer=self._buffers[slot] if new_buffer else None,
            arrays=tuple(
                (key, self._dtype_name(arr.dtype), arr.shape, offset) for key, arr, offset in placed
            ),
            nbytes=need,
            values=values,
            order=tuple(batch),
        )

    def _dtype_name(self, dtype: np.dtype) -> str:
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = dtype.str
        return name

    def _ensure(self, slot: int, need: int) -> None:
        """Makes slot `slot` (possibly a new id) hold `need` bytes: a new buffer if it has none or a smaller
        one (the old one is freed once the consumer unmaps it too), announced with the next batch in it."""
        if slot < len(self._buffers) and self._buffers[slot].numel() >= need:
            return
        # Room to grow (batches vary with the images they hold), given back until a batch uses it.
        size = max(ALIGN, 1 << math.ceil(math.log2(max(need, 1) * 5 // 4 + 1)))
        buffer = torch.empty(size, dtype=torch.uint8).share_memory_()
        # Making it shared wrote every page: give them all back, the batch brings in what it writes.
        resident = 0 if _give_back_pages(buffer, 0, size) else size
        if slot == len(self._buffers):
            self._buffers.append(buffer)
            self._resident.append(resident)
        else:
            self._buffers[slot], self._resident[slot] = buffer, resident
        self._unsent.add(slot)

    def _free_slot(self, need: int) -> int:
        """The smallest free slot holding `need` bytes; else a free one to grow (`put` replaces its buffer);
        else a new slot id; or -1 when none may be made."""
        best = grow = -1
        for slot, buf in enumerate(self._buffers):
            if self.flags[slot] != 0:
                continue
            if buf.numel() >= need:
                if best < 0 or buf.numel() < self._buffers[best].numel():
                    best = slot
            elif grow < 0 or buf.numel() > self._buffers[grow].numel():
                grow = slot
        if best >= 0:
            return best
        if grow >= 0:
            return grow
        return len(self._buffers) if len(self._buffers) < MAX_SLOTS else -1


def _release(flags: Any, slot: int) -> None:
    flags[slot] = 0


class SlotReader:
    """The consumer side of one worker: turns a message into tensors that view the slot (no copy)."""

    def __init__(self, flags: Any, ahead: Any) -> None:
        self.flags, self.ahead = flags, ahead
        self._buffers: dict[int, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}

    def take(self, msg: SlotMessage) -> dict[str, Any]:
        self.ahead.release()  # the worker may make another batch
        if msg.slot < 0:
            return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in msg.values.items()}
        if msg.buffer is not None:
            self._buffers[msg.slot] = msg.buffer.numpy()
        view = self._buffers.get(msg.slot)
        if view is None:
            raise RuntimeError(f"batch in slot {msg.slot} arrived before the slot's buffer")
        # Every array below is a view of `lease` (numpy keeps a view's base at the first array whose base is
        # not an array, here the memoryview), so `lease` dies, and frees the slot, with the batch's last view.
        lease = np.frombuffer(view.data[: msg.nbytes], dtype=np.uint8)
        weakref.finalize(lease, _release, self.flags, msg.slot)
        arrays: dict[str, torch.Tensor] = {}
        for key, dtype, shape, offset in msg.arrays:
            kind = self._dtypes.get(dtype)
            if kind is None:
                kind = self._dtypes[dtype] = np.dtype(dtype)
            arr = np.ndarray(shape, dtype=kind, buffer=lease, offset=offset)
            arrays[key] = torch.from_numpy(arr)
        return {key: arrays[key] if key in arrays else msg.values[key] for key in msg.order}
