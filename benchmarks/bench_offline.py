"""Offline packer throughput: samples/s per stage and end to end, 1 vs N workers, write MB/s vs a plain copy.

    python benchmarks/bench_offline.py                      # 20k samples, workers 1 and 2
    python benchmarks/bench_offline.py --samples 2000 --workers 1   # quick look
    python benchmarks/bench_offline.py --video-only                 # the video scan section alone
    TOKENIZERS_PARALLELISM=false python benchmarks/bench_offline.py --lengths-only   # lengths vs encode_batch

The dataset (real JPEG/PNG files of varied sizes, LLaVA/ShareGPT/caption/text records) is generated once
under --data-dir and reused. The tokenizer is the shared Qwen3 one when present, else a tiny trained BPE.
Two copy baselines for the write stage, over the same bytes: (a) copying the written shard files,
(b) gathering the source image files in bin order into one file. Files are in the page cache in all cases
(the numbers are CPU-bound pipeline costs, not disk speed). Results: benchmarks/results/bench_offline.json.

Video scan section: per video, the scan's cost (container metadata + end check, no frame decoded: videos/s
and bytes read vs file size) and, for scale, the loader's decode of the planned frames next to a decode of
every frame. Videos: the shared mllm_video_demo ones when present, plus generated mp4/mkv/avi files
(cached under --data-dir/videos).

Lengths section: the lengths stage's tokenization (in memory) next to a bare `tokenizers` `encode_batch` over
the same rendered texts, interleaved; TOKENIZERS_PARALLELISM=false compares one core with one core, as in a
lengths worker process. Results: benchmarks/results/bench_offline_lengths.json with --lengths-only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmpack.offline_packing.config import PackJobConfig  # noqa: E402
from mmpack.offline_packing.options import job_config, with_options  # noqa: E402
from mmpack.offline_packing.pipeline import read_manifest, run_pack  # noqa: E402
from tests.support.fixtures_data import make_synthetic_dataset, train_tiny_bpe  # noqa: E402

SHARED = Path(os.environ.get("MMPACK_SHARED_DIR", REPO.parent / "shared"))
QWEN3 = SHARED / "data" / "tokenizer_qwen3" / "tokenizer.json"
DEMO_VIDEOS = SHARED / "data" / "mllm_video_demo" / "mllm_demo_data"


def _dataset(args: argparse.Namespace):
    stamp = args.data_dir / f"done-{args.samples}-{args.images}-{args.max_size}.json"
    raw = args.data_dir / "raw"
    if not stamp.is_file():
        shutil.rmtree(raw, ignore_errors=True)
        t = time.perf_counter()
        data = make_synthetic_dataset(
            raw, args.samples, seed=0, n_images=args.images, size_range=(64, args.max_size), max_words=300
        )
        print(
            f"generated {data.n_samples} records, {data.n_images} images in {time.perf_counter() - t:.1f} s"
        )
        stamp.write_text(json.dumps({"images": data.n_images, "image_bytes": data.image_bytes}))
    info = json.loads(stamp.read_text())
    return raw / "data.jsonl", raw, info


def _copy_baselines(out: Path, manifest: dict, dest: Path) -> dict:
    """MB/s of (a) copying the shard files and (b) gathering the packed samples' image files in order."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    total = sum(e["bytes"] for e in manifest["shards"])
    t = time.perf_counter()
    for e in manifest["shards"]:
        shutil.copyfile(out / e["path"], dest / Path(e["path"]).name)
    shard_copy_s = time.perf_counter() - t
    image_paths = []
    for samples in sorted((out / "_work" / "lengths").glob("chunk-*.samples.jsonl")):
        for line in samples.read_text().splitlines():
            image_paths += json.loads(line)["images"]
    t = time.perf_counter()
    n_bytes = 0
    with open(dest / "gathered.bin", "wb") as f:
        for p in image_paths:
            with open(p, "rb") as src:
                n_bytes += f.write(src.read())
    gather_s = time.perf_counter() - t
    shutil.rmtree(dest)
    return {
        "shard_copy_MBps": total / 2**20 / shard_copy_s,
        "image_gather_MBps": n_bytes / 2**20 / gather_s,
        "image_gather_bytes": n_bytes,
    }


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _bench_videos(data_dir: Path) -> list[Path]:
    from tests.support.video_fixtures import encode_video

    folder = data_dir / "videos"
    folder.mkdir(parents=True, exist_ok=True)
    specs = [  # name, frames, width, height, rate, codec, container, keyframe interval
        ("sd_10s.mp4", 250, 320, 240, 25, "libx264", None, 250),
        ("hd_30s.mp4", 900, 640, 360, 30, "libx264", None, 60),
        ("hd_30s.mkv", 900, 640, 360, 30, "libx264", "matroska", 60),
        ("720p_20s.mp4", 600, 1280, 720, 30, "libx264", None, 250),
        ("sd_20s.avi", 500, 320, 240, 25, "mpeg4", None, 12),
    ]
    paths = sorted(DEMO_VIDEOS.glob("*.*")) if DEMO_VIDEOS.is_dir() else []
    for name, frames, w, h, rate, codec, fmt, gop in specs:
        path = folder / name
        if not path.is_file():
            opts = {"preset": "ultrafast"} if codec == "libx264" else {}
            tmp = encode_video(
                folder / f"tmp-{name}",
                frames,
                width=w,
                height=h,
                rate=rate,
                codec=codec,
                container_format=fmt,
                gop=gop,
                codec_options=opts,
            )
            tmp.rename(path)
        paths.append(path)
    return paths


