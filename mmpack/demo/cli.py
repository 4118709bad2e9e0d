"""`mmpack demo`: the whole path on an embedded default, on CPU.

1. build a small multimodal dataset (synthetic JPEG/PNG images and a few tiny PyAV-encoded videos, LLaVA /
   ShareGPT / caption / text-only / video records) and a small BPE tokenizer trained on the spot (no model hub
   needed);
2. pack it (`mmpack pack`), Arrow and WebDataset shards with a manifest;
3. print its packing statistics (`mmpack stats`);
4. stream it into a few training steps of a tiny vision-language model with TP x PP x DP on CPU processes
   (`torchrun -m mmpack.trainer.pretrain_vlm`, gloo), printing the trainer's log lines, and save a checkpoint;
5. export it with `mmpack convert mcore-to-hf`, load the export in transformers and print how far its logits on
   one packed sample are from the checkpoint's own (loaded at TP1 in megatron-core).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mmpack.cli import main as mmpack_main

if TYPE_CHECKING:
    from mmpack.demo.synthetic import SyntheticData


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `mmpack demo`."""
    parser.add_argument("--out", default="demo_out", help="working folder (default: ./demo_out)")
    parser.add_argument("--samples", type=int, default=400, help="raw samples to generate (default: 400)")
    parser.add_argument("--videos", type=int, default=4, help="tiny generated videos (default: 4)")
    parser.add_argument("--seq-len", type=int, default=1024, help="packed sequence length (default: 1024)")
    parser.add_argument("--workers", type=int, default=2, help="packer worker processes (default: 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: 2)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default: 2)")
    parser.add_argument("--train-iters", type=int, default=8, help="training iterations (default: 8)")
    parser.add_argument(
        "--global-batch-size", type=int, default=4, help="bins per optimizer step (default: 4)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for data, packing and training (default: 0)"
    )
    parser.add_argument("--no-train", action="store_true", help="stop after packing and stats")
    parser.add_argument(
        "--no-export", action="store_true", help="skip the HF export and logits comparison after training"
    )
    parser.add_argument(
        "--keep", action="store_true", help="reuse an existing --out folder instead of wiping it"
    )


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _make_raw_data(out: Path, samples: int, seed: int, videos: int = 0) -> tuple[SyntheticData, Path]:
    from mmpack.demo.synthetic import make_synthetic_dataset, train_tiny_bpe
    from mmpack.demo.videos import add_synthetic_videos

    raw = make_synthetic_dataset(out / "raw", n_samples=samples, seed=seed, size_range=(56, 448))
    raw = add_synthetic_videos(raw, videos, seed=seed)
    tokenizer = train_tiny_bpe(out / "tokenizer", vocab_size=2000, seed=seed, video_pad=True)
    print(
        f"{raw.n_samples} records ({raw.counts_by_format}), {raw.n_images} images "
        f"({raw.image_bytes / 2**20:.1f} MiB), {len(raw.video_paths)} videos in {raw.image_root}; "
        f"tokenizer {tokenizer}"
    )
    return raw, tokenizer


def _pack(args: argparse.Namespace, raw: SyntheticData, tokenizer: Path, packed: Path) -> None:
    from mmpack.demo.synthetic import pack_synthetic

    summary = pack_synthetic(
        raw,
        tokenizer,
        packed,
        seq_len=args.seq_len,
        max_bins_per_shard=16,
        format="both",
        workers=args.workers,
        seed=args.seed,
        progress=True,
    )
    print(summary.format_table())


def _train_command(args: argparse.Namespace, packed: Path, ckpt: Path) -> list[str]:
    nproc = args.tp * args.pp * args.dp
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "mmpack.trainer.pretrain_vlm",
        "--model-size", "tiny",
        "--data-path", str(packed),
        "--tensor-model-parallel-size", str(args.tp),
        "--pipeline-model-parallel-size", str(args.pp),
        "--micro-batch-size", "1",
        "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.train_iters),
        "--lr", "2e-3", "--lr-warmup-iters", "2",
        "--log-interval", "1",
        "--num-workers", "1",
        "--seed", str(args.seed),
        "--save", str(ckpt),
    ]  # fmt: skip


def _export_and_compare(ckpt: Path, packed: Path, hf_out: Path) -> int:
    """`mmpack convert mcore-to-hf`, then the export's logits in transformers vs the checkpoint's at TP1."""
    import warnings

    os.environ["PYTHONWARNINGS"] = "ignore"  # megatron-core's CPU notices in the converter's process
    warnings.simplefilter("ignore")
    print(f"$ mmpack convert mcore-to-hf --ckpt {ckpt} --out {hf_out}", flush=True)
    rc = mmpack_main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(hf_out)])
    if rc != 0:
        return rc
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "transformers is not installed: `pip install -e '.[test]'` to compare the export's logits; skipped"
        )
        return 0
    from transformers.utils import logging as hf_logging

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.export_check import first_image_sample, hf_logits, mcore_logits

    cpu_backend.activate()  # this command is the entry point of the megatron-core model it loads in-process
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    sample = first_image_sample(str(packed))
    ours = mcore_logits(str(ckpt), sample)
    theirs = hf_logits(str(hf_out), sample)
    diff = float((ours - theirs).abs().max())
    ok = ours.shape == theirs.shape and diff <= 1e-4
    n_images = 0 if sample.image_grid_thw is None else int(sample.image_grid_thw.shape[0])
    print(
        f"logits of one packed sample ({sample.tokens.numel()} tokens, {n_images} "
        f"image(s)): mmpack checkpoint at TP1 vs transformers on the export: max abs diff {diff:.3e} "
        f"(logits up to {float(ours.abs().max()):.3f}) -> {'agree' if ok else 'DISAGREE'}"
    )
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    if args.global_batch_size % args.dp:
        print(
            f"mmpack demo: --global-batch-size {args.global_batch_size} must be a multiple of --dp {args.dp}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out).resolve()
    if out.exists() and not args.keep:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    _banner("1/5 build a small multimodal dataset")
    raw, tokenizer = _make_raw_data(out, args.samples, args.seed, args.videos)
    packed = out / "packed"
    _banner(f"2/5 pack it (seq_len {args.seq_len})")
    _pack(args, raw, tokenizer, packed)
    _banner("3/5 packing statistics")
    rc = mmpack_main(["stats", str(packed)])
    if rc != 0:
        return rc
    if args.no_train:
        return 0
    nproc = args.tp * args.pp * args.dp
    _banner(f"4/5 train a tiny VLM: TP{args.tp} x PP{args.pp} x DP{args.dp} = {nproc} CPU processes (gloo)")
    ckpt = out / "checkpoint"
    cmd = _train_command(args, packed, ckpt)
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rc = subprocess.call(cmd, env=env)
    if rc == 0 and not args.no_export:
        _banner("5/5 export to HuggingFace and compare logits with transformers")
        rc = _export_and_compare(ckpt, packed, out / "hf_export")
    print(f"\nmmpack demo finished in {time.perf_counter() - start:.0f}s (exit code {rc}); outputs in {out}")
    return rc
