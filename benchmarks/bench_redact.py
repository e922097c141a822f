"""05's redaction (eagle3nb.data.redact) against the code before issue 50's change, side by side on the same
generated traffic: MB/s of ``redact`` over every kept string, and of a whole request's redaction as 05 reads it (the
old: the raw body redacted, then its content parts joined; the new: the request assembled, then redacted as kept).
Target: the new within 2x of the old's time per MB. The old module is the file as it was at ``--before`` (``git
show``), loaded at run time.

``--detectors`` also weighs the two well-kept detectors as a second layer, when installed: Yelp's ``detect-secrets``
(its default plugins: keyword, entropy and vendor shapes) and Microsoft's ``presidio-analyzer`` (personal data; its
spaCy model cannot be downloaded here, so its pattern recognizers run on a blank spaCy pipeline): what each finds in
the corpus (testkit/secret_corpus.py), in shapes our table does not list, in ordinary text (false positives), and
its MB/s on the same traffic.

    python -m benchmarks.bench_redact                    # ~2 MB of traffic, 5 repeats (about 40 s here)
    python -m benchmarks.bench_redact --detectors        # and the two detectors (about 2 min more)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3nb.data.prompts import openai_message
from eagle3nb.data.redact import redact
from eagle3nb.data.traffic import redact_request
from testkit.secret_corpus import ORDINARY, Case, corpus

ROOT = Path(__file__).resolve().parents[1]
# the last commit of eagle3nb/data/redact.py before issue 50's change (its content is the same up to that change)
BEFORE = "e5472ec"
KEPT = ("messages", "tools", "tool_choice")
WORDS = ("the model answers each request in turn and the cache keeps what it saw before so a second call costs less "
         "when the batch grows the latency rises but the throughput rises faster until memory runs out we measured "
         "it twice on two machines and wrote down every number with its spread key point token budget secret sauce "
         "password policy access review").split()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=float, default=2.0, help="megabytes of generated traffic (request bodies as JSON)")
    ap.add_argument("--repeats", type=int, default=5, help="passes over the traffic per side, alternating")
    ap.add_argument("--secret-every", type=int, default=20, help="one request in N holds a corpus secret")
    ap.add_argument("--before", default=BEFORE, help="the git revision whose eagle3nb/data/redact.py is the old side")
    ap.add_argument("--detectors", action="store_true", help="also weigh detect-secrets and presidio-analyzer")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def load_before(rev: str) -> types.ModuleType:
    """``eagle3nb/data/redact.py`` as it was at ``rev``, as a module of its own."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:eagle3nb/data/redact.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"--before {rev}: git show cannot read eagle3nb/data/redact.py there ({e}); run from a clone with "
                 f"its history, or name another revision")
    module = types.ModuleType("redact_before")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{rev}:eagle3nb/data/redact.py", "exec"), module.__dict__)
    return module


