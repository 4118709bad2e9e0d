"""``mmpack convert``: HuggingFace checkpoints <-> the trainer's megatron-core checkpoints.

    mmpack convert hf-to-mcore --hf DIR --out CKPT --tp N --pp M
    mmpack convert mcore-to-hf --ckpt CKPT --out DIR

``hf-to-mcore`` starts N x M CPU processes (gloo), each building its stage of the model at TP N x PP M and
reading only its own slices of the safetensors, and saves them with megatron-core ``dist_checkpointing``
(the trainer's checkpoint format: iteration 0, weights only). Start training from it with
``pretrain_vlm --load CKPT --finetune`` at any TP x PP (dist_checkpointing reshards).

``mcore-to-hf`` loads the latest iteration of a checkpoint (converted or saved by the trainer, any layout)
into one process at TP1 x PP1 and writes ``config.json`` + ``model.safetensors`` that transformers loads.
The round trip is bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

HF_CONFIG_NAME = "hf_config.json"  # the model's config.json, kept beside the trainer's checkpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF folder -> megatron-core checkpoint, built at a TP x PP layout")
    p.add_argument(
        "--hf", required=True, help="folder written by save_pretrained (config.json + safetensors)"
    )
    p.add_argument("--out", required=True, help="checkpoint folder to write (then --load it with --finetune)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the weights are cut for")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the layers are split for")
    p = sub.add_parser(
        "mcore-to-hf", help="megatron-core checkpoint -> HF folder (config.json + safetensors)"
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder (its latest iteration is exported)")
    p.add_argument("--out", required=True, help="HF folder to write")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", help="show tracebacks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_stage(hf_config: dict[str, Any], tp: int, pp: int) -> tuple[Any, Any, Any]:
    """(family, arch, this rank's stage model) with megatron-core's parallel state at TP x PP."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mmpack.trainer.config import ParallelConfig, RunConfig, build_megatron_configs
    from mmpack.trainer.models import family_of

    ps.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    fam = family_of(hf_config)
    arch = fam.arch_from_hf_config(hf_config)
    cfg = RunConfig(parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    parts = build_megatron_configs(cfg, arch).model
    model = fam.build_stage(
        arch, parts, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
    )
    return fam, arch, model


def _hf_to_mcore_rank(rank: int, world: int, port: int, hf_dir: str, out: str, tp: int, pp: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.checkpoint import TRACKER, iteration_dir
    from mmpack.trainer.models import read_hf_config

    cpu_backend.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        hf_config = read_hf_config(hf_dir)
        fam, arch, model = _build_stage(hf_config, tp, pp)
        fam.load_stage_weights(
            model, hf_dir, arch,
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        )  # fmt: skip
        folder = iteration_dir(out, 0)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = {
            "iteration": 0,
            "layout": {"tp": tp, "pp": pp, "dp": 1},
            "model_config": hf_config,
            "model": model.sharded_state_dict(),
        }
        dist_checkpointing.save(state, str(folder))
        dist.barrier()
        if rank == 0:
            (Path(out) / HF_CONFIG_NAME).write_text(json.dumps(hf_config, indent=2))
            (Path(out) / TRACKER).write_text("0")
    finally:
        dist.destroy_process_group()


def load_tp1_model(ckpt: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(family, arch, whole model at TP1 x PP1, HF config dict) from the latest iteration of ``ckpt``, in a
    process whose one-rank process group is initialised (megatron-core's parallel state is set up here)."""
    from megatron.core import dist_checkpointing

    from mmpack.trainer.checkpoint import iteration_dir, latest_iteration

    iteration = latest_iteration(ckpt)
    if iteration is None:
        raise ValueError(f"{ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    folder = iteration_dir(ckpt, iteration)
    hf_config = dist_checkpointing.load_common_state_dict(str(folder)).get("model_config")
    if not hf_config:
        raise ValueError(f"{folder} records no model_config (the HF config.json of the model)")
    fam, arch, model = _build_stage(hf_config, 1, 1)
    state = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(folder), strict="raise_unexpected"
    )
    model.load_state_dict(state["model"], strict=False)
    return fam, arch, model, hf_config


def _mcore_to_hf_rank(rank: int, port: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from mmpack.trainer import cpu_backend

    cpu_backend.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        fam, arch, model, hf_config = load_tp1_model(ckpt)
        params = {name: p.detach() for name, p in model.named_parameters()}
        tensors = fam.hf_state_dict(arch, {(0, 0): params}, 1, 1)
        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(root / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        (root / "config.json").write_text(json.dumps(hf_config, indent=2))
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, nprocs: int, args: tuple) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]
        raise ValueError(last.split(": ", 1)[-1] if "Error" in last else last) from e


def hf_to_mcore(hf_dir: str, out: str, tp: int, pp: int) -> Path:
    """Writes the weights-only dist checkpoint at ``out``; returns its iteration folder."""
    from mmpack.trainer.checkpoint import iteration_dir
    from mmpack.trainer.models import family_of, read_hf_config

    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    config = read_hf_config(hf_dir)
    family_of(config).arch_from_hf_config(config)  # a clear error before any process starts
    _spawn(_hf_to_mcore_rank, tp * pp, (tp * pp, _free_port(), hf_dir, out, tp, pp))
    return iteration_dir(out, 0)


def mcore_to_hf(ckpt: str, out: str) -> Path:
    """Writes ``out/config.json`` and ``out/model.safetensors``; returns the weights file."""
    from mmpack.trainer.checkpoint import latest_iteration

    if latest_iteration(ckpt) is None:
        raise ValueError(f"{ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    _spawn(_mcore_to_hf_rank, 1, (_free_port(), ckpt, out))
    return Path(out) / "model.safetensors"


def run(args: argparse.Namespace) -> int:
    try:
        if args.direction == "hf-to-mcore":
            folder = hf_to_mcore(args.hf, args.out, args.tp, args.pp)
            print(
                f"wrote {folder} (TP {args.tp} x PP {args.pp}); train from it with --load {args.out} --finetune"
            )
        else:
            print(f"wrote {mcore_to_hf(args.ckpt, args.out)} and config.json")
    except (ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"mmpack convert: error: {e}", file=sys.stderr)
        return 2
    return 0
