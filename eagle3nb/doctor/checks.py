"""The nine checks. Each takes the run's ``Context`` and returns one ``CheckResult``; raising ``Unavailable``
means "nothing to check yet" (skip, with the reason). Thresholds are named constants at the top so a reader
can argue with them."""

from __future__ import annotations

import json
import shutil
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.data.stream import StreamError, build
from eagle3nb.doctor.context import PROBE_QUESTION, STREAM_PROBES, Context, Subset, Unavailable
from eagle3nb.doctor.result import FAIL, PASS, SKIP, WARN, CheckResult
from eagle3nb.families import VLLM_EAGLE3_RELEASE, Family, FamilyError
from eagle3nb.formulas import speedup
from eagle3nb.layers import LayerIdError, default_aux_layer_ids, from_sglang, to_sglang
from eagle3nb.layers import check_layer_ids as validate_layer_ids
from eagle3nb.params import ParamsError
from eagle3nb.synth.client import FatalServerError, GaveUp
from eagle3nb.vllm_config import TESTED_VERSION, version_notes

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
# data_health: shares of samples (of all ids) above which the data is suspect / unusable
TRUNCATED_WARN, TRUNCATED_FAIL = 0.05, 0.30
NO_REASONING_WARN, NO_REASONING_FAIL = 0.01, 0.10
ERROR_WARN, ERROR_FAIL = 0.02, 0.20
# share of loss-masked (trained-on) tokens beyond max_length
CUT_WARN, CUT_FAIL = 0.05, 0.50
# shapes_vocab: share of the target's argmax tokens (held-out, loss-masked) inside the draft vocabulary
COVERAGE_WARN = 0.90
COVERAGE_TOKENS = 4096
# disk: projected bytes as a share of free space
DISK_WARN = 0.8
# draft_sanity: position-0 acceptance (greedy) on a few held-out samples
SANITY_SAMPLES, SANITY_K = 8, 3
CHANCE_MARGIN = 0.10  # a draft is "near chance" below chance + this
# warn when the predicted speedup at typical costs (a 1-layer draft of a deep target) is marginal
TYPICAL_COST_RATIO, TYPICAL_OVERHEAD, SPEEDUP_WARN = 0.05, 0.10, 1.2


def _result(name: str, problems: list[tuple[str, str, str]], measured: str, details: dict) -> CheckResult:
    """Worst of ``problems`` ((status, what, fix) triples) or a pass with ``measured``."""
    fails = [p for p in problems if p[0] == FAIL]
    worst = fails or problems
    if not worst:
        return CheckResult(name, PASS, measured, "", details)
    status = FAIL if fails else WARN
    what = "; ".join(p[1] for p in worst)
    fix = "; ".join(dict.fromkeys(p[2] for p in worst if p[2]))
    return CheckResult(name, status, f"{what} ({measured})" if measured else what, fix, details)


# -- 1. server --------------------------------------------------------------------------------------------------

def no_parser_fix(family: Family) -> str:
    return (f"start the server with the {family.name} family's reasoning parser: vLLM {family.parser_flag('vllm')}, "
            f"SGLang {family.parser_flag('sglang')} (docs/families.md); then re-run the doctor")


def _family(ctx: Context) -> Family:
    """The target's family, or the fix when it cannot be told."""
    try:
        return ctx.family
    except FamilyError as e:
        raise Unavailable(str(e)) from None


# -- 0. family ------------------------------------------------------------------------------------------------------

