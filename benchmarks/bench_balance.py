"""Compute balancing benchmark: the slowest DP rank's cost per step, with and without `balance="compute"`.

    python benchmarks/bench_balance.py                  # simulated: mixtures x seq_len 8k/32k x DP 8/64
    python benchmarks/bench_balance.py --measure        # + measured per-rank compute on this CPU (DP 2)
    python benchmarks/bench_balance.py --trainer        # + a real TP1 x DP2 trainer run, with / without

Simulated: samples of several length mixtures are packed into bins of seq_len (`pack_lengths`, auto), the
bins are shuffled into a stream, and each global batch (DP x 4 micro-batches of 1 bin) is split over the
ranks as the loader does: in stream order (today) or by `mmpack.dataloader.balance.balanced_layout`. The step
time of a step is the largest per-rank sum of `mmpack.packing.cost.DEFAULT_COST_MODEL` (a Qwen2.5-VL-7B-shaped
dense transformer + ViT, in units of one text token's dense-layer work); the table gives mean over steps
of max/mean per rank, and the ratio of summed step times (the speedup balancing gives a synchronous step).

Measured (--measure): a small dense-attention transformer (causal attention within each sample, as with
cu_seqlens) runs forward + backward over every bin of a few global batches on this CPU, one bin at a time
(single process, so the two simulated DP ranks do not fight over the cores); a rank's compute time is the
sum over its bins, the step time the larger of the two ranks. Balancing uses the FLOP model of that small
model's shape (`CostModel.dense`); the model fitted to the measured bin times (`CostModel.fit`) is reported
beside it.

Trainer (--trainer): the real trainer (`torchrun -m mmpack.trainer.pretrain_vlm`, 2 ranks, TP1 x DP2, gloo, one
thread each) trains a random tiny Qwen2.5-VL on packed image-text bins twice, with `--balance none` and
`--balance compute` (its cost model: the trained model's FLOP counts, `mmpack.trainer.training.balance_cost_model`).
Each step logs the DP ranks' forward + backward time (slowest and mean); the step's compute time is the
slowest rank's. Both runs see the same global batches.
Results go to benchmarks/results/bench_balance.json; parts not run keep their last results there
(`--no-simulated --trainer` updates the trainer part only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from mmpack.dataloader.balance import balanced_layout
from mmpack.packing.binpack import pack_lengths
from mmpack.packing.cost import DEFAULT_COST_MODEL, CostModel, features_from_offsets

RESULTS = Path(__file__).resolve().parent / "results" / "bench_balance.json"
MICRO_BATCHES = 4


def mixture(name: str, n: int, seq_len: int, rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sample lengths (tokens, incl. image tokens) and per-sample image patch counts of one mixture."""
    no_images = [np.zeros(0)] * n
    if name == "lognormal":  # SFT-like chat: median ~700 tokens
        return np.clip(rng.lognormal(6.5, 0.9, n), 16, seq_len).astype(np.int64), no_images
    if name == "bimodal":  # mostly short, 10% long documents of 1/4..1 seq_len
        long = rng.random(n) < 0.1
        lengths = np.where(long, rng.uniform(0.25, 1.0, n) * seq_len, rng.lognormal(5.5, 0.7, n))
        return np.clip(lengths, 16, seq_len).astype(np.int64), no_images
    if name == "long-tail":  # heavy tail up to the full length, 1% exactly seq_len
        lengths = np.minimum(rng.pareto(1.2, n) * 300 + 50, seq_len)
        lengths[rng.random(n) < 0.01] = seq_len
        return lengths.astype(np.int64), no_images
    if name == "image-text":  # Poisson(1) images of 4^2..48^2 patches (merge 2: patches/4 tokens each)
        counts = rng.poisson(1.0, n)
        patches = [4 * rng.integers(1, 13, c) ** 2 for c in counts]  # (2k)^2 patches, k in 1..12
        text = rng.lognormal(5.5, 0.8, n)
        lengths = text + np.array([p.sum() / 4 for p in patches])
        keep = lengths <= seq_len
        return np.maximum(lengths[keep], 16).astype(np.int64), [p for p, k in zip(patches, keep) if k]
    raise ValueError(f"unknown mixture {name!r}")


