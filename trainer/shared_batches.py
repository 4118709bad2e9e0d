"""The one owner of how a micro-batch reaches the TP, PP and CP ranks of a DP replica: one read and one image
decode per DP replica, on TP rank 0 and CP rank 0 of the first pipeline stage, which takes the step's
micro-batches (`mmpack.packing.batch.MicroBatch`) from the loader; the other ranks of its model-parallel group
receive them by broadcast, as Megatron-LM's ``get_batch_on_this_tp_rank`` does. The loader itself knows only DP
ranks.

- the other CP ranks of the first stage get the whole micro-batches (pixels included: the vision tower runs on
  every CP rank) over the CP group; each takes its share of the tokens in the trainer
  (`mmpack.trainer.context_parallel`);
- later pipeline stages get, from the first stage over the pipeline group, everything but the pixels
  (tokens, the M-RoPE positions the loader computed, cu_seqlens for the packed attention, labels and loss
  mask for the loss; their pixel fields are empty); the loader state travels with them, so every rank can
  report and save it;
- the TP peers of every stage then get their stage's tensors over the TP group (the pixels only on the first
  stage, where the vision tower runs).

megatron-core's ``broadcast_data`` is not used because it takes one dtype per call and reads a zero-sized
dimension as the end of a shape (an image-free micro-batch has ``pixel_values`` of shape [0, D]): here one
object broadcast describes the micro-batches and one flat tensor per dtype carries their data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mmpack.packing.batch import MicroBatch

# the vision tower's inputs: sent to the first stage only
IMAGE_KEYS = ("pixel_values", "pixel_values_videos", "patch_positions")


def reads_data() -> bool:
    """True on the rank of each DP replica that reads and decodes: TP and CP rank 0 of the first stage."""
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.is_pipeline_first_stage()
    )


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _describe(batches: list[MicroBatch[torch.Tensor]], skip: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per micro-batch: field -> ("tensor", dtype, shape), ("empty", dtype, shape past the first axis) for a
    skipped one, or ("value", plain value)."""
    out = []
    for batch in batches:
        entry: dict[str, Any] = {}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                entry[key] = ("value", value)
            elif key in skip:
                entry[key] = ("empty", value.dtype, tuple(value.shape[1:]))
            else:
                entry[key] = ("tensor", value.dtype, tuple(value.shape))
        out.append(entry)
    return out


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # bool travels as bytes


def broadcast_step(
    batches: list[MicroBatch[torch.Tensor]] | None,
    extra: Any,
    *,
    group: Any,
    src: int,
    skip: tuple[str, ...] = (),
) -> tuple[list[MicroBatch[torch.Tensor]], Any]:
    """Sends ``batches`` (and a picklable ``extra``) from global rank ``src`` to every rank of ``group``; the
    fields in ``skip`` arrive empty. Returns what this rank holds afterwards."""
    is_src = dist.get_rank() == src
    meta: list[Any] = [_describe(batches, skip), extra] if is_src and batches is not None else [None, None]
    dist.broadcast_object_list(meta, src=src, group=group)
    layout, extra = meta
    if is_src and batches is not None:
        _send_tensors(batches, layout, group=group, src=src)
        return batches, extra
    device = _device()
    fields: list[dict[str, Any]] = [
        {
            k: d[1] if d[0] == "value" else torch.empty((0, *d[2]), dtype=d[1], device=device)
            for k, d in e.items()
        }
        for e in layout
    ]
    _receive_tensors(fields, layout, group=group, src=src)
    return [MicroBatch(**f) for f in fields], extra


def _tensor_slots(layout: list[dict[str, Any]]) -> dict[torch.dtype, list[tuple[int, str, tuple[int, ...]]]]:
    """dtype -> the (micro-batch, field, shape) of every tensor sent, in one fixed order."""
    slots = [(i, k, d) for i, entry in enumerate(layout) for k, d in entry.items() if d[0] == "tensor"]
    return {
        dtype: [(i, k, d[2]) for i, k, d in slots if d[1] == dtype]
        for dtype in sorted({d[1] for _, _, d in slots}, key=str)
    }


def _send_tensors(
    batches: list[MicroBatch[torch.Tensor]], layout: list[dict[str, Any]], *, group: Any, src: int
) -> None:
    device = _device()
    for dtype, mine in _tensor_slots(layout).items():
        wire = _wire_dtype(dtype)
        flat = torch.cat([getattr(batches[i], k).reshape(-1).to(wire) for i, k, _ in mine]).to(device)
        dist.broadcast(flat, src=src, group=group)


def _receive_tensors(
    fields: list[dict[str, Any]], layout: list[dict[str, Any]], *, group: Any, src: int
) -> None:
    device = _device()
    for dtype, mine in _tensor_slots(layout).items():
        numel = sum(int(torch.Size(shape).numel()) for _, _, shape in mine)
        flat = torch.empty(numel, dtype=_wire_dtype(dtype), device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i, k, shape in mine:
            n = int(torch.Size(shape).numel())
            fields[i][k] = flat[offset : offset + n].view(shape).to(dtype)
            offset += n


class SharedStepBatches:
    """The step's micro-batches on every rank of a model-parallel group, read on one of them.

    ``source`` (a :class:`mmpack.trainer.data.StepBatches`) exists on the reading rank only. The data wait of the
    other ranks is the time until their broadcast arrived.
    """

    def __init__(self, source: Any | None) -> None:
        self.source = source
        self._state: dict[str, Any] | None = None

    def next_step(self) -> tuple[list[MicroBatch[torch.Tensor]], float]:
        start = time.perf_counter()
        batches: list[MicroBatch[torch.Tensor]] | None = None
        state = None
        wait_s = 0.0
        if self.source is not None:
            batches, wait_s = self.source.next_step()
            state = self.source.state_dict()
        tp_first = ps.get_tensor_model_parallel_rank() == 0
        if ps.get_context_parallel_world_size() > 1 and tp_first and ps.is_pipeline_first_stage():
            batches, state = broadcast_step(
                batches, state, group=ps.get_context_parallel_group(),
                src=ps.get_context_parallel_global_ranks()[0],
            )  # fmt: skip
        if ps.get_pipeline_model_parallel_world_size() > 1 and tp_first:
            batches, state = broadcast_step(
                batches, state, group=ps.get_pipeline_model_parallel_group(),
                src=ps.get_pipeline_model_parallel_first_rank(), skip=IMAGE_KEYS,
            )  # fmt: skip
        if ps.get_tensor_model_parallel_world_size() > 1:
            batches, state = broadcast_step(
                batches, state, group=ps.get_tensor_model_parallel_group(),
                src=ps.get_tensor_model_parallel_src_rank(),
                skip=() if ps.is_pipeline_first_stage() else IMAGE_KEYS,
            )  # fmt: skip
        assert batches is not None
        self._state = state
        return batches, wait_s if self.source is not None else time.perf_counter() - start

    def state_dict(self) -> dict[str, Any]:
        if self.source is not None:
            return self.source.state_dict()
        return dict(self._state or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)
        self._state = dict(state)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def shared_step_batches(build: Callable[[], Any]) -> SharedStepBatches:
    """The step batches of this rank: ``build()`` (a loader) only where :func:`reads_data`."""
    return SharedStepBatches(build() if reads_data() else None)
