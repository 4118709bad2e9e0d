"""The Megatron-Energon sample type of mmpack packed bins (needs `megatron-energon`; imported on demand).

`--energon` datasets declare `PackedBinSample` in `.nv-meta/dataset.yaml`, so Energon yields one per bin::

    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    ds = get_train_dataset(path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None)
    for sample in get_loader(ds): ...   # sample.input_ids, sample.seq_lens, sample.images, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from megatron.energon import Sample


@dataclass
class PackedBinSample(Sample):
    """One packed bin as Energon yields it (images as decoded by Energon's default decoder)."""

    input_ids: np.ndarray  # uint32 [n_tokens]
    loss_mask: np.ndarray  # uint8 [n_tokens]
    seq_lens: np.ndarray  # int32 [n_samples]
    sample_ids: list[str]
    image_formats: list[str]
    image_grid_thw: np.ndarray  # int32 [n_images, 3]
    images: list[Any]
    # videos (format version 3): as Energon's decoder yields the stored files, with the mmpack plan of each
    videos: list[Any] = field(default_factory=list)
    video_formats: list[str] = field(default_factory=list)
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))
    video_plans: list[dict] = field(default_factory=list)  # mmpack.packing.video_tokens.VideoPlan.to_dict()
