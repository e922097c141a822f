"""DSpark's confidence head, calibrated after training as the DSpark paper does: post-hoc temperature scaling.

The head estimates each drafted slot's acceptance probability ``sum_v min(p_v, q_v)`` (what its binary
cross-entropy is trained on); vLLM reads ``sigmoid(proj(.))`` to size adaptive verification budgets, so an
over-confident head verifies tokens that will be rejected. 03 measures the head on the held-out split:

- **ECE** (expected calibration error): the slots binned by predicted confidence (``BINS`` equal-width bins), the
  count-weighted mean of ``|mean confidence - mean acceptance probability|`` over the bins;
- **temperature**: one scale ``s = 1/T`` of the head's logit fitted by Newton's method on the same slots' binary
  cross-entropy (convex in ``s``), then folded into ``proj``'s weight and bias, so the exported checkpoint is
  the calibrated head and vLLM needs no new field. It is kept only when the ECE does not rise (it minimises the
  cross-entropy, not the ECE); ``applied`` says which.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

BINS = 10


def reliability(conf: torch.Tensor, accept: torch.Tensor, bins: int = BINS) -> list[dict[str, float]]:
    """Per non-empty bin of conf [N] in [0, 1]: its edges, slot count, mean confidence and mean acceptance
    probability (accept [N]): the reliability diagram's points."""
    edge = (conf.clamp(0, 1) * bins).long().clamp_max(bins - 1)  # shape: [N], the bin of each slot
    out = []
    for b in range(bins):
        sel = edge == b
        if sel.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(sel.sum()),
                        "confidence": float(conf[sel].mean()), "acceptance": float(accept[sel].mean())})
    return out


def ece(conf: torch.Tensor, accept: torch.Tensor, bins: int = BINS) -> float:
    """Expected calibration error of conf [N] against the acceptance probabilities accept [N]."""
    n = max(1, conf.numel())
    return sum(r["n"] / n * abs(r["confidence"] - r["acceptance"]) for r in reliability(conf, accept, bins))


def fit_scale(logits: torch.Tensor, accept: torch.Tensor, steps: int = 50) -> float:
    """The scale s > 0 minimising the mean binary cross-entropy of sigmoid(s * logits) [N] against accept [N]
    (Newton's method: the loss is convex in s)."""
    z, a, s = logits.double(), accept.double(), 1.0
    for _ in range(steps):
        p = torch.sigmoid(s * z)
        grad, hess = float(((p - a) * z).mean()), float((p * (1 - p) * z * z).mean())
        if hess <= 1e-12:
            break
        step = grad / hess
        s = max(s - step, s / 4)  # stay positive: at most a 4x shrink per step
        if abs(step) < 1e-8:
            break
    return s


@torch.no_grad()
def calibrate(objective: Any, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Measure the draft's confidence head on ``batches`` (03's held-out micro-batches, evaluation's fixed anchors),
    fit its temperature and fold it into the head (``objective.draft`` changes in place when it helps). Returns
    03's ``metrics.json`` ``calibration``: ECE and reliability bins before and after, the temperature, the slots."""
    pairs = [objective.confidence(batch) for batch in batches]
    logits = torch.cat([z for z, _ in pairs]).float().cpu()  # shape: [N] every scored slot's confidence logit
    accept = torch.cat([a for _, a in pairs]).float().cpu()  # shape: [N] its acceptance probability
    before = torch.sigmoid(logits)
    s = fit_scale(logits, accept) if logits.numel() else 1.0
    after = torch.sigmoid(s * logits)
    ece_before, ece_after = ece(before, accept), ece(after, accept)
    applied = ece_after <= ece_before
    if applied:
        proj = objective.draft.confidence_head.proj
        proj.weight.mul_(s)
        proj.bias.mul_(s)
    else:
        s, after, ece_after = 1.0, before, ece_before
    return {"slots": int(logits.numel()), "bins": BINS, "temperature": 1.0 / s, "applied": applied,
            "ece_before": ece_before, "ece_after": ece_after,
            "reliability_before": reliability(before, accept), "reliability_after": reliability(after, accept)}
