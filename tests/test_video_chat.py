"""Records with videos in the chat layer (mmpack.packing.chat): tags and media per kind, in order, and their tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmpack.packing.chat import (
    ChatTemplate,
    Conversation,
    SampleError,
    normalize_record,
    render_conversation,
    tokenize_conversation,
    truncate_sample,
)
from mmpack.packing.tokenizer import ByteTokenizer, load_tokenizer


def _reason(record: dict) -> str:
    with pytest.raises(SampleError) as info:
        normalize_record(record, source="v.jsonl", line=1)
    return info.value.reason


def test_llava_and_sharegpt_records_with_videos() -> None:
    turns = [{"from": "human", "value": "<video>What?"}, {"from": "gpt", "value": "A cat."}]
    one = normalize_record({"video": "a.mp4", "conversations": turns}, source="f", line=0)
    assert one.videos == ("a.mp4",) and one.images == ()
    two_turns = [{"from": "human", "value": "<video><video>Compare."}, {"from": "gpt", "value": "Same."}]
    two = normalize_record({"video": ["a.mp4", "b.avi"], "conversations": two_turns}, source="f", line=0)
    assert two.videos == ("a.mp4", "b.avi")
    messages = [
        {"role": "user", "content": "<image>then<video>and<image>"},
        {"role": "assistant", "content": "ok"},
    ]
    mixed = normalize_record(
        {"messages": messages, "images": ["x.png", "y.png"], "videos": ["v.mp4"]}, source="f", line=0
    )
    assert mixed.images == ("x.png", "y.png") and mixed.videos == ("v.mp4",)
    caption = normalize_record({"video": "c.mp4", "caption": "waves"}, source="f", line=0)
    assert caption.messages[0] == ("user", "<video>") and caption.videos == ("c.mp4",)


def test_video_record_problems_are_rejects() -> None:
    turns = [{"from": "human", "value": "<video>What?"}, {"from": "gpt", "value": "A cat."}]
    assert _reason({"conversations": turns}) == "video_tag_mismatch"
    assert _reason({"video": ["a.mp4", "b.mp4"], "conversations": turns}) == "video_tag_mismatch"
    assert _reason({"video": "a.mp4", "videos": ["a.mp4"], "conversations": turns}) == "malformed_record"
    assert _reason({"video": 3, "conversations": turns}) == "malformed_record"
    pad_in_text = [{"from": "human", "value": "<|video_pad|>"}, {"from": "gpt", "value": "x"}]
    assert _reason({"conversations": pad_in_text}) == "reserved_token_in_text"
    # the image count is still checked on its own: a <video> tag is no <image>
    assert _reason({"image": "a.png", "video": "a.mp4", "conversations": turns}) == "image_tag_mismatch"
    assert _reason({"audio": "a.wav", "conversations": turns}) == "unsupported_modality"


MIXED = Conversation(
    messages=(
        ("user", "<video>First.<image>Then<video>"),
        ("assistant", "Both show bars."),
        ("user", "And <image>?"),
        ("assistant", "A square."),
    ),
    images=("i1.png", "i2.png"),
    videos=("v1.mp4", "v2.mp4"),
)


@pytest.mark.shared
def test_mixed_record_tokens_equal_the_expanded_text(qwen3_tokenizer_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = load_tokenizer(qwen3_tokenizer_path)
    raw = Tokenizer.from_file(str(qwen3_tokenizer_path))
    images, videos = [4, 9], [12, 6]
    sample = tokenize_conversation(MIXED, tok, images, ChatTemplate(), videos)
    text = render_conversation(MIXED.messages, images, video_token_counts=videos)
    assert sample.input_ids.tolist() == raw.encode(text, add_special_tokens=False).ids
    ids = sample.input_ids
    assert int((ids == 151656).sum()) == sum(videos) and int((ids == 151655).sum()) == sum(images)
    assert sample.num_video_tokens == 18 and sample.video_token_counts == (12, 6)
    # spans in text order: video 1, image 1, video 2 in the first turn, image 2 in the third
    order = sorted(
        [(a, "v", b - a - 2) for a, b in sample.video_spans]
        + [(a, "i", b - a - 2) for a, b in sample.image_spans]
    )
    assert [(kind, n) for _, kind, n in order] == [("v", 12), ("i", 4), ("v", 6), ("i", 9)]
    for a, b in (*sample.video_spans, *sample.image_spans):
        assert ids[a] == 151652 and ids[b - 1] == 151653 and not sample.loss_mask[a:b].any()
    assert sample.turn_video_counts == (2, 0, 0, 0) and sample.turn_image_counts == (1, 0, 1, 0)
    # control: counts given per kind matter; swapping them gives other ids
    swapped = tokenize_conversation(MIXED, tok, images, ChatTemplate(), videos[::-1])
    assert swapped.input_ids.tolist() != sample.input_ids.tolist()


def test_truncation_never_cuts_inside_a_video() -> None:
    tok = ByteTokenizer()
    sample = tokenize_conversation(MIXED, tok, [4, 9], ChatTemplate(), [12, 6])
    first_turns = sample.turn_boundaries[1]
    cut = truncate_sample(sample, first_turns + 3)  # whole first exchange kept, second dropped
    assert cut is not None and len(cut) == first_turns
    assert cut.num_videos == 2 and cut.num_images == 1 and cut.video_spans == sample.video_spans
    assert cut.turn_video_counts == (2, 0) and cut.turn_image_counts == (1, 0)
    one_turn = Conversation(messages=(("user", "<video>"), ("assistant", "long answer " * 5)), videos=("v",))
    alone = tokenize_conversation(one_turn, tok, [], ChatTemplate(), [20])
    ((a, b),) = alone.video_spans
    assert truncate_sample(alone, a + 5) is None  # inside the video: no cut
    kept = truncate_sample(alone, len(alone) - 3)  # inside the answer: cut after the video
    assert kept is not None and kept.num_videos == 1 and kept.video_spans == ((a, b),)
    assert np.asarray(kept.loss_mask).any()


def test_a_tokenizer_without_video_pad_is_refused_for_videos(tmp_path: Path) -> None:
    from tests.support.fixtures_data import train_tiny_bpe

    tok = load_tokenizer(train_tiny_bpe(tmp_path))  # the demo tokenizer: Qwen control tokens, no video pad
    assert "video_pad" not in tok.special_ids  # an image-and-text tokenizer still loads
    conv = Conversation(messages=(("user", "<video>"), ("assistant", "x")), videos=("v",))
    with pytest.raises(ValueError, match=r"<\|video_pad\|>"):
        tokenize_conversation(conv, tok, [], ChatTemplate(), [4])


def test_tag_counts_must_match_the_media_given() -> None:
    tagged = Conversation(messages=(("user", "<video>"), ("assistant", "x")))  # not validated: no videos
    with pytest.raises(ValueError, match="<video> tags"):
        tokenize_conversation(tagged, ByteTokenizer(), [], ChatTemplate())
    ok = Conversation(messages=tagged.messages, videos=("v",))  # control
    assert tokenize_conversation(ok, ByteTokenizer(), [], ChatTemplate(), [3]).num_video_tokens == 3
