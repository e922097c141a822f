"""The checks of the draft against its target and data: 4. layer ids, 5. shapes and vocab, 5b. serving (the draft
as the run serves it on vLLM), 8. draft sanity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3nb import drafts
from eagle3nb.data.head import served_target
from eagle3nb.doctor.checks.causes import rank_causes
from eagle3nb.doctor.checks.common import ENGINES, worst_of
from eagle3nb.doctor.context import Context, Subset, Unavailable
from eagle3nb.doctor.result import FAIL, PASS, WARN, CheckResult
from eagle3nb.drafts import DraftMismatchError, Serving, method_layer_ids, method_of, served_as, serving_problems
from eagle3nb.formulas import speedup
from eagle3nb.layers import LayerIdError, default_aux_layer_ids, from_sglang, to_sglang
from eagle3nb.layers import check_layer_ids as validate_layer_ids

# shapes_vocab: share of the target's argmax tokens (held-out, loss-masked) inside the draft vocabulary
COVERAGE_WARN = 0.90
COVERAGE_TOKENS = 4096
# draft_sanity: position-0 acceptance (greedy) on a few held-out samples
SANITY_SAMPLES, SANITY_K = 8, 3
CHANCE_MARGIN = 0.10  # a draft is "near chance" below chance + this
# warn when the predicted speedup at typical costs (a 1-layer draft of a deep target) is marginal
TYPICAL_COST_RATIO, TYPICAL_OVERHEAD, SPEEDUP_WARN = 0.05, 0.10, 1.2


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
        P2 = ctx.params.get("02_hidden_states")
        planned = getattr(P2, "aux_layer_ids", None)
        method = getattr(P2, "draft_method", drafts.DEFAULT)  # what 02 extracts when unset (the run's plan hands it)
        data, src = (list(planned), "02 params") if planned else \
            (method_layer_ids(method, L, getattr(P2, "draft_num_layers", None)), f"{drafts.get(method).title} default")
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
    return worst_of("layer_ids", problems, "; ".join(said), details)


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
    """One draft checkpoint against the target's sizes: its config's, then its tensors as its method writes them
    (``DraftMethod.tensor_problems``: EAGLE-3's fc, head and vocab map, a block drafter's fc over its aux layers),
    then the vocab map where it has one."""
    problems = []
    th = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    dv = cfg.get("draft_vocab_size")
    fix = f"train the draft for this target (03_train) or pick a checkpoint made for it ({d})"
    if th != H:
        problems.append((FAIL, f"{label} target_hidden_size {th} != target hidden {H}", fix))
    if cfg.get("vocab_size") != V:
        problems.append((FAIL, f"{label} vocab_size {cfg.get('vocab_size')} != target vocab {V}", fix))
    try:
        method = method_of(cfg, str(d))
    except DraftMismatchError as e:
        return [*problems, (FAIL, str(e), fix)]
    problems += [(FAIL, f"{label} {what}", f"{how} ({d})") for what, how in method.tensor_problems(cfg, t["shapes"], H)]
    if "d2t" not in t or "t2d" not in t:  # a block drafter has none: the target's vocabulary is its own
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
    return worst_of("shapes_vocab", problems, "; ".join(said), details)


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


# -- 5b. serving ----------------------------------------------------------------------------------------------------

def _served_as(ctx: Context, draft: Path) -> tuple[tuple[str, str], list[tuple[int, str]]]:
    """(the method vLLM serves it as, the parameter naming it) and each (k, the parameter naming it) the run serves
    ``draft`` with: as 03's method is served (else the draft's own) and printed k, 04's k (or its ks sweep)."""
    P3, P4 = ctx.params.get("03_train"), ctx.params.get("04_acceptance")
    if P3 is not None:
        method = (served_as(P3.method), "03_train method")
    else:
        method = (served_as(method_of(json.loads((draft / "config.json").read_text()), str(draft)).name),
                  "the draft's method")
    ks = [(P3.num_speculative_tokens, "03_train num_speculative_tokens")] if P3 is not None else []
    if P4 is not None:
        ks += [(k, "04_acceptance k" if P4.ks is None else "04_acceptance ks") for k in P4.sweep_ks]
    return method, ks


