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

Both take their ``--out`` by the ownership rule (:mod:`mmpack.packing.ownership`): a new, empty or
mmpack-marked folder. ``hf-to-mcore`` refuses a training run's folder (its tracker would go back to iteration
0); ``mcore-to-hf`` into an earlier export replaces that export's files (the shards its index lists too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmpack.packing.errors import MmpackError
from mmpack.packing.ownership import claim_folder, open_owned
from mmpack.packing.processes import ProcessDiedError, describe_exit, exit_with_parent
from mmpack.trainer.models import family_of, read_hf_config

if TYPE_CHECKING:
    from mmpack.trainer.lora.spec import LoraSpec
    from mmpack.trainer.models.protocol import ModelArch, ModelFamily

TIMEOUT_MINUTES = 10.0  # a converter rank waits this long in a collective for the others (as the trainer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF folder -> megatron-core checkpoint, built at a TP x PP layout")
    p.add_argument(
        "--hf", required=True, help="folder written by save_pretrained (config.json + safetensors)"
    )
    p.add_argument(
        "--out",
        required=True,
        help="checkpoint folder to write: new, empty or an earlier conversion, never a training run's (then "
        "--load it with --finetune)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the weights are cut for")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size the layers are split for")
    p = sub.add_parser(
        "mcore-to-hf", help="megatron-core checkpoint -> HF folder (config.json + safetensors)"
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder (its latest iteration is exported)")
    p.add_argument("--out", required=True, help="HF folder to write (new, empty, or an earlier export)")
    p.add_argument(
        "--no-verify-checkpoint", action="store_true", help="skip checking the files against their checksums"
    )
    p.add_argument(
        "--lora-format",
        choices=("peft", "merged"),
        default=None,
        help="a LoRA run's checkpoint: peft writes a PEFT adapter folder, merged the HF weights of --hf-model "
        "with the adapters merged in",
    )
    p.add_argument("--hf-model", default=None, help="--lora-format merged: the base model's HF folder")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", help="show tracebacks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_stage(
    hf_config: dict[str, Any], tp: int, pp: int
) -> tuple[ModelFamily[ModelArch], ModelArch, Any]:
    """(family, arch, this rank's stage model) with megatron-core's parallel state at TP x PP."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mmpack.trainer.config import ParallelConfig, RunConfig, build_megatron_configs

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
    from megatron.core import parallel_state as ps

    from mmpack.trainer.checkpoint_commit import HF_CONFIG_NAME, commit, staging_dir
    from mmpack.trainer.checkpoint_watch import save_watched

    _init_rank(rank, world, port)
    try:
        hf_config = read_hf_config(hf_dir)
        fam, arch, model = _build_stage(hf_config, tp, pp)
        fam.hf.load_stage_weights(
            model, hf_dir, arch,
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        )  # fmt: skip
        folder = staging_dir(out, 0)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = {
            "iteration": 0,
            "layout": {"tp": tp, "pp": pp, "dp": 1},
            "model_config": hf_config,
            "model": model.sharded_state_dict(),
        }
        save_watched(state, str(folder))
        if rank == 0:
            (Path(out) / HF_CONFIG_NAME).write_text(json.dumps(hf_config, indent=2))
        commit(out, 0)  # checksums, iter_0000000, then the tracker
    finally:
        dist.destroy_process_group()


def load_tp1_model(
    ckpt: str, *, verify: bool = True, lora: LoraSpec | None = None, hf_model: str | None = None
) -> tuple[ModelFamily[ModelArch], ModelArch, Any, dict[str, Any]]:
    """(family, arch, whole model at TP1 x PP1, HF config dict) from the newest complete iteration of
    ``ckpt`` (its files verified unless ``verify`` is False), in a process whose one-rank process group is
    initialised (megatron-core's parallel state is set up here). A LoRA run's checkpoint (``lora``) holds the
    adapters and what else trained: the model gets the adapters, its base weights from ``hf_model`` if given."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from mmpack.trainer.checkpoint import (
        describe_load_error,
        load_common,
        open_iteration,
        unreadable_checkpoint,
    )
    from mmpack.trainer.checkpoint_commit import CHECKSUMS, iteration_dir

    iteration, warnings = open_iteration(ckpt, verify=verify)
    if iteration is None:
        raise ValueError(f"{ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    for warning in warnings:
        print(warning, file=sys.stderr)
    folder = iteration_dir(ckpt, iteration)
    hf_config = load_common(ckpt, iteration).get("model_config")
    if not hf_config:
        raise ValueError(f"{folder} records no model_config (the HF config.json of the model)")
    fam, arch, model = _build_stage(hf_config, 1, 1)
    request = model.sharded_state_dict()
    if lora is not None:
        from mmpack.trainer.lora.layer import add_lora
        from mmpack.trainer.models.hf_weights import model_rules

        if hf_model:
            fam.hf.load_stage_weights(model, hf_model, arch, tp_rank=0, tp_size=1)
        add_lora(model, model_rules(fam.hf.part_rules, arch, model), lora, tp_rank=0, tp_size=1, seed=0)
        saved = dist_checkpointing.load_tensors_metadata(str(folder))
        request = {k: v for k, v in model.sharded_state_dict().items() if getattr(v, "key", None) in saved}
    try:
        state = dist_checkpointing.load({"model": request}, str(folder), strict="raise_unexpected")
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        if verify and (folder / CHECKSUMS).is_file():  # its files are as saved: not a damaged one
            raise ValueError(f"checkpoint {folder} could not be read: {describe_load_error(e)}") from e
        raise unreadable_checkpoint(ckpt, iteration, e, verified=verify) from e
    model.load_state_dict(state["model"], strict=False)
    return fam, arch, model, hf_config


def _lora_export(
    ckpt: str, out: str, verify: bool, lora_format: str | None, hf_model: str | None
) -> tuple[dict[str, Any] | None, Any]:
    """A LoRA run's export: (HF tensors to write as the model, the config.json dict), or (None, None) once
    the PEFT folder is written; (None, False) for a checkpoint of no LoRA run."""
    from safetensors.torch import save_file

    from mmpack.trainer.lora import export
    from mmpack.trainer.lora.peft_io import merge_adapter_shards
    from mmpack.trainer.lora.spec import is_lora_param

    spec = export.checkpoint_spec(ckpt)
    if spec is None:
        if lora_format:
            raise ValueError(f"--lora-format: {ckpt} holds the checkpoints of a run without LoRA")
        return None, False
    if lora_format is None or (lora_format == "merged" and not hf_model):
        raise ValueError(
            f"{ckpt} holds a LoRA run's adapters: give --lora-format peft (a PEFT adapter folder) or "
            "--lora-format merged --hf-model DIR (the base model's folder, the adapters merged in)"
        )
    fam, arch, model, hf_config = load_tp1_model(ckpt, verify=verify, lora=spec, hf_model=hf_model)
    params = {name: p.detach() for name, p in model.named_parameters()}
    adapters = merge_adapter_shards(
        fam.hf.stage_rules(arch, 0, 1), [{n: p for n, p in params.items() if is_lora_param(n)}]
    )
    if lora_format == "merged":
        base = {n: p for n, p in params.items() if not is_lora_param(n)}
        weights = fam.hf.hf_state_dict(arch, {(0, 0): base}, 1, 1)
        return export.merge_into(weights, adapters, spec.scale), hf_config
    root = Path(out)
    written = root / "adapter_model.safetensors.tmp"
    save_file(export.peft_tensors(adapters), str(written), metadata={"format": "pt"})
    os.chmod(written, 0o666 & ~_umask())
    os.replace(written, root / "adapter_model.safetensors")
    (root / "adapter_config.json").write_text(json.dumps(export.peft_config(spec, hf_model), indent=2))
    return None, None


def _mcore_to_hf_rank(
    rank: int, port: int, ckpt: str, out: str, verify: bool, lora_format: str | None = None,
    hf_model: str | None = None,
) -> None:  # fmt: skip
    import torch.distributed as dist
    from safetensors.torch import save_file

    _init_rank(rank, 1, port)
    try:
        tensors, hf_config = _lora_export(ckpt, out, verify, lora_format, hf_model)
        if tensors is None and hf_config is None:
            return  # the PEFT folder is written
        if tensors is None:
            fam, arch, model, hf_config = load_tp1_model(ckpt, verify=verify)
            # parameters, and buffers a family's rules also write (Gemma 4's layer scalars)
            params = {name: t.detach() for name, t in [*model.named_buffers(), *model.named_parameters()]}
            tensors = fam.hf.hf_state_dict(arch, {(0, 0): params}, 1, 1)
        root = Path(out)
        written = root / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(written),
                  metadata={"format": "pt"})  # fmt: skip
        os.chmod(written, 0o666 & ~_umask())  # safetensors writes 0600; an export is a file like any other
        open_owned(out, "hf-export").remove_recorded(_old_export_files(root))
        os.replace(written, root / "model.safetensors")
        (root / "config.json").write_text(json.dumps(hf_config, indent=2))
    finally:
        dist.destroy_process_group()


def _umask() -> int:
    """This process's umask, read without changing it (Linux: /proc; elsewhere set and put back)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _old_export_files(root: Path) -> list[str]:
    """The files of an earlier (sharded) export that the new one does not overwrite: the index and the shards
    it lists. Whatever else is in the folder stays."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"{index} is not a safetensors index ({e}); remove it or give another --out"
        ) from None
    return [index.name, *sorted(shards - {"model.safetensors"})]


