"""Pieces the Qwen vision towers share on megatron-core: 2-D rotary positions of the patches, attention
segments as cu_seqlens, the megatron-core configs of a tower and its patch-merger MLP, and the tower's base
module (Conv3d patch embedding, checkpoint shards of its layer lists).

Patches arrive in the image processor's order (merge-window-major: each merge x merge group of patches is
contiguous); a patch's rotary angles are those of its (row, column), head_dim / 4 frequencies each, side by
side and repeated for the two rotated halves (megatron-core's non-interleaved layout, as transformers' axial
RoPE of Qwen2-VL, Qwen2.5-VL and Qwen3-VL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

from mmpack.packing.cost import VisionFlopShape
from mmpack.packing.patch_positions import block_patch_positions
from mmpack.trainer.models.common import LayerNorm, build_layer_spec
from mmpack.trainer.models.segment_attention import SegmentAttention


@dataclass(kw_only=True, frozen=True)
class ViTArch:
    """What every vision tower's arch holds (a family's adds its own fields, and may change the defaults)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size: the merger's output
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def patch_hw_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """[P, 2] (row, column) of every patch in processor order."""
    return block_patch_positions(grid_thw, merge_size)[:, 1:]


def vision_rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[P, head_dim] rotary angles of patches at ``positions`` [P, 2] (see the module docstring)."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [P, 2, head_dim/4]
    angles = freqs.reshape(positions.shape[0], -1)  # rows' then columns' frequencies
    return torch.cat([angles, angles], dim=-1)


