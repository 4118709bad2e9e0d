"""The model of a run: its architecture (from ``--hf-model``'s config.json or the size flags), this stage's
megatron-core module, and its weights (this rank's slice of the HF checkpoint, or of random HF-layout
weights drawn per HF tensor name, so that every TP x PP layout starts from the same model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module

from mmpack.dataloader import load_manifest
from mmpack.trainer.checkpoint_commit import HF_CONFIG_NAME
from mmpack.trainer.config import MegatronConfigs, ModelConfig, RunConfig
from mmpack.trainer.data import DataInfo
from mmpack.trainer.dataset_check import check_dataset_matches_model
from mmpack.trainer.freeze import apply_freeze
from mmpack.trainer.lora.export import check_resume_base
from mmpack.trainer.lora.layer import add_lora
from mmpack.trainer.lora.peft_io import PeftTensors
from mmpack.trainer.lora.spec import LoraSpec, check_targets, resolve_spec
from mmpack.trainer.models import family, family_of, read_hf_config
from mmpack.trainer.models.hf_weights import ExpertSlice, model_rules
from mmpack.trainer.models.protocol import ModelArch, ModelFamily, TinyModelSpec

if TYPE_CHECKING:
    from mmpack.dataloader.mixture import Mixture


def model_hf_config(cfg: RunConfig, info: DataInfo) -> dict[str, Any]:
    """The HF ``config.json`` dict of the run's model: ``--hf-model``'s, the one kept beside the checkpoints
    of ``--load``, or a small random one whose vocabulary and special ids are the dataset's."""
    m = cfg.model
    if m.hf_model:
        config = read_hf_config(m.hf_model)
        check_size_flags(m, config, f"--hf-model {m.hf_model} (its config.json)")
        return config
    kept = Path(cfg.checkpoint.load or "") / HF_CONFIG_NAME
    if cfg.checkpoint.load and kept.is_file():
        config = json.loads(kept.read_text())
        check_size_flags(m, config, f"the checkpoint of --load {cfg.checkpoint.load} (its {HF_CONFIG_NAME})")
        return config
    spec = TinyModelSpec(
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
        num_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
    )
    config = family(m.model_type).tiny_hf_config(spec)
    check_size_flags(m, config, f"--model-type {m.model_type}")  # e.g. experts asked of a dense family
    return config


def check_size_flags(m: ModelConfig, config: dict[str, Any], source: str) -> None:
    """The size flags of the command line must be the sizes of the model ``source`` fixes; ValueError in
    one line naming the flags and both values otherwise."""
    fam = family_of(config)
    sizes = fam.size_flags_of(fam.arch_from_hf_config(config))
    wrong = [(field, value, flag) for field, value, flag in m.size_flags if sizes.get(field, value) != value]
    if wrong:
        flags = " ".join(dict.fromkeys(flag for _, _, flag in wrong))
        detail = ", ".join(f"{field} {value} here, {sizes[field]} there" for field, value, _ in wrong)
        raise ValueError(
            f"{flags} contradicts {source}: {detail}; drop the size flags (that model fixes the sizes) or "
            "train a new model without it"
        )


def check_data_matches_model(
    fam: ModelFamily[ModelArch], arch: ModelArch, info: DataInfo, where: str
) -> None:
    """The dataset's tokenizer, image geometry and video rule must be the model's; ValueError saying which
    differs."""
    problems = []
    if info.vocab_size > arch.vocab_size:
        problems.append(f"the dataset's tokenizer has {info.vocab_size} tokens, the model {arch.vocab_size}")
    if info.image_pad_id != arch.image_token_id:
        problems.append(
            f"<|image_pad|> is {info.image_pad_id} in the dataset, {arch.image_token_id} in the model"
        )
    if info.video_pad_id >= 0 and info.video_pad_id != arch.video_token_id:
        problems.append(
            f"<|video_pad|> is {info.video_pad_id} in the dataset, {arch.video_token_id} in the model"
        )
    if (info.patch_size, info.merge_size) != (arch.vision.patch_size, arch.vision.spatial_merge_size):
        problems.append(
            f"patch/merge size {info.patch_size}/{info.merge_size} in the dataset, "
            f"{arch.vision.patch_size}/{arch.vision.spatial_merge_size} in the model"
        )
    if info.video_rule and info.video_rule != fam.video_rule:
        problems.append(
            f"the dataset's videos follow the {info.video_rule} video rule, {fam.model_type}'s processor the "
            f"{fam.video_rule} one"
        )
    if problems:
        raise ValueError(f"dataset and model {where} disagree: " + "; ".join(problems) + " (repack the data)")


