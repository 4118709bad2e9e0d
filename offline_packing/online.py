"""Online packing: raw records packed into bins buffer by buffer, for the loader to read as it trains.

A `RawSource` is the offline job's stages 1-3 over one packing buffer at a time, by the same functions: the
input readers (`inputs.chunks`), the scan of a record (`scan.scan_record`), the length model
(`lengths.tokenize_chunk_samples`) and the bin-packing kernels with their item and image caps
(`binpack.pack_bins`); a bin is built by the writer's own `write.assemble_bin`. With a buffer that holds the
whole input, the bins are those `mmpack pack` writes with the same options.

A buffer is a run of consecutive input records (the offline job's record order) of at most `buffer_size`
records: the input is cut into chunks of `buffer_size` records (`plan_chunks`, per file), and consecutive
chunks are grouped while they fit. The loader takes a `RawSource` as an object that meets
`mmpack.dataloader.raw_source.RawBins` (`build_loader(raw_source(...), ...)`): the loader's layer does not import
the offline job, the offline job hands it its source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmpack.offline_packing.binpack import pack_bins
from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.errors import PackError, SampleReject, reject_row
from mmpack.offline_packing.finalize import build_manifest
from mmpack.offline_packing.fingerprint import digest, identities
from mmpack.offline_packing.inputs.chunks import Chunk, plan_chunks, read_chunk
from mmpack.offline_packing.inputs.sources import expand_inputs, input_folder
from mmpack.offline_packing.lengths import tokenize_chunk_samples
from mmpack.offline_packing.model_folder import resolve_chat_template, resolve_image_rule, resolve_video_rule
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.scan import image_check_of, scan_record
from mmpack.offline_packing.write import assemble_bin
from mmpack.packing.manifest import Manifest, ManifestCounts
from mmpack.packing.processes import is_running
from mmpack.packing.tokenizer import tokenizer_files

# The output of the job config: online packing writes no dataset (the config requires the field).
NO_OUTPUT = "<online>"


@dataclass(frozen=True)
class PackedBuffer:
    """The bins of one packing buffer: each bin's samples (indices into the buffer's kept samples), their
    tokens and metadata rows, and the buffer's rejects (the offline job's reject rows)."""

    buffer: int
    bins: tuple[np.ndarray, ...]
    input_ids: tuple[np.ndarray, ...]
    loss_masks: tuple[np.ndarray, ...]
    metas: tuple[dict, ...]
    rejects: tuple[dict, ...]
    samples_read: int
    context: JobContext = field(repr=False)
    packed_by: int = 0  # the id of the process that counted and packed it (its plan may come from a cache)

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    @property
    def tokens(self) -> int:
        return int(sum(len(x) for x in self.input_ids))

    def record(self, j: int) -> dict[str, Any]:
        """Bin j as the loader's `BinRecord` (the fields a shard reader returns)."""
        samples = [(self.input_ids[i], self.loss_masks[i], self.metas[i]) for i in self.bins[j].tolist()]
        packed = assemble_bin(f"raw-{self.buffer:06d}-{j:06d}", samples, self.context.remote)
        return {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}

    def bin_features(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq_lens, image grids, video grids) of bin j, for the cost model (nothing read from disk)."""
        members = self.bins[j].tolist()
        lens = np.asarray([len(self.input_ids[i]) for i in members], dtype=np.int64)
        grids = [g for i in members for g in self.metas[i]["grid"]]
        videos = [p["grid_thw"] for i in members for p in self.metas[i].get("video_plans", ())]
        as3 = lambda x: np.asarray(x, dtype=np.int64).reshape(-1, 3)  # noqa: E731
        return lens, as3(grids), as3(videos)


@dataclass(frozen=True)
class RawSource:
    """Raw records, the job config that counts and packs them, and their cut into packing buffers
    (picklable: it travels to the loader's workers, whose job context fills its own caches)."""

    config: PackJobConfig
    buffer_size: int
    files: tuple[str, ...]
    chunks: tuple[Chunk, ...]
    buffers: tuple[tuple[int, int], ...]  # [first chunk, end chunk) of each buffer
    dataset: Manifest  # the rules the bins are packed by (no shards): what the loader's collation reads
    fingerprint: str
    name: str
    context: JobContext = field(repr=False)
    cache: str | None = None  # the packing cache folder (`packing_cache`), None: every process packs
    claim_timeout: float = 600.0  # seconds after which a claim of a live-looking process is taken over
    # --split's part read (`dataloader.order.BinSplit`: weights, part, seed), None: every record
    split: Any = None

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    def split_records(self, split: Any) -> RawSource:
        """This source restricted to the records of one part of --split (`split`: weights, part and seed, as
        `mmpack.dataloader.order.BinSplit`): each record's part is `record_parts`' (a seeded hash of its file
        and index), so the parts are disjoint and together every record; the buffers stay the same runs of
        records, each packing only its part's. A part with no record is refused."""
        if self.split is not None:
            raise ValueError(f"raw source {self.name} is already split ({self.split.describe()})")
        names = record_keys(self.files)
        counts = np.zeros(len(split.weights), dtype=np.int64)
        for chunk in self.chunks:
            parts = record_parts(
                names[chunk.source_index], chunk.start, chunk.count, split.weights, split.seed
            )
            counts += np.bincount(parts, minlength=len(counts))
        if counts[split.part] == 0:
            raise ValueError(
                f"raw source {self.name}: --split {split.describe()} leaves no record in that part (records per "
                f"part: {','.join(map(str, counts.tolist()))}): give it more weight or more records"
            )
        fingerprint = digest(self.fingerprint, "split", list(split.weights), split.part, split.seed)
        return dataclasses.replace(self, split=split, fingerprint=fingerprint)

    def pack_buffer(self, buffer: int) -> PackedBuffer:
        """Buffer `buffer` read, scanned, counted and packed (a pure function of the records and the config);
        with a packing cache, packed once by the first process to claim it and read by the others."""
        if not 0 <= buffer < self.num_buffers:
            raise IndexError(f"{self.name}: buffer {buffer} of {self.num_buffers}")
        if self.cache is None:
            return self._pack(buffer)
        return PackingCache(os.path.join(self.cache, self.fingerprint), self.claim_timeout).get(
            buffer, self._pack, self.context
        )

    def _pack(self, buffer: int) -> PackedBuffer:
        cfg, ctx = self.config, self.context
        rejects: list[dict] = []
        read = [0]
        first, end = self.buffers[buffer]
        scanned = self._scanned(self.chunks[first:end], rejects, read)
        lengths_cfg = cfg.stage_config("lengths")
        ids, masks, metas = [], [], []
        for sample, result in tokenize_chunk_samples(
            scanned, lengths_cfg, ctx.tokenizer(cfg.tokenizer, cfg.lengths.control_tokens), ctx.remote
        ):
            if isinstance(result, SampleReject):
                self._reject(rejects, sample["src"], sample["line"], result, "lengths", sample["id"])
                continue
            tok, meta = result
            ids.append(np.asarray(tok.input_ids))
            masks.append(np.asarray(tok.loss_mask))
            metas.append(meta)
        lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        nimg = np.asarray([len(m["images"]) for m in metas], dtype=np.int64)
        bins, _ = pack_bins(lengths, nimg, cfg.stage_config("binpack"))
        return PackedBuffer(
            buffer=buffer,
            bins=tuple(bins),
            input_ids=tuple(ids),
            loss_masks=tuple(masks),
            metas=tuple(metas),
            rejects=tuple(rejects),
            samples_read=read[0],
            context=ctx,
            packed_by=os.getpid(),
        )

    def _scanned(self, chunks: tuple[Chunk, ...], rejects: list[dict], read: list[int]) -> Iterator[dict]:
        """The scan's rows of the chunks' records, in order (stage 1 of the offline job, record by record)."""
        options, split = self.config.scan, self.split
        check = image_check_of(options)
        names = record_keys(self.files) if split is not None else ()
        for chunk in chunks:
            image_root = options.image_root or input_folder(chunk.path)
            mine = None
            if split is not None:
                parts = record_parts(
                    names[chunk.source_index], chunk.start, chunk.count, split.weights, split.seed
                )
                mine = parts == split.part
            for i, rec in enumerate(read_chunk(self.context, chunk, options.max_record_bytes)):
                if mine is not None and not mine[i]:  # another --split part's record
                    continue
                read[0] += 1
                try:
                    yield scan_record(self.context.remote, rec, chunk.path, image_root, check)
                except SampleReject as exc:
                    self._reject(rejects, chunk.path, rec.line, exc, "scan")

    def _reject(
        self, rejects: list[dict], src: str, line: int, exc: SampleReject, stage: str, sample_id: Any = None
    ) -> None:
        if self.config.strict:
            raise PackError(f"{src}:{line}: {exc.reason}: {exc.message}") from None
        rejects.append(reject_row(src, line, exc.reason, exc.message, stage, sample_id))


def record_keys(files: tuple[str, ...] | list[str]) -> list[str]:
    """Each input file's name in the --split rule: its path below the folder all the files share (so the same
    records moved or mounted elsewhere split alike)."""
    parts = [f.split("/") for f in files]
    shared = 0  # leading folders every path has (a file's own name is always kept)
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    return ["/".join(p[shared:]) for p in parts]


def record_parts(key: str, start: int, count: int, weights: tuple[float, ...], seed: int) -> np.ndarray:
    """The --split part (0 train, 1 valid, 2 test) of records [start, start + count) of the input file named
    `key`: a seeded hash of (seed, key, record index) mapped to [0, 1) and cut by the normalised weights. A
    record's part depends on nothing else (not the buffer size, the other files or their order); the parts'
    sizes follow the weights on average (binomially), not exactly."""
    head = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    x = np.arange(start, start + count, dtype=np.uint64) ^ np.uint64(int.from_bytes(head, "little"))
    with np.errstate(over="ignore"):  # splitmix64's finaliser: arithmetic modulo 2**64
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) * 2.0**-53
    bounds = np.cumsum(np.asarray(weights, dtype=np.float64)) / float(sum(weights))
    return np.searchsorted(bounds[:-1], u, side="right").astype(np.int64)


