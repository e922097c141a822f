"""The checks against the target and its server: 0. family, 1. server, 2. token stream, 3. thinking."""

from __future__ import annotations

import json
from collections import Counter

from eagle3nb.data.stream import StreamError, build
from eagle3nb.doctor.checks.common import ENGINES, no_parser_fix, target_family, worst_of
from eagle3nb.doctor.context import PROBE_QUESTION, STREAM_PROBES, Context, Unavailable
from eagle3nb.doctor.result import FAIL, SKIP, WARN, CheckResult
from eagle3nb.families import VLLM_EAGLE3_RELEASE, FamilyError
from eagle3nb.params import ParamsError
from eagle3nb.synth.client import FatalServerError, GaveUp
from eagle3nb.vllm_config import TESTED_VERSION, version_notes

# -- 0. family ------------------------------------------------------------------------------------------------------

def check_family(ctx: Context) -> CheckResult:
    """The target's family (its markers, switch and parser) and whether the serving engine serves an EAGLE-3
    draft for it: a target it cannot serve is refused before any work."""
    try:
        fam = ctx.family
    except FamilyError as e:
        return worst_of("family", [(FAIL, str(e), "set family: <name> in the run's common.yaml")], "", {})
    engine = ctx.serving_engine
    details = {"family": fam.name, "engine": engine, "reasoning": fam.reasoning, "vllm_parser": fam.vllm_parser,
               "eagle3": fam.serves_eagle3(engine)}
    tags = f"{fam.think_start}...{fam.think_end}" if fam.think_tags else fam.reasoning
    said = (f"{ctx.model_dir.name}: family {fam.name} (reasoning {tags}, switch "
            f"{fam.switch.kwarg if fam.switch else 'none'}, end of turn {fam.end_of_turn or 'eos'}); "
            f"{ENGINES[engine]} {'serves' if fam.serves_eagle3(engine) else 'does not serve'} its EAGLE-3 drafts")
    if fam.serves_eagle3(engine):
        return worst_of("family", [], said, details)
    can = [e for e in ENGINES if fam.serves_eagle3(e)]
    why = f"vLLM {VLLM_EAGLE3_RELEASE}: its model class lacks the EAGLE-3 interface" if engine == "vllm" else engine
    fix = (f"serve the draft with {' or '.join(ENGINES[e] for e in can)} (--serving-engine {can[0]}); a draft "
           f"{ENGINES[engine]} cannot load wastes the run" if can else "no engine eagle3nb knows serves it")
    return worst_of("family", [(FAIL, f"{ENGINES[engine]} cannot serve an EAGLE-3 draft for the {fam.name} family "
                                     f"({why})", fix)], said, details)


# -- 1. server --------------------------------------------------------------------------------------------------

def check_server(ctx: Context) -> CheckResult:
    P1 = ctx.p("01_synth")
    problems, measured, details = [], [], {"urls": []}
    for url in ctx.server_urls():
        try:
            model, names = ctx.served_model(url)
        except GaveUp as e:  # after 01_synth's retries: not a passing hiccup
            problems.append((FAIL, f"{url}: not reachable ({e})",
                             f"start the server (e.g. `vllm serve MODEL` with {target_family(ctx).parser_flag()}) or "
                             f"fix vllm_url in {P1.params_file or '01_synth params'}"))
            continue
        except (FatalServerError, ParamsError) as e:  # the message says what to fix
            problems.append((FAIL, f"{url}: {e}", ""))
            continue
        if model not in names:
            problems.append((FAIL, f"{url} serves {names}, not {model!r}",
                             f"set served_model_name to one of {names} (or null to take the first)"))
            continue
        try:
            ctx.probe_all(url, P1.thinking)
            pr = ctx.probe(url, PROBE_QUESTION, P1.thinking)
        except Unavailable as e:
            problems.append((FAIL, str(e), "check the server log; the probe is a plain chat completion with "
                                           "chat_template_kwargs and return_token_ids"))
            continue
        fields = [f for f in ("reasoning", "reasoning_content") if pr["fields"].get(f)]
        engine = ctx.engine(url)
        details["urls"].append({"url": url, "model": model, "reasoning_fields": fields, **engine, **pr})
        problems += _engine_problems(url, engine)
        said = f"{url} ({_engine_name(engine)}) model {model!r}: {PROBE_QUESTION!r} -> "
        if P1.thinking and pr["source"] in ("reasoning", "reasoning_content"):
            measured.append(f"{said}reasoning {len(pr['reasoning'])} chars in message.{' and message.'.join(fields)}, "
                            f"content {len(pr['content'] or '')} chars")
        elif P1.thinking and pr["source"] == "inline":
            problems.append((FAIL, f"{said}message.reasoning empty, the think text is inline in message.content "
                                   f"({pr['raw_content'][:60]!r}...): the server runs without a reasoning parser",
                             no_parser_fix(target_family(ctx))))
        elif P1.thinking:
            why = (f"no reasoning within {pr['max_tokens']} tokens (finish_reason=length)"
                   if pr["finish_reason"] == "length" else "no reasoning at all")
            problems.append((FAIL, f"{said}{why}; content {(pr['content'] or '')[:60]!r}",
                             f"{no_parser_fix(target_family(ctx))}; check that {pr['kwarg']!r} is the template kwarg "
                             f"your model reads (the thinking_kwarg parameter; docs/families.md)"))
        elif pr["source"] != "none":
            problems.append((FAIL, f"{said}thinking is off ({pr['kwarg']}: false) but reasoning came back "
                                   f"(message.{pr['source']})",
                             f"the chat template ignores {pr['kwarg']!r}: set thinking_kwarg to the kwarg it reads "
                             f"(or family: the target's, docs/families.md)"))
        else:
            measured.append(f"{said}thinking off, no reasoning, content {len(pr['content'] or '')} chars")
    return worst_of("server", problems, "; ".join(measured), details)


