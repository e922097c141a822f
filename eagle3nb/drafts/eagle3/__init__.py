"""EAGLE-3 (Li et al. 2025, arXiv:2503.01840), with its options EAGLE-3.1 (``fc_norm``, ``norm_output``), deeper
drafts (``num_layers``), DeepSeek's latent attention (``mla``) and parallel drafting (P-EAGLE, ``mask_token_id``)."""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.eagle3 import drafting, fresh, layouts, objective, offline

METHODS = {"eagle3": DraftMethod(
    name="eagle3", title="EAGLE-3", claims=layouts.claims,
    load=layouts.load_draft, save=layouts.save_draft, config_json=layouts.draft_config_json,
    objective=objective.TTTObjective.from_params, drafting=drafting.Eagle3Drafting,
    chain_acceptance=offline.chain_acceptance, layouts=("eagle3", "sglang", "speculators"),
    fresh=fresh.fresh_draft, unit=objective.TTTObjective.unit)}
