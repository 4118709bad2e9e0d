"""Pretrain a vision-language model on a packed dataset with megatron-core (TP x PP x DP).

    torchrun --nproc_per_node 8 -m trainer.pretrain_vlm --data-path DIR \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --model-size tiny \\
        --micro-batch-size 1 --global-batch-size 8 --train-iters 20

Without CUDA the same command runs on CPU processes with gloo. ``--help`` lists every flag.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer.arguments import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"pretrain_vlm: error: {e}", file=sys.stderr)
        return 2
    from trainer.training import Trainer, shutdown

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
