"""Served traffic as the refresh stage reads it: the chat-completions requests a deployment saw.

Three forms are read, line by line, in bounded memory (a log of a million requests keeps only the sample asked for
and one counter per group):

- a gateway's JSONL log: one request body per line (``{"model", "messages", "tools", ...}``), or a record wrapping
  it (``{"body": {...}}`` / ``{"request": {...}}``) with the gateway's own ``tags`` / ``metadata.tags`` (a prompt
  set's rows read the same way, their ``category`` as the tag);
- vLLM's own request log: the server's log file with ``--enable-log-requests`` at log level DEBUG, where each body is
  one line ``Request <id> JSON body: {...}`` (vLLM cuts bodies at ``--max-log-len``; a cut body is dropped, counted);
- a folder of such files (``.jsonl``, ``.log``, ``.txt``, each optionally ``.gz``), read in name order.

Each request keeps only what a chat template reads (``messages``, ``tools``, ``tool_choice``): user ids, keys,
metadata and sampling fields are never kept. The row is assembled first (content parts joined, tool-call arguments
parsed) and then redacted as it is kept (``eagle3nb.data.redact``): every string of it (message text, system prompts,
tool-call arguments, tool results, tool schemas, object keys) and the gateway's tags, so a secret split across content
parts is whole when the rules see it; each secret becomes ``[REDACTED:<kind>]``, counted by kind. A tag becomes a
group name only when it reads as a name (or matches ``tag_allowlist``); any other (a tenant id, a random string, a
tag that held a secret) is hashed to ``tag-<8 hex>`` first (:func:`tag_group`). Every line that is not kept is
counted with its reason.
A request becomes a prompt row in the format of ``eagle3nb.data.prompts`` (``id``, ``messages``, ``conversation``,
``tools``, ``tool_choice``, ``category``) plus its ``group`` and ``features`` (:func:`features`), so 01 and 04 read
it as any prompt set.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterator

from eagle3nb.data.prompts import ROLES, PromptsError, openai_message, prompt_id
from eagle3nb.data.redact import Redactions, redact, redact_value

VLLM_BODY = re.compile(r"Request \S+ JSON body: (\{.*)$")
LOG_SUFFIXES = (".jsonl", ".log", ".txt", ".json")
DOMAINS = ("tools", "code", "math", "chat")
CODE = re.compile(r"```|\bdef \w+\(|\bfunction \w+\(|#include|\bclass \w+[:({]|\bimport \w+|\bSELECT\b|=>|;\s*$",
                  re.MULTILINE)
MATH_WORDS = re.compile(r"\b(add|sum|compute|calculate|solve|plus|minus|times|divide|multiply|convert|equation|"
                        r"integral|derivative)\b", re.IGNORECASE)
MATH_SIGNS = re.compile(r"\d\s*[-+*/^=]\s*\d|\\frac|\\sum|\$[^$]+\$")


@dataclass
class Traffic:
    """What a read kept and counted: the sampled prompt rows, every request's group (its share of traffic),
    the lines dropped by reason, and the secrets redacted by kind (in every request kept, sampled or not)."""

    rows: list[dict]
    requests: int
    groups: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    redacted: Redactions = field(default_factory=Redactions)

    def shares(self) -> dict[str, float]:
        """Each group's share of all requests read (not of the sample)."""
        total = sum(self.groups.values())
        return {g: n / total for g, n in sorted(self.groups.items())} if total else {}


def log_files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and
                       (p.suffix in LOG_SUFFIXES or (p.suffix == ".gz" and Path(p.stem).suffix in LOG_SUFFIXES)))
        if not files:
            raise PromptsError(f"traffic {source}: no .jsonl / .log / .txt files in the folder; point 'traffic' at a "
                               f"gateway's JSONL log, vLLM's request log or a folder of them")
        return files
    if not source.exists():
        raise PromptsError(f"traffic {source} does not exist; point 'traffic' at a request log file or folder")
    return [source]


def log_lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def _body(line: str, jsonl: bool) -> tuple[dict | None, list[str], str | None]:
    """(the request body, the log's tags, why the line is dropped); (None, [], None) for a line that is not a
    request at all (in a server log, which is not ``jsonl``: vLLM's other log lines)."""
    line = line.strip()
    if not line:
        return None, [], None
    m = VLLM_BODY.search(line)
    text = m.group(1) if m else line
    if not m and not jsonl:
        return None, [], None
    try:
        record = json.loads(text)
    except ValueError:
        return None, [], "body cut or not JSON (vLLM --max-log-len cuts bodies: raise it)" if m else "not JSON"
    if not isinstance(record, dict):
        return None, [], "not a JSON object"
    body = record.get("body") or record.get("request") or record
    meta = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    tags = record.get("tags") or meta.get("tags") or record.get("category") or []
    if not isinstance(body, dict) or "messages" not in body:
        return None, [], "not a chat-completions request (no messages)"
    return body, [str(t) for t in (tags if isinstance(tags, list) else [tags])], None


