"""Megatron-style command-line flags of ``mmpack.trainer.pretrain_vlm``, parsed in one place into :class:`RunConfig`."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mmpack.dataloader.mixture import load_mixture_file, parse_inline
from mmpack.trainer.config import (
    CP_COMM_TYPES,
    LR_DECAY_STYLES,
    MOE_DISPATCHERS,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from mmpack.trainer.exits import ExitConfig
from mmpack.trainer.freeze import parse_modules
from mmpack.trainer.models import FAMILIES
from mmpack.trainer.observability import ObservabilityConfig
from mmpack.trainer.stage_flags import StageFlags, add_stage_flags, refuse_unsupported, resolve_balance

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")

# Model presets: flags given explicitly on the command line override them.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vision_num_layers=2,
        vision_hidden_size=32,
        vision_num_attention_heads=2,
    ),
    "small": dict(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_query_groups=4,
        vision_num_layers=12,
        vision_hidden_size=768,
        vision_num_attention_heads=12,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """All flags, grouped like Megatron-LM's."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m mmpack.trainer.pretrain_vlm",
        description="Train a vision-language model (a model family of mmpack.trainer.models on megatron-core) on a packed "
        "dataset with TP x PP x DP, from a HuggingFace checkpoint (--hf-model) or a small random model (size "
        "flags). Without CUDA it runs on CPU processes with gloo.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--hf-model",
        default=None,
        help="HuggingFace model folder (save_pretrained: config.json + safetensors); each rank reads its "
        "TP/PP slice. Without it a random model is built from the size flags.",
    )
    g.add_argument(
        "--model-type",
        choices=sorted(FAMILIES),
        default="qwen2_5_vl",
        help="random model: its family (HF model_type); with --hf-model its config.json says",
    )
    g.add_argument(
        "--model-size",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="random model: size preset (tiny when not given); explicit size flags override it",
    )
    g.add_argument("--num-layers", type=int, default=None, help="language model layers")
    g.add_argument("--hidden-size", type=int, default=None, help="language model hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="language model heads")
    g.add_argument("--num-query-groups", type=int, default=None, help="key/value heads (GQA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP size (default 4 x hidden)")
    g.add_argument("--vision-num-layers", type=int, default=None, help="vision encoder layers")
    g.add_argument("--vision-hidden-size", type=int, default=None, help="vision encoder hidden size")
    g.add_argument("--vision-num-attention-heads", type=int, default=None, help="vision encoder heads")
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="experts per MoE layer (random model; with --hf-model it must equal config.json's)",
    )
    g.add_argument(
        "--moe-router-topk",
        type=int,
        default=None,
        help="experts per token (random model; with --hf-model it must equal num_experts_per_tok)",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=None,
        help="load-balancing loss coefficient (random model; with --hf-model it must equal "
        "router_aux_loss_coef)",
    )
    g.add_argument(
        "--moe-token-dispatcher-type", choices=MOE_DISPATCHERS, default="allgather",
        help="how tokens reach their experts' ranks (megatron-core's dispatchers; on CPU only allgather)",
    )  # fmt: skip
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="vocab padding multiple")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout on hidden states")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="dropout on attention probs")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of weight init")
    g.add_argument(
        "--freeze-vision",
        action="store_true",
        help="freeze the vision encoder (patch embedding and blocks; the adapter still trains)",
    )
    g.add_argument(
        "--freeze-llm",
        action="store_true",
        help="freeze the language model (embeddings and output layer too)",
    )
    g.add_argument(
        "--trainable-modules",
        default=None,
        nargs="+",
        help="the modules that train (comma- or space-separated), the rest frozen: adapter (merger/projector), "
        "vision_model, language_model, embedding, output_layer; all (the default): everything",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size")
    g.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="EP size: ranks the experts are spread over"
    )
    g.add_argument(
        "--expert-tensor-parallel-size", type=int, default=None,
        help="TP size of each expert (default: --tensor-model-parallel-size)",
    )  # fmt: skip
    g.add_argument("--sequence-parallel", action="store_true", help="shard activations along sequence (TP>1)")
    # context parallelism: each sample's tokens split over CP ranks (mmpack.packing.context_parallel)
    g.add_argument(
        "--context-parallel-size", type=int, default=1,
        help="CP size: every packed sample split over CP ranks in the load-balanced 2xCP chunk layout",
    )  # fmt: skip
    g.add_argument(
        "--cp-comm-type", choices=CP_COMM_TYPES, default="p2p",
        help="how Transformer Engine's THD attention exchanges K/V over CP on GPU (the CPU path all-gathers)",
    )  # fmt: skip
    g.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer state over DP")
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="reduce gradients by bucket during the backward pass",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="distributed optimizer: gather updated parameters by bucket during the next forward pass",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="language layers on the first stage (it also runs the vision tower); the rest split evenly",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers", type=int, default=None, help="language layers on the last stage"
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved pipeline: language layers per model chunk; each stage holds several chunks "
        "(stage 0 the 1st, PP+1st, ...), which shrinks the pipeline bubble. Micro-batches per step must be a "
        "multiple of PP",
    )
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="interleaved pipeline: model chunks per stage (instead of --num-layers-per-virtual-pipeline-stage; "
        "works with --decoder-first/last-pipeline-num-layers when it divides every stage's layers)",
    )

    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="a collective that waits longer than this for the other ranks fails with an error naming the "
        "flag (gloo and NCCL), instead of hanging on a rank that is stuck or gone",
    )

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 master weights")
    g.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    g.add_argument("--fp32-residual-connection", action="store_true", help="keep the residual stream in fp32")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", help="softmax in fp32")
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32", action="store_true", help="fp32 grad buffers/all-reduce"
    )
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16, help="dynamic scale start")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="dynamic scale floor")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="steps without overflow to grow")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before lowering scale")
    fusions = {
        "bias_swiglu_fusion": "fused bias + SwiGLU",
        "bias_dropout_fusion": "fused bias + dropout + residual add",
        "masked_softmax_fusion": "fused scale + mask + softmax (non-TE attention)",
        "gradient_accumulation_fusion": "weight gradients accumulated into the fp32 main grads in the GEMM",
    }
    for name, what in fusions.items():
        g.add_argument(
            f"--no-{name.replace('_', '-')}",
            dest=name,
            action="store_false",
            help=f"turn off {what} (on by default on CUDA with Transformer Engine; never used on CPU)",
        )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=0,
        help="sequences per optimizer step; 0 = micro-batch size x DP (no accumulation)",
    )
    g.add_argument("--seq-length", type=int, default=0, help="0 = the dataset's seq_len")
    g.add_argument("--train-iters", type=int, default=10, help="optimizer steps")
    g.add_argument("--seed", type=int, default=1234, help="model init, data order and RNG seed")
    g.add_argument("--recompute-activations", action="store_true", help="selective recompute (core attn)")
    g.add_argument("--log-interval", type=int, default=1, help="iterations between log lines")
    g.add_argument("--eval-interval", type=int, default=0, help="iterations between evals (0 = never)")
    g.add_argument("--eval-iters", type=int, default=1, help="global batches per eval")
    g.add_argument("--metrics-file", default=None, help="also write each log line as JSON to this file")
    g.add_argument(
        "--debug-overflow-iterations",
        type=int,
        nargs="*",
        default=[],
        help="testing: make the loss infinite at these iterations (checks fp16 step skipping)",
    )

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="final learning rate")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup iterations")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument(
        "--lr-decay-style",
        default="cosine",
        choices=LR_DECAY_STYLES,
        help="decay after warmup",
    )
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0 = off)")

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="packed dataset (folder or s3:// / http(s):// URL), or a weighted mixture: W1 PATH1 W2 PATH2 ...",
    )
    g.add_argument(
        "--data-mixture",
        default=None,
        help="a mixture file (YAML or JSON: sources with path, weight or repeat, name, storage_options)",
    )
    g.add_argument("--eval-data-path", default=None, help="held-out packed dataset for --eval-interval")
    g.add_argument("--mock-data", action="store_true", help="synthetic packed batches, no dataset")
    g.add_argument("--num-workers", type=int, default=2, help="loader worker processes")
    g.add_argument("--data-cache-dir", default=None, help="local cache for remote shards")
    g.add_argument(
        "--balance",
        choices=("none", "compute"),
        default=None,
        help="none (the default) or compute: spread each global batch's bins over DP ranks by compute cost (mmpack.dataloader.balance)",
    )
    g.add_argument(
        "--balance-cost",
        type=_balance_cost,
        default=None,
        metavar="A,B,C,D",
        help="coefficients of the bin cost A*tokens + B*sum(sample_len^2) + C*image_patches + "
        "D*sum(image_patches^2) for --balance compute (e.g. from mmpack.packing.cost.CostModel.fit on measured "
        "step times); default: the FLOP counts of the model being trained",
    )

    g = p.add_argument_group("logging")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard event files here (last rank)")
    g.add_argument(
        "--wandb-project", default=None, help="log to Weights & Biases (offline mode; needs wandb)"
    )
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B offline folder (default: --tensorboard-dir)")
    g.add_argument(
        "--log-timers-to-tensorboard", action="store_true", help="megatron-core timers (max over ranks)"
    )
    g.add_argument("--log-params-norm", action="store_true", help="L2 norm of all parameters")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="zeros in the gradient")
    g.add_argument(
        "--peak-tflops-per-gpu",
        type=float,
        default=None,
        help="for MFU (default: known GPUs' dense bf16 peak)",
    )

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint folder to write")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from")
    g.add_argument("--save-interval", type=int, default=0, help="iterations between saves (0 = end only)")
    g.add_argument(
        "--async-save", action="store_true", help="write checkpoint shards in the background (torch_dist)"
    )
    g.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only from --load: iteration, optimizer, scheduler and data start fresh",
    )
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument(
        "--no-verify-checkpoint",
        action="store_true",
        help="load without checking the checkpoint's files against the checksums saved with them",
    )

    g = p.add_argument_group("exiting early (each saves a checkpoint of the last step with --save)")
    g.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM or SIGUSR1 finish the current step, save a checkpoint of it on every rank and exit 0",
    )
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="exit after this many minutes of wall time (checked after every step)",
    )
    g.add_argument(
        "--exit-interval", type=int, default=None, help="exit at the first multiple of N iterations"
    )
    _add_stage_script_flags(p)
    return p


