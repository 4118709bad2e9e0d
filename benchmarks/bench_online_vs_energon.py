"""Online packing side by side: mmpack's online packing loader, Megatron-Energon's packing buffer with the same
packing rule in its task encoder, and mmpack's loader of the same records packed offline (the ceiling).

The same raw records (`mmpack.demo.synthetic`'s generator: LLaVA / ShareGPT / caption / text records, images of
56-448 px; each record given an id) are written as WebDataset tars (`<key>.json` the record, `<key>.img<i>.<ext>`
its images, one tar per packing buffer) and as a JSONL beside the image files:
  mmpack online   `build_loader(raw_source(records.jsonl, image_root=...))`: the loader reads, counts and packs
                  buffer by buffer (`--buffer-size` records each, a packing cache in a fresh folder: cold)
  mmpack online (tars)  the same over the tars Energon reads
  energon         `get_train_dataset(..., packing_buffer_size=--buffer-size)` over the tars (`.nv-meta` from
                  Energon's own preparation, `CrudeWebdataset`); its task encoder counts each sample with
                  mmpack's length function (`lengths.tokenize_scanned`: the same tokenizer, chat template and
                  image rule, image sizes from the members' headers), packs the buffer with mmpack's kernel
                  (`binpack.pack_bins`, same caps) in `select_samples_to_pack`, builds each bin from the bytes it
                  holds in `pack_selected_samples` and collates with mmpack's `collate_bins` (same image decoding
                  and patches) in `batch`
  mmpack offline  `build_loader` of the tars packed by `mmpack pack` (the same options): the ceiling; the pack's
                  own time is reported beside it, not counted

Per contender (one loader worker each, `--workers`; micro-batch = one bin): samples/s and tokens/s over one
epoch (end to end, the loader's build and first batch included; "steady": after the first batch), CPU
milliseconds per sample (user + system of the process tree, workers included: steadier than wall time on a
shared machine), time to the first batch, fill (real tokens / bins x seq_len), peak memory (PSS of the process
and its workers, `benchmarks.pss`, sampled during the pass), and the resume cost: at the first bin past
`--resume-at` of the epoch's samples the loader's state is saved (mmpack `state_dict`, Energon
`save_state_rank`), and a new loader restores it (`load_state_dict`, `restore_state_rank`) and yields its first
batch: that time, the loader's build included. `--repeat N` runs N rounds over the contenders and keeps each
one's fastest run (every run's samples/s, CPU and resume are in the JSON). Usage:

    python benchmarks/bench_online_vs_energon.py [--records 3000] [--buffer-size 500] [--seq-len 2048]
        [--repeat 1] [--formats llava,sharegpt,caption,text] [--tokenizer ../shared/.../tokenizer.json]
        [--out benchmarks/results] [--name bench_online_vs_energon]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import resource
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pss import PeakPss  # noqa: E402
from mmpack.dataloader import Topology, build_loader  # noqa: E402
from mmpack.dataloader.collate import CollateConfig, collate_bins  # noqa: E402
from mmpack.dataloader.manifest import Manifest  # noqa: E402
from mmpack.dataloader.raw_source import BIN_BITS  # noqa: E402
from mmpack.dataloader.readers.record import no_videos  # noqa: E402
from mmpack.demo.synthetic import RECORD_FORMATS, make_synthetic_dataset, train_tiny_bpe  # noqa: E402
from mmpack.offline_packing.binpack import pack_bins  # noqa: E402
from mmpack.offline_packing.errors import SampleReject  # noqa: E402
from mmpack.offline_packing.lengths import tokenize_scanned  # noqa: E402
from mmpack.offline_packing.online import RawSource, raw_source  # noqa: E402
from mmpack.packing.batch import MicroBatch  # noqa: E402
from mmpack.packing.chat import normalize_record  # noqa: E402
from mmpack.packing.image_tokens import read_image_size  # noqa: E402

SEED = 3
SHARED_TOKENIZER = REPO.parent / "shared" / "data" / "tokenizer_qwen3" / "tokenizer.json"
CRUDE_DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors:\n  source: raw\n"


# -- the records ----------------------------------------------------------------------------------------------
def write_raw_tars(
    root: Path, records: int, shards: int, seed: int, formats: tuple[str, ...] = RECORD_FORMATS
) -> list[Path]:
    """`records` synthetic records of `formats` (image-text and text) as WebDataset tars under `root/tars`
    (ids `rec-<i>`), and as `root/records.jsonl` with their images under `root/raw`."""
    data = make_synthetic_dataset(
        root / "raw", n_samples=records, seed=seed, formats=formats, size_range=(56, 448), max_words=60
    )
    out = root / "tars"
    out.mkdir(parents=True, exist_ok=True)
    with open(root / "records.jsonl", "w") as fh:  # the same records for a JSONL reader (images in raw/)
        for i, rec in enumerate(data.records):
            fh.write(json.dumps(rec | {"id": f"rec-{i}"}, sort_keys=True) + "\n")
    per = -(-records // shards)
    paths = []
    for s in range(0, records, per):
        path = out / f"raw-{s // per:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(s, min(records, s + per)):
                _add_sample(tar, f"{i:07d}", data.records[i], data.image_root)
        paths.append(path)
    return paths


def _add_sample(tar: tarfile.TarFile, key: str, rec: dict, image_root: Path) -> None:
    images = rec.get("images", rec.get("image", []))
    images = [images] if isinstance(images, str) else list(images)
    names = [f"img{j}.{Path(p).suffix.lstrip('.')}" for j, p in enumerate(images)]
    record = {k: v for k, v in rec.items() if k not in ("image", "images")} | {"id": f"rec-{int(key)}"}
    if names:
        record["images"] = names
    members = [("json", json.dumps(record, sort_keys=True).encode())]
    members += [(n, (image_root / p).read_bytes()) for n, p in zip(names, images)]
    for suffix, body in members:
        info = tarfile.TarInfo(f"{key}.{suffix}")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))


def add_energon_metadata(root: Path, tars: list[Path]) -> None:
    """Energon's own preparation of the tars (`energon prepare`), read as a `CrudeWebdataset`."""
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    names = [p.relative_to(root).as_posix() for p in tars]
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        WebdatasetPreparator.prepare_dataset(
            root, names, split_parts_ratio=[("train", 1.0)], shuffle_seed=None, workers=1
        )
    (root / ".nv-meta" / "dataset.yaml").write_text(CRUDE_DATASET_YAML)


