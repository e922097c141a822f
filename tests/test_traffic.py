"""Served traffic read as the refresh reads it (eagle3nb.data.traffic), the weak groups ranked and the refresh
budget shared (eagle3nb.refresh.weak, .sample): pure functions, no server. The gate: tests/test_gate.py."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pytest

from eagle3nb.data.prompts import PromptsError
from eagle3nb.data.redact import marker
from eagle3nb.data.traffic import features, read_traffic, tag_group
from eagle3nb.formulas import speedup

KEY = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2"


def _chat(text: str, **extra) -> dict:
    return {"model": "kimi", "messages": [{"role": "user", "content": text}], "temperature": 0.6, **extra}


def test_gateway_log_keeps_only_what_a_template_reads(tmp_path: Path) -> None:
    """A gateway's records: the body kept (messages, tools, tool_choice), the user id, metadata and a key pasted
    into a message never reach a row; every skipped line is counted with its reason."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    lines = [
        json.dumps({"body": _chat("What is 3 + 4?", user="user-8812"), "metadata": {"tags": ["math-app"],
                                                                                 "user_id": "u-1"}}),
        json.dumps({"request": {**_chat(f"my key is {KEY}, why does it fail?"), "tools": [tool],
                                "tool_choice": "auto"}, "headers": {"Authorization": f"Bearer {KEY}"}}),
        json.dumps({"model": "kimi", "prompt": "a completions request"}),
        "not json at all {",
        json.dumps(_chat("Write def f(x): return x")),
        json.dumps({"messages": [{"role": "assistant", "content": "no user here"}]}),
    ]
    log = tmp_path / "gateway.jsonl"
    log.write_text("\n".join(lines) + "\n")
    t = read_traffic(log, per_group=10, group_by=["domain"])
    text = json.dumps(t.rows)
    assert KEY not in text and "user-8812" not in text and "u-1" not in text
    assert f"my key is {marker('openai')}, why" in text and t.redacted == {"openai": 1}
    assert t.requests == 3 and sorted(t.groups.elements()) == ["code", "math", "tools"]
    assert t.dropped == {"not a chat-completions request (no messages)": 1, "not JSON": 1, "no user turn": 1}
    row = next(r for r in t.rows if r["group"] == "tools")
    assert row["tools"] == [tool] and row["tool_choice"] == "auto" and set(row) >= {"id", "messages", "conversation"}
    assert {r["group"] for r in read_traffic(log, per_group=10, group_by=["tag"]).rows} == {"math-app", "tools",
                                                                                            "code"}


def test_vllm_request_log_and_folders(tmp_path: Path) -> None:
    """vLLM's own log (bodies on 'JSON body:' lines among its other lines, a body cut by --max-log-len) and a
    folder with a gzipped file are read alike."""
    body = json.dumps(_chat("Convert 47 km to m."))
    vllm_log = "\n".join([
        "INFO 12-02 01:00:00 [api_server.py:1] Started server process",
        f"DEBUG 12-02 01:00:01 [request_logger.py:80] Request chatcmpl-1 JSON body: {body}",
        "INFO 12-02 01:00:01 [request_logger.py:62] Received request chatcmpl-1: params: SamplingParams(...)",
        f"DEBUG 12-02 01:00:02 [request_logger.py:80] Request chatcmpl-2 JSON body: {body[:30]}",
    ])
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "vllm.log").write_text(vllm_log + "\n")
    with gzip.open(folder / "gw.jsonl.gz", "wt") as f:
        f.write(json.dumps(_chat("Hello there, how are you?")) + "\n")
    t = read_traffic(folder, per_group=5)
    assert t.requests == 2 and dict(t.groups) == {"math": 1, "chat": 1}
    assert list(t.dropped) == ["body cut or not JSON (vLLM --max-log-len cuts bodies: raise it)"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptsError, match="no .jsonl"):
        read_traffic(tmp_path / "empty", per_group=1)