def segments(lengths: np.ndarray, device: torch.device) -> PackedSeqParams:
    """Attention blocks of ``lengths`` patches as cu_seqlens (``sbhd``: rotary angles stay per patch)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.as_tensor(np.cumsum(lengths), dtype=torch.int32, device=device)
    longest = int(lengths.max()) if len(lengths) else 0
    return PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def frame_lengths(grid_thw: np.ndarray) -> np.ndarray:
    """Patches of each image and of each temporal patch of a video: the blocks of full attention."""
    return np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])


@dataclass(kw_only=True, frozen=True)
class VLMegatronConfigs:
    """megatron-core configs of a vision-language model's parts: language model, vision transformer, patch
    merger MLP."""

    language: TransformerConfig
    vision: TransformerConfig
    projector: TransformerConfig


def merger_mlp(projector_config: TransformerConfig, merged_size: int) -> MultimodalProjector:
    """megatron-core's projector MLP of a patch merger: ``merged_size`` -> ``merged_size`` -> language hidden,
    column- then row-parallel."""
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return MultimodalProjector(projector_config, submodules, "mlp", merged_size)


class PatchMerger(MegatronModule):
    """LayerNorm per patch (or, ``after_merge``, over each merge group's concatenation), then the groups
    through a GELU MLP (:func:`merger_mlp`): Qwen3-VL's mergers and LLaVA-OneVision-2's."""

    def __init__(
        self, vision_config: TransformerConfig, projector_config: TransformerConfig, merge_units: int, *,
        after_merge: bool,
    ) -> None:  # fmt: skip
        super().__init__(projector_config)
        self.merged_size = vision_config.hidden_size * merge_units
        self.after_merge = after_merge
        size = self.merged_size if after_merge else vision_config.hidden_size
        self.norm = LayerNorm(vision_config, size, eps=vision_config.layernorm_epsilon)
        self.projector = merger_mlp(projector_config, self.merged_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.after_merge:
            return self.projector(self.norm(hidden.reshape(-1, self.merged_size)))
        return self.projector(self.norm(hidden).reshape(-1, self.merged_size))


def single_merger_flop_shape(v: ViTArch) -> VisionFlopShape:
    """The FLOP dimensions of a tower of full-attention layers with a plain (not gated) MLP and one merger, 2-D
    patches (temporal patch 1): the OneVision towers'."""
    return VisionFlopShape(
        hidden_size=v.hidden_size, num_layers=v.depth, ffn_hidden_size=v.intermediate_size, gated_mlp=False,
        patch_pixels=v.in_channels * v.patch_size**2, merge_units=v.spatial_merge_size**2,
        out_hidden_size=v.out_hidden_size, mergers=1,
    )  # fmt: skip


def tower_configs(
    *, depth: int, hidden_size: int, num_heads: int, ffn_hidden_size: int, merged_size: int, out_size: int,
    common: dict[str, Any], normalization: str, activation: Callable[..., torch.Tensor], gated: bool,
    layernorm_epsilon: float = 1e-6, rotary_interleaved: bool = False,
) -> tuple[TransformerConfig, TransformerConfig]:  # fmt: skip
    """megatron-core configs of a vision tower's layers and of its patch-merger MLP (``merged_size`` ->
    ``merged_size`` -> ``out_size``, GELU); ``common``: the run's parallel/precision fields. The tower runs on
    the first pipeline stage only, in the parameter dtype, and is never sequence-parallel (image patches are
    few and variable; they stay whole on every TP rank). ``rotary_interleaved``: the rotary angles turn
    adjacent pairs of a head's channels (LLaVA-OneVision-2) instead of its two halves."""
    vision_common = {**common, "pipeline_model_parallel_size": 1, "fp32_residual_connection": False}
    layers = TransformerConfig(
        num_layers=depth,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        kv_channels=hidden_size // num_heads,
        ffn_hidden_size=ffn_hidden_size,
        normalization=normalization,
        layernorm_epsilon=layernorm_epsilon,
        rotary_interleaved=rotary_interleaved,
        gated_linear_unit=gated,
        activation_func=activation,
        add_bias_linear=True,
        add_qkv_bias=True,
        sequence_parallel=False,
        **vision_common,
    )
    projector = TransformerConfig(
        num_layers=1,
        hidden_size=out_size,
        num_attention_heads=common["tensor_model_parallel_size"],  # unused by the MLP; TP must divide it
        ffn_hidden_size=merged_size,
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        sequence_parallel=False,
        **vision_common,
    )
    return layers, projector


class VisionTowerBase(MegatronModule):
    """A tower's patch embedding, its layers (``arch``: in_channels, temporal_patch_size, patch_size,
    hidden_size, depth) and its checkpoint shards. Subclasses add their merger(s) and the forward pass.

    ``flat_patches``: 2-D patches (temporal patch 1) through a Conv2d, as the OneVision checkpoints store the
    patch embedding; else a Conv3d over temporal x spatial patches (Qwen-VL)."""

    def __init__(
        self, config: TransformerConfig, arch: Any, *, norm: type[torch.nn.Module], patch_bias: bool,
        flat_patches: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self.arch = arch
        p = arch.patch_size
        self.embed_size = arch.hidden_size
        self.patch_embed: torch.nn.Conv2d | torch.nn.Conv3d
        if flat_patches:
            self.patch_shape: tuple[int, ...] = (arch.in_channels, p, p)
            self.patch_embed = torch.nn.Conv2d(
                arch.in_channels, arch.hidden_size, p, stride=p, bias=patch_bias
            )
        else:
            self.patch_shape = (arch.in_channels, arch.temporal_patch_size, p, p)
            kernel = self.patch_shape[1:]
            self.patch_embed = torch.nn.Conv3d(
                arch.in_channels, arch.hidden_size, kernel, stride=kernel, bias=patch_bias
            )
        # megatron-core's layer, its attention over the cu_seqlens segments of each forward
        spec = build_layer_spec(AttnMaskType.no_mask, norm=norm)
        spec.submodules.self_attention.submodules.core_attention = SegmentAttention
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config=config, layer_number=i + 1) for i in range(arch.depth)]
        )

    def _embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        width = int(np.prod(self.patch_shape))
        if pixel_values.shape[-1] != width:
            raise ValueError(
                f"pixel_values rows have {pixel_values.shape[-1]} values, the model takes {width}"
            )
        x = pixel_values.reshape(-1, *self.patch_shape)
        return self.patch_embed(x.to(self.patch_embed.weight.dtype)).reshape(-1, self.embed_size)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Checkpoint shards: megatron-core's default would treat a plain ``ModuleList`` (of layers, of
        mergers) as replicated over TP; each member's own ``sharded_state_dict`` knows its tensor-parallel
        cuts."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out: dict = {}
        for name, child in self.named_children():
            members = list(enumerate(child)) if isinstance(child, torch.nn.ModuleList) else [(None, child)]
            for i, member in members:
                key = f"{prefix}{name}." if i is None else f"{prefix}{name}.{i}."
                tp_group = ps.get_tensor_model_parallel_group()
                out.update(
                    sharded_state_dict_default(member, key, sharded_offsets, metadata, tp_group=tp_group)
                )
        return out
