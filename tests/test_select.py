"""06_select from where the user stands: the candidates are the registry's recipes (a method registered is one), a
candidate 03 would refuse is one line before any work, the pick follows served throughput and never tau (an engine
whose higher-tau candidate serves slower), the load from a traffic log by Little's law, the smoke selection end to
end on the embedded server, killed -9 mid-serving and resumed by ``eagle3nb run`` without re-measuring a finished
cell, and the real vLLM: a candidate served with its rounds profile, one it refuses listed with vLLM's own reason."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest
from background import register

from worlds import requires_vllm

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------- the candidates


def test_the_registrys_recipes_are_the_default_candidates(monkeypatch):
    """With no list, the candidates are every registered method's own recipes, read from the registry: a method
    registered in one line with a recipe is a candidate, named by its method and k, its settings under the shared
    and per-method ones; every registered method's recipes are there, and no other."""
    from eagle3nb import drafts
    from eagle3nb.drafts import PACKAGES, rules
    from eagle3nb.select.candidates import registry_candidates

    fake = ModuleType("fake_select_draft")
    fake.RULES = {"fake": drafts.MethodRules(summary="a test's drafter", block=True,
                                             recipes=({"block_size": 4, "num_speculative_tokens": 3},))}
    monkeypatch.setitem(PACKAGES, "fake", fake)
    rows = registry_candidates({"lr": 0.01}, {"fake": {"lr": 0.02, "anchors_per_seq": 8}})
    assert [(r["method"], r["num_speculative_tokens"]) for r in rows] == \
        [(m, r["num_speculative_tokens"]) for m in PACKAGES for r in rules(m).recipes]
    mine = [r for r in rows if r["method"] == "fake"]
    assert mine == [{"name": "fake k=3 (block_size=4)", "lr": 0.02, "anchors_per_seq": 8, "method": "fake",
                     "block_size": 4, "num_speculative_tokens": 3}]
    assert all(r["lr"] == 0.01 for r in rows if r["method"] != "fake")


def test_trainings_and_extractions_are_shared_where_the_recipes_allow(toy_smoke):
    """A chain drafter's recipes that differ only in k share one training (at the largest k); a block drafter's k
    is its block's, so each trains; extractions are per (layers its method reads, vocabulary): a block drafter's
    the target's whole vocabulary, a chain drafter's 02's reduced one."""
    from eagle3nb.data.head import text_config
    from eagle3nb.drafts import DEFAULT, block_methods, method_layer_ids
    from eagle3nb.select.candidates import plan
    from eagle3nb.select.params import Candidate

    block = block_methods()[0]
    tc = text_config(toy_smoke)
    cands = [Candidate(name=f"chain k{k}", method=DEFAULT, num_speculative_tokens=k) for k in (3, 5, 7)] + \
        [Candidate(name=f"block {b}", method=block, num_speculative_tokens=b - 1, block_size=b) for b in (4, 8)]
    p = plan(cands, {}, {}, tc["num_hidden_layers"], tc["vocab_size"], {"draft_vocab_size": 100})
    chain = {c.training for c in p.candidates if c.method == DEFAULT}
    assert len(chain) == 1 and p.trainings[chain.pop()].settings["num_speculative_tokens"] == 7
    assert len({c.training for c in p.candidates}) == 3
    needs = {p.trainings[c.training].need for c in p.candidates}
    assert len(needs) == 2
    by_method = {c.method: p.needs[p.trainings[c.training].need] for c in p.candidates}
    assert by_method[DEFAULT].vocab == 100 and by_method[block].vocab == tc["vocab_size"]
    assert by_method[block].layer_ids == method_layer_ids(block, tc["num_hidden_layers"])