def check_dataset_for_hf_model(data: str | Mixture, model_dir: str) -> None:
    """The recorded tokenizer and image rule of the dataset (of each source of a mixture, by its own rule)
    against the model folder's tokenizer.json, preprocessor_config.json and config.json
    (mmpack.trainer.dataset_check); one DatasetModelMismatch (a ValueError) listing every disagreement."""
    paths = [(data, None)] if isinstance(data, str) else [(s.path, s.storage_options) for s in data.sources]
    for path, options in paths:
        check_dataset_matches_model(load_manifest(path, storage_options=options), model_dir, dataset=path)


def build_stage_model(
    cfg: RunConfig, mcfg: MegatronConfigs, arch: ModelArch, *, use_te: bool, vp_stage: int | None = None
) -> torch.nn.Module:
    """This pipeline stage's (unwrapped) model with its weights; under the interleaved pipeline the model
    chunk ``vp_stage`` of this stage (the vision tower only in chunk 0 of the first stage, the output layer
    only in the last chunk of the last stage)."""
    fam = family_of(arch.source)
    model = fam.build_stage(
        arch, mcfg.model, use_te=use_te, vp_stage=vp_stage,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )  # fmt: skip
    experts = ExpertSlice(
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
    )  # fmt: skip
    tp = dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        experts=experts,
    )  # fmt: skip
    if cfg.model.hf_model:
        fam.hf.load_stage_weights(model, cfg.model.hf_model, arch, **tp)
    else:
        fam.hf.init_stage_random(model, arch, seed=cfg.train.seed, std=cfg.model.init_method_std, **tp)
    return model


def run_lora_spec(m: ModelConfig, arch: ModelArch) -> LoraSpec | None:
    """The run's LoRA (None: none) from the flags and ``--lora-adapter``'s adapter_config.json, its targets
    checked against every linear module of the whole model."""
    spec = resolve_spec(
        rank=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=m.lora_target_modules,
        adapter=m.lora_adapter,
    )  # fmt: skip
    if spec is not None:
        fam = family_of(arch.source)
        whole = fam.hf.part_rules(arch, first=True, last=True, layers=(0, arch.num_layers))
        check_targets(spec, whole, f"the {fam.model_type} model")
        if spec.adapter_dir:
            PeftTensors(spec.adapter_dir).check_modules(whole)
    return spec


def add_stage_lora(model: torch.nn.Module, cfg: RunConfig, arch: ModelArch, spec: LoraSpec) -> None:
    """LoRA adapters on this stage's (or model chunk's) targeted layers, from ``--lora-adapter`` or drawn."""
    rules = model_rules(family_of(arch.source).hf.part_rules, arch, model)
    add_lora(
        model, rules, spec, tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(), seed=cfg.train.seed,
        adapter=PeftTensors(spec.adapter_dir) if spec.adapter_dir else None,
    )  # fmt: skip


def build_model(
    cfg: RunConfig, mcfg: MegatronConfigs, arch: ModelArch, *, use_te: bool
) -> list[DistributedDataParallel]:
    """This stage's model chunks (one, or one per virtual stage of the interleaved pipeline), each cast and
    wrapped in megatron DDP (as Megatron-LM does, only the first chunk's gradients are bucketed); with LoRA
    the adapters on them, and only those train unless --trainable-modules names more."""
    vp = mcfg.language.virtual_pipeline_model_parallel_size
    lora = run_lora_spec(cfg.model, arch)
    if lora is not None and cfg.checkpoint.load:
        check_resume_base(cfg.checkpoint.load, cfg.model.hf_model)
    chunks = []
    for vp_stage in range(vp) if vp else [None]:
        model = build_stage_model(cfg, mcfg, arch, use_te=use_te, vp_stage=vp_stage)
        if lora is not None:
            add_stage_lora(model, cfg, arch, lora)
        m = cfg.model  # frozen parameters before DDP and the optimizer: no grad buffer, no optimizer state
        apply_freeze(
            model,
            tied=arch.tie_word_embeddings,
            adapter_prefixes=family_of(arch.source).adapter_prefixes,
            trainable_modules=m.trainable_modules,
            freeze_vision=m.freeze_vision,
            freeze_llm=m.freeze_llm,
            lora=lora is not None,
        )
        if torch.cuda.is_available():
            model.cuda()
        if cfg.precision.bf16 or cfg.precision.fp16:
            model = Float16Module(mcfg.language, model)
        chunks.append(
            DistributedDataParallel(
                config=mcfg.language, ddp_config=mcfg.ddp, module=model, disable_bucketing=bool(vp_stage)
            )
        )
    return chunks