def _add_stage_script_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM flags of the LLaVA-OneVision-2 stage scripts with a trainer meaning (README's table), then
    those the dataset or mmpack's design settles (trainer/stage_flags.py)."""
    g = p.add_argument_group("Megatron-LM stage-script flags")
    g.add_argument("--split", type=_split_weights, default=None, metavar="TRAIN,VALID,TEST", help="divide --data-path's bins by these weights (e.g. 969,30,1); --eval-interval evaluates the valid part, training reads only the train part")  # fmt: skip
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None, help="activation recompute: full layers, or selective (core attention, as --recompute-activations)")  # fmt: skip
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None, help="full recompute: uniform (chunks of --recompute-num-layers layers) or block (the first --recompute-num-layers layers of each stage)")  # fmt: skip
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per recompute chunk (uniform) or recomputed per stage (block)")  # fmt: skip
    g.add_argument("--custom-pipeline-layers", type=_int_list, default=None, metavar="N0,N1,...", help="language layers of each pipeline stage (the first may be 0: it runs the vision tower); the stages between the first and the last hold equal numbers")  # fmt: skip
    g.add_argument("--custom-pipeline-recompute-layers", type=_int_list, default=None, metavar="R0,R1,...", help="--recompute-num-layers of each pipeline stage (needs --recompute-granularity full)")  # fmt: skip
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="linear warmup over this fraction of the decay iterations (instead of --lr-warmup-iters)")  # fmt: skip
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None, help="NCCL on CUDA (default); without CUDA nccl falls back to gloo with a warning")  # fmt: skip
    g.add_argument("--data-parallel-size", dest="expected_data_parallel_size", type=int, default=None, help="checked: must equal world size / (TP x PP x CP)")  # fmt: skip
    add_stage_flags(p)


