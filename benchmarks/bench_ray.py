"""The offline job on a local 2-node Ray cluster vs the local engine, and a model of the job at 100M samples.

    python benchmarks/bench_ray.py                                   # 10,000 samples, binpack at 10M and 30M
    python benchmarks/bench_ray.py --samples 1000 --binpack-sizes 1M  # quick look
    python benchmarks/bench_ray.py --binpack-sizes 10M,30M,100M       # measure the binpack step at 100M too

Part 1 runs the same job (image-text records, one image each; JPEG/PNG files on local disk) three ways:
`--engine local -w 1`, `--engine local -w 2` and `--engine ray` on `ray.cluster_utils.Cluster` with two nodes
of one CPU each on this machine; it reports samples/s per stage and checks that the three outputs are
byte-identical. Each is run `--repeats` times and the best time per stage counts. Part 2 measures the binpack step (`mmpack.offline_packing.binpack.pack_bins`: `pack_lengths` plus the
bin lists and their shuffle) on synthetic lengths (one image per sample, seq_len 8192), each size in a fresh
process: wall time and peak RSS (ru_maxrss). Part 3 is the model: time per stage for 100M samples x 1 image on
N nodes of C cores, from the measured single-worker cost per sample, the measured 2-node efficiency of the Ray
engine, and the binpack step measured (or extrapolated linearly from the largest measured size, and said so).
Results: benchmarks/results/bench_ray.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmpack.offline_packing.config import PackJobConfig  # noqa: E402
from mmpack.offline_packing.options import job_config  # noqa: E402
from mmpack.offline_packing.pipeline import run_pack  # noqa: E402
from tests.support.fixtures_data import dataset_files, make_synthetic_dataset, train_tiny_bpe  # noqa: E402

QWEN3 = REPO.parent / "shared" / "data" / "tokenizer_qwen3" / "tokenizer.json"
STAGES = ("scan", "lengths", "binpack", "write")
SEQ_LEN = 8192


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _dataset(data_dir: Path, samples: int) -> Path:
    raw = data_dir / f"raw-{samples}"
    if not (raw / "data.jsonl").is_file():
        make_synthetic_dataset(
            raw, samples, seed=0, formats=("caption", "llava"), max_images_per_sample=1, size_range=(64, 768)
        )
    return raw / "data.jsonl"


def _job(src: Path, tok: Path, out: Path, **kw: Any) -> PackJobConfig:
    return job_config(
        inputs=(str(src),),
        output=str(out),
        seq_len=SEQ_LEN,
        tokenizer=str(tok),
        chunk_size=256,
        progress=False,
        **kw,
    )


def _timed_run(cfg: PackJobConfig, samples: int, repeats: int) -> dict[str, float]:
    """Samples/s per stage, the best of `repeats` runs from scratch (the machine may be shared)."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        subprocess.run(["rm", "-rf", cfg.output], check=True)
        seconds = run_pack(cfg).stage_seconds
        seconds["end_to_end"] = sum(seconds.values())
        best = {s: min(seconds[s], best.get(s, float("inf"))) for s in seconds}
    return {s: samples / t for s, t in best.items()}


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: samples/s per stage for local -w 1, local -w 2 and ray on a 2-node cluster."""
    import ray
    from ray.cluster_utils import Cluster

    src = _dataset(args.data_dir, args.samples)
    tok = QWEN3 if QWEN3.is_file() else train_tiny_bpe(args.data_dir / "tok")
    outs = {name: args.data_dir / f"out-{name}" for name in ("local_w1", "local_w2", "ray_2_nodes")}
    warm = _dataset(args.data_dir, 64)  # numba kernels compiled, tokenizer read, before anything is timed
    run_pack(_job(warm, tok, args.data_dir / "out-warm", workers=2, clean_work=True))
    rates = {
        "local_w1": _timed_run(_job(src, tok, outs["local_w1"], workers=1), args.samples, args.repeats),
        "local_w2": _timed_run(_job(src, tok, outs["local_w2"], workers=2), args.samples, args.repeats),
    }
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    try:
        # a first tiny job starts the workers (and imports) on both nodes, as a long job amortises them
        run_pack(_job(warm, tok, args.data_dir / "out-warm", engine="ray", clean_work=True))
        ray_job = _job(src, tok, outs["ray_2_nodes"], engine="ray")
        rates["ray_2_nodes"] = _timed_run(ray_job, args.samples, args.repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    reference = dataset_files(outs["local_w1"])
    identical = {name: dataset_files(out) == reference for name, out in outs.items()}
    return {
        "samples": args.samples,
        "tokenizer": str(tok),
        "samples_per_s": rates,
        "identical_output": identical,
    }


def _binpack_probe(n: int) -> dict[str, float]:
    """In a fresh process: time and peak RSS of the binpack step on n synthetic one-image samples."""
    code = f"""