def _prose(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(w.capitalize() if i % 12 == 0 else w for i, w in enumerate(words)).replace(" the model", ". The "
                                                                                               "model") + "."


def _code(rng: random.Random) -> str:
    k = rng.randrange(1000)
    return (f"def step_{k}(batch, cache):\n    key = cache.get(batch.id)\n    if key is None:\n"
            f"        key = hash(tuple(batch.tokens[:{k % 64 + 1}]))\n    return model(batch, past=cache[key])\n"
            f"# request {rng.getrandbits(128):032x} took {rng.random() * 900:.1f} ms\n")


def traffic(mb: float, every: int, seed: int) -> list[dict]:
    """Chat-completions bodies adding up to ``mb`` megabytes: a system prompt, user turns of prose, code, numbers
    and the corpus's ordinary texts, tool calls with JSON arguments and their results; one in ``every`` requests
    holds a corpus secret, one in three of those split across content parts."""
    rng, cases, out, size = random.Random(seed), corpus(seed), [], 0
    tool = {"type": "function", "function": {"name": "lookup", "description": "look a record up by its key",
                                             "parameters": {"type": "object", "properties": {
                                                 "record": {"type": "string"}, "limit": {"type": "integer"}}}}}
    while size < mb * 1e6:
        i = len(out)
        user = rng.choice([_prose(rng, rng.randrange(40, 200)), _code(rng), rng.choice(ORDINARY),
                           f"Compute {rng.randrange(10**6)} * {rng.randrange(10**4)} and explain the steps."])
        content: str | list[dict] = user
        if i % every == 0:
            c = cases[(i // every) % len(cases)]
            user = f"{user}\n{c.text}"
            content = user
            if i % (3 * every) == 0:
                cut = user.index(c.secret) + len(c.secret) // 2
                content = [{"type": "text", "text": user[:cut]}, {"type": "text", "text": user[cut:]}]
        messages = [{"role": "system", "content": _prose(rng, 60)}, {"role": "user", "content": content}]
        body: dict = {"model": "m", "messages": messages, "temperature": 0.6, "user": f"u-{i}"}
        if i % 3 == 0:
            args = {"record": f"{rng.getrandbits(64):016x}", "limit": rng.randrange(1, 50), "note": _prose(rng, 20)}
            call = {"name": "lookup", "arguments": json.dumps(args)}
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": call}]},
                         {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(
                             {"found": True, "record": _prose(rng, 30), "updated": "2026-01-01T00:00:00Z"})},
                         {"role": "user", "content": _prose(rng, 15)}]
            body |= {"tools": [tool], "tool_choice": "auto"}
        out.append(body)
        size += len(json.dumps(body))
    return out


def strings(bodies: Sequence[dict]) -> list[str]:
    """Every string 05 keeps of the bodies, as it keeps them (content parts joined)."""
    out = []
    for b in bodies:
        for m in b["messages"]:
            m = openai_message(m)
            out.append(m["content"] or "")
            out += [c["function"]["arguments"] for c in m.get("tool_calls") or []]
        out += [json.dumps(b["tools"])] if b.get("tools") else []
    return out


def alternate(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each side's seconds ``repeats`` times, the sides in turn (A B A B ...): a change of load on the shared
    machine hits both alike."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            out[name].append(time.perf_counter() - t0)
    return out


def side_by_side(title: str, mb: float, old: Callable[[], object], new: Callable[[], object], repeats: int) -> float:
    """Prints both sides' MB/s (median, min..max) and the ratio of the new's time to the old's; returns the ratio."""
    t = alternate({"before": old, "after": new}, repeats)
    ratio = statistics.median(t["after"]) / statistics.median(t["before"])
    for name in ("before", "after"):
        rates = [mb / s for s in t[name]]
        print(f"  {title:<34} {name:<7} {statistics.median(rates):6.2f} MB/s ({min(rates):.2f}..{max(rates):.2f})")
    print(f"  {title:<34} time per MB, after / before: {ratio:.2f}x")
    return ratio


# Shapes our table does not list (what a second layer could add), no credential name around them, built as the
# corpus builds its fakes.
def outside(seed: int) -> list[Case]:
    r = random.Random(seed)

    def rand(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return "".join(r.choice(alphabet) for _ in range(n))

    return [
        Case("hex_in_quotes", 'x = "{s}"', rand(40, "0123456789abcdef")),
        Case("base64_in_quotes", "blob: '{s}'", rand(44, string.ascii_letters + string.digits + "+/")),
        Case("prose_letters_password", "my password is {s}, I think", "tulip" + "garden"),
        Case("pin_prose", "the pin is {s}", rand(4, "0123456789")),
        Case("password_no_separator", "ssh root@db01 with password {s} fails", rand(12)),
    ]


def _overlaps(c: Case, spans: list[tuple[int, int]]) -> bool:
    start = c.text.index(c.secret)
    return any(a < start + len(c.secret) and b > start for a, b in spans)


def detect_secrets_spans() -> Callable[[str], list[tuple[int, int]]] | str:
    """detect-secrets' default plugins and filters as its file scan runs them (not its ad-hoc string scan, whose
    eager mode flags every word), on the text's lines. It flags lines: a finding's value is the plugin's match group
    (``ghp`` for a GitHub token), so each finding is reported as its whole line."""
    try:
        from detect_secrets.core.scan import _process_line_based_plugins, get_filters
        from detect_secrets.settings import default_settings, get_settings
    except ImportError:
        return "not installed (.venv/bin/python -m pip install detect-secrets)"

    settings = contextlib.ExitStack()  # entered for the rest of the run (held by spans: closed when collected)
    settings.enter_context(default_settings())
    get_settings().disable_filters("detect_secrets.filters.common.is_invalid_file")  # no file: a message
    get_filters.cache_clear()

    def spans(text: str, _held: contextlib.ExitStack = settings) -> list[tuple[int, int]]:
        lines, starts = text.splitlines() or [text], [0]
        for line in lines[:-1]:
            starts.append(text.index(line, starts[-1]) + len(line))
        return [(starts[s.line_number - 1], starts[s.line_number - 1] + len(lines[s.line_number - 1]) + 1)
                for s in _process_line_based_plugins(list(enumerate(lines, 1)), "message.txt")]

    return spans


def presidio_spans() -> Callable[[str], list[tuple[int, int]]] | str:
    """presidio-analyzer's recognizers (personal data: e-mail, phone, card, IBAN, IP, URL, ...): with its default
    spaCy model when installed, else its pattern recognizers on a blank spaCy pipeline (names and places need the
    model's NER)."""
    try:
        import spacy
        from presidio_analyzer import AnalyzerEngine
        from presidio_analyzer.nlp_engine import SpacyNlpEngine
    except ImportError:
        return "not installed (.venv/bin/python -m pip install presidio-analyzer)"
    if spacy.util.is_package("en_core_web_lg"):
        engine = AnalyzerEngine()
    else:
        print("  presidio: spaCy model en_core_web_lg is not installed and cannot be (presidio downloads it from "
              "GitHub at first use: ConnectionError here); its pattern recognizers run on a blank spaCy pipeline")
        blank = tempfile.mkdtemp(prefix="spacy-blank-")
        spacy.blank("en").to_disk(blank)
        engine = AnalyzerEngine(nlp_engine=SpacyNlpEngine(models=[{"lang_code": "en", "model_name": blank}]),
                                supported_languages=["en"])

    def spans(text: str) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in engine.analyze(text=text, language="en")]

    return spans


def weigh(name: str, spans: Callable[[str], list[tuple[int, int]]] | str, texts: list[str], mb: float) -> None:
    """One detector beside ours: the corpus, the shapes outside our table, ordinary text and its speed."""
    if isinstance(spans, str):
        print(f"{name}: {spans}")
        return
    cases, extra = corpus(0), outside(0)
    got = [c for c in cases if _overlaps(c, spans(c.text))]
    ours_extra = {c.kind for c in extra if c.secret not in redact(c.text)[0]}
    theirs_extra = {c.kind for c in extra if _overlaps(c, spans(c.text))}
    false = [t for t in ORDINARY if spans(t)]
    t0 = time.perf_counter()
    for t in texts:
        spans(t)
    rate = mb / (time.perf_counter() - t0)
    print(f"{name}:\n  corpus: {len(got)} of {len(cases)} cases ({len({c.kind for c in got})} of "
          f"{len({c.kind for c in cases})} kinds); missed kinds: "
          f"{sorted({c.kind for c in cases} - {c.kind for c in got}) or 'none'}\n"
          f"  outside our table ({len(extra)} shapes): it finds {sorted(theirs_extra) or 'none'}; we find "
          f"{sorted(ours_extra) or 'none'}\n  ordinary texts flagged: {len(false)} of {len(ORDINARY)}\n"
          f"  speed: {rate:.3f} MB/s on the traffic's kept strings ({mb:.2f} MB)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before = load_before(args.before)
    t0 = time.perf_counter()
    bodies = traffic(args.mb, args.secret_every, args.seed)
    texts = strings(bodies)
    mb = sum(len(json.dumps(b)) for b in bodies) / 1e6
    text_mb = sum(len(t) for t in texts) / 1e6
    print(f"traffic: {len(bodies)} requests, {mb:.2f} MB as JSON, {text_mb:.2f} MB of kept strings; before = "
          f"{args.before}:eagle3nb/data/redact.py ({time.perf_counter() - t0:.1f} s to build)")

    def old_requests() -> None:
        for b in bodies:
            kept, _ = before.redact_value({k: b[k] for k in KEPT if b.get(k) is not None})
            [openai_message(m) for m in kept["messages"]]

    def new_requests() -> None:
        for b in bodies:
            redact_request([openai_message(m) for m in b["messages"]], b.get("tools"), b.get("tool_choice"))

    found_old = sum(sum(before.redact(t)[1].values()) for t in texts)
    found_new = sum(sum(redact(t)[1].values()) for t in texts)
    print(f"secrets found in the kept strings: before {found_old}, after {found_new} "
          f"({len(bodies) // args.secret_every + 1} corpus secrets planted)")
    side_by_side("redact, every kept string", text_mb, lambda: [before.redact(t) for t in texts],
                 lambda: [redact(t) for t in texts], args.repeats)
    ratio = side_by_side("a request as 05 reads it", mb, old_requests, new_requests, args.repeats)
    print(f"target: within 2x of the old's time per MB: {'met' if ratio <= 2 else 'MISSED'} ({ratio:.2f}x)")
    if args.detectors:
        weigh("detect-secrets", detect_secrets_spans(), texts, text_mb)
        weigh("presidio-analyzer", presidio_spans(), texts, text_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
