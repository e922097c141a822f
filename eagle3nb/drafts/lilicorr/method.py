"""LiLiCorr's ``DraftMethod`` (the package's ``METHODS``): built here, apart from the package's light ``__init__``,
because its modules load torch. DFlash's method with the lattice's model, objective, layout, walk and chains."""

from __future__ import annotations

from pathlib import Path

from eagle3nb.drafts.base import given
from eagle3nb.drafts.dflash.method import DFlash
from eagle3nb.drafts.lilicorr import drafting, layouts, model, objective, offline, serving


class LiLiCorr(DFlash):
    """DFlash whose top-k candidates per slot a learned lattice walks into a path."""

    name, title = "lilicorr", "LiLiCorr"
    layouts = layouts.LAYOUTS
    unit = objective.LatticeObjective.unit

    def claims(self, config):
        return layouts.claims(config)

    def load(self, path, embed_tokens=None, device="cpu", dtype=None, lm_head=None):
        return layouts.load_draft(path, embed_tokens, device, **given(dtype=dtype), lm_head=lm_head)

    def save(self, model, path, format, dtype=None, include_embed=None, verifier=None, num_speculative_tokens=None):
        return layouts.save_draft(model, path, format, dtype, **given(include_embed=include_embed), verifier=verifier,
                                  num_speculative_tokens=num_speculative_tokens)

    def config_json(self, model, format, dtype=None, verifier=None, num_speculative_tokens=None):
        return layouts.draft_config_json(model, format, dtype, verifier, num_speculative_tokens)

    def objective(self, model, P):
        return objective.LatticeObjective.from_params(model, P)

    def drafting(self, model, k, device):
        return drafting.LatticeDrafting(model, k, device)

    def chain_acceptance(self, model, item, target_argmax, target_probs, steps, temperature):
        return offline.chain_acceptance(model, item, target_argmax, target_probs, steps, temperature)

    def fresh(self, P, data, target_config):
        return model.fresh_draft(P, data.meta, target_config, data.embed_tokens(), data.lm_head())

    def serving_problems(self, path: Path, config, how):
        return serving.serving_problems(path, config, how)

    def tensor_problems(self, config, shapes, hidden_size):
        return layouts.tensor_problems(config, shapes, hidden_size)


METHODS = {"lilicorr": LiLiCorr()}
