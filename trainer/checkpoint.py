"""Checkpoints with megatron-core ``dist_checkpointing``: every rank writes only its own shards, and a
checkpoint loads under another TP, PP or DP size than it was saved with (the tensors are stored by their
global shape; ``dist_checkpointing`` reshards on load).

Layout (as Megatron-LM's)::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000010/        metadata.json, common.pt, *.distcp (torch_dist format), checksums.json

How an iteration is written, committed and verified is :mod:`mmpack.trainer.checkpoint_commit`'s.

What one checkpoint holds:

- ``model``: the sharded state dict of this stage's model, vision tower included (decoder layers by their
  global number, TP shards by their offset in the full tensor); under the interleaved pipeline one entry per
  model chunk, ``model0``, ``model1``, ... (Megatron-LM's keys). The shards are named by global layer
  either way, so a checkpoint saved with chunks loads without them and the other way round. Under LoRA only
  the parameters that train (the adapters: the frozen base is --hf-model's);
- ``optimizer``: megatron-core's sharded optimizer state in model space (the distributed optimizer's
  ``fully_reshardable`` format), so the optimizer reshards like the model;
- ``scheduler``, ``iteration``, the ``layout`` (TP, PP, DP, CP) and the ``model_config`` (HF config.json);
- ``rng``: the Python, NumPy, torch (CPU and CUDA) and tensor-parallel tracker states of every rank (a
  (PP, TP, DP x CP) grid: at CP 1 the (PP, TP, DP) grid of checkpoints from before CP);
- ``loader``: the loader state of every DP rank.

RNG states are restored only under the layout they were saved with (the states of another layout do not
map onto this one's ranks); the loader state is global (epoch, bins consumed), so any DP size continues the
same stream.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from mmpack.trainer.checkpoint_commit import (
    CHECKSUMS,
    CorruptCheckpointError,
    commit,
    iteration_dir,
    previous_good,
    remove_iteration_folder,
    resolve_iteration,
    staging_dir,
    verify_checkpoint,
)
from mmpack.trainer.checkpoint_commit import TRACKER as TRACKER  # re-exported: names this module used to own
from mmpack.trainer.checkpoint_commit import latest_iteration as latest_iteration
from mmpack.trainer.checkpoint_watch import (
    AsyncSaveWatch,
    save_request,
    save_watched,
    started_process,
    watched_request,
)
from mmpack.trainer.lora.spec import is_lora_param

# The distributed optimizer's reshardable format: its flat buffers are all-gathered over DP and cut back into
# tensors of the parameters' shapes (so they reshard like the model); the writes stay spread over ranks.
# A mixture of experts under EP > 1 has two optimizers (dense and expert parameters) and one under EP 1:
# their states keep the parameters' keys, without the chained optimizer's per-optimizer prefix.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Fields of the HF config that fix the shapes of the weights: a checkpoint loads only into the same values.
ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "tie_word_embeddings", "depth", "num_heads", "out_hidden_size", "patch_size",
    "temporal_patch_size", "spatial_merge_size", "in_channels",
)  # fmt: skip


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the model of this run (and cannot be resharded into it)."""


def bare_module(model: Any) -> Any:
    """The stage's model without the DDP / Float16Module wrappers (checkpoint keys do not depend on them)."""
    return unwrap_model(model, (DistributedDataParallel, Float16Module))


def _chunks(model: Any) -> list[Any]:
    """The model chunks of this stage: a list (interleaved pipeline) or one model."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_sharded_state_dict(model: Any) -> dict[str, Any]:
    """``{"model": ...}`` of one chunk, ``{"model0": ..., "model1": ...}`` of the interleaved pipeline's; with
    LoRA only the parameters that train (the adapters; the frozen base comes from --hf-model)."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": _trained_part(bare_module(chunks[0]))}
    return {f"model{i}": _trained_part(bare_module(c)) for i, c in enumerate(chunks)}


def _trained_part(module: Any) -> dict[str, Any]:
    """The module's sharded state dict; under LoRA only the entries of the parameters that train."""
    state = module.sharded_state_dict()
    params = dict(module.named_parameters())
    if not any(is_lora_param(name) for name in params):
        return state
    return {key: value for key, value in state.items() if key in params and params[key].requires_grad}


