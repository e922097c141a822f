"""05_refresh on the toy world: a draft trained without arithmetic, refreshed from a served traffic log rich in it.

The log is the embedded server's own request log (tests/fixtures/traffic/, made by tools/make_traffic_logs.py:
the real openai client against ``eagle3nb serve --enable-log-requests``, which writes vLLM's DEBUG request lines).
Measured: the weak group (math) rises well beyond its standard error, no group falls, the gate ships; a refresh
trained on the weak group alone, with no replay, costs the other group significantly and the gate refuses it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from background import register

from eagle3nb.accept.cache import fingerprint
from eagle3nb.params import from_dict
from eagle3nb.refresh.report import opd_table, served_table, weak_table

from worlds import SEED, THREADS, requires_vllm

LOG = Path(__file__).parent / "fixtures" / "traffic" / "embedded-requests.log"
FAKE_KEY = "sk-" + "test0000fixture0000key0000"
# Given costs (the refresh's verdict needs them; 04 measures them in a real run): a draft step ~a tenth of the
# target's, as 04 measures on the smoke toy.
REFRESH = dict(group_by=["domain"], per_group=40, budget=24, max_completion_tokens=96, k=3, max_tokens=32,
               cost_ratio=0.1, overhead=0.1, lr=2e-3)


# the weak draft: built in the background as the session starts (tests/background.py)
register("weak", "refresh_weak", threads=THREADS, seed=SEED)


@pytest.fixture(scope="module")
def weak(background, tmp_path_factory) -> dict:
    """A draft trained on the toy's dialogues without arithmetic: weak at math, good at the rest."""
    return background.result("weak", tmp_path_factory.mktemp("refresh"))


def refresh(weak: dict, toy_smoke: Path, url: str, name: str, **values):
    import torch

    from eagle3nb.refresh.stage import run

    P = from_dict("05_refresh", {"run_name": "refresh-test", "model_path": str(toy_smoke), "traffic": str(LOG),
                                 "draft_dir": str(weak["draft"]), "synth_dir": str(weak["synth"]), "vllm_url": url,
                                 "output_dir": str(weak["out"] / name), **REFRESH, **values})
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return run(P)
    finally:
        torch.set_num_threads(threads)


SHIPS = dict(steps=60, replay=0.5, seeds=[SEED, SEED + 1], offline=True)


@pytest.fixture(scope="module")
def shipped(weak, toy_smoke, embedded) -> dict:
    """The refresh that ships, and the current draft's fingerprint before it ran."""
    before = fingerprint(weak["draft"])
    return {"metrics": refresh(weak, toy_smoke, embedded.url, "ships", **SHIPS), "before": before}


def test_refresh_lifts_the_weak_group_and_ships(weak, shipped) -> None:
    m, before = shipped["metrics"], shipped["before"]
    # the traffic as read: every request counted, the key redacted, nothing of it in the stage's files
    bodies = sum("JSON body: {" in line for line in LOG.read_text().splitlines())
    assert m["traffic"]["requests"] == sum(m["traffic"]["groups"].values()) == bodies
    assert m["traffic"]["redacted"] == {"openai": 1}
    assert not any(FAKE_KEY in p.read_text(errors="ignore") for p in (weak["out"] / "ships").rglob("*.json*"))
    # the weak group is the math the draft never trained on, and the refresh data went to it
    assert m["weak"][0]["group"] == "math" and m["weak"][0]["speedup_lost"] > 0
    assert m["refresh_data"]["traffic"].get("math", 0) > m["refresh_data"]["traffic"].get("chat", 0)
    assert m["refresh_data"]["replayed"] > 0
    # offline (04's acceptance over the target's own answers to the held-out requests, no decoding) finds it too
    offline = {w["group"]: w["offline_acceptance_length"] for w in m["weak"]}
    assert offline["math"] < offline["chat"] and set(offline) == set(m["traffic"]["groups"]), offline
    assert "offline_acceptance_length" in weak_table(m).columns
    # the gate: the seed chosen on half of each group's held-out requests, judged on the other half
    gate = {g["name"]: g for g in m["gate"]["groups"]}
    judged = sum(2 * g["requests"] for g in gate.values())
    assert m["traffic"]["heldout"] <= judged <= m["traffic"]["heldout"] + len(gate), gate
    assert gate["math"]["change"] > 2 * gate["math"]["se"] > 0, gate["math"]
    assert all(g["status"] == "held" for g in gate.values()), gate
    assert m["gate"]["ship"] and m["gate"]["gain_lower"] > 0 and m["chosen_seed"] in SHIPS["seeds"]
    # the refreshed draft beside the current one, which is untouched
    assert (Path(m["draft"]) / "config.json").exists() and fingerprint(weak["draft"]) == before


