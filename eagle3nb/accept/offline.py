"""04_acceptance: how often the draft is accepted, what that means for throughput, and why.

Offline (no server): on held-out hidden states, chain drafts of length K from every position with the
training-time-test attention (step j at position t sees the verified features 0..t and its own chain), and
compare each step with the target. Greedy: accepted iff the draft's argmax (mapped to the target vocab) is the
target's argmax. Sampling at temperature T: the expected acceptance of rejection sampling, sum_v min(p, q) =
1 - TV(p, q). alpha_i is *conditional*: P(step i accepted | steps < i accepted); tau(k) = 1 + sum_i prod_j
alpha_j (eagle3nb.formulas). Steps are teacher-forced with the data's tokens, which are exactly what an
accepted chain feeds when the data is the target's own (greedy) output.

Then the prediction: speedup = tau / (1 + k*c + overhead), with c = draft step / target step cost and
overhead = the extra cost of verifying k+1 tokens instead of decoding 1 (measured here or given).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3nb.formulas import speedup, tau_from_conditional, tau_iid
from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve
from eagle3nb.progress import write_json_atomic

STAGE = "04_acceptance"
SEGMENTS = {1: "reasoning", 2: "answer"}
PUBLIC_KIMI = "public Kimi-K2.5 drafters reach tau 3.0-3.5 at k=3 (alpha ~0.85)"


class Endpoint(BaseModel):
    """One OpenAI-compatible server to benchmark."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(description="name in tables and plots, e.g. baseline / eagle3")
    url: str = Field(description="base URL, http://host:8000 (/v1 added when missing)")
    model: str | None = Field(None, description="served model name; null = ask /v1/models")
    metrics_url: str | None = Field(None, description="Prometheus page; null = <host>/metrics")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not a URL: use http://host:port")
        v = v.rstrip("/")
        return v if v.endswith("/v1") else v + "/v1"


@register(STAGE)
class AcceptParams(TargetParams):
    """Parameters of ``notebooks/04_acceptance.ipynb`` (docs/ARCHITECTURE.md "04_acceptance output")."""

    draft_dir: str | None = Field(None, description="the draft to judge (EAGLE-3 or speculators layout); default outputs/<run_name>/03_train/draft")
    data_dir: str | None = Field(None, description="held-out hidden states (02_hidden_states layout); default outputs/<run_name>/02_hidden_states")
    model_path: str = Field("toy:demo", description="the target in Hugging Face layout, or toy:smoke / toy:demo")
    output_dir: str | None = Field(None, description="where metrics.json and figures go; default outputs/<run_name>/04_acceptance")
    k: int = Field(3, ge=1, le=16, description="drafted tokens per target step (vLLM num_speculative_tokens)")
    max_k: int = Field(6, ge=1, le=16, description="offline: chain length for the tau(k) curve, k = 1..max_k")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature served (online) and estimated offline besides greedy; 0 = greedy")
    offline_samples: int | None = Field(200, ge=1, description="held-out samples used offline; null = all")
    local_prompts: int = Field(8, ge=0, description="prompts decoded here plainly and speculatively (lossless check, speed); 0 = skip (target too big for this machine)")
    endpoints: Literal["embedded"] | list[Endpoint] = Field("embedded", description="'embedded' (the notebook serves the target without and with the draft) or a list of {label, url}; the first is the speedup baseline")
    concurrency_levels: list[int] = Field([1, 4], description="concurrent requests per benchmark level")
    num_prompts: int = Field(16, ge=1, description="requests per concurrency level")
    prompts: str = Field("toy:heldout", description="prompt set (JSONL / parquet / datasets folder, or toy:heldout) for the local check and the benchmark")
    max_tokens: int = Field(64, ge=1, description="tokens generated per request / local prompt")
    thinking: bool = Field(True, description="chat-template thinking switch for the prompts (as served)")
    thinking_kwarg: str = Field("thinking", description="chat-template kwarg for thinking: Kimi 'thinking', Qwen 'enable_thinking'")
    cost_ratio: float | None = Field(None, ge=0.0, description="draft step / target step cost c; null = measured here on the target and draft")
    overhead: float | None = Field(None, ge=0.0, description="extra cost of a verify pass over a decode step (fraction of a step); null = measured here")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the endpoints' API key (never the key)")
    seed: int = Field(0, description="seed of sampled local decoding")

    @field_validator("concurrency_levels")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("give at least one concurrency level, each >= 1")
        return v

    @model_validator(mode="after")
    def _k(self) -> "AcceptParams":
        if self.max_k < self.k:
            raise ValueError(f"max_k ({self.max_k}) must be >= k ({self.k}): the tau(k) curve must include k")
        if isinstance(self.endpoints, list) and len({e.label for e in self.endpoints}) != len(self.endpoints):
            raise ValueError("endpoint labels must be unique")
        return self

    @property
    def draft_path(self) -> Path:
        return resolve(self.draft_dir) if self.draft_dir else self.out_dir(None, "03_train") / "draft"

    @property
    def data_path(self) -> Path:
        return self.out_dir(self.data_dir, "02_hidden_states")

    def check_paths(self) -> None:
        src = self.params_file or "the notebook's parameters cell"
        if not (self.draft_path / "config.json").exists():
            raise ParamsError(f"parameter 'draft_dir' in {src}: {self.draft_path} has no config.json; run 03_train "
                              "first or point draft_dir at a draft checkpoint folder")
        if not (self.data_path / "index.json").exists():
            raise ParamsError(f"parameter 'data_dir' in {src}: {self.data_path} has no index.json; run "
                              "02_hidden_states first or point data_dir at held-out hidden states")
        if not self.model_path.startswith("toy:") and not (resolve(self.model_path) / "config.json").exists():
            raise ParamsError(f"parameter 'model_path' in {src}: {resolve(self.model_path)} has no config.json; "
                              "point it at the target's Hugging Face folder")
        if self.local_prompts == 0 and (self.cost_ratio is None or self.overhead is None):
            raise ParamsError(f"{src}: local_prompts is 0, so costs cannot be measured here; set cost_ratio and "
                              "overhead (e.g. 0.05 and 0.1 for a 1-layer draft of a 61-layer target)")
        if self.endpoints == "embedded" and not self.model_path.startswith("toy:") \
                and self.local_prompts == 0:
            raise ParamsError(f"parameter 'endpoints' in {src} is 'embedded' but the target is not loaded here "
                              "(local_prompts: 0); list your servers as [{label: baseline, url: ...}, {label: "
                              "eagle3, url: ...}]")


