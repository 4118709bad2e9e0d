"""Megatron-LM flags of the LLaVA-OneVision-2 stage scripts that mmpack settles elsewhere (the tokenizer, chat
template and overlength policy when packing; the loader and checkpoint formats by design): each is accepted and
checked against what the run really does, accepted with a one-line note, or refused in one line naming the flag
and what mmpack does instead. The flags with a trainer meaning of their own (``--split``, the recompute and
custom-pipeline flags, ``--lr-warmup-fraction``, ``--distributed-backend``, ``--data-parallel-size``) live in the
configs they change (``trainer/config.py``); README's "Flags of Megatron-LM stage scripts" lists all of them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_TYPES = ("HFTokenizer", "NullTokenizer")
# chat templates of the stage scripts that write Qwen's ChatML turns (<|im_start|>role ... <|im_end|>)
CHATML_TEMPLATES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen", "qwen2", "qwen3", "chatml")


class StageFlagRefused(ValueError):
    """A stage-script flag whose Megatron-LM meaning mmpack does not have (one line: the flag, what instead)."""


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    """The flags of this module (one group, so that other flag groups merge around it)."""
    g = p.add_argument_group("Megatron-LM stage-script flags settled by the dataset or by mmpack's design")
    g.add_argument("--model-name", default=None, help="a label (logged); the architecture is --hf-model's, the checkpoint's or the size flags'")  # fmt: skip
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None, help="HFTokenizer: checked against the dataset's manifest (the tokenizer is fixed when packing)")  # fmt: skip
    g.add_argument("--hf-tokenizer-path", default=None, help="tokenizer folder or tokenizer.json: its sha256 must equal the manifest's")  # fmt: skip
    g.add_argument("--chat-template", default=None, help="must be a ChatML template (qwen2-vl, ...): the dataset was tokenized with one when packing")  # fmt: skip
    g.add_argument("--training-phase", choices=("pretrain", "sft"), default=None, help="sft: the loss mask packed with the dataset (assistant tokens); pretrain is refused")  # fmt: skip
    g.add_argument("--enable-discard-sample", action="store_true", help="checked: the dataset must have been packed with --overlength drop or error")  # fmt: skip
    g.add_argument("--length-sort-pool-size", type=int, default=0, help="> 0: turns on --balance compute unless --balance is given (bins are packed to even lengths offline)")  # fmt: skip
    g.add_argument("--dataloader-type", choices=("single", "cyclic", "external"), default=None, help="external (mmpack's packed loader); single/cyclic refused")  # fmt: skip
    g.add_argument("--dataloader-save", default=None, help="accepted: the loader's state is saved inside every checkpoint of --save")  # fmt: skip
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="adam (AdamW, --weight-decay); sgd refused")  # fmt: skip
    g.add_argument("--norm-epsilon", type=float, default=None, help="checked: must equal the model's RMSNorm epsilon")  # fmt: skip
    g.add_argument("--max-position-embeddings", type=int, default=None, help="checked: must be >= the sequence length (RoPE has no table)")  # fmt: skip
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "zarr"), default="torch_dist", help="mmpack writes torch_dist (reshardable); torch gives a warning, zarr is refused")  # fmt: skip
    g.add_argument("--ckpt-fully-parallel-load", action="store_true", help="accepted: every rank reads only its own shards already")  # fmt: skip
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"), default="auto", help="CUDA: Transformer Engine's attention (flash/fused kernels); CPU: megatron-core's local attention")  # fmt: skip
    g.add_argument("--moe-per-layer-logging", action="store_true", help="each MoE layer's load-balancing loss in the metrics and TensorBoard (the mean over layers is always logged)")  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class StageFlags:
    """The values of :func:`add_stage_flags`'s flags that the trainer checks against its dataset and model."""

    model_name: str | None = None
    tokenizer_type: str | None = None
    hf_tokenizer_path: str | None = None
    chat_template: str | None = None
    enable_discard_sample: bool = False
    dataloader_save: str | None = None
    norm_epsilon: float | None = None
    max_position_embeddings: int | None = None
    ckpt_format: str = "torch_dist"
    attention_backend: str = "auto"
    length_sort_pool_size: int = 0
    moe_per_layer_logging: bool = False

    def __post_init__(self) -> None:
        if self.chat_template is not None and self.chat_template not in CHATML_TEMPLATES:
            raise StageFlagRefused(
                f"--chat-template {self.chat_template}: mmpack applies the chat template when packing and trains "
                f"on the packed tokens; the trainer accepts the ChatML ones ({', '.join(CHATML_TEMPLATES)}): "
                "repack with `mmpack pack --chat-template FILE` for another"
            )
        if self.length_sort_pool_size < 0:
            raise ValueError(f"--length-sort-pool-size must be >= 0, got {self.length_sort_pool_size}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"--max-position-embeddings must be >= 1, got {self.max_position_embeddings}")

    def notes(self, *, on_cpu: bool, balance: str = "none") -> list[str]:
        """The one-line notes of accepted flags that do something other than their name says (``balance``:
        the run's --balance)."""
        notes = []
        if self.length_sort_pool_size:
            notes.append(f"--length-sort-pool-size {self.length_sort_pool_size}: no pool of samples is sorted; bins are packed to even lengths offline and " + ("--balance compute spreads each global batch's bins over the DP ranks by compute cost" if balance == "compute" else f"--balance {balance} was given, so bins are not re-spread by cost"))  # fmt: skip
        if self.ckpt_format == "torch":
            notes.append("--ckpt-format torch: mmpack writes megatron-core's torch_dist format (reshardable over TP/PP/DP)")  # fmt: skip
        if self.dataloader_save:
            notes.append(f"--dataloader-save {self.dataloader_save}: the loader's state is saved inside each checkpoint of --save; nothing is written there")  # fmt: skip
        if on_cpu and self.attention_backend in ("flash", "fused"):
            notes.append(f"--attention-backend {self.attention_backend}: no such kernel without CUDA; megatron-core's local attention runs")  # fmt: skip
        return notes


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Raise :class:`StageFlagRefused` for the first flag given with a meaning mmpack does not have."""
    refusals = {
        "--training-phase pretrain": (
            args.training_phase == "pretrain",
            "the loss mask is fixed when packing (assistant turns): pack captions as assistant turns and give "
            "--training-phase sft (or leave it out)",
        ),
        f"--dataloader-type {args.dataloader_type}": (
            args.dataloader_type in ("single", "cyclic"),
            "mmpack reads packed bins with its own loader (deterministic order, exact resume): give "
            "--dataloader-type external or leave it out",
        ),
        "--optimizer sgd": (args.optimizer == "sgd", "mmpack trains with megatron-core's Adam (AdamW) only"),
        "--tokenizer-type NullTokenizer": (
            args.tokenizer_type == "NullTokenizer",
            "the tokens come from the packed dataset's tokenizer: give --tokenizer-type HFTokenizer or leave it out",
        ),
        "--ckpt-format zarr": (args.ckpt_format == "zarr", "mmpack writes torch_dist checkpoints only"),
    }
    for flag, (given, instead) in refusals.items():
        if given:
            raise StageFlagRefused(f"{flag} is not supported: {instead}")


def resolve_balance(args: argparse.Namespace) -> str:
    """``--balance`` as given, else ``compute`` when ``--length-sort-pool-size`` > 0 asks for even ranks
    (what the pool's length sort is for), else ``none``."""
    if args.balance is not None:
        return str(args.balance)
    return "compute" if (args.length_sort_pool_size or 0) > 0 else "none"


def check_stage_flags(flags: StageFlags, manifest: dict[str, Any], *, data_path: str) -> None:
    """The dataset-fixed flags against the packed dataset's manifest (``Manifest.raw``): ValueError naming
    the flag, the dataset's value and what to do."""
    tokenizer = manifest.get("tokenizer") or {}
    if flags.tokenizer_type == "HFTokenizer" and tokenizer.get("is_fallback"):
        raise ValueError(
            f"--tokenizer-type HFTokenizer: {data_path} was packed with the byte-level demo tokenizer; "
            "repack it with `mmpack pack --tokenizer DIR`"
        )
    if flags.hf_tokenizer_path:
        _check_tokenizer_file(flags.hf_tokenizer_path, tokenizer, data_path)
    special = tokenizer.get("special_ids") or {}
    if flags.chat_template and not {"im_start", "im_end"} <= special.keys():
        raise ValueError(
            f"--chat-template {flags.chat_template}: the tokenizer of {data_path} has no <|im_start|>/<|im_end|> "
            "tokens, so its samples are not ChatML turns; repack with a Qwen tokenizer"
        )
    if flags.enable_discard_sample and manifest.get("overlength") == "truncate":
        raise ValueError(
            f"--enable-discard-sample: {data_path} was packed with --overlength truncate (long samples cut, "
            "not discarded); repack it with --overlength drop"
        )


def _check_tokenizer_file(path: str, tokenizer: dict[str, Any], data_path: str) -> None:
    from mmpack.packing.tokenizer import TOKENIZER_FILE, load_tokenizer

    file = Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"--hf-tokenizer-path {path}: no {TOKENIZER_FILE} there")
    sha = load_tokenizer(file).sha256
    if sha != tokenizer.get("sha256"):
        raise ValueError(
            f"--hf-tokenizer-path {path}: its {TOKENIZER_FILE} (sha256 {sha[:12]}) is not the tokenizer "
            f"{data_path} was packed with (sha256 {str(tokenizer.get('sha256'))[:12]}, manifest.json); "
            f"repack with `mmpack pack --tokenizer {path}` or point at the packing tokenizer"
        )


def check_model_flags(flags: StageFlags, arch: Any, *, seq_length: int, source: str) -> None:
    """``--norm-epsilon`` against the model's RMSNorm epsilon, ``--max-position-embeddings`` against the run's
    sequence length."""
    eps = getattr(arch, "rms_norm_eps", None)
    if flags.norm_epsilon is not None and eps is not None and not math.isclose(flags.norm_epsilon, eps):
        raise ValueError(
            f"--norm-epsilon {flags.norm_epsilon}: the model ({source}) has RMSNorm epsilon {eps}; leave the "
            "flag out or give the model's value"
        )
    if flags.max_position_embeddings is not None and flags.max_position_embeddings < seq_length:
        raise ValueError(
            f"--max-position-embeddings {flags.max_position_embeddings} is shorter than the sequence length "
            f"{seq_length} of the run"
        )
