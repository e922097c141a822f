"""05's optional on-policy distillation phase (Draft-OPD, docs/refresh.md): after the supervised fine-tune, the
refreshed draft decodes the refresh's own requests against the target, and its proposals are replayed through the
target for a second, short fine-tune.

Each kept round becomes an 01-style record (token ids and loss mask, which 02 extracts as they are): the context
the draft saw plus its k drafted tokens, scored on the drafted tokens only, loss_mask 1 where the target accepted
the token and ``REJECTED`` where it did not (the first miss and every draft after it: states the draft itself
reaches, which the target never would). 03's ``loss: opd`` then trains forward KL on the accepted and reverse KL on
the rejected ones."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

from eagle3nb.drafts.base import REJECTED
from eagle3nb.refresh.measure import Measure
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.refresh.substages import extract, sub_stage


def distil(P: RefreshParams, measure: Measure, draft: Path, rows: list[dict], seed: int, vocab: tuple[int, Path],
           folder: Path) -> tuple[Path, dict[str, int]]:
    """On-policy distillation of one refreshed draft: its proposals on ``rows`` replayed through the target (02
    over the records, keeping the vocabulary of ``vocab``'s 02 folder, the one the draft was fine-tuned on: the
    proposals' few scored tokens would choose another and cost the draft the rest), then 03 from it with
    ``loss: opd``. Returns the distilled draft and the proposals' counts."""
    records = folder / "proposals"
    if not records.is_dir():
        decoder, tpl, eos = measure.decoder(draft)
        write_records(proposals(decoder, tpl, rows, P.max_tokens, eos, P.opd_rounds), records)
    data_dir = extract(P, records, vocab[0], folder / "02_hidden_states", vocab_from=vocab[1])
    trained = sub_stage("03_train", P, {"data_dir": data_dir, "init_from": draft, "max_steps": P.opd_steps,
                                        "lr": P.opd_lr, "seed": seed, "loss": "opd",
                                        "keep_best": False, "output_dir": folder / "03_train"})
    return trained / "draft", counts(records)


def proposals(decoder, template, rows: Sequence[dict], max_tokens: int, eos: Sequence[int],
              rounds: int) -> list[dict]:
    """The draft's proposals on ``rows`` at T=0 as records: up to ``rounds`` rounds per request, spread evenly
    over its decoding (every round would make the records quadratic in the answer's length)."""
    out = []
    for row in rows:
        prompt = template.prompt_ids(row["messages"], row.get("tools"))
        res = decoder.generate(prompt, max_tokens, 0.0, eos)
        emitted = 1  # the prefill's token opens the first round
        step = max(1, math.ceil(len(res.accepted_per_round) / rounds))
        for r, (n, drafted) in enumerate(zip(res.accepted_per_round, res.drafted_per_round)):
            if r % step == 0:
                context = list(prompt) + res.tokens[:emitted]
                out.append({"id": f"{row['id']}-round{r}", "status": "ok", "category": row["group"],
                            "input_ids": context + list(drafted),
                            "loss_mask": [0] * len(context) + [1] * n + [REJECTED] * (len(drafted) - n)})
            emitted += n + 1
    return out


def write_records(records: list[dict], dest: Path) -> dict[str, int]:
    """``records`` as ``dest/samples-opd.jsonl`` (built beside ``dest`` and renamed into place, so a kill leaves
    none); returns the counts of records and of accepted and rejected drafted tokens."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "samples-opd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(dest)
    return counts(dest)


def counts(dest: Path) -> dict[str, int]:
    """Records, accepted and rejected drafted tokens in a folder ``write_records`` wrote."""
    masks = [json.loads(line)["loss_mask"] for line in (dest / "samples-opd.jsonl").open()]
    return {"records": len(masks), "accepted": sum(m.count(1) for m in masks),
            "rejected": sum(m.count(REJECTED) for m in masks)}
