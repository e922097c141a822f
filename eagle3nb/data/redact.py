"""Secrets taken out of served traffic before anything of it is kept: the one place 05 redacts (docs/refresh.md,
"What is redacted").

Best-effort by nature: a rule catches the shapes it knows. Each caught secret is replaced in place by
``[REDACTED:<kind>]`` (the text around it kept, so the request still reads as the user wrote it) and counted by kind;
the counts say how many the requests read held, never what they were. :data:`RULES` is the whole list, applied in its
order (a provider's shape before the generic ``name=value`` forms, so a key pasted as ``API_KEY=sk-...`` counts as the
provider's). A rule may hold a check its candidate passes to be redacted (random-looking, not code), which keeps
ordinary words after "key" or "token" in prose, and hints: strings one of which a text holds for the rule to be tried
at all (a substring test costs far less than a regular expression's scan, and most rules are a provider's prefix).

05 redacts what it keeps *as it keeps it*: the request assembled first (content parts joined, tool-call arguments
parsed), then every string of it (``eagle3nb.data.traffic``), so a secret split across content parts is whole when
the rules see it.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

# The names a credential goes by in `name=value`, `name: value`, `name is value`, headers, env files and JSON keys
# (matched without case, as a whole name that may carry prefixes and suffixes: API_KEY, x-api-key, my api key,
# db.password, dbPassword, PGPASSWORD, sessionToken).
_PASSWORD = r"passw(?:or)?d|passphrase|passcode|pwd"
_CREDENTIAL = (r"api[\s_.-]?key|access[\s_.-]?key|secret[\s_.-]?key|private[\s_.-]?key|client[\s_.-]?secret|"
               r"(?:auth|access|refresh|id|session)[\s_.-]?token|apikey|key|token|secret|credentials?|"
               r"authorization|auth")
# A prefix part: a word and a separator (db_, x-, my.) or a camelCase hump (db|Password, session|Token).
_PREFIX = r"(?:[A-Za-z0-9]{1,40}[_.-]|(?-i:[A-Za-z0-9]{0,39}[a-z0-9](?=[A-Z])))"
# A suffix part: a separator and a word (_id, .value) or a camelCase hump after a lower-case letter (Key|Id).
_SUFFIX = r"(?:[_.-][A-Za-z0-9]{1,40}|(?-i:(?<=[a-z0-9])[A-Z][A-Za-z0-9]{0,39}))"


def _name(core: str, glued: str = "") -> str:
    """A whole name around ``core``: up to four parts before and after it (bounded, so a long dashed run of text
    costs linear time); ``glued``: cores a prefix may stick to without a separator (PGPASSWORD, mypassword)."""
    core = rf"(?:[A-Za-z0-9]{{0,20}}?(?:{glued})|{core})" if glued else rf"(?:{core})"
    return rf"\b{_PREFIX}{{0,4}}{core}{_SUFFIX}{{0,4}}(?![A-Za-z0-9])"


# A value: quoted (may hold spaces; JSON-escaped quotes too) or bare up to a separator, its closing full stop or
# question mark left to the sentence; never a secret redacted already.
_QUOTED = r"(?P<q>\\?[\"'])(?!\[REDACTED)(?P<secret_q>[^\"'\\\n]{1,256})(?P=q)"
_BARE = r"(?!\[REDACTED)(?P<secret>[^\s\"'\\,;&<>)}\]]*[^\s\"'\\,;&<>)}\].!?:])"
# `name = value` (=, :, :=, =>, quotes around the name) or prose's `name is value`.
_VALUE = rf"(?:(?P<assign>[\\\"']*\s*(?::=|=>|[:=])\s*)|(?P<prose>\s+(?:is|was)\s+))(?:{_QUOTED}|{_BARE})"
# Kubernetes' env entries, as JSON or YAML text: {"name": "DB_PASSWORD", "value": "..."} / - name: X\n  value: ...
_Q = r"(?:\\?[\"'])?"
_ENTRY = (rf"(?i:{_Q}(?:name|key){_Q}\s*:\s*){_Q}(?P<name>[A-Za-z0-9_.-]{{1,128}}){_Q}\s*,?\s*"
          rf"(?:(?:\n|\\n)[ \t-]*)?(?i:{_Q}value{_Q})\s*:\s*(?:{_QUOTED}|{_BARE})")
_B64 = r"A-Za-z0-9+/"


def shannon_bits(s: str) -> float:
    """Bits per character of ``s`` (its own character frequencies)."""
    counts, n = Counter(s), len(s)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def random_looking(s: str) -> bool:
    """A token, not a word: 16+ characters, letters and digits mixed, >= 3.3 bits per character (an English word
    or a repeated pattern stays below; 20 random base-62 characters carry ~4)."""
    return (len(s) >= 16 and any(c.isdigit() for c in s) and any(c.isalpha() for c in s)
            and shannon_bits(s) >= 3.3)


# Values after a credential name that are code, a path or a placeholder, not a secret: a call or an index
# (dict.get(k), os.environ["X"]), a variable (${TOKEN}, $TOKEN), an attribute path (self.api_key, process.env.KEY), a
# file (/etc/ssl/key.pem, server.key), an env-var name (YOUR_API_KEY), a literal (None, null), a mask (xxxx, ****).
_CODE = re.compile(r"[(){}\[\]<>`]|\A\$[A-Za-z_]\w*\Z|\A(?:[A-Za-z_][A-Za-z_]*\.)+[A-Za-z_]\w*\Z|"
                   r"\A(?:~|\.{1,2})?/[\w./-]*\Z|\A[\w.-]+\.(?:pem|key|crt|cer|der|p12|pfx|jks|json|ya?ml|txt|env)\Z|"
                   r"\A[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\Z|\A(?i:none|null|nil|true|false|undefined|x+|\*+|\.+)\Z")
# What makes a random-looking value with code's characters code after all: a call, an index or an attribute of a
# word (hash(, tokens[, .get).
_CALL = re.compile(r"[a-z_]{4,}[(\[]|\.[a-z_]{3,}")
_WORDS = frozenset({"password", "passwd", "pwd", "pass", "passphrase", "passcode", "secret", "token", "key"})


def reads_as_code(s: str) -> bool:
    """Code, a path or a placeholder (:data:`_CODE`), unless random-looking with no call, index or attribute in it
    (a Django ``SECRET_KEY`` has parentheses too)."""
    return bool(_CODE.search(s)) and (not random_looking(s) or bool(_CALL.search(s)))


def secret_looking(s: str) -> bool:
    """A value after a credential name that is not a word, code, a path or a URL: 8+ characters holding a digit or a
    symbol other than a word's joints (``-_.``), or random-looking ("key: Enter", "auth: OAuth2", "key: Content-Type"
    and "key = dict.get(k)" stay; "key: x9Fq2LmZ81" goes)."""
    if len(s) < 8 or "://" in s or not any(c.isalnum() for c in s) or reads_as_code(s):
        return False
    return (any(c.isdigit() or not (c.isalnum() or c in "-_.") for c in s)
            or (len(s) >= 16 and shannon_bits(s) >= 3.5))


def password_value(s: str) -> bool:
    """A value after a password name: anything but code, a path or a placeholder (``password=pwd``,
    ``password: ${DB_PASSWORD}``, ``Password: ********``)."""
    return s.lower() not in _WORDS and not reads_as_code(s)


def prose_secret(s: str) -> bool:
    """A value in prose (``my password is hunter2``): 6+ characters with letters and digits mixed, not code (so "the
    key is important", "the token is user_id" and a date stay)."""
    return len(s) >= 6 and any(c.isdigit() for c in s) and any(c.isalpha() for c in s) and not reads_as_code(s)


# Name parts that make a credential-looking name something else: a count, a limit, a type, a path or an index key
# (token_count, max_password_length, sort_key, public_key, idempotency_key), anywhere in the name or as its last part.
STOP_ANY = frozenset({"count", "counts", "len", "length", "limit", "limits", "size", "max", "min", "num", "sort",
                      "primary", "foreign", "partition", "cache", "lookup", "idempotency", "public", "pub",
                      "timeout", "ttl", "expiry", "expires", "expiration", "usage", "format", "version", "index",
                      "policy", "strength", "placeholder", "regex", "pattern", "field", "label"})
STOP_LAST = frozenset({"id", "ids", "name", "names", "type", "types", "url", "uri", "path", "file", "dir", "env",
                       "var", "header", "prefix", "mode", "enabled", "required", "valid", "rule", "rules"})
_PARTS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def plain_name(name: str) -> bool:
    """Whether a credential-looking name is a count, a limit, a type, a path or an index key (its parts)."""
    parts = [p.lower() for p in _PARTS.findall(name)]
    return bool(parts) and (parts[-1] in STOP_LAST or any(p in STOP_ANY for p in parts))


def _shortkey(secret: str) -> bool:
    """An ``sk-`` key: 20+ characters after the prefix (any case of prefix but then letters and digits mixed, as an
    upper-cased key is), or a short lower-case one (LiteLLM's ``sk-1234``) with a digit and no dash."""
    body = secret[3:]
    if secret.startswith("sk-"):
        return len(body) >= 20 or (body.isalnum() and any(c.isdigit() for c in body))
    return len(body) >= 20 and any(c.isdigit() for c in body) and any(c.isalpha() for c in body)


@dataclass(frozen=True)
class Rule:
    """One shape of secret: its kind (the marker's and the count's name), the pattern (the secret is its group named
    ``secret*`` when it has one, else the whole match), hints (strings one of which a text must hold for the pattern
    to be tried: an upper-case hint is looked for as written, another in the lower-cased text; none: always tried)
    and a check ``(match, secret) -> bool`` a candidate passes to be redacted."""

    kind: str
    pattern: str
    hints: tuple[str, ...] = ()
    check: Callable[[re.Match, str], bool] | None = None


def _value_check(m: re.Match, s: str, assign: Callable[[str], bool]) -> bool:
    """A name rule's check: not a plain name (token_count, sort_key); a value in prose passes
    :func:`prose_secret`, an assigned one ``assign``."""
    if plain_name(m.group("name")):
        return False
    return prose_secret(s) if m.groupdict().get("prose") else assign(s)


def _entry_check(full: re.Pattern, assign: Callable[[str], bool]) -> Callable[[re.Match, str], bool]:
    """A Kubernetes entry's check: its name is a credential name of that rule (``full``) and the value passes."""
    return lambda m, s: bool(full.fullmatch(m.group("name"))) and _value_check(m, s, assign)


PASSWORD_NAME = re.compile(_name(_PASSWORD, glued=r"passw(?:or)?d|passphrase|passcode"), re.IGNORECASE)
CREDENTIAL_NAME = re.compile(_name(_CREDENTIAL), re.IGNORECASE)


def _encoded(m: re.Match, s: str) -> bool:
    """A base64 run whose text holds a secret (``api_key=...`` encoded): decoded (standard or URL-safe, padding
    restored) to printable UTF-8, then redacted once more without decoding again."""
    if len(s) > 65536:
        return False
    raw = s.rstrip("=")
    raw += "=" * (-len(raw) % 4)
    try:
        data = base64.b64decode(raw, altchars=b"-_" if ("-" in s or "_" in s) else None, validate=True)
        text = data.decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    if len(text) < 8 or not all(c.isprintable() or c.isspace() for c in text):
        return False
    inner: Counter = Counter()
    _redact(text, inner, decode=False)
    return bool(inner)


# The rules, in order. Provider shapes first (a pasted `API_KEY=sk-...` counts as the provider's), then the
# Kubernetes entries and the generic name rules, then encoded secrets and the random-looking fallback.
RULES: list[Rule] = [
    # a PEM block, whole; cut before its END line, to the end of the text
    Rule("private_key", r"-----BEGIN[ A-Z0-9]*PRIVATE KEY[ A-Z]*-----[\s\S]*?"
                        r"(?:-----END[ A-Z0-9]*PRIVATE KEY[ A-Z]*-----|\Z)", ("PRIVATE KEY",)),
    Rule("jwt", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*", ("eyJ",)),
    Rule("slack_webhook", r"https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+",
         ("hooks.slack.com",)),
    Rule("discord_webhook", r"https://(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/\d+/[A-Za-z0-9_-]+",
         ("/api/webhooks/",)),
    Rule("teams_webhook", r"https://[A-Za-z0-9.-]*\.webhook\.office\.com/webhookb2/[^\s\"'<>]+",
         ("webhook.office.com",)),
    Rule("url_password", r"\b[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@\[\]\"']{0,256}:(?!\[REDACTED)"
                         r"(?P<secret>[^\s/?#@\[\]\"']{1,256})@", ("://",)),
    Rule("aws_signed_url", r"(?i:\bX-Amz-(?:Signature|Security-Token))=(?P<secret>[^&\s\"'<>#]{16,})", ("x-amz-",)),
    Rule("gcp_signed_url", r"(?i:\bX-Goog-Signature)=(?P<secret>[^&\s\"'<>#]{16,})", ("x-goog-signature",)),
    Rule("azure_sas", r"[?&;](?i:sig)=(?P<secret>[A-Za-z0-9%+/=_-]{16,})", ("sig=",)),
    Rule("azure_storage_key", r"(?i:\b(?:AccountKey|SharedAccessKey))\s*=\s*(?P<secret>[A-Za-z0-9+/]{20,}={0,2})",
         ("accountkey", "sharedaccesskey")),
    Rule("azure_client_secret", r"(?<![A-Za-z0-9_~.-])[A-Za-z0-9_~.]{3}\dQ~[A-Za-z0-9_~.-]{31,34}"
                                r"(?![A-Za-z0-9_~.-])", ("Q~",)),
    Rule("anthropic", r"(?i:\bsk-ant-)[A-Za-z0-9_-]{20,}", ("sk-ant-",)),
    Rule("openai", r"(?i:\bsk-)[A-Za-z0-9_-]{4,}", ("sk-",), lambda m, s: _shortkey(s)),
    Rule("stripe", r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}", ("_live_", "_test_")),
    Rule("webhook_secret", r"\bwhsec_[A-Za-z0-9+/=]{24,}", ("whsec_",)),
    Rule("github", r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})",
         ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_")),
    Rule("gitlab", r"\bgl(?:pat|ptt|dt|rt|cbt|ft|soat|oas|imt|agent)-[A-Za-z0-9_-]{20,}",
         ("glpat-", "glptt-", "gldt-", "glrt-", "glcbt-", "glft-", "glsoat-", "gloas-", "glimt-", "glagent-")),
    Rule("aws_access_key_id", r"\b(?:AKIA|ASIA|ABIA|ACCA|AIDA|AROA|AIPA|ANPA|ANVA|APKA|AGPA)[A-Z0-9]{16}\b",
         ("AKIA", "ASIA", "ABIA", "ACCA", "AIDA", "AROA", "AIPA", "ANPA", "ANVA", "APKA", "AGPA")),
    Rule("aws_secret_key", rf"(?i:aws|secret)[^\n]{{0,40}}?(?<![{_B64}=])(?P<secret>[{_B64}]{{40}})(?![{_B64}=])",
         ("aws", "secret"), lambda m, s: random_looking(s)),
    Rule("google_api_key", r"\bAIza[0-9A-Za-z_-]{30,}", ("AIza",)),
    Rule("google_oauth", r"\bya29\.[0-9A-Za-z_-]{20,}", ("ya29.",)),
    Rule("slack", r"\bxox[abposre]-[A-Za-z0-9-]{10,}", ("xox",)),
    Rule("huggingface", r"\bhf_[A-Za-z0-9]{30,}", ("hf_",)),
    Rule("npm", r"\bnpm_[A-Za-z0-9]{36}\b", ("npm_",)),
    Rule("pypi", r"\bpypi-AgE[A-Za-z0-9_-]{50,}", ("pypi-AgE",)),
    Rule("sendgrid", r"\bSG\.[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{16,64}", ("SG.",)),
    Rule("groq", r"\bgsk_[A-Za-z0-9]{40,}", ("gsk_",)),
    Rule("digitalocean", r"\bdo[opr]_v1_[a-f0-9]{64}\b", ("_v1_",)),
    Rule("twilio", r"\bSK[0-9a-fA-F]{32}\b", ("SK",)),
    Rule("discord", r"(?<![A-Za-z0-9_-])[MNO][A-Za-z0-9_-]{23,27}\.[A-Za-z0-9_-]{6,7}\.[A-Za-z0-9_-]{27,40}"
                    r"(?![A-Za-z0-9_-])", (".",)),
    Rule("telegram", r"(?<![A-Za-z0-9])(?:bot)?(?P<secret>\d{8,10}:[A-Za-z0-9_-]{35})(?![A-Za-z0-9_-])", (":",)),
    Rule("docker", r"\bdckr_pat_[A-Za-z0-9_-]{20,}", ("dckr_pat_",)),
    Rule("vault", r"\bhv[sb]\.[A-Za-z0-9_-]{24,}", ("hvs.", "hvb.")),
    Rule("databricks", r"\bdapi[0-9a-f]{32}(?:-\d)?\b", ("dapi",)),
    Rule("shopify", r"\bshp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}\b", ("shpat_", "shpca_", "shppa_", "shpss_")),
    Rule("linear", r"\blin_api_[A-Za-z0-9]{40}\b", ("lin_api_",)),
    Rule("perplexity", r"\bpplx-[A-Za-z0-9]{40,}", ("pplx-",)),
    Rule("xai", r"\bxai-[A-Za-z0-9]{50,}", ("xai-",)),
    Rule("replicate", r"\br8_[A-Za-z0-9]{37}\b", ("r8_",)),
    Rule("square", r"\bsq0(?:atp|csp)-[A-Za-z0-9_-]{22,}", ("sq0",)),
    Rule("mailgun", r"\bkey-[0-9a-f]{32}\b", ("key-",)),
    Rule("mailchimp", r"\b[0-9a-f]{32}-us\d{1,2}\b", ("-us",)),
    Rule("sentry", r"\bsntry[su]_[A-Za-z0-9+/=_-]{40,}", ("sntry",)),
    Rule("grafana", r"\bgl(?:sa|c)_[A-Za-z0-9+/=_-]{32,}", ("glsa_", "glc_")),
    Rule("newrelic", r"\bNRAK-[A-Z0-9]{27}\b", ("NRAK-",)),
    Rule("postman", r"\bPMAK-[a-f0-9]{24}-[a-f0-9]{34}\b", ("PMAK-",)),
    Rule("age", r"\bAGE-SECRET-KEY-1[02-9AC-HJ-NP-Z]{58}\b", ("AGE-SECRET-KEY-1",)),
    Rule("pulumi", r"\bpul-[a-f0-9]{40}\b", ("pul-",)),
    Rule("supabase", r"\bsbp_[a-f0-9]{40}\b", ("sbp_",)),
    Rule("artifactory", r"\bAKCp[A-Za-z0-9]{69}\b", ("AKCp",)),
    Rule("planetscale", r"\bpscale_(?:tkn|pw|oauth)_[A-Za-z0-9_.-]{32,64}", ("pscale_",)),
    Rule("authorization", r"(?i:\b(?:proxy-)?authorization)[\\\"']*\s*[:=]\s*[\\\"']*"
                          r"(?i:(?:bearer|basic|token|digest)\s+)?+(?!\[REDACTED)(?P<secret>[^\s\"'\\,;]+)",
         ("authorization",), lambda m, s: len(s) >= 8 and not reads_as_code(s)),
    Rule("bearer", r"(?i:\bbearer)\s+(?!\[REDACTED)(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)", ("bearer",),
         lambda m, s: random_looking(s)),
    # Kubernetes' env entries (name and value apart), then `name = value` and `name is value`
    Rule("password", _ENTRY, ("value",), _entry_check(PASSWORD_NAME, password_value)),
    Rule("credential", _ENTRY, ("value",), _entry_check(CREDENTIAL_NAME, secret_looking)),
    Rule("password", rf"(?P<name>(?i:{PASSWORD_NAME.pattern})){_VALUE}", ("pass", "pwd"),
         lambda m, s: _value_check(m, s, password_value)),
    Rule("credential", rf"(?P<name>(?i:{CREDENTIAL_NAME.pattern})){_VALUE}",
         ("key", "token", "secret", "auth", "credential"),
         lambda m, s: _value_check(m, s, secret_looking)),
    # a base64 run whose decoded text holds a secret
    Rule("base64", r"(?<![A-Za-z0-9+/=_-])(?P<secret>[A-Za-z0-9+/_-]{16,}={0,2})(?![A-Za-z0-9+/=_-])", (), _encoded),
    # the fallback: a long random-looking token within 40 characters after a credential word
    Rule("high_entropy", r"(?i:\b(?:key|token|secret|passw|credential|auth|bearer|api[\s_-]?key)\w{0,30})"
                         r"[^\n]{0,40}?(?<![\w+/=.-])(?P<secret>[A-Za-z0-9+/_=.-]{20,})",
         ("key", "token", "secret", "passw", "credential", "auth", "bearer", "api"),
         lambda m, s: random_looking(s)),
]
KINDS: list[str] = list(dict.fromkeys(r.kind for r in RULES))


@dataclass(frozen=True)
class _Compiled:
    rule: Rule
    regex: re.Pattern
    groups: tuple[str, ...]  # its secret groups
    hints: frozenset[str]


def _compile(rule: Rule) -> _Compiled:
    regex = re.compile(rule.pattern)
    return _Compiled(rule, regex, tuple(g for g in regex.groupindex if g.startswith("secret")), frozenset(rule.hints))


_COMPILED = [_compile(r) for r in RULES]
# every hint once: an upper-case one looked for as written, another in the lower-cased text
_EXACT = tuple(sorted({h for r in RULES for h in r.hints if h != h.lower()}))
_LOWER = tuple(sorted({h for r in RULES for h in r.hints if h == h.lower()}))
_MARKER = re.compile(r"\[REDACTED:[a-z0-9_]+\]")


def marker(kind: str) -> str:
    """What a secret of ``kind`` becomes."""
    return f"[REDACTED:{kind}]"


class Redactions(Counter):
    """Secrets redacted, by kind; prints as its total and kinds (``3 (github 1, jwt 2)``)."""

    def __str__(self) -> str:
        total = sum(self.values())
        return f"{total} ({', '.join(f'{k} {n}' for k, n in sorted(self.items()))})" if total else "0"


def _redact(text: str, found: Counter, decode: bool = True) -> str:
    """``text`` redacted, each secret counted into ``found``; ``decode``: look into base64 runs too."""
    if len(text) < 16 and text.isidentifier():  # a word or a short name (a key, a role): no rule matches one
        return text
    lower = text.lower()
    present = {h for h in _EXACT if h in text}
    present.update(h for h in _LOWER if h in lower)
    for c in _COMPILED:
        if (c.hints and c.hints.isdisjoint(present)) or (c.rule.check is _encoded and not decode):
            continue

        def replace(m: re.Match, c: _Compiled = c) -> str:
            name = next((g for g in c.groups if m.group(g) is not None), None)
            start, end = m.span(name) if name else m.span()
            if m.string.startswith("[REDACTED:", start) or (c.rule.check and not c.rule.check(m, m.string[start:end])):
                return m.group(0)  # a marker already, or a candidate its check refuses
            found[c.rule.kind] += 1
            return m.string[m.start():start] + marker(c.rule.kind) + m.string[end:m.end()]

        text = c.regex.sub(replace, text)
    return text


def redact(text: str) -> tuple[str, Redactions]:
    """``text`` with every secret :data:`RULES` finds replaced by its marker, and the count by kind."""
    found = Redactions()
    return _redact(text, found), found


def redact_value(value: Any) -> tuple[Any, Redactions]:
    """A JSON value with every string in it redacted (:func:`redact`), object keys included, and a value under a
    credential-named key (``{"password": ...}``, ``{"api_key": ...}`` in a tool call's arguments) or in a
    Kubernetes-style entry (``{"name": "DB_PASSWORD", "value": ...}``) redacted whole, even after another rule
    took a part of it (``{"password": "Tr0ub4dor&3 AKIA..."}``: both counted)."""
    found = Redactions()
    return _value(value, found), found


def _value(value: Any, found: Counter) -> Any:
    if isinstance(value, str):
        return _redact(value, found)
    if isinstance(value, list):
        return [_value(v, found) for v in value]
    if isinstance(value, dict):
        label = next((value[k] for k in ("name", "key") if isinstance(value.get(k), str)), None)
        kept = {}
        for k, v in value.items():
            clean = _value(v, found)
            kind = _named(k, clean) or (_named(label, clean) if k == "value" and label else None)
            if kind:
                clean = marker(kind)
                found[kind] += 1
            kept[_redact(k, found) if isinstance(k, str) else k] = clean
        return kept
    return value


def _named(key: Any, value: Any) -> str | None:
    """The kind of a value whose key names a credential (a password: any value; another credential: a value that
    looks secret), judged on what other rules left of it; else None."""
    if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    rest = _MARKER.sub("", value).strip() if isinstance(value, str) else str(value)
    if not rest or plain_name(key):
        return None
    if PASSWORD_NAME.fullmatch(key):
        return "password"
    if CREDENTIAL_NAME.fullmatch(key) and secret_looking(rest):
        return "credential"
    return None
