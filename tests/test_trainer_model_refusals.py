"""Models that cannot be the one asked for are refused with one line, before any process starts: HF
weights that are not floats (int8) or not the tensors config.json describes (fewer layers in config.json, a
different size), and size flags that contradict the model a checkpoint or --hf-model fixes. Controls: the
untouched folder, and flags that agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config

SPECIAL = dict(vocab_size=256, image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)


def tiny_hf_config(**fields: int | bool) -> dict:
    return FAMILY.tiny_hf_config(TinyModelSpec(**SPECIAL | fields))  # type: ignore[arg-type]


def _save_hf_model(out: Path, *, tied: bool) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = tiny_hf_config(num_layers=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_hf_model(tmp_path_factory.mktemp("hf") / "model", tied=False)


def _copy(hf_dir: Path, dest: Path, *, config: dict | None = None, tensors: dict | None = None) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config or json.loads((hf_dir / "config.json").read_text())))
    save_file(tensors or load_file(str(hf_dir / "model.safetensors")), str(dest / "model.safetensors"))
    return dest


def _convert(hf: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """`mmpack convert hf-to-mcore`: it must fail (exit 2) with error lines, and write nothing."""
    from mmpack.cli import main as mmpack

    assert mmpack(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out)]) == 2
    assert not out.exists()
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("tied", [False, True])
def test_expected_tensors_are_what_transformers_writes(tmp_path: Path, tied: bool) -> None:
    """The oracle: transformers' own save_pretrained of the same config.json."""
    folder = _save_hf_model(tmp_path / "m", tied=tied)
    written = {k: tuple(v.shape) for k, v in load_file(str(folder / "model.safetensors")).items()}
    arch = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    assert FAMILY.hf.tensor_shapes(arch) == written
    FAMILY.hf.check_hf_weights(folder, arch)  # control: the untouched folder passes


def test_int8_weights_are_refused(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = load_file(str(hf_dir / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int8)
    errors = _convert(_copy(hf_dir, tmp_path / "int8", tensors=tensors), tmp_path / "out", capsys)
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        f"mmpack convert: error: {tmp_path / 'int8'}: tensor {name} is I8, not a float"
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("num_hidden_layers", 1, "the files hold 12 tensors it does not describe (model.layers.1."),
        ("num_hidden_layers", 3, "the files hold no model.layers.2."),
        ("intermediate_size", 128, "tensor model.layers.0.mlp.down_proj.weight is [64, 256], config.json"),
        ("num_key_value_heads", 1, "tensor model.layers.0.self_attn.k_proj.bias is [32],"),
    ],
)
def test_config_that_does_not_describe_the_weights_is_refused(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: int, expected: str
) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config["text_config"][field] = value
    errors = _convert(_copy(hf_dir, tmp_path / "cfg", config=config), tmp_path / "out", capsys)
    assert len(errors) == 1 and expected in errors[0], errors
    assert "config.json" in errors[0] and "the weights disagree" in errors[0]


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    from mmpack.trainer.pretrain_vlm import main

    code = main(["--mock-data", "--seq-length", "64", *argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_size_flags_contradicting_a_checkpoint_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer's entry point, up to the refusal (it comes before any process group)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "hf_config.json").write_text(json.dumps(tiny_hf_config(num_layers=4)))
    code, errors = _main(["--load", str(ckpt), "--num-layers", "8"], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0] == (
        f"pretrain_vlm: error: --num-layers contradicts the checkpoint of --load {ckpt} (its hf_config.json): "
        "num_layers 8 here, 4 there; drop the size flags (that model fixes the sizes) or train a new model "
        "without it"
    )
    code, errors = _main(["--load", str(ckpt), "--model-size", "small"], capsys)
    assert code == 2 and len(errors) == 1 and "--model-size small contradicts" in errors[0], errors
    assert "hidden_size 768 here, 64 there" in errors[0]


def test_size_flags_contradicting_hf_model_are_refused(
    hf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, errors = _main(["--hf-model", str(hf_dir), "--hidden-size", "128", "--num-layers", "2"], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert (
        f"--hidden-size contradicts --hf-model {hf_dir} (its config.json): hidden_size 128 here" in errors[0]
    )


def test_size_flags_that_agree_are_accepted(hf_dir: Path) -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.build import model_hf_config
    from mmpack.trainer.data import dataset_info

    cfg = parse_args(["--mock-data", "--seq-length", "64", "--hf-model", str(hf_dir), "--num-layers", "2",
                      "--hidden-size", "64"])  # fmt: skip
    assert model_hf_config(cfg, dataset_info(None, 64))["text_config"]["num_hidden_layers"] == 2


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_vl_weights_are_checked_by_name(tmp_path: Path, tied: bool) -> None:
    """A family without a shape table (Qwen3-VL) is checked by the HF names its weight rules read: exactly
    what transformers' save_pretrained writes (the oracle); a missing layer and an int8 tensor are refused."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen3_vl import FAMILY as QWEN3_VL

    spec = TinyModelSpec(**SPECIAL, num_layers=2, patch_size=16, tie_word_embeddings=tied)
    config = QWEN3_VL.tiny_hf_config(spec)
    torch.manual_seed(0)
    folder = tmp_path / "qwen3"
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).save_pretrained(folder)
    arch = QWEN3_VL.arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    QWEN3_VL.hf.check_hf_weights(folder, arch)  # control: what transformers wrote passes
    tensors = load_file(str(folder / "model.safetensors"))
    layer = [k for k in tensors if ".layers.1." in k and "language_model" in k]
    assert layer
    without = _copy(folder, tmp_path / "fewer", tensors={k: v for k, v in tensors.items() if k not in layer})
    with pytest.raises(ValueError, match="missing"):
        QWEN3_VL.hf.check_hf_weights(without, arch)
    int8 = dict(tensors)
    int8[layer[0]] = int8[layer[0]].to(torch.int8)
    with pytest.raises(ValueError, match="is I8, not a float"):
        QWEN3_VL.hf.check_hf_weights(_copy(folder, tmp_path / "int8", tensors=int8), arch)
