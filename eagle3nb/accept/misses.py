"""Where the draft misses, token by token (04): every drafted position coloured by how many of the k drafted
tokens the target accepted from there (0..k), the draft's guess and the target's token at each miss, and the
token kinds where misses concentrate (first token after the reasoning's end marker, numbers, the end of turn ...).

Two sources, one record shape (one JSON line per sample): ``positions.jsonl`` from the offline chains on held-out
hidden states (``accepted[p]`` = accepted tokens of the chain whose first drafted token is p), and
``local_rounds.jsonl`` from the local speculative decoding run (the real rounds: each token carries its round's
accepted count, ``rounds`` lists what was drafted). Each record: ``source``, ``id``, ``category``, ``ids``,
``loss_mask``, ``accepted`` (-1: not drafted), ``misses`` ([position, draft's guess, target's token]), ``unit``
(the method's name for a round's i-th drafted token, ``DraftMethod.unit``) and ``pieces`` (each id's text, so no
tokenizer is needed to show it). ``stage.run`` writes them; the tables here and the token views
(``eagle3nb.accept.views``: static excerpts, the JupyterLab browser) only read them."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3nb.families import FAMILIES, Family, specials
from eagle3nb.tokenview import pieces_for, roles_for

POSITIONS = "positions.jsonl"  # offline chains
ROUNDS = "local_rounds.jsonl"  # local speculative decoding
SOURCES = {"offline": POSITIONS, "local": ROUNDS}
SEGMENT_OF_ROLE = {"think": "reasoning", "reasoning": "reasoning", "answer": "answer", "end": "answer"}
MIN_CHECKED = 5  # a kind needs this many checked positions before the table names it as the worst
BLOCK = "block position"  # a block drafter's unit (its objective's): the views draw its rounds as blocks


# ----------------------------------------------------------------------------------------- writing (stage.run)


def with_pieces(record: dict[str, Any], tokenizer: Any, source: str, family: Family) -> dict[str, Any]:
    """``record`` with its ``source``, the text of every id it shows (its tokens, the guesses and the target's
    tokens at misses, every drafted token of the local rounds) and the target family's ``markers`` (the think
    markers and end-of-turn token as text), so the view reads roles without the tokenizer."""
    drafted = [t for r in record.get("rounds", ()) for t in r[2]]
    used = sorted({*record["ids"], *(m[1] for m in record["misses"]), *(m[2] for m in record["misses"]), *drafted})
    sp = specials(family, tokenizer)
    return {"source": source, **record, "pieces": dict(zip(map(str, used), pieces_for(tokenizer, used))),
            "markers": {"think_start": sp.think_start, "think_end": sp.think_end, "end": sp.end}}


def local_records(prompts: Sequence[Sequence[int]], local: dict[str, Any],
                  rows: Sequence[dict[str, Any]] | None = None, unit: str = "draft step") -> list[dict[str, Any]]:
    """Records of the local run's real rounds (``compare_with_plain``'s ``outputs``, ``accepted_per_round``,
    ``drafted_per_round``): round r drafts k tokens after the verified ones; its n accepted drafts and the
    target's own token are the round's tokens, each coloured by n; a round with n < k missed at its last token,
    where the draft had guessed ``drafted[n]``. ``rows``: the prompts' rows (their ``id`` and ``category``);
    ``unit``: the draft method's (``DraftMethod.unit``)."""
    out = []
    for i, (prompt, tokens, accepted, drafted) in enumerate(zip(prompts, local["outputs"], local["accepted_per_round"],
                                                                local["drafted_per_round"])):
        seq = list(prompt) + list(tokens)
        acc = [-1] * len(seq)
        misses, rounds = [], []
        p = len(prompt) + 1  # the first output token comes from the prefill; round 1 drafts the next ones
        for n, d in zip(accepted, drafted):
            end = min(p + n + 1, len(seq))
            acc[p:end] = [n] * (end - p)
            rounds.append([p, n, d])
            if n < len(d) and p + n < len(seq):
                misses.append([p + n, d[n], seq[p + n]])
            p += n + 1
        row = rows[i] if rows else {}
        out.append({"id": row.get("id", f"prompt-{i}"), "category": row.get("category"), "ids": seq,
                    "loss_mask": [0] * len(prompt) + [1] * len(tokens), "accepted": acc, "misses": misses,
                    "rounds": rounds, "unit": unit})
    return out


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> Path:
    """One JSON line per sample, written atomically (a killed run leaves the old file or the new, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------- reading


def load_records(stage_dir: Path, source: str = "offline") -> list[dict[str, Any]]:
    """The records ``stage.run`` wrote for ``source`` (offline | local); [] when that step did not run."""
    path = Path(stage_dir) / SOURCES[source]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# Records written before they carried their family's markers all came from Kimi-format targets (the toys).
_OLD_RECORDS = FAMILIES["kimi"]


def markers(record: dict[str, Any]) -> dict[str, str | None]:
    """The record's think markers and end-of-turn token, as text."""
    old = _OLD_RECORDS
    return record.get("markers") or {"think_start": old.think_start, "think_end": old.think_end,
                                     "end": old.end_of_turn}