def test_the_real_vllm_request_log(tmp_path: Path) -> None:
    """The log the real vLLM writes (tests/fixtures/traffic/vllm-requests.log, made by tools/make_traffic_logs.py:
    --enable-log-requests at DEBUG, its bodies as pydantic dumps them, among ~600 other lines) reads exactly as the
    requests sent, written as a gateway's JSONL, do: the same requests, messages, groups and one key redacted."""
    from tools.make_traffic_logs import FAKE_KEY, OUT, requests

    sent = requests(8, 8)
    gateway = tmp_path / "sent.jsonl"
    gateway.write_text("".join(json.dumps({"model": "toy:smoke", "messages": m}) + "\n" for m in sent))
    got, want = read_traffic(OUT / "vllm-requests.log", 100), read_traffic(gateway, 100)
    assert got.requests == want.requests == len(sent) and not got.dropped
    assert got.groups == want.groups and got.redacted == want.redacted == {"openai": 1}
    key = lambda r: json.dumps(r["messages"], sort_keys=True)  # noqa: E731
    assert sorted(map(key, got.rows)) == sorted(map(key, want.rows)) and FAKE_KEY not in json.dumps(got.rows)


def _big_log(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(_chat(f"Compute {i} + {i % 7}." if i % 4 else f"Tell me about item {i}.")) + "\n")


