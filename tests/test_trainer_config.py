"""Flags -> configs -> megatron-core configs: each Megatron flag reaches the megatron-core field it names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpack.trainer.arguments import build_parser, parse_args
from mmpack.trainer.batches import block_causal_mask
from mmpack.trainer.config import (
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    build_megatron_configs,
)

BASE = ["--mock-data", "--seq-length", "64"]


def _arch(cfg):
    """The random model's architecture for the mock data's vocabulary and ids."""
    from mmpack.trainer.build import model_hf_config
    from mmpack.trainer.data import dataset_info
    from mmpack.trainer.models.qwen2_5_vl import arch_from_hf_config

    return arch_from_hf_config(model_hf_config(cfg, dataset_info(None, 64)))


def test_mixed_precision_and_parallel_flags_reach_megatron_configs() -> None:
    cfg = parse_args(
        [
            *BASE,
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--bf16",
            "--fp32-residual-connection",
            "--attention-softmax-in-fp32",
            "--accumulate-allreduce-grads-in-fp32",
            "--recompute-activations",
            "--clip-grad",
            "0.5",
        ]
    )
    m = build_megatron_configs(cfg, _arch(cfg))
    lang = m.language
    assert (lang.tensor_model_parallel_size, lang.pipeline_model_parallel_size) == (2, 2)
    assert lang.sequence_parallel and lang.bf16 and not lang.fp16
    assert lang.fp32_residual_connection and lang.attention_softmax_in_fp32
    assert lang.pipeline_dtype == torch.float32  # the fp32 residual stream crosses pipeline stages
    assert lang.recompute_granularity == "selective"
    assert m.ddp.grad_reduce_in_fp32 and m.ddp.use_distributed_optimizer
    assert m.optimizer.bf16 and m.optimizer.use_distributed_optimizer and m.optimizer.clip_grad == 0.5
    assert not m.model.vision.sequence_parallel  # image patches stay whole on every TP rank
    assert lang.normalization == "RMSNorm" and lang.gated_linear_unit and lang.add_qkv_bias
    assert lang.num_query_groups == 2 and lang.mrope_section == [2, 3, 3]


def test_fp16_dynamic_loss_scaling_options() -> None:
    cfg = parse_args([*BASE, "--fp16", "--initial-loss-scale", "512", "--hysteresis", "1"])
    m = build_megatron_configs(cfg, _arch(cfg))
    assert m.language.fp16 and m.language.pipeline_dtype == torch.float16
    assert m.optimizer.fp16 and m.optimizer.loss_scale is None  # None = dynamic
    assert (m.optimizer.initial_loss_scale, m.optimizer.hysteresis) == (512, 1)


def test_presets_and_explicit_sizes() -> None:
    cfg = parse_args([*BASE, "--model-size", "tiny", "--hidden-size", "96", "--num-attention-heads", "6"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (4, 96, 6)
    assert "--fp32-residual-connection" in build_parser().format_help()


@pytest.mark.parametrize(
    "make",
    [
        lambda: PrecisionConfig(bf16=True, fp16=True),
        lambda: ParallelConfig(sequence_parallel=True),
        lambda: ModelConfig(hidden_size=30, num_attention_heads=4),
        lambda: TrainConfig(micro_batch_size=0),
    ],
)
def test_invalid_configs_raise(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_batch_geometry() -> None:
    assert TrainConfig(micro_batch_size=2, global_batch_size=16).num_microbatches(dp_size=2) == 4
    with pytest.raises(ValueError, match="multiple of"):
        TrainConfig(micro_batch_size=2, global_batch_size=6).num_microbatches(dp_size=2)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(6)
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--bogus-flag"])


def test_block_causal_mask_from_cu_seqlens() -> None:
    # two rows of 4: row 0 = samples of 3 and 1 tokens, row 1 = 2 tokens + 2 padding
    mask = block_causal_mask(torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32), 2, 4)
    assert mask.shape == (2, 1, 4, 4)
    visible = ~mask[:, 0]
    assert visible[0, 2].tolist() == [True, True, True, False]
    assert visible[0, 3].tolist() == [False, False, False, True]  # new sample sees only itself
    assert visible[1, 1].tolist() == [True, True, False, False]
    assert visible[1, 2].tolist() == [False, False, True, False]  # padding is its own segment


def test_thd_inputs_flatten_the_micro_batch() -> None:
    from mmpack.packing.mrope import MRopeRule
    from mmpack.trainer.batches import Sample, make_micro_batch
    from mmpack.trainer.data import model_inputs

    def sample(n: int) -> Sample:
        return Sample(
            input_ids=np.arange(1, n + 1),
            loss_mask=np.ones(n, dtype=np.uint8),
            image_grid_thw=np.zeros((0, 3), dtype=np.int64),
            pixel_values=np.zeros((0, 1176), dtype=np.float32),
        )

    rule = MRopeRule(image_pad_id=-1, merge_size=2)
    batch = make_micro_batch(
        [[sample(3), sample(2)], [sample(4)]], 6, 0, attention_mask=False, position_rule=rule
    )
    thd = model_inputs(batch, use_thd=True)
    params = thd["packed_seq_params"]
    assert params.qkv_format == "thd" and thd["attention_mask"] is None
    assert thd["tokens"].shape == (1, 12)
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 6, 10, 12]  # padding segments included
    assert params.max_seqlen_q == 4
    assert thd["position_ids"].shape == (3, 1, 12)
    assert thd["position_ids"][0, 0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]  # restart per segment
    dense = model_inputs(batch, use_thd=False)
    assert dense["attention_mask"].shape == (2, 1, 6, 6) and "packed_seq_params" not in dense
    assert (dense["labels"] >= 0).all()  # ignored positions are masked by loss_mask, not by -100


def test_fusions_only_with_transformer_engine() -> None:
    """Fused kernels are switched on for a Transformer Engine (CUDA) model, each can be turned off, and a CPU
    model never gets them; the vision tower takes the same settings as the language model."""
    cfg = parse_args(BASE)
    fused = (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "gradient_accumulation_fusion",
    )
    for part in (
        build_megatron_configs(cfg, _arch(cfg)).model.language,
        build_megatron_configs(cfg, _arch(cfg)).model.vision,
    ):
        assert not any(getattr(part, f) for f in fused)
    on_gpu = build_megatron_configs(cfg, _arch(cfg), use_te=True).model
    for part in (on_gpu.language, on_gpu.vision):
        assert all(getattr(part, f) for f in fused), part
        assert not part.apply_rope_fusion  # THD rotary fusion would restart the M-RoPE positions per sample
    off = parse_args([*BASE, "--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion"])
    lang = build_megatron_configs(off, _arch(off), use_te=True).language
    assert not lang.bias_activation_fusion and not lang.gradient_accumulation_fusion
    assert lang.bias_dropout_fusion and lang.masked_softmax_fusion


def test_expert_parallel_size_that_does_not_divide_the_experts_is_one_line() -> None:
    """`--model-type qwen3_vl_moe --num-experts 3 --expert-model-parallel-size 2`: a ValueError naming both
    (one line from the trainer), not megatron-core's assertion when it builds the layers."""
    from mmpack.trainer.build import model_hf_config
    from mmpack.trainer.data import dataset_info
    from mmpack.trainer.models import family

    def configs(experts: int) -> object:
        cfg = parse_args([*BASE, "--model-type", "qwen3_vl_moe", "--num-experts", str(experts),
                          "--moe-router-topk", "2", "--expert-model-parallel-size", "2"])  # fmt: skip
        arch = family("qwen3_vl_moe").arch_from_hf_config(model_hf_config(cfg, dataset_info(None, 64)))
        return build_megatron_configs(cfg, arch)

    assert configs(4).language.num_moe_experts == 4  # control: 2 EP ranks of 2 experts each
    refused = r"^--expert-model-parallel-size 2 must divide the number of experts, 3 "
    with pytest.raises(ValueError, match=refused):
        configs(3)
