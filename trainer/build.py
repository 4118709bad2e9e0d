"""The model of a run: its architecture (from ``--hf-model``'s config.json or the size flags), this stage's
megatron-core module, and its weights (the HF checkpoint's slice of this rank, or a layout-independent
random initialisation)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module

from trainer.config import MegatronConfigs, RunConfig
from trainer.convert import HF_CONFIG_NAME
from trainer.data import DataInfo
from trainer.models import family, family_of
from trainer.models.qwen2_5_vl.config import read_hf_config


def model_hf_config(cfg: RunConfig, info: DataInfo) -> dict[str, Any]:
    """The HF ``config.json`` dict of the run's model: ``--hf-model``'s, the one kept beside the checkpoints
    of ``--load``, or a small random one whose vocabulary and special ids are the dataset's."""
    m = cfg.model
    if m.hf_model:
        return read_hf_config(m.hf_model)
    kept = Path(cfg.checkpoint.load or "") / HF_CONFIG_NAME
    if cfg.checkpoint.load and kept.is_file():
        return json.loads(kept.read_text())
    return family(m.model_type).tiny_hf_config(
        vocab_size=m.padded_vocab_size(info.vocab_size),
        image_token_id=info.image_pad_id,
        vision_start_token_id=info.vision_start_id,
        vision_end_token_id=info.vision_end_id,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        vision_depth=m.vision_num_layers,
        vision_hidden_size=m.vision_hidden_size,
        vision_num_heads=m.vision_num_attention_heads,
        patch_size=info.patch_size,
        merge_size=info.merge_size,
    )


def check_data_matches_model(arch: Any, info: DataInfo, where: str) -> None:
    """The dataset's tokenizer and image geometry must be the model's; ValueError saying which differs."""
    problems = []
    if info.vocab_size > arch.vocab_size:
        problems.append(f"the dataset's tokenizer has {info.vocab_size} tokens, the model {arch.vocab_size}")
    if info.image_pad_id != arch.image_token_id:
        problems.append(
            f"<|image_pad|> is {info.image_pad_id} in the dataset, {arch.image_token_id} in the model"
        )
    if (info.patch_size, info.merge_size) != (arch.vision.patch_size, arch.vision.spatial_merge_size):
        problems.append(
            f"patch/merge size {info.patch_size}/{info.merge_size} in the dataset, "
            f"{arch.vision.patch_size}/{arch.vision.spatial_merge_size} in the model"
        )
    if problems:
        raise ValueError(f"dataset and model {where} disagree: " + "; ".join(problems) + " (repack the data)")


def _global_param_names(model: torch.nn.Module) -> dict[int, str]:
    """Parameter id -> name that is the same under every TP/PP layout (decoder layers by global number)."""
    names: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    decoder = getattr(getattr(model, "language_model", None), "decoder", None)
    if decoder is not None:
        for layer in decoder.layers:
            for pname, param in layer.named_parameters():
                names[id(param)] = f"language_model.decoder.layers.{layer.layer_number - 1}.{pname}"
    output = getattr(getattr(model, "language_model", None), "output_layer", None)
    if getattr(model, "share_embeddings_and_output_weights", False) and output is not None:
        names[id(output.weight)] = "language_model.embedding.word_embeddings.weight"  # tied: the same draw
    return names


@torch.no_grad()
def init_layout_invariant(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Re-initialise every parameter from (seed, global name), then keep this rank's TP shard.

    The full tensor is drawn the same way under every TP x PP layout, so runs with different layouts start
    from the same model (megatron-core's own init draws per-shard and per-stage).
    """
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    names = _global_param_names(model)
    for param in model.parameters():
        name = names[id(param)]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            param.zero_()
            continue
        if "norm" in name or "ln_q" in name:
            param.fill_(1.0)
            continue
        split = bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1
        dim = int(getattr(param, "partition_dim", 0))
        full_shape = list(param.shape)
        if split:
            full_shape[dim] *= tp_size
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        scale = std / (2.0 * num_layers) ** 0.5 if ("linear_proj" in name or "linear_fc2" in name) else std
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * scale
        if split:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        param.copy_(full)


def build_stage_model(cfg: RunConfig, mcfg: MegatronConfigs, arch: Any, *, use_te: bool) -> torch.nn.Module:
    """This pipeline stage's (unwrapped) model with its weights."""
    fam = family_of(arch.source)
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    model = fam.Model(
        arch, mcfg.model, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        use_te=use_te,
    )  # fmt: skip
    if cfg.model.hf_model:
        fam.load_stage_weights(
            model, cfg.model.hf_model, arch,
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=pp_rank, pp_size=pp_size,
        )  # fmt: skip
    else:
        init_layout_invariant(model, cfg.train.seed, cfg.model.init_method_std, arch.num_layers)
    return model


def build_model(cfg: RunConfig, mcfg: MegatronConfigs, arch: Any, *, use_te: bool) -> DistributedDataParallel:
    """This stage's model, cast and wrapped in megatron DDP."""
    model = build_stage_model(cfg, mcfg, arch, use_te=use_te)
    if torch.cuda.is_available():
        model.cuda()
    if cfg.precision.bf16 or cfg.precision.fp16:
        model = Float16Module(mcfg.language, model)
    return DistributedDataParallel(config=mcfg.language, ddp_config=mcfg.ddp, module=model)
