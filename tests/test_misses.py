"""Where the draft misses (04's miss view), on real output: 04's offline step and local decoding run on the shared
trained run (conftest ``trained``), and the view built from what they wrote: positions coloured by accepted count,
the draft's guess beside the target's token at each miss, the miss table naming where the draft fails most; plus
acceptance by context length, the served-vs-trained length warning and 03's held-out curve against data seen."""

from __future__ import annotations

import pytest

from eagle3nb.accept import misses, views
from eagle3nb.accept.local import run_local
from eagle3nb.accept.models import load_models
from eagle3nb.accept.offline import run_offline
from eagle3nb.accept.stage import context_check
from eagle3nb.params import from_dict
from eagle3nb.params_yaml import run_params
from eagle3nb.train.report import DATA_FIGURE, data_curve, read_metrics


@pytest.fixture(scope="module")
def judged(trained, tmp_path_factory) -> dict:
    """04's offline step (8 held-out samples) and local decoding (2 prompts) on the trained run."""
    out = tmp_path_factory.mktemp("misses")
    values = {**run_params(trained["run"], "04_acceptance"), "output_dir": str(out), "offline_samples": 8,
              "local_prompts": 2, "max_tokens": 24}
    P = from_dict("04_acceptance", values)
    target, draft, tok = load_models(P, need_target=True)
    return {"P": P, "offline": run_offline(P, draft, tok), "local": run_local(P, target, draft, tok), "tok": tok}


def test_offline_positions_hold_the_chains_acceptance_and_the_misses(judged):
    P, off = judged["P"], judged["offline"]
    records = misses.load_records(P.stage_dir, "offline")
    assert len(records) == off["samples"]
    drafted = [n for r in records for n in r["accepted"] if n >= 0]
    assert drafted and set(drafted) <= set(range(P.k + 1))
    # accepted >= 1 exactly where the chain's first token was accepted: the share is offline's alpha_1
    assert sum(n >= 1 for n in drafted) / len(drafted) == pytest.approx(off["greedy"]["per_position"][0])
    assert sum(n >= 0 for n in drafted) == off["greedy"]["positions"]
    for r in records:
        assert r["unit"] == "TTT step"  # EAGLE-3's (DraftMethod.unit): drawn by accepted count, not as blocks
        assert all(r["loss_mask"][p] for p, n in enumerate(r["accepted"]) if n >= 0)  # only generated tokens
        assert [m[0] for m in r["misses"]] == [p for p, n in enumerate(r["accepted"]) if n == 0]
        assert all(g != t for _, g, t in r["misses"])  # a miss: the draft's guess is not the target's token
        assert all(str(i) in r["pieces"] for i in r["ids"] + [m[1] for m in r["misses"]])


def test_local_rounds_replay_the_real_decoding(judged):
    P, local = judged["P"], judged["local"]
    records = misses.load_records(P.stage_dir, "local")
    assert len(records) == 2
    for rec, out, acc in zip(records, local["outputs"], local["accepted_per_round"]):
        assert rec["unit"] == "TTT step"
        assert rec["ids"][-len(out):] == out
        assert [n for _, n, _ in rec["rounds"]] == acc
        for p, n, d in rec["rounds"]:
            assert rec["ids"][p:p + n] == d[:n][:len(rec["ids"]) - p]  # the accepted drafts are the output
            assert all(a == n for a in rec["accepted"][p:p + n + 1])
        assert len(rec["misses"]) == sum(1 for p, n, d in rec["rounds"] if n < P.k and p + n < len(rec["ids"]))
    assert sum(n for rec in records for _, n, _ in rec["rounds"]) == local["accepted"]


def test_miss_view_widget_table_and_excerpts(judged):
    P = judged["P"]
    records = misses.load_records(P.stage_dir, "offline")
    box = views.browser(P.stage_dir, P.k)
    html = box.view.value
    assert "tv-mark-acc" in html  # drafted positions coloured by their accepted count
    shown = next(r for r in records if r["id"] in html)
    counts = {n for n in shown["accepted"] if n >= 0}
    assert all(f"tv-mark-acc{n}" in html for n in counts)
    assert shown["misses"], "the sample shown first (worst first) has misses"
    p = shown["misses"][0][0]
    assert "MISS: draft guessed" in html and f"#{p}:" in html  # hover and the printed list
    assert "all positions" in box.table.value and "the draft fails most at" in box.table.value
    # sorted worst first: the first sample listed has the lowest mean accepted count
    means = [misses.sample_stats(r)["mean accepted"] for r in records]
    assert f"mean accepted {min(m for m in means if m is not None):.2f}" in box.children[3].options[0][0]
    # filters: the answer segment only, and the local source
    assert "<td>reasoning</td>" in box.table.value and "<td>answer</td>" in box.table.value
    box.children[1].children[0].value = "answer"
    assert "tv-mark-acc" in box.view.value  # the answers are drafted too
    assert "<td>reasoning</td>" not in box.table.value and "<td>answer</td>" in box.table.value
    box.children[0].children[0].value = "local"
    assert "round" in box.view.value

    table = misses.miss_table(records)
    assert table.iloc[0]["where"] == "all positions"
    assert table.iloc[0]["checked"] == sum(1 for r in records for n in r["accepted"] if n >= 0)
    assert {"reasoning", "answer"} <= set(table["where"])
    assert table["missed"].sum() > 0 and (table["miss rate"].between(0, 1)).all()
    worst = misses.worst_kind(table)
    assert worst.startswith(("the draft fails most at", "misses spread"))
    assert "MISS" not in worst
    static = str(views.excerpts(P.stage_dir, P.k))
    assert "worst: mean accepted" in static and "typical (median)" in static and "tv-mark-acc" in static


def test_a_filter_without_misses_says_so_instead_of_naming_a_kind(judged):
    """A segment (or a draft) the target accepted everywhere has no worst kind and no overall rate to scale by:
    the sentence says so (it used to fail formatting the missing ratio when the answer filter had no miss)."""
    records = misses.load_records(judged["P"].stage_dir, "offline")
    table = misses.miss_table(records).copy()
    table["missed"] = 0
    table["miss rate"] = 0.0
    table["x overall"] = None
    n = table.iloc[0]["checked"]
    assert misses.worst_kind(table) == f"no misses: the target accepted all {n} drafted positions"


def test_acceptance_by_context_and_the_trained_length_warning(judged, trained):
    P, off = judged["P"], judged["offline"]
    assert off["by_context"] and len(off["by_context"]) == len(off["context_edges"]) + 1  # quartiles: all filled
    assert sum(b["greedy"]["positions"] for b in off["by_context"].values()) == off["greedy"]["positions"]
    ctx = context_check(P)
    assert ctx["longest_trained"] > 0 and ctx["warning"] is None  # 24 new tokens: well inside the trained length
    warning = context_check(P.model_copy(update={"max_tokens": ctx["longest_trained"] + 1}))["warning"]
    assert warning and f"at most {ctx['longest_trained']}" in warning


def test_train_records_heldout_acceptance_against_samples_seen(trained):
    rows = read_metrics(trained["out"] / "03_train")
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals[0]["samples_seen"] == 0 and evals[-1]["samples_seen"] > 0 and evals[-1]["tokens_seen"] > 0
    curve = data_curve(rows)
    assert curve["points"][-1] == (evals[-1]["samples_seen"], evals[-1]["acceptance_length"])
    assert (trained["out"] / "03_train" / DATA_FIGURE).exists()
