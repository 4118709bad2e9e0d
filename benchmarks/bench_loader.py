"""Loader throughput, side by side on the same packed WebDataset shards, from local disk and from moto S3.

Contenders (same decoding and batching: npy/json members, Pillow decode + patchify, packing.layout collation):
  raw        sequential read of every shard's bytes (the storage's read bandwidth; no decoding)
  webdataset plain `webdataset` pipeline + WebLoader (shards in order, split by worker)
  mmpack     `dataloader.build_loader` (global shuffled order, sha256 checks, cache, read-ahead)
  mmpack storage  the loader's storage path alone: `ShardStore` fetching (local: checking) every shard into an
             empty cache with the prefetcher's number of threads, nothing decoded
  decode     the CPU ceiling: `--workers` processes decode and collate every bin (micro-batches dealt out in
             turn) from shards already in memory (no storage, order, checks, or hand-over to a consumer): what
             the same decoding on as many processes costs on this machine

Storages: local disk; moto S3 (`python -m moto.server` in its own process, on the same cores); "s3-link", the
same server behind a proxy process that paces all response bodies to `--link-mb-s` together, a link slower than
decoding, so that the storage and not the CPU is the bottleneck.

Local files are evicted from the page cache (posix_fadvise DONTNEED) before each contender, so "local" means
the disk, not memory; the warm (page cache) raw read is reported beside it. Reported per contender and
storage: bins/s and MB/s of shard bytes end to end and in steady state (after the first batch), time to first
batch, and the data-wait fraction when a consumer takes a fixed time per micro-batch. Usage:

    python benchmarks/bench_loader.py [--samples 2000] [--workers 2] [--step-ms 400] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dataloader import Topology, build_loader, load_manifest  # noqa: E402
from dataloader.collate import CollateConfig, collate_bins  # noqa: E402
from dataloader.readers import WdsShardReader, decode_wds_bin  # noqa: E402
from dataloader.storage import ShardStore, StorageConfig  # noqa: E402
from dataloader.worker import to_torch  # noqa: E402
from offline_packing.demo.synthetic import build_packed_dataset  # noqa: E402
from tests.storage_servers import link_proxy_process, moto_s3, s3_storage_options  # noqa: E402


# -- plain webdataset -----------------------------------------------------------------------------------------
def wds_sample_to_record(sample: dict[str, Any]) -> dict[str, Any]:
    """A webdataset sample (member suffix -> bytes) to the record the collation takes."""
    return decode_wds_bin(sample["__key__"], sample, sample.__getitem__, label=sample.get("__url__", "wds"))


def fsspec_opener(
    storage_options: dict[str, Any],
) -> Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]:
    def open_urls(src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from fsspec.core import url_to_fs

        for sample in src:
            fs, path = url_to_fs(sample["url"], **storage_options)
            with fs.open(path, "rb", block_size=8 << 20) as stream:
                yield {**sample, "stream": stream}

    return open_urls


def webdataset_loader(
    urls: list[str], cfg: CollateConfig, micro: int, workers: int, storage_options: dict[str, Any] | None
) -> Iterable[Any]:
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    opener = url_opener if storage_options is None else fsspec_opener(storage_options)
    pipe = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        opener,
        wds.pipelinefilter(tar_file_expander)(),
        wds.pipelinefilter(group_by_keys)(),
        wds.map(wds_sample_to_record),
        wds.batched(micro, collation_fn=partial(collate_bins, cfg=cfg), partial=False),
    )
    return wds.WebLoader(pipe, batch_size=None, num_workers=workers, persistent_workers=False)


# -- measurement ---------------------------------------------------------------------------------------------
def measure(
    make: Callable[[], Iterable[Any]], total_bytes: int, step_s: float, max_batches: int | None
) -> dict:
    """One pass over `make()`: time to first batch, bins/s, MB/s; with step_s > 0, the data-wait fraction."""
    t0 = time.perf_counter()
    it = iter(make())
    first = None
    t_first = t0
    bins = batches = first_bins = 0
    wait = 0.0
    while max_batches is None or batches < max_batches:
        t_req = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.perf_counter()
        if first is None:
            first, t_first = now - t0, now
        else:
            wait += now - t_req  # data wait after the first batch (that one is time to first batch)
        batch = batch if isinstance(batch.get("tokens"), torch.Tensor) else to_torch(batch)
        bins += int(batch["tokens"].shape[0])
        if batches == 0:
            first_bins = bins
        batches += 1
        del batch  # the consumer drops its batch within its step (freeing shared memory takes a few ms)
        if step_s:
            time.sleep(step_s)
    elapsed = time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close is not None:
        close()
    out = {"batches": batches, "bins": bins, "seconds": elapsed, "time_to_first_batch_s": first}
    if step_s:
        out["data_wait_fraction"] = wait / max(time.perf_counter() - t_first, 1e-9) if batches > 1 else 0.0
    else:
        out["bins_per_s"] = bins / elapsed
        out["MB_per_s"] = total_bytes / elapsed / 1e6
        # Steady state: everything after the first batch (its bins' share of the shard bytes).
        after = elapsed - (first or 0.0)
        rest = bins - first_bins
        out["steady_bins_per_s"] = rest / after if rest > 0 and after > 0 else None
        out["steady_MB_per_s"] = total_bytes * rest / bins / after / 1e6 if rest > 0 and after > 0 else None
    return out


def evict_from_page_cache(paths: list[str]) -> None:
    """Drops the clean cached pages of local files, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _decode_share(
    shards: list[tuple[str, int]],
    cfg: CollateConfig,
    micro: int,
    share: tuple[int, int],
    start: Any,
    out: Any,
) -> None:
    """Decodes and collates micro-batches share[0], share[0] + share[1], ... of all bins in file order."""
    for path, _ in shards:  # warm: the ceiling reads from memory
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass
    bins = [(path, row) for path, count in shards for row in range(count)]
    start.wait()
    t0 = time.perf_counter()
    readers: dict[str, WdsShardReader] = {}
    done = 0
    for b0 in range(share[0] * micro, len(bins), share[1] * micro):
        records = []
        for path, row in bins[b0 : b0 + micro]:
            if path not in readers:
                readers[path] = WdsShardReader(path, label=path)
            records.append(readers[path].read(row))
        done += int(collate_bins(records, cfg)["tokens"].shape[0])
    for reader in readers.values():
        reader.close()
    out[share[0]] = (done, time.perf_counter() - t0)