def check_family(ctx: Context) -> CheckResult:
    """The target's family (its markers, switch and parser) and whether the serving engine serves an EAGLE-3
    draft for it: a target it cannot serve is refused before any work."""
    try:
        fam = ctx.family
    except FamilyError as e:
        return _result("family", [(FAIL, str(e), "set family: <name> in the run's common.yaml")], "", {})
    engine = ctx.serving_engine
    details = {"family": fam.name, "engine": engine, "reasoning": fam.reasoning, "vllm_parser": fam.vllm_parser,
               "eagle3": fam.serves_eagle3(engine)}
    tags = f"{fam.think_start}...{fam.think_end}" if fam.think_tags else fam.reasoning
    said = (f"{ctx.model_dir.name}: family {fam.name} (reasoning {tags}, switch "
            f"{fam.switch.kwarg if fam.switch else 'none'}, end of turn {fam.end_of_turn or 'eos'}); "
            f"{ENGINES[engine]} {'serves' if fam.serves_eagle3(engine) else 'does not serve'} its EAGLE-3 drafts")
    if fam.serves_eagle3(engine):
        return _result("family", [], said, details)
    can = [e for e in ENGINES if fam.serves_eagle3(e)]
    why = f"vLLM {VLLM_EAGLE3_RELEASE}: its model class lacks the EAGLE-3 interface" if engine == "vllm" else engine
    fix = (f"serve the draft with {' or '.join(ENGINES[e] for e in can)} (--serving-engine {can[0]}); a draft "
           f"{ENGINES[engine]} cannot load wastes the run" if can else "no engine eagle3nb knows serves it")
    return _result("family", [(FAIL, f"{ENGINES[engine]} cannot serve an EAGLE-3 draft for the {fam.name} family "
                                     f"({why})", fix)], said, details)


def check_server(ctx: Context) -> CheckResult:
    P1 = ctx.p("01_synth")
    problems, measured, details = [], [], {"urls": []}
    for url in ctx.server_urls():
        try:
            model, names = ctx.served_model(url)
        except GaveUp as e:  # after 01_synth's retries: not a passing hiccup
            problems.append((FAIL, f"{url}: not reachable ({e})",
                             f"start the server (e.g. `vllm serve MODEL` with {_family(ctx).parser_flag()}) or fix "
                             f"vllm_url "
                             f"in {P1.params_file or '01_synth params'}"))
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
                             no_parser_fix(_family(ctx))))
        elif P1.thinking:
            why = (f"no reasoning within {pr['max_tokens']} tokens (finish_reason=length)"
                   if pr["finish_reason"] == "length" else "no reasoning at all")
            problems.append((FAIL, f"{said}{why}; content {(pr['content'] or '')[:60]!r}",
                             f"{no_parser_fix(_family(ctx))}; check that {pr['kwarg']!r} is the template kwarg "
                             f"your model reads (the thinking_kwarg parameter; docs/families.md)"))
        elif pr["source"] != "none":
            problems.append((FAIL, f"{said}thinking is off ({pr['kwarg']}: false) but reasoning came back "
                                   f"(message.{pr['source']})",
                             f"the chat template ignores {pr['kwarg']!r}: set thinking_kwarg to the kwarg it reads "
                             f"(or family: the target's, docs/families.md)"))
        else:
            measured.append(f"{said}thinking off, no reasoning, content {len(pr['content'] or '')} chars")
    return _result("server", problems, "; ".join(measured), details)


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
        return _result("token_stream", [(FAIL, str(e), "")], "", {})
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
        return _result("token_stream", problems, "; ".join(measured), details)
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
    return _result("token_stream", problems, "; ".join(measured), details)


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
            return _result("thinking", problems, data_said, details)
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
    return _result("thinking", problems, said, details)


def _serving_kwargs(ctx: Context, thinking: bool) -> str:
    """The chat_template_kwargs that ask the target for ``thinking``, as JSON-ish text ({'thinking': true})."""
    kw = _family(ctx).template_kwargs(thinking, ctx.p("01_synth").thinking_kwarg)
    return "{" + ", ".join(f"{k!r}: {json.dumps(v)}" for k, v in kw.items()) + "}"


def _default_probe(ctx: Context) -> dict | None:
    try:
        return ctx.probe(ctx.server_urls()[0], PROBE_QUESTION, None)
    except Unavailable:
        return None


# -- 4. layer ids -------------------------------------------------------------------------------------------------