# ----------------------------------------------------------------------------------------- offline


def chain_logits(draft, aux, input_ids, steps: int):
    """Draft logits of a K-step chain from every position, in parallel (training-time-test attention), one
    step at a time (a generator, so only one step's logits are held).

    aux [T, 3H], input_ids [T]. Step j at position t feeds the token t+1+j and predicts token t+2+j; yields
    ``steps`` tensors [T-1, draft_vocab] on the draft's device. Positions follow decoding: step j sits at
    position t + j."""
    import torch

    from eagle3nb.draft import TTTCache

    dev = draft.fc.weight.device
    T = input_ids.shape[0]
    cache = TTTCache()
    pos = torch.arange(T - 1, device=dev)[None]
    hidden = draft.fuse(aux[None, :-1].to(dev))
    input_ids = input_ids.to(dev)
    for j in range(steps):
        ids = torch.zeros(T - 1, dtype=torch.long, device=dev)
        ids[: max(0, T - 1 - j)] = input_ids[1 + j:]
        hidden, logits = draft(hidden, ids[None], pos + j, cache=cache)
        yield logits[0].float()


def expected_acceptance(q, p):
    """Probability that rejection sampling accepts a token drawn from q when the target's distribution is p
    (both over the same tokens, last axis): sum_v min(p_v, q_v) = 1 - TV(p, q) when p sums to 1."""
    import torch

    return torch.minimum(q, p).sum(-1)


def chain_acceptance(draft, item: dict, target_argmax, target_probs, steps: int, temperature: float) -> dict:
    """Per start position t: greedy acceptance [K, T-1] (0/1), expected sampled acceptance [K, T-1] (when
    ``target_probs`` [T, draft_vocab] at ``temperature`` is given), and validity [K, T-1] (step j counts
    only when the tokens t+2..t+2+j exist and are all generated ones, i.e. in the loss mask)."""
    import torch

    dev = draft.fc.weight.device
    ids, mask = item["input_ids"], item["loss_mask"].bool().to(dev)
    target_argmax = target_argmax.to(dev)
    target_probs = target_probs.to(dev) if target_probs is not None else None
    T = ids.shape[0]
    n = T - 1
    greedy = torch.zeros(steps, n, device=dev)
    sampled = torch.zeros(steps, n, device=dev) if target_probs is not None else None
    valid = torch.zeros(steps, n, dtype=torch.bool, device=dev)
    ok = torch.ones(n, dtype=torch.bool, device=dev)
    with torch.no_grad():  # evaluation only, whoever calls it
        for j, lg in enumerate(chain_logits(draft, item["aux"], ids, steps)):
            m = n - 1 - j  # positions t whose step-j target (the target's distribution at t+1+j) exists
            if m <= 0:
                break
            tgt = torch.zeros(n, dtype=torch.bool, device=dev)
            tgt[:m] = mask[2 + j:]
            ok = ok & tgt
            valid[j] = ok
            pred = draft.draft_to_target(lg[:m].argmax(-1))
            greedy[j, :m] = (pred == target_argmax[1 + j: 1 + j + m]).float()
            if sampled is not None:
                q = torch.softmax(lg[:m] / temperature, dim=-1)
                sampled[j, :m] = expected_acceptance(q, target_probs[1 + j: 1 + j + m])
    return {"greedy": greedy.cpu(), "sampled": sampled.cpu() if sampled is not None else None,
            "valid": valid.cpu()}


def simulate_rounds(greedy, valid, mask, k: int) -> list[int]:
    """Accepted drafts per round when decoding the sample greedily with chains of ``k``: the first round starts
    where generation starts, each next one n+1 tokens later, as in real decoding. Rounds whose chain would run
    past the sample's generated tokens are not simulated. On the target's own greedy output this reproduces
    the rounds of real speculative decoding exactly (``eagle3nb.spec``)."""
    gen = mask.nonzero()
    if len(gen) == 0:
        return []
    t, out = int(gen[0]) - 1, []  # draft at t predicts token t+2; the target made token t+1 (prefill)
    while t < valid.shape[1] and bool(valid[k - 1, t]):
        n = 0
        while n < k and greedy[n, t] > 0.5:
            n += 1
        out.append(n)
        t += n + 1
    return out


def conditional_alphas(acc, valid) -> list[float]:
    """alpha_j = E[prod_{i<=j} a_i] / E[prod_{i<j} a_i] over the start positions valid for step j."""
    import torch

    alphas, run = [], torch.ones(acc.shape[1])
    for j in range(acc.shape[0]):
        v = valid[j].float()
        den = float((run * v).sum())
        run = run * acc[j]
        num = float((run * v).sum())
        alphas.append(num / den if den > 0 else 0.0)
    return alphas