def video_scan_cost(data_dir: Path, repeats: int = 20) -> list[dict]:
    """Scan cost (probe + plan) and loader decode cost per video; prints a table."""
    import av
    import torch

    from mmpack.dataloader.video import decode_planned_frames
    from mmpack.offline_packing.inputs.video_probe import VideoProbeConfig, probe_video
    from mmpack.packing.video_tokens import VideoTokenRule

    torch.set_num_threads(1)  # one thread per loader worker: intra-op threads only contend with the workers
    rule = VideoTokenRule()
    rows: list[dict[str, Any]] = []
    for path in _bench_videos(data_dir):
        t = time.perf_counter()
        for _ in range(repeats):
            probe = probe_video(path)
            plan = rule.plan(probe.meta)
        scan_s = (time.perf_counter() - t) / repeats
        header_only = VideoProbeConfig(decode_ends=False)  # without the scan's two-frame decode check
        t = time.perf_counter()
        for _ in range(repeats):
            header = probe_video(path, header_only)
        header_s = (time.perf_counter() - t) / repeats
        counters: dict[str, int] = {}
        t = time.perf_counter()
        decode_planned_frames(path, plan, counters=counters)
        planned_s = time.perf_counter() - t
        t = time.perf_counter()
        with av.open(str(path)) as c:
            all_frames = sum(1 for _ in c.decode(video=0))
        full_s = time.perf_counter() - t
        rows.append(
            {
                "video": path.name,
                "size_bytes": probe.size_bytes,
                "bytes_read": probe.bytes_read,
                "frames": probe.meta.total_frames,
                "frame_count_exact": probe.meta.frame_count_exact,
                "grid_thw": list(plan.grid_thw),
                "tokens": plan.num_tokens,
                "scan_videos_per_s": 1 / scan_s,
                "header_bytes_read": header.bytes_read,
                "header_scan_videos_per_s": 1 / header_s,
                "loader_planned_frames": len(plan.frame_indices),
                "loader_frames_decoded": counters["frames_decoded"],
                "loader_seeks": counters["seeks"],
                "loader_decode_s": planned_s,
                "decode_all_frames": all_frames,
                "decode_all_s": full_s,
            }
        )
    print(
        f"\n{'video':>14} {'MB':>6} {'read KB':>8} {'read %':>7} {'scan videos/s':>13} {'header only':>16} "
        f"{'frames':>7} {'tokens':>7}  loader: planned/decoded frames, seeks, s (all frames: s)"
    )
    for r in rows:
        print(
            f"{r['video']:>14} {r['size_bytes'] / 2**20:>6.2f} {r['bytes_read'] / 1024:>8.1f} "
            f"{100 * r['bytes_read'] / r['size_bytes']:>6.1f}% {r['scan_videos_per_s']:>13.0f} "
            f"{r['header_scan_videos_per_s']:>6.0f} ({r['header_bytes_read'] / 1024:>5.1f} KB) {r['frames']:>7} "
            f"{r['tokens']:>7}  {r['loader_planned_frames']}/{r['loader_frames_decoded']}, {r['loader_seeks']}, "
            f"{r['loader_decode_s']:.3f} ({r['decode_all_s']:.3f})"
        )
    return rows


