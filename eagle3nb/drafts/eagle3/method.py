"""EAGLE-3's ``DraftMethod`` (the package's ``METHODS``): built here, apart from the package's light ``__init__``,
because its modules load torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.drafts.base import DraftMethod, given
from eagle3nb.drafts.eagle3 import drafting, fresh, layouts, objective, offline, serving


class Eagle3(DraftMethod):
    """EAGLE-3 and its options (3.1's norms, depth, MLA, parallel drafting): one draft forward per drafted token."""

    name, title = "eagle3", "EAGLE-3"
    layouts = ("eagle3", "sglang", "speculators")
    unit = objective.TTTObjective.unit

    def claims(self, config: dict[str, Any]) -> bool:
        return layouts.claims(config)

    def load(self, path, embed_tokens=None, device="cpu", dtype=None, lm_head=None):
        return layouts.load_draft(path, embed_tokens, device, **given(dtype=dtype), lm_head=lm_head)

    def save(self, model, path, format, dtype=None, include_embed=None, verifier=None, num_speculative_tokens=None):
        return layouts.save_draft(model, path, format, dtype, **given(include_embed=include_embed), verifier=verifier,
                                  **given(num_speculative_tokens=num_speculative_tokens))

    def config_json(self, model, format, dtype=None, verifier=None, num_speculative_tokens=None):
        return layouts.draft_config_json(model, format, dtype, verifier,
                                         **given(num_speculative_tokens=num_speculative_tokens))

    def objective(self, model, P):
        return objective.TTTObjective.from_params(model, P)

    def drafting(self, model, k, device):
        return drafting.Eagle3Drafting(model, k, device)

    def chain_acceptance(self, model, item, target_argmax, target_probs, steps, temperature):
        return offline.chain_acceptance(model, item, target_argmax, target_probs, steps, temperature)

    def fresh(self, P, data, target_config):
        return fresh.fresh_draft(P, data, target_config)

    def serving_problems(self, path: Path, config, how):
        return serving.serving_problems(path, config, how)

    def tensor_problems(self, config, shapes, hidden_size):
        return layouts.tensor_problems(config, shapes, hidden_size)


METHODS = {"eagle3": Eagle3()}
