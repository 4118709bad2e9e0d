"""Checkpoints: one file per rank with model shard, optimizer, scheduler, RNG, iteration and loader state.

Layout::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000010/tp00_pp00_dp00.pt

Model weights and (non-distributed) optimizer state are the same on every DP rank, so a resume with a
different DP size reads the files of DP rank 0; the distributed optimizer's shards are gathered to DP rank 0
on save (megatron-core's "dp_zero" format) and re-scattered on load, so it can change DP size too.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

TRACKER = "latest_checkpointed_iteration.txt"


def rank_file(root: str, iteration: int, tp: int, pp: int, dp: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"tp{tp:02d}_pp{pp:02d}_dp{dp:02d}.pt"


def _distopt_file(root: str, iteration: int, tp: int, pp: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"distopt_tp{tp:02d}_pp{pp:02d}.pt"


def _uses_distributed_optimizer(optimizer: Any) -> bool:
    return bool(getattr(optimizer.config, "use_distributed_optimizer", False))


@contextlib.contextmanager
def _step_state_set_aside(optimizer: Any):
    """torch's AdamW (the fallback without Apex/TE) keeps "step" in each parameter's state, which
    megatron-core's distributed-optimizer state files do not hold (the step is restored from the param
    groups by ``load_state_dict``); the loader would look for it there. Set it aside while loading, and give
    every parameter its own step tensor again (``load_state_dict`` shares one, which torch's foreach AdamW
    would then increment once per parameter)."""
    aside = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if "step" in state:
                aside.append((state, state.pop("step")))
    try:
        yield
    finally:
        for state, step in aside:
            state["step"] = step.clone()


def _coords() -> tuple[int, int, int]:
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(
    root: str, iteration: int, model: Any, optimizer: Any, scheduler: Any, loader_state: dict[str, Any]
) -> None:
    """Collective: every rank writes its file; rank 0 then updates the tracker file."""
    tp, pp, dp = _coords()
    path = rank_file(root, iteration, tp, pp, dp)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _uses_distributed_optimizer(optimizer):
        # collective over DP: DP rank 0 writes the gathered (DP-size independent) parameter state
        optimizer.save_parameter_state(str(_distopt_file(root, iteration, tp, pp)))
    payload = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "loader": loader_state,
        "layout": {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
        },
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = Path(root) / TRACKER
        tracker.with_suffix(".tmp").write_text(str(iteration))
        os.replace(tracker.with_suffix(".tmp"), tracker)
    dist.barrier()


def latest_iteration(root: str) -> int | None:
    """The iteration recorded in ``root``'s tracker file, or None when there is no checkpoint."""
    tracker = Path(root) / TRACKER
    return int(tracker.read_text().strip()) if tracker.exists() else None


def load_model_weights(model: Any, state: dict[str, Any], source: Path) -> None:
    """Loads a weights-only state dict; only megatron-core's ``_extra_state`` entries may be absent."""
    prefix = ""
    keys = list(model.state_dict())
    while keys and all(k.startswith(prefix + "module.") for k in keys):
        prefix += "module."
    result = model.load_state_dict({prefix + k: v for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{source} does not fit this model (missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}): "
            "convert the checkpoint with the same TP/PP and model config"
        )


def load_checkpoint(
    root: str, model: Any, optimizer: Any, scheduler: Any
) -> tuple[int, dict[str, Any] | None]:
    """Restore a checkpoint saved with the same TP x PP (any DP); returns (iteration, loader state).

    A weights-only checkpoint (``mmpack convert hf-to-mcore``) restores the model alone: (0, None).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {root} (missing {TRACKER})")
    tp, pp, dp = _coords()
    own = rank_file(root, iteration, tp, pp, dp)
    zero = rank_file(root, iteration, tp, pp, 0)
    if not zero.exists():
        raise FileNotFoundError(
            f"{zero} is missing: the checkpoint was saved with another tensor/pipeline layout"
        )
    base = torch.load(zero, map_location="cpu", weights_only=False)
    if "optimizer" not in base:
        load_model_weights(model, base["model"], zero)
        return 0, None
    model.load_state_dict(base["model"])
    optimizer.load_state_dict(base["optimizer"])
    if _uses_distributed_optimizer(optimizer):
        # no_grad: it copies into views of parameters that require grad
        with _step_state_set_aside(optimizer), torch.no_grad():
            optimizer.load_parameter_state(str(_distopt_file(root, iteration, tp, pp)))
    scheduler.load_state_dict(base["scheduler"])
    same_layout = own.exists() and base["layout"]["dp"] == ps.get_data_parallel_world_size()
    mine = torch.load(own, map_location="cpu", weights_only=False) if same_layout else base
    if same_layout:
        _set_rng_state(mine["rng"])
    return iteration, mine["loader"]
