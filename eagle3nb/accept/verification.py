"""04's verification comparison: local speculative decoding of the same prompts, sampled, with token-wise rejection
sampling (``standard``) and with block verification (``block``, Sun et al.: ``eagle3nb.verification.block``), at T=1
and at the stage's own temperature when that is another positive one (at T=0 both are the target's greedy
output, so the greedy local check's tau is both). Each rule decodes every prompt with :data:`SEEDS` seeds (the
same seeds for both rules); the mean acceptance length over them goes to ``metrics.json`` as
``verification: {"<T>": {"standard": tau, "block": tau}}`` and the per-seed values, whose spread is tau's noise,
as ``verification_seeds`` (docs/ARCHITECTURE.md "04_acceptance output")."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.local import prompt_token_ids, timed_threads
from eagle3nb.accept.params import AcceptParams
from eagle3nb.decoder.batch import SpecDecoder
from eagle3nb.verification.verify import VERIFIERS, SpecCounters, is_greedy

SEEDS = 4  # seeded repeats of every prompt per rule: their spread says how far apart the two taus may be by chance


def temperatures(P: AcceptParams) -> list[float]:
    """T=1, and the stage's temperature when it samples at another one."""
    return [1.0] + ([P.temperature] if not is_greedy(P.temperature) and P.temperature != 1.0 else [])


def key(t: float) -> str:
    """A temperature as the metrics' key: ``1``, ``0.7``."""
    return f"{t:g}"


def compare_verification(target, draft, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
                         temps: Sequence[float], eos_token_ids: Sequence[int] = (), seed: int = 0,
                         seeds: int = SEEDS) -> dict[str, dict[str, list[float]]]:
    """Acceptance length of every rule at every temperature, one value per seed over all ``prompts``:
    ``{"<T>": {"standard": [tau per seed], "block": [...]}}``. Prompt i of seed s draws from its own generator,
    seeded ``seed + 1000 s + i`` under both rules."""
    dec = SpecDecoder(target, draft, k)
    out: dict[str, dict[str, list[float]]] = {}
    for t in temps:
        for rule in VERIFIERS:
            taus = []
            for s in range(seeds):
                counters = SpecCounters(k)
                for i, prompt in enumerate(prompts):
                    g = torch.Generator().manual_seed(seed + 1000 * s + i)
                    res = dec.generate(prompt, max_new_tokens, t, eos_token_ids, g, verification=rule)
                    counters.merge(res.counters)
                taus.append(counters.summary()["acceptance_length"])
            out.setdefault(key(t), {})[rule] = taus
    return out


def run_verification(P: AcceptParams, target, draft) -> dict[str, dict[str, list[float]]]:
    """The comparison on 04's local prompts (``local_prompts`` of them, ``max_tokens`` each, ``k`` drafts a round),
    reused from ``verification.json`` when a re-run finds it finished."""
    prompts, eos = prompt_token_ids(P, P.local_prompts)
    temps = temperatures(P)
    config = {"draft": fingerprint(P.draft_path), "model": P.model_path, "k": P.k, "prompts": P.prompts,
              "n": P.local_prompts, "max_tokens": P.max_tokens, "thinking": P.thinking, "temperatures": temps,
              "seed": P.seed, "seeds": SEEDS}

    def work() -> dict[str, dict[str, list[float]]]:
        print(f"verification: standard vs block at T={', '.join(map(key, temps))}, {SEEDS} seeds", flush=True)
        with timed_threads():  # one thread: small decodes run faster so on shared cores
            return compare_verification(target, draft, prompts, P.k, P.max_tokens, temps, eos, P.seed)

    return cached(P.stage_dir / "verification.json", config, work)


def summary(per_seed: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """The metrics' ``verification``: the mean tau over seeds of each rule at each temperature."""
    return {t: {rule: statistics.fmean(taus) for rule, taus in rules.items()} for t, rules in per_seed.items()}


def verification_table(metrics: dict[str, Any]):
    """Token-wise vs block verification: tau (mean and standard deviation over seeds) per temperature, and the
    block's gain."""
    import pandas as pd

    rows = []
    for t, rules in (metrics.get("verification_seeds") or {}).items():
        row: dict[str, Any] = {"temperature": t}
        for rule, taus in rules.items():
            row[f"tau {rule}"] = statistics.fmean(taus)
            row[f"sd {rule}"] = statistics.stdev(taus) if len(taus) > 1 else None
        row["block - standard"] = row["tau block"] - row["tau standard"]
        rows.append(row)
    return pd.DataFrame(rows).set_index("temperature") if rows else pd.DataFrame()
