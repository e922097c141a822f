"""01_synth against the embedded server over real HTTP: both reasoning field names and inline think tags,
with and without returned token ids (the two streams agree), thinking on and off, the probe, and a
kill -9 in the middle of a run followed by a resume (compared with an uninterrupted run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from eagle3nb.data.samples import load_samples, sample_files
from eagle3nb.data.stream import Template, build
from eagle3nb.synth.params import SynthParams
from eagle3nb.synth.probe import ask
from eagle3nb.synth.stage import run
from eagle3nb.tokens import IM_END, THINK_END, THINK_START

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def servers(toy_smoke):
    """Three embedded servers, started side by side: vLLM's new field, the old field, no reasoning parser."""
    from eagle3nb.launch import start_server

    specs = {"reasoning": {}, "reasoning_content": {"reasoning_field": "reasoning_content"},
             "inline": {"reasoning_parser": False}}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {k: pool.submit(start_server, toy_smoke, **kw) for k, kw in specs.items()}
    handles = {}
    try:
        for k, f in futures.items():
            handles[k] = f.result()
        yield {k: h.url for k, h in handles.items()}
    finally:
        for h in handles.values():
            h.stop()


@pytest.fixture(scope="module")
def tpl(toy_smoke):
    return Template(toy_smoke, thinking=True)


def params(tmp_path: Path, url: str, model: Path, **kw) -> SynthParams:
    """Small greedy runs; model_path is the served build itself, so client and server share one tokenizer."""
    base = dict(model_path=str(model), output_dir=str(tmp_path / "out"), prompts="toy:train", max_samples=6,
                max_completion_tokens=64, concurrency=6, vllm_url=url, temperature=0.0, retry_backoff_s=0.05)
    return SynthParams(**{**base, **kw})


def split(row: dict) -> tuple[list[int], list[int]]:
    n = row["loss_mask"].count(0)
    return row["input_ids"][:n], row["input_ids"][n:]


def well_formed(completion: list[int], tpl: Template) -> bool:
    """<think> ... </think> ... <|im_end|>, once each: text can describe it exactly."""
    start, end = tpl.think_ids
    return bool(completion) and completion[0] == start and completion.count(end) == 1 and completion[-1] == tpl.end_id


def test_reasoning_content_field_with_server_ids(tmp_path, servers, tpl, toy_smoke):
    m = run(params(tmp_path, servers["reasoning_content"], toy_smoke, max_samples=8))
    rows = load_samples(tmp_path / "out", statuses=None)
    assert len(rows) == 8 and m["counts"]["error"] == 0
    formed = 0
    for r in rows:
        assert r["token_source"] == "server" and r["reasoning"] is not None
        _, completion = split(r)
        if r["finish_reason"] == "stop" and well_formed(completion, tpl):
            formed += 1
            # the two streams agree: the template rendering of reasoning_content + content is the same text the
            # server's ids spell; ids themselves can differ only where sampling chose a non-canonical split
            rendered = build(tpl, r["messages"], r["reasoning"], r["content"], "stop", None, None)["input_ids"]
            assert tpl.decode(completion) == tpl.decode(rendered[len(split(r)[0]):])
            assert tpl.decode(completion) == f"{THINK_START}{r['reasoning']}{THINK_END}{r['content'] or ''}{IM_END}"
            assert r["ids_match"] is (rendered == r["input_ids"])
        elif tpl.think_ids[1] not in completion:
            assert r["ids_match"] is False  # the template would invent a </think> the model never wrote
    assert formed >= 1, ("the toy target wrote no well-formed <think>..</think>..<|im_end|> answer: "
                         "its training regressed")
    ok = [r for r in rows if r["status"] == "ok"]
    assert m["ids_compared"] == len(ok) and m["ids_mismatch"] == sum(r["ids_match"] is False for r in ok)


def test_inline_think_tags_without_server_ids(tmp_path, servers, tpl, toy_smoke):
    run(params(tmp_path, servers["inline"], toy_smoke, return_token_ids=False, max_samples=8))
    rows = load_samples(tmp_path / "out", statuses=None)
    assert len(rows) == 8 and all(r["token_source"] == "template" and r["ids_match"] is None for r in rows)
    split_rows = [r for r in rows if r["reasoning"] is not None]
    assert split_rows  # reasoning recovered from <think>...</think> inside content
    for r in split_rows:
        assert THINK_END not in r["reasoning"]  # split at the first </think>, as vLLM's kimi_k2 parser does
        if r["status"] == "ok":
            assert tpl.decode(split(r)[1]) == f"{THINK_START}{r['reasoning']}{THINK_END}{r['content'] or ''}{IM_END}"


def test_thinking_off_and_probe(tmp_path, servers, tpl, toy_smoke):
    m = run(params(tmp_path, servers["reasoning"], toy_smoke, thinking=False, max_samples=4))
    assert m["counts"]["ok"] + m["counts"]["truncated"] == 4
    for r in load_samples(tmp_path / "out"):
        prompt, completion = split(r)
        assert r["reasoning"] is None and r["thinking"] is False
        assert tpl.decode(prompt).endswith(f"{THINK_START}{THINK_END}") and tpl.think_ids[0] not in completion

    p = ask(params(tmp_path, servers["reasoning"], toy_smoke), "What is 2+2?")
    assert set(p["raw"]) == {"reasoning", "reasoning_content", "content"} and p["raw"]["reasoning_content"] is None
    assert p["raw"]["reasoning"] is not None and p["reasoning_from"] == "reasoning"
    assert p["token_source"] == "server"
    assert p["prompt"].endswith("<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
                                "<|im_assistant|>assistant<|im_middle|>")
    assert p["completion"].startswith(THINK_START) and THINK_START not in p["naive_concatenation"]


def test_kill9_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path, servers, toy_smoke):
    """Greedy, so the killed-and-resumed run must hold exactly what one uninterrupted run holds: every id once,
    each with the same token stream and loss mask (a resume that paired answers with the wrong prompt, or
    re-asked with other settings, would still give unique ids)."""
    out = tmp_path / "out"
    cfg = {"run_name": "killtest", "model_path": str(toy_smoke), "output_dir": str(out), "prompts": "toy:train",
           "max_samples": 12, "max_completion_tokens": 32, "concurrency": 3, "vllm_url": servers["reasoning"],
           "temperature": 0.0}
    yml = tmp_path / "01_synth.yaml"
    yml.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.synth", str(yml)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    lines = 0
    while time.time() < deadline and proc.poll() is None:
        lines = sum(f.read_bytes().count(b"\n") for f in sample_files(out))
        if lines >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 2 <= lines < 12

    run(SynthParams(**cfg))
    ids = [json.loads(line)["id"] for f in sample_files(out) for line in f.read_text().splitlines()
           if line.endswith("}")]
    assert len(ids) == len(set(ids)) == 12  # every id once: none lost, none written twice
    assert json.loads((out / "progress.json").read_text())["state"] == "done"
    run(SynthParams(**{**cfg, "output_dir": str(tmp_path / "reference")}))
    resumed = {r["id"]: (r["input_ids"], r["loss_mask"]) for r in load_samples(out, statuses=None)}
    reference = {r["id"]: (r["input_ids"], r["loss_mask"]) for r in load_samples(tmp_path / "reference", statuses=None)}
    assert resumed == reference
