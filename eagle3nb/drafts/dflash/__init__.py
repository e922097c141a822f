"""Block drafters: DFlash (arXiv 2602.06036) and, on its backbone with a Markov and a confidence head, DSpark
(arXiv 2607.05147; ``markov_rank > 0``). One package serves both methods, as EAGLE-3's serves its options: the same
model, objective, layouts, drafting and offline simulation, with the heads on or off.

``model`` the network (no I/O), ``objective`` its training loss, ``layouts`` its checkpoints (vLLM's and
speculators'), ``drafting`` a block's drafting step and greedy local decoding, ``offline`` acceptance by block
position on stored states. docs/block-drafters.md explains the model, the layouts and the layer-id convention.
"""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.dflash import drafting, layouts, model, objective, offline


def _method(name: str, title: str, markov_rank_of) -> DraftMethod:
    return DraftMethod(
        name=name, title=title, claims=layouts.claimer(name), load=layouts.load_draft, save=layouts.save_draft,
        config_json=layouts.draft_config_json, objective=objective.BlockObjective.from_params,
        drafting=drafting.BlockDrafting, chain_acceptance=offline.chain_acceptance, layouts=layouts.LAYOUTS,
        fresh=lambda P, data, tc: model.fresh_draft(P, data.meta, tc, data.embed_tokens(), data.lm_head(),
                                                   markov_rank=markov_rank_of(P)),
        unit=objective.BlockObjective.unit)


METHODS = {
    "dflash": _method("dflash", "DFlash", lambda P: 0),
    "dspark": _method("dspark", "DSpark", lambda P: P.markov_rank),
}
