"""Secrets in served traffic (eagle3nb.data.redact) as 05 reads and writes it: every kind of testkit/secret_corpus.py
caught wherever it sits in a request (message text, system prompt, tool-call arguments, tool result, gateway tag),
split across content parts or escaped in a tool call's JSON, counted by kind, the text around it kept, and none of
them in any file 05 writes; ordinary text that only looks close to a secret left alone. The secrets are fakes built
in the corpus's code; the stage's heavy steps (01-03's runs, decoding) are stand-ins here, its own steps run as
written."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from eagle3nb.data.redact import KINDS, marker, redact, redact_value
from eagle3nb.data.traffic import read_traffic
from testkit.secret_corpus import ORDINARY, Case, corpus

CASES = corpus(seed=0)
TAGGED = {i for i, c in enumerate(CASES) if i % 4 == 0 and "\n" not in c.template}
# a tenant's random id as the gateway's tag (one request in four)
TENANTS = {i: f"tenant-{hashlib.sha1(str(i).encode()).hexdigest()[:10]}" for i in range(len(CASES)) if i % 4 == 1}


def test_every_kind_is_caught_counted_and_the_text_around_it_kept() -> None:
    """Each case, plain and as a JSON string (a tool call's arguments), comes out as its sentence with only the
    secret replaced, counted once as its kind; every rule of the table is exercised, fresh fakes per seed."""
    assert len({c.kind for c in CASES}) >= 40 and {c.kind for c in CASES} == set(KINDS)
    for seed in range(5):
        for c in corpus(seed):
            for text, want in ((c.text, c.redacted), (json.dumps({"note": c.text}), json.dumps({"note": c.redacted}))):
                out, found = redact(text)
                assert out == want and found == {c.kind: 1}, (c.kind, text, out)
                assert redact(out) == (out, {}), c.kind  # a marker is never taken for a secret again


NAMES = ["credentials: {v}", "Passphrase = '{v}'", "pwd={v}", "apikey: {v}", "x-auth-token: {v}", "CLIENT_SECRET={v}",
         "refreshToken: {v}", "my.private.key = {v}", "Authorization: token {v}", "AccessKey={v}", "secret-key {v}",
         "the passcode is {v}", "- name: GH_TOKEN\n  value: {v}", "bearer {v}"]


def test_hints_only_skip_work(monkeypatch) -> None:
    """A rule is tried only when one of its hint strings is in the text: with every rule tried on every text, the
    corpus, the ordinary texts and the names a credential goes by come out the same."""
    import eagle3nb.data.redact as R

    value = "x9Fq2LmZ81Kd7Qw3Er5Ty1Ui"
    texts = [c.text for seed in range(3) for c in corpus(seed)] + ORDINARY + [n.format(v=value) for n in NAMES]
    hinted = [redact(t) for t in texts]
    assert all(out[1] for out in hinted[-len(NAMES):]), [t for t, o in zip(NAMES, hinted[-len(NAMES):]) if not o[1]]
    monkeypatch.setattr(R, "_COMPILED", [R._Compiled(c.rule, c.regex, c.groups, frozenset()) for c in R._COMPILED])
    assert [redact(t) for t in texts] == hinted


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_is_left_alone(text: str) -> None:
    """Credential words in prose and code, placeholders, paths, hashes, ids, UUIDs, encodings and URLs without a
    password stay as written (the trade-off: testkit/secret_corpus.py's ORDINARY)."""
    assert redact(text) == (text, {})


def test_long_runs_of_text_cost_linear_time() -> None:
    """Dashed, dotted, underscored and camelCase runs with no space (minified code, base64url blobs), repeated
    credential words and prose forms: unbounded name or scheme patterns took ~150 s on 40 kB of "a-" (quadratic);
    bounded, well under a second each on two busy cores, so 10 s is a margin, not a measurement."""
    for text in ("a-" * 20_000, "x." * 20_000, "key_" * 10_000, "aws " * 10_000, "https://u:" * 4_000,
                 "aB" * 20_000, "A" * 40_000, "password is " * 4_000, "name: key\n value: " * 2_000):
        start = time.perf_counter()
        redact(text)
        assert time.perf_counter() - start < 10, text[:8]


def test_values_under_credential_keys() -> None:
    """A tool call's arguments as an object: a password under its key goes whatever it looks like, another
    credential when it looks secret, camelCase names and Kubernetes entries alike; the name still counts after
    another rule took part of the value (both counted); counts, limits, placeholders and plain words stay."""
    pat, akia = "gh" + "p_" + "a1B2" * 9, "AK" + "IA" + "Q7ZKX3V9W2M4P8R6"
    value = {"password": "hunter2", "api_key": "x9Fq2LmZ81", "key": "Enter", "max_tokens": "4096",
             "nested": [{"auth_token": pat, "city": "Paris"}],
             "dbPassword": 839201, "sessionToken": "Zq81xT0vLm4cNw27", "accountKey": "p4Hs9Kd0Lq2Wm7Xc",
             "env": [{"name": "DB_PASSWORD", "value": "s3cret!"}, {"name": "LOG_LEVEL", "value": "debug"}],
             "Password": f"Tr0ub4dor&3 {akia}", "token_count": 12345678, "sortKey": "item-2024-06",
             "apiKey": "${API_KEY}"}
    out, found = redact_value(value)
    assert out == {"password": marker("password"), "api_key": marker("credential"), "key": "Enter",
                   "max_tokens": "4096", "nested": [{"auth_token": marker("github"), "city": "Paris"}],
                   "dbPassword": marker("password"), "sessionToken": marker("credential"),
                   "accountKey": marker("credential"),
                   "env": [{"name": "DB_PASSWORD", "value": marker("password")}, {"name": "LOG_LEVEL",
                                                                                  "value": "debug"}],
                   "Password": marker("password"), "token_count": 12345678, "sortKey": "item-2024-06",
                   "apiKey": "${API_KEY}"}
    assert found == {"password": 4, "credential": 3, "github": 1, "aws_access_key_id": 1}
    # in text the same value goes whole too, the provider's key counted before it
    text = f'{{"password": "Tr0ub4dor&3 {akia}"}}'
    assert redact(text) == (f'{{"password": "{marker("password")}"}}', {"aws_access_key_id": 1, "password": 1})


def _split(text: str, secret: str, at: int) -> list[dict]:
    """``text`` as OpenAI content parts cut ``at`` characters into its secret (0: right before it)."""
    cut = text.index(secret) + at
    return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]


def _arguments(text: str, secret: str) -> str:
    """``{"note": text}`` as a tool call's JSON arguments, the secret's first character written as a \\u escape (as
    some clients write them), so only the parsed arguments show the secret whole."""
    args = json.dumps({"note": text})
    first = json.dumps(secret)[1:-1]
    return args.replace(first, f"\\u{ord(secret[0]):04x}" + first[1:], 1)


def _request(i: int, c: Case) -> dict:
    """One chat request holding the case's text in its system prompt (content parts cut right before the secret),
    the user's turn (cut in the middle of the secret), an assistant's tool-call arguments (escaped) and the tool's
    result (cut three characters into the secret)."""
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "note",
                                                                "arguments": _arguments(c.text, c.secret)}}
    return {"model": "m", "messages": [
        {"role": "system", "content": _split(c.text, c.secret, 0)},
        {"role": "user", "content": _split(f"Request {i}: {c.text}", c.secret, len(c.secret) // 2)},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": _split(c.text, c.secret, 3)},
        {"role": "user", "content": "and now?"}]}


def _log(folder: Path, cases: list[Case]) -> Path:
    """A gateway's JSONL log: one request per case, some of them with the case's text as their gateway tag (the
    group with ``group_by: [tag]``), the others a tenant's random id; keys in the gateway's own metadata too."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "gateway.jsonl"
    log.write_text("".join(json.dumps({"body": _request(i, c), "tags": [c.text if i in TAGGED else
                                                                        TENANTS.get(i, "team-a")],
                                       "metadata": {"user_key": c.secret}}) + "\n" for i, c in enumerate(cases)))
    return log


def _expected() -> Counter:
    """Each case counted four times in its request and once more where it is the tag."""
    want = Counter()
    for i, c in enumerate(CASES):
        want[c.kind] += 4 + (i in TAGGED)
    return want


def _groups_hide_tags(groups) -> None:
    """The group names: ``team-a`` as the tag was, every other tag (a secret redacted in it, a tenant's random id)
    a hash, one per distinct tag."""
    hashed = {g for g in groups if g != "team-a"}
    assert all(re.fullmatch(r"tag-[0-9a-f]{8}", g) for g in hashed), hashed
    assert len(hashed) == len({CASES[i].redacted for i in TAGGED} | set(TENANTS.values()))


def _leaks(text: str) -> list[str]:
    """The cases whose secret, or either half of a secret of 16+ characters, is in ``text``; the tenants' ids."""
    return [c.kind for c in CASES if c.secret in text or (len(c.secret) >= 16 and (
        c.secret[:len(c.secret) // 2] in text or c.secret[len(c.secret) // 2:] in text))] + [
        t for t in TENANTS.values() if t.removeprefix("tenant-") in text]


def test_read_traffic_keeps_no_secret_and_counts_each(tmp_path: Path) -> None:
    """Every secret, wherever it sits in a request or its tags, split across content parts or escaped in a tool
    call's arguments, is out of the kept rows and the group names, counted by kind, and each message reads as sent
    (its parts joined) with only its secrets replaced."""
    t = read_traffic(_log(tmp_path, CASES), per_group=len(CASES), group_by=["tag"])
    assert t.requests == len(CASES) and not t.dropped
    assert t.redacted == _expected()
    _groups_hide_tags(t.groups)
    assert _leaks(json.dumps(t.rows) + json.dumps(t.shares())) == []
    by_request = {int(r["messages"][1]["content"].split(":")[0].removeprefix("Request ")): r for r in t.rows}
    assert len(by_request) == len(CASES)
    for i, c in enumerate(CASES):
        m = by_request[i]["messages"]
        assert m[0]["content"] == m[3]["content"] == c.redacted and m[1]["content"] == f"Request {i}: {c.redacted}"
        assert m[2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"note": c.redacted})
        assert (by_request[i]["group"] == "team-a") == (i not in TAGGED and i not in TENANTS)


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
    assert m["traffic"]["redacted"] == _expected()
    _groups_hide_tags(m["traffic"]["groups"])
    assert json.loads((out / "metrics.json").read_text())["traffic"]["redacted"] == _expected()
    # the report as the notebook renders it: verdict, tables, figure (text kept as text in the SVG, to be searched)
    matplotlib.rcParams["svg.fonttype"] = "none"
    fig = report.plot_gate(m)
    fig.savefig(tmp_path / "gate.svg")
    plt.close(fig)
    rendered = "\n".join([*report.verdict_lines(m), report.gate_table(m).to_string(),
                          report.weak_table(m).to_string(), (tmp_path / "gate.svg").read_text()])
    assert "tag-" in rendered and "[REDACTED:" in (out / "refresh-prompts.jsonl").read_text()
    written = sorted(p for p in out.rglob("*") if p.is_file())
    assert {"metrics.json", "refresh-prompts.jsonl", "samples.jsonl"} <= {p.name for p in written}
    for where, text in [("log", log), ("report", rendered), *((str(p), p.read_text()) for p in written)]:
        assert _leaks(text) == [], where
