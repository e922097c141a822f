"""Conversations answered turn by turn (01's ``multi_turn: every``) against the embedded server over real HTTP:
each turn's stream is the template's rendering of the conversation so far, equal to the server's ids for that
turn; later turns send the target's own earlier answers; a kill -9 mid-conversation resumes exactly; tool results
are replayed against the target's own calls; 03's split keeps a conversation's turns together and 04 reports
first and later turns apart. The real vLLM's run of the same shape is in tests/test_vllm.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.samples import load_samples, sample_files
from eagle3nb.data.split import split_holdout
from eagle3nb.data.stream import Template
from eagle3nb.data.turns import conversation_of, parse_turn, replay, turn_id, turn_inputs
from eagle3nb.synth.params import SynthParams
from eagle3nb.synth.session import SynthError
from eagle3nb.synth.stage import run

from conversations import check_turns, mt_bench

ROOT = Path(__file__).resolve().parents[1]


def params(tmp: Path, url: str, model: Path, prompts: Path, **kw) -> SynthParams:
    base = dict(model_path=str(model), output_dir=str(tmp / "01"), prompts=str(prompts), max_samples=4,
                max_completion_tokens=48, concurrency=3, vllm_url=url, temperature=0.0, retry_backoff_s=0.05,
                multi_turn="every")
    return SynthParams(**{**base, **kw})


def test_turn_inputs_cut_where_the_assistant_speaks():
    u = [{"role": "user", "content": f"u{i}"} for i in range(3)]
    a = {"role": "assistant", "content": "dataset's answer"}
    sys_msg = {"role": "system", "content": "be brief"}
    tool = {"role": "tool", "content": "42", "tool_call_id": "dataset-id"}
    assert turn_inputs([u[0], u[1]]) == [[u[0]], [u[1]]]  # MT-Bench: every user turn is answered
    assert turn_inputs([sys_msg, u[0], a, u[1], a]) == [[sys_msg, u[0]], [u[1]]]  # the dataset's answers dropped
    assert turn_inputs([u[0], a, tool, a, u[2], sys_msg]) == [[u[0]], [tool], [u[2], sys_msg]]
    assert turn_inputs([u[0], a, sys_msg]) == [[u[0]]]  # nothing answers a closing system message
    calls = [{"id": "call-7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert replay([tool], calls) == [{**tool, "tool_call_id": "call-7"}]  # the target's own call id
    assert replay([tool], None) is None and replay([u[0]], None) == [u[0]]
    assert parse_turn(turn_id("a/b", 12)) == ("a/b", 12) and parse_turn("a/b") is None
    assert conversation_of("q/turn-3") == "q" and conversation_of("plain") == "plain"


def test_every_turn_answered_after_the_targets_own_answers(tmp_path, embedded, toy_smoke):
    prompts = mt_bench(tmp_path / "question.jsonl", 3)
    metrics = run(params(tmp_path, embedded.url, toy_smoke, prompts))
    records = load_samples(tmp_path / "01", statuses=None)
    check_turns(records, Template(toy_smoke, thinking=True), 3)
    assert metrics["turns"] == {"conversations": 3, "in_prompts": 6, "multi_turn_conversations": 3,
                                "answered_ok": 6, "first_ok": 3, "untrained": 0}
    assert {r["category"] for r in records} == {"writing", "math"}


def test_last_refuses_unanswered_turns_and_counts_untrained_history(tmp_path, embedded, toy_smoke):
    prompts = mt_bench(tmp_path / "question.jsonl", 2)
    with pytest.raises(SynthError, match="multi_turn: every"):
        run(params(tmp_path, embedded.url, toy_smoke, prompts, multi_turn="last"))
    assert not sample_files(tmp_path / "01")  # refused before any request
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                          {"role": "user", "content": f"What is {i} + 1?"}]} for i in range(2)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = run(params(tmp_path, embedded.url, toy_smoke, tmp_path / "chat.jsonl", multi_turn="last",
                         output_dir=str(tmp_path / "last")))
    assert metrics["turns"]["in_prompts"] == 4 and metrics["turns"]["untrained"] == 4 - metrics["counts"]["ok"]
    assert {r["turn"] for r in load_samples(tmp_path / "last")} == {2}


def test_tool_results_replay_against_the_targets_calls(tmp_path, embedded, toy_smoke):
    """The toy never calls a tool, so a dataset tool result it did not ask for ends the conversation there,
    counted with the reason; tool definitions go to the server and into the template's rendering."""
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {}}}}]
    row = {"id": "t", "tools": tools, "messages": [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "d1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "d1", "content": "5"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 more?"}]}
    (tmp_path / "tools.jsonl").write_text(json.dumps(row) + "\n")
    assert load_prompts(str(tmp_path / "tools.jsonl"))[0]["tools"] == tools
    metrics = run(params(tmp_path, embedded.url, toy_smoke, tmp_path / "tools.jsonl"))
    records = load_samples(tmp_path / "01", statuses=None)
    assert [r["id"] for r in records] == ["t/turn-1"] and records[0]["tools"] == tools
    assert records[0]["tool_calls"] is None and metrics["turns_cut"] == {
        "the dataset replays tool results the target did not call for": 2}
    assert metrics["missing"] == 0


