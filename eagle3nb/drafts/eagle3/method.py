"""EAGLE-3's ``DraftMethod`` (the package's ``METHODS``): built here, apart from the package's light ``__init__``,
because its modules load torch."""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.eagle3 import drafting, fresh, layouts, objective, offline, serving

METHODS = {"eagle3": DraftMethod(
    name="eagle3", title="EAGLE-3", claims=layouts.claims,
    load=layouts.load_draft, save=layouts.save_draft, config_json=layouts.draft_config_json,
    objective=objective.TTTObjective.from_params, drafting=drafting.Eagle3Drafting,
    chain_acceptance=offline.chain_acceptance, layouts=("eagle3", "sglang", "speculators"),
    fresh=fresh.fresh_draft, unit=objective.TTTObjective.unit, serving_problems=serving.serving_problems,
    tensor_problems=layouts.tensor_problems)}