def check_serving(ctx: Context) -> CheckResult:
    """The trained draft as the run serves it on vLLM (``eagle3nb.drafts.serving_problems``: what vLLM would read
    wrong from it without an error), with each k the run serves it with."""
    if ctx.serving_engine != "vllm":
        raise Unavailable("the serving check reads the draft as vLLM does (run it with --serving-engine vllm)")
    drafts = [d for label, d in ctx.drafts if label == "draft"]
    if not drafts:
        raise Unavailable("no trained draft yet (run 03_train)")
    (method, method_field), ks = _served_as(ctx, drafts[0])
    if not ks:
        raise Unavailable("no valid 03_train / 04_acceptance params: the k it is served with is unknown")
    target = served_target(ctx.model_dir)
    problems: list[tuple[str, str, str]] = []
    for k, k_field in ks:
        serving = Serving(method, k, target, method_field=method_field, k_field=k_field)
        for what, fix in serving_problems(drafts[0], serving):
            if (FAIL, what, fix) not in problems:  # a misfit every k shares is said once
                problems.append((FAIL, what, fix))
    said = f"{drafts[0]} served as {method} with k {sorted({k for k, _ in ks})} beside the {target.num_layers}-layer " \
           "target"
    return worst_of("serving", problems, said, {"draft": str(drafts[0]), "method": method, "ks": [k for k, _ in ks]})


# -- 8. draft sanity -------------------------------------------------------------------------------------------------

def chance_acceptance(data) -> float:
    """Acceptance of a draft that always proposes the target's most frequent argmax token: what a draft
    that learned nothing about context scores."""
    import torch

    tops = torch.cat([data.target_argmax(data[i])[data[i]["loss_mask"].bool()] for i in range(len(data))])
    return float(torch.bincount(tops).max()) / max(1, tops.numel())


def check_draft_sanity(ctx: Context, prior: list[CheckResult]) -> CheckResult:
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.drafts import DraftMismatchError, load_draft, one_forward_per_round
    from eagle3nb.drafts import of as drafts_of
    from eagle3nb.hf import compute_device

    drafts = [d for label, d in ctx.drafts if label == "draft"]
    if not drafts:
        raise Unavailable("no trained draft yet (run 03_train)")
    data = ctx.heldout()
    data = Subset(data, range(min(SANITY_SAMPLES, len(data))))
    # the target's embedding and head (V x H each: GBs for Kimi) only when the checkpoint does not carry them
    shapes = _draft_tensors(drafts[0])["shapes"]
    embed = None if "embed_tokens.weight" in shapes else data.embed_tokens()
    head = None if "lm_head.weight" in shapes else data.lm_head()
    try:  # a draft that does not load (a mask_embedding.pt vLLM would refuse) or cannot work (a dead mask input)
        model = load_draft(drafts[0], embed_tokens=embed, lm_head=head, device=compute_device())
        drafts_of(model).check_usable(model, str(drafts[0]))
    except DraftMismatchError as e:  # the draft's own line; its fix apart where the error holds one
        return CheckResult("draft_sanity", FAIL, getattr(e, "what", str(e)),
                           getattr(e, "fix", "fix the draft as the line says, or train a fresh one (03_train "
                                         "init_from: null)"), {"draft": str(drafts[0])})
    res = offline_acceptance(model, data, SANITY_K, SANITY_K, 0.0, ctx.template.specials.segments)
    chance = chance_acceptance(data)
    a0, tau = float(res["per_position"][0]), float(res["acceptance_length"])
    gain = speedup(tau, SANITY_K, TYPICAL_COST_RATIO, TYPICAL_OVERHEAD, parallel=one_forward_per_round(model))
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


