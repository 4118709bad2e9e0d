"""mmpack dataloader: packed shards from disk, S3 or HTTP to every DP/TP/PP rank, deterministic and resumable.

`build_loader(...)` is the entry point; `bin_order` and `micro_batch_bins` are the single place where the
global order and the rank assignment are decided. Typical use on one rank::

    loader = build_loader("s3://bucket/packed", topology=Topology.from_megatron(), micro_batch_size=2,
                          global_batch_size=64, cache_dir="/local/cache", cache_limit_bytes=50 << 30)
    loader.load_state_dict(checkpoint["loader"])      # optional: continue exactly (any DP size)
    it = iter(loader)
    for step in range(train_iters):
        for _ in range(loader.micro_batches_per_step):
            batch = next(it)                          # a MicroBatch of tensors (mmpack.packing.batch)
        checkpoint["loader"] = loader.state_dict()    # between steps
        log(loader.metrics())                         # data_wait_s, bytes_read, cache_hits, ...
"""

from mmpack.dataloader.loader import LoaderConfig, PackedLoader, build_loader
from mmpack.dataloader.manifest import Manifest, ShardInfo, load_manifest
from mmpack.dataloader.order import BatchPlan, StreamOrder, bin_order, bins_for, micro_batch_bins
from mmpack.dataloader.storage import ShardError, ShardStore, StorageConfig
from mmpack.dataloader.topology import Topology

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
