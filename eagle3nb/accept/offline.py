"""04's offline acceptance (no server): on held-out hidden states, the draft's algorithm chains drafts of length K
from every position (``chain_acceptance`` of its ``eagle3nb.drafts`` package) and compares each step with the
target. Greedy: accepted iff the draft's argmax (mapped to the target vocab) is the
target's argmax. Sampling at temperature T: the expected acceptance of rejection sampling, sum_v min(p, q) =
1 - TV(p, q). alpha_i is *conditional*: P(step i accepted | steps < i accepted); tau(k) = 1 + sum_i prod_j
alpha_j (eagle3nb.formulas). Steps are teacher-forced with the data's tokens, which are exactly what an
accepted chain feeds when the data is the target's own (greedy) output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from eagle3nb import drafts
from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.misses import POSITIONS, with_pieces, write_records
from eagle3nb.accept.models import trained_with
from eagle3nb.accept.params import AcceptParams
from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.split import split_holdout
from eagle3nb.data.turns import parse_turn
from eagle3nb.errors import InputError
from eagle3nb.families import specials
from eagle3nb.formulas import tau_from_conditional, tau_per_request_mean, tau_pooled
from eagle3nb.params import schema_for
from eagle3nb.progress import Progress

SEGMENTS = {1: "reasoning", 2: "answer"}


def simulate_rounds(greedy, valid, mask, k: int) -> list[int]:
    """Accepted drafts per round when decoding the sample greedily with chains of ``k``: the first round starts
    where generation starts, each next one n+1 tokens later, as in real decoding. Rounds whose chain would run
    past the sample's generated tokens are not simulated. On the target's own greedy output this reproduces
    the rounds of real speculative decoding exactly (``eagle3nb.decoder.batch``)."""
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


def chain_counts(greedy, valid, k: int) -> list[int]:
    """Per start position t: how many of the ``k`` tokens drafted from t the target accepts (the leading run of
    accepted steps); -1 where nothing is drafted (the first drafted token is not a generated one)."""
    import torch

    run = ((greedy[:k] > 0.5) & valid[:k]).long().cumprod(0).sum(0)
    return torch.where(valid[0], run, torch.full_like(run, -1)).tolist()


LONG_CONTEXT_EDGES = (256, 1024, 4096)


def context_edges(positions) -> list[int]:
    """Inner edges of the context-length buckets over the drafted positions (index in the sequence): 256 / 1k /
    4k once the data reaches 1k tokens (reasoning at scale), else the quartiles of the positions the data
    holds (rounded), so every bucket has data on a toy."""
    import torch

    top = int(positions.max())
    if top >= LONG_CONTEXT_EDGES[1]:
        return [e for e in LONG_CONTEXT_EDGES if e <= top]
    q = torch.quantile(positions.float(), torch.tensor([0.25, 0.5, 0.75])).round().long().tolist()
    return sorted({e for e in q if 0 < e <= top})


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """'0-255', '256-1023', ..., '4096+' for inner edges [256, 1024, 4096]."""
    bounds = [0, *edges]
    return [f"{lo}-{hi - 1}" for lo, hi in pairwise(bounds)] + [f"{bounds[-1]}+"]


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
        raise InputError("the held-out data stores only top-k probabilities over its own draft vocabulary, which is "
                         "not the draft's; extract it with storage bf16 (or fp8), or use the draft's vocabulary "
                         "(eagle3nb doctor: shapes_vocab)")
    return data.target_probs(item, temperature)


def heldout_indices(P: AcceptParams, data) -> tuple[list[int], str]:
    """Which samples to measure on, and how they were chosen. With ``data_dir`` unset the data is 03's training
    data, so only 03_train's held-out split (same id hash, same fraction) is used; so it is for a data_dir the
    draft's own record names as its training data (``data_dir`` in the metrics.json beside it: 06's pick); any other
    data_dir is used whole."""
    n = len(data)
    own = trained_with(P, "data_dir")
    if P.data_dir is None or (own is not None and Path(own).resolve() == P.data_path.resolve()):
        fraction = trained_with(P, "holdout_fraction", schema_for("03_train").model_fields["holdout_fraction"].default)
        _, idx = split_holdout([s["id"] for s in data.meta["samples"]], fraction)
        how = f"03_train's held-out split of the training data ({len(idx)} of {n} samples, fraction {fraction})"
    else:
        idx, how = list(range(n)), f"all {n} samples of {P.data_path}"
    if P.offline_samples is not None and len(idx) > P.offline_samples:
        idx, how = idx[:P.offline_samples], how + f", first {P.offline_samples}"
    return idx, how


TURN_LABELS = ("first turn", "later turns")


def turn_label(sample_id: str) -> str | None:
    """Which turn group a per-turn sample is in; None for a sample that is a whole one-answer conversation."""
    parsed = parse_turn(sample_id)
    return None if parsed is None else TURN_LABELS[parsed[1] > 1]


def offline_acceptance(draft, data, k: int, max_k: int, temperature: float = 0.0,
                       segments: Callable[[list[int], list[int]], list[int]] | None = None,
                       indices: Sequence[int] | None = None,
                       stage_dir: Path | None = None, keep_positions: bool = False) -> dict[str, Any]:
    """Acceptance of ``draft`` on the held-out hidden states ``data`` (an ``eagle3nb.hidden.HiddenStates``):
    greedy, at ``temperature`` (when > 0), by segment (reasoning / answer: ``segments(ids, loss_mask)``, the
    family's ``Specials.segments`` by think tags or Harmony channels; None: every loss token is answer), by
    prompt category, by turn (``by_turn``:
    first and later turns of per-turn samples, 01's ``multi_turn: every``) and by context length (the drafted
    token's index in the sequence, ``by_context``). With ``keep_positions`` the result also
    holds ``positions``: per sample its ids, loss mask and, per token, how many of ``k`` drafted tokens from
    there were accepted, with the draft's guess and the target's token where the first was rejected (what
    ``eagle3nb.accept.misses`` shows)."""
    import torch

    indices = list(range(len(data))) if indices is None else list(indices)
    if not indices:
        raise InputError("no held-out samples to measure on: extract hidden states of held-out prompts (02) and "
                         "set data_dir, or raise 03_train's holdout_fraction")
    method = drafts.of(draft)  # its chains: eagle3nb.drafts.<method>.offline
    head = data.lm_head().float().to(draft.d2t.device) if temperature > 0 else None
    prog = Progress(stage_dir, len(indices), "offline acceptance", "samples") if stage_dir else None
    parts: dict[str, list] = {"greedy": [], "sampled": [], "valid": [], "segment": [], "category": [], "turn": [],
                              "rounds": [], "position": []}
    positions: list[dict[str, Any]] = []
    skipped = 0
    with torch.inference_mode():
        for i in indices:
            item = data[i]
            if item["input_ids"].shape[0] < 3:
                skipped += 1
                continue
            probs = target_probs_for(draft, data, item, temperature, head) if temperature > 0 else None
            r = method.chain_acceptance(draft, item, data.target_argmax(item), probs, max_k, temperature)
            parts["rounds"].append(simulate_rounds(r["greedy"], r["valid"], item["loss_mask"], k))
            ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
            seg = segments(ids, mask) if segments is not None else [2 if m else 0 for m in mask]
            parts["segment"].append(torch.tensor(seg[2:] + [0]))  # segment of the first drafted token t+2
            parts["category"] += [item.get("category")] * (len(ids) - 1)
            parts["turn"] += [turn_label(item["id"])] * (len(ids) - 1)
            parts["position"].append(torch.arange(2, len(ids) + 1))  # index of the first drafted token t+2
            positions.append(position_record(item, r, k, method.unit))
            for key in ("greedy", "sampled", "valid"):
                if r[key] is not None:
                    parts[key].append(r[key])
            if prog:
                prog.update(1)
    if prog:
        prog.close()
    if not parts["valid"]:
        raise InputError("every held-out sample is shorter than 3 tokens; nothing to draft")
    greedy, valid = torch.cat(parts["greedy"], 1), torch.cat(parts["valid"], 1)
    sampled = torch.cat(parts["sampled"], 1) if parts["sampled"] else None
    segment, position = torch.cat(parts["segment"]), torch.cat(parts["position"])
    if int(valid[0].sum()) == 0:
        raise InputError("no generated (loss-masked) tokens to draft in the held-out data: check 02's loss masks "
                         "(eagle3nb doctor: data_health)")

    def block(sel) -> dict[str, Any]:
        v = valid & sel[None]
        out = {"greedy": summarize_chain(greedy, v, k)}
        if sampled is not None:
            out["sampled"] = summarize_chain(sampled, v, k)
        return out

    everything = block(torch.ones_like(segment, dtype=torch.bool))
    # the simulated rounds' acceptance length both ways (eagle3nb.formulas): pooled over every round (vLLM's), and
    # the mean of each held-out sample's own (SpecForge's)
    accepted, rounds = [sum(r) for r in parts["rounds"]], [len(r) for r in parts["rounds"]]
    everything["greedy"]["simulated_acceptance_length"] = tau_pooled(accepted, rounds) if sum(rounds) else None
    everything["greedy"]["simulated_acceptance_length_per_sample"] = tau_per_request_mean(accepted, rounds)
    everything["greedy"]["simulated_rounds"] = sum(rounds)
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
    turns = parts["turn"]
    if any(t is not None for t in turns):
        result["by_turn"] = {t: block(torch.tensor([x == t for x in turns])) for t in TURN_LABELS if t in turns}
    edges = context_edges(position[valid[0]])
    bucket = torch.bucketize(position, torch.tensor(edges, dtype=position.dtype), right=True)
    result["context_edges"] = edges
    result["by_context"] = {label: block(bucket == b) for b, label in enumerate(bucket_labels(edges))
                            if bool((valid[0] & (bucket == b)).any())}
    return {**result, "positions": positions} if keep_positions else result


def position_record(item: dict, chains: dict, k: int, unit: str) -> dict[str, Any]:
    """One held-out sample for the miss view: ``accepted[p]`` = how many of the ``k`` tokens drafted from token p
    on the target accepted (-1: not drafted), ``misses`` = [p, draft's guess, target's token] where the
    first drafted token was rejected (target vocabulary ids), and ``unit`` (the method's name for a drafted
    token: a block drafter's block position has the view draw rounds as blocks)."""
    ids = item["input_ids"].tolist()
    counts = chain_counts(chains["greedy"], chains["valid"], k)
    accepted = ([-1, -1] + counts)[:len(ids)]
    guess, target = chains["guess"].tolist(), chains["target"].tolist()
    misses = [[p, guess[p - 2], target[p - 2]] for p, n in enumerate(accepted) if n == 0]
    return {"id": item.get("id"), "category": item.get("category"), "ids": ids,
            "loss_mask": item["loss_mask"].tolist(), "accepted": accepted, "misses": misses, "unit": unit}


def run_offline(P: AcceptParams, draft, tokenizer) -> dict[str, Any]:
    """Offline acceptance of the stage's draft on its held-out samples (``offline.json``, reused when
    the draft, data and settings are unchanged), and the miss view's per-position records (``positions.jsonl``)."""
    data = HiddenStates(P.data_path)
    segments = specials(P.target_family, tokenizer).segments
    indices, how = heldout_indices(P, data)
    print(f"offline acceptance on {how}", flush=True)
    config = {"draft": fingerprint(P.draft_path), "data": str(P.data_path), "k": P.k, "max_k": P.max_k,
              "temperature": P.temperature, "indices": indices}

    def work() -> dict[str, Any]:
        res = offline_acceptance(draft, data, P.k, P.max_k, P.temperature, segments, indices, P.stage_dir,
                                 keep_positions=True)
        P.stage_dir.mkdir(parents=True, exist_ok=True)
        write_records(P.stage_dir / POSITIONS,
                      [with_pieces(r, tokenizer, "offline", P.target_family) for r in res.pop("positions")])
        return {**res, "data": how}

    if not (P.stage_dir / POSITIONS).exists():  # the miss view's positions come with the step: redo it without them
        (P.stage_dir / "offline.json").unlink(missing_ok=True)
    return cached(P.stage_dir / "offline.json", config, work)