def features(messages: list[dict], tools: list | None) -> dict[str, str]:
    """A cheap description of one request: its domain (tools > code > math > chat, from the last user turn), the
    script of its text, its user-turn count and its length bucket (characters / 4 as tokens)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    last = users[-1] if users else ""
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        domain = "tools"
    elif CODE.search(last):
        domain = "code"
    elif MATH_SIGNS.search(last) or (MATH_WORDS.search(last) and re.search(r"\d", last)):
        domain = "math"
    else:
        domain = "chat"
    text = " ".join(str(m.get("content") or "") for m in messages)
    letters = [c for c in text if c.isalpha()]
    scripts = Counter("latin" if c.isascii() or "\u00c0" <= c <= "\u024f" else
                      "cjk" if "\u3040" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af" else
                      "cyrillic" if "\u0400" <= c <= "\u04ff" else "arabic" if "\u0600" <= c <= "\u06ff" else "other"
                      for c in letters)
    tokens = len(text) // 4
    length = "<128" if tokens < 128 else "128-1k" if tokens < 1024 else "1k-8k" if tokens < 8192 else "8k+"
    turns = len(users)
    return {"domain": domain, "script": scripts.most_common(1)[0][0] if scripts else "none",
            "turns": "1" if turns <= 1 else "2-3" if turns <= 3 else "4+", "length": length}


def group_of(feats: dict[str, str], tags: list[str], group_by: list[str]) -> str:
    """The group a request counts in: the log's first tag when ``group_by`` is ``["tag"]`` and it has one (as
    :func:`tag_group` left it), else the named features joined with ``/`` (``["domain"]`` -> ``math``;
    ``["domain", "turns"]`` -> ``math/1``)."""
    parts = [(tags[0] if tags else feats["domain"]) if k == "tag" else feats[k] for k in group_by]
    return "/".join(parts)


_HUMP = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
# up to four letters of one case, alone or with up to four digits (API, gpt, v2, gpt4, h100, 4o, 70b)
_SHORT = re.compile(r"[a-z]{1,4}(?:\d{1,4}[a-z]?)?|\d{1,4}[a-z]{1,2}|[A-Z]{1,4}(?:\d{1,4}[A-Z]?)?|\d{1,4}[A-Z]{1,2}")
_CONSONANTS = re.compile(r"[^aeiouy]{5}")


def _readable(hump: str) -> bool:
    """Letters that read as a word: a vowel, no run of five consonants; two letters or fewer only with a vowel."""
    low = hump.lower()
    return (len(hump) == 1 or any(c in "aeiouy" for c in low)) and not _CONSONANTS.search(low)


def _word(part: str) -> bool:
    """A part of a tag that reads as a word: letters cased as words are (math, Math, MATH, SupportBot: each camelCase
    hump three letters or more) and readable, a short name (:data:`_SHORT`), a number of up to four digits; letters of
    another script."""
    if not part.isascii():
        return part.isalpha() and len(part) <= 24
    if part.isdigit():
        return len(part) <= 4
    if _SHORT.fullmatch(part):
        return True
    humps = _HUMP.findall(part)
    if not part.isalpha() or len(part) > 24 or "".join(humps) != part:
        return False
    return _readable(part) if len(humps) == 1 else all(len(h) >= 3 and _readable(h) for h in humps)


def tag_group(tag: str, allowlist: list[str] | None = None) -> str:
    """What a (redacted) gateway tag is called as a group: itself when it matches a glob of ``allowlist`` or, with no
    allowlist, when it reads as a name (words, short numbers, joined by ``- _ . / :`` or spaces: ``math-app``,
    ``team-a``, ``support bot v2``); else ``tag-<8 hex>``, a stable hash of it, so a tenant id, a random string or a
    tag that held a secret never becomes a name in metrics, reports or figures."""
    if allowlist is not None:
        keep = any(fnmatchcase(tag, g) for g in allowlist)
    else:
        parts = [p for p in re.split(r"[-_./: ]+", tag) if p]
        keep = 0 < len(tag) <= 64 and bool(parts) and all(_word(p) for p in parts)
    return tag if keep else f"tag-{hashlib.sha256(tag.encode()).hexdigest()[:8]}"


def _parsed_calls(messages: list[dict]) -> tuple[list[dict], list[tuple[int, int]]]:
    """The messages with each tool call's arguments text parsed into what a template reads (vLLM parses them before
    rendering: ``eagle3nb.data.turns.template_messages``), so redaction sees the strings unescaped; and where the
    arguments were text (to be written back as text)."""
    out, texts = [], []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            parsed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                        texts.append((i, j))
                    except ValueError:  # not JSON: kept as text, redacted as text
                        pass
                parsed.append(c)
            m = {**m, "tool_calls": parsed}
        out.append(m)
    return out, texts


def redact_request(messages: list[dict], tools: Any, tool_choice: Any) -> tuple[dict, Redactions]:
    """``{"messages", "tools", "tool_choice"}`` as they are kept, with their secrets redacted and counted: the
    messages already assembled (:func:`eagle3nb.data.prompts.openai_message`: content parts joined), each tool call's
    arguments redacted as parsed, written back as JSON text and redacted again as that text."""
    parsed, texts = _parsed_calls(messages)
    kept, hits = redact_value({"messages": parsed, "tools": tools, "tool_choice": tool_choice})
    for i, j in texts:
        fn = kept["messages"][i]["tool_calls"][j]["function"]
        fn["arguments"], n = redact(json.dumps(fn["arguments"], ensure_ascii=False))
        hits.update(n)
    return kept, hits


def _request(body: dict, tags: list[str], group_by: list[str], allowlist: list[str] | None, where: str
             ) -> tuple[dict | None, Redactions, str | None]:
    """(the prompt row of one request body, the secrets redacted in it and in its tags, why it is dropped): the row
    assembled from the body's kept fields, then redacted as kept."""
    raw = body.get("messages")
    messages = [openai_message(m) for m in raw] if isinstance(raw, list) else []
    if not messages or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                               for m in messages):
        return None, Redactions(), "messages not OpenAI text messages"
    if not any(m["role"] == "user" for m in messages):
        return None, Redactions(), "no user turn"
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    kept, hits = redact_request(messages, tools, body.get("tool_choice") if tools else None)
    tags, in_tags = redact_value(tags)
    hits.update(in_tags)
    messages = kept["messages"]
    feats = features(messages, kept["tools"])
    group = group_of(feats, [tag_group(t, allowlist) for t in tags[:1]], group_by)
    return {"id": prompt_id(messages), "messages": messages, "conversation": messages, "tools": kept["tools"],
            "tool_choice": kept["tool_choice"], "category": group, "group": group, "features": feats,
            "source": where}, hits, None