class PackingCache:
    """Packed buffers of one source fingerprint in a folder shared by the processes of a node (or of a shared
    file system): `buffer-NNNNNN.plan`, written atomically by the process that claimed it first
    (`buffer-NNNNNN.claim`, created with O_EXCL, holding its host, pid and time); the others wait for the plan. A
    claim whose process is gone (same host) or older than `timeout` seconds is taken over."""

    POLL = 0.05

    def __init__(self, folder: str, timeout: float) -> None:
        self.folder, self.timeout = folder, timeout
        os.makedirs(folder, exist_ok=True)

    def get(self, buffer: int, pack: Any, context: JobContext) -> PackedBuffer:
        plan = os.path.join(self.folder, f"buffer-{buffer:06d}.plan")
        claim = plan[: -len(".plan")] + ".claim"
        while True:
            if os.path.exists(plan):
                return self._read(plan, context)
            try:
                fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._wait(plan, claim)
                continue
            mine = f"{socket.gethostname()} {os.getpid()} {time.time()}"
            try:
                os.write(fd, mine.encode())
                os.close(fd)
                if os.path.exists(plan):  # written between the look and the claim
                    return self._read(plan, context)
                packed = pack(buffer)
                body = {
                    f.name: getattr(packed, f.name) for f in dataclasses.fields(packed) if f.name != "context"
                }
                tmp = f"{plan}.{socket.gethostname()}.{os.getpid()}.tmp"
                with open(tmp, "wb") as fh:
                    pickle.dump(body, fh, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, plan)
                return packed
            finally:
                _release(claim, mine)

    def _read(self, plan: str, context: JobContext) -> PackedBuffer:
        with open(plan, "rb") as fh:  # written by this package into its own cache folder
            return PackedBuffer(**pickle.load(fh), context=context)

    def _wait(self, plan: str, claim: str) -> None:
        """Until the plan is written or the claim is gone or stale (then it is moved aside, by one waiter)."""
        while not os.path.exists(plan):
            try:
                with open(claim) as fh:
                    host, pid, _ = fh.read().split()
                age = time.time() - os.path.getmtime(claim)
            except (FileNotFoundError, ValueError):
                if not os.path.exists(claim):
                    return
                time.sleep(self.POLL)  # being written
                continue
            dead = host == socket.gethostname() and not is_running(int(pid))
            if dead or age > self.timeout:
                try:  # one waiter moves the stale claim aside; the others find it gone
                    stale = f"{claim}.stale.{socket.gethostname()}.{os.getpid()}"
                    os.rename(claim, stale)
                    os.unlink(stale)
                except FileNotFoundError:
                    pass
                return
            time.sleep(self.POLL)