def _job(
    jsonl: Path, image_root: Path, out: Path, tokenizer: str, workers: int, args: argparse.Namespace
) -> PackJobConfig:
    return job_config(
        inputs=(str(jsonl),),
        image_root=str(image_root),
        output=str(out),
        seq_len=args.seq_len,
        tokenizer=tokenizer,
        format=args.format,
        workers=workers,
        progress=False,
    )


def lengths_vs_encode_batch(jsonl: Path, image_root: Path, tokenizer: str, args: argparse.Namespace) -> dict:
    """The lengths stage's tokenization next to a bare `tokenizers` `encode_batch` over the same rendered texts.

    All in this process, scanned samples in memory, contenders interleaved `--lengths-repeats` times (the
    median time of each is reported, so the shared machine's load affects all alike). Contenders:
    `ceiling` encode_batch over the fully rendered texts (every image / video pad written out), `ceiling_compact`
    encode_batch over the texts the stage encodes (one pad per image / video), `stage` the stage's
    `tokenize_chunk_samples` (render, batch encode, loss mask, expansion, over-length policy, metadata row),
    `per_sample` the same one sample at a time (`tokenize_scanned`).
    """
    from mmpack.offline_packing.context import JobContext
    from mmpack.offline_packing.lengths import prepare_scanned, tokenize_chunk_samples, tokenize_scanned
    from mmpack.offline_packing.workdir import read_jsonl
    from mmpack.packing.chat import render_conversation

    out = args.data_dir / "lengths-scan"
    shutil.rmtree(out, ignore_errors=True)
    cfg = _job(jsonl, image_root, out, tokenizer, 1, args)
    run_pack(with_options(cfg, only_stage=1))
    ctx = JobContext(work_dir=str(out / "_work"))
    wd = ctx.work
    samples = [
        s
        for c in range(len(wd.read_marker("scan")["chunks"]))
        for s in read_jsonl(wd.chunk_path("scan", c, "samples.jsonl"))
    ]
    lcfg = cfg.stage_config("lengths")
    tok = ctx.tokenizer(tokenizer)
    full_texts, compact_texts, by_stage = [], [], []
    for smp, result in tokenize_chunk_samples(samples, lcfg, tok):
        if isinstance(result, tuple) and result[1]["truncated_from"] is None:  # kept whole
            prep = prepare_scanned(smp, lcfg, tok).prep
            full_texts.append(
                render_conversation(prep.messages, prep.image_token_counts, None, prep.video_token_counts)
            )
            compact_texts.append(prep.text)
            by_stage.append(result[0].input_ids)
    raw = tok._tok  # the bare tokenizers.Tokenizer
    n_check = min(200, len(full_texts))
    assert all(
        np.array_equal(e.ids, ids)
        for e, ids in zip(raw.encode_batch(full_texts[:n_check], add_special_tokens=False), by_stage)
    ), "stage ids differ from a direct encode of the rendered text"
    contenders = {
        "ceiling": lambda: raw.encode_batch(full_texts, add_special_tokens=False),
        "ceiling_compact": lambda: raw.encode_batch(compact_texts, add_special_tokens=False),
        "stage": lambda: list(tokenize_chunk_samples(samples, lcfg, tok)),
        "per_sample": lambda: [_try(tokenize_scanned, smp, lcfg, tok) for smp in samples],
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.lengths_repeats):
        for name, fn in contenders.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    n = len(samples)
    row: dict[str, Any] = {
        "samples": n,
        "kept_untruncated": len(full_texts),
        "tokens_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
        "samples_per_s": {k: n / v for k, v in med.items()},
        "seconds": times,
        "stage_vs_ceiling": med["ceiling"] / med["stage"],
        "stage_vs_ceiling_compact": med["ceiling_compact"] / med["stage"],
        "per_sample_vs_ceiling": med["ceiling"] / med["per_sample"],
        "stage_speedup_vs_per_sample": med["per_sample"] / med["stage"],
    }
    print(
        f"\nlengths stage vs bare encode_batch ({n} samples, median of {args.lengths_repeats} interleaved runs): "
        + ", ".join(f"{k} {v:.0f}/s" for k, v in row["samples_per_s"].items())
    )
    print(
        f"stage/ceiling {row['stage_vs_ceiling']:.2f}, stage/ceiling_compact {row['stage_vs_ceiling_compact']:.2f}, "
        f"per_sample/ceiling {row['per_sample_vs_ceiling']:.2f}"
    )
    shutil.rmtree(out, ignore_errors=True)
    return row


