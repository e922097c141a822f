"""A draft measured on held-out traffic: its acceptance length per request, decoded here against the target, and
what the gate and the report make of those numbers (the costs of the expected speedup, the per-group scores)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.params import ParamsError
from eagle3nb.refresh.gate import GroupScores
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.refresh.weak import per_request


class Measure:
    """A draft's acceptance length per held-out request, by group: decoded here speculatively at T=0 against
    the target (loaded once), cached per draft fingerprint."""

    def __init__(self, P: RefreshParams, rows: list[dict]):
        self.P, self.rows, self._loaded = P, rows, None

    def __call__(self, draft_dir: Path, path: Path) -> dict[str, list[float]]:
        config = {"draft": fingerprint(draft_dir), "model": self.P.model_path, "k": self.P.k,
                  "max_tokens": self.P.max_tokens, "requests": [r["id"] for r in self.rows]}
        return cached(path, config, lambda: self._measure(draft_dir))

    def _measure(self, draft_dir: Path) -> dict[str, list[float]]:
        decoder, tpl, eos = self.decoder(draft_dir)
        return per_request(decoder, tpl, self.rows, self.P.max_tokens, eos)

    def decoder(self, draft_dir: Path):
        """(the draft beside the target as a ``SpecDecoder`` at k, the chat template, the end-of-turn ids)."""
        from eagle3nb.data.stream import Template
        from eagle3nb.decoder.batch import SpecDecoder
        from eagle3nb.drafts import load_draft
        from eagle3nb.hf import DECODER, load_target

        P = self.P
        if self._loaded is None:
            target = load_target(P.model_dir, trust_remote_code=P.trust_remote_code, use=DECODER)
            tpl = Template(P.model_dir, True, "auto", P.trust_remote_code, P.target_family)
            self._loaded = (target, tpl)
        target, tpl = self._loaded
        draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach(),
                           lm_head=target.get_output_embeddings().weight.detach())
        eos = sorted({i for i in (tpl.end_id, tpl.tokenizer.eos_token_id) if i is not None})
        return SpecDecoder(target, draft, P.k), tpl, eos


def costs(P: RefreshParams) -> tuple[float, float]:
    """(cost ratio, overhead) of the expected speedup: the parameters, else 04's measured ones for this run."""
    if P.cost_ratio is not None and P.overhead is not None:
        return P.cost_ratio, P.overhead
    path = P.out_dir(None, "04_acceptance") / "metrics.json"
    pred = json.loads(path.read_text()).get("prediction") if path.exists() else None
    if not pred:
        raise ParamsError(f"05_refresh needs the draft's costs: run 04 first ({path} is missing) or set cost_ratio "
                          "and overhead")
    return (P.cost_ratio if P.cost_ratio is not None else pred["cost_ratio"],
            P.overhead if P.overhead is not None else pred["overhead"])


def scores(shares: dict[str, float], before: dict[str, list[float]], after: dict[int, dict[str, list[float]]],
           seeds: list[int]) -> list[GroupScores]:
    """The gate's input: per group of the traffic (``shares``: ``Traffic.shares()``, every request read), the
    current draft's acceptance and each seed's refreshed one on its held-out requests. A group measured on none
    (its sampled requests all repeated another group's, which ``read_traffic`` keeps once) comes with empty lists,
    so that the gate lists it as not judged and counts its share."""
    unknown = sorted(set(before) - set(shares))
    if unknown:
        raise ValueError(f"groups {unknown} were measured but are not in the traffic's shares")
    return [GroupScores(g, shares[g], before.get(g, []), [after[s].get(g, []) for s in seeds]) for g in sorted(shares)]


def means(after: dict[int, dict[str, list[float]]]) -> dict[str, float]:
    """Per group, the refreshed drafts' mean acceptance length over seeds and requests."""
    rows: dict[str, list[float]] = {}
    for per_group in after.values():
        for g, v in per_group.items():
            rows.setdefault(g, []).extend(v)
    return {g: sum(v) / len(v) for g, v in sorted(rows.items())}