def summarize_chain(acc, valid, k: int) -> dict[str, Any]:
    """alpha per position, tau(k) for every chain length, the headline at ``k``, and how many positions."""
    alphas = conditional_alphas(acc, valid)
    taus = [tau_from_conditional(alphas[:i]) for i in range(1, len(alphas) + 1)]
    return {"per_position": alphas[:k], "acceptance_length": taus[k - 1], "alpha_by_position": alphas,
            "tau_by_k": taus, "acceptance_rate": (taus[k - 1] - 1) / k, "positions": int(valid[0].sum())}


def target_probs_for(draft, data, item: dict, temperature: float, head=None, chunk: int = 512):
    """float32 [T, draft_vocab]: the target's probability of each of the *draft's* tokens at ``temperature``.
    From the stored final state: the full-vocabulary softmax through ``head`` (the target's lm_head [V, H],
    on the draft's device), so mass outside the draft vocabulary counts as never acceptable (exact). From
    compact (top-k) storage: the data's draft-vocabulary distribution, which must be the draft's vocabulary
    (and overstates acceptance by the mass outside it)."""
    import torch

    ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
    if "final" in item:
        head = data.lm_head().float().to(ids.device) if head is None else head
        final = item["final"].float().to(head.device)
        out = []
        for s in range(0, final.shape[0], chunk):
            logits = final[s:s + chunk] @ head.T / temperature
            out.append(torch.exp(logits[:, ids] - torch.logsumexp(logits, dim=-1, keepdim=True)))
        return torch.cat(out)
    if data.d2t.shape != draft.d2t.shape or not torch.equal(data.d2t, draft.d2t.cpu()):
        raise ValueError("the held-out data stores only top-k probabilities over its own draft vocabulary, which is "
                         "not the draft's; extract it with storage bf16 (or fp8), or use the draft's vocabulary "
                         "(eagle3nb doctor: shapes_vocab)")
    return data.target_probs(item, temperature)


def heldout_indices(P: "AcceptParams", data) -> tuple[list[int], str]:
    """Which samples to measure on, and how they were chosen. With ``data_dir`` unset the data is 03's training
    data, so only 03_train's held-out split (same id hash, same fraction) is used; a data_dir is used whole."""
    n = len(data)
    if P.data_dir is None:
        from eagle3nb.params import run_params, schema_for
        from eagle3nb.train.data import split_holdout

        fraction = schema_for("03_train").model_fields["holdout_fraction"].default
        if P.params_file and resolve(P.params_file).parent.is_dir():
            fraction = run_params(resolve(P.params_file).parent, "03_train").get("holdout_fraction", fraction)
        _, idx = split_holdout([s["id"] for s in data.meta["samples"]], fraction)
        how = f"03_train's held-out split of the training data ({len(idx)} of {n} samples, fraction {fraction})"
    else:
        idx, how = list(range(n)), f"all {n} samples of {P.data_path}"
    if P.offline_samples is not None and len(idx) > P.offline_samples:
        idx, how = idx[:P.offline_samples], how + f", first {P.offline_samples}"
    return idx, how


def offline_acceptance(draft, data, k: int, max_k: int, temperature: float = 0.0,
                       think_ids: tuple[int | None, int | None] = (None, None), indices: Sequence[int] | None = None,
                       stage_dir: Path | None = None) -> dict[str, Any]:
    """Acceptance of ``draft`` on the held-out hidden states ``data`` (an ``eagle3nb.hidden.HiddenStates``):
    greedy, at ``temperature`` (when > 0), by segment (reasoning / answer) and by prompt category."""
    import torch

    from eagle3nb.progress import Progress
    from eagle3nb.tokens import segment_ids

    indices = list(range(len(data))) if indices is None else list(indices)
    if not indices:
        raise ValueError("no held-out samples to measure on: extract hidden states of held-out prompts (02) and "
                         "set data_dir, or raise 03_train's holdout_fraction")
    head = data.lm_head().float().to(draft.fc.weight.device) if temperature > 0 else None
    prog = Progress(stage_dir, len(indices), "offline acceptance", "samples") if stage_dir else None
    parts: dict[str, list] = {"greedy": [], "sampled": [], "valid": [], "segment": [], "category": [], "rounds": []}
    skipped = 0
    with torch.inference_mode():
        for i in indices:
            item = data[i]
            if item["input_ids"].shape[0] < 3:
                skipped += 1
                continue
            probs = target_probs_for(draft, data, item, temperature, head) if temperature > 0 else None
            r = chain_acceptance(draft, item, data.target_argmax(item), probs, max_k, temperature)
            parts["rounds"] += simulate_rounds(r["greedy"], r["valid"], item["loss_mask"], k)
            ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
            if think_ids[0] is not None and think_ids[1] is not None:
                seg = segment_ids(ids, mask, think_ids[0], think_ids[1])
            else:
                seg = [2 if m else 0 for m in mask]
            parts["segment"].append(torch.tensor(seg[2:] + [0]))  # segment of the first drafted token t+2
            parts["category"] += [item.get("category")] * (len(ids) - 1)
            for key in ("greedy", "sampled", "valid"):
                if r[key] is not None:
                    parts[key].append(r[key])
            if prog:
                prog.update(1)
    if prog:
        prog.close()
    if not parts["valid"]:
        raise ValueError("every held-out sample is shorter than 3 tokens; nothing to draft")
    greedy, valid = torch.cat(parts["greedy"], 1), torch.cat(parts["valid"], 1)
    sampled = torch.cat(parts["sampled"], 1) if parts["sampled"] else None
    segment = torch.cat(parts["segment"])
    if int(valid[0].sum()) == 0:
        raise ValueError("no generated (loss-masked) tokens to draft in the held-out data: check 02's loss masks "
                         "(eagle3nb doctor: data_health)")

    def block(sel) -> dict[str, Any]:
        v = valid & sel[None]
        out = {"greedy": summarize_chain(greedy, v, k)}
        if sampled is not None:
            out["sampled"] = summarize_chain(sampled, v, k)
        return out

    everything = block(torch.ones_like(segment, dtype=torch.bool))
    rounds = parts["rounds"]
    everything["greedy"]["simulated_acceptance_length"] = 1 + sum(rounds) / len(rounds) if rounds else None
    everything["greedy"]["simulated_rounds"] = len(rounds)
    head = everything["sampled"] if sampled is not None else everything["greedy"]
    result = {
        "k": k, "max_k": max_k, "temperature": temperature, "samples": len(indices) - skipped,
        "skipped_short": skipped,
        **{key: head[key] for key in ("per_position", "acceptance_length", "acceptance_rate", "alpha_by_position",
                                      "tau_by_k", "positions")},
        "greedy": everything["greedy"], "sampled": everything.get("sampled"),
        "by_segment": {name: block(segment == s) for s, name in SEGMENTS.items() if bool((segment == s).any())},
    }
    cats = parts["category"]
    if any(c is not None for c in cats):
        names = sorted({c for c in cats if c is not None})
        result["by_category"] = {c: block(torch.tensor([x == c for x in cats])) for c in names}
    return result


