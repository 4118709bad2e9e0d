"""Context parallelism end to end (fp32, CPU, gloo): one packed bin of a real image sample and a real video
sample (Qwen3 tokenizer, `mmpack pack`), a tiny random Qwen2.5-VL (`--hf-model`). At CP 2 and TP 2 x CP 2
the step's loss and every gradient equal those at CP 1 (same TP) within 1e-5, with the image and the video
tokens split over both CP ranks; control: the same CP 2 step with the two chunks of every sample's share
swapped on the rank (the layout the mask assumes no longer holds) changes the loss.

This file is also the torchrun worker script.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.family]

SWAPPED = "swapped"


def _swap_chunks(part):  # type: ignore[no-untyped-def]
    """The control's wrong layout: within each segment's share, the second chunk before the first."""
    import dataclasses

    import numpy as np

    cu = part.shard.local_cu_seqlens
    order = np.concatenate([np.roll(np.arange(a, b), -(b - a) // 2) for a, b in itertools.pairwise(cu)])
    return dataclasses.replace(
        part, tokens=part.tokens[order], labels=part.labels[order], loss_mask=part.loss_mask[order],
        position_ids=part.position_ids[..., order],
        shard=dataclasses.replace(part.shard, source=part.shard.source[order]),
    )  # fmt: skip


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss and this rank's gradients; at CP > 1 also the pad slots per rank and the control."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mmpack.trainer.context_parallel as tcp
    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    slots: list[tuple[int, int]] = []
    split = tcp.cp_micro_batch

    def recording(batch, cp, *, use_thd):  # type: ignore[no-untyped-def]
        inputs, mask = split(batch, cp, use_thd=use_thd)
        slots.append(tuple(0 if inputs[k] is None else len(inputs[k]) for k in ("image_rows", "video_rows")))
        return inputs, mask

    tcp_module = sys.modules["mmpack.trainer.training"]
    tcp_module.cp_micro_batch = recording  # type: ignore[attr-defined]
    batches, _ = trainer.train_data.next_step()

    def step(forward_only: bool) -> float:
        trainer.model.zero_grad_buffer()
        out = trainer._run_schedule(batches, forward_only=forward_only)
        t = torch.tensor([sum(float(x["lm loss"][i]) for x in out) for i in (0, 1)], dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
        return float(t[0] / t[1])

    result: dict = {"loss": step(forward_only=False)}
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.module.named_parameters()}
    result["slots"] = slots[:1]
    if ps.get_context_parallel_world_size() > 1:
        original = tcp.split_for_cp
        tcp.split_for_cp = lambda *a, **k: _swap_chunks(original(*a, **k))  # type: ignore[assignment]
        with torch.no_grad():
            result[SWAPPED] = step(forward_only=True)
        tcp.split_for_cp = original
    rank = dist.get_rank()
    torch.save(grads, Path(out_dir) / f"grads{rank}.pt")
    (Path(out_dir) / f"result{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


# -- the test side ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_bin(qwen2_5_vl_video_bin: tuple[Path, Path]) -> tuple[Path, Path]:
    """The session's tiny Qwen2.5-VL and its bin of a real image sample and a real video sample."""
    hf_dir, packed = qwen2_5_vl_video_bin
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    assert counts["bins"] == 1 and counts["videos"] == 1 and counts["image_tokens"] > 0
    return hf_dir, packed