def decode_ceiling(
    shards: list[tuple[str, int]], cfg: CollateConfig, micro: int, workers: int, total_bytes: int
) -> dict:
    """`workers` processes decode and collate their share of the shards from memory, started together."""
    ctx = mp.get_context("fork")
    start = ctx.Barrier(workers + 1)
    out = ctx.Manager().dict()
    procs = [
        ctx.Process(target=_decode_share, args=(shards, cfg, micro, (w, workers), start, out))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs) or len(out) != workers:
        raise RuntimeError("a decode-ceiling process failed")
    bins = sum(b for b, _ in out.values())
    return {
        "bins": bins,
        "seconds": elapsed,
        "bins_per_s": bins / elapsed,
        "MB_per_s": total_bytes / elapsed / 1e6,
    }


def storage_path(root: str, storage_options: dict[str, Any] | None, cache_dir: str) -> dict:
    """mmpack's storage path alone: every shard fetched (or, local, checked) by `ShardStore` with as many
    threads as the loader's prefetcher uses, into an empty cache; no decoding."""
    from concurrent.futures import ThreadPoolExecutor

    m = load_manifest(root, storage_options=storage_options, shard_format="wds")
    store = ShardStore(StorageConfig(root=root, cache_dir=cache_dir, storage_options=storage_options))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(store.config.download_concurrency) as pool:
        if not all(pool.map(store.fetch, m.shards)):
            raise RuntimeError("a shard was not fetched")
    elapsed = time.perf_counter() - t0
    size = sum(s.bytes for s in m.shards)
    return {
        "seconds": elapsed,
        "MB_per_s": size / elapsed / 1e6,
        "time_to_first_batch_s": None,
        "bytes": size,
    }