def _engine_name(engine: dict) -> str:
    name = {"vllm": "vLLM", "eagle3nb": "embedded server"}.get(engine["engine"] or "", engine["engine"] or "engine ?")
    return f"{name} {engine['version']}" if engine["version"] else name


def _engine_problems(url: str, engine: dict) -> list[tuple[str, str, str]]:
    """A vLLM other than the release eagle3nb is tested against: a warning naming what is known to differ."""
    if engine["engine"] != "vllm" or not engine["version"]:
        return []
    notes = version_notes(engine["version"])
    if not notes:
        return []
    return [(WARN, f"{url} runs vLLM {engine['version']}, eagle3nb is tested against {TESTED_VERSION}: "
                   + "; ".join(notes),
             f"serve with vLLM {TESTED_VERSION} (`pip install vllm=={TESTED_VERSION}`), or rehearse this recipe "
             "on your release first")]


# -- 2. token stream --------------------------------------------------------------------------------------------

def _first_diff(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_token_stream(ctx: Context) -> CheckResult:
    try:
        tpl = ctx.template
    except StreamError as e:  # no tokenizer (e.g. one that needs its own code while trust_remote_code is off)
        return worst_of("token_stream", [(FAIL, str(e), "")], "", {})
    tok = tpl.tokenizer
    problems, measured, details = [], [], {}
    tags = tpl.family.think_tags or ()
    for t in tags:
        ids = tok.encode(t, add_special_tokens=False)
        details[t] = ids
        if len(ids) != 1:
            problems.append((FAIL, f"{t!r} encodes to {len(ids)} tokens {tok.convert_ids_to_tokens(ids)}",
                             "load the target's own tokenizer (Kimi: trust_remote_code: true, the tiktoken backend) "
                             "whose think tokens are single special tokens; other backends split them and every "
                             "training sample is then off from what the server generates"))
    if tags and not problems:
        measured.append(f"{tags[0]}/{tags[1]} are single tokens {details[tags[0]]}/{details[tags[1]]}")
    elif not tags:
        measured.append(f"the {tpl.family.name} family marks no reasoning with think tokens")
    if not ctx.use_server:
        measured.append("server streams not compared (server not part of this check-up)")
        return worst_of("token_stream", problems, "; ".join(measured), details)
    url = ctx.server_urls()[0]
    thinking = ctx.p("01_synth").thinking
    compared, prompts_only, no_ids = 0, 0, 0
    for q in STREAM_PROBES:
        try:
            pr = ctx.probe(url, q, thinking)
        except Unavailable as e:
            measured.append(f"server streams not compared: {e}")
            break
        if pr["prompt_token_ids"] is None or pr["token_ids"] is None:
            no_ids += 1
            continue
        server = build(tpl, pr["messages"], pr["reasoning"], pr["content"], pr["finish_reason"],
                       pr["prompt_token_ids"], pr["token_ids"])
        try:
            ours = build(tpl, pr["messages"], pr["reasoning"], pr["content"], pr["finish_reason"], None, None)
        except StreamError as e:
            problems.append((FAIL, f"{q!r}: cannot re-render the conversation ({e})", ""))
            continue
        a, b = server["input_ids"], ours["input_ids"]
        # An answer cut by max_tokens, or reasoning the model never closed, has no faithful re-rendering:
        # compare its prompt only.
        if pr["finish_reason"] != "stop" or (thinking and tpl.think_ids[1] is not None
                                             and tpl.think_ids[1] not in pr["token_ids"]):
            prompts_only += 1
            n = len(pr["prompt_token_ids"])
            a, b = a[:n], b[:n]
        else:
            compared += 1
        if a != b:
            i = _first_diff(a, b)
            where = "prompt" if i < len(pr["prompt_token_ids"]) else "completion"
            details.setdefault("mismatches", []).append({"question": q, "position": i, "server": a[i:i + 8],
                                                         "ours": b[i:i + 8]})
            problems.append((FAIL, f"{q!r}: server ids differ from our chat-template rendering at token {i} "
                                   f"({where}): server {tpl.decode(a[i:i + 4])!r} vs ours {tpl.decode(b[i:i + 4])!r}",
                             "use the same tokenizer and chat template as the server (same model_path folder; Kimi "
                             "needs trust_remote_code: true); 01_synth keeps the server's ids, but serving-time "
                             "prompts and the data then disagree"))
    if no_ids:
        problems.append((WARN, f"the server returned no token ids for {no_ids} probe(s)",
                         "use a server that supports `return_token_ids` (vLLM >= 0.10.2, SGLang); 01_synth then "
                         "falls back to re-rendering text, which is only as exact as this check"))
    if compared or prompts_only:
        measured.append(f"server ids == our rendering: {compared} whole conversation(s), {prompts_only} "
                        f"prompt(s) only (answer cut or reasoning unclosed)")
    return worst_of("token_stream", problems, "; ".join(measured), details)


# -- 3. thinking --------------------------------------------------------------------------------------------------

def check_thinking(ctx: Context) -> CheckResult:
    P1 = ctx.p("01_synth")
    problems, details = [], {}
    try:
        modes = Counter(bool(s.get("thinking")) for s in ctx.samples if s["status"] == "ok")
    except Unavailable:
        modes = Counter()
    if modes:
        data = modes.most_common(1)[0][0]
        data_said = f"data thinking={'on' if data else 'off'} ({modes[data]}/{sum(modes.values())} ok samples)"
        if len(modes) > 1:
            problems.append((WARN, f"the data mixes thinking on ({modes[True]}) and off ({modes[False]})",
                             "train on one mode: the one serving uses"))
        if data != P1.thinking:
            problems.append((WARN, f"01_synth now says thinking={P1.thinking}, the data was made with {data}",
                             "put thinking back, or regenerate into a new output_dir"))
    else:
        data = P1.thinking
        data_said = f"planned data thinking={'on' if data else 'off'} (01_synth params; no samples yet)"
    details["data_thinking"] = data
    if ctx.serving_thinking is not None:
        serving, how = ctx.serving_thinking, "as given"
    elif ctx.use_server and (pr := _default_probe(ctx)) is not None:
        serving, how = pr["source"] != "none", "the server's default (probe without chat_template_kwargs)"
    elif "04_acceptance" in ctx.params:
        serving, how = ctx.params["04_acceptance"].thinking, "04_acceptance's thinking, as served"
    else:
        if problems:
            return worst_of("thinking", problems, data_said, details)
        return CheckResult("thinking", SKIP, f"{data_said}; serving-time mode unknown",
                           "pass --serving-thinking on|off (or run the full check-up, which probes the server)",
                           details)
    details["serving_thinking"] = serving
    said = f"{data_said}; serving thinking={'on' if serving else 'off'} ({how})"
    if serving != data:
        problems.append((FAIL, f"the drafter learns {'thinking' if data else 'non-thinking'} output but serving "
                               f"runs with thinking {'on' if serving else 'off'}",
                         f"make them agree: regenerate the data with thinking: {str(serving).lower()} in "
                         f"01_synth, or serve with chat_template_kwargs {_serving_kwargs(ctx, data)}; a drafter "
                         f"trained on one mode collapses on the other"))
    return worst_of("thinking", problems, said, details)


def _serving_kwargs(ctx: Context, thinking: bool) -> str:
    """The chat_template_kwargs that ask the target for ``thinking``, as JSON-ish text ({'thinking': true})."""
    kw = target_family(ctx).template_kwargs(thinking, ctx.p("01_synth").thinking_kwarg)
    return "{" + ", ".join(f"{k!r}: {json.dumps(v)}" for k, v in kw.items()) + "}"


def _default_probe(ctx: Context) -> dict | None:
    try:
        return ctx.probe(ctx.server_urls()[0], PROBE_QUESTION, None)
    except Unavailable:
        return None


