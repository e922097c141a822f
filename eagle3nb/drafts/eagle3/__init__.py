"""EAGLE-3 (Li et al. 2025, arXiv:2503.01840), with its options EAGLE-3.1 (``fc_norm``, ``norm_output``), deeper
drafts (``num_layers``), DeepSeek's latent attention (``mla``) and parallel drafting (P-EAGLE, ``mask_token_id``).
``method`` holds its ``DraftMethod`` (``METHODS``, loaded on first use)."""

from typing import Any, Literal

from pydantic import Field

from eagle3nb.drafts.base import DraftMethod, MethodRules

# A fresh draft's decoder layers when 03's num_layers is null: EAGLE-3's one layer (a second accepted +0.14
# offline on the smoke toy but served slower, 1.12x against 1.33x: docs/recipes.md).
NUM_LAYERS = 1


def speculative(config: dict) -> dict:
    """A parallel-drafting (P-EAGLE) draft, one whose config.json has a ``mask_token_id``, is served with vLLM's
    ``parallel_drafting`` on: served one step at a time its mask slots would never be used, and its later drafts
    were not trained for it."""
    return {"parallel_drafting": True} if config.get("mask_token_id") is not None else {}


# Its own 03 settings (name -> (type, Field)), which 03's schema takes from here. EAGLE-3 was 03's only method before
# the others came: its settings sit in every run's resume record, so they are 03's baseline, which the other methods
# refuse changed (MethodRules.params names only what a method reads besides them).
PARAMS: dict[str, tuple[Any, Any]] = {
    "ttt_steps": (int, Field(7, ge=1, description="EAGLE-3's training-time-test unroll length (draft steps trained "
                                                  "per position)")),
    "step_decay": (float, Field(0.8, gt=0, le=1, description="loss weight of TTT step i is step_decay**i")),
    "draft_attention": (Literal["llama", "mla"], Field(
        "llama", description="from scratch: the midlayer's attention: llama (the published drafters' layer, served "
                             "by vLLM and SGLang on GPUs) or mla (an MLA target's own latent attention and widths: "
                             "vLLM's deepseek_eagle3 draft, the one stock vLLM's CPU build serves beside an MLA "
                             "target)")),
    "fc_norm": (bool | None, Field(None, description="EAGLE-3.1's RMSNorm on each of the three aux states before fc, "
                                                     "so no layer's scale dominates the fused feature (vLLM reads "
                                                     "fc_norm from the draft's config.json); null = true for a "
                                                     "fresh draft (EAGLE-3.1 beat EAGLE-3.0 on both toys, "
                                                     "docs/recipes.md), the run's own when resuming one started "
                                                     "without it, the checkpoint's own when fine-tuning (init_from)")),
    "norm_output": (bool | None, Field(None, description="EAGLE-3.1's post-norm state, not the pre-norm one, fed "
                                                         "back as the next draft step's feature (vLLM's norm_output "
                                                         "key); null as fc_norm: true for a fresh draft")),
    "parallel_drafting": (bool, Field(False, description="from scratch: a P-EAGLE draft (arXiv 2602.01469) that "
                                                         "proposes all k tokens in one forward: k-1 mask positions "
                                                         "(the target's pad token, else its last id, and a learned "
                                                         "mask_hidden) after the last token, trained in the TTT "
                                                         "unroll as vLLM's parallel_drafting feeds them; needs "
                                                         "ttt_steps >= num_speculative_tokens and export_format "
                                                         "eagle3")),
    "loss": (Literal["forward_kl", "reverse_kl", "tv", "jsd", "lk_alpha", "lk_lambda", "opd"], Field(
        "forward_kl", description="the TTT loss per position against the target's distribution p (the draft's: q): "
                                  "forward_kl (EAGLE-3's soft cross-entropy, KL(p||q) + H(p)), reverse_kl "
                                  "KL(q||p), tv (total variation 1/2 sum|p-q| = 1 - acceptance), jsd "
                                  "(Jensen-Shannon), lk_alpha (-log acceptance) or lk_lambda (lambda KL(p||q) + "
                                  "(1-lambda)(1 - acceptance), lambda = exp(-lk_eta acceptance)): the LK losses "
                                  "of arXiv 2602.23881, acceptance = sum min(p, q)), or opd (on-policy "
                                  "distillation over 05's replayed proposals: KL(q||p) where the target rejected "
                                  "the drafted token, loss_mask 2, KL(p||q) where it accepted it)")),
    "lk_eta": (float, Field(3.0, ge=0, description="loss lk_lambda: how fast the weight moves from KL to TV as the "
                                                   "acceptance grows (the paper's best: 3)")),
}


def check(P: Any) -> str | None:
    """Why 03's parameters cannot train an EAGLE-3 draft as set (None when they can): parallel drafting's needs."""
    if P.parallel_drafting and P.ttt_steps < max(2, P.num_speculative_tokens):
        return (f"parallel_drafting trains one mask position per TTT step after the first: ttt_steps ({P.ttt_steps}) "
                f"must be at least num_speculative_tokens ({P.num_speculative_tokens}) and 2")
    if P.parallel_drafting and P.draft_attention == "mla":
        return ("parallel_drafting with draft_attention: mla has no engine to serve it (vLLM 0.32's deepseek_eagle3 "
                "draft has no mask_hidden; SGLang has no parallel drafting): set parallel_drafting: false for an MLA "
                "draft, or draft_attention: llama")
    if P.parallel_drafting and P.export_format != "eagle3":
        return (f"parallel_drafting exports vLLM's eagle3 layout (mask_token_id + mask_hidden) only: set "
                f"export_format: eagle3, not {P.export_format}")
    return None


RULES = {"eagle3": MethodRules(summary="EAGLE-3 and its options below", speculative=speculative, check=check,
                                   recipes=tuple({"num_speculative_tokens": k} for k in (3, 5, 7)))}



def method_named(name: str) -> DraftMethod:
    """This package's ``DraftMethod`` called ``name`` (its ``method`` module loads torch: imported on first use)."""
    from eagle3nb.drafts.eagle3.method import METHODS

    return METHODS[name]
