"""05's use of the earlier stages: 01 answers requests on-policy, 02 extracts, 03 fine-tunes, each run through the
stages' public entry (``eagle3nb.stage_cli.run_stage``) under this run's name, with its own resume; and the data
glue between them (the replay mix, the check that 01's answers hold something to train on)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.data.samples import latest, sample_files
from eagle3nb.errors import InputError
from eagle3nb.params import from_dict
from eagle3nb.progress import PROGRESS_FILE
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.stage_cli import run_stage


def sub_stage(stage: str, P: RefreshParams, values: dict[str, Any]) -> Path:
    """Run stage ``stage`` (01, 02 or 03) with ``values`` under this run's name; returns its output folder."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items() if v is not None or k == "max_samples"}
    sp = from_dict(stage, {"run_name": P.run_name, **values})
    run_stage(sp)
    return sp.stage_dir


def answer(P: RefreshParams, rows: list[dict], prompts: Path, output_dir: Path) -> Path:
    """01 answers ``rows`` on-policy (every turn after the target's own earlier answers), their group as the
    category; the prompts written once to ``prompts``, 01's folder ``output_dir``."""
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"], "tools": r["tools"],
                                               "tool_choice": r["tool_choice"], "category": r["group"]}) + "\n"
                                   for r in rows))
    return sub_stage("01_synth", P, {"prompts": prompts, "max_samples": None, "multi_turn": "every",
                                     "vllm_url": P.vllm_url, "api_key_env": P.api_key_env, "model_path": P.model_path,
                                     "max_completion_tokens": P.max_completion_tokens, "seed": P.seeds[0],
                                     "output_dir": output_dir})


def check_answers(P: RefreshParams, synth_dir: Path) -> int:
    """The on-policy answers usable as training data (01's ``ok`` records); none is a one-line error naming why
    (the statuses counted) and the fix for the commonest, before 02 and 03 run on nothing."""
    status = Counter(r.get("status") for r in latest(synth_dir).values())
    if status["ok"]:
        return status["ok"]
    fixes = {"truncated": f"every answer hit max_completion_tokens ({P.max_completion_tokens}): raise it in "
                          "05_refresh.yaml (a reasoning target needs its thinking and its answer to fit)",
             "no_reasoning": "the target answered without reasoning: check the server's reasoning parser "
                             "(eagle3nb doctor) and the thinking switch of 01",
             "error": f"the server failed them: see the errors in {synth_dir}/samples-*.jsonl"}
    why = ", ".join(f"{n} {s}" for s, n in status.most_common()) or "no answer at all"
    top = status.most_common(1)[0][0] if status else "error"
    raise InputError(f"05_refresh: none of the {sum(status.values())} on-policy answers in {synth_dir} is usable "
                     f"({why}); {fixes.get(top, fixes['error'])}")


def extract(P: RefreshParams, synth_dir: Path, vocab: int, output_dir: Path, vocab_from: Path | None = None) -> Path:
    """02's hidden states over an 01 folder, with a draft vocabulary of the current draft's size (``vocab_from``'s
    vocabulary when given)."""
    return sub_stage("02_hidden_states", P, {"synth_dir": synth_dir, "output_dir": output_dir,
                                             "model_path": P.model_path, "draft_vocab_size": vocab,
                                             "vocab_from": vocab_from})


def offline_by_group(P: RefreshParams, heldout: list[dict], vocab: int, out: Path) -> dict[str, float]:
    """The current draft's offline acceptance length per group (04's ``offline_acceptance``, greedy, by category):
    01 answers the held-out requests (the target's own answers), 02 extracts their states; no decoding here, so
    it is what a target too big to decode locally allows."""
    synth = answer(P, heldout, out / "heldout-prompts.jsonl", out / "01_heldout")
    check_answers(P, synth)
    data_dir = extract(P, synth, vocab, out / "02_heldout")
    config = {"draft": fingerprint(P.draft_path), "data": str(data_dir), "k": P.k,
              "requests": [r["id"] for r in heldout]}

    def work() -> dict[str, float]:
        from eagle3nb.accept.offline import offline_acceptance
        from eagle3nb.data.reader import HiddenStates
        from eagle3nb.drafts import load_draft

        data = HiddenStates(data_dir)
        draft = load_draft(P.draft_path, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
        res = offline_acceptance(draft, data, P.k, P.k)
        return {g: v["greedy"]["acceptance_length"] for g, v in res.get("by_category", {}).items()}

    return cached(out / "offline-before.json", config, work)


def mix(synth_dir: Path, source: Path, n: int, seed: int, dest: Path) -> tuple[Path, int]:
    """The refresh's training data as one 01 folder for 02: the new on-policy records (01's files as written,
    its progress included) plus ``n`` of the current draft's own ok records (chosen by id hash, so the same on a
    re-run) as ``samples-replay.jsonl``; built beside ``dest`` and renamed into place, so a kill leaves none."""
    if dest.is_dir():
        return dest, sum(1 for _ in (dest / "samples-replay.jsonl").open())
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in [*sample_files(synth_dir), synth_dir / PROGRESS_FILE]:
        shutil.copy2(f, tmp / f.name)
    ok = [r for r in latest(source).values() if r.get("status") == "ok"]
    ok.sort(key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
    chosen = ok[:n]
    (tmp / "samples-replay.jsonl").write_text("".join(json.dumps({**r, "id": f"replay-{r['id']}"}) + "\n"
                                                      for r in chosen))
    tmp.rename(dest)
    return dest, len(chosen)
