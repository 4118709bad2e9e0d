"""Configuration of the trainer: one frozen dataclass per component, and the one place megatron-core configs
are built from them (:func:`build_megatron_configs`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from mmpack.dataloader.mixture import Mixture
from mmpack.trainer.exits import ExitConfig
from mmpack.trainer.flags import flag, int_list, not_a_flag
from mmpack.trainer.observability import ObservabilityConfig
from mmpack.trainer.stage_flags import StageFlags

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import ModelArch

MoeDispatcher = Literal["allgather", "alltoall", "flex"]  # megatron-core's token dispatchers
MOE_DISPATCHERS: tuple[str, ...] = get_args(MoeDispatcher)
CpCommType = Literal["p2p", "a2a", "all_gather"]  # Transformer Engine's context-parallel attention
CP_COMM_TYPES: tuple[str, ...] = get_args(CpCommType)
LossReduction = Literal["token", "sample", "square"]  # trainer/loss_reduction.py says what each means


def _family_names() -> list[str]:
    from mmpack.trainer.models import FAMILIES

    return sorted(FAMILIES)


def _trainable_modules(words: list[str]) -> tuple[str, ...] | None:
    """--trainable-modules: Megatron-LM's space-separated list, mmpack's comma list, or `all` (None)."""
    from mmpack.trainer.freeze import parse_modules

    return None if words == ["all"] else parse_modules(",".join(words))


def _lora_targets(words: list[str]) -> tuple[str, ...]:
    """--lora-target-modules: names comma- or space-separated."""
    from mmpack.trainer.lora.spec import parse_targets

    return parse_targets(words)


# --split weights are ratios: larger ones only lose precision (1e308 + 1e308 overflows)
SPLIT_MAX_WEIGHT = 1e12


def split_weights(text: str) -> tuple[float, float, float]:
    """--split: Megatron-LM's `969,30,1` (also `/`-separated; missing parts are 0); each weight a finite number
    from 0 to `SPLIT_MAX_WEIGHT`, one of them > 0."""
    try:
        values = [float(v) for v in text.replace("/", ",").split(",")]
    except ValueError:
        values = []
    if not (1 <= len(values) <= 3 and all(0 <= v <= SPLIT_MAX_WEIGHT for v in values) and sum(values) > 0):
        shown = repr(text) if len(text) <= 60 else repr(text[:60]) + "..."
        raise argparse.ArgumentTypeError(
            f"--split takes up to three weights from 0 to {SPLIT_MAX_WEIGHT:g}, not all 0 (e.g. 969,30,1), "
            f"got {shown}"
        )
    return tuple(values + [0.0] * (3 - len(values)))  # type: ignore[return-value]


def _balance_cost(text: str) -> tuple[float, float, float, float]:
    """--balance-cost `A,B,C,D`: four finite coefficients >= 0."""
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


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Which model: a HuggingFace folder (``--hf-model``: its config.json and weights), or a small random
    model of the same architecture built from the size fields (the ids and vocabulary then come from the
    dataset)."""

    hf_model: str | None = flag(
        None,
        help="HuggingFace model folder (save_pretrained: config.json + safetensors); each rank reads its TP/PP "
        "slice. Without it a random model is built from the size flags",
    )
    model_type: str = flag(
        "qwen2_5_vl",
        help="random model: its family (HF model_type); with --hf-model its config.json says",
        choices=_family_names,
    )
    # the sizes of a random model (--model-size picks a preset of them; a size flag given wins over it); with
    # --hf-model or a checkpoint, a size given must equal the model's own
    num_layers: int = flag(4, help="language model layers")
    hidden_size: int = flag(64, help="language model hidden size")
    num_attention_heads: int = flag(4, help="language model attention heads")
    num_query_groups: int = flag(2, help="key/value heads (GQA)")
    ffn_hidden_size: int | None = flag(None, help="MLP size (default: 4 x hidden size)")
    vision_num_layers: int = flag(2, help="vision encoder layers")
    vision_hidden_size: int = flag(32, help="vision encoder hidden size")
    vision_num_attention_heads: int = flag(2, help="vision encoder attention heads")
    # mixture of experts (Megatron-LM's flags): None takes the model's config.json, or a random model's defaults
    num_experts: int | None = flag(
        None, help="experts per MoE layer (random model; with --hf-model it must equal config.json's)"
    )
    moe_router_topk: int | None = flag(
        None, help="experts per token (random model; with --hf-model it must equal num_experts_per_tok)"
    )
    moe_aux_loss_coeff: float | None = flag(
        None,
        help="load-balancing loss coefficient (random model; with --hf-model it must equal router_aux_loss_coef)",
    )
    moe_token_dispatcher_type: MoeDispatcher = flag(
        "allgather",
        help="how tokens reach their experts' ranks (megatron-core's dispatchers; on CPU only allgather)",
    )
    make_vocab_size_divisible_by: int = flag(128, help="random model: vocabulary padding multiple")
    hidden_dropout: float = flag(0.0, help="dropout on hidden states")
    attention_dropout: float = flag(0.0, help="dropout on attention probabilities")
    init_method_std: float = flag(0.02, help="standard deviation of the weight init")
    # which parameters train (mmpack.trainer.freeze): modules named by --trainable-modules (None = all), minus the
    # vision encoder under --freeze-vision and the language model under --freeze-llm
    freeze_vision: bool = flag(
        False, help="freeze the vision encoder (patch embedding and blocks; the adapter still trains)"
    )
    freeze_llm: bool = flag(False, help="freeze the language model (embeddings and output layer too)")
    trainable_modules: tuple[str, ...] | None = flag(
        None,
        help="the modules that train (comma- or space-separated), the rest frozen: adapter (merger/projector), "
        "vision_model, language_model, embedding, output_layer; all (the default): everything",
        nargs="+",
        convert=_trainable_modules,
    )
    # LoRA (mmpack.trainer.lora): adapters on the targeted linear layers, every other parameter frozen unless
    # --trainable-modules names its module; None: not given (from --lora-adapter's adapter_config.json, or defaults)
    lora_rank: int | None = flag(
        None, help="LoRA: rank of the adapters (turns LoRA on; the base model is frozen)"
    )
    lora_alpha: float | None = flag(
        None, help="LoRA: updates are scaled by alpha / rank (default 8, as peft)"
    )
    lora_dropout: float | None = flag(None, help="LoRA: dropout on the adapters' input (default 0)")
    lora_target_modules: tuple[str, ...] | None = flag(
        None,
        help="LoRA: the HF linear modules to adapt, named as the HF model names them (comma- or space-separated, "
        "a name or a dotted suffix of one, as peft matches): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj, and the vision tower's (qkv, attn.proj, ...) and projector's (mlp.0, mlp.2) (default: q_proj,v_proj)",
        nargs="+",
        convert=_lora_targets,
    )
    lora_adapter: str | None = flag(
        None,
        help="LoRA: start from this PEFT adapter folder (adapter_config.json gives rank, alpha, dropout and "
        "targets; adapter_model.safetensors the weights)",
    )
    size_flags: tuple[tuple[str, float, str], ...] = not_a_flag(
        (),
        why="(field, value, flag) of the sizes the command line set (a size flag or --model-size), from "
        "arguments.parse_args: a model that comes with its own config.json (--hf-model, a checkpoint's "
        "hf_config.json) must have these values",
    )

    def __post_init__(self) -> None:
        from mmpack.trainer.freeze import parse_modules

        parse_modules(self.trainable_modules)  # ValueError naming unknown modules
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.lora_rank}")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vision_num_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("--hidden-size must be divisible by --num-attention-heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("--num-attention-heads must be a multiple of --num-query-groups")
        if self.vision_hidden_size % self.vision_num_attention_heads:
            raise ValueError("--vision-hidden-size must be divisible by --vision-num-attention-heads")
        if self.num_experts is not None and self.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {self.num_experts}")
        if self.moe_router_topk is not None and not 1 <= self.moe_router_topk <= (
            self.num_experts or 1 << 30
        ):
            raise ValueError(f"--moe-router-topk must be in 1..--num-experts, got {self.moe_router_topk}")
        if self.moe_aux_loss_coeff is not None and not 0 <= self.moe_aux_loss_coeff < float("inf"):
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_token_dispatcher_type not in MOE_DISPATCHERS:
            raise ValueError(
                f"--moe-token-dispatcher-type must be one of {', '.join(MOE_DISPATCHERS)}, got "
                f"{self.moe_token_dispatcher_type!r}"
            )

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocabulary of a random model, rounded up so that every TP size up to the multiple divides it."""
        mult = self.make_vocab_size_divisible_by
        return -(-vocab_size // mult) * mult


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """TP x PP x CP x DP layout and the parallel options tied to it."""

    tensor_model_parallel_size: int = flag(1, help="TP size")
    pipeline_model_parallel_size: int = flag(1, help="PP size")
    # context parallelism: every packed sample split over CP ranks (mmpack.packing.context_parallel); on GPU
    # TE's THD attention exchanges K/V by cp_comm_type, on CPU the K/V are all-gathered
    context_parallel_size: int = flag(
        1, help="CP size: every packed sample split over CP ranks in the load-balanced 2xCP chunk layout"
    )
    cp_comm_type: CpCommType = flag(
        "p2p",
        help="how Transformer Engine's THD attention exchanges K/V over CP on GPU (the CPU path all-gathers)",
    )
    # experts of a mixture of experts: spread over EP ranks, each cut over ETP ranks (None: the TP size);
    # ETP x EP x PP divides the world as TP x PP does (megatron-core's expert grid)
    expert_model_parallel_size: int = flag(1, help="EP size: ranks the experts are spread over")
    expert_tensor_parallel_size: int | None = flag(
        None, help="TP size of each expert (default: --tensor-model-parallel-size)"
    )
    sequence_parallel: bool = flag(False, help="shard activations along the sequence (needs TP > 1)")
    use_distributed_optimizer: bool = flag(False, help="shard the optimizer state over DP")
    # megatron-core's uneven split: language layers on the first / last stage (the rest evenly in between),
    # e.g. fewer on the first stage, which also runs the vision tower
    decoder_first_pipeline_num_layers: int | None = flag(
        None, help="language layers on the first stage (it also runs the vision tower); the rest split evenly"
    )
    decoder_last_pipeline_num_layers: int | None = flag(None, help="language layers on the last stage")
    overlap_grad_reduce: bool = flag(False, help="reduce gradients by bucket during the backward pass")
    overlap_param_gather: bool = flag(
        False, help="distributed optimizer: gather updated parameters by bucket during the next forward pass"
    )
    # interleaved (virtual) pipeline: each stage holds several model chunks of consecutive layers, given as
    # chunks per stage or as language layers per chunk (see virtual_pipeline_size)
    virtual_pipeline_model_parallel_size: int | None = flag(
        None,
        help="interleaved pipeline: model chunks per stage (instead of --num-layers-per-virtual-pipeline-stage; "
        "works with --decoder-first/last-pipeline-num-layers when it divides every stage's layers)",
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None,
        help="interleaved pipeline: language layers per model chunk; each stage holds several chunks (stage 0 "
        "the 1st, PP+1st, ...), which shrinks the pipeline bubble. Micro-batches per step must be a multiple "
        "of PP",
    )
    # how long a collective may wait for the other ranks before it fails (Megatron-LM's flag and default)
    distributed_timeout_minutes: float = flag(
        10.0,
        help="a collective that waits longer than this for the other ranks fails with an error naming the flag "
        "(gloo and NCCL), instead of hanging on a rank that is stuck or gone",
    )
    # Megatron-LM's stage-script flags: the layer count of every stage (the fork's --custom-pipeline-layers,
    # megatron-core's pipeline_model_parallel_layout underneath), the process-group backend (None: NCCL on CUDA, gloo
    # without) and --data-parallel-size, which must equal world / (TP x PP)
    custom_pipeline_layers: tuple[int, ...] | None = flag(
        None,
        help="language layers of each pipeline stage, as megatron-core's pipeline_model_parallel_layout (the "
        "first may be 0: it runs the vision tower); one count per stage, summing to the model's layers",
        parse=int_list,
        metavar="N0,N1,...",
    )
    distributed_backend: Literal["nccl", "gloo"] | None = flag(
        None,
        help="NCCL on CUDA (the default); without CUDA nccl falls back to gloo with a warning; gloo on CUDA is "
        "refused",
    )
    expected_data_parallel_size: int | None = flag(
        None, help="checked: must equal world size / (TP x PP x CP)", name="data-parallel-size"
    )

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("parallel sizes must be >= 1")
        if self.context_parallel_size < 1:
            raise ValueError(f"--context-parallel-size must be >= 1, got {self.context_parallel_size}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}"
            )
        if self.context_parallel_size > 1 and (
            self.num_layers_per_virtual_pipeline_stage is not None
            or (self.virtual_pipeline_model_parallel_size or 1) > 1
        ):
            # CP x PP runs the plain pipeline schedule with per-micro-batch shapes; the interleaved one is
            # not verified with them
            raise ValueError(
                "--context-parallel-size > 1 with the interleaved pipeline (--num-layers-per-virtual-pipeline-"
                "stage / --virtual-pipeline-model-parallel-size) is not supported yet: use the plain pipeline"
            )
        if self.context_parallel_size > 1 and self.sequence_parallel:
            # the per-sample CP padding does not yet round each rank's share to a multiple of TP
            raise ValueError("--context-parallel-size > 1 with --sequence-parallel is not supported yet")
        if self.expert_model_parallel_size < 1 or (self.expert_tensor_parallel_size or 1) < 1:
            raise ValueError("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
        if not 0 < self.distributed_timeout_minutes < float("inf"):
            raise ValueError(
                f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
        virtual = (self.virtual_pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage)
        if all(n is not None for n in virtual):
            raise ValueError(
                "give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, not both"
            )
        if any(n is not None and n < 1 for n in virtual):
            raise ValueError(
                "--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage must be >= 1"
            )
        if any(n is not None for n in virtual) and self.pipeline_model_parallel_size < 2:
            raise ValueError(
                "the interleaved pipeline (--virtual-pipeline-model-parallel-size, "
                "--num-layers-per-virtual-pipeline-stage) needs --pipeline-model-parallel-size > 1"
            )
        uneven = (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)
        if any(n is not None for n in uneven) and self.pipeline_model_parallel_size < 2:
            raise ValueError(
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1"
            )
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ValueError(
                "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
            )
        if any(n is not None and n < 0 for n in uneven):
            raise ValueError("--decoder-first/last-pipeline-num-layers must be >= 0")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        self._check_stage_script_flags()

    def _check_stage_script_flags(self) -> None:
        custom, pp = self.custom_pipeline_layers, self.pipeline_model_parallel_size
        if custom is not None:
            if any(
                n is not None
                for n in (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)
            ):
                raise ValueError("give --custom-pipeline-layers or --decoder-first/last-pipeline-num-layers, not both")  # fmt: skip
            if len(custom) != pp or min(custom) < 0:
                raise ValueError(
                    f"--custom-pipeline-layers {','.join(map(str, custom))} must give one layer count >= 0 per "
                    f"pipeline stage: --pipeline-model-parallel-size is {pp}"
                )
            virtual = (self.virtual_pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage)
            if any(n is not None for n in virtual):
                raise ValueError("--custom-pipeline-layers places every layer: give no virtual pipeline flags with it")  # fmt: skip
        if self.distributed_backend not in (None, "nccl", "gloo"):
            raise ValueError(f"--distributed-backend {self.distributed_backend}: mmpack runs NCCL on CUDA, gloo without")  # fmt: skip
        if self.expected_data_parallel_size is not None and self.expected_data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.expected_data_parallel_size}")

    def pipeline_layout(self) -> str | None:
        """megatron-core's pipeline_model_parallel_layout of --custom-pipeline-layers (the embedding on the
        first stage, the loss on the last, ``t`` per language layer; None without the flag or at PP 1)."""
        custom = self.custom_pipeline_layers
        if custom is None or len(custom) < 2:
            return None
        return "E" + "|".join("t" * n for n in custom) + "L"

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Language layers of each pipeline stage (megatron-core's split: the first / last stage as given by
        the uneven-split flags, the rest evenly); ValueError naming the flags when it does not divide."""
        pp, first, last = (
            self.pipeline_model_parallel_size,
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
        )
        custom = self.custom_pipeline_layers
        if custom is not None:
            if sum(custom) != num_layers:
                raise ValueError(
                    f"--custom-pipeline-layers {','.join(map(str, custom))} sums to {sum(custom)}; the model "
                    f"has {num_layers} language layers"
                )
            return list(custom)
        fixed = {0: first} if first is not None else {}
        if last is not None:
            fixed[pp - 1] = last
        rest_layers, rest_stages = num_layers - sum(fixed.values()), pp - len(fixed)
        if (
            rest_layers < 0
            or (rest_stages == 0 and rest_layers)
            or (rest_stages and rest_layers % rest_stages)
        ):
            raise ValueError(
                f"{num_layers} language layers cannot be split over PP {pp}"
                + (" with --decoder-first/last-pipeline-num-layers " + f"{first}/{last}" if fixed else "")
            )
        even = rest_layers // rest_stages if rest_stages else 0
        return [fixed.get(r, even) for r in range(pp)]

    def virtual_pipeline_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline stage of the interleaved schedule (None: not interleaved).

        ``--num-layers-per-virtual-pipeline-stage N`` means chunks of N layers on every stage, so it needs
        stages of equal size; with an uneven split give the chunks per stage
        (``--virtual-pipeline-model-parallel-size``), which must divide every stage's layers. One chunk per
        stage is the plain (non-interleaved) pipeline."""
        per_chunk, chunks = (
            self.num_layers_per_virtual_pipeline_stage,
            self.virtual_pipeline_model_parallel_size,
        )
        if per_chunk is None and chunks is None:
            return None
        counts = self.stage_layer_counts(num_layers)
        if per_chunk is not None:
            if any(c != counts[0] or c % per_chunk for c in counts):
                raise ValueError(
                    f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the language layers "
                    f"per stage {','.join(map(str, counts))} into the same number of chunks; give "
                    "--virtual-pipeline-model-parallel-size (chunks per stage) instead"
                )
            chunks = counts[0] // per_chunk
        assert chunks is not None
        bad = [c for c in counts if c % chunks or c == 0]
        if bad:
            raise ValueError(
                f"--virtual-pipeline-model-parallel-size {chunks}: every pipeline stage needs a positive multiple "
                f"of {chunks} language layers, and the split is {','.join(map(str, counts))} (megatron-core "
                "builds the same number of chunks on every stage)"
            )
        return chunks if chunks > 1 else None

    def data_parallel_size(self, world_size: int) -> int:
        """DP size implied by the world size; raises if TP x PP x CP does not divide it."""
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        mp = tp * pp * cp
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {mp}: give "
                "parallel sizes whose product divides the number of ranks (world = TP x PP x CP x DP)"
            )
        given = self.expected_data_parallel_size
        if given is not None and given != world_size // mp:
            raise ValueError(
                f"--data-parallel-size {given} does not match the launch: world size {world_size} / (TP "
                f"{tp} x PP {pp} x CP {cp}) = {world_size // mp}"
            )
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        experts = etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % experts:
            raise ValueError(
                f"world size {world_size} is not divisible by expert TP x EP x PP = {experts} (give "
                "--expert-model-parallel-size / --expert-tensor-parallel-size that divide it)"
            )
        return world_size // mp


_FUSION_NOTE = " (on by default on CUDA with Transformer Engine; never used on CPU)"


@dataclass(kw_only=True, frozen=True)
class PrecisionConfig:
    """Mixed precision: bf16/fp16 compute, fp32 islands, loss scaling."""

    bf16: bool = flag(False, help="bf16 parameters and compute, fp32 master weights")
    fp16: bool = flag(False, help="fp16 with dynamic loss scaling")
    fp32_residual_connection: bool = flag(False, help="keep the residual stream in fp32")
    attention_softmax_in_fp32: bool = flag(False, help="attention softmax in fp32")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, help="fp32 gradient buffers and all-reduce")
    loss_scale: float | None = flag(None, help="static loss scale (default: dynamic, fp16 only)")
    initial_loss_scale: float = flag(2.0**16, help="dynamic loss scale: its start")
    min_loss_scale: float = flag(1.0, help="dynamic loss scale: its floor")
    loss_scale_window: int = flag(1000, help="dynamic loss scale: steps without overflow before it grows")
    hysteresis: int = flag(2, help="dynamic loss scale: overflows tolerated before it is lowered")
    # Fused kernels (Megatron-LM's defaults, on): used where they run, i.e. on CUDA with Transformer Engine;
    # on CPU the plain ops run (see `build_megatron_configs`). Rotary fusion stays off: fused THD rotary
    # restarts positions in every packed sample, which multimodal RoPE positions must not.
    bias_swiglu_fusion: bool = flag(True, help="turn off fused bias + SwiGLU" + _FUSION_NOTE)
    bias_dropout_fusion: bool = flag(True, help="turn off fused bias + dropout + residual add" + _FUSION_NOTE)
    masked_softmax_fusion: bool = flag(
        True, help="turn off fused scale + mask + softmax (non-TE attention)" + _FUSION_NOTE
    )
    gradient_accumulation_fusion: bool = flag(
        True,
        help="turn off weight gradients accumulated into the fp32 main grads in the GEMM" + _FUSION_NOTE,
    )

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


# LR decay styles of megatron-core's OptimizerParamScheduler that need no further settings ("WSD" needs
# wsd_decay_steps, which the trainer does not set).
LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """Adam, LR schedule (linear warmup, then decay) and gradient clipping."""

    lr: float = flag(1e-3, help="peak learning rate")
    min_lr: float = flag(0.0, help="final learning rate")
    lr_warmup_iters: int = flag(0, help="linear warmup iterations")
    lr_decay_style: LrDecayStyle = flag("cosine", help="decay after warmup")
    lr_decay_iters: int | None = flag(
        None, help="iteration at which the decay reaches --min-lr (default: --train-iters)"
    )
    weight_decay: float = flag(0.01, help="AdamW weight decay")
    adam_beta1: float = flag(0.9, help="Adam beta1")
    adam_beta2: float = flag(0.95, help="Adam beta2")
    adam_eps: float = flag(1e-8, help="Adam epsilon")
    clip_grad: float = flag(1.0, help="global gradient-norm clip (0 = off)")
    lr_warmup_fraction: float | None = flag(
        None,
        help="linear warmup over this fraction of the decay iterations (Megatron-LM's; instead of "
        "--lr-warmup-iters)",
    )

    def __post_init__(self) -> None:
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                raise ValueError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
            if not 0 <= self.lr_warmup_fraction < 1:
                raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"unknown --lr-decay-style {self.lr_decay_style!r}")
        if self.min_lr > self.lr:
            raise ValueError("--min-lr must not exceed --lr")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Batching, length of the run, logging and evaluation."""

    seq_length: int = flag(
        0, help="tokens per sequence; 0 = the dataset's seq_len (any other value must equal it)"
    )
    micro_batch_size: int = flag(1, help="sequences per micro-batch")
    global_batch_size: int = flag(
        0, help="sequences per optimizer step; 0 = micro-batch size x DP (no accumulation)"
    )
    train_iters: int = flag(10, help="optimizer steps")
    seed: int = flag(1234, help="model init, data order and RNG seed")
    log_interval: int = flag(1, help="iterations between log lines")
    eval_interval: int = flag(0, help="iterations between evals (0 = never)")
    eval_iters: int = flag(1, help="global batches per eval")
    recompute_activations: bool = flag(
        False, help="selective recompute (core attention), as --recompute-granularity selective"
    )
    metrics_file: str | None = flag(None, help="also write each log line as JSON to this file")
    debug_overflow_iterations: tuple[int, ...] = flag(
        (), help="testing: make the loss infinite at these iterations (checks fp16 step skipping)", nargs="*"
    )
    loss_reduction: LossReduction = flag(
        "token",
        help="how the target tokens of a global batch are weighed: token (each the same), sample (each "
        "sample's mean, averaged over the samples) or square (1 / sqrt(the sample's target tokens)); "
        "docs/fine-tuning.md",
    )
    # Megatron-LM's activation recompute (TransformerConfig's fields of the same names); the fork's
    # --custom-pipeline-recompute-layers gives each pipeline stage its own recompute_num_layers
    recompute_granularity: Literal["full", "selective"] | None = flag(
        None,
        help="activation recompute: full layers (needs --recompute-method and --recompute-num-layers), or "
        "selective (core attention, as --recompute-activations)",
    )
    recompute_method: Literal["uniform", "block"] | None = flag(
        None,
        help="full recompute: uniform (chunks of --recompute-num-layers layers) or block (the first "
        "--recompute-num-layers layers of each stage)",
    )
    recompute_num_layers: int | None = flag(
        None, help="layers per recompute chunk (uniform) or recomputed per stage (block)"
    )
    custom_pipeline_recompute_layers: tuple[int, ...] | None = flag(
        None,
        help="--recompute-num-layers of each pipeline stage, one count per stage (needs --recompute-granularity "
        "full)",
        parse=int_list,
        metavar="R0,R1,...",
    )

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.global_batch_size < 0 or self.train_iters < 0:
            raise ValueError("--micro-batch-size must be >= 1, --global-batch-size and --train-iters >= 0")
        if self.recompute_activations and self.recompute_granularity not in (None, "selective"):
            raise ValueError("--recompute-activations is --recompute-granularity selective; give one of them")
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self._num_layers_given() is None):
            raise ValueError(
                "--recompute-granularity full needs --recompute-method (uniform or block) and "
                "--recompute-num-layers (or --custom-pipeline-recompute-layers)"
            )
        if not full and (self.recompute_method or self._num_layers_given() is not None):
            raise ValueError(
                "--recompute-method, --recompute-num-layers and --custom-pipeline-recompute-layers need "
                "--recompute-granularity full"
            )
        if any(n < 0 for n in self.custom_pipeline_recompute_layers or ()):
            raise ValueError("--custom-pipeline-recompute-layers must be >= 0 for every stage")

    def _num_layers_given(self) -> int | tuple[int, ...] | None:
        return self.custom_pipeline_recompute_layers or self.recompute_num_layers

    def recompute_fields(self, pipeline_rank: int) -> dict[str, Any]:
        """TransformerConfig's recompute fields on stage ``pipeline_rank``."""
        granularity = "selective" if self.recompute_activations else self.recompute_granularity
        if granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        if granularity is None:
            return {}
        per_stage = self.custom_pipeline_recompute_layers
        layers = per_stage[pipeline_rank] if per_stage else self.recompute_num_layers
        return {"recompute_granularity": "full", "recompute_method": self.recompute_method, "recompute_num_layers": layers}  # fmt: skip

    def num_microbatches(self, dp_size: int) -> int:
        """Micro-batches per step and DP rank: global / (micro x DP), which must divide exactly."""
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} must be a multiple of "
                f"--micro-batch-size x DP = {per_step}"
            )
        return self.global_batch_size // per_step


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where micro-batches come from."""

    data_path: str | None = not_a_flag(
        None, why="--data-path: one dataset here, a weighted blend in data_mixture"
    )
    data_mixture: Mixture | None = not_a_flag(None, why="--data-path w1 A w2 B ... or --data-mixture FILE")
    eval_data_path: str | None = flag(None, help="held-out packed dataset for --eval-interval")
    num_workers: int = flag(2, help="loader worker processes")
    cache_dir: str | None = flag(None, help="local cache for remote shards", name="data-cache-dir")
    mock_data: bool = flag(False, help="synthetic packed batches, no dataset")
    balance: Literal["none", "compute"] = flag(
        "none",
        help="compute: spread each global batch's bins over DP ranks by compute cost (mmpack.dataloader.balance); "
        "when not given, --length-sort-pool-size > 0 turns it on",
    )
    # the cost model's coefficients (mmpack.packing.cost.COST_FEATURES order); None: the trained model's FLOP counts
    balance_cost: tuple[float, float, float, float] | None = flag(
        None,
        help="coefficients of the bin cost A*tokens + B*sum(sample_len^2) + C*image_patches + "
        "D*sum(image_patches^2) for --balance compute (e.g. from mmpack.packing.cost.CostModel.fit on measured "
        "step times); default: the FLOP counts of the model being trained",
        parse=_balance_cost,
        metavar="A,B,C,D",
    )
    # Megatron-LM's --split (train, valid, test weights): the bins of --data-path divided by
    # mmpack.dataloader.order.split_bins (raw records: by mmpack.offline_packing.online.record_parts); the
    # valid part is the eval data of --eval-interval
    split: tuple[float, float, float] | None = flag(
        None,
        help="divide --data-path's bins by these weights (e.g. 969,30,1; a seeded permutation cut as Megatron-LM "
        "cuts documents; with --online-packing the records, each by a seeded hash, before packing); training "
        "reads only the train part, --eval-interval evaluates the valid part",
        parse=split_weights,
        metavar="TRAIN,VALID,TEST",
    )
    strict_data: bool = flag(
        False,
        help="stop at the first sample whose images or videos cannot be decoded, in one line naming it; by default "
        "such a sample is dropped from its bin (no loss, media blank), counted in the log line and listed in "
        "bad_samples-rank<R>.jsonl in --save (else in --tensorboard-dir or beside --metrics-file)",
    )

    # online packing (mmpack.trainer.data.open_raw_data): --data-path names raw records, packed as the run trains
    raw_inputs: tuple[str, ...] = not_a_flag((), why="--data-path with --online-packing: the raw inputs")
    online_packing: bool = flag(
        False,
        help="--data-path names raw records (files, folders, globs or URLs, in any form `mmpack pack -i` reads), "
        "packed into bins as the run trains by the offline job's length model and kernels, with the tokenizer, "
        "image/video rule and chat template of --hf-model's folder (or --tokenizer-model's); or --data-mixture "
        "holds 'kind: raw' sources, each packed whole in one buffer as the run starts",
    )
    image_root: str | None = flag(
        None,
        help="online packing: the folder (or URL) the records' image and video paths are relative to (default: "
        "each input file's folder)",
        metavar="DIR",
    )
    packing_buffer_size: int = flag(
        10_000,
        help="online packing: records packed together, one buffer at a time (at least the dataset's size packs "
        "it all at once, as `mmpack pack` does)",
        metavar="N",
    )
    packing_cache: str | None = flag(
        None,
        help="online packing: the folder where each buffer is counted and packed once for all loader workers "
        "and ranks that see it (a subfolder per source fingerprint; default: packing-cache in a local --save "
        "folder, else $MMPACK_CACHE/packing or ~/.cache/mmpack/packing; a folder shared by the nodes packs once "
        "per run)",
        metavar="DIR",
    )
    tokenizer_model: str | None = flag(
        None,
        help="online packing with a random model: the model folder or tokenizer (folder or tokenizer.json) that "
        "counts the records' tokens (with --hf-model its folder does)",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        self._check_online_packing()
        if not self.data_path and not self.data_mixture and not self.mock_data and not self.raw_inputs:
            raise ValueError("give --data-path (a packed dataset), --data-mixture or --mock-data")
        if self.data_path and self.data_mixture:
            raise ValueError("give one of --data-path and a mixture (--data-mixture or weighted --data-path)")
        if self.split is not None and self.eval_data_path:
            raise ValueError("--split takes the eval data out of --data-path's bins: give it or --eval-data-path, not both")  # fmt: skip
        if self.balance not in ("none", "compute"):
            raise ValueError(f"--balance must be none or compute, got {self.balance!r}")
        if self.balance_cost is not None and self.balance != "compute":
            raise ValueError("--balance-cost sets the cost model of --balance compute; add --balance compute")

    def _check_online_packing(self) -> None:
        """The flags of online packing: given together, and not with what it does not support yet."""
        if not self.online_packing:
            for name, value in (
                ("--image-root", self.image_root),
                ("--tokenizer-model", self.tokenizer_model),
                ("--packing-cache", self.packing_cache),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} is an option of --online-packing (raw records in --data-path): add it"
                    )
            if self.raw_inputs:
                raise ValueError("raw inputs are read with --online-packing: add it")
            if self.data_mixture and self.data_mixture.raw_sources:
                raise ValueError(f"mixture source {self.data_mixture.raw_sources[0]!r} is raw records (kind: raw): add --online-packing (with --hf-model or --tokenizer-model)")  # fmt: skip
            return
        if self.data_path or self.mock_data or (self.data_mixture and not self.data_mixture.raw_sources):
            raise ValueError("--online-packing reads the raw records of --data-path, or a --data-mixture with kind: raw sources: not with a packed dataset, a mixture of packed datasets only or --mock-data")  # fmt: skip
        if not self.raw_inputs and not self.data_mixture:
            raise ValueError("--online-packing reads the raw records --data-path names (files, folders, globs, URLs): give it")  # fmt: skip
        if isinstance(self.packing_buffer_size, bool) or self.packing_buffer_size < 1:
            raise ValueError(f"--packing-buffer-size must be a number of records >= 1, got {self.packing_buffer_size}")  # fmt: skip

    @property
    def train_data(self) -> str | Mixture | None:
        """What the training loader reads: one dataset, a mixture, or None (synthetic)."""
        return self.data_mixture or self.data_path

    @property
    def source_names(self) -> tuple[str, ...]:
        """The names of the training sources, in `source_ids` order (empty for one dataset)."""
        return self.data_mixture.names if self.data_mixture else ()


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = flag(None, help="checkpoint folder to write")
    load: str | None = flag(
        None, help="checkpoint folder to resume from (one without a checkpoint starts at iteration 0)"
    )
    save_interval: int = flag(0, help="iterations between saves (0 = at the end only)")
    async_save: bool = flag(False, help="write checkpoint shards in the background (forked processes)")
    finetune: bool = flag(
        False, help="load weights only from --load: iteration, optimizer, scheduler and data start fresh"
    )
    no_load_optim: bool = flag(False, help="do not load the optimizer state (the rest is restored)")
    no_verify_checkpoint: bool = flag(
        False, help="load without checking the checkpoint's files against the checksums saved with them"
    )

    def __post_init__(self) -> None:
        if self.async_save and not self.save:
            raise ValueError("--async-save needs --save")
        if (self.finetune or self.no_load_optim) and not self.load:
            raise ValueError("--finetune and --no-load-optim need --load")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(mock_data=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    stage: StageFlags = field(default_factory=StageFlags)  # Megatron-LM stage-script flags checked at start

    def __post_init__(self) -> None:
        per_stage, pp = (
            self.train.custom_pipeline_recompute_layers,
            self.parallel.pipeline_model_parallel_size,
        )
        if per_stage is not None and len(per_stage) != pp:
            raise ValueError(
                f"--custom-pipeline-recompute-layers {','.join(map(str, per_stage))} must give one count per "
                f"pipeline stage: --pipeline-model-parallel-size is {pp}"
            )
        if self.exit.exit_signal_handler and not self.checkpoint.save:
            raise ValueError("--exit-signal-handler saves a checkpoint before it exits: add --save DIR")
        if self.data.online_packing:
            self._check_online_packing()

    def _check_online_packing(self) -> None:
        """--online-packing's model folder and sequence length, which other sections hold."""
        folders = [f for f in (self.model.hf_model, self.data.tokenizer_model) if f]
        if len(folders) != 1:
            raise ValueError(
                "--online-packing counts the records' tokens with one tokenizer: give --hf-model (its folder) or, for "
                "a random model, --tokenizer-model DIR" + (", not both" if folders else "")
            )
        if self.train.seq_length <= 0:
            raise ValueError("--online-packing packs bins of --seq-length tokens: give it")


