"""Real torch.distributed (gloo) processes: ranks from megatron-core's parallel_state feed the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmpack.dataloader import bin_order, load_manifest
from mmpack.demo.synthetic import build_packed_dataset
from tests.support import ranks

pytestmark = [pytest.mark.ranks]

TP, PP, DP = 2, 2, 2
GLOBAL_BATCH, MICRO = 4, 1


def rank_main(rank: int, world: int, port: int, dataset: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.dataloader import Topology, build_loader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
        topo = Topology.from_megatron()
        ld = build_loader(
            dataset,
            topology=topo,
            micro_batch_size=MICRO,
            global_batch_size=GLOBAL_BATCH,
            num_workers=0,
            num_epochs=1,
        )
        steps: list[list[list[int]]] = []
        for i, batch in enumerate(ld):
            if i % ld.micro_batches_per_step == 0:
                steps.append([])
                # One collective per step over the whole world: a rank short of data would hang here.
                dist.all_reduce(torch.ones(1))
            steps[-1].append([] if batch is None else batch.bin_ids.tolist())
        dist.barrier()
        record = {"rank": rank, "topology": topo.__dict__, "steps": steps, "state": ld.state_dict()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_ranks_split_the_epoch(tmp_path: Path) -> None:
    dataset = build_packed_dataset(tmp_path / "data", fmt="arrow")
    world = TP * PP * DP
    ctx = ranks.context()  # the fork server of the whole pytest run (torch, megatron-core, the loader loaded)
    port = ranks.free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, str(dataset), str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ranks.join_or_kill(procs, timeout_s=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    m = load_manifest(str(dataset))
    steps = m.num_bins // GLOBAL_BATCH
    per_dp: dict[int, list] = {}
    seen_coords = set()
    for rec in records:
        t = rec["topology"]
        seen_coords.add((t["dp_rank"], t["tp_rank"], t["pp_rank"]))
        assert (t["dp_size"], t["tp_size"], t["pp_size"]) == (DP, TP, PP)
        assert len(rec["steps"]) == steps
        assert all(len(s) == GLOBAL_BATCH // (MICRO * DP) for s in rec["steps"])
        assert rec["state"]["bins_consumed"] == steps * GLOBAL_BATCH
        # Every TP rank and both pipeline stages (first and last here) of a DP rank see the same bins.
        per_dp.setdefault(t["dp_rank"], rec["steps"])
        assert rec["steps"] == per_dp[t["dp_rank"]]
    assert len(seen_coords) == world
    flat = [b for d in range(DP) for step in per_dp[d] for mb in step for b in mb]
    assert len(flat) == len(set(flat)) == steps * GLOBAL_BATCH
    assert set(flat) == set(bin_order(m, 0, 0)[: steps * GLOBAL_BATCH].tolist())
