"""Training throughput with packing vs padding: real (non-pad) tokens/s, same model, same samples, one run.

    python benchmarks/bench_train.py                  # ~2-3 min on 2 CPU cores
    python benchmarks/bench_train.py --iters 10 --samples 300 --nproc 1   # quick look

One raw dataset (synthetic LLaVA/ShareGPT/caption records with real JPEG/PNG images, tiny BPE) is packed
twice by the offline job at the same --seq-len: (a) bin-packed, (b) one sample per sequence (``-M 1``), i.e.
the padded baseline. The same trainer (``torchrun -m mmpack.trainer.pretrain_vlm``, same model and flags: a random
Qwen2.5-VL of --layers x --hidden with a 1-layer vision tower, MRoPE, window attention) runs on each; reported per run: real tokens/s, all tokens/s, real-token fraction, step time, the fraction of the step
spent waiting for data, and the loss. The first --warmup iterations are excluded from the averages.
CPU processes with gloo when there is no GPU. Results: benchmarks/results/bench_train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe  # noqa: E402


def _pack(raw, tokenizer: Path, out: Path, seq_len: int, max_per_bin: int | None) -> dict:
    pack_synthetic(raw, tokenizer, out, seq_len=seq_len, max_samples_per_bin=max_per_bin)
    return json.loads((out / "manifest.json").read_text())["counts"]


def _train(args: argparse.Namespace, data: Path, work: Path) -> list[dict]:
    metrics = work / f"{data.parent.name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_port",
        str(args.port),
        "-m",
        "mmpack.trainer.pretrain_vlm",
        "--data-path",
        str(data),
        "--num-layers",
        str(args.layers),
        "--hidden-size",
        str(args.hidden),
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--vision-num-layers",
        "1",
        "--vision-hidden-size",
        "64",
        "--vision-num-attention-heads",
        "2",
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.global_batch),
        "--train-iters",
        str(args.iters),
        "--lr",
        "1e-3",
        "--num-workers",
        str(args.loader_workers),
        "--metrics-file",
        str(metrics),
        *(["--bf16"] if args.bf16 else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"training failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if "loss" in line]


def _summary(name: str, steps: list[dict], warmup: int, counts: dict) -> dict:
    timed = steps[warmup:]
    step_s = sum(m["step_ms"] for m in timed) / 1e3
    real = sum(m["tokens_per_s"] * m["step_ms"] / 1e3 for m in timed)
    frac = sum(m["real_token_fraction"] for m in timed) / len(timed)
    return {
        "layout": name,
        "bins": counts["bins"],
        "samples_packed": counts["samples_packed"],
        "real_tokens_per_s": real / step_s,
        "all_tokens_per_s": real / step_s / frac,
        "real_token_fraction": frac,
        "step_ms": step_s * 1e3 / len(timed),
        "data_wait_fraction": sum(m["data_wait_ms"] for m in timed) / 1e3 / step_s,
        "final_loss": steps[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1, help="training processes (DP)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--loader-workers", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_train.json")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        raw = make_synthetic_dataset(
            work / "raw", n_samples=args.samples, seed=0, size_range=(28, 168), max_words=60
        )
        tokenizer = train_tiny_bpe(work / "tokenizer")
        rows = []
        for name, max_per_bin in (("packed", None), ("padded (1 sample/seq)", 1)):
            data = work / name.split()[0] / "packed"
            counts = _pack(raw, tokenizer, data, args.seq_len, max_per_bin)
            steps = _train(args, data, work)
            rows.append(_summary(name, steps, args.warmup, counts))

    speedup = rows[0]["real_tokens_per_s"] / rows[1]["real_tokens_per_s"]
    header = f"{'layout':<24}{'bins':>6}{'real tok/s':>12}{'all tok/s':>11}{'real frac':>10}{'step ms':>9}{'data wait':>10}"
    print(header)
    for r in rows:
        print(
            f"{r['layout']:<24}{r['bins']:>6}{r['real_tokens_per_s']:>12.0f}{r['all_tokens_per_s']:>11.0f}"
            f"{r['real_token_fraction']:>10.3f}{r['step_ms']:>9.1f}{100 * r['data_wait_fraction']:>9.2f}%"
        )
    print(f"packing / padding real tokens/s: {speedup:.2f}x")
    result = {
        "benchmark": "bench_train",
        "command": "python benchmarks/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
        "packed_over_padded_real_tokens_per_s": speedup,
        "note": "CPU gloo processes on a shared machine: absolute numbers are noisy; the ratio is the point.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
