"""Per-token loss through megatron-core (``calculate_per_token_loss``): with micro-batches holding very
different numbers of target tokens, on two DP ranks, the step's gradients are those of (sum of all target
token losses of the global batch) / (their number), not of the mean of per-micro-batch means.

The check runs on two gloo ranks (``tests.support.ranks``; this file is also their entry point)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import ranks

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

RTOL = 1e-5


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.checkpoint import bare_module
    from mmpack.trainer.data import model_inputs
    from mmpack.trainer.training import Trainer, shutdown

    cfg = parse_args(
        ["--mock-data", "--seq-length", "96", "--global-batch-size", "4", "--num-workers", "0",
         "--num-layers", "2", "--vision-num-layers", "1", "--seed", "3"]
    )  # fmt: skip
    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    t = Trainer(cfg)
    batches, _ = t.train_data.next_step()
    # micro-batch 0 keeps all its target tokens, micro-batch 1 only its first one (DP rank 1: the reverse)
    few = 1 - ps.get_data_parallel_rank()
    mask = batches[few].loss_mask
    first = int(mask.reshape(-1).nonzero()[0])
    mask.zero_().reshape(-1)[first] = 1
    counts = [float(b.loss_mask.sum()) for b in batches]

    t.model.zero_grad_buffer()
    t.optimizer.zero_grad()
    losses = t._run_schedule(batches, forward_only=False)
    model = bare_module(t.model)
    params = [p for p in model.parameters() if p.requires_grad]
    megatron = torch.cat([p.main_grad.detach().reshape(-1).clone() for p in params])

    def local_sums() -> list[torch.Tensor]:
        """Summed target-token loss of each micro-batch (a fresh graph: megatron's cross entropy backward
        works in place)."""
        out = []
        for b in batches:
            inputs = model_inputs(b, use_thd=False)
            out.append((model(**inputs).float() * b.loss_mask).sum())
        return out

    def grads(loss: torch.Tensor) -> torch.Tensor:
        g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)])
        dist.all_reduce(g)
        return g

    total_tokens = torch.tensor(sum(counts), dtype=torch.float64)
    dist.all_reduce(total_tokens)
    sums = local_sums()
    reference = grads(torch.stack(sums).sum() / float(total_tokens))
    means = [s / c for s, c in zip(local_sums(), counts, strict=True)]
    control = grads(torch.stack(means).sum() / (len(means) * dist.get_world_size()))
    logged = sum(float(x["lm loss"][0]) for x in losses) / sum(float(x["lm loss"][1]) for x in losses)
    result = {
        "counts": counts,
        "max_rel_err": float((megatron - reference).abs().max() / reference.abs().max()),
        "control_rel_diff": float((control - reference).abs().max() / reference.abs().max()),
        "logged_local": logged,
        "reference_local": float(sum(s.detach() for s in sums)) / sum(counts),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    shutdown()


def test_per_token_loss_weighs_every_target_token_the_same(tmp_path: Path) -> None:
    ranks.checked(
        ranks.launch(2, [str(Path(__file__).resolve()), str(tmp_path)], tmp_path / "ranks", timeout_s=300)
    )
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert min(r["counts"]) == 1 and max(r["counts"]) >= 20, r  # very different micro-batches
        assert r["max_rel_err"] < RTOL, r
        assert r["control_rel_diff"] > 100 * RTOL, r  # averaging means would be told apart
        assert r["logged_local"] == pytest.approx(r["reference_local"], rel=1e-6)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