def test_a_candidate_03_refuses_is_one_line_before_any_work(tmp_path):
    """A candidate's 03 setting that 03 would refuse stops the stage's validation in one line naming the candidate
    and the fix, as do the settings the selection owns given in train, before a sample is read."""
    from eagle3nb.drafts import block_methods
    from eagle3nb.params import ParamsError, from_dict

    block = block_methods()[0]
    bad = [({"candidates": [{"name": "too long", "method": block, "num_speculative_tokens": 9, "block_size": 8}]},
            ("'too long'", "num_speculative_tokens (9)")),
           ({"candidates": [{"name": "typo", "num_speculative_tokens": 3, "ttt_stepz": 3}]},
            ("'typo'", "did you mean 'ttt_steps'")),
           ({"train": {"max_steps": 5}}, ("max_steps", "remove them from train")),
           ({"weights": [1, 2]}, ("weights", "one weight"))]
    for values, words in bad:
        with pytest.raises(ParamsError) as e:
            from_dict("06_select", {"run_name": "x", "output_dir": str(tmp_path / "out"), **values},
                      check_paths=False)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_kimi_rehearsals_selection_is_valid_and_serves_at_04s_concurrencies():
    """params/vllm-cpu-kimi/06_select.yaml (what make rehearse runs) validates, every registry recipe checked by 03's
    schema with its MLA setting for EAGLE-3, and is measured at the concurrencies 04's file names (the run's plan
    hands them over; 06's file names none)."""
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import load_yaml, run_params

    run = ROOT / "params" / "vllm-cpu-kimi"
    P = from_dict("06_select", run_params(run, "06_select"), check_paths=False)
    assert P.engine == "vllm" and P.candidates is None
    assert P.concurrencies == load_yaml(run / "04_acceptance.yaml")["concurrency_levels"]
    assert "concurrencies" not in load_yaml(run / "06_select.yaml")


# ----------------------------------------------------------------------------------------- tau two ways, the load


def test_tau_pooled_and_per_request_mean_differ_as_their_definitions_say():
    """vLLM pools every round (a long request weighs by its rounds), SpecForge means each request's own: one long
    request accepting 1 a round and a short one accepting 4 give 2.0 pooled of 10 rounds + 2 and 3.5 per request."""
    from eagle3nb.formulas import tau_per_request_mean, tau_pooled

    accepted, rounds = [10, 8], [10, 2]
    assert tau_pooled(accepted, rounds) == pytest.approx(1 + 18 / 12)
    assert tau_per_request_mean(accepted, rounds) == pytest.approx(((1 + 1) + (1 + 4)) / 2)
    assert tau_per_request_mean([3, 5], [0, 5]) == 2.0 and tau_per_request_mean([1], [0]) is None


def test_04s_table_names_both_taus_and_the_engines_as_pooled_only():
    """04's acceptance-by-source table carries both definitions where the source has per-request data (offline:
    the held-out samples' simulated rounds; local decoding: its prompts) under names that say whose they are, and
    leaves a served endpoint's per-request cell empty, its label saying its counters are pooled only."""
    from eagle3nb.accept.report import acceptance_by_source

    metrics = {"offline": {"k": 2, "greedy": {"tau_by_k": [1.8, 2.5], "alpha_by_position": [0.8, 0.7],
                                              "simulated_acceptance_length_per_sample": 2.4}},
               "local": {"acceptance_length": 2.6, "acceptance_length_per_request": 2.9, "per_position": [0.8, 0.6]},
               "online": [{"endpoint": "vllm", "k": 2, "concurrency": 1, "acceptance_length": 2.55,
                           "metrics_engine": "vllm", "per_position": [0.8, 0.5]}]}
    table = acceptance_by_source(metrics)
    pooled, mean = "acceptance_length pooled (vLLM's)", "acceptance_length per-request mean (SpecForge's)"
    assert table[pooled].tolist() == [2.5, 2.6, 2.55]
    assert table[mean].tolist()[:2] == [2.4, 2.9] and table[mean].isna().tolist()[2]
    assert table.index[2] == "vllm (vllm counters, c=1: pooled only)"


