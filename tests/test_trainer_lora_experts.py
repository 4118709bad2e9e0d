"""LoRA on the experts of a mixture of experts, against peft's adapters of transformers' 3-D expert parameters
(``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, peft's ``ParamWrapper``).

- The layout (no ranks): a PEFT folder's expert adapters read per expert (A [experts, r, in], B [experts, out,
  r]) give peft's own update of every expert, s * B_e A_e; written back they are the file's tensors; merged
  into the weights they are peft's merged model's. Control: B's columns read expert-major (the other plausible
  split of peft's [out, r * experts]) give other updates.
- Parity at EP2 (DP2, a bin per rank; the worker is tests/test_trainer_lora.py): the tiny random Qwen3-VL-MoE
  (4 experts, 2 per token) with peft's adapters on every expert and on the attention's q and v; mmpack starts
  from the saved folder: the loss, every adapter gradient (each EP rank's experts) and the loss after one Adam
  step equal peft's; the base weights are bit-identical, the optimizer holds the adapters only. Control: another
  adapter init moves peft's loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import qwen3_vl
from tests.support.hf_parity import loader_samples, model_inputs_of, records_file
from tests.support.lora_parity import draw_adapters, peft_reference
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_import, need_shared

MODULES = ["q_proj", "v_proj"]
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK, ALPHA = 4, 8
SAMPLES = 4  # image samples of mllm_demo, packed in two bins (one per DP rank)


def _tiny_config():  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    spec = TinyModelSpec(
        vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502, num_layers=2,
        vision_depth=2, patch_size=16, num_experts=4, moe_router_topk=2, ffn_hidden_size=24,
    )  # fmt: skip
    return AutoConfig.for_model(**family("qwen3_vl_moe").tiny_hf_config(spec))


@pytest.mark.parametrize("control", [False, True])
def test_expert_adapters_read_per_expert_are_peft_s_updates(tmp_path: Path, control: bool) -> None:
    """peft's saved expert adapters, read per expert, give its ``get_delta_weight`` of every expert; written
    back they are the file's tensors, merged they are peft's merged weights (control: the other split of B)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mmpack.trainer.lora.export import merge_into, peft_tensors
    from mmpack.trainer.lora.peft_io import PeftTensors

    peft = need_import("peft", extra="test")
    assert peft.__version__.startswith("0.21")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForImageTextToText.from_config(_tiny_config())
    weights = {k: v.detach().clone() for k, v in base.state_dict().items()}
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"], target_parameters=PARAMETERS)
    model = get_peft_model(base, config)
    draw_adapters(model, 0)
    model.save_pretrained(tmp_path)
    read = PeftTensors(str(tmp_path))
    mlp = model.base_model.model.model.language_model.layers[1].mlp
    for wrapper, param in ((mlp.experts.base_layer, "gate_up_proj"), (mlp.experts, "down_proj")):
        assert wrapper.parameter_name == param
        expected = wrapper.get_delta_weight("default")  # [experts, out, in]
        name = f"model.layers.1.mlp.experts.{param}"
        a, b = read.read(name + ".lora_A.weight"), read.read(name + ".lora_B.weight")
        if control:  # B's columns taken expert-major: [out, experts, r]
            raw = load_file(str(tmp_path / "adapter_model.safetensors"))
            nest = ".base_layer" if param == "gate_up_proj" else ""
            flat = raw[f"base_model.model.model.language_model.layers.1.mlp.experts{nest}.lora_B.weight"]
            b = flat.reshape(flat.shape[0], -1, RANK).permute(1, 0, 2)
        ours = (ALPHA / RANK) * torch.bmm(b, a)
        assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-7) != control, param
    if control:
        return
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    back = peft_tensors({k: read.read(k) for k in read.tensors})
    assert back.keys() == saved.keys() and all(back[k].equal(saved[k]) for k in saved)
    merged = merge_into(weights, {k: read.read(k) for k in read.tensors}, ALPHA / RANK)
    peft_merged = model.merge_and_unload().state_dict()
    for key in ("gate_up_proj", "down_proj", "q_proj.weight"):
        key = f"model.language_model.layers.0.{'self_attn' if 'q_proj' in key else 'mlp.experts'}.{key}"
        assert not peft_merged[key].equal(weights[key])
        torch.testing.assert_close(merged[key], peft_merged[key], rtol=1e-6, atol=1e-7)


