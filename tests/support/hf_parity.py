"""The family parity tests' harness (no tests here): launching one training step on warm ranks, the trainer's
arguments for it, the real demo records, each packed sample as the loader gives it with its slices of the image
and video inputs, transformers' loss over samples run one by one (and its gradients), and the ``mmpack
convert`` round trip every family checks.

Imports of torch, transformers and the package are inside the functions: a worker script (a test file run on
ranks) imports this module without loading any model family.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.ranks import warm_start_method
from tests.support.shared import MLLM_DEMO_JSON, VIDEO_DEMO

if TYPE_CHECKING:
    from mmpack.packing.batch import MicroBatch


def torchrun(nproc: int, args: list[str], cwd: Path, timeout_s: int = 600) -> Any:
    """``torchrun --nproc_per_node nproc ARGS`` on warm ranks (``tests.support.ranks``); checks every rank
    exited 0. The worker may be a test file or a module that imports tests.*: the repository root is on its
    path."""
    from tests.support import ranks

    return ranks.checked(ranks.launch(nproc, args, cwd / "ranks", timeout_s=timeout_s))


def train_args(hf_dir: Path, packed: Path, tp: int, pp: int) -> list[str]:
    """One iteration at lr 0 of the model folder on the packed dataset at TP x PP, micro and global batch 1."""
    return [
        "--hf-model", str(hf_dir), "--data-path", str(packed),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "0",
        "--log-interval", "1", "--num-workers", "0",
    ]  # fmt: skip


def step_loss(losses: list) -> float:
    """A step's loss on the last pipeline stage from ``Trainer._run_schedule``'s output (NaN on the other
    stages, which compute none)."""
    if not losses:
        return float("nan")
    return sum(float(x["lm loss"][0]) for x in losses) / sum(float(x["lm loss"][1]) for x in losses)


def loss_and_grads(model, inputs: list) -> dict:  # type: ignore[no-untyped-def]
    """transformers' loss over samples run one by one ((tokens, labels, mm_token_type_ids, model kwargs) each):
    the sum of token cross-entropies over the loss tokens / their count, and its gradients where they are on."""
    import torch
    import torch.nn.functional as F

    total, count = torch.zeros(()), 0
    for tokens, labels, types, kwargs in inputs:
        logits = model(input_ids=tokens[None], mm_token_type_ids=types[None], **kwargs).logits[0]
        keep = labels != -100
        total = total + F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
        count += int(keep.sum())
    loss = total / count
    if loss.requires_grad:
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads, "tokens": count}


def records_file(root: Path, *, with_video: bool = True) -> Path:
    """The six mllm_demo records and (``with_video``) the first mllm_video_demo record, media copied beside
    them."""
    media = root / "media"
    media.mkdir(parents=True)
    records = json.loads(MLLM_DEMO_JSON.read_text())
    for rec in records:
        for rel in rec["images"]:
            shutil.copy(MLLM_DEMO_JSON.parent / rel, media / Path(rel).name)
        rec["images"] = [f"media/{Path(p).name}" for p in rec["images"]]
    if with_video:
        video = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())[0]
        shutil.copy(VIDEO_DEMO / video["videos"][0], media / Path(video["videos"][0]).name)
        video["videos"] = [f"media/{Path(p).name}" for p in video["videos"]]
        records.append(video)
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def loader_samples(packed: Path, layout: list | None = None, bins: int = 1) -> list[dict]:
    """Each sample of the first ``bins`` bins as the loader gives them, with their slices of the image and
    video inputs; `layout`: which samples must hold (images, videos), in any order (default: one image sample
    and one video sample)."""
    from mmpack.dataloader import Topology, build_loader, load_manifest

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    specials = json.loads((packed / "manifest.json").read_text())["tokenizer"]["special_ids"]
    merged = load_manifest(str(packed)).merge_size ** 2  # patches per token
    samples = []
    for batch in itertools.islice(loader, bins):
        assert batch is not None
        samples += bin_samples(batch, specials["image_pad"], specials["video_pad"], merged)
    loader.close()
    if layout is None:
        layout = [(True, False), (False, True)]
    assert sorted(("image" in s, "video" in s) for s in samples) == sorted(layout)
    return samples


def bin_samples(batch: MicroBatch, image_pad: int, video_pad: int, merged: int) -> list[dict]:
    """The samples of one micro-batch of one bin: tokens, labels, and (``image`` / ``video``) their pixel rows
    and grids (``seconds``: the videos' second_per_grid_ts)."""
    import torch

    real = int(batch.num_real_tokens)
    samples, rows = [], {"image": 0, "video": 0}
    grids = {"image": iter(batch.image_grid_thw), "video": iter(batch.video_grid_thw)}
    seconds = iter(batch.second_per_grid_ts)
    for a, b in itertools.pairwise(batch.cu_seqlens.tolist()):
        if b > real:
            break
        tokens = batch.tokens[0, a:b]
        sample = {
            "tokens": tokens,
            "labels": batch.labels[0, a:b],
            "image_pad": image_pad,
            "video_pad": video_pad,
        }
        for kind, pad, pixels in (
            ("image", image_pad, "pixel_values"),
            ("video", video_pad, "pixel_values_videos"),
        ):
            pads, mine = int((tokens == pad).sum()), []
            while pads > 0:
                mine.append(next(grids[kind]))
                pads -= int(mine[-1].prod()) // merged
            if mine:
                n = sum(int(g.prod()) for g in mine)
                sample[kind] = (getattr(batch, pixels)[rows[kind] : rows[kind] + n], torch.stack(mine))
                rows[kind] += n
                if kind == "video":
                    sample["seconds"] = torch.stack([next(seconds) for _ in mine])
        samples.append(sample)
    return samples


def model_inputs_of(samples: list[dict], *, zero_videos: bool = False, seconds: bool = True) -> list:
    """(tokens, labels, mm_token_type_ids, model kwargs) of each sample for transformers (`seconds`: with
    Qwen2.5-VL's second_per_grid_ts)."""
    import torch

    out = []
    for s in samples:
        kwargs: dict = {}
        if "image" in s:
            kwargs |= {"pixel_values": s["image"][0], "image_grid_thw": s["image"][1]}
        if "video" in s:
            pixels = torch.zeros_like(s["video"][0]) if zero_videos else s["video"][0]
            kwargs |= {"pixel_values_videos": pixels, "video_grid_thw": s["video"][1]}
            if seconds:
                kwargs["second_per_grid_ts"] = s["seconds"]
        types = (s["tokens"] == s["image_pad"]).int() + 2 * (s["tokens"] == s["video_pad"]).int()
        out.append((s["tokens"], s["labels"], types, kwargs))
    return out


def check_convert_round_trip(
    setup: dict, tmp_path: Path, tp: int, pp: int, reference: Callable[[Path, Path], dict]
) -> None:
    """``mmpack convert`` HF -> megatron-core at TP x PP -> HF gives back every tensor bit for bit, and the export
    (with the processor and tokenizer files) gives `reference`'s loss (``setup``: the model folder ``hf``, the
    dataset ``packed`` and the reference's result ``ref`` on them); every family's test runs it."""
    from safetensors.torch import load_file

    from mmpack.trainer.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(str(setup["hf"]), str(tmp_path / "mcore"), tp, pp, start_method=warm_start_method())
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "export"), start_method=warm_start_method())
    original, exported = (load_file(str(d / "model.safetensors")) for d in (setup["hf"], tmp_path / "export"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and exported[name].equal(tensor), name
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        if (setup["hf"] / name).is_file():  # a folder without videos has no video processor config
            shutil.copy(setup["hf"] / name, tmp_path / "export" / name)
    assert reference(tmp_path / "export", setup["packed"])["loss"] == setup["ref"]["loss"]
