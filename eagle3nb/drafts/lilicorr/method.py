"""LiLiCorr's ``DraftMethod`` (the package's ``METHODS``): built here, apart from the package's light ``__init__``,
because its modules load torch."""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.dflash.model import check_mask_input
from eagle3nb.drafts.lilicorr import drafting, layouts, model, objective, offline, serving

METHODS = {
    "lilicorr": DraftMethod(
        name="lilicorr", title="LiLiCorr", claims=layouts.claims, load=layouts.load_draft, save=layouts.save_draft,
        config_json=layouts.draft_config_json, objective=objective.LatticeObjective.from_params,
        drafting=drafting.LatticeDrafting, chain_acceptance=offline.chain_acceptance, layouts=layouts.LAYOUTS,
        fresh=lambda P, data, tc: model.fresh_draft(P, data.meta, tc, data.embed_tokens(), data.lm_head()),
        unit=objective.LatticeObjective.unit, serving_problems=serving.serving_problems,
        tensor_problems=layouts.tensor_problems, check_usable=check_mask_input),
}
