"""`--energon`: the `.nv-meta` folder Megatron-Energon needs to read the WebDataset shards.

Runs Energon's own preparation (the same code as `energon prepare`: tar index in index.sqlite, sample
counts in .info.json, split.yaml with every shard in "train") and writes a dataset.yaml declaring the
sample type `mmpack.offline_packing.outputs.energon_sample.PackedBinSample`, filled by a small sample_loader.py (the
`energon prepare --sample-type ... ` + sample-loader route), so `energon info`, `energon preview` and
`get_train_dataset(path, ...)` work with Energon's default task encoder. The random dataset UUID Energon
writes is replaced by one derived from the shard hashes, so reruns stay reproducible.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from pathlib import Path

from mmpack.offline_packing.engines.workers import capped_workers
from mmpack.offline_packing.errors import PackError
from mmpack.packing.processes import call_tied

DATASET_YAML = """\
sample_type:
  __module__: mmpack.offline_packing.outputs.energon_sample
  __class__: PackedBinSample
sample_loader: sample_loader.py:sample_loader
part_filter: sample_loader.py:part_filter
"""

SAMPLE_LOADER_PY = '''"""Energon sample loader of an mmpack packed dataset: members of one bin -> PackedBinSample fields."""


def sample_loader(raw: dict) -> dict:
    meta = raw["json"]
    return dict(
        input_ids=raw["input_ids.npy"],
        loss_mask=raw["loss_mask.npy"],
        seq_lens=raw["seq_lens.npy"],
        image_grid_thw=raw["image_grid_thw.npy"].reshape(-1, 3),
        sample_ids=list(meta["sample_ids"]),
        image_formats=list(meta["image_formats"]),
        images=[raw[f"img{i}.{fmt}"] for i, fmt in enumerate(meta["image_formats"])],
        **_videos(raw, meta),
    )


def _videos(raw: dict, meta: dict) -> dict:
    if not meta.get("n_videos"):
        return {}
    return dict(
        videos=[raw[f"vid{i}.{fmt}"] for i, fmt in enumerate(meta["video_formats"])],
        video_formats=list(meta["video_formats"]),
        video_grid_thw=raw["video_grid_thw.npy"].reshape(-1, 3),
        video_plans=list(meta["video_plans"]),
    )


def part_filter(part: str) -> bool:
    return True
'''


def require_energon() -> None:
    """Raises PackError with the install line when Megatron-Energon (the `energon` extra) is missing."""
    try:
        import megatron.energon  # noqa: F401
    except ImportError:
        raise PackError(
            '--energon needs Megatron-Energon, which is not installed: pip install -e ".[energon]" '
            "(or pip install megatron-energon), or leave out --energon"
        ) from None


def write_energon_metadata(out_dir: Path, wds_shards: list[dict], workers: int = 1) -> Path:
    """Write `<out_dir>/.nv-meta` for the tar shards listed in `wds_shards` (manifest entries), with at most
    `workers` processes, one per CPU and one per shard. Energon's preparation runs in a process of its own
    (`call_tied`), so the processes Energon forks end with this one, however it ends."""
    from megatron.energon.flavors.webdataset.config import INDEX_UUID_FILENAME, MAIN_FOLDER_NAME

    paths = [e["path"] for e in wds_shards]
    if not paths:
        raise ValueError("--energon: the dataset has no WebDataset shards")
    # Energon forks as many processes as it is given
    call_tied(_prepare, Path(out_dir), paths, capped_workers(workers, len(paths)), what="--energon metadata")
    meta = Path(out_dir) / MAIN_FOLDER_NAME
    (meta / "dataset.yaml").write_text(DATASET_YAML)
    (meta / "sample_loader.py").write_text(SAMPLE_LOADER_PY)
    digest = "".join(e["sha256"] for e in wds_shards)
    (meta / INDEX_UUID_FILENAME).write_text(str(uuid.uuid5(uuid.NAMESPACE_URL, digest)))
    return meta


def _prepare(out_dir: Path, paths: list[str], workers: int) -> None:
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    with contextlib.redirect_stdout(io.StringIO()):  # energon prints progress lines to stdout
        WebdatasetPreparator.prepare_dataset(
            out_dir, paths, split_parts_ratio=[("train", 1.0)], shuffle_seed=None, workers=workers
        )
