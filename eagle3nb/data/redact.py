"""Secrets taken out of served traffic before anything of it is kept: the one place 05 redacts (docs/refresh.md,
"What is redacted").

Best-effort by nature: a pattern catches the shapes it knows. Each caught secret is replaced in place by
``[REDACTED:<kind>]`` (the text around it kept, so the request still reads as the user wrote it) and counted by kind;
the counts say how many the requests read held, never what they were. :data:`PATTERNS` is the whole list, applied
in its order (a provider's shape before the generic ``name=value`` forms, so a key pasted as ``API_KEY=sk-...``
counts as the provider's); a kind in :data:`CHECKS` is redacted only when its candidate passes the check
(random-looking), which keeps ordinary words after "key" or "token" in prose.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Callable

# The names a credential goes by in `name=value`, `name: value`, headers, env files and JSON keys (matched without
# case, as a whole name that may carry prefixes and suffixes: API_KEY, x-api-key, my api key, db.password, AUTH_TOKEN).
_PASSWORD = r"passw(?:or)?d|passphrase|pwd"
_CREDENTIAL = (r"api[\s_.-]?key|access[\s_.-]?key|secret[\s_.-]?key|private[\s_.-]?key|client[\s_.-]?secret|"
               r"(?:auth|access|refresh|id)[\s_.-]?token|apikey|key|token|secret|credentials?|authorization|auth")


def _name(core: str) -> str:
    """A whole name around ``core``: up to four parts before and after it joined by ``_``, ``.`` or ``-`` (bounded,
    so a long dashed run of text costs linear time)."""
    return rf"\b(?:[A-Za-z0-9]{{1,40}}[_.-]){{0,4}}(?:{core})(?:[_.-][A-Za-z0-9]{{1,40}}){{0,4}}(?![A-Za-z0-9])"


# `name = value`: a quoted value (may hold spaces; JSON-escaped quotes too) or a bare one up to a separator; never
# a secret redacted already.
_VALUE = (r"[\\\"']*\s*(?::=|=>|[:=])\s*(?:(?P<q>\\?[\"'])(?!\[REDACTED)(?P<secret_q>[^\"'\\\n]{1,256})(?P=q)|"
          r"(?!\[REDACTED)(?P<secret>[^\s\"'\\,;&<>)}\]]+))")
_B64 = r"A-Za-z0-9+/"

# kind -> pattern. The secret is the group named `secret` (or `secret_q`) when the pattern has one, else the whole
# match. Applied in this order.
PATTERNS: dict[str, str] = {
    # a PEM block, whole; cut before its END line, to the end of the text
    "private_key": r"-----BEGIN[ A-Z0-9]*PRIVATE KEY[ A-Z]*-----[\s\S]*?"
                   r"(?:-----END[ A-Z0-9]*PRIVATE KEY[ A-Z]*-----|\Z)",
    "jwt": r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*",
    "slack_webhook": r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+",
    "url_password": r"\b[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@\[\]\"']{0,256}:(?!\[REDACTED)"
                    r"(?P<secret>[^\s/?#@\[\]\"']{1,256})@",
    "anthropic": r"\bsk-ant-[A-Za-z0-9_-]{20,}",
    "openai": r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",
    "stripe": r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",
    "github": r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})",
    "gitlab": r"\bglpat-[A-Za-z0-9_-]{20,}",
    "aws_access_key_id": r"\b(?:AKIA|ASIA|ABIA|ACCA|AIDA|AROA|AIPA|ANPA|ANVA|APKA|AGPA)[A-Z0-9]{16}\b",
    "aws_secret_key": rf"(?i:aws|secret)[^\n]{{0,40}}?(?<![{_B64}=])(?P<secret>[{_B64}]{{40}})(?![{_B64}=])",
    "google_api_key": r"\bAIza[0-9A-Za-z_-]{30,}",
    "google_oauth": r"\bya29\.[0-9A-Za-z_-]{20,}",
    "slack": r"\bxox[abposre]-[A-Za-z0-9-]{10,}",
    "huggingface": r"\bhf_[A-Za-z0-9]{30,}",
    "npm": r"\bnpm_[A-Za-z0-9]{36}\b",
    "pypi": r"\bpypi-AgE[A-Za-z0-9_-]{50,}",
    "sendgrid": r"\bSG\.[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{16,64}",
    "groq": r"\bgsk_[A-Za-z0-9]{40,}",
    "digitalocean": r"\bdo[opr]_v1_[a-f0-9]{64}\b",
    "authorization": r"(?i:\b(?:proxy-)?authorization)[\\\"']*\s*[:=]\s*[\\\"']*(?i:(?:bearer|basic|token|digest)\s+)?+"
                     r"(?!\[REDACTED)(?P<secret>[^\s\"'\\,;]+)",
    "bearer": r"(?i:\bbearer)\s+(?!\[REDACTED)(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)",
    "password": "(?i:" + _name(_PASSWORD) + ")" + _VALUE,
    "credential": "(?i:" + _name(_CREDENTIAL) + ")" + _VALUE,
    # the fallback: a long random-looking token within 40 characters after a credential word
    "high_entropy": r"(?i:\b(?:key|token|secret|passw|credential|auth|bearer|api[\s_-]?key)\w{0,30})[^\n]{0,40}?"
                    r"(?<![\w+/=.-])(?P<secret>[A-Za-z0-9+/_=.-]{20,})",
}


def shannon_bits(s: str) -> float:
    """Bits per character of ``s`` (its own character frequencies)."""
    counts, n = Counter(s), len(s)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def random_looking(s: str) -> bool:
    """A token, not a word: 16+ characters, letters and digits mixed, >= 3.3 bits per character (an English word
    or a repeated pattern stays below; 20 random base-62 characters carry ~4)."""
    return (len(s) >= 16 and any(c.isdigit() for c in s) and any(c.isalpha() for c in s)
            and shannon_bits(s) >= 3.3)


def secret_looking(s: str) -> bool:
    """A value after a credential name that is not a plain word or a URL: 6+ characters holding a digit, a symbol
    or a capital past the first letter ("key: Enter" and "token: end" stay; "key: x9Fq..." goes)."""
    return (len(s) >= 6 and "://" not in s
            and any(c.isdigit() or not c.isalnum() or (c.isupper() and i) for i, c in enumerate(s)))


# kind -> the check a candidate of that kind passes to be redacted (kinds not named: every match is).
CHECKS: dict[str, Callable[[str], bool]] = {"aws_secret_key": random_looking, "bearer": random_looking,
                                            "high_entropy": random_looking, "credential": secret_looking}
RULES = [(kind, re.compile(p)) for kind, p in PATTERNS.items()]
PASSWORD_NAME = re.compile(_name(_PASSWORD), re.IGNORECASE)
CREDENTIAL_NAME = re.compile(_name(_CREDENTIAL), re.IGNORECASE)


def marker(kind: str) -> str:
    """What a secret of ``kind`` becomes."""
    return f"[REDACTED:{kind}]"


class Redactions(Counter):
    """Secrets redacted, by kind; prints as its total and kinds (``3 (github 1, jwt 2)``)."""

    def __str__(self) -> str:
        total = sum(self.values())
        return f"{total} ({', '.join(f'{k} {n}' for k, n in sorted(self.items()))})" if total else "0"


def redact(text: str) -> tuple[str, Redactions]:
    """``text`` with every secret :data:`PATTERNS` finds replaced by its marker, and the count by kind."""
    found = Redactions()
    for kind, rule in RULES:
        check = CHECKS.get(kind)

        def replace(m: re.Match, kind: str = kind, check: Callable[[str], bool] | None = check) -> str:
            name = next((g for g in ("secret", "secret_q") if g in m.re.groupindex and m.group(g) is not None), None)
            start, end = m.span(name) if name else m.span()
            if check and not check(m.string[start:end]):
                return m.group(0)
            found[kind] += 1
            return m.string[m.start():start] + marker(kind) + m.string[end:m.end()]

        text = rule.sub(replace, text)
    return text, found


def redact_value(value: Any) -> tuple[Any, Redactions]:
    """A JSON value with every string in it redacted (:func:`redact`), and a string under a credential-named key
    (``{"password": ...}``, ``{"api_key": ...}`` in a tool call's arguments) redacted whole."""
    if isinstance(value, str):
        return redact(value)
    found = Redactions()
    if isinstance(value, list):
        out = []
        for v in value:
            clean, n = redact_value(v)
            out.append(clean)
            found.update(n)
        return out, found
    if isinstance(value, dict):
        kept = {}
        for k, v in value.items():
            kept[k], n = redact_value(v)
            kind = None if n else _named(k, kept[k])
            if kind:
                kept[k], n = marker(kind), Redactions({kind: 1})
            found.update(n)
        return kept, found
    return value, found


def _named(key: Any, value: Any) -> str | None:
    """The kind of a string value whose key names a credential (a password: any value; another credential: a value
    that looks secret), else None."""
    if not isinstance(key, str) or not isinstance(value, str) or not value:
        return None
    if PASSWORD_NAME.fullmatch(key):
        return "password"
    if CREDENTIAL_NAME.fullmatch(key) and secret_looking(value):
        return "credential"
    return None