def breakdown_table(offline: dict[str, Any], by: str = "by_segment"):
    """One row per segment / category: positions, alpha_1, tau at k (greedy and sampled)."""
    import pandas as pd

    rows = []
    for name, b in (offline.get(by) or {}).items():
        row = {by.removeprefix("by_"): name, "positions": b["greedy"]["positions"],
               "alpha_1 greedy": b["greedy"]["per_position"][0], f"tau(k={offline['k']}) greedy": b["greedy"]["acceptance_length"]}
        if b.get("sampled"):
            row[f"alpha_1 T={offline['temperature']}"] = b["sampled"]["per_position"][0]
            row[f"tau(k={offline['k']}) T={offline['temperature']}"] = b["sampled"]["acceptance_length"]
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------- prediction


def predict(tau: float, k: int, cost_ratio: float, overhead: float) -> dict[str, Any]:
    """The predicted speedup with every term, so the notebook can show the arithmetic."""
    s = speedup(tau, k, cost_ratio, overhead)
    return {"tau": tau, "k": k, "cost_ratio": cost_ratio, "overhead": overhead, "speedup": s,
            "formula": f"speedup = tau / (1 + k*c + overhead) = {tau:.3f} / (1 + {k}*{cost_ratio:.3f} + "
                       f"{overhead:.3f}) = {s:.3f}"}


def speedup_by_k(alpha_by_position: Sequence[float], cost_ratio: float, overhead: float) -> list[float]:
    """Predicted speedup for k = 1..K from the conditional alphas (the overhead is taken as independent of k)."""
    return [speedup(tau_from_conditional(alpha_by_position[:k]), k, cost_ratio, overhead)
            for k in range(1, len(alpha_by_position) + 1)]


# ----------------------------------------------------------------------------------------- verdict


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _rate(alpha1: float) -> str:
    return "good" if alpha1 >= 0.7 else "fair" if alpha1 >= 0.4 else "low"


def likely_causes(metrics: dict[str, Any], doctor_results: list | None = None) -> list[str]:
    """Likeliest causes of a low acceptance or a slowdown, each pointing to an ``eagle3nb doctor`` check."""
    causes: list[str] = []
    doctor: list[str] = []
    if doctor_results:
        from eagle3nb.doctor import likely_causes as doctor_causes

        doctor = doctor_causes(doctor_results)
        causes += [c for c in doctor if " failed: " in c or " warned: " in c]  # evidence first
    off = metrics.get("offline") or {}
    alpha1 = off.get("per_position", [0.0])[0] if off else None
    seg = off.get("by_segment") or {}
    if alpha1 is not None and alpha1 < 0.2:
        causes.append("almost nothing is accepted even offline: the draft reads the wrong aux layers or a wrong "
                      "vocabulary map (doctor: layer_ids, shapes_vocab), or it is untrained (doctor: draft_sanity)")
    if "reasoning" in seg and "answer" in seg:
        r = seg["reasoning"]["greedy"]["per_position"][0]
        a = seg["answer"]["greedy"]["per_position"][0]
        if a - r > 0.15:
            causes.append(f"reasoning tokens are accepted far less than answer tokens ({r:.0%} vs {a:.0%}): the "
                          "training stream likely lost or mangled the reasoning (doctor: thinking, token_stream)")
    if alpha1 is not None and alpha1 < 0.5:
        causes.append("too little or unrepresentative training data for this draft (doctor: data_health)")
    online = [r for r in metrics.get("online") or [] if r.get("acceptance_length")]
    if online and off:
        served = sum(r["acceptance_length"] for r in online) / len(online)
        if served < off["acceptance_length"] - 0.5:
            causes.append(f"the server accepts less than offline ({served:.2f} vs {off['acceptance_length']:.2f} "
                          "tokens per step): it runs the draft unlike training, e.g. aux ids in the other "
                          "engine's convention or another chat template / thinking mode (doctor: layer_ids, "
                          "server, thinking)")
    pred = (metrics.get("prediction") or {}).get("speedup")
    if pred is not None and pred < 1.0:
        causes.append(f"the acceptance cannot pay for drafting: tau {off['acceptance_length']:.2f} is less than the "
                      f"cost of a step with k={off['k']} drafts ({metrics['prediction']['formula']}); raise "
                      "acceptance first, or lower k")
    slow = [r for r in metrics.get("online") or [] if r.get("speedup") is not None and r["speedup"] < 0.95
            and r.get("endpoint") != metrics.get("online_baseline")]
    if slow and pred is not None and pred >= 1.0:
        levels = ", ".join(str(r["concurrency"]) for r in slow)
        causes.append(f"serving is slower than predicted ({pred:.2f}x) at concurrency {levels}: the verify pass of "
                      "k+1 tokens per request costs more once the server is compute-bound, and a speculative "
                      "engine that batches less than the baseline loses throughput (the embedded one runs "
                      "requests one at a time); use speculation at low concurrency only, or lower k")
    return list(dict.fromkeys(causes + doctor))


