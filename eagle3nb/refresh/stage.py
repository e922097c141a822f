"""05_refresh's work, ``run(P) -> metrics``: from the requests a deployment served to a refreshed draft that ships
only if the gate finds it better on held-out traffic and no group significantly worse (docs/refresh.md). Each step
stores its result, so a re-run or a resume after a kill redoes only what did not finish; 01, 02 and 03 resume on
their own."""

from __future__ import annotations

import json
import shutil
from typing import Any

from eagle3nb.data.prompts import prompts_path
from eagle3nb.data.traffic import read_traffic
from eagle3nb.errors import InputError
from eagle3nb.progress import write_json_atomic
from eagle3nb.refresh.gate import judge
from eagle3nb.refresh.measure import Measure, costs, means, scores
from eagle3nb.refresh.opd import distil
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.refresh.sample import allocate, count, split
from eagle3nb.refresh.served import served_ab
from eagle3nb.refresh.substages import answer, check_answers, extract, mix, offline_by_group, sub_stage
from eagle3nb.refresh.weak import rank, table


def run(P: RefreshParams) -> dict[str, Any]:
    """The whole stage; writes ``metrics.json`` and, when the gate passes, the refreshed draft in ``draft/``
    beside the current one (never over it). Returns the metrics as written."""
    out = P.stage_dir
    out.mkdir(parents=True, exist_ok=True)
    # 1. the traffic: a uniform sample of each group, every request counted, each group split into held-out
    #    requests (to measure and judge, at least what the gate needs) and a pool (refresh data); none usable: stop
    traffic = read_traffic(prompts_path(P.traffic), P.per_group, group_by=P.group_by, seed=P.seeds[0],
                           tag_allowlist=P.tag_allowlist)
    if not traffic.rows:
        dropped = (", ".join(f"{n} {why}" for why, n in traffic.dropped.most_common())
                   or "none holds a request: vLLM logs them with --enable-log-requests at log level DEBUG")
        raise InputError(f"traffic {P.traffic} holds no usable chat request (lines dropped: {dropped}); point "
                         "traffic at a gateway's JSONL request log or vLLM's request log (docs/refresh.md, step 1)")
    heldout, pool = split(traffic.rows, len(P.seeds))
    print(f"traffic: {traffic.requests} requests in {len(traffic.groups)} groups, {len(traffic.rows)} sampled "
          f"({len(heldout)} held out); dropped {dict(traffic.dropped) or 'none'}; {traffic.redacted} secrets redacted",
          flush=True)
    empty = sorted(set(traffic.groups) - {r["group"] for r in traffic.rows})
    if empty:  # the gate lists them as not judged and counts their share (its 5% rule)
        print(f"groups with no request left after de-duplication (all repeat another group's): "
              f"{', '.join(f'{g} ({traffic.shares()[g]:.0%})' for g in empty)}", flush=True)
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
    # 3. the refresh data: a budget of requests drawn toward the weak groups, answered on-policy (none usable:
    #    stop, naming why), plus a replay of the current draft's own data
    picks = allocate({w.name: w.speedup_lost for w in ranked}, pool, P.budget)
    if not picks:
        raise InputError(f"traffic {P.traffic}: its {len(traffic.rows)} usable requests are all held out to judge "
                         f"the groups ({count(heldout)}), none is left to refresh on; raise per_group (now "
                         f"{P.per_group}) or give a longer log")
    synth_dir = answer(P, picks, out / "refresh-prompts.jsonl", out / "01_synth")
    check_answers(P, synth_dir)
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
    # 6. the gate (eagle3nb/refresh/gate.py): each refreshed draft on the same held-out requests; the seed chosen on
    #    one half of each group's requests, judged on the other; with `opd_steps`, the drafts after on-policy
    #    distillation (5b) are judged and the supervised ones are kept as the comparison
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
               "without": {"speedup": supervised.speedup_after, "groups": means(sft)},
               "with": {"speedup": verdict.speedup_after, "groups": means(after)}}
        print(f"on-policy distillation: traffic-weighted speedup {supervised.speedup_after:.3f}x without, "
              f"{verdict.speedup_after:.3f}x with", flush=True)
    print(verdict.reason, flush=True)
    # 7. the chosen seed's draft beside the current one when it ships
    chosen = P.seeds[verdict.seed]
    shipped = None
    if verdict.ship:
        shipped = out / "draft"
        shutil.rmtree(shipped, ignore_errors=True)
        shutil.copytree(drafts[chosen], shipped)
    # 8. on request, the served A/B: both drafts in the real vLLM on the weakest group's held-out requests
    served = None
    if P.served_ab == "vllm":
        weakest = ranked[0].name
        served = served_ab(P, weakest, [r for r in heldout if r["group"] == weakest],
                           {"current": P.draft_path, "refreshed": drafts[chosen]}, out / "served-ab.json")
    metrics = {"stage": "05_refresh", "run_name": P.run_name, "current_draft": str(P.draft_path),
               "traffic": {"requests": traffic.requests, "groups": dict(traffic.groups), "shares": traffic.shares(),
                           "dropped": dict(traffic.dropped), "redacted": traffic.redacted,
                           "sampled": len(traffic.rows), "heldout": len(heldout)},
               "weak": [{**row, "offline_acceptance_length": offline.get(row["group"])} for row in table(ranked)],
               "refresh_data": {"traffic": count(picks), "replayed": replayed},
               "costs": {"cost_ratio": c, "overhead": o, "k": P.k},
               "gate": verdict.as_metrics(),
               "opd": opd, "chosen_seed": chosen, "draft": str(shipped) if shipped else None, "served_ab": served}
    write_json_atomic(out / "metrics.json", metrics)
    return metrics