def pack_bins(lengths: np.ndarray, patches: list[np.ndarray], seq_len: int) -> np.ndarray:
    """Cost features [bins, 4] of the packed bins."""
    result = pack_lengths(lengths, seq_len)
    order = np.argsort(result.bin_ids, kind="stable")
    order = order[result.bin_ids[order] >= 0]
    sizes = np.bincount(result.bin_ids[order], minlength=result.num_bins)
    seq_offsets = np.concatenate(([0], np.cumsum(sizes)))
    per_image = [patches[i] for i in order]
    image_counts = np.array([len(p) for p in per_image])
    grid = np.zeros((int(image_counts.sum()), 3))
    grid[:, 0] = 1
    grid[:, 1] = np.concatenate(per_image) if len(grid) else grid[:, 1]
    grid[:, 2] = 1  # (1, patches, 1): only the patch count matters to the cost
    image_offsets = np.concatenate(([0], np.cumsum(image_counts)))[seq_offsets]
    return features_from_offsets(lengths[order], seq_offsets, grid, image_offsets)


def step_times(
    costs: np.ndarray, dp: int, steps: int, rng: np.random.Generator, order: np.ndarray | None = None
) -> dict[str, float]:
    """Per-step max and mean rank cost over a shuffled stream (``order``: the stream's bins, else a permutation of
    all of them), plain split vs balanced."""
    g = dp * MICRO_BATCHES
    if order is None:
        order = rng.permutation(len(costs))
    stream = order[: steps * g].reshape(steps, g)
    plain, balanced, mean = [], [], []
    balance_s = 0.0
    for batch in stream:
        c = costs[batch]
        plain.append(c.reshape(dp, -1).sum(axis=1).max())
        start = time.perf_counter()
        layout = balanced_layout(c, dp, 1)
        balance_s += time.perf_counter() - start
        balanced.append(c[layout].sum(axis=(1, 2)).max())
        mean.append(c.sum() / dp)
    plain_a, balanced_a, mean_a = np.array(plain), np.array(balanced), np.array(mean)
    return {
        "plain_max_over_mean": float((plain_a / mean_a).mean()),
        "balanced_max_over_mean": float((balanced_a / mean_a).mean()),
        "speedup": float(plain_a.sum() / balanced_a.sum()),
        "balance_ms_per_step": 1000 * balance_s / steps,
    }


# Cost models compared: the default (7B-shaped LM) and a 1.5B-shaped LM with the same ViT, where attention
# is a larger share of the work (b = 1 / (12 h) grows as the hidden size shrinks).
COST_MODELS = {
    "7B": DEFAULT_COST_MODEL,
    "1.5B": CostModel.dense(hidden_size=1536, num_layers=28, vision_hidden_size=1280, vision_layers=32),
}


def packed_features(name: str, seq_len: int, need_bins: int) -> np.ndarray:
    """Features of at least `need_bins` bins of mixture `name` (more samples drawn until there are)."""
    n = need_bins * 4
    while True:
        lengths, patches = mixture(name, n, seq_len, np.random.default_rng(0))
        features = pack_bins(lengths, patches, seq_len)
        if len(features) >= need_bins:
            return features
        n = int(n * 1.5 * need_bins / max(len(features), 1)) + 64


def buffered_features(name: str, seq_len: int, need_bins: int, buffers: int) -> list[np.ndarray]:
    """Online packing's bins: the samples of mixture `name` packed in `buffers` consecutive buffers, each alone
    (features per buffer), at least `need_bins` bins in all."""
    n = need_bins * 4
    while True:
        lengths, patches = mixture(name, n, seq_len, np.random.default_rng(0))
        chunks = np.array_split(np.arange(len(lengths)), buffers)
        per = [pack_bins(lengths[c], [patches[i] for i in c], seq_len) for c in chunks]
        total = sum(len(f) for f in per)
        if total >= need_bins:
            return per
        n = int(n * 1.5 * need_bins / max(total, 1)) + 64


def buffered_order(sizes: list[int], rng: np.random.Generator) -> np.ndarray:
    """The online stream's bins: buffers in a shuffled order, each buffer's bins shuffled, one after the other."""
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    return np.concatenate([offsets[b] + rng.permutation(sizes[b]) for b in rng.permutation(len(sizes))])


