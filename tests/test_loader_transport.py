"""Shared-memory slots between loader workers and the consumer (dataloader.transport)."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import numpy as np
import pytest
import torch

from dataloader.transport import SlotMessage, SlotReader, SlotWriter


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


def test_batches_round_trip_and_survive_slot_reuse() -> None:
    """Every dtype/shape arrives intact; a batch taken earlier is not changed when its slot is rewritten."""
    free, stop = threading.Semaphore(2), threading.Event()
    writer, reader = SlotWriter(2, free, stop), SlotReader(free)
    rng = np.random.default_rng(0)
    sent, got, grown = [], [], 0
    for i in range(7):
        batch = _batch(rng, n_patches=[0, 3, 50, 2, 400, 1, 0][i])  # sizes force slot growth and reuse
        msg = writer.put(batch)
        assert isinstance(msg, SlotMessage)
        grown += msg.buffer is not None
        sent.append(batch)
        got.append(reader.take(msg))
    assert 2 <= grown < 7  # slots are allocated once per slot, and again only when a batch outgrows one
    for batch, received in zip(sent, got):
        _same(batch, received)


def test_writer_waits_for_a_free_slot_and_gives_up_when_stopped() -> None:
    free, stop = threading.Semaphore(1), threading.Event()
    writer = SlotWriter(1, free, stop)
    assert writer.put({"x": np.ones(3)}) is not None
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(writer.put({"x": np.ones(3)})))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive()  # the only slot is still held by the consumer
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive() and result == [None]


def _produce(q: Any, free: Any, stop: Any, n: int) -> None:
    writer = SlotWriter(3, free, stop)
    rng = np.random.default_rng(1)
    for i in range(n):
        q.put(writer.put(_batch(rng, n_patches=(i * 37) % 90)))
    stop.wait()


def test_across_processes() -> None:
    ctx = mp.get_context("fork")
    q, free, stop = ctx.Queue(maxsize=2), ctx.Semaphore(3), ctx.Event()
    proc = ctx.Process(target=_produce, args=(q, free, stop, 12), daemon=True)
    proc.start()
    try:
        reader = SlotReader(free)
        rng = np.random.default_rng(1)
        for i in range(12):
            _same(_batch(rng, n_patches=(i * 37) % 90), reader.take(q.get(timeout=30)))
    finally:
        stop.set()
        proc.join(timeout=10)
    assert proc.exitcode == 0


def test_rejects_no_slots() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        SlotWriter(0, threading.Semaphore(1), threading.Event())