def _refuse_training_run(out: str) -> None:
    """``out`` may hold a conversion (iteration 0), never a training run's checkpoints."""
    from mmpack.trainer.checkpoint_commit import TRACKER, complete_iterations, latest_iteration

    newest = max([*complete_iterations(out), latest_iteration(out) or 0])
    if newest > 0:
        raise ValueError(
            f"--out {out} holds the checkpoints of a training run (up to iteration {newest}): converting into it "
            f"would point its {TRACKER} at iteration 0 and the next --load would restart the run there; give "
            "a new folder"
        )


def _init_rank(rank: int, world: int, port: int) -> None:
    """CPU backend and the gloo group of one converter rank; a collective waits at most TIMEOUT_MINUTES. The
    first call of each rank process (the entry point there: a started rank inherits nothing of convert's run)."""
    import torch.distributed as dist

    from mmpack.trainer import cpu_backend

    exit_with_parent()  # a killed `mmpack convert` takes its ranks with it
    cpu_backend.activate()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(minutes=TIMEOUT_MINUTES),
    )  # fmt: skip


def _spawn(fn: Any, nprocs: int, args: tuple, start_method: str) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes; the first that fails or dies stops the others, with one
    error naming it.

    Deaths are seen by polling each process's exit (``waitpid``): torch's ``join`` alone waits on pipes that a
    rank's own children (its checkpoint writers) inherit, so a killed rank with a live writer went unseen."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    try:
        while not context.join(timeout=0.5):
            failed = [i for i, p in enumerate(context.processes) if p.exitcode not in (None, 0)]
            if failed:
                raise _failure(context, failed[0])
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1]
        message = last.split(": ", 1)[-1] if "Error" in last else last
        if last.startswith(f"{ProcessDiedError.__module__}.{ProcessDiedError.__name__}:"):
            raise ProcessDiedError(message) from None  # a rank's checkpoint writer died
        raise ValueError(message) from e
    except mp.ProcessExitedException as e:
        raise ProcessDiedError(
            f"converter process {e.error_pid} (rank {e.error_index} of {nprocs}) {describe_exit(e.exit_code)}; "
            "the other ranks were stopped and the output is incomplete"
        ) from None
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
            p.join()