@requires_vllm()
def test_served_ab_through_the_real_vllm(weak, shipped, toy_smoke, embedded) -> None:
    """The same refresh asked for the served A/B (every earlier step reused from its files): the current and the
    refreshed draft, each in the real vLLM beside the target, on the weak group's held-out requests. vLLM's own
    acceptance rises there too, and the report's table shows it."""
    m = refresh(weak, toy_smoke, embedded.url, "ships", **SHIPS, served_ab="vllm")
    assert m["gate"] == shipped["metrics"]["gate"]  # nothing before the A/B was redone differently
    ab, math = m["served_ab"], m["weak"][0]  # every held-out request of the weakest group (the gate judges half)
    assert ab["group"] == math["group"] == "math" and ab["requests"] == math["requests"]
    assert ab["current"]["errors"] == ab["refreshed"]["errors"] == 0
    assert ab["refreshed"]["acceptance_length"] > ab["current"]["acceptance_length"] > 1, ab
    table = served_table(m)
    assert list(table.index) == ["current", "refreshed"] and "math" in table.index.name


def test_refresh_that_forgets_a_group_is_refused(weak, toy_smoke, embedded) -> None:
    """Trained on the weak group alone (no replay), long and hot: math rises, chat falls beyond its noise, so the
    gate refuses and writes no draft."""
    # the refresh that ships measured the current draft on the same held-out requests: taken over when it ran (the
    # stage reuses a finished step whose settings match, as on a resume)
    ships, forgets = weak["out"] / "ships", weak["out"] / "forgets"
    forgets.mkdir()
    if (ships / "before.json").exists():
        shutil.copy(ships / "before.json", forgets / "before.json")
    m = refresh(weak, toy_smoke, embedded.url, "forgets", steps=200, replay=0.0, lr=1e-2, seeds=[SEED])
    gate = {g["name"]: g for g in m["gate"]["groups"]}
    assert gate["math"]["change"] > 0
    assert gate["chat"]["status"] == "fell" and gate["chat"]["upper"] < 0, gate["chat"]
    assert not m["gate"]["ship"] and m["draft"] is None and not (weak["out"] / "forgets" / "draft").exists()


def test_on_policy_distillation_replays_the_drafts_proposals_and_is_measured_with_and_without(weak, shipped,
                                                                                             toy_smoke, embedded):
    """The shipping refresh (its steps reused from its files) with on-policy distillation, one seed: the refreshed
    draft's own proposals on the refresh requests are replayed through 02 (accepted and rejected drafted tokens
    both there), 03 distils from it with loss opd, the gate judges the distilled draft, and the metrics say both."""
    ships = weak["out"] / "ships"
    m = refresh(weak, toy_smoke, embedded.url, "ships", **{**SHIPS, "seeds": [SEED]}, opd_steps=20, opd_lr=5e-4)
    opd = m["opd"]
    n = opd["proposals"][str(SEED)]
    assert n["records"] > 0 and n["accepted"] > 0 and n["rejected"] > 0, n
    # without: the supervised draft as the shipping run measured it; with: the distilled one, which the gate judged
    sft = json.loads((ships / f"after-seed{SEED}.json").read_text())["result"]
    assert opd["without"]["groups"] == {g: sum(v) / len(v) for g, v in sorted(sft.items())}
    assert opd["with"]["speedup"] == m["gate"]["speedup_after"]
    distilled = ships / f"opd-seed{SEED}" / "03_train" / "draft"
    assert fingerprint(distilled) != fingerprint(ships / f"03_train-seed{SEED}" / "draft")
    # at a quarter of the fine-tune's rate the distilled draft keeps the refresh's gain and the gate ships it
    gate = {g["name"]: g for g in m["gate"]["groups"]}
    assert gate["math"]["change"] > 2 * gate["math"]["se"] > 0, gate
    assert all(g["status"] == "held" for g in gate.values()), gate
    assert m["gate"]["ship"], m["gate"]["reason"]
    table = opd_table(m)
    assert list(table.index) == ["without", "with"]
    assert table.loc["with", "math"] == pytest.approx(opd["with"]["groups"]["math"], abs=1e-3)
