"""Slow, obviously-correct pure-Python reference of mmpack.packing.layout (lists and loops only)."""

from __future__ import annotations

IGNORE = -100


def reference_packed_sequence(
    input_ids: list[int], loss_mask: list[int], seq_lens: list[int], pad_to: int, pad_id: int
) -> dict[str, object]:
    """tokens, labels, loss_mask, position_ids, cu_seqlens, max_seqlen and the [L][L] mask (True = masked)."""
    # which sample each token belongs to; padding is sample number len(seq_lens)
    owner: list[int] = []
    for k, n in enumerate(seq_lens):
        owner += [k] * n
    total = len(owner)
    owner += [len(seq_lens)] * (pad_to - total)
    tokens = list(input_ids) + [pad_id] * (pad_to - total)

    labels = []
    for i in range(pad_to):
        nxt = i + 1
        ok = i < total and nxt < total and owner[nxt] == owner[i] and loss_mask[nxt] == 1
        labels.append(tokens[nxt] if ok else IGNORE)

    positions = []
    for i in range(pad_to):
        positions.append(0 if i == 0 or owner[i] != owner[i - 1] else positions[-1] + 1)

    segments = list(seq_lens) + ([pad_to - total] if pad_to > total else [])
    cu = [0]
    for n in segments:
        cu.append(cu[-1] + n)

    mask = [[not (owner[i] == owner[j] and j <= i) for j in range(pad_to)] for i in range(pad_to)]
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": [0.0 if lab == IGNORE else 1.0 for lab in labels],
        "position_ids": positions,
        "cu_seqlens": cu,
        "max_seqlen": max(segments, default=0),
        "attention_mask": mask,
    }