def verdict(metrics: dict[str, Any], doctor_results: list | None = None):
    """The plain-words table that ends the notebook: acceptance, what it means at each concurrency, why."""
    import pandas as pd

    rows: list[tuple[str, str]] = []
    off = metrics.get("offline") or {}
    k = off.get("k")
    if off:
        a1, tau = off["per_position"][0], off["acceptance_length"]
        kind = "greedy" if not off.get("temperature") else f"at temperature {off['temperature']}"
        rows.append(("Acceptance (offline, held-out data)",
                     f"{_rate(a1)}: the first drafted token is accepted {a1:.0%} of the time ({kind}); a target "
                     f"step yields tau = {tau:.2f} tokens at k={k} (alpha per position "
                     f"{', '.join(f'{a:.2f}' for a in off['per_position'])}); for scale, {PUBLIC_KIMI}."))
    loc = metrics.get("local") or {}
    if loc:
        same = loc.get("identical_to_target")
        rows.append(("Lossless (local speculative decoding)",
                     "yes: greedy output identical to the target's own on every prompt" if same else
                     f"NO: outputs differ from the target's on prompts {loc.get('mismatched_prompts')}"
                     if same is False else "not checked (sampling)"))
        rows.append(("Acceptance (local, real decoding)",
                     f"tau = {loc['acceptance_length']:.2f} tokens per target step at k={loc['k']} (offline greedy "
                     f"said {_num(off.get('greedy', {}).get('acceptance_length'))} over all positions, "
                     f"{_num(off.get('greedy', {}).get('simulated_acceptance_length'))} replaying decoding rounds); "
                     f"{loc['spec_tokens_per_s']:.1f} vs {loc['plain_tokens_per_s']:.1f} tokens/s plain = "
                     f"{loc['speedup']:.2f}x here."))
    pred = metrics.get("prediction") or {}
    if pred:
        verdict_word = "faster" if pred["speedup"] > 1 else "SLOWER"
        rows.append(("Predicted speedup", f"{pred['formula']}: {verdict_word} than plain decoding "
                                          "(memory-bound serving, low concurrency)."))
    for r in metrics.get("online") or []:
        if r.get("speedup") is None or r.get("endpoint") == (metrics.get("online_baseline") or ""):
            continue
        s = r["speedup"]
        what = ("faster" if s >= 1.05 else "no gain" if s >= 0.95 else "slower")
        acc = (f", server acceptance length {r['acceptance_length']:.2f}" if r.get("acceptance_length")
               else ", no spec-decode metrics from the server")
        rows.append((f"Throughput at concurrency {r['concurrency']} ({r['endpoint']})",
                     f"{s:.2f}x the baseline ({r['output_tokens_per_s']:.1f} tok/s): {what}{acc}."))
    causes = likely_causes(metrics, doctor_results)
    low = off and (off["per_position"][0] < 0.4 or any(
        (r.get("speedup") or 1.0) < 1.0 for r in metrics.get("online") or []))
    if causes and low:
        for i, c in enumerate(causes[:5], 1):
            rows.append((f"Likeliest cause #{i}", c))
    elif off:
        rows.append(("Likeliest cause", "nothing points to a problem; `eagle3nb doctor params/<run>/` checks the "
                                        "setup end to end."))
    return pd.DataFrame(rows, columns=["question", "answer"]).style.hide(axis="index").set_properties(
        **{"text-align": "left", "white-space": "pre-wrap"})


# ----------------------------------------------------------------------------------------- plots