def check_layer_ids(ctx: Context) -> CheckResult:
    L = ctx.target_dims["num_layers"]
    problems, details = [], {"num_layers": L, "engine": ctx.serving_engine}
    try:
        meta = ctx.hidden().meta
        data, src = list(meta["layer_ids"]), "hidden-state data"
        if meta.get("num_layers") not in (None, L):
            problems.append((FAIL, f"the data was made from a {meta['num_layers']}-layer model, the target has {L}",
                             "re-run 02_hidden_states with the target 01_synth sampled from"))
    except Unavailable:
        planned = getattr(ctx.params.get("02_hidden_states"), "aux_layer_ids", None)
        data, src = (list(planned), "02 params") if planned else (default_aux_layer_ids(L), "EAGLE-3 default")
    details["data_ids"] = data
    try:
        validate_layer_ids(data, L)
    except LayerIdError as e:
        problems.append((FAIL, str(e), ""))
    said = [f"{src} {data} (HF/vLLM; SGLang {to_sglang(data)}) for {L} layers"]
    engine_key = "top-level " if ctx.serving_engine == "vllm" else "eagle_config."
    for label, d in ctx.drafts:
        cfg = json.loads((d / "config.json").read_text())
        top = cfg.get("eagle_aux_hidden_state_layer_ids")
        nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        details[label] = {"dir": str(d), "top_level": top, "eagle_config": nested}
        ids = top if ctx.serving_engine == "vllm" else nested
        if top is not None and nested is not None and list(top) != list(nested):
            problems.append((FAIL, f"{label} config.json disagrees with itself: top-level {top}, eagle_config {nested}",
                             f"write the same ids in both places ({d / 'config.json'})"))
        if ids is None:
            default = f" {default_aux_layer_ids(L)}" if ctx.serving_engine == "vllm" else ""
            problems.append((FAIL, f"{label} config.json has no {engine_key}eagle_aux_hidden_state_layer_ids: "
                                   f"{ENGINES[ctx.serving_engine]} would silently use its default{default}",
                             f"write eagle_aux_hidden_state_layer_ids {data} (vLLM convention) at the top level and in "
                             f"eagle_config of {d / 'config.json'}" if ctx.serving_engine == "vllm" else
                             f"write eagle_aux_hidden_state_layer_ids {to_sglang(data)} (SGLang's output-of-layer ids) "
                             f"in eagle_config of {d / 'config.json'}"))
            continue
        ids = [int(i) for i in ids]
        hf = ids if ctx.serving_engine == "vllm" else from_sglang(ids)
        said.append(f"{label} {ids} ({ENGINES[ctx.serving_engine]} -> HF {hf})")
        if hf == data:
            continue
        if ctx.serving_engine == "vllm" and from_sglang(ids) == data:
            problems.append((FAIL, f"{label} ids {ids} are the SGLang/SpecForge (output-of-layer) numbering of the "
                                   f"data's layers {data}; vLLM reads them as input-of-layer ids, so every aux state "
                                   f"comes from one layer too early (the SGLang/vLLM off-by-one)",
                             f"write {data} (vLLM convention) into {d / 'config.json'} (top level and eagle_config), "
                             f"or serve with SGLang"))
        elif ctx.serving_engine == "sglang" and ids == data:
            problems.append((FAIL, f"{label} ids {ids} are vLLM (input-of-layer) ids; SGLang adds +1 and reads "
                                   f"layers {from_sglang(ids)}, one too late (the SGLang/vLLM off-by-one)",
                             f"for SGLang write {to_sglang(data)} into eagle_config of {d / 'config.json'}, or serve "
                             f"with vLLM"))
        else:
            problems.append((FAIL, f"{label} reads layers {hf} but the data holds {data}",
                             "train the draft on data extracted at its layers (02 aux_layer_ids), or fix its config"))
    return _result("layer_ids", problems, "; ".join(said), details)


# -- 5. shapes and vocab ------------------------------------------------------------------------------------------