# -- the packing rule, as Energon's task encoder applies it ----------------------------------------------------
@dataclass(frozen=True)
class PackingRule:
    """What counts and packs a sample in mmpack (`RawSource.config`): its length stage (tokenizer, chat
    template, image rule), its bin-packing stage (kernel, caps) and the collation of its bins."""

    source: RawSource

    def tokenizer(self) -> Any:
        cfg = self.source.config
        return self.source.context.tokenizer(cfg.tokenizer, cfg.lengths.control_tokens)

    def collate(self) -> CollateConfig:
        return CollateConfig.from_manifest(Manifest.from_model(self.source.dataset))

    def count(self, key: str, raw: dict[str, Any]) -> dict[str, Any] | None:
        """A crude sample (`json` record, image members as bytes) counted as the offline job counts it: its
        token ids, loss mask and metadata row, and its images' bytes; None for a record it would reject."""
        try:
            conv = normalize_record(raw["json"], source=key, line=0)
            wh, fmt, nbytes = [], [], []
            for name in conv.images:
                w, h, f = read_image_size(raw[name], check_truncated=True)
                wh.append([w, h])
                fmt.append(f)
                nbytes.append(len(raw[name]))
            row = {"src": key, "line": 0, "id": conv.sample_id, "messages": [list(m) for m in conv.messages]}
            row |= {"images": list(conv.images), "wh": wh, "fmt": fmt, "nbytes": nbytes}
            tok, meta = tokenize_scanned(row, self.source.config.stage_config("lengths"), self.tokenizer())
        except (SampleReject, KeyError, ValueError):
            return None
        ids, mask = np.asarray(tok.input_ids), np.asarray(tok.loss_mask)
        return {"ids": ids, "mask": mask, "meta": meta, "images": [raw[n] for n in conv.images]}

    def select(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        lengths = np.asarray([len(s["ids"]) for s in samples], dtype=np.int64)
        nimg = np.asarray([len(s["images"]) for s in samples], dtype=np.int64)
        bins, _ = pack_bins(lengths, nimg, self.source.config.stage_config("binpack"))
        return [[samples[i] for i in b.tolist()] for b in bins]


def bin_record(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The `BinRecord` of a selected pack (the fields a shard reader returns), images from memory."""
    metas = [s["meta"] for s in samples]
    grids = [g for m in metas for g in m["grid"]]
    return {
        "key": metas[0]["id"],
        "input_ids": np.concatenate([s["ids"] for s in samples]).astype(np.uint32),
        "loss_mask": np.concatenate([s["mask"] for s in samples]).astype(np.uint8),
        "seq_lens": np.asarray([len(s["ids"]) for s in samples], dtype=np.int32),
        "sample_ids": [m["id"] for m in metas],
        "images": [b for s in samples for b in s["images"]],
        "image_formats": [f for m in metas for f in m["fmt"]],
        "image_grid_thw": np.asarray(grids, dtype=np.int32).reshape(-1, 3),
    } | no_videos()


def energon_dataset(root: Path, rule: PackingRule, buffer_size: int, workers: int) -> Any:
    """Energon's train dataset of the tars with a packing buffer of `buffer_size` samples and `rule`."""
    from megatron.energon import Cooker, DefaultTaskEncoder, SkipSample, WorkerConfig, get_train_dataset
    from megatron.energon.task_encoder.base import stateless
    from megatron.energon.task_encoder.cooking import basic_sample_keys

    collate = rule.collate()

    class RawDecoder:  # the record parsed, image members left as bytes (the rule reads their headers)
        def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
            return {k: json.loads(v) if k == "json" else v for k, v in sample.items()}

        def config(self) -> dict[str, Any]:
            return {"decoder": "json only"}

    @stateless
    def cook(sample: dict[str, Any]) -> dict[str, Any]:
        return sample

    class SameRuleEncoder(DefaultTaskEncoder):  # type: ignore[misc]
        decoder = RawDecoder()
        cookers: ClassVar[list[Any]] = [Cooker(cook)]

        @stateless
        def encode_sample(self, sample: dict[str, Any]) -> dict[str, Any]:
            counted = rule.count(sample["__key__"], sample)
            if counted is None:
                raise SkipSample()
            return basic_sample_keys(sample) | counted  # its restore key: Energon restores buffers by it

        def select_samples_to_pack(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
            return rule.select(samples)

        @stateless
        def pack_selected_samples(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
            return bin_record(samples)

        def batch(self, samples: list[dict[str, Any]]) -> tuple[MicroBatch, list[tuple[str, int]]]:
            seen = [(i, int(n)) for s in samples for i, n in zip(s["sample_ids"], s["seq_lens"])]
            return collate_bins(samples, collate), seen

        def encode_batch(self, batch: Any) -> Any:
            return batch

    return get_train_dataset(
        str(root),
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        batch_size=1,
        batch_drop_last=False,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        packing_buffer_size=buffer_size,
        repeat=False,
        task_encoder=SameRuleEncoder(),
    )


# -- the contenders -------------------------------------------------------------------------------------------
@dataclass
class Contender:
    """A loader to time: `build(state)` gives one (resumed from `state` when given), `save(loader)` its state,
    `unwrap(batch)` the `MicroBatch` of what it yields, `samples(loader, batch)` the (sample id, tokens) of each
    sample of a batch (the id "" where the contender does not trace ids)."""

    name: str
    build: Callable[[Any], Any]
    save: Callable[[Any], Any]
    unwrap: Callable[[Any], MicroBatch]
    samples: Callable[[Any, Any], list[tuple[str, int]]]
    close: Callable[[Any], None]


def _seg_lens(batch: MicroBatch) -> list[int]:
    """The real samples' lengths of a one-bin micro-batch (cu_seqlens, padding left out)."""
    cu = np.asarray(batch.cu_seqlens).reshape(-1).tolist()
    lens = [b - a for a, b in itertools.pairwise(cu) if b > a]
    real, out = int(batch.num_real_tokens), []
    for n in lens:
        if real <= 0:
            break
        out.append(n)
        real -= n
    return out


def mmpack_contender(name: str, make: Callable[[], Any], workers: int, trace: bool = False) -> Contender:
    """`trace`: name each sample of a raw source's batches (its bin read back from the source's packing)."""
    made: list[Any] = []

    def build(state: Any) -> Any:
        made[:] = [make()]
        loader = build_loader(
            made[0],
            topology=Topology(dp_rank=0, dp_size=1),
            micro_batch_size=1,
            global_batch_size=1,
            num_workers=workers,
            seed=SEED,
        )
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        return loader

    def samples(loader: Any, batch: MicroBatch) -> list[tuple[str, int]]:
        if not trace:
            return [("", n) for n in _seg_lens(batch)]
        b = int(batch.bin_ids[0])  # type: ignore[index]
        rec = made[0].pack_buffer(b >> BIN_BITS).record(b & ((1 << BIN_BITS) - 1))
        return [(i, int(n)) for i, n in zip(rec["sample_ids"], rec["seq_lens"])]

    return Contender(name, build, lambda ld: ld.state_dict(), lambda b: b, samples, lambda ld: ld.close())


def energon_contender(root: Path, rule: PackingRule, buffer_size: int, workers: int) -> Contender:
    from megatron.energon import get_savable_loader

    def build(state: Any) -> Any:
        loader = get_savable_loader(energon_dataset(root, rule, buffer_size, workers))
        if state is not None:
            loader.restore_state_rank(state)
        return loader

    return Contender(
        "energon",
        build,
        lambda ld: ld.save_state_rank(),
        lambda b: b[0],
        lambda ld, b: list(b[1]),
        lambda ld: None,
    )


def run_pass(c: Contender, epoch_samples: int, resume_at: float) -> tuple[dict[str, Any], Any, list]:
    """One epoch of `c` (until every sample is seen once), timed, with its state saved at `resume_at`."""
    seen: list[tuple[str, int]] = []
    bins = tokens = 0
    state, save_s, first_s, first_samples = None, 0.0, 0.0, 0
    cpu0 = _cpu_s()
    with PeakPss() as pss:
        t0 = time.perf_counter()
        loader = c.build(None)
        it: Iterator[Any] = iter(loader)
        for batch in it:
            mb = c.unwrap(batch)
            bins += 1
            tokens += int(mb.num_real_tokens)
            seen += c.samples(loader, batch)
            if bins == 1:
                first_s, first_samples = time.perf_counter() - t0, len(seen)
            if state is None and len(seen) >= resume_at * epoch_samples:
                t1 = time.perf_counter()
                state = c.save(loader)
                save_s = time.perf_counter() - t1
            if len(seen) >= epoch_samples:
                break
        took = time.perf_counter() - t0 - save_s
        cpu = _cpu_s() - cpu0  # before the workers are stopped
        del it
        c.close(loader)
    return (
        {
            "samples": len(seen),
            "bins": bins,
            "tokens": tokens,
            "seconds": round(took, 2),
            "samples_per_s": round(len(seen) / took, 1),
            "tokens_per_s": round(tokens / took),
            "first_batch_s": round(first_s, 2),
            "steady_samples_per_s": round((len(seen) - first_samples) / max(took - first_s, 1e-9), 1),
            "save_state_s": round(save_s, 3),
            "cpu_s": round(cpu, 1),
            "cpu_ms_per_sample": round(1000 * cpu / max(len(seen), 1), 2),
            "peak_pss_mb": round(pss.peak_kb / 1024),
            "peak_anon_shmem_mb": round(pss.peak_anon_shmem_kb / 1024),
        },
        state,
        seen,
    )


def _cpu_s() -> float:
    """User + system CPU seconds of this process, its live descendants (the loaders' workers) and the children
    it has reaped (each process is in exactly one of those)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def resume_seconds(c: Contender, state: Any) -> float:
    t0 = time.perf_counter()
    loader = c.build(state)
    it = iter(loader)
    next(it)
    took = time.perf_counter() - t0
    del it
    c.close(loader)
    return took


def measure(c: Contender, epoch_samples: int, seq_len: int, resume_at: float) -> tuple[dict[str, Any], list]:
    result, state, seen = run_pass(c, epoch_samples, resume_at)
    result["fill"] = round(result["tokens"] / (result["bins"] * seq_len), 4)
    result["resume_s"] = round(resume_seconds(c, state), 2) if state is not None else None
    return result, seen


# -- the run --------------------------------------------------------------------------------------------------
def prepare(tmp: Path, args: argparse.Namespace) -> tuple[list[Path], str]:
    shards = args.shards or -(-args.records // args.buffer_size)  # a tar is a buffer for the tar reader too
    tars = write_raw_tars(tmp, args.records, shards, SEED, tuple(args.formats.split(",")))
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = str(
            SHARED_TOKENIZER if SHARED_TOKENIZER.exists() else train_tiny_bpe(tmp / "bpe", seed=0)
        )
    return tars, tokenizer


def open_source(
    inputs: list[Path],
    tokenizer: str,
    args: argparse.Namespace,
    cache: Path | None,
    image_root: Path | None = None,
) -> RawSource:
    return raw_source(
        [str(p) for p in inputs],
        image_root=str(image_root) if image_root else None,
        buffer_size=args.buffer_size,
        seq_len=args.seq_len,
        tokenizer=tokenizer,
        packing_cache=str(cache) if cache else None,
        seed=SEED,
    )


def pack_offline(source: RawSource, out: Path) -> tuple[int, float]:
    """The records packed by `mmpack pack` with the source's options: (samples packed, seconds)."""
    from mmpack.offline_packing.pipeline import run_pack

    t0 = time.perf_counter()
    summary = run_pack(replace(source.config, output=str(out)))
    return int(summary.samples_packed), time.perf_counter() - t0


def contenders(
    tmp: Path, tars: list[Path], tokenizer: str, args: argparse.Namespace, trace: bool = False
) -> list[Contender]:
    packed = tmp / "packed"
    fresh = lambda: tmp / f"cache-{time.monotonic_ns()}"  # noqa: E731  # a cold packing cache per loader
    jsonl = lambda: open_source([tmp / "records.jsonl"], tokenizer, args, fresh(), tmp / "raw")  # noqa: E731
    rule = PackingRule(open_source(tars, tokenizer, args, None))
    return [
        mmpack_contender("mmpack online", jsonl, args.workers, trace),
        mmpack_contender(
            "mmpack online (tars)", lambda: open_source(tars, tokenizer, args, fresh()), args.workers, trace
        ),
        energon_contender(tmp, rule, args.buffer_size, args.workers),
        mmpack_contender("mmpack offline", lambda: str(packed), args.workers),
    ]


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a contender's runs (least wall time; its fastest resume), with every run's samples/s
    and CPU per sample beside it."""
    best = min(runs, key=lambda r: r["seconds"])
    resumes = [r["resume_s"] for r in runs if r["resume_s"] is not None]
    return best | {
        "resume_s": min(resumes) if resumes else None,
        "runs_samples_per_s": [r["samples_per_s"] for r in runs],
        "runs_cpu_ms_per_sample": [r["cpu_ms_per_sample"] for r in runs],
        "runs_resume_s": [r["resume_s"] for r in runs],
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each online contender over Energon and over the offline loader: samples/s (end to end and steady)
    and peak memory."""
    out = {}
    for name, tag in (("mmpack online", "online"), ("mmpack online (tars)", "online_tars")):
        for other, otag in (("energon", "energon"), ("mmpack offline", "offline")):
            on, off = results.get(name), results.get(other)
            if not (on and off):
                continue
            for key in ("samples_per_s", "steady_samples_per_s", "cpu_ms_per_sample", "peak_pss_mb"):
                out[f"{tag}_over_{otag}_{key}"] = round(on[key] / off[key], 2)
    return out


def print_table(results: dict[str, dict[str, Any]]) -> None:
    cols = (
        "samples_per_s",
        "steady_samples_per_s",
        "tokens_per_s",
        "cpu_ms_per_sample",
        "fill",
        "first_batch_s",
        "peak_pss_mb",
        "resume_s",
        "seconds",
    )
    print(f"{'contender':<21}" + "".join(f"{c:>21}" for c in cols))
    for name, r in results.items():
        print(f"{name:<21}" + "".join(f"{r[c]!s:>21}" for c in cols))


def work_differences(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> list[str]:
    """Where two passes' samples differ (ids seen, each id's token count); [] when they did the same work."""
    da, db = dict(a), dict(b)
    out = [f"{len(a) - len(da)} samples seen twice in the first pass"] if len(da) != len(a) else []
    out += [f"sample {i} only in the first pass" for i in sorted(da.keys() - db.keys())]
    out += [f"sample {i} only in the second pass" for i in sorted(db.keys() - da.keys())]
    out += [f"sample {i}: {da[i]} vs {db[i]} tokens" for i in sorted(da.keys() & db.keys()) if da[i] != db[i]]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--shards", type=int, default=None, help="tars (default: one per packing buffer)")
    ap.add_argument("--buffer-size", type=int, default=500, help="records (samples) per packing buffer")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes per contender")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the contenders; the best run is kept")
    ap.add_argument("--resume-at", type=float, default=0.9, help="fraction of the epoch's samples")
    ap.add_argument(
        "--tokenizer", default=None, help="default: the Qwen3 tokenizer of ../shared, else a tiny BPE"
    )
    ap.add_argument(
        "--formats",
        default=",".join(RECORD_FORMATS),
        help=f"record formats, comma-separated, of {RECORD_FORMATS} (text: no images)",
    )
    ap.add_argument("--name", default="bench_online_vs_energon", help="the results file's name (.json)")
    ap.add_argument("--only", action="append", default=None, help="run only these contenders (repeatable)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tars, tokenizer = prepare(tmp, args)
        add_energon_metadata(tmp, tars)
        kept, pack_s = pack_offline(open_source(tars, tokenizer, args, None), tmp / "packed")
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):  # rounds over every contender: a busy machine slows all of them alike
            for c in contenders(tmp, tars, tokenizer, args):
                if args.only and c.name not in args.only:
                    continue
                result, _ = measure(c, kept, args.seq_len, args.resume_at)
                runs.setdefault(c.name, []).append(result)
                print(f"{c.name}: {json.dumps(result)}", flush=True)
        results = {name: best_of(r) for name, r in runs.items()}
    report = {
        "records": args.records,
        "formats": args.formats,
        "samples_kept": kept,
        "buffer_size": args.buffer_size,
        "seq_len": args.seq_len,
        "workers": args.workers,
        "repeat": args.repeat,
        "resume_at": args.resume_at,
        "tokenizer": Path(tokenizer).parent.name if tokenizer.endswith(".json") else tokenizer,
        "offline_pack_s": round(pack_s, 1),
        "results": results,
        "ratios": ratios(results),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "energon": _energon_version(),
        },
    }
    print_table(results)
    print(json.dumps(report["ratios"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _energon_version() -> str:
    from importlib.metadata import version

    return version("megatron-energon")


if __name__ == "__main__":
    raise SystemExit(main())
