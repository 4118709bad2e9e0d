"""Where the trainer's micro-batches come from: the packed-dataset loader, or synthetic packed bins."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mmpack.packing.batch import MicroBatch, PositionRule
from mmpack.packing.layout import IGNORE_INDEX
from mmpack.packing.tokenizer import ByteTokenizer
from mmpack.trainer.batches import SyntheticLoader, SyntheticSpec, block_causal_mask

if TYPE_CHECKING:
    from mmpack.dataloader.mixture import Mixture
    from mmpack.dataloader.raw_source import RawBins
    from mmpack.trainer.config import RunConfig

# --mock-data uses the ids of the byte-level fallback tokenizer: vocab_size and pad, vision_start, ... ids.
MOCK_VOCAB = {"vocab_size": ByteTokenizer.vocab_size, **ByteTokenizer().special_ids}


@dataclass(kw_only=True, frozen=True)
class DataInfo:
    """What the model needs to know about the data."""

    seq_length: int
    vocab_size: int
    pad_id: int
    image_pad_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int = 2  # frames per patch of --mock-data's pixels (the model's, see Trainer)
    video_pad_id: int = -1  # the dataset's <|video_pad|> id where it holds videos, else -1
    video_rule: str = ""  # the style of the video rule its videos were planned with, where it holds videos


class StepBatches:
    """Pulls the micro-batches of one step from a loader, timing how long the trainer waited for them."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.micro = loader.micro_batches_per_step
        self._it: Iterator[Any] | None = None

    def next_step(self) -> tuple[list[MicroBatch[torch.Tensor]], float]:
        """The next step's micro-batches and the seconds spent waiting for them."""
        if self._it is None:
            self._it = iter(self.loader)
        start = time.perf_counter()
        batches = [next(self._it) for _ in range(self.micro)]
        return batches, time.perf_counter() - start

    def close(self) -> None:
        """Stops the loader's worker processes."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        if hasattr(self.loader, "close"):
            self.loader.close()
        self._it = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def metrics(self) -> dict[str, float]:
        """The loader's counters (`PackedLoader.metrics`; none for synthetic batches)."""
        return dict(self.loader.metrics()) if hasattr(self.loader, "metrics") else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)


def open_raw_data(cfg: RunConfig) -> RawBins | Mixture:
    """The raw source of --online-packing: the records of --data-path, counted and packed by the offline job's
    own functions (`mmpack.offline_packing.online`, the one module of the offline job the trainer may import)
    with the tokenizer, rules and chat template of --hf-model's folder or --tokenizer-model; with --data-mixture,
    the mixture with each `kind: raw` source opened so (its own image_root and packing_buffer_size, else the
    flags')."""
    from mmpack.offline_packing.online import raw_source

    d = cfg.data

    def opened(inputs: str | tuple[str, ...], buffer_size: int, image_root: str | None, what: str) -> RawBins:
        try:
            return raw_source(
                inputs,
                buffer_size=buffer_size,
                seq_len=cfg.train.seq_length,
                model=cfg.model.hf_model,
                tokenizer=d.tokenizer_model,
                image_root=image_root,
                packing_cache=d.packing_cache or default_packing_cache(cfg.checkpoint.save),
            )
        except FileNotFoundError as e:  # a missing input or model folder: one line, not a traceback per rank
            raise ValueError(f"--online-packing {what}: {e}") from None

    if d.data_mixture is None:
        return opened(
            d.raw_inputs, d.packing_buffer_size, d.image_root, f"--data-path {' '.join(d.raw_inputs)}"
        )
    sources = tuple(
        dataclasses.replace(
            s,
            raw=opened(
                s.path,
                s.packing_buffer_size or d.packing_buffer_size,
                s.image_root or d.image_root,
                f"--data-mixture source {name!r}",
            ),
        )
        if s.kind == "raw"
        else s
        for s, name in zip(d.data_mixture.sources, d.data_mixture.names)
    )
    return dataclasses.replace(d.data_mixture, sources=sources)


def packed_sources(data: str | Mixture | None) -> str | Mixture | None:
    """One packed dataset, or a mixture's packed datasets (its `kind: raw` sources left out, None where it has no
    other; the raw ones are checked by the rules they pack by, `raw_sources`)."""
    if data is None or isinstance(data, str) or not data.raw_sources:
        return data
    packed = tuple(s for s in data.sources if s.kind != "raw")
    return dataclasses.replace(data, sources=packed) if packed else None


def raw_sources(data: RawBins | Mixture | None) -> list[RawBins]:
    """The raw sources of --online-packing's data (`open_raw_data`): one, or a mixture's opened `kind: raw` ones."""
    if data is None:
        return []
    if isinstance(getattr(data, "sources", None), tuple):
        return [s.raw for s in data.sources if s.raw is not None]  # type: ignore[union-attr]
    return [data]  # type: ignore[list-item]


