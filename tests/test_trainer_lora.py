"""LoRA parity with peft on transformers: the session's tiny Qwen2.5-VL and its bin of a real image sample and a
real video sample; peft puts adapters (rank 4, nonzero B) on every linear module of the language model, the
vision tower and the projector, and saves them; mmpack starts from that folder (``--lora-adapter``) at TP1 and
TP2 x PP2. The loss before any update and every adapter gradient equal peft's to 1e-5 (relative), and so does
the loss after one Adam step at lr > 0 (peft's adapters stepped by torch's Adam alike). The base weights stay
bit-identical and the optimizer holds the adapters only. Control: another adapter init moves the loss by far
more than the tolerance. Cheap unit checks of the flags and the target names follow.

This file is also the torchrun worker: one step's loss and adapter gradients, an optimizer step, the loss after.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv", "attn.proj", "mlp.0", "mlp.2"]  # fmt: skip


def _worker(out_dir: str, argv: list[str]) -> None:
    """Loss and adapter gradients of one step, one optimizer step (base weights compared before and after, the
    optimizer's parameters named), and the loss after it."""
    import torch
    import torch.distributed as dist

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.lora.spec import is_lora_param
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    chunks = trainer.chunks  # several under the interleaved pipeline: their parameters named "<chunk>.<name>"
    named = [dict(c.module.named_parameters()) for c in chunks]
    params = (
        named[0] if len(chunks) == 1 else {f"{i}.{n}": p for i, ps in enumerate(named) for n, p in ps.items()}
    )
    base = {n: p.detach().clone() for n, p in params.items() if not is_lora_param(n)}
    for chunk in chunks:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    loss = _global_loss(trainer._run_schedule(batches, forward_only=False))
    grads = {n: p.main_grad.detach().clone() for n, p in params.items() if is_lora_param(n)}
    if (
        len(chunks) > 1
    ):  # each chunk's adapter gradients by HF name (a chunk's layers are not its stage's even share)
        from mmpack.trainer.lora.peft_io import merge_adapter_shards
        from mmpack.trainer.models.hf_weights import model_rules

        hf_grads: dict = {}
        for chunk, ps in zip(chunks, named, strict=True):
            rules = model_rules(trainer.family.hf.part_rules, trainer.arch, chunk.module)
            own = {n: p.main_grad.detach().clone() for n, p in ps.items() if is_lora_param(n)}
            hf_grads |= merge_adapter_shards(rules, [own])
        torch.save(hf_grads, Path(out_dir) / f"hf_grads{dist.get_rank()}.pt")
    ok, _, _ = trainer.optimizer.step()
    by_id = {id(p): n for n, p in params.items()}
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    in_optimizer = sorted(
        by_id.get(id(p), "?") for o in optimizers for g in o.param_groups for p in g["params"]
    )
    with_state = sorted(by_id.get(id(p), "?") for o in optimizers for p in o.optimizer.state)
    with torch.no_grad():
        after = _global_loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.cfg.checkpoint.save:  # the adapters after the step, for the export round trip
        trainer.iteration = 1
        trainer.save()
        assert trainer.writer is not None
        trainer.writer.finalize(blocking=True)
    rank = dist.get_rank()
    result = {
        "loss": loss, "after": after, "ok": bool(ok), "lr": trainer.optimizer.param_groups[0]["lr"],
        "base_unchanged": all(p.equal(base[n]) for n, p in params.items() if n in base),
        "base_trainable": [n for n, p in params.items() if n in base and p.requires_grad],
        "lora_params": sorted(n for n in params if is_lora_param(n)),
        "in_optimizer": in_optimizer, "with_state": with_state,
    }  # fmt: skip
    torch.save(grads, Path(out_dir) / f"grads{rank}.pt")
    (Path(out_dir) / f"result{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


def _global_loss(losses: list) -> float:
    """The step's loss over the whole global batch: the loss sums and target-token counts of this rank's
    micro-batches summed over the DP ranks (NaN on the stages before the last, which compute none)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sums = torch.tensor([sum(float(x["lm loss"][i]) for x in losses) for i in range(2)], dtype=torch.float64)
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")


# -- the test side ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(qwen2_5_vl_video_bin: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """peft's adapter folder, its loss and adapter gradients on the bin, its loss after one Adam step and
    (control) the loss under another adapter init."""
    from tests.support.hf_parity import loader_samples, model_inputs_of
    from tests.support.lora_parity import peft_reference

    pytest.importorskip("peft")
    hf_dir, packed = qwen2_5_vl_video_bin
    inputs = model_inputs_of(loader_samples(packed))
    return peft_reference(hf_dir, packed, inputs, TARGETS, tmp_path_factory.mktemp("lora") / "adapter")


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.family
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_lora_equals_peft(reference: dict, tmp_path: Path, tp: int, pp: int) -> None:
    from tests.support.hf_parity import train_args
    from tests.support.lora_parity import check_lora_step, run_lora_step

    ref = reference
    save = ["--save", str(tmp_path / "ckpt")] if pp > 1 else []
    results = run_lora_step(ref, tmp_path, tp * pp, train_args(ref["hf"], ref["packed"], tp, pp), *save)
    check_lora_step(ref, results, tp, pp, f"TP{tp}xPP{pp}")
    if save:
        _check_export(ref, tmp_path, results[-1]["after"])


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.family
@pytest.mark.slow
def test_lora_equals_peft_under_the_interleaved_pipeline(
    qwen2_5_vl_video_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    """PP2 x VP2 (a 4-layer Qwen2.5-VL, one layer per model chunk; the vision tower in stage 0's first chunk):
    the adapters of every chunk, the loss before and after one Adam step and every adapter gradient (mapped to
    HF names chunk by chunk) equal peft's, as at TP1 and TP2 x PP2; the same control."""
    from tests.support import qwen2_5_vl
    from tests.support.hf_parity import loader_samples, model_inputs_of, train_args
    from tests.support.lora_parity import check_lora_step, peft_reference, run_lora_step

    pytest.importorskip("peft")
    _, packed = qwen2_5_vl_video_bin
    hf_dir = qwen2_5_vl.tiny_hf_model(tmp_path / "hf4", qwen2_5_vl.qwen3_special_ids(), num_layers=4)
    inputs = model_inputs_of(loader_samples(packed))
    ref = peft_reference(hf_dir, packed, inputs, TARGETS, tmp_path / "adapter")
    args = [*train_args(hf_dir, packed, 1, 2), "--num-layers-per-virtual-pipeline-stage", "1"]
    # the interleaved schedule runs micro-batches in groups of PP: the one bin twice (epochs 0 and 1) is the
    # same loss and gradient as once
    args[args.index("--global-batch-size") + 1] = "2"
    results = run_lora_step(ref, tmp_path / "run", 2, args)
    assert all("hf_grads" in r for r in results), "the worker saw one model chunk: no interleaved pipeline"
    check_lora_step(ref, results, 1, 2, "PP2xVP2")


def _check_export(ref: dict, tmp_path: Path, loss: float) -> None:
    """The checkpoint (saved at TP2 x PP2, read at TP1: resharded) holds the adapters only; exported as a PEFT
    folder peft on transformers gives mmpack's loss after the step, and so do the merged weights."""
    import torch
    from megatron.core import dist_checkpointing
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmpack.trainer.convert import mcore_to_hf
    from tests.support.hf_parity import loader_samples, loss_and_grads, model_inputs_of
    from tests.support.ranks import warm_start_method

    inputs = model_inputs_of(loader_samples(ref["packed"]))
    ckpt = tmp_path / "ckpt"
    saved = {p.name for p in ckpt.rglob("*") if p.is_file()}
    assert "adapter_config.json" in saved and not any("safetensors" in n for n in saved)
    tensors = dist_checkpointing.load_tensors_metadata(str(ckpt / "iter_0000001"))
    assert tensors and all(".lora.lora_" in key for key in tensors), sorted(tensors)[:5]
    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    mcore_to_hf(str(ckpt), str(peft_dir), lora_format="peft", start_method=warm_start_method())
    mcore_to_hf(str(ckpt), str(merged_dir), lora_format="merged", hf_model=str(ref["hf"]),
                start_method=warm_start_method())  # fmt: skip
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(ref["hf"], torch_dtype=torch.float32)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(merged_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        via_peft = loss_and_grads(PeftModel.from_pretrained(base, peft_dir), inputs)["loss"]
        via_merged = loss_and_grads(merged, inputs)["loss"]
    print(f"exported: peft {via_peft!r}, merged {via_merged!r}, mmpack {loss!r}")
    assert via_peft == pytest.approx(loss, rel=1e-5)
    assert via_merged == pytest.approx(loss, rel=1e-5)


# -- flags and target names (no ranks) --------------------------------------------------------------------


def test_target_names_that_match_nothing_are_one_error_listing_the_valid_names() -> None:
    from mmpack.trainer.lora.spec import LoraSpec, check_targets
    from mmpack.trainer.models.qwen2_5_vl import FAMILY
    from tests.support.qwen2_5_vl import tiny_arch

    arch = tiny_arch()
    rules = FAMILY.hf.part_rules(arch, first=True, last=True, layers=(0, arch.num_layers))
    check_targets(
        LoraSpec(rank=2, alpha=4, targets=("q_proj", "mlp.0", "layers.1.mlp.down_proj")), rules, "it"
    )
    with pytest.raises(ValueError, match="qproj, lm_head name") as err:
        check_targets(LoraSpec(rank=2, alpha=4, targets=("qproj", "lm_head", "v_proj")), rules, "it")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv", "mlp.0"):
        assert name in str(err.value).split("valid names: ")[1]
    with pytest.raises(ValueError, match=r"proj \(visual.patch_embed.proj\) also name"):
        check_targets(LoraSpec(rank=2, alpha=4, targets=("proj",)), rules, "it")


def test_expert_targets_are_one_error_and_the_dense_modules_of_a_moe_model_are_valid() -> None:
    """The experts of a mixture of experts (3-D tensors in transformers, stacked or one file per expert) are not
    linear modules: a module target naming only them is one error that says how to name them (as parameters,
    tests/test_trainer_lora_experts.py); its attention and vision modules are valid targets."""
    from mmpack.trainer.lora.spec import LoraSpec, check_targets, expert_names
    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen_moe import MoEArch, moe_rules

    fam = family("qwen3_vl_moe")
    spec = TinyModelSpec(
        vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502
    )
    arch = fam.arch_from_hf_config(fam.tiny_hf_config(spec))
    rules = fam.hf.part_rules(arch, first=True, last=True, layers=(0, arch.num_layers))
    check_targets(LoraSpec(rank=2, alpha=4, targets=("q_proj", "o_proj", "qkv", "linear_fc1")), rules, "it")
    for target in ("experts", "gate_up_proj", "mlp.experts.down_proj", ".*experts.*"):
        targets = target if "*" in target else ("q_proj", target)
        with pytest.raises(ValueError, match=rf"{re.escape(target)} name\(s\) the experts of it") as err:
            check_targets(LoraSpec(rank=2, alpha=4, targets=targets), rules, "it")
        assert "q_proj" in str(err.value).split("valid module names: ")[1] and "\n" not in str(err.value)
        assert "(experts.gate_up_proj, experts.down_proj)" in str(err.value)
    # Qwen3-MoE checkpoints' layout: each expert's own gate_proj / up_proj / down_proj
    moe = MoEArch(num_experts=2, top_k=1, ffn_hidden_size=4, per_expert_files=True)
    per_expert = moe_rules(moe, 8, "model.layers.0.mlp.", "decoder.layers.0.mlp.")
    assert "model.layers.0.mlp.experts.1.down_proj" in expert_names(per_expert)
    with pytest.raises(ValueError, match=r"down_proj name\(s\) the experts of it"):
        check_targets(LoraSpec(rank=2, alpha=4, targets=("down_proj",)), rules | per_expert, "it")


def test_adapter_config_gives_the_lora_and_contradicting_flags_are_refused(tmp_path: Path) -> None:
    from mmpack.trainer.lora.export import check_resume_base, write_run_config
    from mmpack.trainer.lora.spec import resolve_spec

    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.1,
                "target_modules": ["v_proj", "q_proj"],
            }
        )
    )
    spec = resolve_spec(rank=None, alpha=None, dropout=None, targets=None, adapter=str(tmp_path))
    assert spec is not None and (spec.rank, spec.scale, spec.dropout, spec.targets) == (8, 2.0, 0.1, ("q_proj", "v_proj"))  # fmt: skip
    with pytest.raises(ValueError, match="--lora-rank 4 contradicts --lora-adapter"):
        resolve_spec(rank=4, alpha=None, dropout=None, targets=None, adapter=str(tmp_path))
    assert resolve_spec(rank=None, alpha=None, dropout=None, targets=None, adapter=None) is None
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": True}))  # fmt: skip
    with pytest.raises(ValueError, match="use_dora True is not supported"):
        resolve_spec(rank=None, alpha=None, dropout=None, targets=None, adapter=str(tmp_path))
    write_run_config(str(tmp_path), spec, "/models/base")  # a LoRA run's checkpoint folder
    check_resume_base(str(tmp_path), "/models/base")
    with pytest.raises(ValueError, match="trained on --hf-model /models/base; give that --hf-model again"):
        check_resume_base(str(tmp_path), None)


def test_flags_reach_the_config_and_freeze_composes() -> None:
    import torch

    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.freeze import apply_freeze

    cfg = parse_args(["--mock-data", "--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj", "o_proj"])
    assert (cfg.model.lora_rank, cfg.model.lora_target_modules) == (4, ("q_proj", "v_proj", "o_proj"))
    names = ["vision.merger.ln_q.weight", "vision.layers.0.self_attention.linear_proj.lora.lora_A.proj",
             "language_model.decoder.layers.0.self_attention.linear_qkv.weight",
             "language_model.decoder.layers.0.self_attention.linear_qkv.lora.lora_B.q_proj"]  # fmt: skip
    model = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        module = model
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(1)))

    def trains(**flags) -> list[bool]:  # type: ignore[no-untyped-def]
        flags = {"trainable_modules": None, "freeze_vision": False, "freeze_llm": False, **flags}
        apply_freeze(model, tied=False, adapter_prefixes=("vision.merger.",), lora=True, **flags)
        return [model.get_parameter(n).requires_grad for n in names]

    assert trains() == [False, True, False, True]  # only the adapters
    assert trains(trainable_modules=("adapter",)) == [True, True, False, True]  # and the projector in full
    assert trains(freeze_vision=True) == [False, False, False, True]  # the vision tower's adapters frozen


