"""Pretrain a vision-language model on a packed dataset with megatron-core (TP x PP x DP).

    torchrun --nproc_per_node 8 -m mmpack.trainer.pretrain_vlm --data-path DIR \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --model-size tiny \\
        --micro-batch-size 1 --global-batch-size 8 --train-iters 20

Without CUDA the same command runs on CPU processes with gloo. ``--help`` lists every flag.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence

from mmpack.packing.errors import MmpackError
from mmpack.trainer.failures import describe_failure


def _quiet_cpu_warnings() -> None:
    """Without CUDA, megatron-core's warnings about Apex/Transformer Engine/CUDA settings are expected noise."""
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")
        warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")
        warnings.filterwarnings("ignore", message=r".*using transformer_engine as the transformer.*")


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_cpu_warnings()  # before megatron-core is imported
    from mmpack.trainer.arguments import parse_args

    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"pretrain_vlm: error: {e}", file=sys.stderr)
        return 2
    from mmpack.trainer import cpu_backend
    from mmpack.trainer.exits import ExitSignals
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # without CUDA: gloo and CPU tensors; set up here, by the entry point
    # installed before the data workers and checkpoint writers fork: they inherit it and live on until
    # the trainer stops them at the step boundary
    signals = ExitSignals() if cfg.exit.exit_signal_handler else None
    with signals or contextlib.nullcontext():
        trainer = None
        try:
            trainer = Trainer(cfg, exit_signals=signals)
            trainer.train()
        except Exception as e:
            # a process gone (a helper or a peer rank): each rank says in one line what it saw
            line = describe_failure(e, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
            if line is not None:
                rank = os.environ.get("RANK", "0")
                print(f"pretrain_vlm: error: rank {rank}: {line}", file=sys.stderr, flush=True)
                return 1
            if not isinstance(e, (ValueError, MmpackError)):
                raise
            # what the user can fix: one clear line, not a traceback per rank (a bad sample: by the rank that read it)
            bad_sample = isinstance(e, MmpackError) and e.reason == "bad_sample"
            if os.environ.get("RANK", "0") == "0" or bad_sample:
                print(f"pretrain_vlm: error: {e}", file=sys.stderr)
            return 2
        finally:
            if trainer is not None:
                trainer.close()
            shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
