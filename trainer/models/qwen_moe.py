"""The mixture-of-experts MLP of the Qwen3-MoE language models (Qwen3-VL-MoE, and Qwen3-30B-A3B-style text
models behind other vision towers) on megatron-core's MoE layer: its architecture from ``text_config``
(:func:`moe_arch_from_text`), its megatron-core config fields (:func:`moe_config_fields`) and the HF weight
rules of its router and experts (:func:`moe_rules`).

Every decoder layer's MLP is a router (a linear layer to the experts' logits, softmax, top-k, the k
probabilities renormalised when ``norm_topk_prob``) and ``num_experts`` SwiGLU experts, transformers'
``Qwen3MoeSparseMoeBlock``. megatron-core routes the same way: top-k of the logits then softmax over the k
is softmax, top-k and renormalisation (``moe_router_pre_softmax`` False); softmax then top-k without
renormalisation is ``moe_router_pre_softmax`` True. The load-balancing loss is megatron-core's
``aux_loss`` (Switch Transformer's, per layer) with config.json's ``router_aux_loss_coef``.

The experts are megatron-core's ``SequentialMLP`` (one MLP per local expert, also under Transformer Engine:
its grouped GEMM names the weights otherwise); expert parallelism spreads them over EP ranks, megatron-core's
token dispatchers bring the tokens to them. Without CUDA (gloo) only the ``allgather`` dispatcher runs:
megatron-core 0.16.1's ``alltoall`` one creates a CUDA stream, ``flex`` needs DeepEP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils

from mmpack.trainer.models.hf_weights import Rule

# megatron-core 0.16.1's router gating reads `te_general_gemm`, which it defines only when Transformer
# Engine imports (a NameError without it); None selects its own torch path.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


@dataclass(kw_only=True, frozen=True)
class MoEArch:
    """The experts of every decoder layer (transformers' ``Qwen3MoeSparseMoeBlock``)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 0.0
    # HF layout of the experts: transformers 5's stacked tensors, or (``per_expert_files``) each expert's own
    # ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (the Qwen3-MoE checkpoint layout)
    per_expert_files: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts {self.num_experts}")
        if self.ffn_hidden_size < 1 or self.aux_loss_coeff < 0:
            raise ValueError("moe_intermediate_size must be >= 1 and router_aux_loss_coef >= 0")


def moe_arch_from_text(text: dict[str, Any], *, norm_topk_prob: bool | None = None) -> MoEArch:
    """The experts of a ``text_config`` dict; ``norm_topk_prob``: fixed by the model (Qwen3-VL-MoE always
    renormalises), else read from the file. ValueError for layouts other than experts in every layer."""
    if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            "only experts in every decoder layer are supported (mlp_only_layers empty, decoder_sparse_step 1)"
        )
    if text.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported (shared_expert_intermediate_size)")
    experts = text.get("num_experts", text.get("num_local_experts"))
    if experts is None:
        raise ValueError("text_config has no num_experts: not a mixture-of-experts model")
    return MoEArch(
        num_experts=int(experts),
        top_k=int(text.get("num_experts_per_tok", 2)),
        ffn_hidden_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=bool(text.get("norm_topk_prob", True) if norm_topk_prob is None else norm_topk_prob),
        aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.001)),
    )


def text_has_experts(cfg: dict[str, Any]) -> bool:
    """Whether the text model of a ``config.json`` dict is a mixture of experts (a Qwen3-MoE ``text_config``)."""
    text = cfg.get("text_config") or {}
    return text.get("model_type") == "qwen3_moe" or bool(text.get("num_experts"))


def tiny_moe_text_fields(
    num_experts: int | None, top_k: int | None, aux: float | None, hidden: int, ffn: int | None = None
) -> dict:
    """``text_config`` fields of a small random mixture of experts (4 experts, 2 per token by default; each
    expert ``ffn`` wide, else as wide as the hidden size)."""
    return {
        "num_experts": num_experts or 4,
        "num_experts_per_tok": top_k or min(2, num_experts or 4),
        "moe_intermediate_size": ffn or hidden,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001 if aux is None else float(aux),
    }


def moe_config_fields(moe: MoEArch, dispatcher: str) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` fields of the experts (see the module docstring)."""
    if dispatcher != "allgather" and not torch.cuda.is_available():
        raise ValueError(
            f"--moe-token-dispatcher-type {dispatcher} needs CUDA (megatron-core's {dispatcher} dispatcher); "
            "on CPU give allgather"
        )
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )


def moe_rules(moe: MoEArch, hidden_size: int, hf: str, mc: str) -> dict[str, Rule]:
    """HF rules of one layer's router and experts: HF names ``{hf}gate.weight`` and ``{hf}experts.
    gate_up_proj`` / ``down_proj`` (transformers 5's stacked [experts, out, in] tensors), megatron-core names
    under ``{mc}`` (its MoE layer) with global expert numbers."""
    rules = {mc + "router.weight": Rule("copy", (hf + "gate.weight",), None)}
    if moe.per_expert_files:
        return rules | _per_expert_rules(moe, hf, mc)
    stacked = dict(experts=moe.num_experts)
    for e in range(moe.num_experts):
        ours = f"{mc}experts.local_experts.{e}."
        rules[ours + "linear_fc1.weight"] = Rule(
            "fused_glu", (hf + "experts.gate_up_proj",), expert=e, rows=2 * moe.ffn_hidden_size, **stacked
        )
        rules[ours + "linear_fc2.weight"] = Rule(
            "copy", (hf + "experts.down_proj",), 1, expert=e, rows=hidden_size, **stacked
        )
    return rules


def _per_expert_rules(moe: MoEArch, hf: str, mc: str) -> dict[str, Rule]:
    """The experts' rules where each expert has its own 2-D HF tensors (``experts`` 0: not stacked)."""
    rules = {}
    for e in range(moe.num_experts):
        ours, theirs = f"{mc}experts.local_experts.{e}.", f"{hf}experts.{e}."
        rules[ours + "linear_fc1.weight"] = Rule(
            "glu", (theirs + "gate_proj.weight", theirs + "up_proj.weight"), expert=e
        )
        rules[ours + "linear_fc2.weight"] = Rule("copy", (theirs + "down_proj.weight",), 1, expert=e)
    return rules


def mark_expert_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its experts' parameters marked expert-parallel (``allreduce`` False) also under EP 1,
    where megatron-core marks them dense: then DDP and the optimizer group them alike under every EP size
    (a dense and an expert optimizer, over the same data-parallel ranks at EP 1), so that a checkpoint's
    optimizer state resumes under another EP size."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False  # type: ignore[attr-defined]
    return model
