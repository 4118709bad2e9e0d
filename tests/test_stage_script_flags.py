"""The flags of LLaVA-OneVision-2's stage scripts (examples/llava_onevision2/*/*.sh) and of its training guide's
8-GPU command: each one is accepted with its Megatron-LM meaning or refused in one line (docs/trainer-flags.md).

- every flag the four scripts pass parses (no argparse "unrecognized arguments");
- qwen3_4b/alignment.sh's flag set, paths and sizes replaced (TP2 x PP1 on two ranks, the script's PP=1
  layout), trains a tiny Qwen3-VL for two iterations on a real packed dataset and checks the tokenizer;
- the guide's command (world 8: TP2 x PP2 x DP2, --distributed-backend nccl) parses into that layout, and its
  flags (TP lowered to 1: world 4, the same --data-parallel-size 2) train on 4 CPU ranks;
- --split gives disjoint, complete, deterministic train/valid bins; the loader reads only its part;
- at lr 0, --custom-pipeline-layers 0,4 at PP2 (with per-stage full recompute) gives the even split's losses, and
  the eval of --split's valid part runs in both;
- each refused flag gives its one line.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mmpack.trainer.models.protocol import TinyModelSpec
from tests.support.trainer import REPO, ok, train

# every distinct flag of qwen3_4b/alignment.sh, qwen3_30b_a3b/instruct_780k.sh, quick_start_4b/quick_start.sh
# and quick_start_video_2b/instruct_video.sh (a value where the flag takes one)
SCRIPT_FLAGS: dict[str, str | None] = {
    "--model-name": "llava-onevision2-4b", "--tokenizer-type": "HFTokenizer", "--hf-tokenizer-path": "tok",
    "--data-path": "data", "--dataloader-type": "external", "--split": "100,0,0", "--num-workers": "2",
    "--chat-template": "qwen2-vl", "--enable-discard-sample": None, "--length-sort-pool-size": "0",
    "--training-phase": "sft", "--trainable-modules": "adapter", "--seq-length": "256",
    "--max-position-embeddings": "32768", "--init-method-std": "0.02", "--micro-batch-size": "1",
    "--global-batch-size": "8", "--lr": "1e-4", "--min-lr": "1e-6", "--clip-grad": "1.0", "--weight-decay": "0",
    "--optimizer": "adam", "--adam-beta1": "0.9", "--adam-beta2": "0.99", "--adam-eps": "1e-05",
    "--norm-epsilon": "1e-6", "--train-iters": "2", "--lr-decay-iters": "2", "--lr-decay-style": "cosine",
    "--lr-warmup-fraction": "0.002", "--initial-loss-scale": "65536", "--bf16": None, "--load": "ckpt",
    "--save": "ckpt", "--save-interval": "2000", "--ckpt-format": "torch", "--dataloader-save": "dl",
    "--ckpt-fully-parallel-load": None, "--recompute-granularity": "full", "--recompute-method": "uniform",
    "--recompute-num-layers": "1", "--custom-pipeline-recompute-layers": "1,1", "--custom-pipeline-layers": "16,32",
    "--attention-backend": "flash", "--moe-token-dispatcher-type": "alltoall", "--moe-per-layer-logging": None,
    "--pipeline-model-parallel-size": "2", "--tensor-model-parallel-size": "1", "--expert-model-parallel-size": "8",
    "--num-experts": "128", "--use-distributed-optimizer": None, "--distributed-backend": "nccl",
    "--moe-router-topk": "8", "--moe-aux-loss-coeff": "0.01", "--log-interval": "1", "--tensorboard-dir": "tb",
    "--log-timers-to-tensorboard": None, "--wandb-project": "p", "--wandb-exp-name": "n",
}  # fmt: skip

REFUSED = {
    "--training-phase pretrain": "--training-phase pretrain is not supported: the loss mask is fixed when packing",
    "--dataloader-type cyclic": "--dataloader-type cyclic is not supported: mmpack reads packed bins",
    "--optimizer sgd": "--optimizer sgd is not supported: mmpack trains with megatron-core's Adam",
    "--tokenizer-type NullTokenizer": "--tokenizer-type NullTokenizer is not supported: the tokens come",
    "--ckpt-format zarr": "--ckpt-format zarr is not supported: mmpack writes torch_dist",
    "--chat-template llama3": "--chat-template llama3: mmpack applies the chat template when packing",
}

SIZES = [
    "--model-type", "qwen3_vl", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--vision-num-layers", "1", "--vision-hidden-size", "32",
    "--vision-num-attention-heads", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def packed(packed_dataset: Callable[..., Path]) -> Path:
    return packed_dataset(n_samples=48, seed=3)


def test_every_script_flag_parses() -> None:
    from mmpack.trainer.arguments import build_parser

    parser = build_parser()
    for flag, value in SCRIPT_FLAGS.items():
        _, unknown = parser.parse_known_args([flag] if value is None else [flag, value])
        assert unknown == [], flag
    # Megatron-LM's space-separated module list, as the instruct scripts pass it
    args = parser.parse_args(["--trainable-modules", "language_model", "adapter", "vision_model"])
    assert args.trainable_modules == ["language_model", "adapter", "vision_model"]


def _alignment_argv(data: Path, out: Path) -> list[str]:
    """qwen3_4b/alignment.sh's flags in its order, with paths and sizes replaced (TP 2, PP 1: the script adds
    no --custom-pipeline-layers then; 2 iterations, global batch 2, sequence length of the dataset)."""
    return [
        "--model-name", "llava-onevision2-4b",
        "--tokenizer-type", "HFTokenizer", "--hf-tokenizer-path", str(data.parent / "tokenizer"),
        "--data-path", str(data), "--dataloader-type", "external", "--split", "100,0,0", "--num-workers", "1",
        "--chat-template", "qwen2-vl",
        "--training-phase", "sft", "--trainable-modules", "adapter", "--seq-length", "256",
        "--max-position-embeddings", "32768", "--init-method-std", "0.02", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1.0e-4", "--min-lr", "1.0e-6", "--clip-grad", "1.0",
        "--weight-decay", "0", "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.99",
        "--adam-eps", "1e-05", "--norm-epsilon", "1e-6", "--train-iters", "2", "--lr-decay-iters", "2",
        "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.002", "--initial-loss-scale", "65536", "--bf16",
        "--load", str(out / "init"), "--save", str(out / "ckpt"), "--save-interval", "2000",
        "--ckpt-format", "torch", "--dataloader-save", str(out / "ckpt" / "dataloader"),
        "--attention-backend", "flash", "--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "2",
        "--use-distributed-optimizer", "--distributed-backend", "nccl",
        "--log-interval", "1", "--tensorboard-dir", str(out / "tb"), "--log-timers-to-tensorboard",
    ]  # fmt: skip


@pytest.mark.ranks
def test_alignment_flag_set_trains(packed: Path, tmp_path: Path) -> None:
    run = ok(train(2, [*SIZES, *_alignment_argv(packed, tmp_path)], tmp_path, tiny=False))
    assert [m["iteration"] for m in run.train] == [1, 2]
    assert all(np.isfinite(m["loss"]) for m in run.train)
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
    notes = [line for line in run.stderr.splitlines() if line.startswith("pretrain_vlm: ")]
    assert any("--distributed-backend nccl: no CUDA here, running gloo" in n for n in notes), notes
    assert any("--ckpt-format torch: mmpack writes megatron-core's torch_dist" in n for n in notes), notes
    assert "with --trainable-modules adapter" in run.stdout + run.stderr
    # the tokenizer check can fail: a tokenizer other than the packing one is refused, naming the flag
    from mmpack.dataloader import load_manifest
    from mmpack.demo.synthetic import train_tiny_bpe
    from mmpack.trainer.stage_flags import StageFlags, check_stage_flags

    manifest = load_manifest(str(packed)).raw
    check_stage_flags(StageFlags(hf_tokenizer_path=str(packed.parent / "tokenizer")), manifest, data_path="d")
    other = train_tiny_bpe(tmp_path / "other", seed=5)
    with pytest.raises(ValueError, match=r"^--hf-tokenizer-path .* is not the tokenizer d was packed with"):
        check_stage_flags(StageFlags(hf_tokenizer_path=str(other)), manifest, data_path="d")


@pytest.mark.ranks
def test_guide_command_parses_at_world_8_and_trains_at_world_4(tmp_path: Path) -> None:
    """torchrun --nproc_per_node 8 ... --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --data-parallel-size 2 --distributed-backend nccl, with a tiny model on synthetic batches: it parses into
    TP2 x PP2 x DP2 at world 8; the same flags with TP lowered to 1 (world 4, still --data-parallel-size 2: the
    suite's one 8-rank run is tests/test_trainer_parallel.py's) train two iterations on 4 CPU ranks (gloo, one
    warning line); a --data-parallel-size the launch does not give is refused."""
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.config import build_megatron_configs
    from mmpack.trainer.models import family

    argv = ["--mock-data", "--seq-length", "256", *SIZES, "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--distributed-backend", "nccl"]  # fmt: skip
    run = ok(train(4, [*argv, "--tensor-model-parallel-size", "1", "--num-workers", "0", "--train-iters", "2",
                       "--global-batch-size", "4"], tmp_path, tiny=False))  # fmt: skip
    assert [m["iteration"] for m in run.train] == [1, 2]
    assert "world 4 = TP 1 x PP 2 x DP 2" in run.stdout
    warnings = [line for line in run.stderr.splitlines() if "--distributed-backend nccl" in line]
    assert warnings == [
        "pretrain_vlm: warning: --distributed-backend nccl: no CUDA here, running gloo on CPU"
    ]
    cfg = parse_args(argv)
    assert cfg.parallel.data_parallel_size(8) == 2
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 does not match the launch: world size 16"):
        cfg.parallel.data_parallel_size(16)
    assert parse_args([*argv, "--tensor-model-parallel-size", "1"]).parallel.data_parallel_size(4) == 2
    fam = family("qwen3_vl")
    arch = fam.arch_from_hf_config(fam.tiny_hf_config(_tiny_spec()))
    lang = build_megatron_configs(cfg, arch).language
    assert (lang.tensor_model_parallel_size, lang.pipeline_model_parallel_size) == (2, 2)


def _tiny_spec() -> TinyModelSpec:
    return TinyModelSpec(vocab_size=512, image_token_id=5, vision_start_token_id=6, vision_end_token_id=7,
                         num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         ffn_hidden_size=None, vision_depth=1, vision_hidden_size=32, vision_num_heads=2,
                         patch_size=14, merge_size=2)  # fmt: skip


def test_stage_flags_map_onto_megatron_core() -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.config import build_megatron_configs
    from mmpack.trainer.models import family

    fam = family("qwen3_vl")
    arch = fam.arch_from_hf_config(fam.tiny_hf_config(_tiny_spec()))
    base = ["--mock-data", "--seq-length", "256", *SIZES, "--pipeline-model-parallel-size", "2"]
    cfg = parse_args([*base, "--custom-pipeline-layers", "0,4", "--recompute-granularity", "full",
                      "--recompute-method", "block", "--custom-pipeline-recompute-layers", "0,3"])  # fmt: skip
    assert cfg.parallel.stage_layer_counts(4) == [0, 4]
    for rank, layers in ((0, 0), (1, 3)):
        lang = build_megatron_configs(cfg, arch, pipeline_rank=rank).language
        assert str(lang.pipeline_model_parallel_layout) == str(cfg.parallel.pipeline_layout())
        assert cfg.parallel.pipeline_layout() == "E|ttttL"
        assert (lang.recompute_granularity, lang.recompute_method, lang.recompute_num_layers) == ("full", "block", layers)  # fmt: skip
    assert (
        parse_args([*base, "--lr-warmup-fraction", "0.25", "--train-iters", "8"]).optim.lr_warmup_fraction
        == 0.25
    )
    bad = {
        "--custom-pipeline-layers 1,1,2": "one layer count >= 0 per pipeline stage",
        "--recompute-granularity full": "needs --recompute-method",
        "--recompute-method block": "need --recompute-granularity full",
        "--lr-warmup-fraction 0.1 --lr-warmup-iters 3": "not both",
    }
    for flags, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_args([*base, *flags.split()])
    with pytest.raises(ValueError, match="sums to 5; the model has 4"):
        parse_args([*base, "--custom-pipeline-layers", "1,4"]).parallel.stage_layer_counts(4)
    four = parse_args([*base[:-1], "4", "--custom-pipeline-layers", "8,7,6,5"])  # any split, as in the fork
    assert four.parallel.stage_layer_counts(26) == [8, 7, 6, 5]


@pytest.mark.slow
def test_refused_flags_give_one_line() -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.stage_flags import StageFlagRefused

    for flags, line in REFUSED.items():
        with pytest.raises(StageFlagRefused) as e:
            parse_args(["--mock-data", "--seq-length", "64", *flags.split()])
        assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
    proc = subprocess.run(
        [sys.executable, "-m", "mmpack.trainer.pretrain_vlm", "--mock-data", "--seq-length", "64",
         "--optimizer", "sgd"],
        cwd=REPO, capture_output=True, text=True, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"pretrain_vlm: error: {REFUSED['--optimizer sgd']}"), lines


def test_length_sort_pool_turns_on_compute_balance() -> None:
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.stage_flags import StageFlags

    base = ["--mock-data", "--seq-length", "64"]
    assert parse_args(base).data.balance == "none"
    pooled = parse_args([*base, "--length-sort-pool-size", "1000"])
    assert pooled.data.balance == "compute" and pooled.stage.length_sort_pool_size == 1000
    assert parse_args([*base, "--length-sort-pool-size", "1000", "--balance", "none"]).data.balance == "none"
    assert parse_args([*base, "--length-sort-pool-size", "0"]).data.balance == "none"
    (note,) = pooled.stage.notes(on_cpu=True, balance="compute")
    assert note.startswith("--length-sort-pool-size 1000: no pool of samples is sorted") and "compute" in note
    assert StageFlags().notes(on_cpu=True) == []
    with pytest.raises(ValueError, match="--length-sort-pool-size must be >= 0"):
        parse_args([*base, "--length-sort-pool-size", "-1"])


def test_split_bins_disjoint_complete_deterministic(packed: Path) -> None:
    from mmpack.dataloader import Topology, build_loader, load_manifest
    from mmpack.dataloader.order import split_bins

    n = load_manifest(str(packed)).num_bins
    parts = split_bins(n, (8, 2, 0), seed=1234)
    assert [len(p) for p in parts] == [round(0.8 * n), n - round(0.8 * n), 0]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    assert all(np.array_equal(a, b) for a, b in zip(parts, split_bins(n, (8, 2, 0), seed=1234)))
    assert not np.array_equal(parts[1], split_bins(n, (8, 2, 0), seed=1)[1])  # the seed moves it
    assert [len(p) for p in split_bins(1000, (969, 30, 1), seed=0)] == [969, 30, 1]  # Megatron's rounding

    def epoch_bins(part: int, order_seed: int) -> list[int]:
        loader = build_loader(str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1,
                              global_batch_size=1, seed=order_seed, num_workers=0,
                              split=((8, 2, 0), part, 1234))  # fmt: skip
        it = iter(loader)
        seen = [int(next(it).bin_ids[0]) for _ in range(loader.epoch_bins)]
        loader.close()
        assert loader.state_dict()["split"] == f"8,2,0:{('train', 'valid')[part]}"
        return seen

    # as the trainer builds them: the eval loader orders its bins with another seed, splits with the same
    train_bins, valid_bins = epoch_bins(0, 1234), epoch_bins(1, 1235)
    assert sorted(train_bins) == parts[0].tolist() and sorted(valid_bins) == parts[1].tolist()
    assert not set(train_bins) & set(valid_bins)


@pytest.mark.ranks
def test_uneven_pipeline_equals_even_at_lr0_and_split_eval_runs(packed: Path, tmp_path: Path) -> None:
    common = [*SIZES, "--data-path", str(packed), "--pipeline-model-parallel-size", "2", "--lr", "0",
              "--min-lr", "0", "--train-iters", "2", "--global-batch-size", "2", "--split", "8,2,0",
              "--eval-interval", "2", "--eval-iters", "1"]  # fmt: skip
    uneven = ok(train(2, [*common, "--custom-pipeline-layers", "0,4", "--recompute-granularity", "full",
                          "--recompute-method", "block", "--custom-pipeline-recompute-layers", "0,2"],
                      tmp_path / "uneven", tiny=False))  # fmt: skip
    even = ok(train(2, common, tmp_path / "even", tiny=False))
    assert (
        "language layers per stage 0,4 |" in uneven.stdout
        and "language layers per stage 2,2 |" in even.stdout
    )
    assert len(uneven.losses()) == 2 and len(uneven.evals) == 1 == len(even.evals)
    assert uneven.losses() == pytest.approx(even.losses(), rel=1e-6, abs=0)
    assert uneven.evals[0]["eval_loss"] == pytest.approx(even.evals[0]["eval_loss"], rel=1e-6, abs=0)
    # the comparison can fail: the two steps read other bins and their losses differ by far more
    a, b = even.losses()
    assert abs(a - b) > 1e-3 * abs(a)


@pytest.mark.parametrize(
    ("script", "trains"),
    [("llava_onevision2_align.sh", {"adapter"}),
     ("llava_onevision2_midtrain.sh", {"adapter", "vision_model", "language_model"}),
     ("llava_onevision2_instruct.sh", {"adapter", "vision_model", "language_model"})],
)  # fmt: skip
def test_onevision2_recipes_parse(tmp_path: Path, script: str, trains: set[str]) -> None:
    """Each recipe's command line (launched through a stand-in for torchrun that records it) parses into its
    stage; MODEL_TYPE picks the family (qwen3_vl here)."""
    import json
    import os

    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.freeze import trainable_set

    record, launcher = tmp_path / "argv.json", tmp_path / "launcher.py"
    launcher.write_text(f"import json, sys\nopen({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    env = {**os.environ, "TORCHRUN": f"{sys.executable} {launcher}", "MODEL_TYPE": "qwen3_vl", "PP": "2",
           "CUSTOM_PIPELINE_LAYERS": "0,4"}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO / "trainer" / "examples" / script), "first", "packed/", "out/"],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(record.read_text())[4:]  # after --nproc_per_node 8 -m mmpack.trainer.pretrain_vlm
    cfg = parse_args(argv)
    assert cfg.model.model_type == "qwen3_vl" and cfg.parallel.custom_pipeline_layers == (0, 4)
    assert cfg.data.split == (100.0, 0.0, 0.0) and cfg.checkpoint.save == "out/"
    allowed, frozen = trainable_set(
        cfg.model.trainable_modules, freeze_vision=cfg.model.freeze_vision, freeze_llm=cfg.model.freeze_llm
    )
    assert {
        m for m in ("adapter", "vision_model", "language_model") if m in allowed and m not in frozen
    } == trains
    if script == "llava_onevision2_align.sh":
        assert cfg.model.hf_model == "first" and cfg.stage.hf_tokenizer_path == "first"
    else:
        assert cfg.checkpoint.load == "first" and cfg.checkpoint.finetune
        assert cfg.train.recompute_granularity == "full" and cfg.train.recompute_num_layers == 1
    assert cfg.data.balance == ("compute" if script == "llava_onevision2_instruct.sh" else "none")