def _failure(context: Any, index: int) -> Exception:
    """torch's exception for process ``index`` of ``context``, which ended non-zero: its own error (from the
    file torch's wrapper writes), or how it ended."""
    import pickle

    import torch.multiprocessing as mp

    process = context.processes[index]
    if os.access(context.error_files[index], os.R_OK):
        with open(context.error_files[index], "rb") as f:
            trace = pickle.load(f)
        return mp.ProcessRaisedException(trace, index, process.pid)
    return mp.ProcessExitedException("", index, process.pid, process.exitcode)


def hf_to_mcore(hf_dir: str, out: str, tp: int, pp: int, *, start_method: str = "spawn") -> Path:
    """Writes the weights-only dist checkpoint at ``out``; returns its iteration folder. ``start_method``
    of the rank processes: "fork" only from a process that has started no threads (the command line)."""
    from mmpack.trainer.checkpoint_commit import claim_checkpoint_folder, iteration_dir

    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    _refuse_training_run(out)  # clear errors before any process starts
    config = read_hf_config(hf_dir)
    fam = family_of(config)
    fam.hf.check_hf_weights(hf_dir, fam.arch_from_hf_config(config))
    claim_checkpoint_folder(out, role="checkpoint folder (--out)")
    _spawn(_hf_to_mcore_rank, tp * pp, (tp * pp, _free_port(), hf_dir, out, tp, pp), start_method)
    return iteration_dir(out, 0)