def read_traffic(source: str | Path, per_group: int, *, group_by: list[str] | None = None, seed: int = 0,
                 tag_allowlist: list[str] | None = None) -> Traffic:
    """Read every request of ``source`` once; keep up to ``per_group`` of each group (a uniform sample of that
    group: reservoir sampling with ``seed``), count all of them by group, and count every dropped line by reason.
    ``tag_allowlist``: globs of the tags kept as group names (None: those that read as names, :func:`tag_group`)."""
    group_by = group_by or ["domain"]
    unknown = sorted(set(group_by) - {"tag", "domain", "script", "turns", "length"})
    if unknown:
        raise PromptsError(f"group_by {unknown}: use tag, domain, script, turns or length")
    rng = random.Random(seed)
    out = Traffic(rows=[], requests=0)
    reservoirs: dict[str, list[dict]] = {}
    for path in log_files(Path(source)):
        jsonl = bool({".jsonl", ".json"} & set(path.suffixes))
        for n, line in enumerate(log_lines(path), 1):
            body, tags, why = _body(line, jsonl)
            if body is not None:
                row, hits, why = _request(body, tags, group_by, tag_allowlist, f"{path.name}:{n}")
                out.redacted.update(hits)
            if why:
                out.dropped[why] += 1
            if body is None or row is None:
                continue
            out.requests += 1
            out.groups[row["group"]] += 1
            pool = reservoirs.setdefault(row["group"], [])
            if len(pool) < per_group:
                pool.append(row)
            else:
                j = rng.randrange(out.groups[row["group"]])
                if j < per_group:
                    pool[j] = row
    seen: set[str] = set()
    for group in sorted(reservoirs):
        for row in reservoirs[group]:
            if row["id"] in seen:
                out.dropped["repeated request (kept once in the sample)"] += 1
                continue
            seen.add(row["id"])
            out.rows.append(row)
    return out