def _run(hf_dir: Path, packed: Path, out: Path, tp: int, cp: int, pp: int = 1) -> list[dict]:
    import torch

    from tests.support.hf_parity import torchrun, train_args

    out.mkdir()
    argv = [*train_args(hf_dir, packed, tp, pp), "--context-parallel-size", str(cp)]
    torchrun(tp * cp * pp, [__file__, str(out), *argv], out)
    return [
        {**json.loads((out / f"result{r}.json").read_text()), "grads": torch.load(out / f"grads{r}.pt")}
        for r in range(tp * cp * pp)
    ]


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    scale = max(float(g.abs().max()) for g in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_cp2_equals_cp1_with_split_image_and_video(
    packed_bin: tuple[Path, Path], tmp_path: Path, tp: int
) -> None:
    hf_dir, packed = packed_bin
    ref = _run(hf_dir, packed, tmp_path / "cp1", tp, 1)
    cp2 = _run(hf_dir, packed, tmp_path / "cp2", tp, 2)
    # megatron-core's rank order is TP fastest, then CP: rank t of CP1 and ranks t, t + TP of CP2 are TP rank t
    for rank, mine in enumerate(cp2):
        want = ref[rank % tp]
        diff = _max_rel_diff(mine["grads"], want["grads"])
        print(
            f"TP{tp} CP2 rank {rank}: loss {mine['loss']!r} vs CP1 {want['loss']!r}, max grad diff {diff:.2e}"
        )
        assert mine["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert diff < 1e-5
        assert all(float(g.abs().max()) > 0 for n, g in mine["grads"].items() if "vision" in n)
    # the image and the video are split over both CP ranks (their pad slots on each)
    for mine in cp2[::tp][:2]:
        images, videos = mine["slots"][0]
        assert images > 0 and videos > 0, mine["slots"]
    gap = abs(cp2[0][SWAPPED] - cp2[0]["loss"]) / cp2[0]["loss"]
    print(f"control: swapped chunks change the loss by {gap:.2e}")
    assert gap > 1e-3


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.slow
def test_cp2_pp2_equals_cp1_pp2(packed_bin: tuple[Path, Path], tmp_path: Path) -> None:
    """CP with pipeline parallelism: each micro-batch's local length is its own (every sample padded to a
    multiple of 2 x CP), so the stages exchange activation shapes (megatron-core's variable_seq_lengths)."""
    hf_dir, packed = packed_bin
    ref = _run(hf_dir, packed, tmp_path / "cp1", 1, 1, pp=2)  # ranks: stage 0, stage 1
    cp2 = _run(hf_dir, packed, tmp_path / "cp2", 1, 2, pp=2)  # ranks: stage 0 CP 0, 1; stage 1 CP 0, 1
    for rank, mine in enumerate(cp2):
        want = ref[rank // 2]
        diff = _max_rel_diff(mine["grads"], want["grads"])
        print(f"PP2 CP2 rank {rank}: loss {mine['loss']!r} vs CP1 {want['loss']!r}, max grad diff {diff:.2e}")
        assert diff < 1e-5
        if rank >= 2:  # the last stage has the loss
            assert mine["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert all(float(g.abs().max()) > 0 for n, g in cp2[0]["grads"].items() if "vision" in n)
    gap = abs(cp2[2][SWAPPED] - cp2[2]["loss"]) / cp2[2]["loss"]
    print(f"control: swapped chunks change the loss by {gap:.2e}")
    assert gap > 1e-3


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.slow
def test_qwen3_vl_cp2_equals_cp1(qwen3_vl_packed: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-VL (DeepStack: vision features added to the first language layers' hidden states at the media
    pads, which under CP are each rank's own pads) on the mllm_demo records and a real video in one bin (the
    session's tiny Qwen3-VL and its packed demo records)."""
    hf_dir, packed = qwen3_vl_packed["hf"], qwen3_vl_packed["packed"]
    ref = _run(hf_dir, packed, tmp_path / "cp1", 1, 1)
    cp2 = _run(hf_dir, packed, tmp_path / "cp2", 1, 2)
    for rank, mine in enumerate(cp2):
        diff = _max_rel_diff(mine["grads"], ref[0]["grads"])
        print(
            f"Qwen3-VL CP2 rank {rank}: loss {mine['loss']!r} vs CP1 {ref[0]['loss']!r}, max grad diff {diff:.2e}"
        )
        assert mine["loss"] == pytest.approx(ref[0]["loss"], rel=1e-5)
        assert diff < 1e-5
    images, videos = cp2[1]["slots"][0]
    assert images > 0 and videos > 0, cp2[1]["slots"]
    gap = abs(cp2[0][SWAPPED] - cp2[0]["loss"]) / cp2[0]["loss"]
    print(f"control: swapped chunks change the loss by {gap:.2e}")
    assert gap > 1e-3


def test_cp_with_interleaved_pipeline_is_refused_in_one_line() -> None:
    from mmpack.trainer.arguments import parse_args

    base = [
        "--mock-data",
        "--seq-length",
        "64",
        "--context-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ]
    assert parse_args(base).parallel.context_parallel_size == 2  # the plain pipeline is taken
    for extra in (
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--virtual-pipeline-model-parallel-size", "2"],
    ):
        with pytest.raises(ValueError, match=r"with the interleaved pipeline .* is not supported yet") as e:
            parse_args([*base, *extra])
        assert "\n" not in str(e.value)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