def _dropout_masks(out_dir: str) -> None:
    """At TP2, seeded as the trainer seeds: whether the dropout masks of a replicated input, of a split one
    and (control) of a split one by the default generator are equal on the two TP ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.lora.layer import lora_dropout

    cpu_backend.activate()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(1234)
    mtp.model_parallel_cuda_manual_seed(1234)
    x = torch.ones(64, 32)
    masks = {
        "replicated": lora_dropout(x, 0.5, split=False, tp_size=2),
        "split": lora_dropout(x, 0.5, split=True, tp_size=2),
        "replicated_after_split": lora_dropout(x, 0.5, split=False, tp_size=2),
        "split_by_default_generator": F.dropout(x, 0.5),
    }
    equal = {}
    for key, mask in masks.items():
        both = [torch.empty_like(mask) for _ in range(2)]
        dist.all_gather(both, mask)
        equal[key] = bool(both[0].equal(both[1]))
        equal[key + "_kept"] = float((mask != 0).float().mean())
    if dist.get_rank() == 0:
        (Path(out_dir) / "masks.json").write_text(json.dumps(equal))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.ranks
def test_dropout_masks_follow_the_inputs_split_over_tp(tmp_path: Path) -> None:
    """--lora-dropout under TP: a column-parallel layer's input is the same on both TP ranks, and so is its mask
    (else the ranks' shards of the update come from different inputs); a row-parallel layer's input (and a
    column-parallel one's under sequence parallelism) is a slice per rank, and the slices' masks are independent,
    drawn from the model-parallel generator without moving the default one. Control: the default generator gives
    the slices one same mask, the pattern the split masks must not repeat."""
    from tests.support.ranks import checked, launch

    checked(launch(2, [__file__, "--dropout-masks", str(tmp_path)], tmp_path / "logs", timeout_s=120))
    equal = json.loads((tmp_path / "masks.json").read_text())
    assert equal["replicated"] and equal["replicated_after_split"]
    assert not equal["split"]
    assert equal["split_by_default_generator"]  # control: what the split masks would be without the fork
    for key in ("replicated", "split", "replicated_after_split"):
        assert 0.4 < equal[key + "_kept"] < 0.6  # p = 0.5: about half kept


if __name__ == "__main__":
    if sys.argv[1] == "--dropout-masks":
        _dropout_masks(sys.argv[2])
    else:
        _worker(sys.argv[1], sys.argv[2:])
