"""Looking at the data: the token renderer, 01's and 02's sample browsers and static samples on real stage output
(the smoke toy served over HTTP, then extracted), the validate cell's table of changed parameters, and the runner
staying quiet about outputs an earlier stage of the same run makes."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
import yaml

from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.samples import load_samples
from eagle3nb.hidden import report as hidden_report
from eagle3nb.hidden.stage import run as extract
from eagle3nb.params import ParamsError, from_dict
from eagle3nb.params_notebook import changed_table
from eagle3nb.run.plan import plan
from eagle3nb.synth import report as synth_report
from eagle3nb.synth.stage import run as synth
from eagle3nb.tokens import IM_END, THINK_END, THINK_START
from eagle3nb.tokenview import load_tokenizer, render_tokens, roles_for, special_ids

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stages(toy_smoke, embedded, tmp_path_factory) -> dict:
    """A tiny real 01 run (a budget of 24 tokens, so some answers are cut: status truncated) and its 02 extraction
    with a max_length that cuts the longest sample."""
    out = tmp_path_factory.mktemp("views")
    synth(from_dict("01_synth", {"model_path": str(toy_smoke), "vllm_url": embedded.url, "max_samples": 8,
                                 "max_completion_tokens": 24, "concurrency": 8, "temperature": 0.0,
                                 "output_dir": str(out / "01")}))
    usable = load_samples(out / "01", statuses=("ok", "truncated"))
    cap = max(len(r["input_ids"]) for r in usable) - 3
    extract(from_dict("02_hidden_states", {"model_path": str(toy_smoke), "synth_dir": str(out / "01"),
                                           "output_dir": str(out / "02"), "statuses": ["ok", "truncated"],
                                           "max_length": cap, "storage": "fp32", "dtype": "float32",
                                           "draft_vocab_size": 64}))
    return {"01": out / "01", "02": out / "02", "cap": cap, "tokenizer": load_tokenizer(toy_smoke)}


def test_roles_and_renderer(toy_smoke):
    tok = load_tokenizer(toy_smoke)
    (start, stop), end = special_ids(tok)
    vocab = tok.get_vocab()
    assert (start, stop, end) == (vocab[THINK_START], vocab[THINK_END], vocab[IM_END])
    ids = [300, 301, start, 310, 311, stop, 312, end]
    mask = [0, 0, 1, 1, 1, 1, 1, 1]
    assert roles_for(ids, mask, (start, stop), end) == ["prompt", "prompt", "think", "reasoning", "reasoning",
                                                      "think", "answer", "end"]
    assert roles_for([300, 301, end], [0, 1, 1], (start, stop), end) == ["prompt", "answer", "end"]  # no thinking
    out = render_tokens(["a", "<b>", "\n", "x"], [7, 8, 9, 10], ["prompt", "answer", "answer", "end"],
                        marks=[None, "miss", None, None], titles=[None, "p=0.3", None, None], show_ids=True)
    assert out.count('class="tv-role-') == 4 and out.count("tv-mark-miss") == 1 and "p=0.3" in out
    assert "&lt;b&gt;" in out and "<b>" not in out.split("</div>", 1)[1]  # token text is escaped
    assert "↵<br>" in out and "<sub" in out and "tv-noloss" in out and out.count("tv-loss") == 3
    with pytest.raises(ValueError, match="one entry per token"):
        render_tokens(["a"], [1, 2], ["prompt", "prompt"])
    with pytest.raises(ValueError, match="unknown roles"):
        render_tokens(["a"], [1], ["nonsense"])
    with pytest.raises(ValueError, match="no style for marks"):
        render_tokens(["a"], [1], ["prompt"], marks=["sparkle"])


def spans(view: str) -> list[tuple[str, int, str]]:
    """(classes, id, title) of every token span in a sample view."""
    return [(c, int(i), html.unescape(t)) for c, i, t in
            re.findall(r'<span class="(tv-role-[^"]*)" data-id="(\d+)" title="([^"]*)"', view)]


def test_synth_sample_browser_and_static_samples(stages):
    tok, d = stages["tokenizer"], stages["01"]
    rows = synth_report.sample_rows(d)
    recs = {r["id"]: r for r in load_samples(d, statuses=None)}
    assert len(rows) == 8 and {r["id"] for r in rows} == set(recs)
    flagged = {r["id"] for r in rows if r["flags"]}
    assert flagged == {i for i, r in recs.items() if r["status"] != "ok" or r["ids_match"] is False}
    assert flagged and flagged != set(recs), "the fixture's 24-token budget cuts some answers and not others"

    widget = synth_report.sample_browser(d, tok)
    pick, view = widget.children[2].children[0], widget.children[-1]
    ok = next(r for r in recs.values() if r["status"] == "ok")
    pick.value = ok["id"]
    got = spans(view.value)
    assert [i for _, i, _ in got] == ok["input_ids"]  # every token, in order, with its id
    for (classes, i, title), m in zip(got, ok["loss_mask"]):
        assert ("tv-loss" in classes.split()) == bool(m) and f"loss {m}" in title  # the loss mask, per token
        assert repr(tok.decode([i], skip_special_tokens=False)) in title  # the decoded text beside the id
    roles = {c.split()[0] for c, _, _ in got}
    assert roles == {"tv-role-prompt", "tv-role-think", "tv-role-reasoning", "tv-role-answer", "tv-role-end"}
    assert html.escape(ok["content"]) in view.value and f'data-sample-id="{ok["id"]}"' in view.value  # its fields

    status = widget.children[0].children[0]
    status.value = "truncated"
    assert {v for _, v in pick.options} == {i for i, r in recs.items() if r["status"] == "truncated"}
    status.value = "(any)"
    widget.children[2].children[1].click()  # random flagged
    assert pick.value in flagged
    widget.children[2].children[2].value = True  # show ids
    first = recs[pick.value]["input_ids"][0]
    assert f">{first}</sub></span>" in view.value
    assert "interactive in JupyterLab" in widget._repr_mimebundle_()["text/html"]  # what a headless report shows

    chosen = synth_report.chosen_samples(d)
    assert chosen["worst"] in flagged
    assert recs[chosen["typical"]]["status"] == "ok" and chosen["typical"] != chosen["worst"]
    static = str(synth_report.static_samples(d, tok))
    assert re.findall(r'data-sample-id="([^"]+)"', static) == [chosen["worst"], chosen["typical"]]
    assert "worst sample" in static and "typical sample" in static


def test_hidden_sample_browser_and_static_samples(stages):
    tok, d, cap = stages["tokenizer"], stages["02"], stages["cap"]
    data = HiddenStates(d)
    rows = hidden_report.sample_rows(d)
    cut = [r["id"] for r in rows if "cut" in r["flags"]]
    assert cut and all(r["length"] == cap for r in rows if r["id"] in cut)

    widget = hidden_report.sample_browser(d, tok)
    pick, view = widget.children[2].children[0], widget.children[-1]
    pick.value = cut[0]
    item = data[[s["id"] for s in data.samples].index(cut[0])]
    got = spans(view.value)
    assert [i for _, i, _ in got] == item["input_ids"].tolist()
    assert [("tv-loss" in c.split()) for c, _, _ in got] == [bool(m) for m in item["loss_mask"].tolist()]
    assert "tv-mark-cut" in got[-1][0] and f"yes (max_length {cap})" in view.value
    argmax = data.target_argmax(item).tolist()
    assert f"(id {argmax[0]}," in got[1][2]  # the target's pick for token 1, from the stored final state
    assert "tv-role-reasoning" in view.value and "tv-role-prompt" in view.value

    chosen = hidden_report.chosen_samples(d)
    assert chosen["worst"] in cut and chosen["typical"] != chosen["worst"]
    static = str(hidden_report.static_samples(d, tok))
    assert re.findall(r'data-sample-id="([^"]+)"', static) == [chosen["worst"], chosen["typical"]]
    assert "tv-mark-cut" in static


def test_01_and_02_reports_open_with_three_lines_from_their_metrics(stages):
    """The headline each report opens with: what was measured, whether it pays, what next, from metrics.json."""
    import json

    from eagle3nb.figures import headline_html

    m1 = json.loads((stages["01"] / "metrics.json").read_text())
    measured, pays, nxt = synth_report.headline(m1)
    c = m1["counts"]
    assert f"{c['ok']} ok" in measured and f"{c['truncated']} truncated" in measured  # this run cut some answers
    assert pays.startswith("yes" if c["ok"] and c["no_reasoning"] <= 0.1 * sum(c.values()) else "no") and "02" in nxt
    m2 = json.loads((stages["02"] / "metrics.json").read_text())
    measured, pays, nxt = hidden_report.headline(m2)
    assert f"{m2['samples']} samples" in measured and f"{m2['tokens']:,} tokens" in measured
    assert f"covers {m2['coverage']:.0%}" in pays and ("run 03_train" in nxt) == (m2["coverage"] >= 0.9)
    box = headline_html(measured, pays, nxt).data
    assert [re.sub("<[^>]+>", "", d) for d in box.split("<div>")[1:]][0].startswith("Measured:")


def test_changed_table_shows_only_what_differs():
    P = from_dict("04_acceptance", {"k": 2, "max_k": 4, "endpoints": [{"label": "a", "url": "http://h:1"}],
                                    "params_file": "params/x/04_acceptance.yaml"}, check_paths=False)
    t = changed_table(P)
    assert [r[0] for r in t.rows] == ["k", "max_k", "endpoints"]
    text, page = repr(t), t._repr_html_()
    total = len(type(P).model_fields) - 1  # params_file is bookkeeping
    assert text.splitlines()[0] == (f"04_acceptance: 3 of {total} parameters differ from the defaults "
                                    "(from params/x/04_acceptance.yaml)")
    assert re.search(r"^  k +2  \(default 3\)$", text, re.M)
    assert "'http://h:1/v1'" in text and "(default 'embedded')" in text
    assert "<td><code>max_k</code></td><td><code>4</code></td><td><code>6</code></td>" in page
    assert "drafted tokens per target step" in page  # the schema's help beside the value
    plain = changed_table(from_dict("03_train", {}, check_paths=False))
    assert plain.rows == [] and "every parameter at its default" in repr(plain)


def test_runner_is_quiet_about_what_an_earlier_stage_makes(tmp_path):
    run_dir = tmp_path / f"views-quiet-{tmp_path.name}"  # its outputs/<run>/ is never created: plan only reads
    run_dir.mkdir()
    for stage, values in {"01_synth": {"model_path": "toy:smoke"}, "02_hidden_states": {"model_path": "toy:smoke"},
                          "03_train": {}, "04_acceptance": {"model_path": "toy:smoke"}}.items():
        (run_dir / f"{stage}.yaml").write_text(yaml.safe_dump(values))
    assert plan(run_dir).notes == []  # 04's draft (made by 03) and data (by 02): no warning
    with pytest.raises(ParamsError, match="draft_dir.*has no config.json; run 03_train first"):
        plan(run_dir, stages="04")  # the stage alone: its missing input is an error before it starts
    (run_dir / "04_acceptance.yaml").write_text(yaml.safe_dump({"model_path": "toy:smoke",
                                                                "draft_dir": str(tmp_path / "elsewhere")}))
    notes = plan(run_dir).notes  # a path no stage of this run makes is still a note
    assert len(notes) == 1 and "elsewhere has no config.json" in notes[0] and "checked again" in notes[0]