@dataclass(kw_only=True, frozen=True)
class MegatronConfigs:
    """The megatron-core configs of one run (``model`` holds the family's per-part TransformerConfigs)."""

    language: TransformerConfig
    model: Any
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig


def build_megatron_configs(
    cfg: RunConfig, arch: ModelArch, *, use_te: bool = False, pipeline_rank: int = 0
) -> MegatronConfigs:
    """Translate our configs (and the model family's architecture) into megatron-core's; ``pipeline_rank``:
    this rank's stage (its own --custom-pipeline-recompute-layers count).

    `use_te`: the model is built with Transformer Engine on CUDA; only then are the fusion flags switched on
    (on CPU megatron-core would compile its fused ops with torch.compile, for no gain).
    """
    from mmpack.trainer.models import family_of

    m, par, prec, tr = cfg.model, cfg.parallel, cfg.precision, cfg.train
    pipeline_dtype = torch.float32 if prec.fp32_residual_connection else prec.params_dtype
    common = dict(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        use_cpu_initialization=True,
        params_dtype=torch.float32,  # initialised in fp32; Float16Module casts the whole model
        pipeline_dtype=pipeline_dtype,
        bf16=prec.bf16,
        fp16=prec.fp16,
        fp32_residual_connection=prec.fp32_residual_connection,
        attention_softmax_in_fp32=prec.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=use_te and prec.bias_swiglu_fusion,
        masked_softmax_fusion=use_te and prec.masked_softmax_fusion,
        persist_layer_norm=False,  # Apex only
        # TE accumulates weight gradients straight into DDP's fp32 main_grad buffers
        gradient_accumulation_fusion=use_te and prec.gradient_accumulation_fusion,
        bias_dropout_fusion=use_te and prec.bias_dropout_fusion,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
        calculate_per_token_loss=True,  # the loss function returns (sum, tokens); see training._loss_func
    )
    recompute = tr.recompute_fields(pipeline_rank)
    vp = par.virtual_pipeline_size(arch.num_layers)
    # The interleaved schedule sends activations and gradients both ways at once: batched into one
    # batch_isend_irecv, two sends to the same peer (PP 2: next and previous stage are one rank) are matched
    # in posting order and deliver gradients into activation buffers. Unbatched, megatron-core gives each
    # direction its own process group (Megatron-LM's defaults under VP: overlapped, not batched).
    interleaved = {"overlap_p2p_comm": True, "batch_p2p_comm": False} if vp else {}
    if par.expert_model_parallel_size > 1 and arch.moe is None:
        raise ValueError(
            f"--expert-model-parallel-size {par.expert_model_parallel_size} needs a mixture-of-experts model; "
            f"{arch.source.get('model_type')} has no experts"
        )
    if arch.moe is not None and arch.moe.num_experts % par.expert_model_parallel_size:
        raise ValueError(
            f"--expert-model-parallel-size {par.expert_model_parallel_size} must divide the number of experts, "
            f"{arch.moe.num_experts} (--num-experts or the model's config.json): every EP rank holds as many"
        )
    variable_lengths = par.context_parallel_size > 1 and par.pipeline_model_parallel_size > 1
    dispatcher = m.moe_token_dispatcher_type
    if variable_lengths and arch.moe is None:
        dispatcher = "alltoall"  # no experts: megatron-core only refuses allgather with variable lengths
    elif variable_lengths and dispatcher == "allgather":
        raise ValueError(
            "--context-parallel-size > 1 with --pipeline-model-parallel-size > 1 and experts needs "
            "--moe-token-dispatcher-type alltoall (megatron-core's allgather dispatcher takes fixed lengths only)"
        )
    language_extra = {
        "sequence_parallel": par.sequence_parallel,
        # the language model alone: the vision tower runs whole on every CP rank
        "context_parallel_size": par.context_parallel_size,
        "cp_comm_type": par.cp_comm_type if par.context_parallel_size > 1 else None,
        # the CP split pads every sample, so a micro-batch's local length varies from one micro-batch to the
        # next: the pipeline stages send each other the shape of every activation before it
        "variable_seq_lengths": variable_lengths,
        "moe_token_dispatcher_type": dispatcher,
        # the experts' layout: the language model's alone (a vision tower config with EP > 1 is refused)
        "expert_model_parallel_size": par.expert_model_parallel_size,
        "expert_tensor_parallel_size": par.expert_tensor_parallel_size or par.tensor_model_parallel_size,
        "num_layers_in_first_pipeline_stage": par.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": par.decoder_last_pipeline_num_layers,
        "pipeline_model_parallel_layout": par.pipeline_layout(),
        "virtual_pipeline_model_parallel_size": vp,
        **interleaved,
        **recompute,
    }
    parts = family_of(arch.source).megatron_configs(arch, common, language_extra)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=prec.accumulate_allreduce_grads_in_fp32,
        use_distributed_optimizer=par.use_distributed_optimizer,
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        average_in_collective=False,
    )
    opt = cfg.optim
    optimizer = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=prec.bf16,
        fp16=prec.fp16,
        params_dtype=prec.params_dtype,
        loss_scale=prec.loss_scale,
        initial_loss_scale=prec.initial_loss_scale,
        min_loss_scale=prec.min_loss_scale,
        loss_scale_window=prec.loss_scale_window,
        hysteresis=prec.hysteresis,
        use_distributed_optimizer=par.use_distributed_optimizer,
        log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
    )
    return MegatronConfigs(language=parts.language, model=parts, ddp=ddp, optimizer=optimizer)
