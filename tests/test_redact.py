"""Secrets in served traffic (eagle3nb.data.redact) as 05 reads and writes it: every kind of tests/secret_corpus.py
caught wherever it sits in a request (message text, system prompt, tool-call arguments, tool result, gateway tag),
counted by kind, the text around it kept, and none of them in any file 05 writes. The secrets are fakes built in the
corpus's code; the stage's heavy steps (01-03's runs, decoding) are stand-ins here, its own steps run as written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from secret_corpus import Case, corpus

from eagle3nb.data.redact import PATTERNS, marker, redact, redact_value
from eagle3nb.data.traffic import read_traffic

CASES = corpus(seed=0)
TAGGED = {i for i, c in enumerate(CASES) if i % 4 == 0 and "\n" not in c.template}


def test_every_kind_is_caught_counted_and_the_text_around_it_kept() -> None:
    """Each case, plain and as a JSON string (a tool call's arguments), comes out as its sentence with only the
    secret replaced, counted once as its kind; every pattern of the table is exercised, fresh fakes per seed."""
    assert len({c.kind for c in CASES}) >= 20 and {c.kind for c in CASES} == set(PATTERNS)
    for seed in range(5):
        for c in corpus(seed):
            for text, want in ((c.text, c.redacted), (json.dumps({"note": c.text}), json.dumps({"note": c.redacted}))):
                out, found = redact(text)
                assert out == want and found == {c.kind: 1}, (c.kind, text, out)


BENIGN = [
    "The key: understand recursion before you start.",
    "Set max_tokens=4096 and temperature=0.7 in the request.",
    "Token: end of sequence",
    "the author: Jane Austen",
    "Your password must be at least 8 characters long.",
    'a dict like {"key": "Enter", "token_count": 12}',
    "sort by key=lambda x: x[1]",
    "The bearer of bad news arrived at the internationalization meeting.",
    "sha256 of the file is 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "request id 123e4567-e89b-12d3-a456-426614174000",
    "https://user@example.com/path and http://localhost:8000/v1/chat/completions",
    "ssh://git@github.com:22/acme/app.git",
    "def tokenize(text): return text.split()",
    "x = a_key + b_token; y = tokens[-1]; monkey=banana",
    "Use the access token from the settings page.",
]


@pytest.mark.parametrize("text", BENIGN)
def test_ordinary_text_is_left_alone(text: str) -> None:
    """Credential words in prose and code, hashes, ids and URLs without a password stay as written."""
    assert redact(text) == (text, {})


def test_long_runs_of_text_cost_linear_time() -> None:
    """Dashed, dotted and underscored runs with no space (minified code, base64url blobs) and repeated credential
    words: unbounded name or scheme patterns took ~150 s on 40 kB of "a-" (quadratic); bounded, well under a
    second each on two busy cores, so 10 s is a margin, not a measurement."""
    import time

    for text in ("a-" * 20_000, "x." * 20_000, "key_" * 10_000, "aws " * 10_000, "https://u:" * 4_000):
        start = time.perf_counter()
        redact(text)
        assert time.perf_counter() - start < 10, text[:8]


def test_values_under_credential_keys() -> None:
    """A tool call's arguments as an object: a password under its key goes whatever it looks like, another
    credential when it looks secret, a provider's key as the provider's; other keys and plain words stay."""
    pat = "gh" + "p_" + "a1B2" * 9
    value = {"password": "hunter2", "api_key": "x9Fq2LmZ81", "key": "Enter", "max_tokens": "4096",
             "nested": [{"auth_token": pat, "city": "Paris"}]}
    out, found = redact_value(value)
    assert out == {"password": marker("password"), "api_key": marker("credential"), "key": "Enter",
                   "max_tokens": "4096", "nested": [{"auth_token": marker("github"), "city": "Paris"}]}
    assert found == {"password": 1, "credential": 1, "github": 1}


def _request(i: int, text: str) -> dict:
    """One chat request holding ``text`` in its system prompt, the user's turn, an assistant's tool-call arguments
    and the tool's result."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "note", "arguments": json.dumps({"note": text})}}
    return {"model": "m", "messages": [
        {"role": "system", "content": text},
        {"role": "user", "content": f"Request {i}: {text}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": text},
        {"role": "user", "content": "and now?"}]}


def _log(folder: Path, cases: list[Case]) -> Path:
    """A gateway's JSONL log: one request per case, some of them with the case's text as their gateway tag (the
    group with ``group_by: [tag]``); keys in the gateway's own metadata too."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "gateway.jsonl"
    log.write_text("".join(json.dumps({"body": _request(i, c.text), "tags": [c.text if i in TAGGED else "team-a"],
                                       "metadata": {"user_key": c.secret}}) + "\n" for i, c in enumerate(cases)))
    return log


def _expected() -> tuple[Counter, set[str]]:
    """Each case counted four times in its request and once more where it is the tag; the groups, tags redacted."""
    want = Counter()
    for i, c in enumerate(CASES):
        want[c.kind] += 4 + (i in TAGGED)
    return want, {CASES[i].redacted for i in TAGGED} | {"team-a"}


def _leaks(text: str) -> list[str]:
    return [c.kind for c in CASES if c.secret in text]


def test_read_traffic_keeps_no_secret_and_counts_each(tmp_path: Path) -> None:
    """Every secret, wherever it sits in a request or its tags, is out of the kept rows and the group names,
    counted by kind, and each message reads as sent with only its secrets replaced."""
    t = read_traffic(_log(tmp_path, CASES), per_group=len(CASES), group_by=["tag"])
    want, groups = _expected()
    assert t.requests == len(t.rows) == len(CASES) and not t.dropped
    assert t.redacted == want and set(t.groups) == groups
    assert _leaks(json.dumps(t.rows) + json.dumps(t.shares())) == []
    by_request = {int(r["messages"][1]["content"].split(":")[0].removeprefix("Request ")): r for r in t.rows}
    for i, c in enumerate(CASES):
        m = by_request[i]["messages"]
        assert m[0]["content"] == m[3]["content"] == c.redacted and m[1]["content"] == f"Request {i}: {c.redacted}"
        assert m[2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"note": c.redacted})
        assert by_request[i]["group"] == (c.redacted if i in TAGGED else "team-a")


def test_nothing_05_writes_holds_a_secret(tmp_path: Path, monkeypatch, capsys) -> None:
    """05's run(P) on that log, grouped by tag, to the end: its files (metrics, the prompts 01 answers, the shipped
    draft's folder), its log, its report's lines and tables and its figure hold none of the secrets, and its
    metrics count each by kind. The target's decoding and 01-03's runs are stand-ins (acceptance numbers; 01 keeps
    the prompts it was given, as its records do)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle3nb.params import from_dict
    from eagle3nb.refresh import report, stage, substages

    class Measure:
        def __init__(self, P, rows: list[dict]):
            self.rows = rows

        def __call__(self, draft: Path, path: Path) -> dict[str, list[float]]:
            gain = 0.0 if draft.name == "draft" and draft.parent.name == "current" else 0.5
            out: dict[str, list[float]] = {}
            for j, r in enumerate(self.rows):
                out.setdefault(r["group"], []).append(2.0 + gain + 0.01 * (j % 3))
            path.write_text(json.dumps({"result": out}))
            return out

    def sub_stage(name: str, P, values: dict) -> Path:
        folder = Path(values["output_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        if "prompts" in values:
            (folder / "samples.jsonl").write_text(Path(values["prompts"]).read_text())
        if name == "03_train":
            (folder / "draft").mkdir(exist_ok=True)
            (folder / "draft" / "config.json").write_text(json.dumps({"draft_vocab_size": 8}))
        return folder

    monkeypatch.setattr(stage, "Measure", Measure)
    monkeypatch.setattr(stage, "sub_stage", sub_stage)  # 03, called by the stage itself
    monkeypatch.setattr(substages, "sub_stage", sub_stage)  # 01 and 02, through answer and extract
    monkeypatch.setattr(stage, "check_answers", lambda P, synth_dir: 1)  # the stand-in's records are its prompts
    monkeypatch.setattr(stage, "mix", lambda synth, source, n, seed, dest: (synth, 0))
    current = tmp_path / "current" / "draft"
    current.mkdir(parents=True)
    (current / "config.json").write_text(json.dumps({"draft_vocab_size": 8}))
    out = tmp_path / "05_refresh"
    P = from_dict("05_refresh", {"run_name": "redact-test", "traffic": str(_log(tmp_path / "logs", CASES)),
                                 "group_by": ["tag"], "per_group": 8, "budget": 8, "draft_dir": str(current),
                                 "synth_dir": str(tmp_path / "synth"), "cost_ratio": 0.1, "overhead": 0.1,
                                 "seeds": [0], "output_dir": str(out)})
    m = stage.run(P)
    log = capsys.readouterr().out
    want, groups = _expected()
    assert m["traffic"]["redacted"] == want and set(m["traffic"]["groups"]) == groups
    assert json.loads((out / "metrics.json").read_text())["traffic"]["redacted"] == want
    # the report as the notebook renders it: verdict, tables, figure (text kept as text in the SVG, to be searched)
    matplotlib.rcParams["svg.fonttype"] = "none"
    fig = report.plot_gate(m)
    fig.savefig(tmp_path / "gate.svg")
    plt.close(fig)
    rendered = "\n".join([*report.verdict_lines(m), report.gate_table(m).to_string(),
                          report.weak_table(m).to_string(), (tmp_path / "gate.svg").read_text()])
    assert "[REDACTED:" in rendered and "[REDACTED:" in (out / "refresh-prompts.jsonl").read_text()
    written = sorted(p for p in out.rglob("*") if p.is_file())
    assert {"metrics.json", "refresh-prompts.jsonl", "samples.jsonl"} <= {p.name for p in written}
    for where, text in [("log", log), ("report", rendered), *((str(p), p.read_text()) for p in written)]:
        assert _leaks(text) == [], where
