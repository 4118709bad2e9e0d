"""Gemma 4's rotary angles per layer type (``text_config.rope_parameters``).

Sliding layers rotate every frequency pair of their head (``default``). Full-attention layers use
``proportional`` RoPE: of the ``head_dim / 2`` frequency pairs only the first ``partial_rotary_factor`` share
rotate, with the frequencies of the full head size (``theta ** (-2i / head_dim)``), and the remaining pairs have
frequency 0 (not rotated). megatron-core's ``rotary_percent`` is a different rule (frequencies of the rotated
size, ``theta ** (-2i / (percent * head_dim))``), so the family gives its own frequencies.

The angles are laid out as transformers and megatron-core's non-interleaved rotary both apply them: the
frequencies twice over (``cat(freqs, freqs)``), rotating the first half of the head against the second.
"""

from __future__ import annotations

import torch

from mmpack.trainer.models.gemma4.config import Gemma4TextArch


def inv_freq(arch: Gemma4TextArch, layer: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of ``layer``."""
    rope, head_dim = arch.layer_rope(layer), arch.layer_head_dim(layer)
    if rope.kind == "default":
        freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        return freq
    rotated = int(rope.partial_rotary_factor * head_dim // 2)
    freq = 1.0 / rope.theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / head_dim)
    freq = torch.cat([freq, torch.zeros(head_dim // 2 - rotated)])
    return freq / rope.factor


def angles(arch: Gemma4TextArch, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """[s, head_dim] rotary angles of token ``positions`` [s] (each sample of a packed bin from 0)."""
    freqs = positions[:, None].float() * inv_freq(arch, layer)[None, :]
    return torch.cat([freqs, freqs], dim=-1)
