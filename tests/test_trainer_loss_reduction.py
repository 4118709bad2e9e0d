"""``--loss-reduction token | sample | square`` on packed bins equals each mode's definition on the samples one by
one through transformers. One launch of four gloo ranks, DP 2 x CP 2 (every sample split over both CP ranks),
micro-batch 2, two micro-batches per DP rank (global batch 8: every bin of a dataset of two one-image mllm_demo
records and 22 text records of unequal answer lengths, Qwen3 tokenizer, bins of 128 tokens): the same trainer runs
one forward/backward per mode; the step's loss (to 1e-6 relative) and the gradients of a few language and vision
weights (to 1e-6 relative in norm) equal those of transformers' per-sample loss sums s_i over n_i target tokens
(a tiny random Qwen2.5-VL, float64) reduced by the mode (token: sum s_i / sum n_i; sample: mean of s_i / n_i;
square: sum s_i / sqrt(n_i) / sum sqrt(n_i)). Control: the three modes give three different losses.

This file is also the ranks' worker script.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_shared

MODES = ("token", "sample", "square")
RTOL = 1e-6
# megatron-core names of the gradients compared (TP 1: one shard each)
GRAD_PARAMS = (
    "vision.patch_embed.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
    "language_model.decoder.layers.0.self_attention.linear_qkv.weight",
    "language_model.decoder.layers.1.mlp.linear_fc2.weight",
)
# the text records' answer lengths (words): with two image records, 8 bins of 128 tokens
ANSWER_TEXT = "the model reads each packed sample on its own and weighs its answer tokens"
ANSWER_WORDS = (1, 30, 2, 45, 3, 9, 50, 1, 18, 4, 12, 25, 6, 40, 2, 20, 8, 35, 1, 15, 3, 28)


def _worker(out_dir: str, argv: list[str]) -> None:
    """Each mode's step loss (over DP x CP) and, on rank 0, the reduced gradients; the global batch's bins."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    bins = torch.cat([b.bin_ids for b in batches])
    gathered = [torch.zeros_like(bins) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bins)
    result: dict = {"bins": sorted({int(x) for g in gathered for x in g})}
    grads = {}
    for mode in MODES:
        trainer.cfg = dataclasses.replace(
            trainer.cfg, train=dataclasses.replace(trainer.cfg.train, loss_reduction=mode)
        )
        trainer.model.zero_grad_buffer()
        losses = trainer._run_schedule(batches, forward_only=False)
        t = torch.tensor([sum(float(x["lm loss"][i]) for x in losses) for i in (0, 1)], dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
        result[mode] = float(t[0] / t[1])
        params = dict(trainer.model.module.named_parameters())
        grads[mode] = {n: params[n].main_grad.detach().clone() for n in GRAD_PARAMS}
    if dist.get_rank() == 0:  # every DP x CP rank holds the reduced gradients
        torch.save(grads, Path(out_dir) / "grads.pt")
        (Path(out_dir) / "result.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


# -- the test side ----------------------------------------------------------------------------------------


def _dataset(root: Path) -> Path:
    """Two one-image mllm_demo records and text records of unequal answer lengths, packed into bins of 128."""
    from tests.support import qwen2_5_vl
    from tests.support.hf_parity import records_file

    path = records_file(root, with_video=False)
    lines = path.read_text().splitlines()
    records = [lines[1], lines[4]]  # one image each
    words = ANSWER_TEXT.split()
    for i, n in enumerate(ANSWER_WORDS):
        answer = " ".join(words[(i + k) % len(words)] for k in range(n))
        messages = [{"role": "user", "content": f"Question {i}: say something."}]
        messages.append({"role": "assistant", "content": answer})
        records.append(json.dumps({"messages": messages, "images": []}))
    path.write_text("\n".join(records) + "\n")
    return qwen2_5_vl.pack(path, QWEN3_TOKENIZER, root / "packed", 128)


def _samples_of_bins(packed: Path, wanted: list[int]) -> list[dict]:
    """The samples of the bins ``wanted`` as the loader gives them, with their image inputs."""
    from mmpack.dataloader import Topology, build_loader, load_manifest
    from tests.support.hf_parity import bin_samples

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    specials = json.loads((packed / "manifest.json").read_text())["tokenizer"]["special_ids"]
    merged = load_manifest(str(packed)).merge_size ** 2
    samples, seen = [], []
    for batch in loader:
        assert batch is not None and batch.bin_ids is not None
        if int(batch.bin_ids[0]) in wanted:
            seen.append(int(batch.bin_ids[0]))
            samples += bin_samples(batch, specials["image_pad"], specials["video_pad"], merged)
    loader.close()
    assert sorted(seen) == sorted(wanted)
    return samples


def _reference(hf_dir: Path, samples: list[dict], hf_names: list[str]) -> dict:
    """Each mode's loss from transformers' per-sample loss sums, and its gradients of ``hf_names``."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.support.hf_parity import model_inputs_of

    # float64: the reference adds no rounding of its own to the packed run's single precision
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float64)
    params = dict(model.named_parameters())
    for name, param in params.items():  # the backward computes no other weight's gradient
        param.requires_grad_(name in hf_names)
    sums, counts = [], []
    for tokens, labels, types, kwargs in model_inputs_of(samples):
        keep = labels != -100
        if not keep.any():
            continue
        kwargs = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}
        hidden = model.model(
            input_ids=tokens[None], mm_token_type_ids=types[None], **kwargs
        ).last_hidden_state
        logits = model.lm_head(hidden[0][keep])  # the output layer on the target positions only
        sums.append(F.cross_entropy(logits, labels[keep], reduction="sum"))
        counts.append(float(keep.sum()))
    s, n = torch.stack(sums), torch.tensor(counts, dtype=torch.float64)
    losses = {
        "token": s.sum() / n.sum(),
        "sample": (s / n).mean(),
        "square": (s / n.sqrt()).sum() / n.sqrt().sum(),
    }
    out: dict = {"counts": counts}
    for mode, loss in losses.items():
        grads = torch.autograd.grad(loss, [params[h] for h in hf_names], retain_graph=True)
        out[mode] = {"loss": float(loss.detach()), "grads": dict(zip(hf_names, grads, strict=True))}
    return out


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.family
@pytest.mark.slow
def test_each_loss_reduction_equals_its_definition_at_dp2_cp2(qwen2_5_vl_model: Path, tmp_path: Path) -> None:
    import torch

    from mmpack.trainer.models.hf_weights import merge_tp_shards
    from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config
    from tests.support.hf_parity import torchrun

    need_shared(QWEN3_TOKENIZER, MLLM_DEMO_JSON, what="Qwen3 tokenizer and the mllm_demo records")
    hf_dir, packed = qwen2_5_vl_model, _dataset(tmp_path / "data")
    argv = [
        "--hf-model", str(hf_dir), "--data-path", str(packed), "--context-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "0",
        "--num-workers", "0",
    ]  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    torchrun(4, [str(Path(__file__).resolve()), str(out), *argv], out)
    result = json.loads((out / "result.json").read_text())
    assert len(result["bins"]) == 8  # the global batch is every bin

    # megatron-core's gradients under transformers' names (TP 1: the fused QKV split into q, k, v)
    rules = FAMILY.hf.stage_rules(arch_from_hf_config(json.loads((hf_dir / "config.json").read_text())), 0, 1)
    packed_grads = {
        mode: {
            hf.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): g
            for name, grad in per_name.items()
            for hf, g in merge_tp_shards(rules[name], [grad]).items()
        }
        for mode, per_name in torch.load(out / "grads.pt").items()
    }
    hf_names = sorted(packed_grads["token"])
    ref = _reference(hf_dir, _samples_of_bins(packed, result["bins"]), hf_names)
    assert max(ref["counts"]) >= 10 * min(ref["counts"]), ref["counts"]  # unequal samples: the modes differ

    for mode in MODES:
        want = ref[mode]["loss"]
        print(f"{mode}: packed DP2xCP2 loss {result[mode]!r}, transformers one by one {want!r}")
        assert result[mode] == pytest.approx(want, rel=RTOL), mode
        for name in hf_names:
            expected, got = ref[mode]["grads"][name], packed_grads[mode][name]
            # relative in norm: single-precision sums in another order leave single elements ~1e-6 apart
            rel = float((got.double() - expected).norm() / expected.norm())
            worst = float((got.double() - expected).abs().max() / expected.abs().max())
            print(f"  grad {name}: |diff| / |grad| {rel:.2e} (max |diff| / max |grad| {worst:.2e})")
            assert rel <= RTOL, (mode, name, rel)
    # control: on samples of unequal length the three reductions are three different losses
    values = [ref[m]["loss"] for m in MODES]
    gaps = [abs(a - b) / abs(b) for i, a in enumerate(values) for b in values[i + 1 :]]
    assert min(gaps) > 100 * RTOL, values


def test_weights_of_the_worked_example_and_per_source_losses() -> None:
    """docs/fine-tuning.md's example: samples of 2 and 8 target tokens (with a prompt token each and a padding
    tail) in one bin; each token's share of the loss per mode, and a mixture's per-source loss under sample."""
    import torch

    from mmpack.trainer.loss_reduction import token_weights
    from mmpack.trainer.observability import source_loss_parts
    from mmpack.trainer.training import _loss_func

    mask = torch.tensor([[0, 1, 1] + [0] + [1] * 8 + [0, 0]], dtype=torch.float32)
    cu = torch.tensor([0, 3, 12, 14], dtype=torch.int32)
    a, b = slice(1, 3), slice(4, 12)
    shares = {}
    for mode in ("token", "sample", "square"):
        w = token_weights(mask, cu, mode)[0]
        assert w.shape == (14,) and float(w[mask[0] == 0].abs().sum()) == 0.0
        share = w / w.sum()
        shares[mode] = (float(share[a].sum()), float(share[b].sum()))
        assert float(share[a].min()) == float(share[a].max()) and float(share[b].min()) == float(
            share[b].max()
        )
    assert shares["token"] == pytest.approx((0.2, 0.8))
    assert shares["sample"] == pytest.approx((0.5, 0.5))
    assert shares["square"] == pytest.approx((1 / 3, 2 / 3))

    # two rows from two sources: source 1's loss under sample is the mean of its samples' means
    mask2 = torch.cat([mask, mask])
    cu2 = torch.tensor([0, 3, 12, 14, 17, 26, 28], dtype=torch.int32)
    loss = torch.arange(28, dtype=torch.float32).reshape(2, 14)
    parts = source_loss_parts(
        loss, token_weights(mask2, cu2, "sample"), torch.tensor([0, 1]).repeat_interleave(14), 2
    )
    means = (float(loss[1, a].mean()), float(loss[1, b].mean()))
    assert float(parts[0, 1] / parts[1, 1]) == pytest.approx(sum(means) / 2)
    assert parts[2].tolist() == [10.0, 10.0]  # target tokens per source
    # the trainer's loss function on the scaled weights: the step's sum scaled, target tokens and source sums not
    scale = 3.0
    weights = token_weights(mask2, cu2, "sample")
    sources = (torch.tensor([0, 1]).repeat_interleave(14), 2)
    loss_sum, num_tokens, reported = _loss_func((weights * scale).float(), False, sources, scale, loss)
    assert int(num_tokens) == 20 and float(loss_sum) == pytest.approx(scale * float((weights * loss).sum()))
    assert torch.allclose(reported["source loss"], parts)
    # control: the token-mode loss of that source differs
    assert float(loss[1][mask[0] == 1].mean()) != pytest.approx(sum(means) / 2)
    with pytest.raises(ValueError, match="cu_seqlens run from 0 to 12"):
        token_weights(mask, torch.tensor([0, 3, 12]), "sample")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