import json, resource, time
import numpy as np
import mmpack.packing.binpack
from mmpack.offline_packing.binpack import pack_bins
from mmpack.offline_packing.config import BinpackConfig, BinpackStage
mmpack.packing.binpack.pack_lengths(np.array([3, 5, 2]), 8)  # numba kernels loaded (cached) before the baseline
imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rng = np.random.default_rng(0)
n = {n}
# one image per sample (64..1024 image tokens) plus 20..1500 text tokens
lengths = (rng.integers(64, 1025, n) + rng.integers(20, 1501, n)).astype(np.int64)
images = np.ones(n, dtype=np.int64)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = BinpackStage(binpack=BinpackConfig(), seq_len={SEQ_LEN}, max_images_per_bin=None)
t = time.perf_counter()
bins, algorithm = pack_bins(lengths, images, cfg)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"n": n, "seconds": seconds, "bins": len(bins), "algorithm": algorithm,
                  "peak_rss_gib": peak / 2**20, "imports_rss_gib": imports / 2**20,
                  "job_gib": (peak - imports) / 2**20, "inputs_gib": 2 * n * 8 / 2**30}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"binpack probe at n={n} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def model(
    engines: dict[str, Any], binpack: list[dict[str, float]], args: argparse.Namespace
) -> dict[str, Any]:
    """Part 3: hours per stage for `args.model_samples` samples on N nodes of `args.cores_per_node` cores."""
    rates = engines["samples_per_s"]
    cost = {s: 1.0 / rates["local_w1"][s] for s in ("scan", "lengths", "write")}  # CPU-seconds per sample
    # parallel efficiency of the Ray engine measured on 2 one-CPU nodes, per stage (capped at 1)
    eff = {s: min(1.0, rates["ray_2_nodes"][s] / (2 * rates["local_w1"][s])) for s in cost}
    largest = max(binpack, key=lambda r: r["n"])
    scale = args.model_samples / largest["n"]
    binpack_s = largest["seconds"] * scale
    binpack_gib = largest["peak_rss_gib"] * scale  # the whole process; linear scaling overstates it
    rows = []
    for nodes in args.model_nodes:
        cores = nodes * args.cores_per_node
        hours = {s: args.model_samples * cost[s] / (cores * eff[s]) / 3600 for s in cost}
        hours["binpack"] = binpack_s / 3600
        hours["total"] = sum(hours.values())
        rows.append({"nodes": nodes, "cores": cores, "hours": hours})
    return {
        "samples": args.model_samples,
        "cores_per_node": args.cores_per_node,
        "cpu_s_per_sample": cost,
        "ray_efficiency_2_nodes": eff,
        "binpack_from_n": largest["n"],
        "binpack_extrapolated": scale != 1,
        "binpack_seconds": binpack_s,
        "binpack_peak_rss_gib": binpack_gib,
        "rows": rows,
    }


def _print(result: dict[str, Any]) -> None:
    eng = result["engines"]
    print(f"\n{eng['samples']} samples x 1 image, seq_len {SEQ_LEN}; samples/s per stage (best of runs)")
    print(f"{'run':<14}" + "".join(f"{s:>12}" for s in (*STAGES, "end_to_end")) + "   identical")
    for name, rates in eng["samples_per_s"].items():
        cells = "".join(f"{rates[s]:>12.0f}" for s in (*STAGES, "end_to_end"))
        print(f"{name:<14}{cells}   {eng['identical_output'][name]}")
    print("\nbinpack step (pack_bins), fresh process per size")
    print(f"{'samples':>12}{'seconds':>10}{'bins':>12}{'peak RSS GiB':>14}{'inputs GiB':>12}  algorithm")
    for r in result["binpack"]:
        print(
            f"{r['n']:>12}{r['seconds']:>10.1f}{r['bins']:>12}{r['peak_rss_gib']:>14.2f}"
            f"{r['inputs_gib']:>12.2f}  {r['algorithm']}"
        )
    m = result["model"]
    note = f" (extrapolated linearly from {m['binpack_from_n']:,})" if m["binpack_extrapolated"] else ""
    print(
        f"\nmodel: {m['samples']:,} samples x 1 image, {m['cores_per_node']} cores per node; binpack "
        f"{m['binpack_seconds'] / 60:.1f} min, peak RSS {m['binpack_peak_rss_gib']:.1f} GiB on one node{note}"
    )
    print(f"{'nodes':>6}{'cores':>7}" + "".join(f"{s + ' h':>12}" for s in (*STAGES, "total")))
    for row in m["rows"]:
        h = row["hours"]
        print(f"{row['nodes']:>6}{row['cores']:>7}" + "".join(f"{h[s]:>12.2f}" for s in (*STAGES, "total")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10000, help="samples of the engine comparison")
    p.add_argument("--repeats", type=int, default=2, help="runs per engine; the best time per stage counts")
    p.add_argument("--binpack-sizes", default="10M,30M", help="synthetic sample counts for the binpack step")
    p.add_argument("--model-samples", type=_count, default=100_000_000)
    p.add_argument("--model-nodes", default="1,2,4,8,16,32")
    p.add_argument("--cores-per-node", type=int, default=32)
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/mmpack-bench-ray"))
    p.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "bench_ray.json")
    p.add_argument(
        "--model-only", action="store_true", help="recompute the model from the measurements in --json only"
    )
    args = p.parse_args()
    args.model_nodes = [int(x) for x in args.model_nodes.split(",")]
    args.data_dir.mkdir(parents=True, exist_ok=True)
    if args.model_only:
        result = json.loads(args.json.read_text())
    else:
        result = {
            "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
            "engines": run_engines(args),
            "binpack": [_binpack_probe(_count(n)) for n in args.binpack_sizes.split(",")],
        }
    result["model"] = model(result["engines"], result["binpack"], args)
    _print(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
