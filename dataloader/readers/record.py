"""The record both shard readers return for one bin."""

from __future__ import annotations

from typing import Any

# key, input_ids (uint32), loss_mask (uint8), seq_lens (int32), sample_ids (list[str]), images (list[bytes]),
# image_formats (list[str]), image_grid_thw (int32 [n, 3])
BinRecord = dict[str, Any]