def plot_alpha(metrics: dict[str, Any]):
    """Conditional acceptance per draft position: offline (greedy and sampled), local, and each endpoint."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    off = metrics.get("offline") or {}
    series = []
    if off:
        series.append(("offline greedy", off["greedy"]["alpha_by_position"], "o-"))
        if off.get("sampled"):
            series.append((f"offline T={off['temperature']}", off["sampled"]["alpha_by_position"], "s-"))
    if metrics.get("local"):
        series.append(("local decoding (greedy)", metrics["local"]["per_position"], "D--"))
    for r in metrics.get("online") or []:
        if r.get("per_position"):
            series.append((f"{r['endpoint']} c={r['concurrency']}", r["per_position"], "x:"))
    for label, ys, style in series:
        ax.plot(range(1, len(ys) + 1), ys, style, label=label)
    ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, max([len(ys) for _, ys, _ in series] + [1]) + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("alpha_i = P(accept i | accepted < i)")
    ax.set_title("Acceptance per position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_tau(offline: dict[str, Any], prediction: dict[str, Any] | None = None):
    """tau(k) offline for k = 1..K against i.i.d. references, with the predicted speedup per k."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = list(range(1, offline["max_k"] + 1))
    ax.plot(ks, offline["greedy"]["tau_by_k"], "o-", label="offline greedy")
    if offline.get("sampled"):
        ax.plot(ks, offline["sampled"]["tau_by_k"], "s-", label=f"offline T={offline['temperature']}")
    for a in (0.15, 0.5, 0.85):
        ax.plot(ks, [tau_iid(a, k) for k in ks], color="gray", lw=0.8, ls=":")
        ax.annotate(f"iid a={a}", (ks[-1], tau_iid(a, ks[-1])), fontsize=7, color="gray")
    ax.set_xticks(ks)
    ax.set_xlabel("k (drafted tokens per step)")
    ax.set_ylabel("tau = tokens per target step")
    ax.set_title("Acceptance length vs k")
    if prediction:
        ax2 = ax.twinx()
        ax2.plot(ks, speedup_by_k(offline["alpha_by_position"], prediction["cost_ratio"], prediction["overhead"]),
                 "^--", color="C3", label="predicted speedup")
        ax2.axhline(1.0, color="C3", lw=0.6, ls=":")
        ax2.set_ylabel("predicted speedup", color="C3")
        ax2.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def plot_offline_vs_local(metrics: dict[str, Any]):
    """Offline-predicted vs locally measured acceptance (greedy), per position and as tau."""
    import matplotlib.pyplot as plt

    off, loc = metrics["offline"]["greedy"], metrics["local"]
    k = metrics["local"]["k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(1, k + 1)
    w = 0.38
    ax.bar([x - w / 2 for x in xs], off["alpha_by_position"][:k], w, label="offline (predicted)")
    ax.bar([x + w / 2 for x in xs], loc["per_position"], w, label="local decoding (measured)")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("alpha_i")
    ax.set_title(f"Offline vs measured: tau {off['tau_by_k'][k - 1]:.2f} predicted, {loc['acceptance_length']:.2f} "
                 "measured")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_predicted_vs_measured(metrics: dict[str, Any]):
    """Measured speedup (local and each online level) against the prediction; the diagonal is agreement."""
    import matplotlib.pyplot as plt

    pred = metrics["prediction"]["speedup"]
    fig, ax = plt.subplots(figsize=(5, 4))
    pts = []
    if metrics.get("local") and metrics["local"].get("speedup") is not None:
        pts.append(("local", metrics["local"]["speedup"]))
    for r in metrics.get("online") or []:
        if r.get("speedup") is not None and r["endpoint"] != metrics.get("online_baseline"):
            pts.append((f"{r['endpoint']} c={r['concurrency']}", r["speedup"]))
    for label, y in pts:
        ax.scatter([pred], [y])
        ax.annotate(label, (pred, y), fontsize=8, xytext=(4, 0), textcoords="offset points")
    hi = max([pred, 1.0] + [y for _, y in pts]) * 1.15
    ax.plot([0, hi], [0, hi], color="gray", ls=":", lw=1)
    ax.axhline(1.0, color="gray", lw=0.6)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("predicted speedup")
    ax.set_ylabel("measured speedup")
    ax.set_title("Predicted vs measured speedup")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- stage steps


def cached(path: Path, config: dict[str, Any], fn) -> dict[str, Any]:
    """``fn()``'s result, stored at ``path`` with the settings it was made with; reused when they match, so
    a re-run (or a resume after a kill) redoes only the steps that did not finish."""
    path = Path(path)
    if path.exists():
        try:
            stored = json.loads(path.read_text())
            if stored.get("config") == json.loads(json.dumps(config, default=str)):
                print(f"{path.name}: reusing the finished result (delete it to redo)")
                return stored["result"]
        except ValueError:
            pass
    result = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"config": config, "result": result})
    return result


