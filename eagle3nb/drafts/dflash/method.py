"""DFlash's, DSpark's and DFlash2's ``DraftMethod``s (the package's ``METHODS``): built here, apart from the
package's light ``__init__``, because their modules load torch."""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.dflash import calibration, drafting, layouts, model, objective, offline, serving


def _method(name: str, title: str, heads_of, calibrate=None, confidences=None) -> DraftMethod:
    """``heads_of(P)``: the method's own ``DFlashConfig`` fields from 03's params (DSpark's ``markov_rank``, DFlash2's
    convolutions and selector, DFlash's and DFlash2's ``causal`` block)."""
    return DraftMethod(
        name=name, title=title, claims=layouts.claimer(name), load=layouts.load_draft, save=layouts.save_draft,
        config_json=layouts.draft_config_json, objective=objective.BlockObjective.from_params,
        drafting=drafting.BlockDrafting, chain_acceptance=offline.chain_acceptance, layouts=layouts.LAYOUTS,
        fresh=lambda P, data, tc: model.fresh_draft(P, data.meta, tc, data.embed_tokens(), data.lm_head(),
                                                   **heads_of(P)),
        unit=objective.BlockObjective.unit, serving_problems=serving.serving_problems,
        tensor_problems=layouts.tensor_problems, calibrate=calibrate, confidences=confidences,
        check_usable=model.check_mask_input)


METHODS = {
    "dflash": _method("dflash", "DFlash", lambda P: {"causal": P.block_causal}),
    "dspark": _method("dspark", "DSpark", lambda P: {"markov_rank": P.markov_rank},
                      calibration.calibrate, offline.block_confidences),  # its confidence head
    "dflash2": _method("dflash2", "DFlash2", lambda P: {"causal": P.block_causal,
                                                        **{k: getattr(P, k) for k in layouts.DFLASH2_KEYS}}),
}