def _try(fn: Any, *args: Any) -> Any:
    from mmpack.offline_packing.errors import SampleReject

    try:
        return fn(*args)
    except SampleReject as exc:
        return exc


def run_once(jsonl: Path, image_root: Path, tokenizer: str, workers: int, args: argparse.Namespace) -> dict:
    out = args.data_dir / f"out-w{workers}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = _job(jsonl, image_root, out, tokenizer, workers, args)
    # stage by stage, to record CPU seconds (this process + its finished workers) next to wall seconds:
    # on a shared machine wall time depends on the load, CPU time much less
    stages = {}
    t = time.perf_counter()
    for number, name in enumerate(("scan", "lengths", "binpack", "write"), start=1):
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        summary = run_pack(with_options(cfg, only_stage=number))
        stages[name] = {"seconds": time.perf_counter() - wall0, "cpu_seconds": _cpu_s() - cpu0}
    total_s = time.perf_counter() - t
    summary = run_pack(cfg)  # all stages complete: just the summary
    manifest = read_manifest(str(out))
    n = summary.samples_read
    for name, st in stages.items():
        count = n if name == "scan" else summary.samples_packed
        st["samples_per_s"] = count / st["seconds"]
        st["samples_per_cpu_s"] = count / st["cpu_seconds"]
    stages["write"]["MBps"] = summary.output_bytes / 2**20 / stages["write"]["seconds"]
    result = {
        "workers": workers,
        "samples_read": n,
        "samples_packed": summary.samples_packed,
        "bins": summary.bins,
        "fill_efficiency": summary.fill_efficiency,
        "output_bytes": summary.output_bytes,
        "stages": stages,
        "end_to_end_s": total_s,
        "end_to_end_samples_per_s": n / total_s,
    }
    result.update(_copy_baselines(out, manifest, args.data_dir / "copy"))
    if not args.keep:
        shutil.rmtree(out)
    return result


def _versus_ov2(jsonl: Path, image_root: Path, tokenizer: str, args: argparse.Namespace) -> list[dict] | None:
    """LLaVA-OneVision-2's packer next to mmpack's auto_pipe.sh (benchmarks/ov2_contender.py); None without
    --ov2-repo (or without a Qwen tokenizer.json + tokenizer_config.json to build the model folder from)."""
    if args.ov2_repo is None:
        return None
    tok = Path(tokenizer)
    if tok.name != "tokenizer.json" or not (tok.parent / "tokenizer_config.json").is_file():
        print(
            f"LLaVA-OneVision-2 comparison skipped: {tok} is not a Qwen tokenizer.json with its tokenizer_config.json"
        )
        return None
    from benchmarks.ov2_contender import versus_ov2

    workers = max(args.workers)
    return versus_ov2(
        jsonl, image_root, tok, args.ov2_repo, args.ov2_python, args.ov2_seq_lens, workers, args.data_dir
    )