def vocab_problems(d2t, t2d, vocab_size: int, where: str) -> list[str]:
    """What is wrong with a d2t/t2d pair (empty when they agree): sizes, range, order, t2d[d2t[i]+i]."""
    import torch

    out = []
    if t2d.numel() != vocab_size:
        out.append(f"{where} t2d has {t2d.numel()} entries, the target vocab {vocab_size}")
    n_in = int(t2d.sum())
    if n_in != d2t.numel():
        out.append(f"{where} t2d marks {n_in} ids but d2t has {d2t.numel()}")
    target = torch.arange(d2t.numel()) + d2t.long()
    outside = (target < 0) | (target >= t2d.numel())
    if outside.any():
        out.append(f"{where} d2t maps {int(outside.sum())} draft ids outside the target vocab")
        return out
    missing = ~t2d[target].bool()
    if missing.any():
        i = int(missing.nonzero()[0])
        out.append(f"{where} d2t and t2d disagree: t2d[d2t[i]+i] false for {int(missing.sum())} of {d2t.numel()} "
                   f"draft ids (first: draft {i} -> target {int(target[i])})")
    elif d2t.numel() > 1 and not bool((target[1:] > target[:-1]).all()):
        out.append(f"{where} d2t does not map draft ids to increasing target ids")
    return out


def _draft_tensors(d: Path) -> dict[str, Any]:
    """Shapes of every tensor of a draft checkpoint, and its d2t/t2d (read raw: a broken checkpoint must be
    described, not refused)."""
    from safetensors import safe_open

    shapes, vocab = {}, {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k] = list(st.get_slice(k).get_shape())
                if k in ("d2t", "t2d"):
                    vocab[k] = st.get_tensor(k)
    return {"shapes": shapes, **vocab}


def _draft_shape_problems(label: str, d: Path, cfg: dict, t: dict, H: int, V: int) -> list[tuple[str, str, str]]:
    """One draft checkpoint against the target's sizes: fc input, lm_head rows, vocab map."""
    problems = []
    shapes = t["shapes"]
    th = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    dv = cfg.get("draft_vocab_size")
    fix = f"train the draft for this target (03_train) or pick a checkpoint made for it ({d})"
    if th != H:
        problems.append((FAIL, f"{label} target_hidden_size {th} != target hidden {H}", fix))
    if cfg.get("vocab_size") != V:
        problems.append((FAIL, f"{label} vocab_size {cfg.get('vocab_size')} != target vocab {V}", fix))
    fc = shapes.get("fc.weight")
    if fc is None or fc[1] != 3 * H:
        problems.append((FAIL, f"{label} fc.weight {fc} does not take 3 x {H} = {3 * H} inputs", fix))
    head = shapes.get("lm_head.weight")
    if head is None or head[0] != dv:
        problems.append((FAIL, f"{label} lm_head.weight {head} does not have draft_vocab_size {dv} rows", fix))
    if "d2t" not in t or "t2d" not in t:
        problems.append((FAIL, f"{label} has no d2t/t2d tensors", f"export the draft with its vocab map ({d})"))
        return problems
    for p in vocab_problems(t["d2t"], t["t2d"], V, label):
        problems.append((FAIL, p, f"re-export {d} with the d2t/t2d of the data it was trained on "
                                  f"(02's draft_vocab.safetensors)"))
    if t["d2t"].numel() != dv:
        problems.append((FAIL, f"{label} d2t has {t['d2t'].numel()} entries, draft_vocab_size {dv}", fix))
    return problems


