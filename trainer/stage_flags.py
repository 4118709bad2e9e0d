"""Megatron-LM flags of the LLaVA-OneVision-2 stage scripts that mmpack settles elsewhere (the tokenizer, chat
template and overlength policy when packing; the loader and checkpoint formats by design): each is accepted and
checked against what the run really does, accepted with a one-line note, or refused in one line naming the flag
and what mmpack does instead. The flags with a trainer meaning of their own (``--split``, the recompute and
custom-pipeline flags, ``--lr-warmup-fraction``, ``--distributed-backend``, ``--data-parallel-size``) live in the
configs they change (``trainer/config.py``); docs/trainer-flags.md, generated from the fields, lists all of them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from mmpack.trainer.flags import flag

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import ModelArch

TokenizerType = Literal["HFTokenizer", "NullTokenizer"]
TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)
# chat templates of the stage scripts that write Qwen's ChatML turns (<|im_start|>role ... <|im_end|>)
CHATML_TEMPLATES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen", "qwen2", "qwen3", "chatml")


class StageFlagRefused(ValueError):
    """A stage-script flag whose Megatron-LM meaning mmpack does not have (one line: the flag, what instead)."""


# the stage-script flags that set no field (the run is the same with or without them): accepted or refused by
# refuse_unsupported, added by add_stage_flags
HAND_WRITTEN_FLAGS = {
    "--training-phase": "sft is what the packed loss mask already is; pretrain is refused",
    "--dataloader-type": "external is mmpack's loader; single/cyclic are refused",
    "--optimizer": "adam is megatron-core's Adam the trainer runs; sgd is refused",
    "--ckpt-fully-parallel-load": "every rank reads only its own shards already",
}


def add_stage_flags(g: argparse._ArgumentGroup) -> None:
    """The stage-script flags of :data:`HAND_WRITTEN_FLAGS` (the others are :class:`StageFlags`'s fields)."""
    g.add_argument("--training-phase", choices=("pretrain", "sft"), default=None, help="sft: the loss mask packed with the dataset (assistant turns); pretrain is refused")  # fmt: skip
    g.add_argument("--dataloader-type", choices=("single", "cyclic", "external"), default=None, help="external (mmpack's packed loader); single/cyclic are refused")  # fmt: skip
    g.add_argument("--optimizer", choices=("adam", "sgd"), default=None, help="adam (megatron-core's Adam with decoupled weight decay, the default); sgd is refused")  # fmt: skip
    g.add_argument("--ckpt-fully-parallel-load", action="store_true", help="accepted: every rank reads only its own shards already")  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class StageFlags:
    """The stage-script flags that the trainer checks against its dataset and model, or notes."""

    model_name: str | None = flag(
        None, help="a label (logged); the architecture is --hf-model's, the checkpoint's or the size flags'"
    )
    tokenizer_type: TokenizerType | None = flag(
        None,
        help="HFTokenizer: checked that the dataset was packed with a real tokenizer (not the byte-level demo "
        "one); NullTokenizer is refused",
    )
    hf_tokenizer_path: str | None = flag(
        None,
        help="tokenizer folder or tokenizer.json: its sha256 must equal the one in the dataset's manifest (the "
        "tokenizer is fixed when packing)",
    )
    chat_template: str | None = flag(
        None,
        help="must be a ChatML template (qwen2-vl, qwen2.5-vl, qwen3-vl, ...) and the dataset's tokenizer must "
        "have <|im_start|>/<|im_end|>: the template is applied when packing",
    )
    enable_discard_sample: bool = flag(
        False, help="checked: the dataset must have been packed with --overlength drop or error"
    )
    dataloader_save: str | None = flag(
        None, help="accepted with a note: the loader's state is saved inside every checkpoint of --save"
    )
    norm_epsilon: float | None = flag(None, help="checked: must equal the model's RMSNorm epsilon")
    max_position_embeddings: int | None = flag(
        None, help="checked: must be >= the sequence length (rotary positions, no table)"
    )
    ckpt_format: Literal["torch", "torch_dist", "zarr"] = flag(
        "torch_dist",
        help="mmpack writes megatron-core's torch_dist (reshardable); torch gives a note, zarr is refused",
    )
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = flag(
        "auto",
        help="CUDA: Transformer Engine's attention (flash/fused kernels); CPU: megatron-core's local attention "
        "(flash/fused give a note)",
    )
    length_sort_pool_size: int = flag(
        0,
        help="> 0: no pool of samples is sorted (bins are packed to even lengths offline); turns on --balance "
        "compute unless --balance is given",
    )
    moe_per_layer_logging: bool = flag(
        False,
        help="each MoE layer's load-balancing loss in the metrics file and TensorBoard (the mean over layers "
        "is always logged)",
    )

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
    """Raise :class:`StageFlagRefused` for the first flag given with a meaning mmpack does not have (``args``:
    the parsed flags; a config field's flag not given is absent)."""
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
            vars(args).get("tokenizer_type") == "NullTokenizer",
            "the tokens come from the packed dataset's tokenizer: give --tokenizer-type HFTokenizer or leave it out",
        ),
        "--ckpt-format zarr": (
            vars(args).get("ckpt_format") == "zarr",
            "mmpack writes torch_dist checkpoints only",
        ),
    }
    for name, (given, instead) in refusals.items():
        if given:
            raise StageFlagRefused(f"{name} is not supported: {instead}")


def resolve_balance(args: argparse.Namespace) -> str:
    """``--balance`` as given, else ``compute`` when ``--length-sort-pool-size`` > 0 asks for even ranks
    (what the pool's length sort is for), else ``none``."""
    given = vars(args)  # a config field's flag not given is absent
    if given.get("balance") is not None:
        return str(given["balance"])
    return "compute" if (given.get("length_sort_pool_size") or 0) > 0 else "none"


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
    import hashlib

    from mmpack.packing.tokenizer import TOKENIZER_FILE

    file = Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"--hf-tokenizer-path {path}: no {TOKENIZER_FILE} there")
    # the file's hash, as the manifest records it (`HFTokenizer.sha256`): whichever model's control tokens it has
    sha = hashlib.sha256(file.read_bytes()).hexdigest()
    if sha != tokenizer.get("sha256"):
        raise ValueError(
            f"--hf-tokenizer-path {path}: its {TOKENIZER_FILE} (sha256 {sha[:12]}) is not the tokenizer "
            f"{data_path} was packed with (sha256 {str(tokenizer.get('sha256'))[:12]}, manifest.json); "
            f"repack with `mmpack pack --tokenizer {path}` or point at the packing tokenizer"
        )


def check_model_flags(flags: StageFlags, arch: ModelArch, *, seq_length: int, source: str) -> None:
    """``--norm-epsilon`` against the model's RMSNorm epsilon, ``--max-position-embeddings`` against the run's
    sequence length."""
    eps = arch.rms_norm_eps
    if flags.norm_epsilon is not None and not math.isclose(flags.norm_epsilon, eps):
        raise ValueError(
            f"--norm-epsilon {flags.norm_epsilon}: the model ({source}) has RMSNorm epsilon {eps}; leave the "
            "flag out or give the model's value"
        )
    if flags.max_position_embeddings is not None and flags.max_position_embeddings < seq_length:
        raise ValueError(
            f"--max-position-embeddings {flags.max_position_embeddings} is shorter than the sequence length "
            f"{seq_length} of the run"
        )
