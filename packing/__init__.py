"""Pure packing algorithms: bin packing, the length model, packed-sequence layout, statistics.

This package imports no torch.
"""

from mmpack.packing.binpack import ALGORITHMS, PackResult, pack_lengths
from mmpack.packing.chat import (
    ChatTemplate,
    Conversation,
    SampleError,
    TokenizedSample,
    normalize_record,
    render_conversation,
    tokenize_conversation,
    truncate_sample,
)
from mmpack.packing.image_tokens import (
    ImageHeaderError,
    ImageSizeError,
    ImageTokenRule,
    image_to_patches,
    patches_to_image,
    read_image_size,
)
from mmpack.packing.layout import IGNORE_INDEX, PackedSequence, build_packed_sequence, collate_packed
from mmpack.packing.stats import lower_bound_images, lower_bound_l1, lower_bound_l2, packing_stats
from mmpack.packing.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer, load_tokenizer, tokenizer_info

__all__ = [
    "ALGORITHMS",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "ChatTemplate",
    "Conversation",
    "HFTokenizer",
    "ImageHeaderError",
    "ImageSizeError",
    "ImageTokenRule",
    "PackResult",
    "PackedSequence",
    "SampleError",
    "TextTokenizer",
    "TokenizedSample",
    "build_packed_sequence",
    "collate_packed",
    "image_to_patches",
    "load_tokenizer",
    "lower_bound_images",
    "lower_bound_l1",
    "lower_bound_l2",
    "normalize_record",
    "pack_lengths",
    "packing_stats",
    "patches_to_image",
    "read_image_size",
    "render_conversation",
    "tokenize_conversation",
    "tokenizer_info",
    "truncate_sample",
]
