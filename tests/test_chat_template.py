"""The model folder's chat template decides each sample's text: on the real mllm_demo records (OV-2's format,
`messages` + `images`) with and without system turns, `mmpack pack --model DIR` with no other flag packs exactly
the ids of transformers' `apply_chat_template` + `Qwen2VLProcessor` (`Qwen2VLImageProcessorPil`), sample for
sample; text-only, multi-turn, multi-image and video through the same template; the loss mask is the assistant
turns; `--default-system` / `--no-default-system` / `--chat-template`; templates mmpack cannot follow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mmpack.cli import main as mmpack
from mmpack.offline_packing.model_folder import resolve_chat_template
from mmpack.packing.chat import ChatTemplate, Conversation, normalize_record, tokenize_conversation
from mmpack.packing.jinja_chat import ChatTemplateError, JinjaChat
from mmpack.packing.tokenizer import load_tokenizer
from tests.support.fixtures_chat import QWEN2_VL_CHAT_TEMPLATE, hf_messages, qwen2_vl_model_folder
from tests.support.fixtures_data import read_arrow_bins
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_shared

pytestmark = [pytest.mark.shared]

SYSTEM = "You are a sports and news expert."


def _shared(path: Path) -> Path:
    need_shared(path, what="the Qwen3 tokenizer and the mllm_demo records")
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = _shared(QWEN3_TOKENIZER)
    return qwen2_vl_model_folder(tmp_path_factory.mktemp("model") / "Qwen2-VL", tokenizer)


@pytest.fixture(scope="module")
def hf(model: Path):
    """transformers' own tokenizer and image processor of the model folder."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return AutoTokenizer.from_pretrained(str(model)), Qwen2VLImageProcessorPil.from_pretrained(str(model))


def _records(mllm_demo_json: Path) -> list[dict]:
    """The 6 real records as they are, the same 6 with a system turn, and a text-only one of each kind."""
    out = []
    for i, rec in enumerate(json.loads(mllm_demo_json.read_text())):
        images = rec["images"]  # relative to the image root (-r), as OV-2 takes them
        out.append({"id": f"demo-{i}", "messages": rec["messages"], "images": images})
        system = [{"role": "system", "content": SYSTEM}, *rec["messages"]]
        out.append({"id": f"demo-{i}-system", "messages": system, "images": images})
        text = [{**m, "content": m["content"].replace("<image>", "")} for m in rec["messages"]]
        out.append({"id": f"demo-{i}-text", "messages": text})
    return out