def _special(record: dict[str, Any], which: str) -> int | None:
    name = markers(record)[which]
    return next((int(i) for i, p in record["pieces"].items() if p == name), None) if name else None


def roles(record: dict[str, Any]) -> list[str]:
    """tokenview's role per token (prompt, think, reasoning, answer, end)."""
    think = (_special(record, "think_start"), _special(record, "think_end"))
    return roles_for(record["ids"], record["loss_mask"], think, _special(record, "end"))


def outcomes(record: dict[str, Any]) -> list[int]:
    """Per token: 1 the draft's token here was accepted, 0 rejected, -1 not checked. Offline: the first drafted
    token of the chain from here. Local: every drafted token the target compared (up to the round's miss)."""
    if "rounds" not in record:
        return [-1 if n < 0 else int(n > 0) for n in record["accepted"]]
    out = [-1] * len(record["ids"])
    for p, n, d in record["rounds"]:
        for q in range(p, min(p + n + (n < len(d)), len(out))):
            out[q] = int(q < p + n)
    return out


def _is_number(piece: str) -> bool:
    return bool(re.fullmatch(r"[\d.,]+", piece.strip())) and any(c.isdigit() for c in piece)


def kinds(record: dict[str, Any]) -> list[list[str]]:
    """The kinds each token belongs to (several may apply): its segment, the reasoning's end and the token after
    it, the end of turn, numbers, punctuation, words."""
    rl, ids, pieces = roles(record), record["ids"], record["pieces"]
    think_end, end_text = _special(record, "think_end"), markers(record)["think_end"]
    out = []
    for p, (tok, role) in enumerate(zip(ids, rl)):
        piece = pieces[str(tok)]
        ks = [SEGMENT_OF_ROLE.get(role, "prompt")]
        if think_end is not None and tok == think_end:
            ks.append(f"{end_text} (end of reasoning)")
        elif p > 0 and think_end is not None and ids[p - 1] == think_end:
            ks.append(f"first token after {end_text}")
        elif role == "think":
            ks.append(markers(record)["think_start"] or "think marker")
        if role == "end":
            ks.append("end of turn")
        elif _is_number(piece):
            ks.append("number")
        elif piece.strip() and not any(c.isalnum() for c in piece):
            ks.append("punctuation")
        elif any(c.isalpha() for c in piece) and role not in ("think", "end"):
            ks.append("word")
        out.append(ks)
    return out