def test_bounded_memory_and_uniform_sample(tmp_path: Path) -> None:
    """Ten times the log, the same peak memory (the sample and one counter per group, not the log); the kept
    requests are a uniform sample of their group, from all over the file, not its first lines."""
    peaks = {}
    for n in (1_000, 10_000):
        _big_log(tmp_path / f"{n}.jsonl", n)
        tracemalloc.start()
        t = read_traffic(tmp_path / f"{n}.jsonl", per_group=50, seed=1)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert t.requests == n and dict(t.groups) == {"math": n - n // 4, "chat": n // 4}
        assert len(t.rows) == 100
    assert peaks[10_000] < 1.5 * peaks[1_000], peaks
    lines = sorted(int(r["source"].split(":")[1]) for r in t.rows if r["group"] == "math")
    assert lines[0] < 10_000 * 0.2 and lines[-1] > 10_000 * 0.8  # spread over the whole file
    assert abs(sum(lines) / len(lines) - 5_000) < 1_250


def test_tags_become_group_names_only_when_they_read_as_names(tmp_path: Path) -> None:
    """A gateway tag is a group name in metrics, reports and figures: one that reads as a name stays, a tenant id,
    a random string, an address or a UUID becomes a stable ``tag-<8 hex>``, one per tag; with ``tag_allowlist``
    only the tags its globs match stay."""
    names = ["math-app", "team-a", "support bot v2", "SupportBot", "gpt-4o-mini", "API", "2024", "数学"]
    ids = ["tenant-8f3a9c2e71", "tenant-kQ7xZ2pL9w", "tenant-xAeqLmTb", "user@example.com", "u-1234567",
           "123e4567-e89b-12d3-a456-426614174000", "tenant_Za3K_t6", "sess-qwrtzpl"]
    assert [tag_group(t) for t in names] == names
    hashed = [tag_group(t) for t in ids]
    assert all(h.startswith("tag-") and len(h) == 12 and int(h[4:], 16) >= 0 for h in hashed), hashed
    assert len(set(hashed)) == len(ids) and hashed == [tag_group(t) for t in ids]  # distinct and stable
    assert tag_group("support-eu", ["support-*"]) == "support-eu"
    assert tag_group("math-app", ["support-*"]) == tag_group("math-app", []) != "math-app"
    log = tmp_path / "tagged.jsonl"
    log.write_text("".join(json.dumps({"body": _chat(f"Tell me about item {i}."), "tags": [tag]}) + "\n"
                           for i, tag in enumerate(["math-app", "tenant-8f3a9c2e71", "support-eu", "math-app"])))
    groups = read_traffic(log, per_group=10, group_by=["tag"]).groups
    assert groups == {"math-app": 2, tag_group("tenant-8f3a9c2e71"): 1, "support-eu": 1}
    strict = read_traffic(log, per_group=10, group_by=["tag"], tag_allowlist=["support-*"]).groups
    assert strict == {tag_group("math-app", []): 2, tag_group("tenant-8f3a9c2e71"): 1, "support-eu": 1}
    assert "8f3a9c2e71" not in json.dumps(dict(groups)) + json.dumps(dict(strict))


def test_features() -> None:
    assert features([{"role": "user", "content": "Add 9 and 2."}], None)["domain"] == "math"
    assert features([{"role": "user", "content": "```py\nprint(1)\n```"}], None)["domain"] == "code"
    assert features([{"role": "user", "content": "How are you?"}], None)["domain"] == "chat"
    f = features([{"role": "user", "content": "你好，今天天气怎么样"}, {"role": "assistant", "content": "好"},
                  {"role": "user", "content": "谢谢"}], None)
    assert (f["script"], f["turns"], f["length"]) == ("cjk", "2-3", "<128")


def test_rank_puts_the_costliest_group_first() -> None:
    """A common group slightly below the rest loses more speedup than a rare group far below it; the loss is
    the share times the speedup gap to the rest of the traffic, computed here from the formula."""
    from eagle3nb.refresh.weak import rank

    by_group = {"chat": [3.0, 3.2], "math": [2.4, 2.6], "code": [1.2, 1.4]}
    shares = {"chat": 0.5, "math": 0.45, "code": 0.05, "unmeasured": 0.1}
    ranked = rank(by_group, shares, k=3, cost_ratio=0.1)
    assert [w.name for w in ranked] == ["math", "code", "chat"]
    total = 0.5 + 0.45 + 0.05
    ref_math = (0.5 * 3.1 + 0.05 * 1.3) / (0.5 + 0.05)
    assert ranked[0].share == pytest.approx(0.45 / total)
    assert ranked[0].speedup_lost == pytest.approx(0.45 / total * (speedup(ref_math, 3, 0.1) - speedup(2.5, 3, 0.1)))
    assert ranked[-1].speedup_lost == 0.0


def test_allocate_follows_the_loss_and_spills_over() -> None:
    """The budget goes to the groups in proportion to the speedup each loses; a group that runs out of requests
    passes the rest to the others; a group that loses nothing gets nothing, unless none loses any."""
    from eagle3nb.refresh.sample import allocate

    pool = [{"group": g, "id": f"{g}{i}"} for g, n in (("math", 30), ("code", 3), ("chat", 30)) for i in range(n)]
    picks = allocate({"math": 0.3, "code": 0.3, "chat": 0.0}, pool, 20)
    counts = {g: sum(r["group"] == g for r in picks) for g in ("math", "code", "chat")}
    assert counts == {"math": 17, "code": 3, "chat": 0}
    even = allocate({}, pool, 9)
    assert sorted(r["group"] for r in even).count("chat") >= 3 and len(even) == 9
    assert len(allocate({"math": 1.0}, pool, 100)) == 30  # no more than the group holds


def test_the_committed_logs_name_no_machines_folders() -> None:
    """tools/make_traffic_logs.py scrubs the logs it writes: outside the request bodies (kept byte for byte), no
    absolute path of the machine that made them (its checkout, virtual environments, temporary files)."""
    import re

    from tools.make_traffic_logs import OUT, scrub

    machine = re.compile(r"/(?:work|home|root|tmp|usr|opt|var|Users|mnt|srv|private|scratch|nix)/")
    body = ('DEBUG [request_logger.py:74] Request r1 JSON body: '
            '{"messages": [{"role": "user", "content": "cat /tmp/x"}]}\n')
    made = ("/home/ann/venv/lib/python3.11/site-packages/vllm/api.py:24: Warning\r\n"
            + "model /work/ann/eagle3nb/toy/shipped/smoke, ipc:///tmp/f355 GET /v1/models\n" + body)
    assert scrub(made) == ("<site-packages>/vllm/api.py:24: Warning\r\n"
                           + "model <eagle3nb>/toy/shipped/smoke, ipc://<tmp>/f355 GET /v1/models\n" + body)
    logs = sorted(OUT.glob("*.log"))
    assert logs
    for log in logs:
        bad = [line[:120] for line in log.read_text().splitlines() if machine.search(line) and "JSON body:" not in line]
        assert bad == [], log
