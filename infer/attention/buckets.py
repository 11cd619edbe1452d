"""A step's short queries split into buckets of similar kv length, and the additive masks their padded keys take."""

from __future__ import annotations

import torch


KV_BUCKET_MIN = 16  # short queries split by kv length only into groups of at least this many sequences,
KV_BUCKET_KEYS = 8192  # only when one group would pad to at least this many keys (smaller attention is op-bound)
KV_BUCKET_GAIN = 0.75  # and only when the groups' padded keys are at most this share of one group's


def kv_buckets(seqs: list[int], kv_lens: list[int]) -> list[list[int]]:
    """The short queries' sequences in groups whose kv lengths lie within a factor of 2 (powers-of-two bins, a bin
    of fewer than KV_BUCKET_MIN sequences merged into the next longer one): padding every key block to a batch's
    longest wastes up to half of a decode step's attention when lengths spread (generation at batch 128), while
    each group costs a gather and an SDPA call per layer, so the split is kept only for large key blocks and where it
    pads a quarter fewer keys."""
    if len(seqs) < 2 * KV_BUCKET_MIN or len(seqs) * max(kv_lens[b] for b in seqs) < KV_BUCKET_KEYS:
        return [seqs]
    bins: dict[int, list[int]] = {}
    for b in seqs:
        bins.setdefault(kv_lens[b].bit_length(), []).append(b)
    groups: list[list[int]] = []
    pending: list[int] = []
    for key in sorted(bins):
        pending += bins[key]
        if len(pending) >= KV_BUCKET_MIN:
            groups.append(pending)
            pending = []
    if pending:
        if groups:
            groups[-1] += pending
        else:
            groups.append(pending)
    padded = lambda group: len(group) * max(kv_lens[b] for b in group)  # noqa: E731
    return groups if sum(map(padded, groups)) <= KV_BUCKET_GAIN * padded(seqs) else [seqs]


_MASK_TEMPLATES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
MASK_ALIGN = 8  # elements between mask rows are a multiple of this: 16 bytes in bf16, 32 in fp32


def additive_mask(visible: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """visible [...] key counts (each at least 1) -> [..., width] additive mask rows: `visible` zeros, then -inf.

    One index_select of rows cut from a constant template (M zeros, then M times -inf; the row for c keys starts at
    M - c), where comparing positions and filling a mask costs three ops: a step's plan is op-bound here.

    Rows are laid out MASK_ALIGN elements apart (the view keeps `width`), so that every row, and every step's slab
    of a decode run's masks, starts 16-byte aligned: CUDA's fused SDPA kernels read the mask with vector loads and
    fault on a misaligned start ("misaligned address", seen on an H200 with a decode run's step j > 0 at odd widths).
    """
    stride = -(-width // MASK_ALIGN) * MASK_ALIGN
    key = (dtype, visible.device)
    template = _MASK_TEMPLATES.get(key)
    if template is None or template.shape[0] < 2 * stride:
        half = max(256, stride, 0 if template is None else template.shape[0])
        template = torch.zeros(2 * half, dtype=dtype, device=visible.device)
        template[half:] = float("-inf")
        _MASK_TEMPLATES[key] = template
    half = template.shape[0] // 2
    rows = template.unfold(0, stride, 1).index_select(0, torch.rsub(visible, half).flatten())
    return rows.view(*visible.shape, stride)[..., :width]