def mcore_to_hf(
    ckpt: str, out: str, *, verify: bool = True, start_method: str = "spawn", lora_format: str | None = None,
    hf_model: str | None = None,
) -> Path:  # fmt: skip
    """Writes ``out/config.json`` and ``out/model.safetensors`` (an earlier export there replaced, shards and
    index included); returns the weights file (``start_method``: as :func:`hf_to_mcore`'s). A LoRA run's
    checkpoint: ``lora_format`` peft writes ``out/adapter_config.json`` and ``out/adapter_model.safetensors``
    (returns the latter), merged the weights of ``hf_model`` with the adapters merged in."""
    from mmpack.trainer.checkpoint_commit import latest_iteration

    if latest_iteration(ckpt) is None:
        raise ValueError(f"{ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    claim_folder(out, "hf-export", role="HF export folder (--out)")
    args = (_free_port(), ckpt, out, verify, lora_format, hf_model)
    _spawn(_mcore_to_hf_rank, 1, args, start_method)
    return Path(out) / ("adapter_model.safetensors" if lora_format == "peft" else "model.safetensors")


def _preload() -> None:
    """Imports what every rank process needs once, here, so that forked ranks start at once (a rank started
    by "spawn" imports it all again)."""
    import megatron.core.dist_checkpointing  # noqa: F401

    import mmpack.trainer.checkpoint_watch
    import mmpack.trainer.config  # noqa: F401


def run(args: argparse.Namespace) -> int:
    _preload()
    method = "fork" if threading.active_count() == 1 else "spawn"  # fork a process of one thread only
    try:
        if args.direction == "hf-to-mcore":
            folder = hf_to_mcore(args.hf, args.out, args.tp, args.pp, start_method=method)
            print(
                f"wrote {folder} (TP {args.tp} x PP {args.pp}); train from it with --load {args.out} --finetune"
            )
        else:
            weights = mcore_to_hf(
                args.ckpt, args.out, verify=not args.no_verify_checkpoint, start_method=method,
                lora_format=args.lora_format, hf_model=args.hf_model,
            )  # fmt: skip
            config = "adapter_config.json" if args.lora_format == "peft" else "config.json"
            print(f"wrote {weights} and {config}")
    except (ValueError, FileNotFoundError, MmpackError, ProcessDiedError) as e:
        if args.debug:
            raise
        print(f"mmpack convert: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ProcessDiedError) else 2
    return 0
