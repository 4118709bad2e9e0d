"""The LoRA parity harness (no tests here): peft's side (a model folder's transformers model under peft's LoRA,
its saved adapter folder, loss, adapter gradients and the loss after one Adam step), one LoRA training step of
mmpack from that folder on warm ranks (the worker is tests/test_trainer_lora.py) and the comparison of every
adapter gradient. Used by the dense (tests/test_trainer_lora.py) and the mixture-of-experts
(tests/test_qwen3_vl_moe_trainer.py) parity tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parents[1] / "test_trainer_lora.py"
ADAM = ["--weight-decay", "0", "--clip-grad", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8"]  # fmt: skip
LR = 0.003


def peft_model(  # type: ignore[no-untyped-def]
    hf_dir: Path, seed: int, targets: list[str], model_class: Any = None, parameters: list[str] | None = None
):
    """The model folder's transformers model (``model_class``; None: transformers' auto class) under peft's LoRA
    on ``targets`` and (``parameters``) peft's ``target_parameters`` (rank 4, alpha 8), every A and B drawn from
    ``seed`` (B nonzero, so that the adapters change the loss and every gradient is nonzero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = (model_class or AutoModelForImageTextToText).from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, target_parameters=parameters
    )
    model = get_peft_model(model, config)
    draw_adapters(model, seed)
    return model


def draw_adapters(model, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Every A and B of a peft model drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def peft_reference(
    hf_dir: Path, packed: Path, inputs: list, targets: list[str], folder: Path, model_class: Any = None,
    parameters: list[str] | None = None,
) -> dict:  # fmt: skip
    """peft's side of the parity for one model folder and its packed samples (``inputs``): the adapter folder,
    the loss and adapter gradients, the loss after one Adam step at ``LR`` and (control) the loss under another
    adapter init (``model_class``, ``parameters``: see :func:`peft_model`)."""
    import torch

    from tests.support.hf_parity import loss_and_grads

    model = peft_model(hf_dir, 0, targets, model_class, parameters)
    model.save_pretrained(folder)
    model.train()
    ref = loss_and_grads(model, inputs)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)
    adam = torch.optim.Adam(lora, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    adam.step()
    with torch.no_grad():
        ref["after"] = loss_and_grads(model, inputs)["loss"]
        draw_adapters(model, 1)
        ref["other_init"] = loss_and_grads(model, inputs)["loss"]
    return {**ref, "adapter": folder, "hf": hf_dir, "packed": packed}


def run_lora_step(ref: dict, tmp_path: Path, nproc: int, train_args: list[str], *extra: str) -> list[dict]:
    """One LoRA step of mmpack from peft's adapter folder (``train_args``: the layout, data and model flags) on
    ``nproc`` warm ranks: each rank's result (losses over the whole global batch, optimizer checks) and its
    adapter gradients."""
    import torch

    from tests.support.hf_parity import torchrun

    args = [*train_args, "--lora-adapter", str(ref["adapter"]), *ADAM, *extra]
    args[args.index("--lr") + 1] = str(LR)
    torchrun(nproc, [str(WORKER), str(tmp_path), *args], tmp_path)
    return [
        {
            **json.loads((tmp_path / f"result{r}.json").read_text()),
            "grads": torch.load(tmp_path / f"grads{r}.pt"),
            # by HF name, under the interleaved pipeline (the worker maps each model chunk's)
            **({"hf_grads": torch.load(p)} if (p := tmp_path / f"hf_grads{r}.pt").exists() else {}),
        }
        for r in range(nproc)
    ]


def check_adapter_grads(ref: dict, results: list[dict], tp: int, pp: int, max_entry_rel: float = 1e-5) -> int:
    """Every adapter gradient of every stage, TP shards merged, against peft's: the difference's norm within 1e-5
    of the gradient's norm and its largest entry within ``max_entry_rel`` of the gradient's largest entry (the
    first TP x PP ranks: DP rank 0); returns how many (and prints the largest gaps)."""
    from mmpack.trainer.lora.peft_io import merge_adapter_shards
    from mmpack.trainer.lora.spec import spellings
    from mmpack.trainer.models import family_of

    config = json.loads((ref["hf"] / "config.json").read_text())
    family = family_of(config)
    arch = family.arch_from_hf_config(config)
    peft_grads = {
        k.replace("base_model.model.", "", 1).replace(".default", ""): g for k, g in ref["grads"].items()
    }
    checked, worst, worst_norm = 0, (0.0, ""), 0.0
    for stage in range(pp):  # megatron-core's rank order: TP fastest
        if "hf_grads" in results[stage * tp]:  # the interleaved pipeline (TP1): already by HF name
            assert tp == 1
            grads = results[stage]["hf_grads"]
        else:
            grads = merge_adapter_shards(
                family.hf.stage_rules(arch, stage, pp), [results[stage * tp + t]["grads"] for t in range(tp)]
            )
        for name, grad in grads.items():
            module, tail = name.rsplit(".lora_", 1)
            [expected] = [
                peft_grads[k] for k in (f"{m}.lora_{tail}" for m in spellings(module)) if k in peft_grads
            ]
            scale = float(expected.abs().max())
            assert scale > 0, name
            diff = float((grad - expected).abs().max())
            norm_gap = float((grad - expected).norm() / expected.norm())
            assert diff <= max_entry_rel * scale and norm_gap <= 1e-5, (name, diff, scale, norm_gap)
            checked, worst, worst_norm = (
                checked + 1,
                max(worst, (diff / scale, name)),
                max(worst_norm, norm_gap),
            )
    print(
        f"{checked} adapter gradients; largest gaps {worst_norm:.2e} in norm, {worst[0]:.2e} of the max ({worst[1]})"
    )
    return checked


def check_lora_step(
    ref: dict, results: list[dict], tp: int, pp: int, layout: str, max_entry_rel: float = 1e-5
) -> None:
    """mmpack's step (``results``, every rank's) against peft's: the loss before and after the Adam step and
    every adapter gradient to 1e-5 (relative; ``max_entry_rel``: see :func:`check_adapter_grads`), the base
    weights bit-identical, the optimizer holding the adapters only; controls: another adapter init and the step
    itself move the loss by far more than that."""
    import pytest

    last = results[-1]  # the last stage computes the loss (every DP rank the whole batch's)
    print(
        f"{layout}: loss {last['loss']!r} / after {last['after']!r}; peft {ref['loss']!r} / {ref['after']!r}; "
        f"peft under another adapter init {ref['other_init']!r}"
    )
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert last["after"] == pytest.approx(ref["after"], rel=1e-5)
    gap = abs(ref["other_init"] - last["loss"]) / ref["loss"]
    assert gap > 1e-3, f"control: another adapter init moves the loss by only {gap:.2e}"
    assert abs(ref["after"] - ref["loss"]) / ref["loss"] > 1e-4, "the Adam step should move the loss"
    assert check_adapter_grads(ref, results, tp, pp, max_entry_rel) == len(ref["grads"])
    for r in results:
        assert r["ok"] and r["lr"] == pytest.approx(LR)
        assert r["base_unchanged"] and not r["base_trainable"]
        assert r["lora_params"] and r["in_optimizer"] == r["lora_params"] == r["with_state"]
