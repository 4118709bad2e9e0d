"""Online packing deep in a large raw stream: the loader state's size and the time to resume near the start and
deep in the stream, with the packing cache cold (an empty folder: the resume packs its buffer) and warm (the
plans of an earlier walk in place).

A synthetic raw JSONL of `--records` text records (chat turns of random words, `mmpack.demo.synthetic`'s words
and tiny BPE) is opened as a raw source (`--buffer-size` records per buffer, `--seq-len` tokens per bin). The deep
position is the first bin of the first-epoch buffer slot that holds `--deep` of the records (its bin count is the
sum over the slots before it, every one of them packed once into the warm cache: the walk's time is reported as
well). Resume = `load_state_dict` of a JSON round-tripped state plus the first micro-batch, in the main process
(`num_workers=0`). Usage:

    python benchmarks/bench_online.py [--records 1000000] [--buffer-size 10000] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mmpack.dataloader import Topology, build_loader  # noqa: E402
from mmpack.dataloader.raw_source import buffer_order  # noqa: E402
from mmpack.demo.synthetic import random_words, train_tiny_bpe  # noqa: E402
from mmpack.offline_packing.online import RawSource, raw_source  # noqa: E402

SEED = 3
GLOBAL_BATCH = 8


def write_records(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            q = random_words(rng, rng.randint(3, 12)) + "?"
            a = random_words(rng, max(1, min(60, int(rng.paretovariate(1.3) * 6))))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            fh.write(json.dumps({"id": i, "messages": msgs}) + "\n")


def loader_of(source: RawSource) -> Any:
    return build_loader(
        source,
        topology=Topology(dp_rank=0, dp_size=1),
        micro_batch_size=GLOBAL_BATCH,
        global_batch_size=GLOBAL_BATCH,
        num_workers=0,
        seed=SEED,
    )


def resume_seconds(source: RawSource, state: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    loader = loader_of(source)
    loader.load_state_dict(json.loads(json.dumps(state)))
    next(iter(loader))
    took = time.perf_counter() - t0
    loader.close()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--buffer-size", type=int, default=10_000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument(
        "--deep", type=float, default=0.9, help="fraction of the records before the deep position"
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        write_records(tmp / "data.jsonl", args.records, SEED)
        tokenizer = train_tiny_bpe(tmp / "tokenizer", seed=0)
        written = time.perf_counter() - t0

        def source(cache: str) -> RawSource:
            return raw_source(
                str(tmp / "data.jsonl"),
                buffer_size=args.buffer_size,
                seq_len=args.seq_len,
                tokenizer=str(tokenizer),
                packing_cache=cache,
                seed=SEED,
            )

        t0 = time.perf_counter()
        warm = source(str(tmp / "warm"))
        opened = time.perf_counter() - t0
        order = buffer_order(warm.num_buffers, SEED, 0).tolist()
        deep_slot = int(args.deep * warm.num_buffers)
        t0 = time.perf_counter()
        before = sum(warm.pack_buffer(b).num_bins for b in order[:deep_slot])  # fills the warm cache
        walked = time.perf_counter() - t0
        consumed = before // GLOBAL_BATCH * GLOBAL_BATCH
        fresh = loader_of(warm)
        start_state = fresh.state_dict()
        fresh.close()
        deep_state = start_state | {
            "epoch": 0,
            "buffer_slot": deep_slot - 1 if consumed < before else deep_slot,
            "bin_in_buffer": warm.pack_buffer(order[deep_slot - 1]).num_bins - (before - consumed)
            if consumed < before
            else 0,
            "bins_consumed": consumed,
        }
        for b in (order[0], order[deep_slot]):  # the start's buffer, and the deep step's next one, warm too
            warm.pack_buffer(b)
        results: dict[str, Any] = {
            "records": args.records,
            "buffer_size": args.buffer_size,
            "num_buffers": warm.num_buffers,
            "seq_len": args.seq_len,
            "write_records_s": round(written, 2),
            "open_source_s": round(opened, 2),
            "deep_records_fraction": args.deep,
            "deep_bins_consumed": consumed,
            "walk_to_deep_pack_s": round(walked, 2),
            "state_bytes_start": len(json.dumps(start_state)),
            "state_bytes_deep": len(json.dumps(deep_state)),
            "resume_s": {},
        }
        for name, state in (("start", start_state), ("deep", deep_state)):
            cold = source(str(tmp / f"cold-{name}"))
            results["resume_s"][f"{name}_cold"] = round(resume_seconds(cold, state), 3)
            results["resume_s"][f"{name}_warm"] = round(resume_seconds(warm, state), 3)
        results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    print(json.dumps(results, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_online_deep.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