def _release(claim: str, mine: str) -> None:
    """Removes the claim if it is still this process's (one taken over as stale is another's now)."""
    try:
        with open(claim) as fh:
            if fh.read() == mine:
                os.unlink(claim)
    except FileNotFoundError:
        pass


def open_raw_source(config: PackJobConfig, buffer_size: int, packing_cache: str | None = None) -> RawSource:
    """The raw source of a job config's inputs (its output is not written), cut into buffers of at most
    `buffer_size` records; `packing_cache`: a folder where each buffer is packed once for all processes."""
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"packing buffer size must be a whole number of samples >= 1, got {buffer_size!r}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = JobContext(work_dir="", storage_options=config.control.storage_options)
    files = expand_inputs(ctx.remote, config.inputs)
    if not files:
        raise FileNotFoundError(f"raw source {' '.join(config.inputs)}: no input files (.jsonl, .json, ...)")
    chunks = plan_chunks(ctx, files, buffer_size, config.scan.max_record_bytes)
    buffers: list[tuple[int, int]] = []
    held = 0  # records of the last buffer
    for i, chunk in enumerate(chunks):  # consecutive chunks share a buffer while they fit
        if buffers and held + chunk.count <= buffer_size:
            buffers[-1], held = (buffers[-1][0], i + 1), held + chunk.count
        else:
            buffers.append((i, i + 1))
            held = chunk.count
    # loaded once here: workers forked from this process inherit it
    ctx.tokenizer(config.tokenizer, config.lengths.control_tokens)
    algorithm = config.binpack.algorithm
    counts = ManifestCounts(
        samples_read=0,
        samples_packed=0,
        samples_rejected=0,
        rejected_by_reason={},
        bins=0,
        tokens=0,
        image_tokens=0,
    )
    dataset = build_manifest(ctx, config, counts, [], algorithm=algorithm)
    read = identities(ctx.remote, [*files, *tokenizer_files(config.tokenizer)], config.verify_inputs)
    stages = [dataclasses.asdict(config.stage_config(s)) for s in ("scan", "lengths", "binpack")]
    fingerprint = digest("online", stages, read, buffer_size)
    return RawSource(
        config=config,
        buffer_size=buffer_size,
        files=tuple(files),
        chunks=tuple(chunks),
        buffers=tuple(buffers),
        dataset=dataset,
        fingerprint=fingerprint,
        name=os.path.basename(files[0].rstrip("/")) if len(files) == 1 else f"{len(files)} raw files",
        context=ctx,
        cache=os.path.abspath(packing_cache) if packing_cache else None,
    )


