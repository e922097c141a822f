"""05_refresh's work, ``run(P) -> metrics``: from the requests a deployment served to a refreshed draft that ships
only if it wins everywhere (docs/refresh.md). Each step stores its result, so a re-run or a resume after a kill
redoes only what did not finish; 01, 02 and 03 resume on their own."""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.data.prompts import prompts_path
from eagle3nb.data.samples import latest, sample_files
from eagle3nb.data.split import split_holdout
from eagle3nb.data.traffic import read_traffic
from eagle3nb.params import STAGE_MODULES, ParamsError, from_dict
from eagle3nb.progress import PROGRESS_FILE, write_json_atomic
from eagle3nb.refresh.gate import GroupScores, judge
from eagle3nb.refresh.opd import counts, proposals, write_records
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.refresh.served import served_ab
from eagle3nb.refresh.weak import per_request, rank, table


def run(P: RefreshParams) -> dict[str, Any]:
    """The whole stage; writes ``metrics.json`` and, when the gate passes, the refreshed draft in ``draft/``
    beside the current one (never over it). Returns the metrics as written."""
    out = P.stage_dir
    out.mkdir(parents=True, exist_ok=True)
    # 1. the traffic: a uniform sample of each group, every request counted, half of each group held out
    traffic = read_traffic(prompts_path(P.traffic), P.per_group, group_by=P.group_by, seed=P.seeds[0])
    _, held_idx = split_holdout([r["id"] for r in traffic.rows], 0.5)
    held = set(held_idx)
    heldout = [traffic.rows[i] for i in held_idx]
    pool = [r for i, r in enumerate(traffic.rows) if i not in held]
    print(f"traffic: {traffic.requests} requests in {len(traffic.groups)} groups, {len(traffic.rows)} sampled "
          f"({len(heldout)} held out); dropped {dict(traffic.dropped) or 'none'}; {traffic.redacted} secrets redacted",
          flush=True)
    # 2. the current draft on held-out traffic, per group, and the groups ranked by the speedup they lose; with
    #    `offline`, also 04's offline acceptance per group over the target's own answers to the same requests
    measure = Measure(P, heldout)
    before = measure(P.draft_path, out / "before.json")
    vocab = json.loads((P.draft_path / "config.json").read_text())["draft_vocab_size"]
    offline = offline_by_group(P, heldout, vocab, out) if P.offline else {}
    c, o = costs(P)
    ranked = rank(before, traffic.shares(), P.k, c, o)
    for w in ranked:
        print(f"group {w.name}: {w.share:.0%} of traffic, acceptance length {w.acceptance_length:.2f}"
              + (f" (offline {offline[w.name]:.2f})" if w.name in offline else "")
              + f", speedup lost {w.speedup_lost:.3f}x", flush=True)
    # 3. the refresh data: a budget of requests drawn toward the weak groups, answered on-policy, plus a replay
    picks = allocate({w.name: w.speedup_lost for w in ranked}, pool, P.budget)
    synth_dir = answer(P, picks, out / "refresh-prompts.jsonl", out / "01_synth")
    mixed, replayed = mix(synth_dir, P.synth_path, round(len(picks) * P.replay / (1 - P.replay)), P.seeds[0],
                          out / "refresh-data")
    # 4. 02's hidden states over the refresh data, with a draft vocabulary of the current draft's size
    data_dir = extract(P, mixed, vocab, out / "02_hidden_states")
    # 5. 03 fine-tunes from the current draft, once per seed (lm_head rows follow their ids where the refresh
    #    data's vocabulary differs: remap_vocab), exporting its last weights: the gate judges, not 03's held-out
    drafts = {s: sub_stage("03_train", P, {"data_dir": data_dir, "init_from": P.draft_path, "max_steps": P.steps,
                                           "lr": P.lr, "seed": s, "remap_vocab": True, "keep_best": False,
                                           "output_dir": out / f"03_train-seed{s}"}) / "draft"
              for s in P.seeds}
    # 6. the gate: each refreshed draft on the same held-out requests, group by group; with `opd_steps`, the
    #    drafts after on-policy distillation (5b) are judged and the supervised ones are kept as the comparison
    after = {s: measure(d, out / f"after-seed{s}.json") for s, d in drafts.items()}
    verdict = judge(scores(traffic.shares(), before, after, P.seeds), P.k, c, o)
    opd = None
    if P.opd_steps:
        sft, supervised = after, verdict
        proposed = {s: distil(P, measure, d, picks, s, (vocab, data_dir), out / f"opd-seed{s}")
                    for s, d in drafts.items()}
        drafts = {s: d for s, (d, _) in proposed.items()}
        after = {s: measure(d, out / f"after-opd-seed{s}.json") for s, d in drafts.items()}
        verdict = judge(scores(traffic.shares(), before, after, P.seeds), P.k, c, o)
        opd = {"steps": P.opd_steps, "proposals": {str(s): n for s, (_, n) in proposed.items()},
               "without": {"speedup": supervised.speedup_after, "groups": _means(sft)},
               "with": {"speedup": verdict.speedup_after, "groups": _means(after)}}
        print(f"on-policy distillation: traffic-weighted speedup {supervised.speedup_after:.3f}x without, "
              f"{verdict.speedup_after:.3f}x with", flush=True)
    print(verdict.reason, flush=True)
    # 7. the refreshed draft beside the current one when it ships
    best = max(P.seeds, key=lambda s: sum(traffic.shares()[g] * sum(v) / len(v) for g, v in after[s].items()))
    shipped = None
    if verdict.ship:
        shipped = out / "draft"
        shutil.rmtree(shipped, ignore_errors=True)
        shutil.copytree(drafts[best], shipped)
    # 8. on request, the served A/B: both drafts in the real vLLM on the weakest group's held-out requests
    served = None
    if P.served_ab == "vllm":
        weakest = ranked[0].name
        served = served_ab(P, weakest, [r for r in heldout if r["group"] == weakest],
                           {"current": P.draft_path, "refreshed": drafts[best]}, out / "served-ab.json")
    metrics = {"stage": "05_refresh", "run_name": P.run_name, "current_draft": str(P.draft_path),
               "traffic": {"requests": traffic.requests, "groups": dict(traffic.groups), "shares": traffic.shares(),
                           "dropped": dict(traffic.dropped), "redacted": traffic.redacted,
                           "sampled": len(traffic.rows), "heldout": len(heldout)},
               "weak": [{**row, "offline_acceptance_length": offline.get(row["group"])} for row in table(ranked)],
               "refresh_data": {"traffic": _count(picks), "replayed": replayed},
               "costs": {"cost_ratio": c, "overhead": o, "k": P.k},
               "gate": {"ship": verdict.ship, "reason": verdict.reason, "speedup_before": verdict.speedup_before,
                        "speedup_after": verdict.speedup_after, "groups": [vars(g) for g in verdict.groups]},
               "opd": opd, "best_seed": best, "draft": str(shipped) if shipped else None, "served_ab": served}
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def scores(shares: dict[str, float], before: dict[str, list[float]], after: dict[int, dict[str, list[float]]],
           seeds: list[int]) -> list[GroupScores]:
    """The gate's input: per group, the current draft's acceptance and each seed's refreshed one."""
    return [GroupScores(g, shares[g], before[g], [after[s][g] for s in seeds]) for g in sorted(before)]


