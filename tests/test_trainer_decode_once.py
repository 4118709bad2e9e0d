"""One decode per DP rank: with TP2 each image of a micro-batch is decoded once per DP rank (on TP rank 0 of
the first stage); the TP peers receive the same pixels, later pipeline stages receive the batch without them.

The check runs on four gloo ranks (``tests.support.ranks``; this file is also their entry point); decodes are
counted by wrapping the loader's image decoder in each rank."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.ranks import checked, launch
from tests.support.trainer import TINY

pytestmark = [pytest.mark.ranks, pytest.mark.slow]


def _worker(data: str, out: Path, tp: int, pp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mmpack.dataloader.collate as collate
    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    decodes = [0]
    decode = collate.decode_image_patches

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        decodes[0] += 1
        return decode(*args, **kwargs)

    collate.decode_image_patches = counting  # type: ignore[assignment]
    cfg = parse_args(
        [*TINY, "--data-path", data, "--micro-batch-size", "1", "--global-batch-size", "4", "--seed", "2",
         "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    )  # fmt: skip
    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    t = Trainer(cfg)
    seen: list = []
    next_step = t.train_data.next_step

    def recording():  # type: ignore[no-untyped-def]
        batches, wait = next_step()
        seen.extend(batches)
        return batches, wait

    t.train_data.next_step = recording  # type: ignore[method-assign]
    losses = [t.train_step()["loss"] for _ in range(2)]
    # later pipeline stages get the pixel fields empty; every batch here has images
    with_pixels = [b for b in seen if b.pixel_values.shape[0] == int(b.image_grid_thw.prod(dim=1).sum())]
    result = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "decodes": decodes[0],
        "images": sum(len(b.image_grid_thw) for b in seen),
        "all_have_pixels": len(with_pixels) == len(seen),
        "pixel_sum": sum(float(b.pixel_values.double().sum()) for b in with_pixels),
        "token_sum": sum(int(b.tokens.sum()) for b in seen),
        "losses": losses,
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    shutdown()


@pytest.fixture(scope="module")
def data(packed_dataset: Callable[..., Path]) -> Path:
    return packed_dataset(n_samples=60, seed=8)


def _launch(data: Path, out: Path, tp: int, pp: int) -> list[dict]:
    argv = [str(Path(__file__).resolve()), str(data), str(out), str(tp), str(pp)]
    checked(launch(4, argv, out / "ranks", timeout_s=400))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_tp2_decodes_each_image_once_per_dp_rank(data: Path, tmp_path: Path) -> None:
    ranks = _launch(data, tmp_path, tp=2, pp=1)  # TP2 x DP2
    for dp in (0, 1):
        reader, peer = sorted((r for r in ranks if r["dp"] == dp), key=lambda r: r["tp"])
        assert reader["images"] > 0 and reader["decodes"] == reader["images"], reader
        assert peer["decodes"] == 0, peer
        assert peer["all_have_pixels"] and peer["images"] == reader["images"]
        assert peer["pixel_sum"] == reader["pixel_sum"] and peer["token_sum"] == reader["token_sum"]
    assert (
        ranks[0]["token_sum"] != next(r for r in ranks if r["dp"] == 1)["token_sum"]
    )  # DP ranks: other data


def test_later_stages_get_the_batch_without_pixels(data: Path, tmp_path: Path) -> None:
    ranks = _launch(data, tmp_path, tp=2, pp=2)  # TP2 x PP2 x DP1
    reader = next(r for r in ranks if r["tp"] == 0 and r["pp"] == 0)
    assert reader["images"] > 0 and reader["decodes"] == reader["images"]
    for r in ranks:
        assert r["token_sum"] == reader["token_sum"] and r["images"] == reader["images"]
        if r is not reader:
            assert r["decodes"] == 0, r
        assert r["all_have_pixels"] == (r["pp"] == 0), r
    last = [r for r in ranks if r["pp"] == 1]
    assert all(all(x == x and abs(x) < 1e3 for x in r["losses"]) for r in last)  # finite losses


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