def _int_list(text: str) -> tuple[int, ...]:
    """`19,20,20,21` -> (19, 20, 20, 21)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _split_weights(text: str) -> tuple[float, float, float]:
    """Megatron-LM's `969,30,1` (also `/`-separated; missing parts are 0)."""
    try:
        values = [float(v) for v in text.replace("/", ",").split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or min(values) < 0 or sum(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"--split takes up to three weights >= 0 (e.g. 969,30,1), got {text!r}"
        )
    return tuple(values + [0.0] * (3 - len(values)))  # type: ignore[return-value]


def _balance_cost(text: str) -> tuple[float, float, float, float]:
    """`A,B,C,D`: four finite coefficients >= 0."""
    from mmpack.packing.cost import CostModel

    try:
        values = tuple(float(v) for v in text.split(","))
        if len(values) != 4:
            raise ValueError(f"{len(values)} values")
        CostModel.from_coefficients(values)  # the model's own checks: finite, >= 0, one of them > 0
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--balance-cost takes four coefficients >= 0 as A,B,C,D, got {text!r} ({e})"
        ) from None
    return values  # type: ignore[return-value]


# mixture-of-experts flags a model's config.json fixes, checked like its sizes
MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_aux_loss_coeff")


def _size_flags(args: argparse.Namespace) -> tuple[tuple[str, float, str], ...]:
    """(field, value, flag) of every model size the command line sets: by a size flag, or by the
    ``--model-size`` preset where no flag overrides it."""
    fields = {name for preset in MODEL_PRESETS.values() for name in preset} | {"ffn_hidden_size", *MOE_FLAGS}
    given = [
        (k, getattr(args, k), f"--{k.replace('_', '-')}")
        for k in sorted(fields)
        if getattr(args, k) is not None
    ]
    named = {k for k, _, _ in given}
    preset = MODEL_PRESETS[args.model_size] if args.model_size else {}
    return tuple(
        given + [(k, v, f"--model-size {args.model_size}") for k, v in preset.items() if k not in named]
    )


