"""Reading mmpack WebDataset shards with Megatron-Energon (needs `megatron-energon`; imported on demand).

`--energon` datasets declare `CrudeWebdataset` with subflavor `mmpack_packed: true`; Energon hands each bin
to a cooker as a dict of its decoded members. `cook_packed_bin` turns that dict into a `PackedBinSample`, and
`PackedBinTaskEncoder` registers it::

    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    ds = get_train_dataset(path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           task_encoder=PackedBinTaskEncoder())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless


@dataclass
class PackedBinSample(Sample):
    """One packed bin as Energon yields it (images as decoded by Energon's default decoder)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    seq_lens: np.ndarray
    sample_ids: list[str]
    image_formats: list[str]
    image_grid_thw: np.ndarray
    images: list[Any]


@stateless
def cook_packed_bin(sample: dict) -> PackedBinSample:
    """Crude Energon sample (member suffix -> decoded value) -> PackedBinSample."""
    meta = sample["json"]
    images = [sample[f"img{i}.{fmt}"] for i, fmt in enumerate(meta["image_formats"])]
    return PackedBinSample(
        **basic_sample_keys(sample),
        input_ids=np.asarray(sample["input_ids.npy"], dtype=np.uint32),
        loss_mask=np.asarray(sample["loss_mask.npy"], dtype=np.uint8),
        seq_lens=np.asarray(sample["seq_lens.npy"], dtype=np.int32),
        sample_ids=list(meta["sample_ids"]),
        image_formats=list(meta["image_formats"]),
        image_grid_thw=np.asarray(sample["image_grid_thw.npy"], dtype=np.int32).reshape(-1, 3),
        images=images,
    )


class PackedBinTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder that cooks mmpack bins (no batching beyond Energon's defaults)."""

    cookers = [Cooker(cook_packed_bin, has_subflavors={"mmpack_packed": True})]  # noqa: RUF012
