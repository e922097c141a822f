"""What a compact storage costs in training signal: the loss targets that the same samples stored in bf16 and
in a compact storage yield, compared over loss-masked positions (``stage.storage_cost`` makes the runs)."""

from __future__ import annotations

from eagle3nb.data.reader import HiddenStates


def compare_targets(ref: HiddenStates, other: HiddenStates, max_samples: int | None = None,
                    temperature: float = 1.0) -> dict:
    """What a compact storage costs in training signal: the loss target (draft-vocab distribution) it yields
    against ``ref``'s, over loss-masked positions. Returns mean total variation, mean KL(other || ref),
    argmax agreement and the relative error of the aux states."""
    tv, kl, agree, aux_err, n = 0.0, 0.0, 0.0, 0.0, 0
    for i in range(min(len(ref), max_samples or len(ref))):
        a, b = ref[i], other[i]
        if a["id"] != b["id"]:
            raise ValueError(f"sample {i}: {a['id']} vs {b['id']}: compare runs over the same samples")
        m = a["loss_mask"].bool()
        p, q = ref.target_probs(a, temperature)[m], other.target_probs(b, temperature)[m]
        tv += 0.5 * (p - q).abs().sum(-1).sum().item()
        kl += (q * (q.clamp_min(1e-12).log() - p.clamp_min(1e-12).log())).sum(-1).sum().item()
        agree += (ref.target_argmax(a)[m] == other.target_argmax(b)[m]).sum().item()
        aux_err += ((b["aux"][m] - a["aux"][m]).norm(dim=-1) / a["aux"][m].norm(dim=-1).clamp_min(1e-12)).sum().item()
        n += int(m.sum())
    return {"positions": n, "total_variation": tv / n, "kl_other_to_ref": kl / n, "argmax_agreement": agree / n,
            "aux_relative_error": aux_err / n}


def cost_table(runs: dict[str, tuple[dict, HiddenStates]]):
    """One row per storage of ``runs`` (storage -> (02's metrics, its data), bf16 among them): bytes per token
    and, against bf16, what its loss targets lose."""
    import pandas as pd

    storages = [s for s in runs if s != "bf16"]
    bf16 = runs["bf16"][0]["bytes_per_token"]
    rows = [{"storage": "bf16", "bytes/token": bf16, "vs bf16": 1.0, "total_variation": 0.0, "kl_other_to_ref": 0.0,
             "argmax_agreement": 1.0, "aux_relative_error": 0.0}]
    for s in storages:
        c = compare_targets(runs["bf16"][1], runs[s][1])
        rows.append({"storage": s, "bytes/token": runs[s][0]["bytes_per_token"],
                     "vs bf16": runs[s][0]["bytes_per_token"] / bf16,
                     **{k: v for k, v in c.items() if k != "positions"}})
    return pd.DataFrame(rows)