def check_shapes_vocab(ctx: Context) -> CheckResult:
    dims = ctx.target_dims
    H, V = dims["hidden_size"], dims["vocab_size"]
    problems, said, details = [], [f"target H={H} V={V}"], {"target": dims}
    data_t2d = cover_t2d = None
    try:
        hs = ctx.hidden()
        meta = hs.meta
        if (meta["hidden_size"], meta["vocab_size"]) != (H, V):
            problems.append((FAIL, f"hidden-state data has H={meta['hidden_size']} V={meta['vocab_size']}, the target "
                                   f"H={H} V={V}", "re-run 02_hidden_states with the target 01_synth sampled from"))
        data_t2d = cover_t2d = hs.t2d
        for p in vocab_problems(hs.d2t, hs.t2d, V, "data"):
            problems.append((FAIL, p, "re-run 02_hidden_states (its draft_vocab.safetensors is inconsistent)"))
        said.append(f"data draft vocab {hs.d2t.numel()}")
    except Unavailable:
        hs = None
    for label, d in ctx.drafts:
        cfg = json.loads((d / "config.json").read_text())
        t = _draft_tensors(d)
        fc, head, dv = t["shapes"].get("fc.weight"), t["shapes"].get("lm_head.weight"), cfg.get("draft_vocab_size")
        problems += _draft_shape_problems(label, d, cfg, t, H, V)
        if "d2t" not in t or "t2d" not in t:
            continue
        if label == "draft":
            if data_t2d is not None and not _same(t["t2d"], data_t2d):
                problems.append((WARN, "the draft's vocabulary differs from the data's", "train and evaluate the "
                                 "draft on data with the same draft_vocab.safetensors"))
            cover_t2d = t["t2d"]
        details[label] = {"dir": str(d), "fc": fc, "lm_head": head, "draft_vocab_size": dv}
        said.append(f"{label} fc {fc} draft vocab {dv}")
    if hs is None and not ctx.drafts:
        raise Unavailable("no hidden-state data and no draft checkpoint yet (run 02_hidden_states / 03_train)")
    if cover_t2d is not None and (ctx.eval_dir / "index.json").exists():
        cov, n = _argmax_coverage(ctx, cover_t2d)
        details["coverage"] = cov
        said.append(f"draft vocab covers {cov:.1%} of {n} held-out target argmax tokens")
        if cov < COVERAGE_WARN:
            problems.append((WARN, f"the draft vocab covers only {cov:.1%} of the target's argmax tokens",
                             "raise draft_vocab_size in 02_hidden_states (positions whose target token is outside "
                             "the draft vocab can never be accepted)"))
    return _result("shapes_vocab", problems, "; ".join(said), details)


def _same(a, b) -> bool:
    return a.shape == b.shape and bool((a.bool() == b.bool()).all())


def _argmax_coverage(ctx: Context, t2d) -> tuple[float, int]:
    """Share of the target's argmax tokens on loss-masked held-out positions that the draft vocab contains."""
    data = ctx.heldout()
    inside = total = 0
    for i in range(len(data)):
        item = data[i]
        am = data.target_argmax(item)[item["loss_mask"].bool()]
        inside += int(t2d[am].sum())
        total += am.numel()
        if total >= COVERAGE_TOKENS:
            break
    return (inside / total if total else 1.0), total


# -- 6. data health -------------------------------------------------------------------------------------------------