def test_the_load_from_a_traffic_log_by_littles_law(tmp_path):
    """A gateway log of an hour at 0.5 requests/s then an hour at 3 requests/s, on a plain server that completes 1,
    1.8, 3.2 requests/s at 1, 2, 4 in flight: the first hour is served at c=1 (below the lowest rate), the second
    at c = 2 + (3 - 1.8) / (3.2 - 1.8) x 2 = 3.71, shared between c=2 and c=4 in proportion; the weights are the
    requests' shares."""
    from eagle3nb.select.load import arrivals, traffic_weights

    log = tmp_path / "gateway.jsonl"
    t0 = 1_760_000_000.0
    times = [t0 + i * 2.0 for i in range(1800)] + [t0 + 3600 + i / 3 for i in range(10800)]
    log.write_text("".join(json.dumps({"timestamp": t, "body": {"messages": [{"role": "user", "content": "hi"}]}})
                           + "\n" for t in times) + "not json\n")
    got = arrivals(log)
    assert len(got) == len(times) and got[0] == t0
    weights, info = traffic_weights(got, 60.0, {1: 1.0, 2: 1.8, 4: 3.2})
    c_busy = 2 + (3 - 1.8) / (3.2 - 1.8) * 2
    share_busy = 10800 / 12600
    assert weights[1] == pytest.approx(1 - share_busy, abs=0.01)
    assert weights[4] == pytest.approx(share_busy * (c_busy - 2) / 2, abs=0.01)
    assert weights[2] == pytest.approx(share_busy * (4 - c_busy) / 2, abs=0.01)
    assert info["mean_concurrency"] == pytest.approx((1800 * 1 + 10800 * c_busy) / 12600, abs=0.02)


# ----------------------------------------------------------------------------------------- the pick


