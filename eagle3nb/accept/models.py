"""The target and the draft 04 judges, loaded through ``hf`` (float32, one device: 04 compares tokens one for
one with the target's own decoding) and checked to fit each other and the held-out data before any work."""

from __future__ import annotations

import json
from typing import Any

from eagle3nb.accept.params import AcceptParams
from eagle3nb.data.head import served_target
from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import Serving, ServingError, check_fits, load_draft, of, served_method, serving_problems
from eagle3nb.hf import DECODER, compute_device, load_target, load_tokenizer


def served_ks(P: AcceptParams) -> list[tuple[int, str, bool]]:
    """Each (k, the parameter naming it, whether eagle3nb's own decoder serves it) the stage serves the draft with:
    the embedded servers' sweep (``ks``, else ``k``), the local decoding's ``k``, each listed endpoint's declared
    ``k`` (its own engine: vLLM's rules)."""
    out = []
    if P.endpoints == "embedded":
        out += [(k, "ks" if P.ks else "k", True) for k in P.sweep_ks]
    else:
        out += [(e.k, f"endpoint {e.label}'s k", False) for e in P.endpoints if e.k is not None]
    if P.local_prompts or P.benchmarks:  # decoded here, at k
        out.append((P.k, "k", True))
    return list(dict.fromkeys(out))


def check_serving(P: AcceptParams) -> None:
    """Refuse, in one line before any model loads or any work starts, a draft the stage would serve wrong at one
    of its k (``served_ks``): the draft's own serving check (``eagle3nb.drafts.serving_problems``: a block
    drafter's k against its block, its mask input, its layers and vocabulary against the target), each misfit said
    once with the parameter that fixes it."""
    src = P.params_file or "the notebook's parameters cell"
    target, method, problems = served_target(P.model_dir), served_method(P.draft_path), []
    for k, field, ours in served_ks(P):
        for what, fix in serving_problems(P.draft_path, Serving(method, k, target, k_field=field, whole_block=ours)):
            line = f"{what}: {fix}"
            if line not in problems:  # a misfit every k shares is said once
                problems.append(line)
    if problems:
        raise ServingError(f"04_acceptance ({src}), draft {P.draft_path}: " + "; ".join(problems))


def load_models(P: AcceptParams, need_target: bool = True):
    """(target or None, draft, tokenizer) for the stage, after checking that the draft fits both the held-out
    data and the target (sizes, vocabulary, aux layers), so a mismatch stops here, naming both sides. The
    draft gets the target's embedding (and head: a block drafter's) when its checkpoint carries none."""
    model_dir = P.model_dir
    tokenizer = load_tokenizer(model_dir, trust_remote_code=P.trust_remote_code)
    data = HiddenStates(P.data_path)
    target = None
    if need_target:
        target = load_target(model_dir, trust_remote_code=P.trust_remote_code, use=DECODER)
        embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    else:
        embed, head = data.embed_tokens(), data.lm_head()
    draft = load_draft(P.draft_path, embed_tokens=embed, lm_head=head, device=compute_device())
    of(draft).check_usable(draft, str(P.draft_path))  # a block drafter's mask input, on the target's own rows
    meta = data.meta
    check_fits(draft.config, hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"],
               layer_ids=meta["layer_ids"], num_layers=meta["num_layers"], draft=f"the draft {P.draft_path}",
               data=f"the held-out data {P.data_path}")
    tc = json.loads((model_dir / "config.json").read_text())
    tc = tc.get("text_config") or tc
    check_fits(draft.config, hidden_size=tc["hidden_size"], vocab_size=tc["vocab_size"], layer_ids=None,
               num_layers=tc["num_hidden_layers"], draft=f"the draft {P.draft_path}", data=f"the target {model_dir}")
    return target, draft, tokenizer


def trained_with(P: AcceptParams, key: str, default: Any = None) -> Any:
    """What 03 recorded of the draft's training under ``key`` (its metrics.json beside the draft, 03's layout: the
    held-out share, the longest training sequence), else ``default``: 04 reads 03's output, never its parameters."""
    path = P.draft_path.parent / "metrics.json"
    return json.loads(path.read_text()).get(key, default) if path.exists() else default