def raw_read(urls: list[str], storage_options: dict[str, Any] | None) -> dict:
    """Every shard read whole, one after the other, the fastest plain way: local files with read(), objects with
    one GET each (s3fs `cat_file` without its size lookup)."""
    from fsspec.core import url_to_fs

    t0 = time.perf_counter()
    first = None
    size = 0
    for url in urls:
        if storage_options is None:
            with open(url, "rb") as f:
                while chunk := f.read(8 << 20):
                    size += len(chunk)
        else:
            fs, path = url_to_fs(url, **storage_options)
            extra = {"max_concurrency": 1} if url.startswith("s3://") else {}
            size += len(fs.cat_file(path, **extra))
        first = first if first is not None else time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "MB_per_s": size / elapsed / 1e6,
        "time_to_first_batch_s": first,
        "bytes": size,
    }


def run_storage(
    name: str, root: str, storage_options: dict[str, Any] | None, args: argparse.Namespace, tmp: Path
) -> dict[str, dict]:
    m = load_manifest(root, storage_options=storage_options, shard_format="wds")
    urls = [f"{root}/{s.path}" for s in m.shards]
    total = sum(s.bytes for s in m.shards)
    cfg = CollateConfig.from_manifest(m)
    micro = args.micro_batch
    counter = iter(range(10**6))

    def mmpack() -> Iterable[Any]:
        return build_loader(
            root,
            topology=Topology(dp_rank=0, dp_size=1),
            micro_batch_size=micro,
            global_batch_size=micro,
            num_workers=args.workers,
            shard_format="wds",
            num_epochs=1,
            storage_options=storage_options,
            cache_dir=str(tmp / f"cache-{name}-{next(counter)}"),
        )

    def plain() -> Iterable[Any]:
        return webdataset_loader(urls, cfg, micro, args.workers, storage_options)

    local_files = urls if storage_options is None else []

    def cold() -> None:
        evict_from_page_cache(local_files)

    results: dict[str, dict] = {}
    if local_files:
        results["raw (page cache)"] = raw_read(urls, None)
    cold()
    results["raw"] = raw_read(urls, storage_options)
    cold()
    results["mmpack storage"] = storage_path(
        root, storage_options, str(tmp / f"cache-{name}-{next(counter)}")
    )
    for label, make in (("webdataset", plain), ("mmpack", mmpack)):
        cold()
        full = measure(make, total, 0.0, None)
        cold()
        consumer = measure(make, total, args.step_ms / 1000, args.consumer_batches)
        results[label] = {**full, "data_wait_fraction": consumer["data_wait_fraction"]}
    results["_dataset"] = {"shards": len(m.shards), "bins": m.num_bins, "bytes": total}
    return results


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width},.{digits}f}"


