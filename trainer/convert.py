"""``mmpack convert``: HuggingFace checkpoints <-> the trainer's megatron-core checkpoints.

    mmpack convert hf-to-mcore --hf DIR --out CKPT --tp N --pp M
    mmpack convert mcore-to-hf --ckpt CKPT --out DIR

``hf-to-mcore`` writes a weights-only checkpoint (iteration 0, one file per TP x PP rank, each made from
that rank's slices of the safetensors only) that ``pretrain_vlm --load CKPT`` starts from at the same TP and
PP. ``mcore-to-hf`` reads the latest iteration of any checkpoint of the trainer (converted or trained; any
TP/PP, DP rank 0) and writes ``config.json`` + ``model.safetensors`` that transformers loads. The round trip
is bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

HF_CONFIG_NAME = "hf_config.json"
TRACKER = "latest_checkpointed_iteration.txt"


def _rank_file(root: str | Path, iteration: int, tp: int, pp: int) -> Path:
    """A weights-only rank file: ``<root>/iter_<iteration>/tp<tp>_pp<pp>_dp00.pt``."""
    return Path(root) / f"iter_{iteration:07d}" / f"tp{tp:02d}_pp{pp:02d}_dp00.pt"


def _latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER
    return int(tracker.read_text().strip()) if tracker.is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    p = sub.add_parser("hf-to-mcore", help="HF folder -> megatron-core checkpoint at a TP x PP layout")
    p.add_argument(
        "--hf", required=True, help="folder written by save_pretrained (config.json + safetensors)"
    )
    p.add_argument("--out", required=True, help="checkpoint folder to write (used with --load)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the checkpoint")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the checkpoint")
    p = sub.add_parser(
        "mcore-to-hf", help="megatron-core checkpoint -> HF folder (config.json + safetensors)"
    )
    p.add_argument("--ckpt", required=True, help="checkpoint folder (latest iteration is exported)")
    p.add_argument("--out", required=True, help="HF folder to write")
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", help="show tracebacks")


def hf_to_mcore(hf_dir: str, out: str, tp: int, pp: int) -> list[Path]:
    """Writes the weights-only checkpoint; returns the rank files written."""
    import torch

    from trainer.models import family_of
    from trainer.models.qwen2_5_vl.config import read_hf_config

    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    hf_config = read_hf_config(hf_dir)
    fam = family_of(hf_config)
    arch = fam.arch_from_hf_config(hf_config)
    written = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            state = fam.stage_state_dict(
                hf_dir, arch, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp
            )
            path = _rank_file(out, 0, tp_rank, pp_rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            payload = {"iteration": 0, "model": state, "layout": {"tp": tp, "pp": pp, "dp": 1}}
            torch.save(payload, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            written.append(path)
    (Path(out) / HF_CONFIG_NAME).write_text(json.dumps(hf_config, indent=2))
    (Path(out) / TRACKER).write_text("0")
    return written


def _checkpoint_shards(ckpt: str) -> tuple[dict[tuple[int, int], dict[str, Any]], int, int]:
    """The model state dicts of DP rank 0 at the latest iteration, by (tp, pp); and the TP, PP sizes."""
    import torch

    iteration = _latest_iteration(ckpt)
    if iteration is None:
        raise ValueError(f"{ckpt} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    folder = Path(ckpt) / f"iter_{iteration:07d}"
    coords = []
    for f in folder.glob("tp*_pp*_dp00.pt"):
        m = re.fullmatch(r"tp(\d+)_pp(\d+)_dp00\.pt", f.name)
        if m:
            coords.append((int(m.group(1)), int(m.group(2))))
    if not coords:
        raise ValueError(f"{folder} has no tpXX_ppYY_dp00.pt files")
    tp, pp = max(c[0] for c in coords) + 1, max(c[1] for c in coords) + 1
    if len(coords) != tp * pp:
        raise ValueError(f"{folder} misses rank files: found {sorted(coords)} of TP {tp} x PP {pp}")
    shards = {}
    for t, p in coords:
        payload = torch.load(folder / f"tp{t:02d}_pp{p:02d}_dp00.pt", map_location="cpu", weights_only=False)
        shards[(t, p)] = payload["model"]
    return shards, tp, pp


def mcore_to_hf(ckpt: str, out: str) -> Path:
    """Writes ``out/config.json`` and ``out/model.safetensors``; returns the weights file."""
    from safetensors.torch import save_file

    from trainer.models import family_of

    config_path = Path(ckpt) / HF_CONFIG_NAME
    if not config_path.is_file():
        raise ValueError(
            f"{ckpt} has no {HF_CONFIG_NAME} (the model config the trainer writes beside checkpoints)"
        )
    hf_config = json.loads(config_path.read_text())
    fam = family_of(hf_config)
    arch = fam.arch_from_hf_config(hf_config)
    shards, tp, pp = _checkpoint_shards(ckpt)
    tensors = fam.hf_state_dict(arch, shards, tp, pp)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    weights = root / "model.safetensors"
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())}, str(weights), metadata={"format": "pt"}
    )
    (root / "config.json").write_text(json.dumps(hf_config, indent=2))
    return weights


def run(args: argparse.Namespace) -> int:
    try:
        if args.direction == "hf-to-mcore":
            files = hf_to_mcore(args.hf, args.out, args.tp, args.pp)
            print(f"wrote {len(files)} rank files (TP {args.tp} x PP {args.pp}) to {args.out}")
        else:
            weights = mcore_to_hf(args.ckpt, args.out)
            print(f"wrote {weights} and config.json")
    except (ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"mmpack convert: error: {e}", file=sys.stderr)
        return 2
    return 0
