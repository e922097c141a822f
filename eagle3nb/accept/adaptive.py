"""04's adaptive verification, simulated: how many of each round's drafted tokens vLLM would verify when the
draft estimates its own acceptance (DSpark's confidence head), and what that buys per concurrency level.

vLLM's rule (``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``, ``AdaptiveVerificationManager``,
docs/benchmarks.md "Adaptive verification") sizes one draft budget ``B`` for the whole batch of ``c`` requests, each
with k drafted slots whose survival is the running product of its confidences:

    B = argmax over B in 0..c*k of (c + sum of the B largest survivals) / (draft_cost(c) + verify_cost(c + B))

(``get_num_tokens``; ties to the smallest B), then admits the B slots of highest survival across the batch
(``_assign_draft_token_budget``: a global top-B, a prefix of each request's block). B is chosen on the
confidences of each request's previous round (a stale copy: new requests count as 1.0), the slots on the current
ones; both are simulated so.

Here the costs are 04's step-cost model in units of a plain step at c: ``verify_cost(c + B) / t(c)`` =
``concurrency.width_ratio(cost, c, B / c)``, ``draft_cost`` = the round's draft and bookkeeping ``D``. The
held-out samples are decoded greedily as c concurrent requests (a finished sample hands its slot to the next; the
samples cycle until every one ran and the batch drains): a request accepts ``min(run, admitted)`` of its block. Per
level: the mean verify budget per request and round, tau (accepted + 1 per round), tau per verified token (the
target forward's width: admitted + 1), and the speedup over plain serving, adaptive against fixed k (the whole
block), with the same costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from eagle3nb import drafts
from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.concurrency import concurrency_verdict, fit_step_cost, width_ratio
from eagle3nb.accept.online import baseline_label
from eagle3nb.accept.params import AcceptParams
from eagle3nb.formulas import draft_passes

BLOCKS = "adaptive_blocks.pt"


def budget(survival: np.ndarray, c: int, cost: tuple[float, float], draft: float) -> int:
    """vLLM's batch budget: the B maximising (c + sum of the B largest of ``survival``) / (draft + t(c+B)/t(c))."""
    scores = np.sort(survival.ravel())[::-1]
    gain = c + np.concatenate(([0.0], np.cumsum(scores)))
    costs = draft + np.array([width_ratio(cost, c, b / c) for b in range(scores.size + 1)])
    return int(np.argmax(gain / costs))


