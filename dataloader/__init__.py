"""mmpack dataloader: packed shards from disk, S3 or HTTP to every DP/TP/PP rank, deterministic and resumable.

`build_loader(...)` is the entry point; `bin_order` and `micro_batch_bins` are the single place where the
global order and the rank assignment are decided.
"""

from dataloader.loader import LoaderConfig, PackedLoader, build_loader
from dataloader.manifest import Manifest, ShardInfo, load_manifest
from dataloader.order import BatchPlan, StreamOrder, bin_order, bins_for, micro_batch_bins
from dataloader.storage import ShardError, ShardStore, StorageConfig
from dataloader.topology import Topology

__all__ = [
    "BatchPlan",
    "LoaderConfig",
    "Manifest",
    "PackedLoader",
    "ShardError",
    "ShardInfo",
    "ShardStore",
    "StorageConfig",
    "StreamOrder",
    "Topology",
    "bin_order",
    "bins_for",
    "build_loader",
    "load_manifest",
    "micro_batch_bins",
]