def _expected_ids(record: dict, hf, system: str | None = None) -> list[int]:
    from PIL import Image

    tokenizer, image_processor = hf
    messages = record["messages"]
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    text = tokenizer.apply_chat_template(hf_messages(messages), tokenize=False)
    images = [Image.open(MLLM_DEMO_JSON.parent / p) for p in record.get("images", [])]
    if images:  # Qwen2VLProcessor's rule: each <|image_pad|> becomes grid t*h*w / merge_size**2 of them
        grids = image_processor(images=images, return_tensors="np")["image_grid_thw"]
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(grids) + 1
        counts = [int(np.prod(g)) // image_processor.merge_size**2 for g in grids]
        text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _packed(out: Path) -> dict[str, tuple[list[int], list[int]]]:
    """sample id -> (input ids, loss mask) of every packed sample."""
    samples = {}
    for entry in json.loads((out / "manifest.json").read_text())["shards"]:
        for row in read_arrow_bins(out / entry["path"]):
            ends = np.cumsum(row["seq_lens"])
            for sid, a, b in zip(row["sample_ids"], [0, *ends[:-1]], ends):
                samples[sid] = (row["input_ids"][a:b], row["loss_mask"][a:b])
    return samples


@pytest.fixture(scope="module")
def packed(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The records packed three ways: the folder alone, --no-default-system, --default-system TEXT."""
    records = _records(_shared(MLLM_DEMO_JSON))
    root = tmp_path_factory.mktemp("packed")
    (root / "data.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    base = ["pack", "-i", str(root / "data.jsonl"), "-r", str(MLLM_DEMO_JSON.parent), "-L", "4096"]
    base += ["--model", str(model), "--no-progress"]
    runs = {"folder": [], "off": ["--no-default-system"], "override": ["--default-system", SYSTEM]}
    for name, extra in runs.items():
        assert mmpack([*base, "-o", str(root / name), *extra]) == 0
    return records, {name: _packed(root / name) for name in runs}


def test_token_ids_equal_apply_chat_template_and_processor(packed, hf) -> None:
    """No flag beyond --model: every sample's ids are transformers' (the template's default system turn
    included); the control runs (default turn off, another system prompt) differ where they must."""
    records, runs = packed
    assert len(runs["folder"]) == len(records) == 18
    for rec in records:
        expected = _expected_ids(rec, hf)
        assert runs["folder"][rec["id"]][0] == expected, rec["id"]
        has_system = rec["messages"][0]["role"] == "system"
        off, override = runs["off"][rec["id"]][0], runs["override"][rec["id"]][0]
        if has_system:  # the record's own system turn: no flag changes it
            assert off == override == expected
        else:
            assert (
                len(off) == len(expected) - 11
            )  # "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            assert override == _expected_ids(rec, hf, system=SYSTEM) != expected
    images = sum(len(r.get("images", [])) for r in records)
    assert images == 16  # multi-image records (the same picture twice in two turns) among them


def test_loss_mask_is_the_assistant_turns(packed, hf) -> None:
    """The trained tokens of each sample are its assistant contents, each with its closing <|im_end|>."""
    tokenizer, _ = hf
    records, runs = packed
    for rec in records:
        ids, mask = runs["folder"][rec["id"]]
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert trained == "".join(a + "<|im_end|>" for a in answers), rec["id"]


def test_video_and_text_only_through_the_template(model: Path, hf, qwen3_tokenizer_path: Path) -> None:
    """A video part, an image and a video in one turn, and a text-only record: the text is the template's
    (apply_chat_template), the pads expand to the media's token counts, the ids equal an encode of that text."""
    tokenizer, _ = hf
    template = ChatTemplate(**_template_fields(model))
    tok = load_tokenizer(qwen3_tokenizer_path)
    video = {"role": "user", "content": "<video>What happens?"}
    mixed = {"role": "user", "content": "<image> then <video>"}
    turns = [{"role": r, "content": c} for r, c in (("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"))]
    cases = [
        ({"messages": [video, {"role": "assistant", "content": "A goal."}], "videos": ["v.mp4"]}, [], [7]),
        (
            {
                "messages": [mixed, {"role": "assistant", "content": "Same."}],
                "images": ["a.jpg"],
                "videos": ["v.mp4"],
            },
            [4],
            [6],
        ),
        ({"messages": [*turns, {"role": "assistant", "content": "Bye."}]}, [], []),
    ]
    for record, image_counts, video_counts in cases:
        conv = normalize_record(record, source="case", line=1)
        sample = tokenize_conversation(conv, tok, image_counts, template, video_counts)
        text = tokenizer.apply_chat_template(hf_messages(record["messages"]), tokenize=False)
        for pad, counts in (("<|image_pad|>", image_counts), ("<|video_pad|>", video_counts)):
            pieces = text.split(pad)
            text = pieces[0] + "".join(pad * n + rest for n, rest in zip(counts, pieces[1:]))
        assert sample.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sample.num_video_tokens == sum(video_counts) and sample.num_image_tokens == sum(image_counts)


def _template_fields(folder: Path) -> dict:
    fields = resolve_chat_template(str(folder), None, None)
    return {"source": fields["chat_source"], "variables": fields["chat_variables"]}


def test_qwen3_template_renders_as_transformers(qwen3_tokenizer_path: Path, hf) -> None:
    """The shared folder's own Qwen3 template (no default system, an empty think block in the last assistant
    turn only, string content): mmpack's text is apply_chat_template's, and the think block is trained."""
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_path.parent))
    template = ChatTemplate(**_template_fields(qwen3_tokenizer_path.parent))
    assert template.jinja.default_system is None and not template.jinja.takes_parts
    messages = [("user", "Who?"), ("assistant", "Kane."), ("user", "Where?"), ("assistant", "Munich.")]
    rendered = template.render(messages, [], [])
    expected = qwen3.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False)
    assert rendered.text == expected and expected.count("<think>") == 1
    trained = [rendered.text[a:b] for a, b in rendered.target_spans]
    assert trained == ["Kane.<|im_end|>", "<think>\n\n</think>\n\nMunich.<|im_end|>"]


def test_builtin_and_file_templates(model: Path, tmp_path: Path) -> None:
    """--chat-template builtin: mmpack's own rendering (no default system); a .jinja file wins over the
    folder's; a -t tokenizer file has no template (builtin)."""
    assert resolve_chat_template(str(model), None, "builtin")["chat_source"] is None
    assert resolve_chat_template(None, str(model / "tokenizer.json"), None)["chat_source"] is None
    own = tmp_path / "own.jinja"
    own.write_text(QWEN2_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "Be brief."))
    fields = resolve_chat_template(str(model), None, str(own))
    assert fields["chat_origin"] == str(own)
    assert JinjaChat(fields["chat_source"]).default_system == "Be brief."
    folder = resolve_chat_template(None, str(model), None)  # -t DIR: the folder's template too
    assert folder["chat_origin"].endswith("tokenizer_config.json")
    conv = Conversation(messages=(("user", "q"), ("assistant", "a")))
    builtin = ChatTemplate().render(conv.messages, [], [])
    assert builtin.text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    with pytest.raises(ValueError, match="no such file"):
        resolve_chat_template(str(model), None, str(tmp_path / "missing.jinja"))


def test_templates_mmpack_cannot_follow_are_refused(model: Path, tmp_path: Path) -> None:
    """A template that folds the system prompt into the first user turn (Llama-2 style) is refused when the
    flags are read; a sample whose content the template rewrites is a chat_template_mismatch."""
    llama2 = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% set sys = m['content'] %}"
        "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}</s>"
        "{% endif %}{% endfor %}"
    )
    bad = tmp_path / "llama2.jinja"
    bad.write_text(llama2)
    with pytest.raises(ValueError, match=r"llama2\.jinja"):
        resolve_chat_template(str(model), None, str(bad))
    trimming = QWEN2_VL_CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | upper }}")
    with pytest.raises(ChatTemplateError, match="does not write the content"):
        JinjaChat(trimming)
