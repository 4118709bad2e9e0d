"""--freeze-vision, --freeze-llm, --trainable-modules: after one iteration at lr > 0 the frozen weights are
bit-identical to the --hf-model file and the trainable ones changed. Each run is the other's control: the
language model trains under --freeze-vision and stays put under --freeze-llm, the vision encoder the other way
round; the adapter-only run has a pipeline stage with nothing to train."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mmpack.trainer.freeze import MODULES, modules_of, param_trains, parse_modules, trainable_set
from tests.support.ranks import warm_start_method


def test_module_names_and_flags() -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.models import family

    qwen3_vl = dict(adapter_prefixes=family("qwen3_vl").adapter_prefixes)  # its DeepStack mergers too
    qwen2_5_vl = dict(adapter_prefixes=family("qwen2_5_vl").adapter_prefixes)
    assert modules_of("vision.merger.projector.encoder.linear_fc1.weight", tied=False, **qwen2_5_vl) == {
        "adapter"
    }
    assert modules_of("vision.layers.0.self_attention.linear_qkv.weight", tied=False, **qwen3_vl) == {
        "vision_model"
    }
    assert modules_of("vision.deepstack_mergers.1.norm.weight", tied=False, **qwen3_vl) == {"adapter"}
    # control: the family decides, another family's prefixes make the same name part of the vision model
    assert modules_of("vision.deepstack_mergers.1.norm.weight", tied=False, **qwen2_5_vl) == {"vision_model"}
    assert modules_of("vision.pos_embed.weight", tied=False, **qwen3_vl) == {"vision_model"}
    assert modules_of("language_model.output_layer.weight", tied=True, **qwen2_5_vl) == {
        "language_model", "embedding", "output_layer",
    }  # fmt: skip
    assert modules_of("language_model.output_layer.weight", tied=False, **qwen2_5_vl) == {
        "language_model", "output_layer",
    }  # fmt: skip
    allowed, frozen = trainable_set(("adapter", "language_model"), freeze_vision=False, freeze_llm=True)
    assert not param_trains("language_model.decoder.layers.0.mlp.linear_fc1.weight", tied=False,
                            allowed=allowed, frozen=frozen, **qwen2_5_vl)  # fmt: skip
    assert param_trains("vision.merger.ln_q.weight", tied=False, allowed=allowed, frozen=frozen, **qwen2_5_vl)
    assert not param_trains(
        "vision.patch_embed.weight", tied=False, allowed=allowed, frozen=frozen, **qwen2_5_vl
    )
    allowed, frozen = trainable_set(("embedding",), freeze_vision=False, freeze_llm=False)
    assert param_trains("language_model.output_layer.weight", tied=True, allowed=allowed, frozen=frozen,
                        **qwen2_5_vl)  # fmt: skip
    assert not param_trains("language_model.output_layer.weight", tied=False, allowed=allowed, frozen=frozen,
                            **qwen2_5_vl)  # fmt: skip

    cfg = parse_args(["--mock-data", "--seq-length", "64", "--trainable-modules", "adapter, language_model"])
    assert cfg.model.trainable_modules == ("adapter", "language_model")
    cfg = parse_args(["--mock-data", "--seq-length", "64", "--freeze-vision", "--freeze-llm"])
    assert (cfg.model.freeze_vision, cfg.model.freeze_llm, cfg.model.trainable_modules) == (True, True, None)
    assert parse_modules(MODULES) == MODULES
    with pytest.raises(ValueError, match=r"unknown module.*projector"):
        parse_args(["--mock-data", "--seq-length", "64", "--trainable-modules", "adapter,projector"])


def _hf_part(name: str) -> str:
    """adapter / vision_model / language_model of an HF Qwen2.5-VL tensor name."""
    if re.search(r"(^|\.)visual\.merger\.", name):
        return "adapter"
    if re.search(r"(^|\.)visual\.", name):
        return "vision_model"
    return "language_model"


@pytest.mark.ranks
@pytest.mark.slow
def test_frozen_weights_stay_bit_identical(tmp_path: Path, packed_dataset: Callable[..., Path]) -> None:
    from safetensors.torch import load_file

    from mmpack.trainer.convert import mcore_to_hf
    from tests.support.hf_parity import torchrun
    from tests.support.qwen2_5_vl import hf_model_for

    packed = packed_dataset(n_samples=40, seed=8, seq_len=256)
    hf_dir = hf_model_for(packed, tmp_path / "hf", tied=False)
    before = load_file(str(hf_dir / "model.safetensors"))
    common = [
        "-m", "mmpack.trainer.pretrain_vlm", "--hf-model", str(hf_dir), "--data-path", str(packed),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-2",
        "--num-workers", "0",
    ]  # fmt: skip
    runs = {  # name: (processes, flags, parts that must train)
        "adapter_pp2": (2, ["--pipeline-model-parallel-size", "2", "--trainable-modules", "adapter"],
                        {"adapter"}),
        "freeze_llm_tp2": (2, ["--tensor-model-parallel-size", "2", "--freeze-llm"],
                           {"adapter", "vision_model"}),
        "freeze_vision": (1, ["--freeze-vision"], {"adapter", "language_model"}),
    }  # fmt: skip
    for name, (nproc, flags, trains) in runs.items():
        ckpt = tmp_path / f"ckpt_{name}"
        proc = torchrun(nproc, [*common, *flags, "--save", str(ckpt)], tmp_path)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("trainable parameters:"))
        counts = [int(n.replace(",", "")) for n in re.findall(r"[\d,]{2,}", line)[:2]]
        expected = sum(t.numel() for k, t in before.items() if _hf_part(k) in trains)
        assert counts == [expected, sum(t.numel() for t in before.values())], (name, line)
        mcore_to_hf(str(ckpt), str(tmp_path / f"hf_{name}"), start_method=warm_start_method())
        after = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
        changed = {k for k in before if not after[k].equal(before[k])}
        frozen = {k for k in before if _hf_part(k) not in trains}
        assert not changed & frozen, (name, sorted(changed & frozen)[:5])
        unchanged_trainable = sorted(set(before) - frozen - changed)
        assert not unchanged_trainable, (name, unchanged_trainable[:5])
        print(f"{name}: {line}; {len(changed)} tensors changed, {len(frozen)} frozen bit-identical")


@pytest.mark.ranks
@pytest.mark.slow
def test_nothing_to_train_is_one_error(tmp_path: Path) -> None:
    from tests.support.trainer import train

    run = train(1, ["--mock-data", "--seq-length", "64", "--train-iters", "1", "--freeze-vision",
                    "--trainable-modules", "vision_model"], tmp_path)  # fmt: skip
    assert run.returncode != 0  # torchrun reports the worker's exit code 2 as a failure
    assert (
        "pretrain_vlm: error: no parameter trains with --freeze-vision --trainable-modules vision_model"
        in (run.stderr)
    )
    assert json.dumps(run.metrics) == "[]"


@pytest.mark.ranks
@pytest.mark.slow
def test_distributed_optimizer_with_an_idle_stage_is_refused_without_te(tmp_path: Path) -> None:
    """megatron-core's distributed optimizer asserts when checkpointing an empty shard on its torch-Adam path
    (no Transformer Engine / Apex): the adapter-only run at PP2 says so before training."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    from tests.support.trainer import train

    if HAVE_APEX_OR_TE:
        pytest.skip("Transformer Engine or Apex present: megatron-core checkpoints empty optimizer shards")
    run = train(2, ["--mock-data", "--seq-length", "64", "--train-iters", "1", "--pipeline-model-parallel-size",
                    "2", "--use-distributed-optimizer", "--trainable-modules", "adapter",
                    "--save", str(tmp_path / "ckpt")], tmp_path)  # fmt: skip
    assert run.returncode != 0 and run.metrics == []
    assert "--trainable-modules adapter leaves a TP x PP rank with nothing to train" in run.stderr