def raw_source(
    inputs: str | list[str] | tuple[str, ...],
    *,
    buffer_size: int,
    seq_len: int,
    model: str | None = None,
    tokenizer: str | None = None,
    image_root: str | None = None,
    packing_cache: str | None = None,
    **options: Any,
) -> RawSource:
    """Raw records (files, folders or globs, as `mmpack pack -i` takes them) packed online into bins of
    `seq_len` tokens, `buffer_size` records at a time, by the length model of the model folder `model` (its
    tokenizer, image and video rules, chat template, as `mmpack pack --model`) or of `tokenizer` alone;
    `packing_cache`: a folder shared by the loader's processes where each buffer is packed once (kept under
    a subfolder per source fingerprint); `options`: other packing options by their `mmpack pack` names
    (`max_images_per_bin`, `seed`, ...)."""
    named = tokenizer if tokenizer is None or not os.path.exists(tokenizer) else os.path.abspath(tokenizer)
    model = os.path.abspath(model) if model else None
    found, image_rule = resolve_image_rule(model, named, {})
    video_rule = resolve_video_rule(model, named, {}, image_rule)
    chat = resolve_chat_template(model, named, None)
    config = job_config(
        inputs=(inputs,) if isinstance(inputs, str) else tuple(inputs),
        output=NO_OUTPUT,
        seq_len=seq_len,
        tokenizer=found or "",
        image_rule=image_rule,
        video_rule=video_rule,
        image_root=image_root,
        progress=False,
        **chat,
        **options,
    )
    return open_raw_source(config, buffer_size, packing_cache)
