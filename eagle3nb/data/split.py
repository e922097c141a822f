"""03's held-out split: which samples the draft never trains on. 04 and the doctor compute the same split to
judge the draft on exactly those samples."""

from __future__ import annotations

import hashlib

from eagle3nb.data.turns import conversation_of
from eagle3nb.errors import InputError


def split_holdout(ids: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices. Chosen by a hash of the conversation's id, so the split does not depend
    on sample order and stays the same when more data is added; the turns of one conversation (01's
    ``multi_turn: every``) fall on one side, since a later turn's prompt holds the earlier turns' answers. At least
    one sample is held out when fraction > 0."""
    keys = [hashlib.sha256(conversation_of(str(i)).encode()).hexdigest() for i in ids]
    order = sorted(range(len(ids)), key=lambda i: (keys[i], str(ids[i])))
    k = 0 if fraction <= 0 else max(1, round(fraction * len(ids)))
    while 0 < k < len(ids) and keys[order[k]] == keys[order[k - 1]]:
        k += 1  # the rest of the last held-out conversation
    if k >= len(ids):
        raise InputError(f"holdout_fraction {fraction} leaves no training samples out of {len(ids)}; lower it "
                         "or extract hidden states for more samples")
    return sorted(order[k:]), sorted(order[:k])
