"""04's offline acceptance (no server): on held-out hidden states, chain drafts of length K from every position with the
training-time-test attention (step j at position t sees the verified features 0..t and its own chain), and
compare each step with the target. Greedy: accepted iff the draft's argmax (mapped to the target vocab) is the
target's argmax. Sampling at temperature T: the expected acceptance of rejection sampling, sum_v min(p, q) =
1 - TV(p, q). alpha_i is *conditional*: P(step i accepted | steps < i accepted); tau(k) = 1 + sum_i prod_j
alpha_j (eagle3nb.formulas). Steps are teacher-forced with the data's tokens, which are exactly what an
accepted chain feeds when the data is the target's own (greedy) output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.params import AcceptParams
from eagle3nb.draft import TTTCache
from eagle3nb.formulas import tau_from_conditional
from eagle3nb.hidden.reader import HiddenStates
from eagle3nb.params import run_params, schema_for
from eagle3nb.paths import resolve
from eagle3nb.progress import Progress
from eagle3nb.tokens import THINK_END, THINK_START, segment_ids
from eagle3nb.train.data import split_holdout

SEGMENTS = {1: "reasoning", 2: "answer"}


def chain_logits(draft, aux, input_ids, steps: int):
    """Draft logits of a K-step chain from every position, in parallel (training-time-test attention), one
    step at a time (a generator, so only one step's logits are held).

    aux [T, 3H], input_ids [T]. Step j at position t feeds the token t+1+j and predicts token t+2+j; yields
    ``steps`` tensors [T-1, draft_vocab] on the draft's device. Positions follow decoding: step j sits at
    position t + j."""
    import torch

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


def heldout_indices(P: AcceptParams, data) -> tuple[list[int], str]:
    """Which samples to measure on, and how they were chosen. With ``data_dir`` unset the data is 03's training
    data, so only 03_train's held-out split (same id hash, same fraction) is used; a data_dir is used whole."""
    n = len(data)
    if P.data_dir is None:
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


def run_offline(P: AcceptParams, draft, tokenizer) -> dict[str, Any]:
    """Offline acceptance of the stage's draft on its held-out samples (``offline.json``, reused when
    the draft, data and settings are unchanged)."""
    data = HiddenStates(P.data_path)
    vocab = tokenizer.get_vocab()
    think = (vocab.get(THINK_START), vocab.get(THINK_END))
    indices, how = heldout_indices(P, data)
    print(f"offline acceptance on {how}", flush=True)
    config = {"draft": fingerprint(P.draft_path), "data": str(P.data_path), "k": P.k, "max_k": P.max_k,
              "temperature": P.temperature, "indices": indices}

    def work() -> dict[str, Any]:
        return {**offline_acceptance(draft, data, P.k, P.max_k, P.temperature, think, indices, P.stage_dir),
                "data": how}

    return cached(P.stage_dir / "offline.json", config, work)
