"""Tables and plots of a 02_hidden_states run, for the notebook (plots take an optional matplotlib ``ax``)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3nb.layers import to_sglang
from eagle3nb.hidden.storage import STORAGES, bytes_per_token

GB = 1e9


def layer_table(meta: dict):
    """Each stored state: its role, the HF/vLLM id, the SGLang/SpecForge id of the same tensor."""
    import pandas as pd

    ids, L = meta["layer_ids"], meta["num_layers"]
    roles = ["low", "middle", "high"] if len(ids) == 3 else [f"aux {k}" for k in range(len(ids))]
    rows = [{"state": r, "HF hidden_states / vLLM id": i, "SGLang / SpecForge id": s,
             "is": "embeddings" if i == 0 else f"output of decoder layer {i - 1} (input of layer {i})"}
            for r, i, s in zip(roles, ids, to_sglang(ids))]
    rows.append({"state": "final", "HF hidden_states / vLLM id": L, "SGLang / SpecForge id": L - 1,
                 "is": "after the final norm (vLLM's id L is before it; we apply the norm)"})
    return pd.DataFrame(rows)


def storage_table(hidden_size: int, tokens: int, num_aux: int = 3, topk: int = 32, draft_vocab_size: int = 32000):
    """Bytes/token of every storage option, its ratio to bf16 and the disk a run of ``tokens`` takes."""
    import pandas as pd

    bf16 = bytes_per_token("bf16", hidden_size, num_aux, topk, draft_vocab_size)
    rows = []
    for s in STORAGES:
        b = bytes_per_token(s, hidden_size, num_aux, topk, draft_vocab_size)
        rows.append({"storage": s, "bytes/token": b, "vs bf16": round(b / bf16, 4), "GB for the run": tokens * b / GB})
    return pd.DataFrame(rows)


def disk_table(metrics: dict):
    """Projected (printed before the run) vs actual disk use."""
    import pandas as pd

    return pd.DataFrame([
        {"what": "projected before starting", "GB": metrics["projected_bytes"] / GB},
        {"what": "actual (shards + head + vocab)", "GB": metrics["total_bytes"] / GB},
        {"what": "free when it started", "GB": metrics["free_bytes"] / GB},
    ])


def throughput(stage_dir: str | Path, window_s: float = 30.0):
    """Per-batch log -> DataFrame with elapsed time and tokens/s averaged over ``window_s``."""
    import pandas as pd

    path = Path(stage_dir) / "throughput.jsonl"
    df = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [],
                      columns=["time", "tokens", "seconds"])
    if df.empty:
        return df.assign(elapsed_s=[], tok_per_s=[])
    df["elapsed_s"] = df["seconds"].cumsum()
    win = max(1, int(window_s / max(df["seconds"].mean(), 1e-9)))
    df["tok_per_s"] = df["tokens"].rolling(win, min_periods=1).sum() / df["seconds"].rolling(win, min_periods=1).sum()
    return df


def plot_throughput(stage_dir: str | Path, ax=None):
    import matplotlib.pyplot as plt

    df = throughput(stage_dir)
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    ax.plot(df["elapsed_s"], df["tok_per_s"])
    ax.set(xlabel="compute time (s)", ylabel="tokens/s", title="extraction throughput")
    return ax


def plot_lengths(meta: dict, ax=None):
    import matplotlib.pyplot as plt

    lengths = [s["length"] for s in meta["samples"]]
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    ax.hist(lengths, bins=min(50, max(5, len(lengths) // 4)))
    ax.set(xlabel="tokens per sample", ylabel="samples", title=f"sequence lengths ({len(lengths)} samples)")
    return ax


def compare_targets(ref, other, max_samples: int | None = None, temperature: float = 1.0) -> dict:
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


def storage_cost(P, samples: int = 16, storages: tuple[str, ...] = ("fp8", "topk")):
    """Extract the first ``samples`` samples in bf16 and in each compact storage (under
    ``<stage_dir>/storage_check/``) and compare the loss targets they yield: one row per storage."""
    import pandas as pd

    from eagle3nb.hidden.reader import HiddenStates
    from eagle3nb.hidden.stage import extract

    base = P.stage_dir / "storage_check"
    runs = {}
    for s in ("bf16", *storages):
        q = P.model_copy(update={"storage": s, "output_dir": str(base / s), "max_samples": samples, "force": True})
        runs[s] = (extract(q), HiddenStates(base / s))
    bf16 = runs["bf16"][0]["bytes_per_token"]
    rows = [{"storage": "bf16", "bytes/token": bf16, "vs bf16": 1.0, "total_variation": 0.0, "kl_other_to_ref": 0.0,
             "argmax_agreement": 1.0, "aux_relative_error": 0.0}]
    for s in storages:
        c = compare_targets(runs["bf16"][1], runs[s][1])
        rows.append({"storage": s, "bytes/token": runs[s][0]["bytes_per_token"],
                     "vs bf16": runs[s][0]["bytes_per_token"] / bf16, **{k: v for k, v in c.items() if k != "positions"}})
    return pd.DataFrame(rows)