def default_packing_cache(save: str | None) -> str:
    """Where --online-packing keeps each buffer's plan when --packing-cache is not given: `packing-cache` in the
    local --save folder (one per run, shared by its nodes when the folder is), else the user's cache,
    `$MMPACK_CACHE/packing` or `$XDG_CACHE_HOME/mmpack/packing` (`~/.cache/mmpack/packing`), where a rerun on
    the same records finds them packed. A folder only this user writes: plans are read back as Python objects."""
    if save and "://" not in save:
        return os.path.join(save, "packing-cache")
    root = os.environ.get("MMPACK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mmpack"
    )
    return os.path.join(root, "packing")


def dataset_info(data_path: str | Mixture | RawBins | None, seq_length: int) -> DataInfo:
    """Vocabulary, special ids and image geometry from the dataset manifest (or the mock defaults); of a
    mixture, from its sources' manifests once they are checked to mix (`mixture.check_sources`): the geometry
    of a source holding images or videos, the video rule of one holding videos; of a raw source, from the rules
    it packs by."""
    if not data_path:
        if seq_length <= 0:
            raise ValueError("--mock-data needs --seq-length")
        return DataInfo(
            seq_length=seq_length,
            vocab_size=MOCK_VOCAB["vocab_size"],
            pad_id=MOCK_VOCAB["pad"],
            image_pad_id=MOCK_VOCAB["image_pad"],
            vision_start_id=MOCK_VOCAB["vision_start"],
            vision_end_id=MOCK_VOCAB["vision_end"],
            patch_size=14,
            merge_size=2,
        )
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.manifest import Manifest
    from mmpack.dataloader.mixture import Mixture, check_sources, vision_source
    from mmpack.dataloader.raw_source import is_raw_source

    # resolves the S3 endpoint (AWS_ENDPOINT_URL) like the loader
    if is_raw_source(data_path):
        names, manifests = [data_path.name], [Manifest.from_model(data_path.dataset)]
    elif isinstance(data_path, str):
        names, manifests = [data_path], [load_manifest(data_path)]
    elif isinstance(data_path, Mixture):
        from mmpack.dataloader.raw_source import mixture_manifest

        names = list(data_path.names)
        manifests = [
            mixture_manifest(s.raw)  # packed whole, in one buffer, as the loader will
            if s.raw is not None
            else load_manifest(s.path, storage_options=s.storage_options)
            for s in data_path.sources
        ]
        check_sources(names, manifests)
    else:
        raise TypeError(f"no dataset, mixture or raw source: {data_path!r}")
    at = vision_source(manifests)
    manifest = manifests[at]
    with_videos = manifests[vision_source(manifests, videos=True)].dataset
    if seq_length and seq_length != manifest.seq_len:
        raise ValueError(f"--seq-length {seq_length} differs from the dataset's seq_len {manifest.seq_len}")
    vocab = int(manifest.raw.get("tokenizer", {}).get("vocab_size", 0))
    has_videos = with_videos.holds_videos
    video_rule = with_videos.video_rule
    if vocab <= 0:
        raise ValueError(f"manifest of {names[at]} has no tokenizer vocab_size")
    return DataInfo(
        seq_length=manifest.seq_len,
        vocab_size=vocab,
        pad_id=manifest.pad_id,
        image_pad_id=manifest.image_pad_id,
        vision_start_id=manifest.dataset.special_id("vision_start", -1),
        vision_end_id=manifest.dataset.special_id("vision_end", -1),
        patch_size=manifest.patch_size,
        merge_size=manifest.merge_size,
        video_pad_id=manifest.video_pad_id if has_videos else -1,
        video_rule=video_rule.style if has_videos and video_rule is not None else "",
    )


