"""The MoE routers' load-balancing loss in the run's metrics (``--moe-per-layer-logging``), against the
switch-transformer loss computed here from each router's own inputs.

One launch, TP2 with sequence parallelism on two CPU ranks (each rank routes half of every micro-batch's
tokens, so the logged value is the sum of two partial losses), a tiny random Qwen3-VL-MoE (4 experts, 2 per
token), synthetic packed batches, 2 micro-batches per step. A forward pre-hook on every router saves the hidden
states it routes; the reference loss of a layer is E x sum_i f_i P_i over the micro-batch's whole sequence
(f_i: the fraction of the top-k slots that go to expert i, P_i: the mean softmax probability of expert i),
averaged over the micro-batches, as Megatron-LM logs it. Control: the same formula on one rank's half of the
tokens gives another value.

This file is also the torchrun worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.hf_parity import torchrun

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.slow]

NUM_EXPERTS, TOP_K = 4, 2
ARGS = [
    "--mock-data", "--model-type", "qwen3_vl_moe", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--vision-num-layers", "1",
    "--vision-hidden-size", "32", "--vision-num-attention-heads", "2", "--num-experts", str(NUM_EXPERTS),
    "--moe-router-topk", str(TOP_K), "--moe-aux-loss-coeff", "0.01", "--moe-per-layer-logging",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "64",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
    "--log-interval", "1", "--num-workers", "0",
]  # fmt: skip


def _worker(out_dir: str, argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    routed: dict[int, list[torch.Tensor]] = {}
    weights: dict[int, torch.Tensor] = {}
    for module in trainer.model.module.modules():
        if isinstance(module, TopKRouter):
            layer = int(module.layer_number)
            weights[layer] = module.weight.detach().clone()

            def save(_mod: torch.nn.Module, inputs: tuple, layer: int = layer) -> None:
                routed.setdefault(layer, []).append(
                    inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone()
                )

            module.register_forward_pre_hook(save)
    metrics = trainer.train_step()
    trainer.log_metrics(metrics)
    record = {"routed": routed, "weights": weights, "metrics": metrics}
    torch.save(record, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    trainer.close()
    shutdown()


def _switch_loss(hidden, weight):  # type: ignore[no-untyped-def]
    import torch

    scores = torch.softmax((hidden.float() @ weight.float().T), dim=-1)
    chosen = torch.topk(scores, TOP_K, dim=-1).indices
    counts = torch.zeros(NUM_EXPERTS).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
    f = counts / (hidden.shape[0] * TOP_K)
    return float(NUM_EXPERTS * (f * scores.mean(dim=0)).sum())


def test_per_layer_load_balancing_loss_is_the_routers(tmp_path: Path) -> None:
    import torch

    proc = torchrun(2, [str(Path(__file__)), str(tmp_path), *ARGS], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    metrics = ranks[0]["metrics"]
    logged = metrics["moe_load_balancing_loss_layers"]
    assert ranks[1]["metrics"]["moe_load_balancing_loss_layers"] == logged  # reduced: every rank has it
    assert len(logged) == 2 and sorted(ranks[0]["routed"]) == [1, 2]
    expected, halves = [], []
    for layer in (1, 2):
        assert torch.equal(ranks[0]["weights"][layer], ranks[1]["weights"][layer])  # the router is not cut
        micro = list(zip(ranks[0]["routed"][layer], ranks[1]["routed"][layer], strict=True))
        assert len(micro) == 2  # two micro-batches, each split over the two ranks by sequence parallelism
        weight = ranks[0]["weights"][layer]
        expected.append(sum(_switch_loss(torch.cat([a, b]), weight) for a, b in micro) / len(micro))
        halves.append(sum(_switch_loss(a, weight) for a, _ in micro) / len(micro))
    assert logged == pytest.approx(expected, rel=1e-5)
    assert metrics["moe_load_balancing_loss"] == pytest.approx(sum(expected) / 2, rel=1e-5)
    assert all(abs(h - e) > 1e-3 * e for h, e in zip(halves, expected))  # control: one rank's tokens differ
    assert "load-balancing loss:" in proc.stdout


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
