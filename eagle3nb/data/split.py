"""03's held-out split: which samples the draft never trains on. 04 and the doctor compute the same split to
judge the draft on exactly those samples."""

from __future__ import annotations

import hashlib

from eagle3nb.errors import InputError


def split_holdout(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices. Chosen by a hash of the id, so the split does not depend on sample
    order and stays the same when more data is added. At least one sample is held out when fraction > 0."""
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(str(ids[i]).encode()).hexdigest())
    k = 0 if fraction <= 0 else max(1, round(fraction * len(ids)))
    if k >= len(ids):
        raise InputError(f"holdout_fraction {fraction} leaves no training samples out of {len(ids)}; lower it "
                         "or extract hidden states for more samples")
    return sorted(order[k:]), sorted(order[:k])
