"""Does an exported HF folder compute what the trainer's checkpoint computes? The logits of one packed sample
(with its images, as the loader gives them) from the checkpoint loaded at TP1 x PP1 in megatron-core, and from
the `mmpack convert mcore-to-hf` export loaded in transformers, compared element by element."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mmpack.trainer.batches import block_causal_mask
from mmpack.trainer.convert import load_tp1_model
from mmpack.trainer.cpu_backend import require_backend


@dataclass(frozen=True)
class Sample:
    """One sample of a packed bin with the pixel rows and grids of its images."""

    tokens: torch.Tensor  # [L] int64
    pixel_values: torch.Tensor | None  # [P, C*T*p*p]
    image_grid_thw: torch.Tensor | None  # [n, 3]
    image_pad_id: int


def first_image_sample(data_path: str) -> Sample:
    """The first sample of the dataset's first bin that holds images and no videos (the loader's tokens and
    pixels); ValueError when the first bin has none."""
    from mmpack.dataloader import Topology, build_loader, load_manifest

    manifest = load_manifest(data_path)
    loader = build_loader(
        data_path, topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    tokens, grids = batch.tokens[0], batch.image_grid_thw
    image_pad, video_pad = manifest.image_pad_id, manifest.video_pad_id
    merge = manifest.merge_size**2
    cu = batch.cu_seqlens.tolist()
    image, row = 0, 0  # next image of the bin and its first pixel row
    for a, b in itertools.pairwise(cu):
        if b > int(batch.num_real_tokens):
            break
        seg = tokens[a:b]
        first_image, first_row = image, row
        pads = int((seg == image_pad).sum())
        while pads > 0:
            pads -= int(grids[image].prod()) // merge
            row += int(grids[image].prod())
            image += 1
        if image > first_image and (video_pad < 0 or not bool((seg == video_pad).any())):
            return Sample(
                tokens=seg.long(), pixel_values=batch.pixel_values[first_row:row],
                image_grid_thw=grids[first_image:image], image_pad_id=image_pad,
            )  # fmt: skip
    raise ValueError(f"the first bin of {data_path} has no sample with images (and no videos)")


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """This process as a one-rank gloo group (on the CPU backend without CUDA, which the caller's entry point set
    up: `cpu_backend.activate`); on leaving, megatron-core's parallel state (set up inside) and the group are
    torn down."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    require_backend("one_rank_group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def mcore_logits(ckpt: str, sample: Sample) -> torch.Tensor:
    """[L, V] logits of ``sample`` from the checkpoint's latest iteration at TP1 x PP1 (one gloo process: this
    one, see :func:`one_rank_group`)."""
    with one_rank_group():
        fam, arch, model, _ = load_tp1_model(ckpt)
        model.eval()
        tokens = sample.tokens[None]
        n = tokens.shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32)
        grid_thw = sample.image_grid_thw
        grids = grid_thw.numpy().astype("int64") if grid_thw is not None else np.zeros((0, 3), dtype=np.int64)
        rule = fam.position_rule(arch)
        positions = torch.from_numpy(rule.positions(tokens[0].numpy(), np.array([n]), grids)).reshape(3, 1, n)
        patches = rule.patch_positions(grids)
        extra = {} if patches is None else {"patch_positions": torch.from_numpy(patches)}
        with torch.no_grad():
            logits = model(
                tokens, positions, block_causal_mask(cu, 1, n), labels=None,
                pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw, **extra,
            )  # fmt: skip
        return logits[0].float()


def hf_logits(hf_dir: str, sample: Sample) -> torch.Tensor:
    """[L, V] logits of ``sample`` from the HF folder loaded by transformers (its image-text-to-text class)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    ids = sample.tokens[None]
    with torch.no_grad():
        out = model(
            input_ids=ids, mm_token_type_ids=(ids == sample.image_pad_id).int(),
            pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
        )  # fmt: skip
    return out.logits[0].float()
