"""Token-budget batches: which samples run through a forward pass together (02's extraction batches, 03's
micro-batches)."""

from __future__ import annotations


def pack_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped into forward batches, in the given order, such that ``len(batch) * longest <=
    tokens_per_batch`` (a sample longer than the budget runs alone). Callers sort by length first so padding
    stays small."""
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):  # no call per sample: 03 packs every epoch of a million samples up front
        m = n if n > longest else longest
        if cur and (len(cur) + 1) * m > tokens_per_batch:
            batches.append(cur)
            cur, m = [], n
        cur.append(i)
        longest = m
    if cur:
        batches.append(cur)
    return batches
