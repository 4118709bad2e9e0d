"""Model families are a registry (`mmpack.trainer.models.FAMILIES`): every family claims the config.json files
it reads and no other's (the MoE variants made from their dense family included), and a fake family
(`tests.support.fake_family`), known to nothing but one registry line, is chosen by `--model-type`, reads its
tiny config and trains a step on a packed dataset. Controls: without the registry line the family is unknown
to the registry and to the trainer's flags."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mmpack.trainer import models
from mmpack.trainer.models.protocol import TinyModelSpec
from tests.support import fake_family
from tests.support.trainer import ok, train

SPEC = TinyModelSpec(vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502)
RANK_ENTRY = Path(fake_family.__file__)  # each rank runs the trainer with the fake family registered


@pytest.fixture
def registered() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "FAMILIES", dict(models.FAMILIES))  # the registry as it was comes back after
        fake_family.register(models.FAMILIES)  # what the family needs: one line
        yield


def test_every_family_claims_its_own_configs_only() -> None:
    """Each registered family (MoE variants too) is the one family that claims its tiny config.json; a
    LLaVA-OneVision-1.5 config keeps its dense model_type with a Qwen3-MoE text model and is the MoE one's."""
    for name in models.FAMILIES:
        fam = models.family(name)
        config = fam.tiny_hf_config(SPEC)
        assert models.family_of(config) is fam, name
        arch = fam.arch_from_hf_config(config)
        assert (arch.moe is not None) == name.endswith("_moe"), name
    moe_1_5 = models.family("llavaonevision1_5_moe").tiny_hf_config(SPEC)
    assert moe_1_5["model_type"] == "llavaonevision1_5"
    with pytest.raises(ValueError, match=r"model_type 'qwen9_vl' is not supported \(known: .*qwen3_vl_moe"):
        models.family_of({**moe_1_5, "model_type": "qwen9_vl"})


def test_a_family_is_one_registry_line(registered: None) -> None:
    from mmpack.trainer.arguments import parse_args

    fam = models.family(fake_family.MODEL_TYPE)
    config = fam.tiny_hf_config(SPEC)
    assert fam is fake_family.FAMILY and models.family_of(config) is fam
    arch = fam.arch_from_hf_config(config)
    assert type(arch) is fake_family.FakeVLArch and arch.source["model_type"] == "fake_vl"
    assert parse_args(["--mock-data", "--model-type", "fake_vl"]).model.model_type == "fake_vl"


def test_control_without_the_line_the_family_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    from mmpack.trainer.arguments import parse_args

    config = fake_family.FAMILY.tiny_hf_config(SPEC)
    assert fake_family.MODEL_TYPE not in models.FAMILIES
    with pytest.raises(ValueError, match="model_type 'fake_vl' is not supported"):
        models.family_of(config)
    with pytest.raises(ValueError, match="model_type 'fake_vl' is not supported"):
        models.family(fake_family.MODEL_TYPE)
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--model-type", "fake_vl"])
    assert "invalid choice: 'fake_vl'" in capsys.readouterr().err


@pytest.mark.ranks
def test_the_fake_family_trains_a_step(packed_dataset: Callable[..., Path], tmp_path: Path) -> None:
    """One rank: a packed synthetic dataset, loaded with the fake family's position rule, one step of its tiny
    random model (size flags), a finite loss over target tokens."""
    data = packed_dataset(n_samples=40, seed=6)
    args = ["--model-type", "fake_vl", "--data-path", str(data), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1"]  # fmt: skip
    run = ok(train(1, args, tmp_path, entry=(str(RANK_ENTRY),)))
    [step] = run.train
    assert math.isfinite(step["loss"]) and step["target_tokens"] > 0