def _load_model_state(model: Any, state: dict[str, Any]) -> None:
    chunks = _chunks(model)
    for i, chunk in enumerate(chunks):
        bare_module(chunk).load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict=False)


def layout() -> dict[str, int]:
    """TP, PP, DP and CP sizes, and ``vp``, the model chunks per stage (1 without the interleaved
    pipeline)."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "vp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "cp": ps.get_context_parallel_world_size(),
    }


def _describe_layout(lay: dict[str, int]) -> str:
    vp, cp = lay.get("vp", 1), lay.get("cp", 1)
    return (
        f"TP {lay['tp']} x PP {lay['pp']}{f' (VP {vp})' if vp > 1 else ''}{f' x CP {cp}' if cp > 1 else ''} "
        f"x DP {lay['dp']}"
    )


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rank_coords() -> tuple[int, int, int]:
    return (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )


def _rng_object(lay: dict[str, int], state: Any) -> ShardedObject:
    """One RNG state per rank of a (PP, TP, DP x CP) grid (the CP ranks of a DP rank hold their own)."""
    coords = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    grid = (lay["pp"], lay["tp"], lay["dp"] * lay.get("cp", 1))
    return ShardedObject("rng_state", state, grid, coords, replica_id=0)


def _loader_object(dp_size: int, dp_rank: int, state: Any, replica: int) -> ShardedObject:
    """One loader state per DP rank (the same on every TP rank and stage of it: one of them writes)."""
    return ShardedObject("loader_state", state, (dp_size,), (dp_rank,), replica_id=replica)


def _state_for_save(
    iteration: int, model: Any, optimizer: Any, scheduler: Any, loader_state: dict, model_config: dict
) -> dict[str, Any]:
    lay = layout()
    pp_rank, tp_rank, dp_rank = _rank_coords()
    model_sd = model_sharded_state_dict(model)
    return {
        "iteration": iteration,
        "layout": lay,
        "model_config": model_config,
        "scheduler": scheduler.state_dict(),
        **model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_METADATA),
        "rng": _rng_object(lay, _rng_state()),
        "loader": _loader_object(
            lay["dp"],
            dp_rank,
            loader_state,
            replica=(ps.get_context_parallel_rank() * lay["tp"] + tp_rank) * lay["pp"] + pp_rank,
        ),
    }


class CheckpointWriter:
    """Saves checkpoints, synchronously or (``async_save``) in forked writer processes while training goes
    on; an iteration is committed (checksums, rename, tracker) only once every rank has written it."""

    def __init__(self, root: str, *, async_save: bool = False) -> None:
        self.root = root
        self.async_save = async_save
        self.queue = AsyncCallsQueue() if async_save else None
        self.watch: AsyncSaveWatch | None = None  # the async save in flight

    def save(
        self,
        iteration: int,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        loader_state: dict,
        model_config: dict,
    ) -> None:
        """Collective. ``model``: this stage's model, or the list of its chunks (interleaved pipeline).
        Returns once the shards are written (sync) or handed to the writer (async)."""
        self.finalize(blocking=True)  # one checkpoint in flight at a time
        folder = staging_dir(self.root, iteration)
        if dist.get_rank() == 0:
            remove_iteration_folder(self.root, folder)  # left by a save of this iteration that did not finish
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = _state_for_save(iteration, model, optimizer, scheduler, loader_state, model_config)
        if not self.async_save:
            save_watched(state, str(folder))
            commit(self.root, iteration)
            return
        request = save_request(state, str(folder))
        watch = AsyncSaveWatch(dist.get_rank(), f"iteration {iteration} in {folder}")
        request = watched_request(request, report=watch.send_end)
        request.add_finalize_fn(lambda: commit(self.root, iteration))
        queue = self.queue
        assert queue is not None
        watch.started(started_process(lambda: queue.schedule_async_request(request)))
        self.watch = watch
        if request.async_fn is None:  # nothing to write on this rank: no process to watch
            watch.conn.close()
            self.watch = None

    def finalize(self, *, blocking: bool = False) -> None:
        """Completes finished async saves (all of them when ``blocking``); raises
        :class:`~mmpack.packing.processes.ProcessDiedError` on the rank whose writer died. Collective."""
        if self.watch is not None and self.watch.check(blocking=blocking):
            self.watch = None
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        self.finalize(blocking=True)
        if self.queue is not None:
            self.queue.close()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def _allocate_state_for_load(optimizer: Any) -> None:
    """torch's Adam (the fallback without Apex/TE) allocates its state lazily, and the distributed optimizer
    needs it allocated to describe what it loads: one step on zero gradients with lr and weight decay 0
    (leaves the weights as they are; the loaded state then replaces it)."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) or not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        opt._init_optimizer_states_with_dummy_values()
        for g, (lr, wd) in zip(inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer: Any) -> Iterator[None]:
    """The distributed optimizer copies every entry of a parameter's Adam state from the loaded tensors, but
    its fully reshardable format holds no "step" (Apex/TE's Adam keeps none; torch's Adam, the fallback
    without them, does and gets it from the param groups): keep the step it already set."""
    patched = []
    for opt in _inner_optimizers(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def set_states(model_param: Any, tensors: dict, opt: Any = opt, original: Any = original) -> None:
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group_index]["params"][group_order]
            step = opt.optimizer.state[main].get("step")
            if step is not None and "step" not in tensors:
                tensors = {**tensors, "step": step}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _unshare_step_counters(optimizer: Any) -> None:
    """After a load, torch's Adam may hold one "step" tensor shared by all parameters, which its foreach
    implementation would then increment once per parameter: give each parameter its own."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _describe(config: dict[str, Any]) -> str:
    text = {**config, **(config.get("text_config") or {})}
    vision = config.get("vision_config") or {}
    parts = [f"{k}={text[k]}" for k in ARCH_KEYS if k in text and k not in vision]
    parts += [f"vision.{k}={vision[k]}" for k in ARCH_KEYS if k in vision]
    return f"{config.get('model_type')} ({', '.join(parts)})"


def check_model_config(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """Raises :class:`CheckpointMismatchError` naming both models when their weight shapes differ."""
    if _describe(saved) != _describe(current):
        raise CheckpointMismatchError(
            f"checkpoint {where} holds another model than this run builds: saved {_describe(saved)}; "
            f"this run {_describe(current)}. Load it with the model it was saved with (its hf_config.json "
            "or --hf-model of the same architecture)"
        )


def load_checkpoint(
    root: str,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    model_config: dict[str, Any],
    *,
    load_optim: bool = True,
    finetune: bool = False,
    verify: bool = True,
) -> tuple[int, dict[str, Any] | None, str]:
    """Restores the latest checkpoint under ``root`` into this run (``model``: one model or this stage's
    chunks), at any TP x PP x DP, with or without the interleaved pipeline.

    Returns (iteration, loader state, message). ``finetune`` loads the weights only (iteration 0, fresh
    optimizer, scheduler and data stream); ``load_optim=False`` keeps a fresh optimizer. A folder without a
    checkpoint (missing, empty, or only files the trainer writes before its first save) starts at 0.
    The newest complete iteration is loaded (see :func:`open_iteration`), its files verified first unless
    ``verify`` is False.
    """
    iteration, warnings = open_iteration(root, verify=verify)
    if iteration is None:
        return 0, None, f"no checkpoint in {root}: training starts at iteration 0"
    folder = iteration_dir(root, iteration)
    common = load_common(root, iteration)
    check_model_config(common.get("model_config") or {}, model_config, folder)
    saved_layout: dict[str, int] = {"vp": 1, "cp": 1, **common["layout"]}
    lay = layout()
    dp_rank = ps.get_data_parallel_rank()
    model_sd = model_sharded_state_dict(model)
    request: dict[str, Any] = dict(model_sd)
    weights_only = "scheduler" not in common  # written by `mmpack convert hf-to-mcore`
    restore_training = not finetune and not weights_only
    if restore_training and load_optim:
        _allocate_state_for_load(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
        )
    same_layout = saved_layout == lay
    if restore_training:
        # one RNG state per (PP, TP, DP x CP) rank: it fits whenever those sizes are the same
        if all(saved_layout[k] == lay[k] for k in ("tp", "pp", "dp", "cp")):
            request["rng"] = _rng_object(lay, None)
        saved_dp = saved_layout["dp"]
        # every rank reads all of them: only rank 0's request counts as the main replica
        request["loaders"] = [
            _loader_object(saved_dp, i, None, replica=dist.get_rank()) for i in range(saved_dp)
        ]
    try:
        state = dist_checkpointing.load(request, str(folder))
    except (Exception, CheckpointException) as e:  # several types for missing/mismatched/unreadable shards
        if not verify or not (folder / CHECKSUMS).is_file():  # a damaged file is as likely as a mismatch
            raise unreadable_checkpoint(root, iteration, e, verified=verify) from e
        raise CheckpointMismatchError(
            f"checkpoint {folder} (saved at {_describe_layout(saved_layout)}) does not load into this run "
            f"({_describe_layout(lay)}): {' '.join(_full_text(e).split())[:800]}"
        ) from e
    _load_model_state(model, state)
    prefix = "".join(f"{w}\n" for w in warnings)
    if not restore_training:
        why = "a weights-only checkpoint" if weights_only else "--finetune"
        return (
            0,
            None,
            f"{prefix}loaded weights of iteration {iteration} from {root} ({why}: starting at iteration 0)",
        )
    if load_optim:
        with _torch_adam_step_kept(optimizer):
            optimizer.load_state_dict(state["optimizer"])
        _unshare_step_counters(optimizer)
    scheduler.load_state_dict(common["scheduler"])
    if "rng" in state:
        _set_rng_state(state["rng"])
    loaders = state["loaders"]
    if saved_layout["dp"] == lay["dp"]:
        loader = loaders[dp_rank]
    else:
        if any(s != loaders[0] for s in loaders):
            raise CheckpointMismatchError(
                f"checkpoint {folder}: the DP ranks' loader states differ (saved inside a step), so it resumes "
                f"only at DP {saved_layout['dp']}, not {lay['dp']}"
            )
        loader = loaders[0]
    notes = [] if same_layout else [f"resharded from {_describe_layout(saved_layout)}"]
    if not load_optim:
        notes.append("optimizer state not loaded (--no-load-optim)")
    suffix = f" ({'; '.join(notes)})" if notes else ""
    return iteration, loader, f"{prefix}resumed from {root} at iteration {iteration}{suffix}"


def open_iteration(root: str | Path, *, verify: bool = True) -> tuple[int | None, list[str]]:
    """Collective when ``verify``: (iteration to load, warnings), None without a checkpoint. The tracker's
    iteration, or the newest complete one before it when that is missing or incomplete; its files checked
    against their checksums (:class:`CorruptCheckpointError` naming the bad file otherwise)."""
    iteration, warning = resolve_iteration(root)
    warnings = [warning] if warning else []
    if iteration is not None:
        note = verify_checkpoint(root, iteration) if verify else "files not verified (--no-verify-checkpoint)"
        warnings += [f"note: {note}"] if note else []
    return iteration, warnings


def load_common(root: str | Path, iteration: int) -> dict[str, Any]:
    """The common (non-sharded) state of an iteration; :class:`CorruptCheckpointError` naming the folder
    and the previous good iteration when it cannot be read."""
    folder = iteration_dir(root, iteration)
    try:
        return dist_checkpointing.load_common_state_dict(str(folder))
    except Exception as e:  # a truncated or missing common.pt / metadata.json: pickle, EOF, OS errors
        raise CorruptCheckpointError(
            f"{folder}: its common state (common.pt, metadata.json) could not be read ({type(e).__name__}: "
            f"{_first_line(e)}); {previous_good(root, iteration)}"
        ) from e


def unreadable_checkpoint(
    root: str | Path, iteration: int, error: BaseException, *, verified: bool
) -> CorruptCheckpointError:
    """The one-line error for an iteration whose files could not be read and were not checked against
    checksums (``verified``: False under --no-verify-checkpoint; True when it has no checksums.json)."""
    folder = iteration_dir(root, iteration)
    if verified:
        why = f"it has no {CHECKSUMS}, written before checksums existed, so its files could not be checked"
    else:
        why = "load without --no-verify-checkpoint to find which"
    return CorruptCheckpointError(
        f"checkpoint {folder} could not be read ({describe_load_error(error)}): a file of it may be damaged "
        f"({why}); {previous_good(root, iteration)}"
    )


def describe_load_error(error: BaseException) -> str:
    """``Type: first line`` of a load error; of torch's ``CheckpointException`` (a ``BaseException`` holding
    each rank's error and traceback), the first failing rank's error."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(error).__name__}: {_first_line(error)}"


def _full_text(e: BaseException) -> str:
    return describe_load_error(e) if isinstance(e, CheckpointException) else str(e)


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else repr(e)