def check_data_health(ctx: Context) -> CheckResult:
    records, samples = ctx.records, ctx.samples
    n = len(samples)
    status = Counter(s["status"] for s in samples)
    share = {k: status[k] / n for k in ("ok", "truncated", "no_reasoning", "error")}
    details: dict[str, Any] = {"samples": n, "status": dict(status)}
    problems = []
    P1 = ctx.p("01_synth")
    for key, warn, fail, fix in [
        ("truncated", TRUNCATED_WARN, TRUNCATED_FAIL,
         f"raise max_completion_tokens in 01_synth (now {P1.max_completion_tokens}): truncated answers are dropped"),
        ("no_reasoning", NO_REASONING_WARN, NO_REASONING_FAIL,
         "the server is not returning reasoning: run the server check (reasoning parser, thinking kwarg)"),
        ("error", ERROR_WARN, ERROR_FAIL, "read the error field of those samples; re-run 01_synth to retry them"),
    ]:
        if share[key] > warn:
            problems.append((FAIL if share[key] > fail else WARN, f"{share[key]:.0%} {key}", fix))
    ok_ids = Counter(r["id"] for r in records if r["status"] == "ok")
    dups = [i for i, c in ok_ids.items() if c > 1]
    details["duplicate_ok_ids"] = dups[:20]
    if dups:
        problems.append((FAIL, f"{len(dups)} ids recorded ok more than once (e.g. {dups[0]!r})",
                         "training would count them twice; move the duplicate files away and resume 01_synth"))
    ok = [s for s in samples if s["status"] == "ok"]
    kinds = _mismatch_kinds(ctx, [s for s in ok if s.get("ids_match") is False])
    details["ids_mismatch"] = kinds
    if kinds["text"]:
        problems.append((WARN, f"{kinds['text']}/{len(ok)} ok samples: the chat template renders other text than "
                               f"the server generated", "run the token_stream check against the server; the data "
                                                        "keeps the server's ids"))
    later = [s for s in ok if (s.get("turn") or 1) > 1]
    details["turns"] = turns = {
        "multi_turn": P1.multi_turn,
        "conversations": len({s.get("conversation_id", s["id"]) for s in samples}),
        "first_turn_ok": len(ok) - len(later), "later_turn_ok": len(later),
        "later_ids_mismatch": _mismatch_kinds(ctx, [s for s in later if s.get("ids_match") is False])["text"],
        "dataset_turns_untrained": sum((s.get("turn") or 1) - 1 for s in ok) if P1.multi_turn == "last" else 0}
    if turns["later_ids_mismatch"]:
        problems.append((WARN, f"{turns['later_ids_mismatch']}/{len(later)} later turns: the template renders the "
                               f"history other than the server did", "the data keeps the server's ids; run the "
                                                                     "token_stream check on a multi-turn prompt"))
    answered = turns["dataset_turns_untrained"] + len(ok)
    if answered and turns["dataset_turns_untrained"] > answered / 2:
        problems.append((WARN, f"multi_turn: last trains {len(ok)} of {answered} assistant turns (the rest are the "
                               f"dataset's text, never the target's)",
                         "set multi_turn: every in 01_synth: each turn answered on-policy becomes a sample"))
    think, think_text = ctx.template.think_ids[0], ctx.template.specials.think_start
    thinking = [s for s in ok if s.get("thinking")] if think is not None else []
    no_wrap = sum(1 for s in thinking if think not in [t for t, m in zip(s["input_ids"], s["loss_mask"]) if m])
    if no_wrap:
        problems.append((FAIL, f"{no_wrap}/{len(thinking)} ok thinking samples have no {think_text} token in their "
                               f"trained tokens (reasoning or its wrappers lost: the story's bug)",
                         "regenerate them with the current 01_synth (it keeps the server's token ids)"))
    max_length = ctx.max_length()
    lengths = [len(s["input_ids"]) for s in ok]
    trained = sum(sum(s["loss_mask"]) for s in ok)
    cut = sum(sum(s["loss_mask"][max_length:]) for s in ok)
    longer = sum(n_ > max_length for n_ in lengths)
    details.update(max_length=max_length, longer=longer, cut_tokens=cut, trained_tokens=trained,
                   lengths=_percentiles(lengths))
    if trained and cut / trained > CUT_WARN:
        problems.append((FAIL if cut / trained > CUT_FAIL else WARN,
                         f"{longer}/{len(ok)} samples exceed max_length {max_length}: {cut / trained:.0%} of the "
                         f"trained tokens are cut", "raise max_length in 02_hidden_states and 03_train"))
    if not ok:
        problems.append((FAIL, "no ok samples", "see the statuses above; run 01_synth"))
    p = details["lengths"]
    measured = (f"{n} samples: {status['ok']} ok, {status['truncated']} truncated, {status['no_reasoning']} "
                f"no_reasoning, {status['error']} error; length p50 {p['p50']} p99 {p['p99']} max {p['max']} "
                f"vs max_length {max_length}; server ids != template: {kinds['text']} text, {kinds['split']} token "
                f"split only, {kinds['unclosed']} reasoning never closed; duplicates {len(dups)}; turns: "
                f"{turns['first_turn_ok']} first, {turns['later_turn_ok']} later ok ({turns['multi_turn']})")
    return _result("data_health", problems, measured, details)


def _mismatch_kinds(ctx: Context, samples: list[dict]) -> dict[str, int]:
    """Why server ids differ from the template rendering: ``split`` (same text, other token boundaries:
    sampling picked a non-canonical tokenization, harmless), ``unclosed`` (the model stopped inside its
    reasoning, which no template can render), ``text`` (the template renders other text: a real mismatch)."""
    tpl = ctx.template
    out = {"text": 0, "split": 0, "unclosed": 0}
    for s in samples:
        generated = [t for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
        if s.get("thinking") and tpl.think_ids[1] is not None and tpl.think_ids[1] not in generated:
            out["unclosed"] += 1
            continue
        try:
            ours = build(tpl, s["messages"], s["reasoning"], s["content"], s["finish_reason"], None, None,
                         tools=s.get("tools"), tool_calls=s.get("tool_calls"))
        except StreamError:
            out["text"] += 1
            continue
        out["split" if tpl.decode(ours["input_ids"]) == tpl.decode(s["input_ids"]) else "text"] += 1
    return out


def _percentiles(xs: list[int]) -> dict[str, int]:
    if not xs:
        return {"p50": 0, "p99": 0, "max": 0}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "max": s[-1]}


