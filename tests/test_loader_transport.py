"""Shared-memory slots between loader workers and the consumer (mmpack.dataloader.transport)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
from typing import Any

import numpy as np
import pytest
import torch

from mmpack.dataloader import transport
from mmpack.dataloader.transport import SlotMessage, SlotReader, SlotWriter


def _batch(rng: np.random.Generator, n_patches: int) -> dict[str, Any]:
    return {
        "tokens": rng.integers(0, 1 << 40, size=(2, 64), dtype=np.int64),
        "loss_mask": rng.random((2, 64), dtype=np.float32),
        "attention_mask": rng.random((2, 1, 8, 8)) < 0.5,
        "cu_seqlens": np.array([0, 5, 64], dtype=np.int32),
        "pixel_values": rng.random((n_patches, 12), dtype=np.float32),
        "image_grid_thw": np.zeros((0, 3), dtype=np.int64),
        "scalar": np.array(7, dtype=np.uint16),
        "strided": np.arange(40, dtype=np.int16).reshape(5, 8)[:, ::2],
        "bin_count": 2,
        "keys": ["a", "b"],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key, value in a.items():
        if isinstance(value, np.ndarray):
            got = b[key]
            assert isinstance(got, torch.Tensor), key
            np.testing.assert_array_equal(got.numpy(), value)
            assert got.numpy().dtype == value.dtype and got.shape == value.shape
        else:
            assert b[key] == value


def _pair(n_ahead: int = 64) -> tuple[SlotWriter, SlotReader]:
    flags, ahead, stop = (
        mp.get_context("fork").RawArray("B", transport.MAX_SLOTS),
        threading.Semaphore(n_ahead),
        threading.Event(),
    )
    return SlotWriter(flags, ahead, stop), SlotReader(flags, ahead)


def _send(writer: SlotWriter, batch: dict[str, Any]) -> SlotMessage:
    assert writer.wait_for_room()
    return writer.put(batch)


def test_held_batches_keep_their_slots_and_dropped_ones_are_reused() -> None:
    writer, reader = _pair()
    rng = np.random.default_rng(0)
    sent = [_batch(rng, n) for n in (0, 3, 50, 2, 400, 1, 0)]
    held = [reader.take(_send(writer, b)) for b in sent]  # the consumer keeps every batch
    assert len(writer._buffers) == len(sent)  # each held batch has its own slot
    for batch, received in zip(sent, held):
        _same(batch, received)  # nothing was overwritten by later batches
    # Zero-copy: the consumer's tensors are views of the slot the worker wrote.
    assert np.shares_memory(held[2]["pixel_values"].numpy(), writer._buffers[2].numpy())
    keep_view = held[4]["pixel_values"][10:20]  # a view alone keeps its batch's slot
    del held
    gc.collect()
    before = len(writer._buffers)
    again = [_batch(rng, n) for n in (5, 5, 5, 5, 5, 5)]
    for b in again:
        _same(b, reader.take(_send(writer, b)))  # each dropped at once: slots are reused
    assert len(writer._buffers) == before
    np.testing.assert_array_equal(keep_view.numpy(), sent[4]["pixel_values"][10:20])


def test_past_max_slots_batches_travel_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_SLOTS", 3)
    writer, reader = _pair()
    rng = np.random.default_rng(1)
    sent = [_batch(rng, 4) for _ in range(5)]
    msgs = [_send(writer, b) for b in sent]
    assert [m.slot for m in msgs] == [0, 1, 2, -1, -1]
    for batch, msg in zip(sent, msgs):
        _same(batch, reader.take(msg))


def test_writer_waits_for_room_and_gives_up_when_stopped() -> None:
    flags, ahead, stop = mp.get_context("fork").RawArray("B", 8), threading.Semaphore(1), threading.Event()
    writer = SlotWriter(flags, ahead, stop)
    assert writer.wait_for_room()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(writer.wait_for_room()))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # one batch ahead already, not yet taken by the consumer
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive() and result == [False]


def _produce(conn: Any, flags: Any, ahead: Any, stop: Any, n: int) -> None:
    writer = SlotWriter(flags, ahead, stop)
    rng = np.random.default_rng(2)
    for i in range(n):
        assert writer.wait_for_room()
        conn.send(writer.put(_batch(rng, n_patches=(i * 37) % 90)))
    stop.wait()


def test_across_processes() -> None:
    ctx = mp.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    flags, ahead, stop = transport.new_slot_flags(ctx), ctx.Semaphore(2), ctx.Event()
    proc = ctx.Process(target=_produce, args=(send_end, flags, ahead, stop, 12), daemon=True)
    proc.start()
    try:
        reader = SlotReader(flags, ahead)
        rng = np.random.default_rng(2)
        kept = []
        for i in range(12):
            assert recv_end.poll(30)
            got = reader.take(recv_end.recv())
            _same(_batch(rng, n_patches=(i * 37) % 90), got)
            if i % 4 == 0:
                kept.append((i, got))
        rng = np.random.default_rng(2)
        expected = [_batch(rng, n_patches=(i * 37) % 90) for i in range(12)]
        for i, got in kept:  # batches kept by the consumer were never overwritten by the worker
            _same(expected[i], got)
    finally:
        stop.set()
        proc.join(timeout=10)
    assert proc.exitcode == 0


@pytest.mark.parametrize("trim", [True, False])
def test_slot_keeps_in_memory_only_what_its_batch_needs(monkeypatch: pytest.MonkeyPatch, trim: bool) -> None:
    if not trim:  # control: pages past the batch stay, with the old batch's bytes
        monkeypatch.setattr(transport, "TRIM_MIN_BYTES", 1 << 60)
    writer, reader = _pair()
    big = {"x": np.full((3 << 20) // 4, 7.0, dtype=np.float32)}  # 3 MiB: a 4 MiB buffer with room to grow
    got = reader.take(_send(writer, big))
    _same(big, got)
    assert writer.resident_bytes() == 3 << 20  # of a 4 MiB buffer: the room to grow is not in memory
    del got
    gc.collect()
    small = {"x": np.arange(1000, dtype=np.float32), "y": np.ones((3, 5), dtype=np.int16)}
    msg = _send(writer, small)
    assert msg.slot == 0 and msg.buffer is None  # the same slot, reused
    got = reader.take(msg)
    _same(small, got)  # nothing of the big batch leaks into the small one
    buf = writer._buffers[0].numpy()
    tail = buf[-(-msg.nbytes // 4096) * 4096 : 3 << 20]
    if trim:
        assert writer.resident_bytes() == msg.nbytes
        assert not tail.any()  # those pages were given back: they read as zeros now
    else:
        assert writer.resident_bytes() == 3 << 20 and tail.view(np.float32).max() == 7.0
    del got
    gc.collect()
    again = reader.take(_send(writer, big))  # grows back into the same slot, data intact
    _same(big, again)
    assert len(writer._buffers) == 1


def test_free_slot_too_small_grows_under_its_id() -> None:
    writer, reader = _pair()
    rng = np.random.default_rng(3)
    small = _batch(rng, 1)
    got = reader.take(_send(writer, small))
    size = writer._buffers[0].numel()
    large = _batch(rng, 40000)  # far past the first slot's buffer
    held = reader.take(_send(writer, large))  # the small batch is still held: a second slot
    assert len(writer._buffers) == 2
    _same(small, got)
    _same(large, held)
    del got, held
    gc.collect()
    larger = _batch(rng, 90000)
    msg = _send(writer, larger)  # both free, neither big enough: the larger one grows, no third slot
    assert msg.slot == 1 and msg.buffer is not None and len(writer._buffers) == 2
    _same(larger, reader.take(msg))
    assert writer._buffers[0].numel() == size  # the small slot is kept for small batches


@pytest.mark.parametrize("room_after", [1 << 20, 0])
def test_array_written_in_place_is_not_copied(room_after: int) -> None:
    """`stage` hands out a slot's start; `put` leaves the array written there and lays the others after it,
    also when they do not fit in the slot (room_after=0): then the slot grows and everything is copied."""
    writer, reader = _pair()
    rng = np.random.default_rng(4)
    ref = _batch(rng, 3000) | {"big": rng.random(40000)}  # 320 KB after the pixels' 144 KB
    pixels = writer.stage(ref["pixel_values"].nbytes, room_after).view(np.float32).reshape(3000, 12)
    pixels[:] = ref["pixel_values"]
    staged_ptr = pixels.ctypes.data
    batch = dict(ref) | {"pixel_values": pixels}  # keys in the original order
    msg = writer.put(batch)
    got = reader.take(msg)
    _same(ref, got)  # every value, in order, intact
    offsets = {key: offset for key, _, _, offset in msg.arrays}
    assert offsets["pixel_values"] == 0
    if room_after:  # the consumer's pixels are the very bytes written in place
        assert got["pixel_values"].data_ptr() == staged_ptr
    else:
        assert got["pixel_values"].data_ptr() != staged_ptr
    assert len(writer._buffers) == 1
