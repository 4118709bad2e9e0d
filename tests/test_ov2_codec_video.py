"""LLaVA-OneVision-2's codec-stream video (`cv-preinfer` folders) against the preprocessor's own model-side
values (../shared/data/ov2_codec_demo: canvases, positions and meta.json made by codec-video-prep 0.2.5, and per
video the expected block-ordered positions, timestamp runs and token ids its integration functions give):
`mmpack pack` with a OneVision-2 model folder (Qwen2-VL's chat template) writes each demo video's sample with
exactly those ids, refuses bad assets with a reason, and the loader hands the tower one grid row per video and
the block-ordered source positions."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.support.fixtures_chat import QWEN2_VL_CHAT_TEMPLATE
from tests.support.onevision import VIDEO_IMAGE_CONFIG
from tests.support.shared import QWEN3_TOKENIZER, SHARED_DIR, need_shared
from tests.support.storage_servers import moto_s3

pytestmark = [pytest.mark.family, pytest.mark.shared]

CODEC_DEMO = SHARED_DIR / "data" / "ov2_codec_demo"
DEMOS = ("1", "1_fixed", "2", "3")
USER, ANSWER = "<video>\nDescribe the video.", "A short answer."  # the chat of expected.json
MOE_BIN_TOKENS = 1024  # the mixed records in two bins


def _expected(name: str) -> dict:
    return json.loads((CODEC_DEMO / name / "expected.json").read_text())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A OneVision-2 model folder as the packer reads it, with Qwen2-VL's chat template."""
    need_shared(QWEN3_TOKENIZER, CODEC_DEMO, what="the codec demo assets and the Qwen3 tokenizer")
    out = tmp_path_factory.mktemp("ov2_codec_folder")
    (out / "config.json").write_text(json.dumps({"model_type": "llava_onevision2"}))
    (out / "preprocessor_config.json").write_text(json.dumps(VIDEO_IMAGE_CONFIG))
    (out / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    shutil.copy(QWEN3_TOKENIZER, out / "tokenizer.json")
    shutil.copy(QWEN3_TOKENIZER.parent / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def test_block_order_and_runs_equal_the_preprocessors(folder: Path) -> None:
    """Per demo video: the blob's block-ordered positions are the preprocessor's, byte for byte; the runs are
    expected.json's. Control: the runs of the row-major positions are its negative-test count."""
    from mmpack.offline_packing.inputs.codec_assets import codec_blob, read_codec_folder
    from mmpack.packing.video_codec_ov2 import read_codec_blob, timestamp_runs, timestamp_text

    for name in DEMOS:
        exp, path = _expected(name), CODEC_DEMO / name
        info = read_codec_folder(str(path), name=name)["codec"]
        runs = [[timestamp_text(t / info["fps"]), n] for t, n in info["runs"]]
        assert runs == exp["runs"] and len(info["kept"]) == exp["num_canvases"], name
        canvases, positions = read_codec_blob(codec_blob(str(path), name=name), name)
        assert len(canvases) == exp["num_canvases"]
        assert canvases[0] == (path / exp["canvas_files"][0]).read_bytes()  # kept as read
        assert np.array_equal(positions, np.load(path / exp["positions_block_order_file"])), name
        row_major = np.load(path / exp["src_positions_file"])
        wrong = [n for _, n in timestamp_runs(row_major) if n > 0]  # runs under one token are no block
        assert len(wrong) == exp["num_runs_if_row_major_positions_were_used"] != len(runs)


def _bad_variant(root: Path, name: str, edit_meta=None, edit_positions=None) -> str:  # type: ignore[no-untyped-def]
    """A one-group copy of demo 3 (4 canvases) under `root/name`, its meta.json or positions edited."""
    src, out = CODEC_DEMO / "3", root / name
    out.mkdir()
    meta = json.loads((src / "meta.json").read_text())
    meta["canvas_files"] = meta["canvas_files"][:4]
    for f in meta["canvas_files"]:
        shutil.copy(src / f, out / f)
    positions = np.load(src / "src_patch_position.npy")[: 4 * 720]
    (edit_meta or (lambda m: None))(meta)
    positions = edit_positions(positions) if edit_positions else positions
    (out / "meta.json").write_text(json.dumps(meta))
    np.save(out / "src_patch_position.npy", positions)
    return name


def _padding_at(canvas: int, patches: slice):  # type: ignore[no-untyped-def]
    def edit(p: np.ndarray) -> np.ndarray:
        p = p.copy()
        p[canvas * 720 : (canvas + 1) * 720][patches] = -1
        return p

    return edit


@pytest.fixture(scope="module")
def packed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mmpack pack --model DIR` of one record per demo video, a one-group video whose last canvas is all
    padding, and the bad assets."""
    from mmpack.cli import main as mmpack

    root = tmp_path_factory.mktemp("codec_pack")
    for name in DEMOS:
        shutil.copytree(CODEC_DEMO / name, root / name, ignore=shutil.ignore_patterns("*.json", "*order.npy"))
        meta = json.loads((CODEC_DEMO / name / "meta.json").read_text())
        (root / name / "meta.json").write_text(json.dumps(meta))
    good = [*DEMOS, _bad_variant(root, "dropped", edit_positions=_padding_at(3, slice(None)))]
    bad = {
        "partly": _bad_variant(root, "partly", edit_positions=_padding_at(1, slice(0, 4))),
        "short": _bad_variant(root, "short", edit_positions=lambda p: p[:-4]),
        "nofps": _bad_variant(root, "nofps", edit_meta=lambda m: m.pop("fps")),
        "blocks": _bad_variant(root, "blocks", edit_meta=lambda m: m.update(block_size=4)),
    }
    chat = lambda user: [{"role": "user", "content": user}, {"role": "assistant", "content": ANSWER}]  # noqa: E731
    records = [{"id": n, "messages": chat(USER), "videos": [n]} for n in good]
    records += [{"id": k, "messages": chat(USER), "videos": [v]} for k, v in bad.items()]
    records += [{"id": "nonewline", "messages": chat("<video>Describe the video."), "videos": ["3"]}]
    meta = json.loads((CODEC_DEMO / "3" / "meta.json").read_text())
    canvases = [f"3/{f}" for f in meta["canvas_files"]]  # the training form of demo 3: its canvases as images
    form = {"images": canvases, "patch_positions": "3/src_patch_position.npy", "fps": [meta["fps"]]}
    tags = "<image>\n" * len(canvases)
    records += [{"id": "training_form", "messages": chat(tags + "Describe the video."), **form}]
    gap = tags.replace("\n", "\nand ", 1) + "Describe it."  # text between the tags: a reject
    records += [{"id": "form_gap", "messages": chat(gap), **form}]
    (root / "records.json").write_text(json.dumps(records))
    out = root / "packed"
    args = ["pack", "-i", str(root / "records.json"), "-o", str(out), "-L", "9000", "--model", str(folder)]
    assert mmpack([*args, "--no-progress"]) == 0
    return out


def _samples(packed: Path) -> dict[str, tuple[list[int], dict]]:
    """sample id -> (its token ids, its video plan) over every bin of the dataset."""
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader

    out = {}
    for shard in load_manifest(str(packed)).shards:
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        for i in range(shard.bins):
            rec = reader.read(i)
            ids, starts = np.asarray(rec["input_ids"]).tolist(), np.cumsum([0, *rec["seq_lens"]]).tolist()
            plans = iter(rec["video_plans"])
            for sid, (a, b) in zip(rec["sample_ids"], itertools.pairwise(starts)):
                out[sid] = (ids[a:b], next(plans))
        reader.close()
    return out


def test_packed_ids_equal_the_preprocessors_and_bad_assets_are_rejects(packed: Path) -> None:
    """Every demo video's packed sample holds expected.json's token ids (timestamp text included), its plan one
    grid row for its canvases; an all-padding canvas is dropped; bad assets are `codec_video` rejects naming
    what is wrong."""
    samples = _samples(packed)
    for name in DEMOS:
        exp = _expected(name)
        ids, plan = samples[name]
        assert ids == exp["input_ids"], name
        assert plan["grid_thw"] == [exp["num_canvases"], *exp["image_grid_thw"][0][1:]]
        assert (
            len(plan["run_tokens"]) == exp["num_runs"] and plan["num_tokens"] == exp["num_image_pad_tokens"]
        )
    assert samples["dropped"][1]["grid_thw"] == [3, 20, 36]
    assert sum(samples["dropped"][1]["run_tokens"]) == 3 * 180
    rejects = [json.loads(line) for line in (packed / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["codec_video"] * 6
    messages = [r["message"] for r in rejects]
    for key, words in {
        "partly": "canvas 1 is partly padding",
        "short": "is int32 (2876, 3)",
        "nofps": "no positive fps",
        "blocks": "4x4 patch blocks",
        "form_gap": "text between the canvases' <image> tags",
    }.items():
        assert any(f"codec video {key}:" in m and words in m for m in messages), (key, messages)
    assert any("newline right after the <video>" in m for m in messages), messages


def test_training_form_packs_as_the_folder_form(packed: Path) -> None:
    """LLaVA-OneVision-2's training form of demo 3 (its canvases as the record's images, one <image> each, the
    row-major positions `.npy`, the fps) packs to the folder form's sample: expected.json's ids, the same plan
    and the same stored canvases and block-ordered positions."""
    from mmpack.packing.video_codec_ov2 import read_codec_blob

    samples = _samples(packed)
    (ids, plan), (folder_ids, folder_plan) = samples["training_form"], samples["3"]
    assert ids == folder_ids == _expected("3")["input_ids"]
    same = lambda p: {k: v for k, v in p.items() if k not in ("source", "sample_id")}  # noqa: E731
    assert same(plan) == same(folder_plan)
    blobs = _video_blobs(packed)
    (form_canvases, form_positions), (canvases, positions) = (
        read_codec_blob(blobs[k], k) for k in ("training_form", "3")
    )
    assert form_canvases == canvases and np.array_equal(form_positions, positions)
    assert np.array_equal(positions, np.load(CODEC_DEMO / "3" / "patch_positions_block_order.npy"))


def test_loader_hands_one_grid_row_and_source_positions(packed: Path) -> None:
    """The loader's micro-batch of a codec video: one grid row [N, h, w] for its canvases, the canvases'
    patches in order, and the patch positions the preprocessor's block-ordered source positions (not the
    canvas grid's own)."""
    from PIL import Image

    from mmpack.dataloader import Topology, build_loader
    from mmpack.packing.batch import contract_problems
    from mmpack.packing.image_tokens import ImageTokenRule, image_to_patches
    from mmpack.packing.patch_positions import TextPositionRule, block_patch_positions

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=1, num_epochs=1, position_rule=TextPositionRule(merge_size=2),
    )  # fmt: skip
    seen = 0
    rule = ImageTokenRule(patch_size=14, merge_size=2, temporal_patch_size=1)
    for batch in loader:
        assert contract_problems(batch) == []
        grids = batch.image_grid_thw.tolist()
        at = 0
        for t, h, w in grids:
            rows = slice(at, at + t * h * w)
            positions = batch.patch_positions[rows].numpy()
            name = next(
                (n for n in DEMOS if positions.shape == np.load(CODEC_DEMO / n / "patch_positions_block_order.npy").shape
                 and np.array_equal(positions, np.load(CODEC_DEMO / n / "patch_positions_block_order.npy"))),
                None,
            )  # fmt: skip
            if name is not None:
                exp = _expected(name)
                assert [t, h, w] == [exp["num_canvases"], *exp["image_grid_thw"][0][1:]]
                # control: the canvas grid's own positions are not these
                assert not np.array_equal(positions, block_patch_positions(np.asarray([[t, h, w]]), 2))
                with Image.open(CODEC_DEMO / name / exp["canvas_files"][-1]) as img:
                    last = image_to_patches(img, rule, grid_thw=(1, h, w))
                assert np.array_equal(batch.pixel_values[rows][-h * w :].numpy(), last)
                seen += 1
            at += t * h * w
    loader.close()
    assert seen == len(DEMOS) + 1  # and demo 3's training form


def _oracle():  # type: ignore[no-untyped-def]
    """The preprocessor's model-side functions (../shared/reference/codec_video_prep, a test oracle), loaded as
    its SOURCE.md says: the wheel it imports at the top is stubbed, none of its functions needs it."""
    import importlib.util
    import sys
    import types

    sys.modules.setdefault("codec_video_prep", types.SimpleNamespace(run_preinfer=None))  # type: ignore[arg-type]
    path = SHARED_DIR / "reference" / "codec_video_prep" / "llava_onevision.py"
    spec = importlib.util.spec_from_file_location("cvp_llava_oracle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _mixed_bin(root: Path, hf_dir: Path, *, length: int = 2048, bins: int = 1) -> Path:
    """A codec video (a one-group copy of demo 3, its last canvas all padding), a frame-path video and an
    image, packed with the tiny model folder into bins of ``length`` tokens (``bins`` of them)."""
    from mmpack.cli import main as mmpack
    from tests.support.shared import MLLM_DEMO_JSON, VIDEO_DEMO

    need_shared(VIDEO_DEMO, MLLM_DEMO_JSON, what="mllm_video_demo and mllm_demo")
    _bad_variant(root, "codec", edit_positions=_padding_at(3, slice(None)))
    shutil.copy(VIDEO_DEMO / "mllm_demo_data" / "2.avi", root / "2.avi")
    shutil.copy(MLLM_DEMO_JSON.parent / "mllm_demo_data" / "1.jpg", root / "1.jpg")
    chat = lambda user, answer: [  # noqa: E731
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    records = [
        {"id": "codec", "messages": chat("<video>\nWhat happens?", "People walk by."), "videos": ["codec"]},
        {"id": "frames", "messages": chat("<video>What moves?", "A cat."), "videos": ["2.avi"]},
        {"id": "image", "messages": chat("<image>What is it?", "A photo."), "images": ["1.jpg"]},
    ]
    (root / "mixed.json").write_text(json.dumps(records))
    out = root / "mixed"
    args = ["pack", "-i", str(root / "mixed.json"), "-o", str(out), "-L", str(length), "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["samples_packed"], counts["bins"]) == (3, bins), counts
    return out


def _codec_reference_inputs(oracle, folder: Path, ids: list[int], lead: int, tokenizer_file: Path) -> dict:  # type: ignore[no-untyped-def]
    """The reference's inputs of a codec sample, made by the oracle from the folder: canvases through
    transformers' image processor (never resized), positions in block order, the per-run text rewrite of the
    sample's text (its run blocks folded back to the template's one video block) tokenized."""
    import torch
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    found = oracle.load_llava_codec_result(folder)
    images, src, _ = oracle.drop_padding_canvases(found.images, found.src_positions)
    processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=1)
    area = max(150000, max(im.width * im.height for im in images))
    data = processor(images=images, max_pixels=area, return_tensors="pt")
    grids = data["image_grid_thw"]
    positions = oracle.codec_positions_for_processor(src, grids, device="cpu")
    tok = Tokenizer.from_file(str(tokenizer_file))
    # the sample's video span: from its first timestamp (`lead` tokens before the first <|vision_start|>) to its
    # last <|vision_end|>
    first = ids.index(tok.token_to_id("<|vision_start|>")) - lead
    last = len(ids) - ids[::-1].index(tok.token_to_id("<|vision_end|>"))
    folded = ids[:first] + [
        tok.token_to_id(t) for t in ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
    ]
    text = tok.decode(folded + ids[last:], skip_special_tokens=False)
    text = oracle.rewrite_text_with_codec_positions(text, positions, fps=found.fps, decimals=1)
    return {
        "ids": tok.encode(text, add_special_tokens=False).ids,
        "pixels": data["pixel_values"],
        "grids": grids,
        "merged": torch.tensor([[len(grids), int(grids[0, 1]), int(grids[0, 2])]]),
        "positions": positions,
        "canvas_order": torch.from_numpy(src.astype(np.int64)),
    }


def _reference_mixed_loss(hf_dir: Path, packed: Path, root: Path, *, bins: int = 1) -> dict[str, float]:
    """The reference model's (dense or MoE, as config.json says) loss over the samples of the first ``bins``
    bins one by one: the codec sample with the oracle's inputs (one merged grid row), the frame-path video and
    the image with the loader's pixels and grids and the reference's own `build_patch_positions` (the frames at
    their indices); and the codec controls: its canvases as one grid row each (`per_canvas`), its positions in
    canvas order (`canvas_order`), the codec sample's own loss under each (`codec_*`)."""
    import torch

    from mmpack.dataloader import Topology, build_loader, load_manifest
    from mmpack.dataloader.readers import open_shard_reader
    from tests.support import onevision

    model_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    model = onevision.reference_classes(model_type)[1].from_pretrained(hf_dir, dtype=torch.float32).eval()
    m = load_manifest(str(packed))
    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    totals = {"loss": 0.0, "tokens": 0.0}
    codec: dict[str, float] = {}  # the codec sample's own loss, as it is and under the controls
    seen: list[str] = []
    for batch in itertools.islice(loader, bins):
        bin_id = int(batch.bin_ids[0])
        shard = m.shards[m.shard_index(bin_id)]
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        rec = reader.read(bin_id - shard.first_bin)
        reader.close()
        _add_mixed_bin_losses(model, batch, rec, m.image_pad_id, hf_dir, root, totals, codec)
        seen += rec["sample_ids"]
    loader.close()
    assert sorted(seen) == ["codec", "frames", "image"], seen
    return {"loss": totals["loss"] / totals["tokens"], "tokens": totals["tokens"]} | {
        f"codec_{name}": value for name, value in codec.items()
    }


def _add_mixed_bin_losses(  # type: ignore[no-untyped-def]
    model, batch, rec: dict, pad: int, hf_dir: Path, root: Path, totals: dict, codec: dict
) -> None:
    """Adds the summed token losses and loss tokens of one bin's samples to ``totals``; the codec sample's mean
    loss as it is and under the controls to ``codec``."""
    import torch
    import torch.nn.functional as F

    from mmpack.packing.tokenizer import load_tokenizer
    from mmpack.packing.video_codec_ov2 import timestamp_text
    from tests.support import onevision

    _, _, video = onevision.reference_modules()
    plans = {p["sample_id"]: p for p in rec["video_plans"]}
    grids, row, frame, cu = batch.image_grid_thw.tolist(), 0, 0, batch.cu_seqlens.tolist()
    for sid, (a, b) in zip(rec["sample_ids"], itertools.pairwise(cu)):
        tokens, labels = batch.tokens[0, a:b], batch.labels[0, a:b]
        taken = []
        while sum(t * h * w for t, h, w in taken) // 4 < int((tokens == pad).sum()):
            taken.append(grids[frame])
            frame += 1
        rows = sum(t * h * w for t, h, w in taken)
        pixels, row = batch.pixel_values[row : row + rows], row + rows
        keep = labels != -100
        if sid == "codec":
            tok = load_tokenizer(hf_dir / "tokenizer.json")
            lead = len(tok.encode(timestamp_text(plans[sid]["timestamps_s"][0])))
            ref = _codec_reference_inputs(
                _oracle(), root / "codec", tokens.tolist(), lead, hf_dir / "tokenizer.json"
            )
            assert ref["ids"] == tokens.tolist() and taken == ref["merged"].tolist()
            variants = {
                "loss": (ref["merged"], ref["positions"]),
                "per_canvas": (ref["grids"], ref["positions"]),
                "canvas_order": (ref["merged"], ref["canvas_order"]),
            }
            inputs = {name: (ref["pixels"], g, p) for name, (g, p) in variants.items()}
        else:
            t, h, w = len(taken), taken[0][1], taken[0][2]
            frames = [torch.tensor(plans[sid]["frame_indices"])] if sid in plans else None
            shape = torch.tensor([[t, h, w]]) if frames else torch.tensor(taken)
            positions = video.build_patch_positions(shape, spatial_merge_size=2, frame_indices=frames)
            inputs = {"loss": (pixels, torch.tensor(taken), positions)}
        with torch.no_grad():
            for name, (px, g, p) in inputs.items():
                logits = model(
                    input_ids=tokens[None], pixel_values=px, image_grid_thw=g, patch_positions=p
                ).logits[0]
                loss = float(F.cross_entropy(logits[keep].double(), labels[keep], reduction="sum"))
                if sid == "codec":
                    codec[name] = loss / int(keep.sum())
                if name == "loss":
                    totals[name] += loss
        totals["tokens"] += int(keep.sum())
    assert row == len(batch.pixel_values)  # every grid row of the bin was one sample's


@pytest.mark.ranks
@pytest.mark.slow
def test_codec_frames_and_image_in_one_bin_train_as_the_reference(
    onevision2_model: Callable[..., Path], tmp_path: Path
) -> None:
    """A tiny random OneVision-2, one bin of a codec video, a frame-path video and an image: one iteration at
    lr 0 at TP2 x PP2 logs the reference's loss over the same samples (the codec sample fed the oracle's
    inputs: one grid row for its canvases, block-ordered source positions) to 1e-5; controls: the canvases as
    one grid row each (the tower's frame windows change), their positions in canvas order, each move the
    reference's loss of the codec sample by over 1e-4."""
    from tests.support.hf_parity import torchrun, train_args

    need_shared(QWEN3_TOKENIZER, CODEC_DEMO, what="the codec demo assets and the Qwen3 tokenizer")
    hf_dir = onevision2_model()
    packed = _mixed_bin(tmp_path, hf_dir)
    ref = _reference_mixed_loss(hf_dir, packed, tmp_path)
    torchrun(4, ["-m", "tests.support.onevision", str(tmp_path), *train_args(hf_dir, packed, 2, 2)], tmp_path)
    ours = json.loads((tmp_path / "losses.json").read_text())
    print(f"codec mix TP2 x PP2: loss {ours['loss']!r}, reference {ref}")
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name in ("per_canvas", "canvas_order"):
        gap = abs(ref[f"codec_{name}"] - ref["codec_loss"]) / ref["codec_loss"]
        assert gap > 1e-4, f"control {name}: the reference's loss moves by only {gap:.2e} (relative)"


@pytest.mark.ranks
@pytest.mark.slow
def test_moe_codec_bins_at_ep2_train_as_the_reference(
    onevision2_model: Callable[..., Path], tmp_path: Path
) -> None:
    """The MoE variant (4 experts, 2 per token), the codec video, a frame-path video and an image in two bins:
    one iteration of both bins at lr 0, EP2 (TP1, DP2) on two ranks, logs the reference's loss over the same
    samples (the codec sample fed the oracle's inputs) to 1e-5; controls: the canvases as one grid row each and
    their positions in canvas order move the reference's loss of the codec sample by over 1e-4 (the experts'
    own control is test_llava_onevision2_video.py's)."""
    from tests.support import onevision
    from tests.support.trainer import ok, train

    need_shared(QWEN3_TOKENIZER, CODEC_DEMO, what="the codec demo assets and the Qwen3 tokenizer")
    hf_dir = onevision2_model("llava_onevision2_moe", **onevision.MOE_FIELDS)
    packed = _mixed_bin(tmp_path, hf_dir, length=MOE_BIN_TOKENS, bins=2)  # one global batch of two
    ref = _reference_mixed_loss(hf_dir, packed, tmp_path, bins=2)
    args = onevision.moe_args({"hf": hf_dir, "packed": packed}, 1, 2, "--train-iters", "1", "--lr", "0")
    [step] = ok(train(2, args, tmp_path / "ep2", tiny=False)).train
    print(f"codec mix MoE EP2: loss {step['loss']!r}, reference {ref}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name in ("per_canvas", "canvas_order"):
        gap = abs(ref[f"codec_{name}"] - ref["codec_loss"]) / ref["codec_loss"]
        assert gap > 1e-4, f"control {name}: the reference's loss moves by only {gap:.2e} (relative)"


STAND_IN = '''#!{python}
"""A stand-in cv-preinfer: logs its command line, writes the shared demo's assets of the video's demo."""
import shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
video, out = Path(args[args.index("--video") + 1]), Path(args[args.index("--out_dir") + 1])
demo = Path({demo!r}) / video.stem.split("-")[0]
for f in demo.iterdir():
    if f.suffix in (".jpg", ".npy") and not f.name.endswith("order.npy") or f.name == "meta.json":
        shutil.copy(f, out / f.name)
'''


def _stand_in(root: Path) -> tuple[Path, Path]:
    """A stand-in `cv-preinfer` executable under ``root`` and the file it logs its command lines to."""
    import sys

    log, exe = root / "cv-preinfer.log", root / "cv-preinfer"
    exe.write_text(STAND_IN.format(python=sys.executable, log=str(log), demo=str(CODEC_DEMO)))
    exe.chmod(0o755)
    return exe, log


def test_pack_runs_cv_preinfer_on_raw_videos_once_per_content_and_knobs(folder: Path, tmp_path: Path) -> None:
    """`mmpack pack --codec-videos --cv-preinfer PATH` (a stand-in that writes the demo's assets) packs two raw
    videos of the same bytes as codec videos with expected.json's ids, running the preprocessor once, with the
    processor's frame count (146, all the frames of 3.mp4); the cache answers the same bytes and knobs again,
    another knob runs it anew."""
    from mmpack.cli import main as mmpack
    from mmpack.offline_packing.inputs.codec_preinfer import CodecPreinfer
    from tests.support.shared import VIDEO_DEMO

    need_shared(VIDEO_DEMO, what="mllm_video_demo")
    exe, log = _stand_in(tmp_path)
    for name in ("3.mp4", "3-copy.mp4"):
        shutil.copy(VIDEO_DEMO / "mllm_demo_data" / "3.mp4", tmp_path / name)
    chat = [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}]
    records = [{"id": n, "messages": chat, "videos": [n]} for n in ("3.mp4", "3-copy.mp4")]
    (tmp_path / "raw.json").write_text(json.dumps(records))
    cache, out = tmp_path / "cache", tmp_path / "packed"
    args = ["pack", "-i", str(tmp_path / "raw.json"), "-o", str(out), "-L", "6000", "--model", str(folder)]
    codec = ["--codec-videos", "--cv-preinfer", str(exe), "--codec-cache", str(cache), "--no-progress"]
    assert mmpack([*args, *codec]) == 0
    samples = _samples(out)
    assert samples["3.mp4"][0] == samples["3-copy.mp4"][0] == _expected("3")["input_ids"]
    [call] = log.read_text().splitlines()
    assert "--num_sampled_frames 146 --grouping_mode readiness" in call, call
    video = str(tmp_path / "3.mp4")
    made = CodecPreinfer(executable=str(exe), cache_dir=str(cache)).assets_of(video, 146, name="3")
    assert len(log.read_text().splitlines()) == 1  # cached: same bytes, same knobs
    fewer = CodecPreinfer(executable=str(exe), cache_dir=str(cache), target_canvases=16)
    assert fewer.assets_of(video, 146, name="3") != made
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "--num_sampled_frames 128 " in calls[1], calls


def test_pack_without_cv_preinfer_says_how_to_get_it(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--codec-videos with no cv-preinfer found stops the job with one line saying how to install it."""
    from mmpack.cli import main as mmpack

    (tmp_path / "raw.json").write_text("[]")
    args = ["pack", "-i", str(tmp_path / "raw.json"), "-o", str(tmp_path / "out"), "-L", "64"]
    args += ["-t", "byte-fallback"]
    args += ["--codec-videos", "--cv-preinfer", str(tmp_path / "missing"), "--no-progress"]
    code = mmpack(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert "pip install codec-video-prep==0.2.5" in err[0] and "--cv-preinfer" in err[0]


def test_codec_folder_given_as_an_s3_url_packs_as_the_local_one(
    folder: Path, packed: Path, tmp_path: Path
) -> None:
    """A one-group cv-preinfer folder (demo 3's first group, its last canvas all padding) on a moto S3 server, a
    record's video under the URL image root (`-r s3://...`, resolved as a video file is), packs to the sample of
    the same folder packed from disk: the same ids, plan, stored canvases and block-ordered positions (read
    through the job's storage)."""
    from mmpack.cli import main as mmpack

    chat = [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}]
    records = [{"id": "s3", "messages": chat, "videos": ["dropped"]}]
    (tmp_path / "records.json").write_text(json.dumps(records))
    out = tmp_path / "packed"
    with moto_s3() as endpoint:
        endpoint.upload_folder(packed.parent / "dropped", "codec", "v1/dropped")
        args = ["pack", "-i", str(tmp_path / "records.json"), "-o", str(out), "-L", "6000"]
        args += ["--model", str(folder), "-r", "s3://codec/v1", "--s3-endpoint", endpoint.endpoint_url]
        assert mmpack([*args, "--no-progress"]) == 0
    [(ids, plan)] = _samples(out).values()
    local_ids, local_plan = _samples(packed)["dropped"]
    same = lambda p: {k: v for k, v in p.items() if k != "sample_id"}  # noqa: E731
    assert ids == local_ids and same(plan) == same(local_plan) and plan["grid_thw"] == [3, 20, 36]
    assert _video_blobs(out)["s3"] == _video_blobs(packed)["dropped"]


def _video_blobs(packed: Path) -> dict[str, bytes]:
    """sample id -> its video's blob over every bin of the dataset."""
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader

    blobs = {}
    for shard in load_manifest(str(packed)).shards:
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        for i in range(shard.bins):
            rec = reader.read(i)
            blobs |= {p["sample_id"]: bytes(blob) for p, blob in zip(rec["video_plans"], rec["videos"])}
        reader.close()
    return blobs