# -- 7. disk ---------------------------------------------------------------------------------------------------------

def _free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes of the file system ``path`` will be on (its nearest existing ancestor)."""
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


def check_disk(ctx: Context) -> CheckResult:
    from eagle3nb.data.shards import bytes_per_token
    from eagle3nb.hidden.plan import head_bytes

    P2 = ctx.p("02_hidden_states")
    source = getattr(ctx.params.get("03_train"), "data_source", "stored")
    out = P2.stage_dir
    info = ctx.target_dims
    n_aux = len(P2.aux_layer_ids) if P2.aux_layer_ids else 3
    # online: 03 computes the hidden states as it trains and stores none (02's folder gets the head and vocab);
    # hybrid: 03 keeps each sample's states once, in 02's storage, in its own output folder
    bpt = 0 if source == "online" else bytes_per_token(P2.storage, info["hidden_size"], n_aux, P2.topk,
                                                       P2.draft_vocab_size)
    if source == "hybrid":
        out = ctx.p("03_train").stage_dir / "hidden_cache"
    tokens, how = ctx.projected_tokens()
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) if out.is_dir() else 0
    need = max(0, tokens * bpt + head_bytes(ctx.model_dir, info) - written)
    free, where = _free_bytes(out)
    details = {"bytes_per_token": bpt, "tokens": tokens, "written": written, "need": need, "free": free,
               "path": str(where), "data_source": source}
    who = {"stored": "02", "online": "03 (data_source online: no hidden states stored, only the target's head)",
           "hybrid": "03's hybrid cache"}[source]
    measured = (f"{who} needs ~{_gb(need)} more ({tokens:,} tokens x {bpt:,} B/token, storage {P2.storage}, {how}; "
                f"{_gb(written)} written); {_gb(free)} free at {where}")
    if need > free:
        return CheckResult("disk", FAIL, measured,
                           "free space, point 02's output_dir at a bigger disk, pick a compact storage "
                           "(storage: fp8 or topk halves bytes/token or better), or train with 03's data_source: "
                           "online (no hidden states on disk; the target runs every epoch)", details)
    if need > DISK_WARN * free:
        return CheckResult("disk", WARN, measured, "the run would nearly fill the disk; free space first", details)
    return CheckResult("disk", PASS, measured, "", details)


def _gb(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- 8. draft sanity -------------------------------------------------------------------------------------------------

def chance_acceptance(data) -> float:
    """Acceptance of a draft that always proposes the target's most frequent argmax token: what a draft
    that learned nothing about context scores."""
    import torch

    tops = torch.cat([data.target_argmax(data[i])[data[i]["loss_mask"].bool()] for i in range(len(data))])
    return float(torch.bincount(tops).max()) / max(1, tops.numel())


def check_draft_sanity(ctx: Context, prior: list[CheckResult]) -> CheckResult:
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.drafts import load_draft

    drafts = [d for label, d in ctx.drafts if label == "draft"]
    if not drafts:
        raise Unavailable("no trained draft yet (run 03_train)")
    data = ctx.heldout()
    data = Subset(data, range(min(SANITY_SAMPLES, len(data))))
    import torch

    # the target's embedding (V x H: GBs for Kimi) only when the checkpoint does not carry one
    embed = None if "embed_tokens.weight" in _draft_tensors(drafts[0])["shapes"] else data.embed_tokens()
    model = load_draft(drafts[0], embed_tokens=embed, device="cuda" if torch.cuda.is_available() else "cpu")
    res = offline_acceptance(model, data, SANITY_K, SANITY_K, 0.0, ctx.template.specials.segments)
    chance = chance_acceptance(data)
    a0, tau = float(res["per_position"][0]), float(res["acceptance_length"])
    gain = speedup(tau, SANITY_K, TYPICAL_COST_RATIO, TYPICAL_OVERHEAD, parallel=model.config.mask_token_id is not None)
    details = {"per_position": res["per_position"], "acceptance_length": tau, "chance": chance,
               "predicted_speedup": gain, "samples": len(data), "draft": str(drafts[0])}
    measured = (f"{len(data)} held-out samples, greedy k={SANITY_K}: first-token acceptance {a0:.1%} "
                f"(chance {chance:.1%}), tau {tau:.2f}, ~{gain:.2f}x at typical costs (c={TYPICAL_COST_RATIO}, "
                f"overhead {TYPICAL_OVERHEAD})")
    if a0 < chance + CHANCE_MARGIN:
        causes = rank_causes(prior)
        details["likely_causes"] = causes
        return CheckResult("draft_sanity", FAIL, f"the draft is near chance: {measured}",
                           "likeliest causes: " + " | ".join(f"{i + 1}. {c}" for i, c in enumerate(causes[:4])),
                           details)
    if gain < SPEEDUP_WARN:
        return CheckResult("draft_sanity", WARN, f"acceptance too low to pay off: {measured}",
                           "train longer or on more data (03_train max_steps / 01 max_samples)", details)
    return CheckResult("draft_sanity", PASS, measured, "", details)


# Why acceptance is low, in the order these causes are seen in practice (docs/DESIGN-FACTS.md "What users report").
CAUSES = {
    "layer_ids": "aux layer ids: the draft reads other target layers than it was trained on (off-by-one)",
    "token_stream": "token stream: training ids differ from what the target sees at serving (template/tokenizer)",
    "thinking": "thinking mode: the draft learned the other mode's output",
    "data_health": "training data: reasoning missing, truncated or cut by max_length",
    "shapes_vocab": "draft vocabulary / shapes do not fit the target",
    "server": "the server: reasoning not returned, so the data lacks it",
}
UNDERTRAINED = "too little training: more samples (01 max_samples) or steps (03 max_steps)"


def _short(text: str, n: int = 140) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def rank_causes(results: list[CheckResult]) -> list[str]:
    """Causes of a low acceptance, likeliest first: failed checks, then warnings, then plain undertraining
    (what remains when every check passes), then the checks that could not run (not ruled out)."""
    by_name = {r.name: r for r in results}

    def with_status(status: str, tag: str) -> list[str]:
        return [f"{cause} [{name} {tag}: {_short(by_name[name].measured)}]" for name, cause in CAUSES.items()
                if name in by_name and by_name[name].status == status]

    out = with_status(FAIL, "failed") + with_status(WARN, "warned") + [UNDERTRAINED] + with_status(SKIP, "skipped")
    unchecked = [n for n in CAUSES if n not in by_name]
    if unchecked:
        out.append(f"not checked here: {', '.join(unchecked)} (run `eagle3nb doctor params/<run>/`)")
    return out


# -- dispatch ----------------------------------------------------------------------------------------------------------

FUNCS = {
    "family": check_family, "server": check_server, "token_stream": check_token_stream, "thinking": check_thinking,
    "layer_ids": check_layer_ids, "shapes_vocab": check_shapes_vocab, "data_health": check_data_health,
    "disk": check_disk,
}


def run_one(name: str, ctx: Context, prior: list[CheckResult]) -> CheckResult:
    """Run one check; a missing artifact is a skip, a crash is a fail that says it is the doctor's."""
    try:
        if name == "draft_sanity":
            return check_draft_sanity(ctx, prior)
        return FUNCS[name](ctx)
    except Unavailable as e:
        return CheckResult(name, SKIP, str(e), "")
    except ParamsError as e:  # e.g. api_key_env names an unset variable: the message says what to do
        return CheckResult(name, FAIL, str(e), "fix the parameter or environment variable named above")
    except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
        return CheckResult(name, FAIL, f"the check could not run: {type(e).__name__}: {e}",
                           "fix the artifact named above (or report a doctor bug with details.traceback)",
                           {"traceback": traceback.format_exc()})