def _ov2_only(
    jsonl: Path, image_root: Path, tokenizer: str, args: argparse.Namespace, argv: list[str] | None
) -> int:
    rows = _versus_ov2(jsonl, image_root, tokenizer, args)
    if rows is None:
        print("--ov2-only needs --ov2-repo PATH (a clone of LLaVA-OneVision-2)")
        return 2
    out = args.out.with_name("bench_offline_ov2.json")
    command = "python benchmarks/bench_offline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"benchmark": "offline_vs_llava_onevision2", "command": command, "machine": _machine()}
    record |= {"load_average_at_end": os.getloadavg(), "tokenizer": tokenizer, "runs": rows}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--images", type=int, default=8000, help="distinct image files")
    p.add_argument("--max-size", type=int, default=1024, help="max image side in pixels (min 64)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--format", default="both", choices=("arrow", "wds", "both"))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokenizer", default=None, help="default: shared Qwen3 if present, else a tiny BPE")
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/mmpack-bench-offline"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_offline.json")
    p.add_argument("--keep", action="store_true", help="keep the packed outputs")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--video-only", action="store_true", help="run only the video scan section")
    p.add_argument("--lengths-only", action="store_true", help="run only the lengths-vs-encode_batch section")
    p.add_argument("--lengths-repeats", type=int, default=5)
    p.add_argument(
        "--ov2-repo", type=Path, default=None, help="a clone of LLaVA-OneVision-2: run its packer too"
    )
    p.add_argument(
        "--ov2-python", default=sys.executable, help="the Python of its environment (ov2_contender.py)"
    )
    p.add_argument("--ov2-seq-lens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--ov2-only", action="store_true", help="run only the LLaVA-OneVision-2 comparison")
    args = p.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    if args.video_only:
        rows = video_scan_cost(args.data_dir)
        out = args.out.with_name("bench_offline_video.json")
        out.write_text(
            json.dumps(
                {
                    "benchmark": "offline_video_scan",
                    "command": "python benchmarks/bench_offline.py --video-only",
                    "machine": _machine(),
                    "load_average_at_end": os.getloadavg(),
                    "videos": rows,
                },
                indent=1,
            )
        )
        print(f"-> {out}")
        return 0
    jsonl, image_root, data_info = _dataset(args)
    tokenizer = args.tokenizer or (
        str(QWEN3) if QWEN3.is_file() else str(train_tiny_bpe(args.data_dir / "tok"))
    )
    if args.ov2_only:
        return _ov2_only(jsonl, image_root, tokenizer, args, argv)
    if args.lengths_only:
        row = lengths_vs_encode_batch(jsonl, image_root, tokenizer, args)
        out = args.out.with_name("bench_offline_lengths.json")
        command = "python benchmarks/bench_offline.py " + " ".join(argv if argv is not None else sys.argv[1:])
        record = {"benchmark": "offline_lengths", "command": command, "machine": _machine()}
        record |= {"load_average_at_end": os.getloadavg(), "tokenizer": tokenizer, "lengths": row}
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"-> {out}")
        return 0
    if args.child is not None:  # one measured run in a fresh process, so no warm caches carry over
        print(json.dumps(run_once(jsonl, image_root, tokenizer, args.child, args)))
        return 0
    runs = []
    for w in args.workers:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(w),
            "--tokenizer",
            tokenizer,
            "--data-dir",
            str(args.data_dir),
        ]
        cmd += [
            "--samples",
            str(args.samples),
            "--images",
            str(args.images),
            "--max-size",
            str(args.max_size),
        ]
        cmd += ["--seq-len", str(args.seq_len), "--format", args.format] + (["--keep"] if args.keep else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))

    print(
        f"\n{args.samples} samples, {data_info['images']} images ({data_info['image_bytes'] / 2**20:.0f} MiB), "
        f"seq_len {args.seq_len}, format {args.format}, tokenizer {Path(tokenizer).parent.name}"
    )
    header = (
        f"{'workers':>7} {'scan/s':>9} {'lengths/s':>10} {'binpack/s':>11} {'write/s':>9} {'write MB/s':>10} "
    )
    header += f"{'end2end/s':>10} {'shard cp MB/s':>13} {'img gather MB/s':>15}  samples per CPU-s: scan/lengths/write"
    print(header)
    for r in runs:
        s = r["stages"]
        print(
            f"{r['workers']:>7} {s['scan']['samples_per_s']:>9.0f} {s['lengths']['samples_per_s']:>10.0f} "
            f"{s['binpack']['samples_per_s']:>11.0f} {s['write']['samples_per_s']:>9.0f} {s['write']['MBps']:>10.1f} "
            f"{r['end_to_end_samples_per_s']:>10.0f} {r['shard_copy_MBps']:>13.1f} {r['image_gather_MBps']:>15.1f}  "
            f"{s['scan']['samples_per_cpu_s']:.0f}/{s['lengths']['samples_per_cpu_s']:.0f}/{s['write']['samples_per_cpu_s']:.0f}"
        )
    result = {
        "benchmark": "offline_packing",
        "command": "python benchmarks/bench_offline.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(),
        "load_average_at_end": os.getloadavg(),
        "dataset": {"samples": args.samples, **data_info, "max_size": args.max_size},
        "seq_len": args.seq_len,
        "format": args.format,
        "tokenizer": tokenizer,
        "runs": runs,
        "video_scan": video_scan_cost(args.data_dir),
        "lengths_vs_encode_batch": lengths_vs_encode_batch(jsonl, image_root, tokenizer, args),
        "versus_llava_onevision2": _versus_ov2(jsonl, image_root, tokenizer, args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
