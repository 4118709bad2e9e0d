"""The contract of a model family: everything generic trainer code (building, weights, checkpoints, conversion,
positions, FLOPs, freezing) asks of a model, behind one typed interface named by its ``model_type``.

A family implements :class:`ModelFamily` over its architecture (a :class:`ModelArch`, read from
``config.json``): a small random ``config.json`` of the same layout (:class:`TinyModelSpec`), its megatron-core
configs, the model of one pipeline stage, the MRoPE position rule of its image and video tokens, the video-token
rule its processor follows (``mmpack.packing.video_tokens``) and its FLOP shape, the one formula behind both
MFU and ``--balance compute`` (``mmpack.packing.cost``). It declares which ``config.json`` files it reads
(:meth:`ModelFamily.claims`) and which of its parameters are the adapter (``--trainable-modules``). Its HF
weights are a separate object, its state-dict adapter (:class:`HFAdapter`, ``family.hf``): the HF rules of a
part of the model, from which import and export per TP x PP slice go through
:mod:`mmpack.trainer.models.hf_weights`.

Generic trainer code reads of an architecture only what :class:`ModelArch` declares, and never imports a family
module: it asks the registry (:mod:`mmpack.trainer.models`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from mmpack.packing.batch import PositionRule
from mmpack.packing.cost import CostModel, ModelFlopShape, forward_flop_model
from mmpack.trainer.models import hf_check, hf_weights
from mmpack.trainer.models.hf_weights import ExpertSlice, Rule

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from mmpack.trainer.models.qwen_moe import MoEArch


class TowerArch(Protocol):
    """What generic code reads of a vision tower: how images become patches and merged tokens, and its sizes."""

    @property
    def patch_size(self) -> int: ...
    @property
    def spatial_merge_size(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def depth(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...


class ModelArch(Protocol):
    """Everything generic trainer code reads of an architecture (each family's arch has more)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def image_token_id(self) -> int: ...
    @property
    def video_token_id(self) -> int: ...
    @property
    def vision(self) -> TowerArch: ...
    @property
    def moe(self) -> MoEArch | None: ...  # the experts of every language layer's MLP; None: dense MLPs
    @property
    def source(self) -> dict[str, Any]: ...  # the config.json it was read from, written back on export


ArchT = TypeVar("ArchT", bound=ModelArch)


class FamilyConfigs(Protocol):
    """A family's megatron-core configs; ``language`` is the one the schedule and DDP take."""

    @property
    def language(self) -> TransformerConfig: ...


@dataclass(kw_only=True, frozen=True)
class TinyModelSpec:
    """Sizes and special ids of a small random model (the trainer's size flags and the dataset's ids)."""

    vocab_size: int
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    ffn_hidden_size: int | None = None
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    patch_size: int = 14
    merge_size: int = 2
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    # a mixture-of-experts family's experts (None: its defaults; a dense family has none)
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_aux_loss_coeff: float | None = None


class HFAdapter(abc.ABC, Generic[ArchT]):
    """A family's HF state-dict adapter: it names, in :meth:`part_rules`, the HF tensors of every parameter of a
    part of the model; reading, cutting, merging and checking follow from those rules."""

    @abc.abstractmethod
    def part_rules(self, arch: ArchT, *, first: bool, last: bool, layers: tuple[int, int]) -> dict[str, Rule]:
        """HF rules of a consecutive part of the model: ``first`` (vision tower and embedding), the
        language ``layers`` (first global layer, count), ``last`` (final norm and output layer)."""

    def tensor_shapes(self, arch: ArchT) -> dict[str, tuple[int, ...]] | None:
        """Name -> shape of every tensor ``save_pretrained`` writes for ``arch``, where the family has the
        table (checked before loading); None: names only, shapes checked against the built parameters."""
        return None

    def check_hf_weights(self, model_dir: str | Path, arch: ArchT) -> None:
        """The files of ``model_dir`` hold float tensors of exactly the names (and shapes) ``arch``
        describes; ValueError in one line otherwise (reads the file headers only)."""
        shapes = self.tensor_shapes(arch)
        expected = set(shapes) if shapes is not None else hf_check.expected_hf_names(self.part_rules, arch)
        with hf_weights.open_hf_weights(model_dir) as reader:
            hf_check.check_weight_files(reader, expected, shapes, arch=arch)

    def stage_rules(
        self, arch: ArchT, pp_rank: int, pp_size: int, layers: tuple[int, int] | None = None
    ) -> dict[str, Rule]:
        """megatron-core parameter name -> :class:`Rule` of one pipeline stage (even split unless ``layers``)."""
        return hf_weights.stage_rules(self.part_rules, arch, pp_rank, pp_size, layers)

    def load_stage_weights(
        self, model: torch.nn.Module, model_dir: str | Path, arch: ArchT, *, tp_rank: int, tp_size: int,
        experts: ExpertSlice | None = None,
    ) -> int:  # fmt: skip
        """This rank's slice of the HF weights of ``model_dir`` into ``model`` (the files checked first, see
        :meth:`check_hf_weights`; ``experts``: this rank's experts of a mixture of experts); returns the
        tensors read."""
        self.check_hf_weights(model_dir, arch)
        return hf_weights.load_stage_weights(
            self.part_rules, model, model_dir, arch, tp_rank=tp_rank, tp_size=tp_size, experts=experts
        )

    def init_stage_random(
        self, model: torch.nn.Module, arch: ArchT, *, seed: int, std: float, tp_rank: int, tp_size: int,
        experts: ExpertSlice | None = None,
    ) -> None:  # fmt: skip
        """Random HF-layout weights (the same model under every TP x PP x EP layout), this rank's slices."""
        hf_weights.init_stage_random(
            self.part_rules, model, arch, seed=seed, std=std, tp_rank=tp_rank, tp_size=tp_size,
            experts=experts,
        )  # fmt: skip

    def stage_state_dict(
        self, model_dir: str | Path, arch: ArchT, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
    ) -> dict[str, torch.Tensor]:
        """The megatron-core state dict of one (TP, PP) rank from HF weights, without building the model."""
        return hf_weights.stage_state_dict(
            self.part_rules, model_dir, arch, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
            pp_size=pp_size,
        )  # fmt: skip

    def hf_state_dict(
        self, arch: ArchT, shards: dict[tuple[int, int], dict[str, Any]], tp_size: int, pp_size: int
    ) -> dict[str, torch.Tensor]:
        """HF tensors from the state dicts of every (tp_rank, pp_rank) of a checkpoint."""
        return hf_weights.hf_state_dict(self.part_rules, arch, shards, tp_size, pp_size)


class ModelFamily(abc.ABC, Generic[ArchT]):
    """One model family (see the module docstring). Subclasses set the declarations below and implement the
    abstract methods."""

    model_type: str  # the family's name: its registry key and --model-type
    hf_model_types: tuple[str, ...]  # the config.json "model_type"s it reads (see `claims`)
    video_rule: str  # `mmpack.packing.video_tokens.VideoTokenRule.style` of its video processor
    hf: HFAdapter[ArchT]  # its HF state-dict adapter
    # stage-model parameters (by name prefix) of the adapter between tower and language model; the rest of
    # ``vision.`` is the vision model (``--trainable-modules``, ``--freeze-vision``)
    adapter_prefixes: tuple[str, ...] = ("vision.merger.",)

    def claims(self, hf_config: dict[str, Any]) -> bool:
        """Whether this family reads the model of ``hf_config`` (a ``config.json`` dict): by default, one
        of its ``hf_model_types``."""
        return hf_config.get("model_type") in self.hf_model_types

    @abc.abstractmethod
    def arch_from_hf_config(self, cfg: dict[str, Any]) -> ArchT:
        """The architecture of a ``config.json`` dict; ValueError if unsupported."""

    @abc.abstractmethod
    def tiny_hf_config(self, spec: TinyModelSpec) -> dict[str, Any]:
        """A ``config.json`` dict of a small random model of this family."""

    @abc.abstractmethod
    def megatron_configs(
        self, arch: ArchT, common: dict[str, Any], language_extra: dict[str, Any]
    ) -> FamilyConfigs:
        """megatron-core configs of the model's parts; ``common``: the run's parallel/precision fields,
        ``language_extra``: the language model's own (SP, pipeline split, recomputation, experts' dispatcher)."""

    @abc.abstractmethod
    def build_stage(
        self, arch: ArchT, configs: Any, *, pre_process: bool, post_process: bool, use_te: bool = False,
        vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        """The (unwrapped, unweighted) model of one pipeline stage or model chunk (``configs``: this family's
        :meth:`megatron_configs`): per-token loss [b, s] from ``forward(tokens, position_ids, attention_mask,
        labels, ...)`` on the last stage; its parameters named ``vision.*`` and ``language_model.*``."""

    @abc.abstractmethod
    def position_rule(self, arch: ArchT) -> PositionRule:
        """How the positions of a packed micro-batch (its tokens' and, where the tower takes them, its
        patches') are made from its tokens and grids."""

    @abc.abstractmethod
    def flop_shape(self, arch: ArchT) -> ModelFlopShape:
        """The dimensions the FLOP count reads (``mmpack.packing.cost.forward_flop_model``)."""

    def flop_model(self, arch: ArchT, *, attention_by_sample: bool = True) -> CostModel:
        """Forward FLOPs of a bin as a linear cost model over its features: MFU counts 3x this (with
        attention per sample), ``--balance compute`` evens it out over DP ranks (attention per sample only
        where the language model attends per sample, i.e. with Transformer Engine)."""
        return forward_flop_model(self.flop_shape(arch), attention_by_sample=attention_by_sample)

    def size_flags_of(self, arch: ArchT) -> dict[str, float]:
        """The model's sizes under the trainer's size-flag names (``ModelConfig`` fields), which must not
        contradict a model loaded from a folder or checkpoint (a dense model has no experts)."""
        moe = arch.moe
        return {
            "num_experts": moe.num_experts if moe else 0,
            "moe_router_topk": moe.top_k if moe else 0,
            "moe_aux_loss_coeff": moe.aux_loss_coeff if moe else 0.0,
            "num_layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "num_attention_heads": arch.num_attention_heads,
            "num_query_groups": arch.num_key_value_heads,
            "ffn_hidden_size": arch.intermediate_size,
            "vision_num_layers": arch.vision.depth,
            "vision_hidden_size": arch.vision.hidden_size,
            "vision_num_attention_heads": arch.vision.num_heads,
        }
