"""Length model: tokenizers, chat rendering + loss mask, the Qwen2-VL image-token rule, image headers."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mmpack.packing.chat import (
    ChatTemplate,
    Conversation,
    SampleError,
    encode_texts,
    finish_tokenized,
    normalize_record,
    prepare_conversation,
    tokenize_conversation,
    truncate_sample,
)
from mmpack.packing.image_tokens import (
    CLIP_MEAN,
    CLIP_STD,
    ImageHeaderError,
    ImageSizeError,
    ImageTokenRule,
    image_to_patches,
    patches_to_image,
    read_image_size,
)
from mmpack.packing.tokenizer import BYTE_TOKENIZER, ByteTokenizer, HFTokenizer, load_tokenizer
from tests.support.fixtures_data import SPECIAL_TOKENS
from tests.support.shared import QWEN3_TOKENIZER, need_shared

SPECIALS = list(SPECIAL_TOKENS)  # <|image_pad|> last
CORPUS = [
    "system user assistant You are a helpful assistant.",
    "What is in this picture? A cat sits on a red mat near the window.",
    "Describe the image in detail. There are two dogs playing in the snow.",
    "Ils jouent au football. 他们在足球场上庆祝。 Ünïcödé façade naïve 😀",
    "The quick brown fox jumps over the lazy dog.\n\nNew paragraph\twith tabs.",
]


def _train_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    path.write_text(_train_bpe(SPECIALS).to_str())
    return path


@pytest.fixture(scope="module")
def bpe(bpe_file: Path) -> HFTokenizer:
    return HFTokenizer(bpe_file)


@pytest.fixture(scope="module")
def qwen3() -> tuple[HFTokenizer, Tokenizer]:
    """The real Qwen3 tokenizer (ours and a plain `tokenizers` one), loaded once; skips when absent."""
    need_shared(QWEN3_TOKENIZER, what="the Qwen3 tokenizer")
    return HFTokenizer(QWEN3_TOKENIZER), Tokenizer.from_file(str(QWEN3_TOKENIZER))


def _render_by_hand(messages: list[tuple[str, str]], counts: list[int]) -> str:
    """Rendering written out independently of mmpack.packing.chat."""
    it = iter(counts)
    text = ""
    for role, content in messages:
        pieces = content.split("<image>")
        body = pieces[0] + "".join(
            "<|vision_start|>" + "<|image_pad|>" * next(it) + "<|vision_end|>" + p for p in pieces[1:]
        )
        text += f"<|im_start|>{role}\n{body}<|im_end|>\n"
    return text


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_ids_and_offsets() -> None:
    tok = load_tokenizer(BYTE_TOKENIZER)  # by name only: there is no default tokenizer
    for nothing in (None, ""):
        with pytest.raises(ValueError, match="no tokenizer"):
            load_tokenizer(nothing)  # type: ignore[arg-type]
    assert isinstance(tok, ByteTokenizer) and tok.is_fallback and tok.sha256 == "" and tok.vocab_size == 263
    assert tok.special_ids == {
        "pad": 256,
        "im_start": 257,
        "im_end": 258,
        "vision_start": 259,
        "vision_end": 260,
        "image_pad": 261,
        "video_pad": 262,
    }
    ids, offsets = tok.encode_with_offsets("é<|im_end|>a<|im")
    assert ids == [0xC3, 0xA9, 258, ord("a"), *b"<|im"]
    assert offsets == [(0, 1), (0, 1), (1, 11), (11, 12), (12, 13), (13, 14), (14, 15), (15, 16)]


def test_hf_tokenizer_file_and_folder(bpe_file: Path) -> None:
    raw = Tokenizer.from_file(str(bpe_file))
    for path in (bpe_file, bpe_file.parent, str(bpe_file)):
        tok = load_tokenizer(path)
        assert not tok.is_fallback
        assert tok.sha256 == hashlib.sha256(bpe_file.read_bytes()).hexdigest()
        assert tok.special_ids["pad"] == raw.token_to_id("<|endoftext|>")
        assert tok.special_ids["image_pad"] == raw.token_to_id("<|image_pad|>")
        assert tok.vocab_size == raw.get_vocab_size()
    text = "<|im_start|>user\nA cat 😀 on a mat<|im_end|>\n"
    tok = load_tokenizer(bpe_file)
    assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text) and len(offsets) == len(ids)
    assert text[offsets[0][0] : offsets[0][1]] == "<|im_start|>"


def test_tokenizers_pickle(bpe: HFTokenizer) -> None:
    # loader and packer workers receive the tokenizer by pickling
    for tok in (bpe, ByteTokenizer()):
        clone = pickle.loads(pickle.dumps(tok))
        assert clone.encode("<|im_start|>a cat") == tok.encode("<|im_start|>a cat")
        assert clone.special_ids == tok.special_ids and clone.sha256 == tok.sha256


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid"):
        load_tokenizer(bad)
    no_image_pad = tmp_path / "partial" / "tokenizer.json"
    no_image_pad.parent.mkdir()
    no_image_pad.write_text(_train_bpe(SPECIALS[:-1]).to_str())
    with pytest.raises(ValueError, match=r"<\|image_pad\|>"):
        load_tokenizer(no_image_pad.parent)


@pytest.mark.shared
def test_qwen3_tokenizer_facts(qwen3: tuple[HFTokenizer, Tokenizer], qwen3_tokenizer_path: Path) -> None:
    assert load_tokenizer(qwen3_tokenizer_path.parent).sha256 == qwen3[0].sha256  # the folder form
    tok = qwen3[0]
    assert tok.special_ids == {
        "pad": 151643,
        "im_start": 151644,
        "im_end": 151645,
        "vision_start": 151652,
        "vision_end": 151653,
        "image_pad": 151655,
        "video_pad": 151656,
    }
    assert tok.vocab_size == 151669
    assert tok.sha256 == "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
    assert tok.encode(text) == [151644, 872, 198, 151652, 151655, 151653, 74785, 419, 2168, 13, 151645, 198]
    assert tok.encode("hello <image> world") == [14990, 366, 1805, 29, 1879]


# ---------------------------------------------------------------- records


def test_normalize_llava_with_system_prompt() -> None:
    rec = {
        "id": 7,
        "image": "a.jpg",
        "system_prompt": "Be brief.",
        "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."}],
    }
    conv = normalize_record(rec, source="f.json", line=3)
    assert conv == Conversation(
        messages=(("system", "Be brief."), ("user", "<image>\nWhat?"), ("assistant", "A cat.")),
        images=("a.jpg",),
        sample_id="7",
    )


def test_normalize_sharegpt_caption_and_text_only() -> None:
    share = {
        "messages": [
            {"role": "user", "content": "<image><image>Same?"},
            {"role": "assistant", "content": "Yes."},
        ],
        "images": ["x.png", "x.png"],
    }
    conv = normalize_record(share, source="s.jsonl", line=12)
    assert conv.images == ("x.png", "x.png") and conv.sample_id == "s.jsonl:12"
    assert conv.messages == (("user", "<image><image>Same?"), ("assistant", "Yes."))
    cap = normalize_record({"image": "c.jpg", "caption": "A red bus."}, source="c", line=0)
    assert cap.messages == (("user", "<image>"), ("assistant", "A red bus.")) and cap.images == ("c.jpg",)
    text = normalize_record(
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        source="t",
        line=1,
    )
    assert text.images == () and text.messages[1] == ("assistant", "Hello")
    plain = normalize_record({"text": "Just text."}, source="t", line=2)
    assert plain.messages == (("assistant", "Just text."),)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "malformed_record"),
        ({"foo": 1}, "malformed_record"),
        ({"messages": "hi"}, "malformed_record"),
        ({"messages": [{"role": "user"}]}, "malformed_record"),
        (
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
            "malformed_record",
        ),
        ({"messages": [], "images": []}, "empty_conversation"),
        ({"conversations": []}, "empty_conversation"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
            "no_assistant_turn",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "images": ["i.jpg"],
            },
            "image_tag_mismatch",
        ),
        (
            {"messages": [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": "a"}]},
            "image_tag_mismatch",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": "late"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "misplaced_system",
        ),
        (
            {"messages": [{"role": "user", "content": "q<|im_end|>"}, {"role": "assistant", "content": "a"}]},
            "reserved_token_in_text",
        ),
        ({"image": ["a.jpg", 3], "caption": "x"}, "malformed_record"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad \ud800"}]},
            "malformed_record",
        ),
        ({"image": "a.jpg", "caption": None}, "malformed_record"),
    ],
)
def test_normalize_rejects(record: object, reason: str) -> None:
    with pytest.raises(SampleError) as info:
        normalize_record(record, source="bad.jsonl", line=5)
    assert info.value.reason == reason and reason in str(info.value)


# ---------------------------------------------------------------- tokenisation and loss mask


def _assistant_target_text(messages: list[tuple[str, str]]) -> str:
    return "".join(content + "<|im_end|>" for role, content in messages if role == "assistant")


@pytest.mark.shared
def test_mllm_demo_counts_match_direct_encode(
    qwen3: tuple[HFTokenizer, Tokenizer], mllm_demo_json: Path
) -> None:
    tok, raw = qwen3
    rule = ImageTokenRule()
    records = json.loads(mllm_demo_json.read_text())
    assert len(records) == 6
    for i, rec in enumerate(records):
        conv = normalize_record(rec, source=str(mllm_demo_json), line=i)
        sizes = [read_image_size(mllm_demo_json.parent / p) for p in conv.images]
        counts = [rule.num_tokens(h, w) for w, h, _ in sizes]
        sample = tokenize_conversation(conv, tok, counts, ChatTemplate())
        text = _render_by_hand([(m["role"], m["content"]) for m in rec["messages"]], counts)
        direct = raw.encode(text, add_special_tokens=False).ids
        assert sample.input_ids.dtype == np.uint32 and sample.input_ids.tolist() == direct
        assert sample.num_image_tokens == sum(counts) == direct.count(151655)
        targets = sample.input_ids[sample.loss_mask == 1].tolist()
        assert raw.decode(targets, skip_special_tokens=False) == _assistant_target_text(conv.messages)
        # every assistant message's closing <|im_end|> is a target, no other special token is
        special_targets = [t for t in targets if t >= 151643]
        assert special_targets == [151645] * sum(role == "assistant" for role, _ in conv.messages)


@pytest.mark.shared
@pytest.mark.parametrize("counts", [[1], [16384], [3, 2500]])
def test_large_image_counts_match_direct_encode(
    qwen3: tuple[HFTokenizer, Tokenizer], counts: list[int]
) -> None:
    tok, raw = qwen3
    tags = "".join("<image>\n" for _ in counts)
    conv = Conversation(
        messages=(("user", tags + "Describe."), ("assistant", "Two cats.")), images=("a",) * len(counts)
    )
    sample = tokenize_conversation(conv, tok, counts, ChatTemplate())
    direct = raw.encode(_render_by_hand(list(conv.messages), counts), add_special_tokens=False).ids
    assert sample.input_ids.tolist() == direct and sample.num_image_tokens == sum(counts)
    starts = [a for a, _ in sample.image_spans]
    assert [direct[a] for a in starts] == [151652] * len(counts)
    assert [b - a - 2 for a, b in sample.image_spans] == counts


@pytest.mark.shared
def test_mllm_demo_image_sizes(mllm_demo_json: Path) -> None:
    sizes = {
        p.name: read_image_size(p) for p in sorted((mllm_demo_json.parent / "mllm_demo_data").glob("*.jpg"))
    }
    for name, (w, h, fmt) in sizes.items():
        with Image.open(mllm_demo_json.parent / "mllm_demo_data" / name) as im:
            assert (w, h) == im.size and fmt == "jpg"
    w, h, _ = sizes["1.jpg"]
    assert (w, h) == (300, 168) and ImageTokenRule().num_tokens(h, w) == 66  # 6 x 11 merged tokens


def test_loss_mask_with_bpe_and_default_system(bpe: HFTokenizer) -> None:
    conv = Conversation(
        messages=(("user", "<image>\nWhat is in this picture?"), ("assistant", "A cat sits on a red mat.")),
        images=("a.jpg",),
    )
    sample = tokenize_conversation(
        conv, bpe, [5], ChatTemplate(default_system="You are a helpful assistant.")
    )
    messages = [("system", "You are a helpful assistant."), *conv.messages]
    text = _render_by_hand(messages, [5])
    raw = Tokenizer.from_file(str(bpe.path))
    assert sample.input_ids.tolist() == raw.encode(text, add_special_tokens=False).ids
    targets = sample.input_ids[sample.loss_mask == 1].tolist()
    assert raw.decode(targets, skip_special_tokens=False) == "A cat sits on a red mat.<|im_end|>"
    assert sample.turn_roles == ("system", "user", "assistant") and sample.turn_boundaries[-1] == len(sample)
    ((a, b),) = sample.image_spans
    ids = sample.input_ids
    assert ids[a] == bpe.special_ids["vision_start"] and ids[b - 1] == bpe.special_ids["vision_end"]
    assert (ids[a + 1 : b - 1] == bpe.special_ids["image_pad"]).all() and b - a == 7
    # a record that already has a system message keeps it
    own = Conversation(messages=(("system", "S"), ("user", "q"), ("assistant", "a")))
    kept = tokenize_conversation(own, bpe, [], ChatTemplate(default_system="X"))
    assert kept.turn_roles == ("system", "user", "assistant")
    assert "X" not in raw.decode(kept.input_ids.tolist(), skip_special_tokens=False)


def test_image_inside_assistant_content_has_no_loss() -> None:
    tok = ByteTokenizer()
    conv = Conversation(messages=(("user", "Draw"), ("assistant", "Here<image>done")), images=("i.png",))
    sample = tokenize_conversation(conv, tok, [3], ChatTemplate())
    ids = sample.input_ids
    targets = ids[sample.loss_mask == 1].tolist()
    assert targets == [*b"Here", *b"done", 258]
    ((a, b),) = sample.image_spans
    assert not sample.loss_mask[a:b].any() and (ids[a + 1 : b - 1] == 261).all()


@pytest.mark.shared
def test_token_straddling_header_and_content_is_a_target(qwen3: tuple[HFTokenizer, Tokenizer]) -> None:
    # "assistant\n" + "\n\nAnswer": Qwen's BPE merges "\n\n\n" across the header/content boundary
    tok = qwen3[0]
    conv = Conversation(messages=(("user", "Q"), ("assistant", "\n\nAnswer")))
    sample = tokenize_conversation(conv, tok, [], ChatTemplate())
    text = _render_by_hand(list(conv.messages), [])
    ids, offsets = tok.encode_with_offsets(text)
    content_start = text.index("assistant\n") + len("assistant\n")
    straddling = [i for i, (a, b) in enumerate(offsets) if a < content_start < b]
    assert len(straddling) == 1 and text[slice(*offsets[straddling[0]])] == "\n\n\n"
    assert sample.loss_mask[straddling[0]] == 1
    assert sample.loss_mask[: straddling[0]].sum() == 0
    assert sample.input_ids[sample.loss_mask == 1].tolist() == ids[straddling[0] : -1]


def test_image_token_counts_must_match() -> None:
    conv = Conversation(messages=(("user", "<image>"), ("assistant", "x")), images=("a",))
    with pytest.raises(ValueError, match="image token counts"):
        tokenize_conversation(conv, ByteTokenizer(), [], ChatTemplate())
    with pytest.raises(ValueError, match=">= 1"):
        tokenize_conversation(conv, ByteTokenizer(), [0], ChatTemplate())


_text = st.text(alphabet=st.sampled_from(list("ab é中😀\n\t<>|")), max_size=12)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[Conversation, list[int]]:
    n_turns = draw(st.integers(1, 3))
    messages: list[tuple[str, str]] = []
    if draw(st.booleans()):
        messages.append(("system", draw(_text)))
    n_images = 0
    for _ in range(n_turns):
        tags = draw(st.integers(0, 2))
        n_images += tags
        messages.append(("user", draw(_text) + "<image>" * tags + draw(_text)))
        messages.append(("assistant", "x" + draw(_text)))
    counts = draw(st.lists(st.integers(1, 4), min_size=n_images, max_size=n_images))
    return Conversation(messages=tuple(messages), images=tuple(["i"] * n_images)), counts


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_byte_tokenizer_mask_is_exactly_assistant_bytes(case: tuple[Conversation, list[int]]) -> None:
    conv, counts = case
    sample = tokenize_conversation(conv, ByteTokenizer(), counts, ChatTemplate())
    text = _render_by_hand(list(conv.messages), counts)
    assert sample.input_ids.tolist() == ByteTokenizer().encode(text)
    expected: list[int] = []
    for role, content in conv.messages:
        if role == "assistant":
            expected += [*content.encode("utf-8"), 258]
    assert sample.input_ids[sample.loss_mask == 1].tolist() == expected
    assert sample.num_image_tokens == sum(counts) == int((sample.input_ids == 261).sum())


@settings(max_examples=60, deadline=None)
@given(conversations())
def test_bpe_ids_equal_direct_encode(bpe: HFTokenizer, case: tuple[Conversation, list[int]]) -> None:
    conv, counts = case
    sample = tokenize_conversation(conv, bpe, counts, ChatTemplate())
    raw = Tokenizer.from_file(str(bpe.path))
    assert (
        sample.input_ids.tolist()
        == raw.encode(_render_by_hand(list(conv.messages), counts), add_special_tokens=False).ids
    )
    # every assistant message ends in a target <|im_end|>; the text between targets is assistant text only
    im_end = bpe.special_ids["im_end"]
    assert int(((sample.input_ids == im_end) & (sample.loss_mask == 1)).sum()) == sum(
        role == "assistant" for role, _ in conv.messages
    )
    assert not sample.loss_mask[
        np.isin(sample.input_ids, [bpe.special_ids[k] for k in ("im_start", "image_pad")])
    ].any()


# ---------------------------------------------------------------- truncation


def _multi_turn() -> Conversation:
    return Conversation(
        messages=(
            ("user", "<image>First question?"),
            ("assistant", "First answer."),
            ("user", "Second <image> question?"),
            ("assistant", "Second answer."),
        ),
        images=("a", "b"),
    )


def test_truncate_drops_trailing_turns() -> None:
    tok = ByteTokenizer()
    conv = _multi_turn()
    full = tokenize_conversation(conv, tok, [4, 6], ChatTemplate())
    assert truncate_sample(full, len(full)) is full
    first_end = full.turn_boundaries[1]
    cut = truncate_sample(full, len(full) - 1)
    assert cut is not None and len(cut) == first_end
    one_turn = Conversation(messages=conv.messages[:2], images=conv.images[:1])
    direct = tokenize_conversation(one_turn, tok, [4], ChatTemplate())
    assert cut.input_ids.tolist() == direct.input_ids.tolist()
    assert cut.loss_mask.tolist() == direct.loss_mask.tolist()
    assert cut.num_images == 1 and cut.num_image_tokens == 4 and cut.turn_image_counts == (1, 0)


def test_truncate_cuts_text_at_token_boundary_but_never_inside_an_image() -> None:
    tok = ByteTokenizer()
    text_only = tokenize_conversation(
        Conversation(messages=(("user", "q"), ("assistant", "a long answer"))), tok, [], ChatTemplate()
    )
    header_end = len(tok.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"))
    assert text_only.loss_mask[:header_end].sum() == 0 and text_only.loss_mask[header_end] == 1
    cut = truncate_sample(text_only, header_end + 4)
    assert cut is not None and len(cut) == header_end + 4 and cut.num_loss_tokens == 4
    assert cut.input_ids.tolist() == text_only.input_ids[: header_end + 4].tolist()
    # a budget that ends before any target token cannot make a useful sample
    assert truncate_sample(text_only, header_end) is None
    with_image = tokenize_conversation(
        Conversation(messages=(("user", "<image>"), ("assistant", "caption text")), images=("a",)),
        tok,
        [10],
        ChatTemplate(),
    )
    ((a, b),) = with_image.image_spans
    assert truncate_sample(with_image, (a + b) // 2) is None
    kept = truncate_sample(with_image, len(with_image) - 2)
    assert kept is not None and kept.num_images == 1 and kept.image_spans == ((a, b),)


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(1, 200))
def test_truncate_properties(case: tuple[Conversation, list[int]], max_len: int) -> None:
    conv, counts = case
    tok = ByteTokenizer()
    full = tokenize_conversation(conv, tok, counts, ChatTemplate())
    cut = truncate_sample(full, max_len)
    if cut is None:
        assert len(full) > max_len
        return
    n = len(cut)
    assert n <= max_len
    assert cut.input_ids.tolist() == full.input_ids[:n].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:n].tolist() and cut.loss_mask.any()
    assert all(b <= n for _, b in cut.image_spans) and cut.image_spans == full.image_spans[: cut.num_images]
    assert cut.num_image_tokens == int((cut.input_ids == 261).sum()) == sum(cut.image_token_counts)
    assert sum(cut.turn_image_counts) == cut.num_images
    if n in full.turn_boundaries:
        # whole turns kept: identical to tokenizing the shorter conversation
        k = full.turn_boundaries.index(n) + 1
        assert cut.turn_roles[-1] == "assistant" and len(cut.turn_roles) == k
        shorter = Conversation(messages=conv.messages[:k], images=conv.images[: cut.num_images])
        direct = tokenize_conversation(shorter, tok, counts[: cut.num_images], ChatTemplate())
        assert direct.input_ids.tolist() == cut.input_ids.tolist()
        assert direct.loss_mask.tolist() == cut.loss_mask.tolist()


# ---------------------------------------------------------------- image-token rule


@pytest.mark.parametrize(
    ("h", "w", "hw", "tokens"),
    [
        (168, 300, (168, 308), 66),  # 6 x round(10.71)=11
        (28, 28, (56, 56), 4),  # 784 < min_pixels: beta = 2, ceil -> 56 x 56
        (56, 56, (56, 56), 4),  # exactly min_pixels
        (42, 70, (56, 56), 4),  # 1.5 -> 2 and 2.5 -> 2: Python rounds half to even
        (28, 5600, (28, 5600), 200),  # aspect exactly 200 is allowed
        (6000, 8000, (3080, 4116), 110 * 147),  # max_pixels clamp: beta = sqrt(48e6 / 12845056)
        (3000, 4000, (2996, 4004), 107 * 143),  # just under max_pixels after rounding: no clamp
    ],
)
def test_smart_resize_hand_computed(h: int, w: int, hw: tuple[int, int], tokens: int) -> None:
    rule = ImageTokenRule()
    assert rule.resized_hw(h, w) == hw
    assert rule.num_tokens(h, w) == tokens
    assert rule.grid_thw(h, w) == (1, hw[0] // 14, hw[1] // 14)
    assert rule.tokens_of_grid(rule.grid_thw(h, w)) == tokens


def test_smart_resize_small_max_pixels_keeps_one_token_row() -> None:
    rule = ImageTokenRule(min_pixels=784, max_pixels=7840)
    # beta = sqrt(156800 / 7840) = sqrt(20): the short side floors to 0 and is held at one factor
    assert rule.resized_hw(28, 5600) == (28, 1232)
    assert ImageTokenRule(max_pixels=3136).resized_hw(280, 280) == (56, 56)


@pytest.mark.parametrize(("h", "w"), [(28, 5601), (5601, 28), (100, 20001)])
def test_smart_resize_rejects_aspect_above_200(h: int, w: int) -> None:
    with pytest.raises(ValueError, match="aspect ratio") as info:
        ImageTokenRule().num_tokens(h, w)
    assert isinstance(info.value, ImageSizeError) and info.value.reason == "image_aspect_ratio"


@pytest.mark.parametrize(
    ("h", "w", "hw"),
    [
        (27, 100, (28, 112)),  # rounds up to one factor: 28 * 112 = min_pixels
        (100, 27, (112, 28)),
        (1, 1, (56, 56)),  # min_pixels branch: beta = 56
        (10, 10, (56, 56)),
        (5, 150, (28, 308)),  # beta = sqrt(3136 / 750): ceil(0.37), ceil(10.95) factors
    ],
)
def test_smart_resize_upscales_sides_below_factor(h: int, w: int, hw: tuple[int, int]) -> None:
    # transformers 5's smart_resize has no minimum side: tiny images go through the min_pixels branch
    assert ImageTokenRule().resized_hw(h, w) == hw
    with pytest.raises(ImageSizeError, match="no pixels") as info:
        ImageTokenRule().resized_hw(0, 10)
    assert info.value.reason == "image_size_invalid"


def test_rule_validates_and_serialises() -> None:
    with pytest.raises(ValueError, match="min_pixels"):
        ImageTokenRule(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError):
        ImageTokenRule(patch_size=0)
    rule = ImageTokenRule(patch_size=16, min_pixels=1024)
    assert rule.to_dict()["patch_size"] == 16 and ImageTokenRule.from_dict(rule.to_dict()) == rule
    assert ImageTokenRule.from_dict({"patch_size": 14, "merge_size": 2}) == ImageTokenRule()
    template = ChatTemplate(default_system="Hi.")
    assert ChatTemplate.from_dict(json.loads(json.dumps(template.to_dict()))) == template
    assert ImageTokenRule(patch_size=16, merge_size=2).num_tokens(64, 64) == 4


@settings(max_examples=300, deadline=None)
@given(st.integers(28, 20000), st.integers(28, 20000))
def test_smart_resize_invariants(h: int, w: int) -> None:
    rule = ImageTokenRule()
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError):
            rule.resized_hw(h, w)
        return
    rh, rw = rule.resized_hw(h, w)
    assert rh % 28 == 0 and rw % 28 == 0 and rh >= 28 and rw >= 28
    assert rule.min_pixels <= rh * rw <= rule.max_pixels
    assert rule.num_tokens(h, w) == (rh // 28) * (rw // 28)


# ---------------------------------------------------------------- image headers


def _image_bytes(fmt: str, size: tuple[int, int] = (123, 45), **save: object) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(buf, format=fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("pil_fmt", "fmt"), [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp"), ("GIF", "gif")]
)
def test_read_image_size_formats_and_sources(tmp_path: Path, pil_fmt: str, fmt: str) -> None:
    data = _image_bytes(pil_fmt)
    path = tmp_path / "img.bin"  # the extension says nothing
    path.write_bytes(data)
    assert read_image_size(path) == (123, 45, fmt)
    assert read_image_size(str(path)) == (123, 45, fmt)
    assert read_image_size(data) == (123, 45, fmt)
    assert read_image_size(io.BytesIO(data)) == (123, 45, fmt)
    with open(path, "rb") as f:
        assert read_image_size(f) == (123, 45, fmt)
    shifted = io.BytesIO(b"xyz" + data)
    shifted.read(3)  # a file object not at its start is read from where it stands
    assert read_image_size(shifted) == (123, 45, fmt)


def test_read_image_size_trusts_content_not_extension(tmp_path: Path) -> None:
    (tmp_path / "photo.jpg").write_bytes(_image_bytes("PNG", (64, 80)))
    (tmp_path / "pic.png").write_bytes(_image_bytes("WEBP", (70, 50)))
    assert read_image_size(tmp_path / "photo.jpg") == (64, 80, "png")
    assert read_image_size(tmp_path / "pic.png") == (70, 50, "webp")


def test_read_image_size_does_not_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import ImageFile

    def no_decode(self: object) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    for fmt in ("JPEG", "PNG", "WEBP"):
        assert read_image_size(_image_bytes(fmt))[:2] == (123, 45)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("keep", [0.6, 0.02])
def test_read_image_size_truncated(fmt: str, keep: float) -> None:
    data = _image_bytes(fmt, (200, 150))
    with pytest.raises(ImageHeaderError):
        read_image_size(data[: max(8, int(len(data) * keep))])
    assert read_image_size(data) == (200, 150, fmt.lower().replace("jpeg", "jpg"))


def test_read_image_size_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_image_size(tmp_path / "missing.jpg")
    with pytest.raises(ImageHeaderError):
        read_image_size(b"this is not an image at all")
    with pytest.raises(ImageHeaderError):
        read_image_size(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
    with pytest.raises(ValueError):  # ImageHeaderError is a ValueError
        read_image_size(b"")


def test_jpeg_with_trailing_bytes_is_accepted() -> None:
    data = _image_bytes("JPEG") + b"\x00" * 100  # some encoders pad after the end marker
    assert read_image_size(data) == (123, 45, "jpg")


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_exif_orientation_is_not_applied_by_header_or_pixels(fmt: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90" for viewers; Qwen2VLImageProcessorPil uses the stored pixels
    data = _image_bytes(fmt, (120, 60), exif=exif.tobytes())
    w, h, _ = read_image_size(data)
    assert (w, h) == (120, 60)
    rule = ImageTokenRule()
    img = Image.open(io.BytesIO(data))
    assert img.getexif().get(0x0112) == 6
    patches = image_to_patches(img, rule)
    _, gh, gw = rule.grid_thw(h, w)
    assert (gh, gw) == (4, 8) and patches.shape == (gh * gw, 3 * 2 * 14 * 14)


# ---------------------------------------------------------------- pixels


def test_image_to_patches_layout() -> None:
    rule = ImageTokenRule()
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)  # already a multiple of 28: no resampling
    patches = image_to_patches(Image.fromarray(arr), rule)
    gh, gw, p, m, t = 4, 6, 14, 2, 2
    assert patches.shape == (gh * gw, 3 * t * p * p) == (gh * gw, rule.patch_dim)
    assert patches.dtype == np.float32
    norm = (arr.astype(np.float32) / 255.0 - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)
    for r in range(gh * gw):
        window, inner = divmod(r, m * m)
        wy, wx = divmod(window, gw // m)
        dy, dx = divmod(inner, m)
        py, px = wy * m + dy, wx * m + dx
        patch = norm[py * p : (py + 1) * p, px * p : (px + 1) * p, :].transpose(2, 0, 1)  # [C, y, x]
        expected = np.stack([patch, patch], axis=1).reshape(-1)  # [C, T, y, x]: the image twice in time
        np.testing.assert_allclose(patches[r], expected, rtol=1e-5, atol=1e-5)
    back = patches_to_image(patches, (1, gh, gw), rule)
    np.testing.assert_allclose(back, norm.transpose(2, 0, 1), rtol=1e-5, atol=1e-5)
    assert image_to_patches(Image.fromarray(arr), ImageTokenRule(temporal_patch_size=1)).shape == (24, 588)
    broken = patches.copy()
    broken[0, 3 * p * p - 1] += 1  # channel 1, t = 1: the temporal copies now differ
    with pytest.raises(ValueError, match="temporal copies"):
        patches_to_image(broken, (1, gh, gw), rule)


def test_image_to_patches_resizes_to_rule_or_grid() -> None:
    rule = ImageTokenRule()
    img = Image.new("L", (300, 168), 128)  # grayscale is converted to RGB
    patches = image_to_patches(img, rule)
    assert patches.shape == (12 * 22, 1176)
    np.testing.assert_allclose(patches[:, :392], (128 / 255 - CLIP_MEAN[0]) / CLIP_STD[0], rtol=1e-5)
    assert image_to_patches(img, rule, grid_thw=(1, 4, 8)).shape == (32, 1176)
    with pytest.raises(ValueError, match="merge_size"):
        image_to_patches(img, rule, grid_thw=(1, 3, 8))


# ---------------------------------------------------------------- batched tokenization


def _reference_ids_and_mask(conv: Conversation, counts: list[int], raw: Tokenizer) -> tuple[list, list]:
    """Ids and loss mask of the fully expanded text straight from its token offsets, without mmpack.packing.chat:
    a token is a target when it overlaps assistant content or the <|im_end|> closing an assistant message
    (the conversations here have no images in assistant messages)."""
    text = _render_by_hand(list(conv.messages), counts)
    targets, pos = [], 0
    for role, content in conv.messages:
        pos += len(f"<|im_start|>{role}\n")
        body = _render_by_hand([(role, content)], counts[: content.count("<image>")])
        counts = counts[content.count("<image>") :]
        body = body[len(f"<|im_start|>{role}\n") : -len("<|im_end|>\n")]
        if role == "assistant":
            targets += [(pos, pos + len(body)), (pos + len(body), pos + len(body) + len("<|im_end|>"))]
        pos += len(body) + len("<|im_end|>\n")
    assert pos == len(text)
    enc = raw.encode(text, add_special_tokens=False)
    mask = [int(any(s < b and e > a for a, b in targets)) for s, e in enc.offsets]
    return enc.ids, mask


def _same_sample(a: object, b: object) -> bool:
    return all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(vars(a).values(), vars(b).values())
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(conversations(), min_size=1, max_size=6))
def test_batched_tokenization_equals_reference_and_one_by_one(
    bpe: HFTokenizer, cases: list[tuple[Conversation, list[int]]]
) -> None:
    raw = Tokenizer.from_file(str(bpe.path))
    for tok in (bpe, ByteTokenizer()):  # batch encode (HF) and text-by-text fallback
        preps = [prepare_conversation(conv, tok, counts) for conv, counts in cases]
        batch = list(finish_tokenized(preps, tok, encode_texts(tok, [p.text for p in preps])))
        for (conv, counts), sample in zip(cases, batch):
            assert _same_sample(sample, tokenize_conversation(conv, tok, counts))
            if tok is bpe:
                ids, mask = _reference_ids_and_mask(conv, counts, raw)
                assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask


def test_batched_tokenization_control_and_errors(bpe: HFTokenizer) -> None:
    a = Conversation(messages=(("user", "<image>Hi"), ("assistant", "A cat sits.")), images=("x",))
    b = Conversation(messages=(("user", "Why?"), ("assistant", "\n\nBecause 😀")))
    preps = [prepare_conversation(a, bpe, [3]), prepare_conversation(b, bpe, [])]
    encoded = encode_texts(bpe, [p.text for p in preps])
    good = list(finish_tokenized(preps, bpe, encoded))
    assert _same_sample(good[1], tokenize_conversation(b, bpe, []))
    # control: encodings handed to the wrong conversations give other samples (or fail), so the equality
    # checks above can fail
    with pytest.raises(ValueError, match="vision tokens"):
        list(finish_tokenized(preps[::-1], bpe, encoded))
    swapped = list(finish_tokenized(preps[1:], bpe, encoded[:1]))
    assert not _same_sample(swapped[0], good[1])
    with pytest.raises(ValueError, match="2 encodings for 1"):
        list(finish_tokenized(preps[:1], bpe, encoded))
    assert list(finish_tokenized([], bpe, [])) == []