class FakeEngine:
    """A real HTTP server speaking the OpenAI chat API and vLLM's spec-decode counters: each request takes
    max_tokens / ``rate`` seconds in its own thread (requests in flight overlap: c of them make c x rate tokens/s),
    and a speculative one adds max_tokens / tau rounds and the rest of its tokens as accepted ones."""

    def __init__(self, rate: float, tau: float | None):
        counts = {"drafts": 0.0, "accepted": 0.0}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.endswith("/models"):
                    return self.reply(json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}))
                if self.path == "/metrics":
                    text = "" if tau is None else (f"vllm:spec_decode_num_drafts_total {counts['drafts']}\n"
                                                   f"vllm:spec_decode_num_draft_tokens_total {counts['drafts'] * 3}\n"
                                                   f"vllm:spec_decode_num_accepted_tokens_total {counts['accepted']}\n")
                    return self.reply(text, "text/plain")
                return self.reply("{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = body["max_tokens"]
                time.sleep(n / rate)
                if tau is not None:
                    with lock:
                        counts["drafts"] += n / tau
                        counts["accepted"] += n - n / tau
                self.reply(json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.base_url = self.url + "/v1"

    def stop(self) -> None:
        self.server.shutdown()


def tiny_draft_folder(folder: Path, seed: int) -> Path:
    """A small random draft checkpoint (the fake engine never loads it: it is what the user points a candidate at)."""
    from tiny_drafts import tiny_draft

    from eagle3nb.drafts import of

    m = tiny_draft(seed)
    return of(m).save(m, folder, of(m).layouts[0]) and folder


def test_the_pick_follows_served_throughput_not_tau(tmp_path, monkeypatch, capsys):
    """On an engine where the candidate that accepts the most (tau 4) serves slower than the target alone (0.8x)
    and another accepting less (tau 2) serves 1.6x, the pick is the faster one, with its speedup at the load and
    why; the engine's refusal of a third is listed with the engine's own reason from its log, in the metrics,
    the table and the figure; the pick's draft is the run's draft, with its serve command. Measured through real
    HTTP and 04's benchmark: the measured ratios are the engine's within a margin."""
    import eagle3nb.select.measure as measure
    import eagle3nb.select.stage as stage
    from eagle3nb.errors import InputError
    from eagle3nb.params import from_dict
    from eagle3nb.select import report

    plain_rate = 100.0  # tokens/s of one request on the plain server (16 tokens: 160 ms, well above HTTP's own)
    engines = {"accepts-most": (0.8 * plain_rate, 4.0), "serves-most": (1.6 * plain_rate, 2.0)}
    log = tmp_path / "refused.log"
    log.write_text("(EngineCore pid=1) ERROR ... pydantic_core._pydantic_core.ValidationError: 1 validation error\n"
                   "  Value error, Model Runner V2 requires Triton. [type=value_error, input_value=...]\n")
    started = []

    def fake_start(P, draft=None, k=None, rounds=None):
        name = "plain" if draft is None else Path(draft).name
        started.append(name)
        if name == "refused":
            raise InputError(f"vllm-x exited with code 1 before it was ready: 1 validation error for VllmConfig; its "
                             f"output ({log}) ends with:\n...")
        return FakeEngine(*(engines.get(name) or (plain_rate, None)))

    monkeypatch.setattr(measure, "start", fake_start)
    monkeypatch.setattr(stage, "start", fake_start)
    names = ("accepts-most", "serves-most", "refused")
    cands = [{"name": n, "draft": str(tiny_draft_folder(tmp_path / n, i)), "num_speculative_tokens": 3}
             for i, n in enumerate(names)]
    P = from_dict("06_select", {"run_name": "pick", "model_path": "toy:smoke", "output_dir": str(tmp_path / "06"),
                                "candidates": cands, "concurrencies": [1, 2], "num_prompts": 4, "max_tokens": 16,
                                "tau_requests": 2})
    metrics = stage.run(P)
    rows = {c["name"]: c for c in metrics["candidates"]}
    assert rows["accepts-most"]["tau"]["pooled"] > rows["serves-most"]["tau"]["pooled"]  # tau would pick the other
    assert rows["accepts-most"]["tau"]["pooled"] == pytest.approx(4.0)
    assert rows["serves-most"]["tau"]["per_request_mean"] == pytest.approx(2.0)
    for name, (rate, _) in engines.items():
        for cell in rows[name]["cells"]:
            assert cell["speedup"] == pytest.approx(rate / plain_rate, rel=0.25), (name, cell)
    assert metrics["pick"]["name"] == "serves-most" and rows["serves-most"]["status"] == "picked"
    assert metrics["pick"]["why"].startswith(f"picked serves-most: {metrics['pick']['score']:.2f}x at the load")
    assert "accepts-most accepts more" in metrics["pick"]["why"]
    assert rows["refused"]["status"] == "refused" and rows["refused"]["reason"] == "Model Runner V2 requires Triton."
    assert started.count("plain") == 1  # one plain server for the whole run
    assert (tmp_path / "06" / "draft" / "config.json").read_bytes() == \
        (tmp_path / "serves-most" / "config.json").read_bytes()
    assert "--num-speculative-tokens 3" in metrics["pick"]["serve_command"]
    table = report.candidates_table(metrics)
    assert list(table.index) == list(names) and table.loc["refused", "why not served"].startswith("Model Runner V2")
    assert report.verdict_lines(metrics)[0] == metrics["pick"]["why"]
    assert (tmp_path / "06" / "served_throughput.png").stat().st_size > 0
    fig = report.plot_throughput(metrics)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == \
        ["accepts-most", "serves-most (picked)", "refused: refused", "plain (range over the pairs)"]


def test_a_method_vllm_drafts_in_one_runner_only_is_asked_before_it_trains(tmp_path, monkeypatch):
    """Before hours of training, a method the registry says vLLM drafts in one model runner only is probed: 03 trains
    one step and vLLM is started on that draft; its refusal (the reason from its log) is kept, asked once, and the
    training is not run; a method without that rule, or another engine, is not probed."""
    import eagle3nb.select.training as training
    from eagle3nb.drafts import PACKAGES, rules
    from eagle3nb.errors import InputError
    from eagle3nb.select.candidates import Training

    log = tmp_path / "vllm.log"
    log.write_text("  Value error, Model Runner V2 requires Triton. [type=value_error, input_value=...]\n")
    calls = []
    monkeypatch.setattr(training, "sub_stage", lambda stage, P, values: calls.append((stage, values["max_steps"])))

    def refuse(P, draft, k, rounds=None):
        calls.append(("start", k))
        raise InputError(f"vllm-x exited with code 1 before it was ready: ...; its output ({log}) ends with:\n...")

    monkeypatch.setattr(training, "start", refuse)
    v2 = next(m for m in PACKAGES if rules(m).v2_only)
    other = next(m for m in PACKAGES if not rules(m).v2_only)
    P = type("P", (), {"engine": "vllm"})()
    t = Training("v2", {"method": v2, "num_speculative_tokens": 8}, "need")
    for _ in range(2):
        assert training.probe(P, t, tmp_path / "data", tmp_path) == "Model Runner V2 requires Triton."
    assert calls == [("03_train", 1), ("start", 8)]
    assert training.probe(P, Training("o", {"method": other, "num_speculative_tokens": 3}, "n"), tmp_path,
                          tmp_path) is None
    P.engine = "embedded"
    assert training.probe(P, Training("e", {"method": v2, "num_speculative_tokens": 8}, "n"), tmp_path,
                          tmp_path) is None
    assert len(calls) == 2
    # the project's own serving check refusing (code that may change) is said as such and asked again next time
    from eagle3nb.drafts import ServingError

    def check_refuses(P, draft, k, rounds=None):
        calls.append(("start", k))
        raise ServingError("the draft's block does not fit k: set num_speculative_tokens")

    monkeypatch.setattr(training, "start", check_refuses)
    P.engine = "vllm"
    for _ in range(2):
        why = training.probe(P, Training("s", {"method": v2, "num_speculative_tokens": 8}, "n"), tmp_path, tmp_path)
        assert why.startswith("refused before the engine started, by eagle3nb's serving check: the draft's block")
    assert calls[2:] == [("03_train", 1), ("start", 8)] * 2


# ----------------------------------------------------------------------------------------- end to end, resumed


# the smoke selection: built in the background as the session starts (tests/background.py)
register("smoke_selection", "smoke_selection")


@pytest.fixture(scope="module")
def smoke_selection(background, tmp_path_factory) -> dict:
    """The smoke selection on the embedded engine, killed -9 once its first cell landed, then resumed by ``eagle3nb
    run --stages 06`` (tests/background.py's ``smoke_selection``): ``{"out", "first", "bytes", "log", "metrics"}``."""
    return background.result("smoke_selection", tmp_path_factory.mktemp("select"))


def test_the_smoke_selection_end_to_end_resumes_after_kill9_without_remeasuring(smoke_selection):
    """Killed -9 mid-serving and resumed by the runner: the cell that had landed is the same file, reused (the
    notebook says so), every other cell measured; every candidate trained (two sharing one training), served at
    every concurrency with both acceptance lengths, the cost of its training; the pick is one of them (or plain),
    the run's draft its copy; the report opens with the pick."""
    m, out = smoke_selection["metrics"], smoke_selection["out"]
    assert smoke_selection["first"].read_bytes() == smoke_selection["bytes"]
    assert f"{smoke_selection['first'].name}: reusing the finished result" in smoke_selection["log"]
    rows = {c["name"]: c for c in m["candidates"]}
    assert list(rows) == ["chain k3", "chain k5", "block 8"]
    assert rows["chain k3"]["training"] == rows["chain k5"]["training"] != rows["block 8"]["training"]
    assert rows["chain k3"]["shares_training_with"] == ["chain k5"]
    for r in rows.values():
        assert r["status"] in ("picked", "served"), r
        assert [c["concurrency"] for c in r["cells"]] == [1, 4] and all(c["speedup"] > 0 for c in r["cells"])
        assert r["tau"]["pooled"] > 1 and r["tau"]["per_request_mean"] > 1 and r["tau"]["requests"] == 4
        assert r["cost"]["steps"] == 30 and r["cost"]["wall_s"] > 0 and r["cost"]["tokens_per_s"] > 0
    assert sorted(len(m["plain"][c]["output_tokens_per_s"]) for c in ("1", "4")) == [3, 3]  # one pair per candidate
    picked = m["pick"]["name"]
    assert picked is None or (rows[picked]["status"] == "picked" and m["pick"]["score"] == max(
        r["score"] for r in rows.values()))
    if picked is not None:  # the run's draft is the pick's export
        trained = out / "train" / rows[picked]["training"] / "draft" / "model.safetensors"
        assert (out / "draft" / "model.safetensors").read_bytes() == trained.read_bytes()
    html = (out.parent / "06_select.html").read_text()
    assert m["pick"]["why"].split(":")[0] in html and (out / "served_throughput.png").exists()


@requires_vllm()
def test_the_real_vllm_serves_a_candidate_with_its_rounds_and_names_why_it_refuses_another(smoke_selection, tmp_path,
                                                                                             toy_smoke):
    """On the real vLLM (CPU build): the trained chain draft served at k=3 beside the plain target, each cell with
    vLLM's own counters and the round's cost in plain steps from both servers' rounds profile (its three parts
    adding up); a block drafter vLLM's CPU build refuses (its V2 runner needs Triton) listed with vLLM's words from
    its log, in the table and the metrics."""
    import torch
    from safetensors.torch import load_file

    from eagle3nb.drafts import DEFAULT, rules
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.params import from_dict
    from eagle3nb.select import report
    from eagle3nb.stage_cli import run_stage

    v2 = "dspark"  # a block drafter with a Markov head (markov_rank > 0), drafted by vLLM's V2 runner only
    assert rules(v2).v2_only
    torch.manual_seed(0)
    block = DFlashDraft(from_target(json.loads((toy_smoke / "config.json").read_text()), num_layers=2, block_size=8,
                                    markov_rank=8))
    weights = load_file(toy_smoke / "model.safetensors")
    block.set_target(weights["model.embed_tokens.weight"].float(),
                     weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float())
    refused = save_draft(block, tmp_path / v2, "vllm")
    chain = next(c for c in smoke_selection["metrics"]["candidates"] if c["method"] == DEFAULT and c["k"] == 3)
    P = from_dict("06_select", {"run_name": "vllm", "model_path": "toy:smoke", "engine": "vllm",
                                "output_dir": str(tmp_path / "06"), "concurrencies": [1, 2], "num_prompts": 8,
                                "max_tokens": 32, "tau_requests": 4,
                                "candidates": [
                                    {"name": "chain k3", "draft": chain["draft"], "num_speculative_tokens": 3},
                                    {"name": v2, "draft": str(refused), "num_speculative_tokens": 8}]})
    m = run_stage(P)
    rows = {c["name"]: c for c in m["candidates"]}
    assert rows[v2]["status"] == "refused" and "Triton" in rows[v2]["reason"]
    served = rows["chain k3"]
    assert served["status"] in ("picked", "served") and served["tau"]["pooled"] > 1
    for cell in served["cells"]:
        assert cell["candidate"]["acceptance_length"] > 1
        r = cell["round"]
        assert r["in_plain_steps"] > 1 and r["verify_forward"] > 0 and r["draft_forwards"] > 0
        assert r["verify_forward"] + r["draft_forwards"] + r["bookkeeping"] == pytest.approx(r["in_plain_steps"])
    assert (tmp_path / "06" / "rounds" / "plain.jsonl").stat().st_size > 0
    table = report.candidates_table(m)
    assert list(table.index) == ["chain k3", v2] and "Triton" in table.loc[v2, "why not served"]