def _means(after: dict[int, dict[str, list[float]]]) -> dict[str, float]:
    """Per group, the refreshed drafts' mean acceptance length over seeds and requests."""
    rows: dict[str, list[float]] = {}
    for per_group in after.values():
        for g, v in per_group.items():
            rows.setdefault(g, []).extend(v)
    return {g: sum(v) / len(v) for g, v in sorted(rows.items())}


def distil(P: RefreshParams, measure: Measure, draft: Path, rows: list[dict], seed: int, vocab: tuple[int, Path],
           folder: Path) -> tuple[Path, dict[str, int]]:
    """On-policy distillation of one refreshed draft (``eagle3nb.refresh.opd``): its proposals on ``rows``
    replayed through the target (02 over the records, keeping the vocabulary of ``vocab``'s 02 folder, the one the
    draft was fine-tuned on: the proposals' few scored tokens would choose another and cost the draft the rest),
    then 03 from it with ``loss: opd``. Returns the distilled draft and the proposals' counts."""
    records = folder / "proposals"
    if not records.is_dir():
        decoder, tpl, eos = measure.decoder(draft)
        write_records(proposals(decoder, tpl, rows, P.max_tokens, eos, P.opd_rounds), records)
    data_dir = extract(P, records, vocab[0], folder / "02_hidden_states", vocab_from=vocab[1])
    trained = sub_stage("03_train", P, {"data_dir": data_dir, "init_from": draft, "max_steps": P.opd_steps,
                                        "lr": P.opd_lr, "seed": seed, "loss": "opd",
                                        "keep_best": False, "output_dir": folder / "03_train"})
    return trained / "draft", counts(records)


def _count(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["group"]] = out.get(r["group"], 0) + 1
    return dict(sorted(out.items()))


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
        from eagle3nb.drafts import load_draft
        from eagle3nb.hf import DECODER, load_target
        from eagle3nb.specdec.batch import SpecDecoder

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


def allocate(loss: dict[str, float], pool: list[dict], budget: int) -> list[dict]:
    """Up to ``budget`` rows of ``pool``, shared among the groups in proportion to the speedup each loses (all
    groups alike when none loses any); what a group cannot fill goes to the others, in the same proportions."""
    by_group: dict[str, list[dict]] = {}
    for r in pool:
        by_group.setdefault(r["group"], []).append(r)
    weights = {g: loss.get(g, 0.0) for g in by_group}
    if not any(weights.values()):
        weights = dict.fromkeys(by_group, 1.0)
    take = dict.fromkeys(by_group, 0)
    left = min(budget, sum(len(v) for g, v in by_group.items() if weights[g] > 0))
    while left > 0:
        open_ = {g: w for g, w in weights.items() if w > 0 and take[g] < len(by_group[g])}
        total = sum(open_.values())
        shares = {g: max(1, int(left * w / total)) for g, w in open_.items()}
        for g in sorted(open_, key=lambda g: -open_[g]):
            n = min(shares[g], len(by_group[g]) - take[g], left)
            take[g] += n
            left -= n
    return [r for g in sorted(by_group) for r in by_group[g][: take[g]]]


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
    data_dir = extract(P, answer(P, heldout, out / "heldout-prompts.jsonl", out / "01_heldout"), vocab,
                       out / "02_heldout")
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


def sub_stage(stage: str, P: RefreshParams, values: dict[str, Any]) -> Path:
    """Run stage ``stage`` (01, 02 or 03) with ``values`` under this run's name; returns its output folder."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items() if v is not None or k == "max_samples"}
    sp = from_dict(stage, {"run_name": P.run_name, **values})
    importlib.import_module(f"{STAGE_MODULES[stage]}.stage").run(sp)
    return sp.stage_dir
