"""04's per-dataset acceptance: the draft judged on the prompt sets the public drafters report on (MT-Bench,
HumanEval, ShareGPT, or any file), decoded here speculatively with greedy verification, one row per set in the
layout their model cards use (dataset x acceptance length at k, per-position rates, the draft settings).

Every later turn of a conversation is answered on-policy: MT-Bench's second turn ("Rewrite your previous
response...") is sent after the target's own first answer, split into reasoning and content at the family's
markers and rendered back through the chat template as a server would. On a toy target the numbers are the
toy's; the table and the path are what a Kimi user runs."""

from __future__ import annotations

from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.params import AcceptParams
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.reasoning import split_inline
from eagle3nb.data.stream import Template
from eagle3nb.data.turns import answer_message, turn_inputs
from eagle3nb.decoder.batch import SpecDecoder
from eagle3nb.progress import Progress
from eagle3nb.verification.verify import SpecCounters

TURN_GROUPS = ("first turn", "later turns")


def answer_of(tpl: Template, tokens: list[int]) -> dict[str, Any]:
    """A generated answer as the next turn sends it back: text split at the family's think markers, up to the
    end-of-turn token."""
    text = tpl.decode(tokens)
    if tpl.end_text and tpl.end_text in text:
        text = text[: text.index(tpl.end_text)]
    reasoning, content = split_inline(text, tpl.family.think_tags) if tpl.family.think_tags else (None, text)
    return answer_message(reasoning, content, None)


def decode_set(dec: SpecDecoder, tpl: Template, rows: list[dict], max_tokens: int, eos: list[int],
               progress: Progress | None) -> dict[str, Any]:
    """Counters over every turn of ``rows``: all, per turn group and per category."""
    import torch

    k = dec.k
    groups: dict[str, SpecCounters] = {"all": SpecCounters(k)}
    by_cat: dict[str, SpecCounters] = {}
    turns = 0
    for i, row in enumerate(rows):
        history: list[dict] = []
        for t, inputs in enumerate(turn_inputs(row["conversation"]), 1):
            messages = [*history, *inputs]
            res = dec.generate(tpl.prompt_ids(messages, row.get("tools")), max_tokens, 0.0, eos,
                               torch.Generator().manual_seed(i))
            turns += 1
            for c in (groups["all"], groups.setdefault(TURN_GROUPS[t > 1], SpecCounters(k)),
                      *([by_cat.setdefault(row["category"], SpecCounters(k))] if row.get("category") else [])):
                c.merge(res.counters)
            history = [*messages, answer_of(tpl, res.tokens)]
        if progress is not None:
            progress.update(1, acceptance_length=groups["all"].summary()["acceptance_length"])
    out = {"prompts": len(rows), "turns": turns, **groups["all"].summary()}
    out["by_turn"] = {g: groups[g].summary() for g in TURN_GROUPS if g in groups}
    out["by_category"] = {c: s.summary() for c, s in sorted(by_cat.items())}
    return out


def run_benchmarks(P: AcceptParams, target, draft) -> dict[str, Any] | None:
    """Per-dataset acceptance of ``P.benchmarks`` (``P.benchmark_prompts`` prompts each), cached beside the
    other results; None when no set is asked for."""
    if not P.benchmarks:
        return None
    tpl = Template(P.model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    eos = sorted({i for i in (tpl.end_id, tpl.tokenizer.eos_token_id) if i is not None})
    sets = {name: load_prompts(name, P.benchmark_prompts) for name in P.benchmarks}
    config = {"draft": fingerprint(P.draft_path), "model": P.model_path, "k": P.k, "sets": P.benchmarks,
              "n": P.benchmark_prompts, "max_tokens": P.max_tokens, "thinking": P.thinking}

    def work() -> dict[str, Any]:
        dec = SpecDecoder(target, draft, P.k)
        prog = Progress(P.stage_dir, sum(len(r) for r in sets.values()), "benchmark sets", "prompts")
        datasets = {name: decode_set(dec, tpl, rows, P.max_tokens, eos, prog) for name, rows in sets.items()}
        prog.close()
        return {"k": P.k, "temperature": 0.0, "max_tokens": P.max_tokens, "thinking": P.thinking,
                "draft": str(P.draft_path), "datasets": datasets}

    return cached(P.stage_dir / "benchmarks.json", config, work)