def test_expert_parameter_targets_are_named_as_peft_names_them() -> None:
    """``experts.gate_up_proj`` / ``mlp.experts.down_proj`` in --lora-target-modules are expert parameters
    (peft's target_parameters); a bare ``gate_up_proj`` or a parameter target of a dense model is one error."""
    from mmpack.trainer.lora.spec import LoraSpec, check_targets, resolve_spec, split_targets
    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    assert split_targets(("q_proj", "experts.gate_up_proj", "mlp.experts.down_proj", "down_proj")) == (
        ("q_proj", "down_proj"), ("experts.gate_up_proj", "mlp.experts.down_proj"))  # fmt: skip
    spec = resolve_spec(rank=4, alpha=8, dropout=None, targets=("q_proj", "experts.down_proj"), adapter=None)
    assert spec is not None and (spec.targets, spec.parameters) == (("q_proj",), ("experts.down_proj",))
    fam = family("qwen3_vl_moe")
    tiny = TinyModelSpec(
        vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502
    )
    arch = fam.arch_from_hf_config(fam.tiny_hf_config(tiny))
    rules = fam.hf.part_rules(arch, first=True, last=True, layers=(0, arch.num_layers))
    check_targets(
        LoraSpec(rank=2, alpha=4, targets=(), parameters=("layers.1.mlp.experts.down_proj",)), rules, "it"
    )
    with pytest.raises(ValueError, match=r"gate_up_proj name\(s\) the experts of it.*experts.gate_up_proj"):
        check_targets(LoraSpec(rank=2, alpha=4, targets=("gate_up_proj",)), rules, "it")
    with pytest.raises(
        ValueError, match=r"layers\.9\.mlp\.experts\.down_proj names no expert parameter of it"
    ):
        check_targets(LoraSpec(rank=2, alpha=4, parameters=("layers.9.mlp.experts.down_proj",)), rules, "it")
    with pytest.raises(ValueError, match="take no dropout"):
        LoraSpec(rank=2, alpha=4, dropout=0.1, parameters=("experts.down_proj",))


