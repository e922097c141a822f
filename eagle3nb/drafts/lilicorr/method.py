"""LiLiCorr's ``DraftMethod`` (the package's ``METHODS``): built here, apart from the package's light ``__init__``,
because its modules load torch. DFlash's method served by the lattice's own model, objective, layout, walk and
chains."""

from __future__ import annotations

from eagle3nb.drafts.dflash.method import DFlash
from eagle3nb.drafts.lilicorr import drafting, layouts, model, objective, offline, serving


class LiLiCorr(DFlash):
    """DFlash whose top-k candidates per slot a learned lattice walks into a path."""

    layouts_module, offline_module, serving_module = layouts, offline, serving  # before layouts, the formats
    objective_class, drafting_class = objective.LatticeObjective, drafting.LatticeDrafting
    name, title = "lilicorr", "LiLiCorr"
    layouts = layouts.LAYOUTS
    unit = objective.LatticeObjective.unit

    def claims(self, config):
        return layouts.claims(config)

    def fresh(self, P, data, target_config):
        return model.fresh_draft(P, data.meta, target_config, data.embed_tokens(), data.lm_head())


METHODS = {"lilicorr": LiLiCorr()}