def miss_table(records: Sequence[dict[str, Any]], min_checked: int = MIN_CHECKED):
    """Where misses concentrate: per token kind, the positions checked, how many the target rejected, the miss
    rate and how it compares with all positions, its share of all misses and the most common wrong guess
    (draft -> target). Sorted worst first (kinds with fewer than ``min_checked`` positions last)."""
    import pandas as pd

    checked: Counter = Counter()
    missed: Counter = Counter()
    pairs: dict[str, Counter] = {}
    for rec in records:
        got = {m[0]: (rec["pieces"].get(str(m[1]), str(m[1])), rec["pieces"].get(str(m[2]), str(m[2])))
               for m in rec["misses"]}
        for p, (o, ks) in enumerate(zip(outcomes(rec), kinds(rec))):
            if o < 0:
                continue
            for kind in ["all positions", *ks]:
                checked[kind] += 1
                if o == 0:
                    missed[kind] += 1
                    if p in got:
                        pairs.setdefault(kind, Counter())[got[p]] += 1
    total_missed = missed["all positions"] or 1
    overall = missed["all positions"] / max(checked["all positions"], 1)
    rows = []
    for kind, n in checked.items():
        rate = missed[kind] / n
        common = pairs.get(kind, Counter()).most_common(1)
        rows.append({"where": kind, "checked": n, "missed": missed[kind], "miss rate": rate,
                     "x overall": rate / overall if overall else None,
                     "share of misses": missed[kind] / total_missed,
                     "most common miss (draft -> target)":
                         f"{common[0][0][0]!r} -> {common[0][0][1]!r} ({common[0][1]}x)" if common else ""})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["_small"] = df["checked"] < min_checked
    df["_all"] = df["where"] == "all positions"
    return df.sort_values(["_all", "_small", "miss rate"], ascending=[False, True, False]) \
        .drop(columns=["_small", "_all"]).reset_index(drop=True)


def worst_kind(table) -> str:
    """One sentence naming the kind of token where the draft fails most (from ``miss_table``)."""
    if table is None or len(table) < 2:
        return "no drafted positions to judge"
    overall = table.iloc[0]
    if not overall["missed"]:  # a draft (or a filter) with no miss has no kind to name, nor an overall rate to scale
        return f"no misses: the target accepted all {overall['checked']} drafted positions"
    rest = table.iloc[1:]
    rest = rest[(rest["checked"] >= MIN_CHECKED) & ~rest["where"].isin(["reasoning", "answer"])]
    if rest.empty:
        return f"misses spread evenly (miss rate {overall['miss rate']:.0%} over {overall['checked']} positions)"
    w = rest.iloc[0]
    return (f"the draft fails most at: {w['where']} (miss rate {w['miss rate']:.0%} over {w['checked']} positions, "
            f"{w['x overall']:.1f}x the {overall['miss rate']:.0%} overall; {w['share of misses']:.0%} of all misses)")


def summary(stage_dir: Path) -> dict[str, Any]:
    """Per source that ran: the miss table's rows and the sentence naming the worst kind (for metrics.json)."""
    out = {}
    for source in SOURCES:
        records = load_records(stage_dir, source)
        if records:
            table = miss_table(records)
            out[source] = {"samples": len(records), "worst": worst_kind(table), "table": table.to_dict("records")}
    return out


def sample_stats(record: dict[str, Any], segment: str = "all", span: tuple[int, int] | None = None) -> dict[str, Any]:
    """One sample's acceptance: positions drafted, mean accepted count, misses (over ``segment``: all |
    reasoning | answer, and positions in ``span``)."""
    rl = roles(record)
    lo, hi = span or (0, len(record["ids"]))
    acc, miss = [], 0
    for p, (n, o) in enumerate(zip(record["accepted"], outcomes(record))):
        if n < 0 or not lo <= p < hi or (segment != "all" and SEGMENT_OF_ROLE.get(rl[p]) != segment):
            continue
        acc.append(n)
        miss += o == 0
    return {"id": record["id"], "category": record.get("category"), "length": len(record["ids"]),
            "drafted": len(acc), "mean accepted": sum(acc) / len(acc) if acc else None, "misses": miss}


def sample_table(records: Sequence[dict[str, Any]], segment: str = "all"):
    """Every sample's acceptance, worst first (pandas)."""
    import pandas as pd

    df = pd.DataFrame([sample_stats(r, segment) for r in records])
    return df.sort_values("mean accepted", na_position="last").reset_index(drop=True) if len(df) else df