def run_online(args: argparse.Namespace, rows: list[dict]) -> None:
    """As :func:`run_simulated`, the bins packed in `--online-buffers` buffers and streamed buffer by buffer."""
    for seq_len in args.seq_lens:
        for name in args.mixtures:
            need = args.steps * max(args.dps) * MICRO_BATCHES
            per = buffered_features(name, seq_len, need, args.online_buffers)
            features = np.concatenate(per)
            for model_name, model in COST_MODELS.items():
                costs = model.cost(features)
                for dp in args.dps:
                    rng = np.random.default_rng(1)
                    order = buffered_order([len(f) for f in per], rng)
                    row = {
                        "packing": f"online, {args.online_buffers} buffers",
                        "mixture": name,
                        "seq_len": seq_len,
                    }
                    row |= {"model": model_name, "dp": dp, "bins": len(costs)}
                    row |= step_times(costs, dp, args.steps, rng, order)
                    rows.append(row)
                    print(
                        f"{name:<12} {seq_len:>7} {model_name:>5} {dp:>4} {row['plain_max_over_mean']:>10.3f} "
                        f"{row['balanced_max_over_mean']:>10.3f} {row['speedup']:>8.3f}x "
                        f"{row['balance_ms_per_step']:>8.2f}  (online)",
                        flush=True,
                    )


def run_simulated(args: argparse.Namespace, rows: list[dict]) -> None:
    for seq_len in args.seq_lens:
        for name in args.mixtures:
            features = packed_features(name, seq_len, args.steps * max(args.dps) * MICRO_BATCHES)
            for model_name, model in COST_MODELS.items():
                costs = model.cost(features)
                for dp in args.dps:
                    row = {
                        "mixture": name,
                        "seq_len": seq_len,
                        "model": model_name,
                        "dp": dp,
                        "bins": len(costs),
                    }
                    row |= step_times(costs, dp, args.steps, np.random.default_rng(1))
                    rows.append(row)
                    print(
                        f"{name:<12} {seq_len:>7} {model_name:>5} {dp:>4} {row['plain_max_over_mean']:>10.3f} "
                        f"{row['balanced_max_over_mean']:>10.3f} {row['speedup']:>8.3f}x "
                        f"{row['balance_ms_per_step']:>8.2f}",
                        flush=True,
                    )