def print_table(all_results: dict[str, dict[str, dict]]) -> None:
    head = (
        f"{'data/storage':13} {'reader':17} {'bins/s':>9} {'MB/s':>8} {'steady bins/s':>13} {'steady MB/s':>11} "
        f"{'1st batch s':>11} {'data wait':>10}"
    )
    print(head)
    print("-" * len(head))
    for storage, results in all_results.items():
        for label, r in results.items():
            if label.startswith("_"):
                continue
            wait = r.get("data_wait_fraction")
            print(
                f"{storage:13} {label:17} {_fmt(r.get('bins_per_s'), 9)} {_fmt(r['MB_per_s'], 8)} "
                f"{_fmt(r.get('steady_bins_per_s'), 13)} {_fmt(r.get('steady_MB_per_s'), 11)} "
                f"{_fmt(r.get('time_to_first_batch_s'), 11, 3)} "
                f"{_fmt(None if wait is None else 100 * wait, 9, 2)}{'%' if wait is not None else ' '}"
            )
    print()
    print("ratios (steady state; raw = the storage's sequential read, decode = the CPU ceiling):")
    for storage, results in all_results.items():
        mm, wds, raw = results["mmpack"], results["webdataset"], results["raw"]
        ceiling = results.get("decode ceiling", {}).get("MB_per_s")
        bound = raw["MB_per_s"] if ceiling is None else min(raw["MB_per_s"], ceiling)
        parts = [
            f"mmpack/webdataset {mm['steady_MB_per_s'] / wds['steady_MB_per_s']:.2f}",
            f"mmpack/raw {mm['steady_MB_per_s'] / raw['MB_per_s']:.2f}",
            f"mmpack storage path/raw {results['mmpack storage']['MB_per_s'] / raw['MB_per_s']:.2f}",
        ]
        if ceiling is not None:
            parts.append(f"mmpack/decode {mm['steady_MB_per_s'] / ceiling:.2f}")
            parts.append(f"mmpack/min(raw, decode) {mm['steady_MB_per_s'] / bound:.2f}")
        print(f"  {storage:13} " + ", ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--samples", type=int, default=4000, help="raw synthetic samples of the image-text dataset"
    )
    p.add_argument("--text-samples", type=int, default=150000, help="samples of the text-only dataset")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--bins-per-shard", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=400.0, help="consumer time per micro-batch")
    p.add_argument("--consumer-batches", type=int, default=20)
    p.add_argument("--storages", default="local,s3,s3-link")
    p.add_argument(
        "--link-mb-s", type=float, default=5.0, help="bandwidth of the s3-link storage's link (MB/s, shared)"
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="mmpack-bench-loader-") as tmp_name:
        tmp = Path(tmp_name)
        datasets = {
            # image-text bins: decoding and patchifying images dominates
            "vlm": build_packed_dataset(
                tmp / "vlm",
                n_samples=args.samples,
                seq_len=args.seq_len,
                fmt="wds",
                max_bins_per_shard=args.bins_per_shard,
                size_range=(64, 512),
                max_words=120,
            ),
            # text-only bins: shows what the storage and reading path cost without image work
            "text": build_packed_dataset(
                tmp / "text",
                n_samples=args.text_samples,
                seq_len=args.seq_len,
                fmt="wds",
                max_bins_per_shard=args.bins_per_shard,
                max_words=400,
                record_formats=("text",),
            ),
        }
        all_results: dict[str, dict[str, dict]] = {}
        storages = args.storages.split(",")
        for data_name, dataset in datasets.items():
            m = load_manifest(str(dataset), shard_format="wds")
            cfg = CollateConfig.from_manifest(m)
            shards = [(str(dataset / s.path), s.bins) for s in m.shards]  # bin counts from the manifest
            ceiling = decode_ceiling(
                shards, cfg, args.micro_batch, args.workers, sum(s.bytes for s in m.shards)
            )
            if "local" in storages:
                all_results[f"{data_name}/local"] = run_storage("local", str(dataset), None, args, tmp)
                all_results[f"{data_name}/local"]["decode ceiling"] = ceiling
            if "s3" in storages or "s3-link" in storages:
                with moto_s3(own_process=True) as s3:
                    url = s3.upload_folder(dataset, "bench", data_name)
                    if "s3" in storages:
                        all_results[f"{data_name}/s3"] = run_storage("s3", url, s3.storage_options, args, tmp)
                        all_results[f"{data_name}/s3"]["decode ceiling"] = ceiling
                    if "s3-link" in storages:
                        # The same server behind a link slower than decoding: the storage is the bottleneck.
                        with link_proxy_process(s3.endpoint_url, args.link_mb_s * 1e6) as proxy:
                            key = f"{data_name}/s3-link"
                            all_results[key] = run_storage(
                                "s3-link", url, s3_storage_options(proxy), args, tmp
                            )
                            all_results[key]["decode ceiling"] = ceiling
    print_table(all_results)
    record = {
        "benchmark": "bench_loader",
        "args": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0],
        },
        "results": all_results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loader.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'bench_loader.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
