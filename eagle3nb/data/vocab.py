"""The draft vocabulary: the target ids the draft may propose, chosen by frequency in the training data.

EAGLE-3 keeps the top-N target ids by frequency over loss-masked tokens (the tokens the draft must predict),
sorted by id; ``d2t[d] = target_id - d`` maps draft id ``d`` back (``target = d + d2t[d]``) and ``t2d`` marks
the chosen target ids. Coverage = the share of loss-masked tokens inside the draft vocabulary: an upper
bound on how often the draft can be right at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from eagle3nb.errors import InputError

if TYPE_CHECKING:
    import numpy as np
    import torch

VOCAB_FILE = "draft_vocab.safetensors"


def token_counts(samples: Iterable[dict], vocab_size: int) -> tuple["np.ndarray", "np.ndarray"]:
    """(counts over loss-masked tokens, counts over all tokens) [V] of samples with ``input_ids``/``loss_mask``."""
    import numpy as np

    masked = np.zeros(vocab_size, dtype=np.int64)
    every = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        ids = np.asarray(s["input_ids"], dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InputError(f"sample {s.get('id')!r} has token id {int(ids.max())} outside the target's vocabulary "
                             f"(size {vocab_size}): the samples were made with another tokenizer than model_path's")
        every += np.bincount(ids, minlength=vocab_size)
        masked += np.bincount(ids, weights=np.asarray(s["loss_mask"], dtype=np.int64) != 0,
                              minlength=vocab_size).astype(np.int64)
    return masked, every


def build_draft_vocab(samples: Iterable[dict], vocab_size: int, draft_vocab_size: int) -> dict:
    """Choose the draft vocabulary. Returns ``{"d2t", "t2d", "target_ids", "coverage", "padded", "note", ...}``.

    Ties break by the smaller id. When fewer distinct ids than ``draft_vocab_size`` are loss-masked, the rest
    is filled with the most frequent remaining ids over all tokens (then the smallest unused ids), so the
    size is exactly ``draft_vocab_size``, and ``note`` says so."""
    import numpy as np
    import torch

    if draft_vocab_size > vocab_size:
        raise InputError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({vocab_size} ids); "
                         f"set draft_vocab_size <= {vocab_size}")
    masked, every = token_counts(samples, vocab_size)
    total = int(masked.sum())
    if total == 0:
        raise InputError("no loss-masked tokens in the samples: nothing to train on (check 01_synth's statuses)")
    ids = np.arange(vocab_size)
    # rank: loss-masked count, then count over all tokens, then id (np.lexsort sorts by the last key first)
    order = np.lexsort((ids, -every, -masked))
    chosen = order[:draft_vocab_size]
    distinct = int((masked > 0).sum())
    padded = max(0, draft_vocab_size - distinct)
    note = (f"only {distinct} distinct ids are loss-masked; filled {padded} more with the most frequent other ids "
            f"so the draft vocabulary has exactly {draft_vocab_size}") if padded else ""
    target_ids = torch.from_numpy(np.sort(chosen)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    covered = int(masked[chosen].sum())
    return {"target_ids": target_ids, "d2t": target_ids - torch.arange(draft_vocab_size), "t2d": t2d,
            "coverage": covered / total, "padded": padded, "note": note,
            "distinct_loss_tokens": distinct, "loss_tokens": total}


def keep_draft_vocab(samples: Iterable[dict], path: Path, vocab_size: int, draft_vocab_size: int) -> dict:
    """``build_draft_vocab``'s result for the vocabulary stored at ``path`` (an earlier 02's), its coverage
    measured over ``samples``."""
    d2t, t2d = load_draft_vocab(path)
    if d2t.shape[0] != draft_vocab_size or t2d.shape[0] != vocab_size:
        raise InputError(f"{path} holds a draft vocabulary of {d2t.shape[0]} ids over {t2d.shape[0]}, but this run "
                         f"asks for {draft_vocab_size} over the target's {vocab_size}: set draft_vocab_size to match")
    masked, _ = token_counts(samples, vocab_size)
    target_ids = draft_target_ids(d2t)
    total = int(masked.sum())
    return {"target_ids": target_ids, "d2t": d2t, "t2d": t2d, "coverage": int(masked[target_ids.numpy()].sum())
            / max(total, 1), "padded": 0, "note": "", "distinct_loss_tokens": int((masked > 0).sum()),
            "loss_tokens": total}


def save_draft_vocab(path: Path, vocab: dict) -> None:
    from safetensors.torch import save_file

    save_file({"d2t": vocab["d2t"].contiguous(), "t2d": vocab["t2d"].contiguous()}, str(path))


def load_draft_vocab(path: Path) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(d2t int64 [D], t2d bool [V]) from a ``draft_vocab.safetensors``."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def draft_target_ids(d2t: "torch.Tensor") -> "torch.Tensor":
    """Target id of every draft id, in draft order."""
    import torch

    return torch.arange(d2t.shape[0], dtype=torch.int64) + d2t