def run_measured(args: argparse.Namespace) -> dict:
    """Real forward + backward times of every bin on this CPU; step time = slower of two DP ranks."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    seq_len, hidden, layers, heads = args.measure_seq_len, 256, 2, 4
    model = torch.nn.ModuleList(
        torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        for _ in range(layers)
    )
    mask_cache: dict[int, torch.Tensor] = {}

    def run_bin(lens: np.ndarray) -> float:
        x = torch.randn(1, int(lens.sum()), hidden)
        start = time.perf_counter()
        out = []
        for piece in torch.split(x, lens.tolist(), dim=1):  # attention within each sample only (cu_seqlens)
            n = piece.shape[1]
            if n not in mask_cache:
                mask_cache[n] = torch.nn.Transformer.generate_square_subsequent_mask(n)
            h = piece
            for layer in model:
                h = layer(h, src_mask=mask_cache[n], is_causal=True)
            out.append(h)
        torch.cat(out, dim=1).square().mean().backward()
        return time.perf_counter() - start

    rng = np.random.default_rng(0)
    lengths, _ = mixture("long-tail", 20_000, seq_len, rng)
    result = pack_lengths(lengths, seq_len)
    bins = [lengths[b] for b in result.bins()]
    dp, steps = 2, args.measure_steps
    g = dp * MICRO_BATCHES
    chosen = rng.permutation(len(bins))[: steps * g]
    run_bin(bins[chosen[0]])  # warm-up
    times = np.array([run_bin(bins[i]) for i in chosen])
    features = np.array(
        [[b.sum(), (b.astype(np.float64) ** 2).sum(), 0, 0] for b in (bins[i] for i in chosen)]
    )
    flops = CostModel.dense(hidden_size=hidden, num_layers=layers)  # balancing uses this, not the fit
    fitted = CostModel.fit(features, times)
    plain, balanced, mean = [], [], []
    for s in range(steps):
        t = times[s * g : (s + 1) * g]
        plain.append(t.reshape(dp, -1).sum(axis=1).max())
        layout = balanced_layout(flops.cost(features[s * g : (s + 1) * g]), dp, 1)
        balanced.append(t[layout].sum(axis=(1, 2)).max())
        mean.append(t.sum() / dp)
    report = {
        "seq_len": seq_len,
        "model": f"{layers} x TransformerEncoderLayer(hidden {hidden}, {heads} heads), fp32, 1 thread",
        "dp": dp,
        "steps": steps,
        "flop_model_b_over_a": float(flops.sum_sq_seq_len / flops.tokens),
        "fitted_model": {k: float(v) for k, v in zip(("a", "b", "c", "d"), fitted.coefficients)},
        "fitted_b_over_a": float(fitted.sum_sq_seq_len / fitted.tokens) if fitted.tokens else None,
        "plain_step_s": float(np.sum(plain)),
        "balanced_step_s": float(np.sum(balanced)),
        "ideal_step_s": float(np.sum(mean)),
        "speedup": float(np.sum(plain) / np.sum(balanced)),
    }
    print(
        f"measured (long-tail, seq_len {seq_len}, DP {dp}, {steps} steps): plain {report['plain_step_s']:.2f}s, "
        f"balanced {report['balanced_step_s']:.2f}s, ideal {report['ideal_step_s']:.2f}s, "
        f"speedup {report['speedup']:.3f}x; b/a FLOP model {report['flop_model_b_over_a']:.3g}, "
        f"fitted {report['fitted_b_over_a']}",
        flush=True,
    )
    return report


def run_trainer(args: argparse.Namespace) -> dict:
    """A real TP1 x DP2 training run, with and without `--balance compute`: each rank's forward + backward
    time per step as the trainer logs it (`compute_ms_max` / `compute_ms_mean` over the DP group)."""
    import subprocess
    import tempfile

    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe

    repo = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        work = Path(tmp)
        # image-text samples with 0-2 images of 28..448 px: a bin's vision work varies far more than its tokens
        raw = make_synthetic_dataset(
            work / "raw", n_samples=args.trainer_samples, seed=0, size_range=(28, 448), max_words=80
        )
        tokenizer = train_tiny_bpe(work / "tokenizer")
        data = work / "packed"
        pack_synthetic(raw, tokenizer, data, seq_len=args.trainer_seq_len)
        # rounds in ABBA order, so a drift of this machine's speed weighs on both alike
        order = [
            ("none", "compute") if r % 2 == 0 else ("compute", "none") for r in range(args.trainer_rounds)
        ]
        for r, balance in ((r, b) for r, pair in enumerate(order) for b in pair):
            metrics = work / f"{balance}-{r}.jsonl"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(args.trainer_port), "-m", "mmpack.trainer.pretrain_vlm",
                "--data-path", str(data), "--num-layers", "2", "--hidden-size", "128",
                "--num-attention-heads", "4", "--num-query-groups", "2", "--vision-num-layers", "2",
                "--vision-hidden-size", "128", "--vision-num-attention-heads", "4",
                "--micro-batch-size", "1", "--global-batch-size", str(2 * MICRO_BATCHES),
                "--train-iters", str(args.trainer_steps + args.trainer_warmup), "--lr", "1e-4",
                "--num-workers", "0", "--balance", balance, "--metrics-file", str(metrics),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"training with --balance {balance} failed:\n{proc.stderr[-4000:]}")
            lines = [json.loads(line) for line in metrics.read_text().splitlines()]
            steps = [m for m in lines if "compute_ms_max" in m][args.trainer_warmup :]
            if balance in runs and [m["data_digest"] for m in steps] != [
                m["data_digest"] for m in runs[balance][-len(steps) :]
            ]:
                raise RuntimeError("two rounds trained on different global batches")
            runs.setdefault(balance, []).extend(steps)
    plain, balanced = runs["none"], runs["compute"]
    if [m["data_digest"] for m in plain] != [m["data_digest"] for m in balanced]:
        raise RuntimeError("the two runs trained on different global batches: their times do not compare")
    summed = {
        name: {
            "step_compute_s": sum(m["compute_ms_max"] for m in steps) / 1e3,
            "mean_rank_compute_s": sum(m["compute_ms_mean"] for m in steps) / 1e3,
            "mean_max_over_mean": float(np.mean([m["dp_imbalance"] for m in steps])),
            "step_s": sum(m["step_ms"] for m in steps) / 1e3,
        }
        for name, steps in (("plain", plain), ("balanced", balanced))
    }
    report = {
        "what": "torchrun -m mmpack.trainer.pretrain_vlm, TP1 x DP2 on CPU (gloo, 1 thread per rank), random tiny "
        "Qwen2.5-VL (2 x 128 language layers, dense block mask; 2 x 128 vision layers), seq_len "
        f"{args.trainer_seq_len}, {MICRO_BATCHES} micro-batches of 1 bin per rank and step, "
        f"{args.trainer_steps} steps after {args.trainer_warmup} warm-up, {args.trainer_rounds} runs of each in "
        "ABBA order",
        "samples": args.trainer_samples,
        **summed,
        "speedup_step_compute": summed["plain"]["step_compute_s"] / summed["balanced"]["step_compute_s"],
        "speedup_step": summed["plain"]["step_s"] / summed["balanced"]["step_s"],
        # the slowest rank over the mean rank, summed over steps, per run; their ratio is the gain at equal
        # machine speed (a drift of the machine's speed between the runs moves both ranks alike)
        "speedup_at_equal_rank_speed": (
            summed["plain"]["step_compute_s"] / summed["plain"]["mean_rank_compute_s"]
        )
        / (summed["balanced"]["step_compute_s"] / summed["balanced"]["mean_rank_compute_s"]),
        "rounds": args.trainer_rounds,
    }
    p, b = summed["plain"], summed["balanced"]
    print(
        f"trainer (TP1 x DP2, {args.trainer_rounds} x {args.trainer_steps} steps): slowest rank's compute {p['step_compute_s']:.2f}s "
        f"plain vs {b['step_compute_s']:.2f}s balanced ({report['speedup_step_compute']:.3f}x; mean rank "
        f"{p['mean_rank_compute_s']:.2f}s / {b['mean_rank_compute_s']:.2f}s); max/mean per step "
        f"{p['mean_max_over_mean']:.3f} vs {b['mean_max_over_mean']:.3f}; at equal rank speed "
        f"{report['speedup_at_equal_rank_speed']:.3f}x; whole steps {report['speedup_step']:.3f}x",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dps", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--mixtures", nargs="+", default=["lognormal", "bimodal", "long-tail", "image-text"])
    parser.add_argument("--steps", type=int, default=200, help="simulated global batches per case")
    parser.add_argument(
        "--measure", action="store_true", help="also measure real per-bin compute on this CPU"
    )
    parser.add_argument("--measure-seq-len", type=int, default=2048)
    parser.add_argument("--measure-steps", type=int, default=12)
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="also time a real TP1 x DP2 trainer run with and without balancing (a few minutes)",
    )
    parser.add_argument("--trainer-samples", type=int, default=600)
    parser.add_argument("--trainer-seq-len", type=int, default=1024)
    parser.add_argument("--trainer-steps", type=int, default=20)
    parser.add_argument("--trainer-warmup", type=int, default=2)
    parser.add_argument("--trainer-rounds", type=int, default=2, help="runs of each, in ABBA order")
    parser.add_argument("--trainer-port", type=int, default=29741)
    parser.add_argument("--simulated", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--online-buffers", type=int, default=0,
        help="also simulate online packing: the samples packed in this many buffers, streamed buffer by buffer",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(
        f"{'mixture':<12} {'seq_len':>7} {'model':>5} {'dp':>4} {'plain':>10} {'balanced':>10} {'speedup':>9} "
        f"{'ms/step':>8}"
    )
    print(f"{'':<12} {'':>7} {'':>5} {'':>4} {'max/mean':>10} {'max/mean':>10}")
    rows: list[dict] = []
    if args.simulated:
        run_simulated(args, rows)
    if args.online_buffers:
        run_online(args, rows)
    measured = run_measured(args) if args.measure else None
    trainer = run_trainer(args) if args.trainer else None
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "cost_models": {
            name: dict(zip(("a", "b", "c", "d"), model.coefficients.tolist()))
            for name, model in COST_MODELS.items()
        },
        "micro_batches_per_rank": MICRO_BATCHES,
        "rows": rows,
        "measured": measured,
        "trainer": trainer,
    }
    if args.out.exists():  # parts not run this time keep their last results
        previous = json.loads(args.out.read_text())
        for key, ran in (("rows", args.simulated), ("measured", args.measure), ("trainer", args.trainer)):
            if not ran and previous.get(key):
                report[key] = previous[key]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