def admit(survival: np.ndarray, b: int) -> np.ndarray:
    """Per request (rows of ``survival`` [c, k]) how many of its slots are among the batch's ``b`` best."""
    order = np.argsort(-survival.ravel(), kind="stable")[:b]
    return np.bincount(order // survival.shape[1], minlength=survival.shape[0])


def simulate(blocks: Sequence[dict[str, Any]], c: int, cost: tuple[float, float], draft: float,
             adaptive: bool = True) -> dict[str, float]:
    """Greedy decoding of the samples' ``blocks`` (each: ``anchors`` [A], ``confidence`` [A, k], ``run`` [A],
    ``full`` [A], as ``DraftMethod.confidences`` gives them) as ``c`` concurrent requests; ``adaptive`` False
    verifies every block whole (fixed k). Returns the totals' means: ``verify_budget``, ``tau``,
    ``tau_per_verified``, ``speedup`` (over plain decoding at c) and ``rounds``."""
    where = [{int(p): i for i, p in enumerate(b["anchors"].tolist())} for b in blocks]
    k = int(blocks[0]["confidence"].shape[1])
    queue = chain.from_iterable([range(len(blocks))] * max(1, -(-c // len(blocks))))
    def start() -> list | None:
        """The next sample's first round: [sample, anchor, its stale confidences (none yet: 1.0, as vLLM's)]."""
        for s in queue:
            if where[s] and bool(blocks[s]["full"][0]):
                return [s, int(blocks[s]["anchors"][0]), np.ones(k)]
        return None

    slots = [x for x in (start() for _ in range(c)) if x is not None]  # the c requests in flight
    tokens = verified = cost_sum = 0.0
    rounds = 0
    while slots:
        rows = [where[s][p] for s, p, _ in slots]
        conf = np.stack([blocks[s]["confidence"][r].numpy() for (s, _, _), r in zip(slots, rows)])
        stale = np.stack([x[2] for x in slots])
        n = len(slots)
        if adaptive:
            b = budget(np.cumprod(stale, 1), n, cost, draft)
            got = admit(np.cumprod(conf, 1), b)
        else:
            b, got = n * k, np.full(n, k)
        acc = np.minimum([int(blocks[s]["run"][r]) for (s, _, _), r in zip(slots, rows)], got)
        tokens, verified, rounds = tokens + float(acc.sum()) + n, verified + float(got.sum()) + n, rounds + n
        cost_sum += n * (width_ratio(cost, n, b / n) + draft)
        nxt = []
        for x, a, cf in zip(slots, acc, conf):
            x[1], x[2] = x[1] + int(a) + 1, cf
            r = where[x[0]].get(x[1])
            nxt.append(x if r is not None and bool(blocks[x[0]]["full"][r]) else start())
        slots = [x for x in nxt if x is not None]
    return {"verify_budget": verified / rounds - 1, "tau": tokens / rounds, "tau_per_verified": tokens / verified,
            "speedup": tokens / cost_sum, "rounds": rounds}


def levels(blocks: Sequence[dict[str, Any]], concurrency: Sequence[int], cost: tuple[float, float], draft: float
           ) -> list[dict[str, Any]]:
    """Per concurrency: the adaptive simulation beside fixed k, and adaptive's speedup over fixed k's."""
    out = []
    for c in concurrency:
        a, f = simulate(blocks, c, cost, draft), simulate(blocks, c, cost, draft, adaptive=False)
        out.append({"concurrency": c, **a, **{f"{key}_fixed": v for key, v in f.items() if key != "rounds"},
                    "gain": a["speedup"] / f["speedup"]})
    return out


def cost_model(P: AcceptParams, online: list[dict[str, Any]], prediction: dict[str, Any] | None, k: int,
               local: dict[str, Any] | None) -> dict[str, Any] | None:
    """The step costs the rule prices (``a``, ``b``: a plain step of width n costs a + b*n, ``draft``: the round's
    draft and bookkeeping, in plain steps at c): the sweep's fit (``concurrency.fit_step_cost``) and its series at
    the block's k (else its first) where the sweep has a baseline; else 04's prediction, a verify pass's extra
    width (measured here, or the given overhead) spread linearly over its k tokens; None without either."""
    base = baseline_label(P)
    fit = fit_step_cost(online, base) if online else None
    series = concurrency_verdict(online, base)["series"] if fit else []
    if fit and series:
        pick = next((s for s in series if s["k"] == k), series[0])
        return {"from": f"the sweep's step costs, {pick['endpoint']} k={pick['k']}'s bookkeeping", "a": fit[0],
                "b": fit[1], "draft": pick["bookkeeping"]}
    if not prediction:
        return None
    width = ((local or {}).get("costs") or {}).get("verify_overhead", prediction["overhead"])
    n = draft_passes(prediction["k"], prediction["parallel"])
    return {"from": f"04's prediction at k={prediction['k']} (width linear from c=1)", "a": 1 - width / prediction["k"],
            "b": width / prediction["k"], "draft": n * prediction["cost_ratio"] + prediction["overhead"] - width}


def confidence_blocks(P: AcceptParams, draft) -> list[dict[str, Any]] | str:
    """The draft's confidences and runs on 04's held-out samples (``adaptive_blocks.pt``, reused while the draft,
    data and samples are unchanged), or why there are none (the method estimates no acceptance)."""
    import torch

    from eagle3nb.accept.offline import heldout_indices
    from eagle3nb.data.reader import HiddenStates

    method = drafts.of(draft)
    if method.confidences is None:
        return f"{method.title} drafts estimate no acceptance (no confidence head): nothing to size budgets with"
    data = HiddenStates(P.data_path)
    indices, _ = heldout_indices(P, data)
    config = {"draft": fingerprint(P.draft_path), "data": str(P.data_path), "indices": indices}
    path = Path(P.stage_dir) / BLOCKS
    if path.exists() and (stored := torch.load(path))["config"] == config:
        return stored["blocks"]
    with torch.inference_mode():
        blocks = [method.confidences(draft, data[i], data.target_argmax(data[i])) for i in indices]
    blocks = [b for b in blocks if len(b["anchors"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": config, "blocks": blocks}, path)
    return blocks


def run_adaptive(P: AcceptParams, blocks: list[dict[str, Any]] | str, online: list[dict[str, Any]],
                 prediction: dict[str, Any] | None, local: dict[str, Any] | None) -> dict[str, Any]:
    """``metrics.json``'s ``adaptive_verification`` (``adaptive.json``, reused while its inputs are unchanged):
    ``levels`` per concurrency of ``P.concurrency_levels``, the ``cost`` priced, ``k``; or ``skipped``, why."""
    if isinstance(blocks, str) or not blocks:
        return {"skipped": blocks or "no held-out block lies in generated tokens"}
    k = int(blocks[0]["confidence"].shape[1])
    cost = cost_model(P, online, prediction, k, local)
    if cost is None:
        return {"skipped": "no step costs: neither a sweep with a baseline nor 04's prediction"}
    config = {"draft": fingerprint(P.draft_path), "data": str(P.data_path), "levels": P.concurrency_levels,
              "cost": cost, "blocks": sum(len(b["anchors"]) for b in blocks)}
    return cached(P.stage_dir / "adaptive.json", config, lambda: {
        "k": k, "cost": cost, "levels": levels(blocks, P.concurrency_levels, (cost["a"], cost["b"]), cost["draft"])})


def table(metrics: dict[str, Any]):
    """Adaptive against fixed k per concurrency (a DataFrame), or None when skipped."""
    import pandas as pd

    rows = (metrics.get("adaptive_verification") or {}).get("levels")
    cols = ["concurrency", "verify_budget", "tau", "tau_fixed", "tau_per_verified", "tau_per_verified_fixed",
            "speedup", "speedup_fixed", "gain"]
    return pd.DataFrame(rows)[cols].round(3) if rows else None


def plot(metrics: dict[str, Any]):
    """Tau per verified token and the predicted speedup against concurrency, adaptive against fixed k; None
    when skipped."""
    av = metrics.get("adaptive_verification") or {}
    if not av.get("levels"):
        return None
    import matplotlib.pyplot as plt

    cs = [lv["concurrency"] for lv in av["levels"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tau_per_verified", "tau per verified token"),
                           (axes[1], "speedup", "predicted speedup over plain")):
        ax.plot(cs, [lv[key] for lv in av["levels"]], marker="o", label="adaptive (vLLM's rule)")
        ax.plot(cs, [lv[f"{key}_fixed"] for lv in av["levels"]], marker="s", label=f"fixed k={av['k']}")
        ax.set(xscale="log", xlabel="concurrency", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle(f"Adaptive verification, simulated (costs: {av['cost']['from']})", fontsize=9)
    fig.tight_layout()
    return fig