def test_kill9_mid_conversation_resumes_exactly(tmp_path, embedded, toy_smoke):
    """One conversation at a time, killed once a conversation's first turn is on disk and its second is not:
    the resumed run asks the second turn after the stored first answer and holds exactly what an uninterrupted
    run holds."""
    prompts = mt_bench(tmp_path / "question.jsonl", 4)
    out = tmp_path / "killed"
    cfg = {"run_name": "mt", "model_path": str(toy_smoke), "output_dir": str(out), "prompts": str(prompts),
           "max_samples": 4, "max_completion_tokens": 96, "concurrency": 1, "vllm_url": embedded.url,
           "temperature": 0.0, "multi_turn": "every"}
    (tmp_path / "01_synth.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.synth", str(tmp_path / "01_synth.yaml")], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if sum(f.read_bytes().count(b"\n") for f in sample_files(out)) % 2 == 1:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    on_disk = [json.loads(line)["id"] for f in sample_files(out) for line in f.read_text().splitlines()
               if line.endswith("}")]
    half = {conversation_of(i) for i in on_disk} - {conversation_of(i) for i in on_disk if i.endswith("/turn-2")}
    assert half, f"no conversation was half done when killed: {on_disk}"

    run(SynthParams(**cfg))
    ids = [json.loads(line)["id"] for f in sample_files(out) for line in f.read_text().splitlines()
           if line.endswith("}")]
    assert len(ids) == len(set(ids)) == 8  # every turn once: none lost, none asked twice
    run(SynthParams(**{**cfg, "output_dir": str(tmp_path / "reference")}))
    resumed = {r["id"]: (r["messages"], r["input_ids"], r["loss_mask"]) for r in load_samples(out)}
    reference = {r["id"]: (r["messages"], r["input_ids"], r["loss_mask"]) for r in load_samples(tmp_path / "reference")}
    assert resumed == reference


def test_split_keeps_a_conversations_turns_together():
    ids = [turn_id(f"c{i}", k) for i in range(40) for k in (1, 2, 3)] + [f"single{i}" for i in range(20)]
    train, held = split_holdout(ids, 0.1)
    assert sorted(train + held) == list(range(len(ids))) and len(held) >= round(0.1 * len(ids))
    held_convs = {conversation_of(ids[i]) for i in held}
    assert held_convs.isdisjoint({conversation_of(ids[i]) for i in train})
    plain = [f"single{i}" for i in range(20)]  # ids without turns split as they always did: by their own hash
    by_hash = sorted(range(20), key=lambda i: hashlib.sha256(plain[i].encode()).hexdigest())
    assert split_holdout(plain, 0.25)[1] == sorted(by_hash[:5])