def build_step_batches(
    data_path: str | Mixture | RawBins | None,
    info: DataInfo,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    seed: int,
    num_workers: int = 2,
    cache_dir: str | None = None,
    balance: str = "none",
    cost_model: Any = None,
    position_rule: PositionRule | None = None,
    split: tuple[tuple[float, float, float], int, int] | None = None,
    strict_data: bool = False,
    rejects_dir: str | None = None,
) -> StepBatches:
    """The loader of this rank's DP replica (megatron-core parallel_state must be initialised); `balance`,
    `cost_model`, `position_rule` (the model's) and `split` (--split's weights, the part read: 0 train,
    1 valid, and the split's seed), `strict_data` and `rejects_dir` (a raw source's) as in
    `mmpack.dataloader.build_loader` (synthetic batches ignore all but the position rule)."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if not data_path:
        spec = SyntheticSpec(
            vocab_size=info.vocab_size,
            pad_id=info.pad_id,
            image_pad_id=info.image_pad_id,
            vision_start_id=MOCK_VOCAB["vision_start"],
            vision_end_id=MOCK_VOCAB["vision_end"],
            patch_size=info.patch_size,
            temporal_patch_size=info.temporal_patch_size,
            merge_size=info.merge_size,
        )
        synthetic = SyntheticLoader(
            spec,
            seq_length=info.seq_length,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            position_rule=position_rule,
        )
        return StepBatches(synthetic)
    from mmpack.dataloader import Topology, build_loader

    loader = build_loader(
        data_path,
        topology=Topology.from_megatron(),
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        seed=seed,
        num_workers=num_workers,
        cache_dir=cache_dir,
        balance=balance,
        cost_model=cost_model,
        position_rule=position_rule,
        split=split,
        strict_data=strict_data,
        rejects_dir=rejects_dir,
    )
    return StepBatches(loader)


def thd_length(num_tokens: int, multiple: int) -> int:
    """Length of a micro-batch flattened for THD: rounded up to ``multiple`` (the TP size under sequence
    parallelism, which cuts the flattened sequence into TP equal parts)."""
    return -(-num_tokens // multiple) * multiple


def pad_flat_batch(batch: MicroBatch[torch.Tensor], multiple: int, pad_id: int) -> MicroBatch[torch.Tensor]:
    """The micro-batch as one flattened row whose length divides by ``multiple``: the extra tokens form a
    dummy trailing segment (its own cu_seqlens entry, pad tokens, no loss, text positions from 0), as
    LLaVA-OneVision-2 pads THD batches for sequence parallelism."""
    tokens = batch.tokens
    pad = thd_length(tokens.numel(), multiple) - tokens.numel()
    if pad == 0:
        return batch

    def padded(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([x.reshape(1, -1), x.new_full((1, pad), value)], dim=1)

    positions = batch.position_ids
    axes = positions.shape[:-2]  # (3,) for M-RoPE, () for 1-D positions
    flat = positions.reshape(*axes, 1, -1)
    tail = torch.arange(pad, dtype=positions.dtype, device=positions.device).expand(*axes, 1, pad)
    cu = batch.cu_seqlens
    return dataclasses.replace(
        batch,
        tokens=padded(tokens, pad_id),
        labels=padded(batch.labels, IGNORE_INDEX),
        loss_mask=padded(batch.loss_mask, 0),
        position_ids=torch.cat([flat, tail], dim=-1),
        cu_seqlens=torch.cat([cu, cu[-1:] + pad]),
        max_seqlen=max(int(batch.max_seqlen), pad),
        attention_mask=None,
    )


def model_inputs(batch: MicroBatch[torch.Tensor], *, use_thd: bool) -> dict[str, Any]:
    """Model keyword arguments from a micro-batch: its M-RoPE positions (computed by the loader under the
    model's rule), the packed mask (dense on CPU, THD with TE)."""
    tokens = batch.tokens
    b, seq = tokens.shape
    positions = batch.position_ids
    if positions.dim() != 3:
        raise ValueError(
            f"the micro-batch has {positions.dim() - 1}-D positions; the model takes M-RoPE positions [3, B, L]: "
            "build the loader with the model's position rule (build_loader(position_rule=...))"
        )
    labels = batch.labels
    inputs: dict[str, Any] = {
        "tokens": tokens,
        "position_ids": positions,
        "labels": labels.masked_fill(labels == IGNORE_INDEX, 0),  # masked out by loss_mask
        "pixel_values": batch.pixel_values,
        "image_grid_thw": batch.image_grid_thw,
        "pixel_values_videos": batch.pixel_values_videos,
        "video_grid_thw": batch.video_grid_thw,
    }
    if batch.patch_positions is not None:  # the tower of a family whose rule gives them (LLaVA-OneVision-2)
        inputs["patch_positions"] = batch.patch_positions
    cu = batch.cu_seqlens.to(device=tokens.device, dtype=torch.int32)
    if use_thd:
        from megatron.core.packed_seq_params import PackedSeqParams

        max_len = int(batch.max_seqlen)
        inputs["attention_mask"] = None
        inputs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        # THD: the micro-batch is one flattened sequence; cu_seqlens already runs over the flattened batch
        for key in ("tokens", "labels"):
            inputs[key] = inputs[key].reshape(1, b * seq)
        inputs["position_ids"] = positions.reshape(3, 1, b * seq)
    else:
        mask = batch.attention_mask
        inputs["attention_mask"] = mask if mask is not None else block_causal_mask(cu, b, seq)
    return inputs