def _config_from_args(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """``cls`` built from the flags named like its fields; ``given`` values take precedence."""
    names = {f.name for f in dataclasses.fields(cls)} - given.keys()
    return cls(**{k: v for k, v in vars(args).items() if k in names}, **given)


def _data_flags(args: argparse.Namespace) -> dict[str, Any]:
    """`--data-path` (one dataset or Megatron's `W1 A W2 B` blend) and `--data-mixture` as DataConfig fields."""
    words = args.data_path or []
    if args.data_mixture and words:
        raise ValueError("give --data-path or --data-mixture, not both")
    if args.data_mixture:
        return {"data_path": None, "data_mixture": load_mixture_file(args.data_mixture)}
    if len(words) > 1:
        return {"data_path": None, "data_mixture": parse_inline(words)}
    return {"data_path": words[0] if words else None, "data_mixture": None}


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse flags into a validated :class:`RunConfig` (raises ``SystemExit``/``ValueError`` on bad input)."""
    args = build_parser().parse_args(argv)
    refuse_unsupported(args)
    args.balance = resolve_balance(args)
    modules = args.trainable_modules
    if modules is not None:  # Megatron-LM's space-separated list, mmpack's comma list, or `all`
        modules = None if modules == ["all"] else parse_modules(",".join(modules))
    preset = MODEL_PRESETS.get(args.model_size or "tiny", {})
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    return RunConfig(
        model=_config_from_args(
            ModelConfig,
            args,
            trainable_modules=modules,
            size_flags=_size_flags(args),
            **size,
        ),
        parallel=_config_from_args(ParallelConfig, args),
        precision=_config_from_args(PrecisionConfig, args),
        optim=_config_from_args(OptimConfig, args),
        train=_config_from_args(
            TrainConfig, args, debug_overflow_iterations=tuple(args.debug_overflow_iterations)
        ),
        data=_config_from_args(DataConfig, args, cache_dir=args.data_cache_dir, **_data_flags(args)),
        checkpoint=_config_from_args(CheckpointConfig, args),
        logging=_config_from_args(ObservabilityConfig, args),
        exit=_config_from_args(ExitConfig, args),
        stage=_config_from_args(StageFlags, args),
    )
