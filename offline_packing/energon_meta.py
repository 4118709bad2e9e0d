"""`--energon`: the `.nv-meta` folder Megatron-Energon needs to read the WebDataset shards.

Runs Energon's own preparation (the same code as `energon prepare`: tar index in index.sqlite, sample
counts in .info.json, split.yaml with every shard in "train") and writes a dataset.yaml that loads each bin
as a crude sample (a dict of its members, for a Cooker in the user's TaskEncoder). The random dataset
UUID Energon writes is replaced by one derived from the shard hashes, so reruns stay reproducible.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from pathlib import Path

DATASET_YAML = """\
__module__: megatron.energon
__class__: CrudeWebdataset
subflavors:
  mmpack_packed: true
"""


def write_energon_metadata(out_dir: Path, wds_shards: list[dict], workers: int = 1) -> Path:
    """Write `<out_dir>/.nv-meta` for the tar shards listed in `wds_shards` (manifest entries)."""
    from megatron.energon.flavors.webdataset.config import INDEX_UUID_FILENAME, MAIN_FOLDER_NAME
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    paths = [e["path"] for e in wds_shards]
    if not paths:
        raise ValueError("--energon: the dataset has no WebDataset shards")
    with contextlib.redirect_stdout(io.StringIO()):  # energon prints progress lines to stdout
        WebdatasetPreparator.prepare_dataset(
            Path(out_dir),
            paths,
            split_parts_ratio=[("train", 1.0)],
            shuffle_seed=None,
            workers=max(1, workers),
        )
    meta = Path(out_dir) / MAIN_FOLDER_NAME
    (meta / "dataset.yaml").write_text(DATASET_YAML)
    digest = "".join(e["sha256"] for e in wds_shards)
    (meta / INDEX_UUID_FILENAME).write_text(str(uuid.uuid5(uuid.NAMESPACE_URL, digest)))
    return meta