def load_models(P: AcceptParams, need_target: bool = True):
    """(target or None, draft, tokenizer) for the stage, after checking that the draft fits both the held-out
    data and the target (sizes, vocabulary, aux layers), so a mismatch stops here, naming both sides. The
    draft gets the target's embedding when its checkpoint carries none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3nb.draft import check_fits, load_draft
    from eagle3nb.hf import from_pretrained
    from eagle3nb.hidden import HiddenStates
    from eagle3nb.toy import resolve_model_path

    model_dir = resolve_model_path(P.model_path)
    tokenizer = from_pretrained(AutoTokenizer, model_dir, trust_remote_code=P.trust_remote_code)
    data = HiddenStates(P.data_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = None
    if need_target:
        target = from_pretrained(AutoModelForCausalLM, model_dir, trust_remote_code=P.trust_remote_code,
                                 dtype=torch.float32).to(device).eval()
        embed = target.get_input_embeddings().weight.detach()
    else:
        embed = data.embed_tokens()
    draft = load_draft(P.draft_path, embed_tokens=embed, device=device)
    meta = data.meta
    check_fits(draft.config, hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"],
               layer_ids=meta["layer_ids"], num_layers=meta["num_layers"], draft=f"the draft {P.draft_path}",
               data=f"the held-out data {P.data_path}")
    tc = json.loads((model_dir / "config.json").read_text())
    tc = tc.get("text_config") or tc
    check_fits(draft.config, hidden_size=tc["hidden_size"], vocab_size=tc["vocab_size"], layer_ids=None,
               num_layers=tc["num_hidden_layers"], draft=f"the draft {P.draft_path}", data=f"the target {model_dir}")
    return target, draft, tokenizer


def run_offline(P: AcceptParams, draft, tokenizer) -> dict[str, Any]:
    from eagle3nb.hidden import HiddenStates
    from eagle3nb.tokens import THINK_END, THINK_START

    data = HiddenStates(P.data_path)
    vocab = tokenizer.get_vocab()
    think = (vocab.get(THINK_START), vocab.get(THINK_END))
    indices, how = heldout_indices(P, data)
    print(f"offline acceptance on {how}", flush=True)
    config = {"draft": _fingerprint(P.draft_path), "data": str(P.data_path), "k": P.k, "max_k": P.max_k,
              "temperature": P.temperature, "indices": indices}

    def work() -> dict[str, Any]:
        return {**offline_acceptance(draft, data, P.k, P.max_k, P.temperature, think, indices, P.stage_dir),
                "data": how}

    return cached(P.stage_dir / "offline.json", config, work)


def greedy_hidden_states(model_dir: Path, prompts: str, n: int, max_new_tokens: int, out_dir: Path,
                         draft_vocab_size: int = 256, thinking: bool = True) -> Path:
    """Held-out data that matches greedy decoding exactly: the target's own greedy answers to ``n`` prompts
    (01's sample format in ``out_dir/01``), through 02's extraction (``out_dir/02``, fp32). Offline chains on
    it see what real greedy speculative decoding sees, round for round."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3nb.hidden import extract
    from eagle3nb.params import from_dict
    from eagle3nb.spec import plain_generate
    from eagle3nb.synth.prompts import load_prompts
    from eagle3nb.synth.stream import Template

    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tpl = Template(model_dir, thinking=thinking)
    rows = []
    for r in load_prompts(prompts, n):
        p = tpl.prompt_ids(r["messages"])
        out = plain_generate(target, p, max_new_tokens, eos_token_ids=[tpl.end_id])
        rows.append({"id": r["id"], "status": "ok", "messages": r["messages"], "input_ids": p + out,
                     "loss_mask": [0] * len(p) + [1] * len(out), "category": r["category"], "thinking": thinking})
    synth = Path(out_dir) / "01"
    synth.mkdir(parents=True, exist_ok=True)
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract(from_dict("02_hidden_states", {"synth_dir": str(synth), "model_path": str(model_dir),
                                           "output_dir": str(Path(out_dir) / "02"), "storage": "fp32",
                                           "draft_vocab_size": draft_vocab_size, "run_name": "heldout"}))
    return Path(out_dir) / "02"


def prompt_token_ids(P: AcceptParams, n: int) -> tuple[list[list[int]], list[int]]:
    """The first ``n`` prompts rendered with the target's chat template, and the end-of-turn ids."""
    from eagle3nb.synth.prompts import load_prompts
    from eagle3nb.synth.stream import Template
    from eagle3nb.toy import resolve_model_path

    tpl = Template(resolve_model_path(P.model_path), P.thinking, P.thinking_kwarg, P.trust_remote_code)
    rows = load_prompts(P.prompts, n)
    eos = {i for i in (tpl.end_id, tpl.tokenizer.eos_token_id) if i is not None}
    return [tpl.prompt_ids(r["messages"]) for r in rows], sorted(eos)


def run_local(P: AcceptParams, target, draft) -> dict[str, Any]:
    """Lossless greedy speculative decoding here vs the target alone, plus the measured costs."""
    from eagle3nb.progress import Progress
    from eagle3nb.spec import compare_with_plain, measure_costs

    prompts, eos = prompt_token_ids(P, P.local_prompts)
    config = {"draft": _fingerprint(P.draft_path), "model": P.model_path, "k": P.k, "prompts": P.prompts,
              "n": P.local_prompts, "max_tokens": P.max_tokens, "thinking": P.thinking}

    def work() -> dict[str, Any]:
        prog = Progress(P.stage_dir, len(prompts), "local speculative decoding", "prompts")
        res = compare_with_plain(target, draft, prompts, P.k, P.max_tokens, 0.0, eos, P.seed, prog)
        prog.close()
        res["costs"] = measure_costs(target, draft, P.k, context=min(256, max(len(p) for p in prompts) + P.max_tokens))
        return res

    return cached(P.stage_dir / "local.json", config, work)


def prediction(P: AcceptParams, offline: dict[str, Any], local: dict[str, Any] | None) -> dict[str, Any]:
    """The predicted speedup at k from the offline tau and the given or measured costs."""
    costs = (local or {}).get("costs") or {}
    c = P.cost_ratio if P.cost_ratio is not None else costs["cost_ratio"]
    o = P.overhead if P.overhead is not None else costs["overhead"]
    out = predict(offline["acceptance_length"], P.k, c, o)
    out["costs_from"] = "given" if P.cost_ratio is not None and P.overhead is not None else "measured here"
    return out


def baseline_label(P: AcceptParams) -> str:
    """The endpoint every speedup is relative to: ``baseline`` (embedded) or the first endpoint listed."""
    return "baseline" if P.endpoints == "embedded" else P.endpoints[0].label


def run_online(P: AcceptParams) -> list[dict[str, Any]]:
    """Benchmark every endpoint (embedded: the target served plainly, then with the draft), with speedups."""
    from eagle3nb.bench import add_speedup, bench_endpoint
    from eagle3nb.synth.prompts import load_prompts

    rows = load_prompts(P.prompts, P.num_prompts)
    extra = {"chat_template_kwargs": {P.thinking_kwarg: P.thinking}}
    kw = dict(prompts=rows, concurrency_levels=P.concurrency_levels, max_tokens=P.max_tokens,
              temperature=P.temperature, extra_body=extra)
    config = {"draft": _fingerprint(P.draft_path), "model": P.model_path, "k": P.k, "prompts": P.prompts,
              "num_prompts": P.num_prompts, "levels": P.concurrency_levels, "max_tokens": P.max_tokens,
              "temperature": P.temperature, "thinking": P.thinking}
    out: list[dict[str, Any]] = []
    if P.endpoints == "embedded":
        from eagle3nb.serve import start_server
        from eagle3nb.toy import resolve_model_path

        model_dir = resolve_model_path(P.model_path)
        for label, draft in (("baseline", None), ("eagle3", P.draft_path)):
            def work(draft=draft, label=label) -> list[dict[str, Any]]:
                with start_server(model_dir, draft_dir=draft, num_speculative_tokens=P.k) as h:
                    return bench_endpoint(label, h.base_url, api_key="EMPTY", **kw)
            out += _cached_rows(P.stage_dir / f"online-{label}.json", {**config, "label": label}, work)
    else:
        key = P.api_key()
        for e in P.endpoints:
            def work(e=e) -> list[dict[str, Any]]:
                return bench_endpoint(e.label, e.url, api_key=key, model=e.model, metrics=e.metrics_url, **kw)
            out += _cached_rows(P.stage_dir / f"online-{e.label}.json", {**config, "url": e.url}, work)
    return add_speedup(out, baseline_label(P))


def _cached_rows(path: Path, config: dict[str, Any], fn) -> list[dict[str, Any]]:
    return cached(path, config, lambda: {"rows": fn()})["rows"]


def _fingerprint(draft_dir: Path) -> str:
    """Identity of a draft checkpoint for result reuse: the sha256 of its config and weights. Size and mtime
    are not enough: a draft retrained or copied in place can keep both. Drafts are small (a Kimi-K2.5 drafter
    is ~2-3 GB, seconds to hash)."""
    from eagle3nb.hidden.storage import file_sha256

    files = sorted(Path(draft_dir).glob("*.safetensors")) + [Path(draft_dir) / "config.json"]
    return ";".join(f"{f.name}:{file_sha256(f)}" for f in files if f.exists())


def assemble(P: AcceptParams, offline: dict[str, Any], local: dict[str, Any] | None,
             prediction: dict[str, Any] | None, online: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The stage's metrics in the contract's shape (docs/ARCHITECTURE.md "04_acceptance output")."""
    return {"stage": STAGE, "run_name": P.run_name, "draft_dir": str(P.draft_path), "data_dir": str(P.data_path),
            "model_path": P.model_path, "offline": offline, "local": local, "prediction": prediction,
            "online": online or [], "online_baseline": baseline_label(P)}


def online_table(rows: list[dict[str, Any]]):
    """The benchmark rows as a table (per-position lists left out)."""
    import pandas as pd

    cols = ["endpoint", "concurrency", "output_tokens_per_s", "speedup", "acceptance_rate", "acceptance_length",
            "latency_p50_s", "latency_p90_s", "latency_p99_s", "requests", "errors"]
    return pd.DataFrame([{c: r.get(c) for c in cols} for r in rows])


def acceptance_by_source(metrics: dict[str, Any]):
    """Acceptance length and alpha_i at the served k from every source side by side: offline (predicted from
    hidden states), local decoding (our decoder here) and each served endpoint's own counters (vLLM's
    /metrics; first concurrency level), so a draft the engine reads differently shows as a gap."""
    import pandas as pd

    k = metrics["offline"]["k"]
    off = metrics["offline"]["greedy"]
    rows = [{"source": "offline greedy (predicted)", "acceptance_length": off["tau_by_k"][k - 1],
             **{f"alpha_{i + 1}": a for i, a in enumerate(off["alpha_by_position"][:k])}}]
    if metrics.get("local"):
        loc = metrics["local"]
        rows.append({"source": "local decoding (measured)", "acceptance_length": loc["acceptance_length"],
                     **{f"alpha_{i + 1}": a for i, a in enumerate(loc["per_position"][:k])}})
    seen = set()
    for r in metrics.get("online") or []:
        if r.get("acceptance_length") is None or r["endpoint"] in seen:
            continue
        seen.add(r["endpoint"])
        rows.append({"source": f"{r['endpoint']} ({r.get('metrics_engine') or 'server'} counters, c={r['concurrency']})",
                     "acceptance_length": r["acceptance_length"],
                     **{f"alpha_{i + 1}": a for i, a in enumerate((r.get("per_position") or [])[:k])}})
    return pd.DataFrame(rows).set_index("source")


def position_table(metrics: dict[str, Any]):
    """alpha_i per draft position from every source that has it (offline greedy / sampled, local)."""
    import pandas as pd

    off = metrics["offline"]
    table = {"offline greedy": off["greedy"]["alpha_by_position"]}
    if off.get("sampled"):
        table[f"offline T={off['temperature']}"] = off["sampled"]["alpha_by_position"]
    if metrics.get("local"):
        loc = metrics["local"]["per_position"]
        table["local decoding"] = loc + [None] * (off["max_k"] - len(loc))
    df = pd.DataFrame(table, index=pd.RangeIndex(1, off["max_k"] + 1, name="position i"))
    df["tau(k=i) offline"] = (off["sampled"] or off["greedy"])["tau_by_k"]
    return df


def save_fig(P: AcceptParams, fig, name: str) -> None:
    """Write a figure as ``output_dir/<name>.png`` (the notebook still shows it)."""
    P.stage_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(P.stage_dir / f"{name}.png", dpi=110, bbox_inches="tight")


def write_metrics(P: AcceptParams, metrics: dict[str, Any]) -> Path:
    """``output_dir/metrics.json`` (NaN written as null so every JSON reader takes it)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path = P.stage_dir / "metrics.json"
    write_json_atomic(path, clean(metrics))
    return path
