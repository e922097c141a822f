"""DFlash's and DSpark's ``DraftMethod``s (the package's ``METHODS``): built here, apart from the package's light
``__init__``, because their modules load torch."""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.dflash import drafting, layouts, model, objective, offline, serving


def _method(name: str, title: str, markov_rank_of) -> DraftMethod:
    return DraftMethod(
        name=name, title=title, claims=layouts.claimer(name), load=layouts.load_draft, save=layouts.save_draft,
        config_json=layouts.draft_config_json, objective=objective.BlockObjective.from_params,
        drafting=drafting.BlockDrafting, chain_acceptance=offline.chain_acceptance, layouts=layouts.LAYOUTS,
        fresh=lambda P, data, tc: model.fresh_draft(P, data.meta, tc, data.embed_tokens(), data.lm_head(),
                                                   markov_rank=markov_rank_of(P)),
        unit=objective.BlockObjective.unit, serving_problems=serving.serving_problems)


METHODS = {
    "dflash": _method("dflash", "DFlash", lambda P: 0),
    "dspark": _method("dspark", "DSpark", lambda P: P.markov_rank),
}
