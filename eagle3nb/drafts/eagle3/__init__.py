"""EAGLE-3 (Li et al. 2025, arXiv:2503.01840), with its options EAGLE-3.1 (``fc_norm``, ``norm_output``), deeper
drafts (``num_layers``), DeepSeek's latent attention (``mla``) and parallel drafting (P-EAGLE, ``mask_token_id``).
``method`` holds its ``DraftMethod`` (``METHODS``, loaded on first use)."""

from eagle3nb.drafts.base import MethodRules, lazy_methods

# A fresh draft's decoder layers when 03's num_layers is null: EAGLE-3's one layer (a second accepted +0.14
# offline on the smoke toy but served slower, 1.12x against 1.33x: docs/recipes.md).
NUM_LAYERS = 1
RULES = {"eagle3": MethodRules(summary="EAGLE-3 and its options below")}

__getattr__ = lazy_methods(__name__)