# -- parity at EP2 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny Qwen3-VL-MoE of tests/test_qwen3_vl_moe_trainer.py and the first four mllm_demo image records
    packed in two bins."""
    from mmpack.cli import main as mmpack

    need_shared(QWEN3_TOKENIZER, MLLM_DEMO_JSON, what="Qwen3 tokenizer and mllm_demo")
    root = tmp_path_factory.mktemp("lora-experts")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    hf_dir = qwen3_vl.tiny_hf_model(root / "hf", ids, "qwen3_vl_moe", num_experts=4, moe_router_topk=2,
                                    ffn_hidden_size=48, moe_aux_loss_coeff=0)  # fmt: skip
    packed = root / "packed"
    records = records_file(root, with_video=False)
    records.write_text("".join(records.read_text().splitlines(keepends=True)[:SAMPLES]))
    args = ["pack", "-i", str(records), "-o", str(packed), "-L", "320", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    assert (counts["bins"], counts["samples_packed"]) == (2, SAMPLES), counts
    return {"hf": hf_dir, "packed": packed}


def _peft_reference(hf_dir: Path, packed: Path, folder: Path) -> dict:
    """peft's adapter folder, loss and adapter gradients, its loss after one Adam step and (control) under
    another adapter init, with adapters on ``MODULES`` and the experts."""
    inputs = model_inputs_of(loader_samples(packed, [(True, False)] * SAMPLES, bins=2), seconds=False)
    return peft_reference(hf_dir, packed, inputs, MODULES, folder, parameters=PARAMETERS)


def _expert_grads(results: list[dict], etp: int) -> dict[tuple, object]:
    """Every expert adapter gradient by (layer, parameter, A/B, global expert): EP rank r (ranks r * etp ..,
    expert TP fastest) holds experts r * local onwards; the factor cut over expert TP (fc1's B by [gate; up]
    rows, fc2's A by columns) merged, the other one equal on every expert-TP rank."""
    import torch

    out: dict[tuple, object] = {}
    for ep in range(len(results) // etp):
        shards = [results[ep * etp + t]["grads"] for t in range(etp)]
        local = 1 + max(
            int(n.split(".local_experts.")[1].split(".")[0]) for n in shards[0] if ".local_experts." in n
        )
        for name in shards[0]:
            if ".local_experts." not in name:
                continue
            parts = [s[name] for s in shards]
            which, param = name.rsplit(".", 2)[-2:]
            if param == "gate_up_proj" and which == "lora_B":
                halves = [p.chunk(2) for p in parts]
                grad = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            elif param == "down_proj" and which == "lora_A":
                grad = torch.cat(parts, dim=1)
            else:
                assert all(p.equal(parts[0]) for p in parts), name
                grad = parts[0]
            layer = int(name.split(".layers.")[1].split(".")[0])
            expert = ep * local + int(name.split(".local_experts.")[1].split(".")[0])
            out[(layer, param, which[-1], expert)] = grad
    return out


@pytest.fixture(scope="module")
def peft_side(moe_setup: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    need_import("peft", extra="test")
    return _peft_reference(moe_setup["hf"], moe_setup["packed"], tmp_path_factory.mktemp("peft") / "adapter")


LAYOUTS = {"EP2": (1, 2, 1), "TP2xETP2": (2, 1, 2)}  # (TP, EP, expert TP) on two ranks


@pytest.fixture(scope="module", params=list(LAYOUTS))
def lora_step(request: pytest.FixtureRequest, peft_side: dict, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """mmpack's LoRA step from peft's folder on two ranks in a layout of ``LAYOUTS`` (EP2: DP2, a bin per rank;
    its checkpoint after the step saved): (layout, peft's side, every rank's result, the run's folder)."""
    from tests.support.lora_parity import run_lora_step

    tp, ep, etp = LAYOUTS[request.param]
    tmp_path, ref = tmp_path_factory.mktemp(request.param), peft_side
    args = [
        "--hf-model", str(ref["hf"]), "--data-path", str(ref["packed"]), "--tensor-model-parallel-size", str(tp),
        "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
        *(["--sequence-parallel"] if tp > 1 else []), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "0", "--log-interval", "1", "--num-workers", "0",
        *(["--save", str(tmp_path / "ckpt")] if ep > 1 else []),
    ]  # fmt: skip
    return request.param, ref, run_lora_step(ref, tmp_path, 2, args), tmp_path


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.family
@pytest.mark.slow
def test_expert_lora_equals_peft(lora_step) -> None:  # type: ignore[no-untyped-def]
    """EP2 and TP2 x expert TP2: loss, every adapter gradient and the loss after an Adam step are peft's."""
    from tests.support.lora_parity import LR, check_adapter_grads

    layout, ref, results, _ = lora_step
    tp, ep, etp = LAYOUTS[layout]
    print(f"{layout} experts: loss {results[-1]['loss']!r} / after {results[-1]['after']!r}; peft {ref['loss']!r} / "
          f"{ref['after']!r}; peft under another adapter init {ref['other_init']!r}")  # fmt: skip
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["after"] == pytest.approx(ref["after"], rel=1e-5)
        assert r["ok"] and r["lr"] == pytest.approx(LR)
        assert r["base_unchanged"] and not r["base_trainable"]
        assert r["lora_params"] and r["in_optimizer"] == r["lora_params"] == r["with_state"]
        # layers x (fc1, fc2) x (A, B) x the rank's experts
        assert sum(".local_experts." in n for n in r["lora_params"]) == 4 * 2 * 2 * (4 // ep)
    assert abs(ref["other_init"] - ref["loss"]) / ref["loss"] > 1e-3, "control: another init keeps the loss"
    assert abs(ref["after"] - ref["loss"]) / ref["loss"] > 1e-4, "the Adam step should move the loss"
    dense = [
        {**r, "grads": {n: g for n, g in r["grads"].items() if ".local_experts." not in n}} for r in results
    ]
    checked = check_adapter_grads(ref, dense, tp, 1)
    # peft's expert gradients: A [r * experts, in] (expert e: rows e*r ..), B [out, r * experts] (columns e, e + E ..)
    ours, worst = _expert_grads(results, etp), (0.0, 0.0)
    for (layer, param, which, expert), grad in ours.items():
        nest = ".base_layer" if param == "gate_up_proj" else ""
        full = ref["grads"][f"base_model.model.model.language_model.layers.{layer}.mlp.experts{nest}.lora_{which}.default.weight"]  # fmt: skip
        expected = (full.reshape(4, RANK, -1)[expert] if which == "A"
                    else full.reshape(full.shape[0], RANK, 4)[:, :, expert])  # fmt: skip
        norm_gap = float((grad - expected).norm() / expected.norm())
        entry_gap = float((grad - expected).abs().max() / expected.abs().max())
        assert norm_gap <= 1e-5 and entry_gap <= 1e-5, (layer, param, which, expert, norm_gap, entry_gap)
        worst = (max(worst[0], norm_gap), max(worst[1], entry_gap))
    assert len(ours) == 4 * 2 * 2 * 4  # layers x parameters x A/B x experts
    expert_tensors = sum(".experts." in k for k in ref["grads"])
    assert checked + expert_tensors == len(ref["grads"])
    print(f"{len(ours)} expert adapter gradients (of {expert_tensors} peft tensors); largest gaps {worst[0]:.2e} "
          f"in norm, {worst[1]:.2e} of the max")  # fmt: skip


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.family
@pytest.mark.slow
@pytest.mark.parametrize("lora_step", ["EP2"], indirect=True)
def test_expert_adapters_saved_at_ep2_export_to_peft_and_merged(lora_step) -> None:  # type: ignore[no-untyped-def]
    """The EP2 checkpoint (each rank's experts' adapters) read at EP1 by ``mmpack convert``: the PEFT folder
    loaded by peft, and the merged weights, give mmpack's loss after the step."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmpack.trainer.convert import mcore_to_hf
    from tests.support.hf_parity import loss_and_grads
    from tests.support.ranks import warm_start_method

    _, ref, results, tmp_path = lora_step
    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    mcore_to_hf(str(tmp_path / "ckpt"), str(peft_dir), lora_format="peft", start_method=warm_start_method())
    mcore_to_hf(str(tmp_path / "ckpt"), str(merged_dir), lora_format="merged", hf_model=str(ref["hf"]),
                start_method=warm_start_method())  # fmt: skip
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == (sorted(MODULES), sorted(PARAMETERS))
    inputs = model_inputs_of(loader_samples(ref["packed"], [(True, False)] * SAMPLES, bins=2), seconds=False)
    base = AutoModelForImageTextToText.from_pretrained(ref["hf"], dtype=torch.float32)
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        via_peft = loss_and_grads(PeftModel.from_pretrained(base, peft_dir), inputs)["loss"]
        via_merged = loss_and_grads(merged, inputs)["loss"]
    print(f"exported: peft {via_peft!r}, merged {via_merged!r}, mmpack {results[-1]['after']!r}")
    assert via_peft == pytest.approx(results[-1]["after"], rel=1e-5)
    assert via_merged == pytest.approx(results[-1]["after"], rel=1e-5)
