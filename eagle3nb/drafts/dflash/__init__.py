"""Block drafters: DFlash (arXiv 2602.06036) and, on its backbone, DSpark with a Markov and a confidence head
(arXiv 2607.05147; ``markov_rank > 0``) and DFlash2 with grouped dynamic convolutions and a candidate selector
(``selector_rank > 0``: ``dflash2.py``). One package serves the three methods, as EAGLE-3's serves its options: the
same model, objective, layouts, drafting and offline simulation, with the additions on or off.

``model`` the network (no I/O), ``objective`` its training loss, ``layouts`` its checkpoints (vLLM's and
speculators'), ``drafting`` a block's drafting step and greedy local decoding, ``offline`` acceptance by block
position on stored states, ``method`` the two ``DraftMethod``s (``METHODS``, loaded on first use).
docs/block-drafters.md explains the model, the layouts and the layer-id convention.
"""

from eagle3nb.drafts.base import MethodRules, lazy_methods
from eagle3nb.layers import spread_layer_ids

# A fresh draft's decoder layers when 03's num_layers is null: on the smoke toy (60 steps, 3 seeds) one layer
# accepted 2.31 (DFlash) / 2.97 (DSpark), two 2.71 / 3.35 (docs/recipes.md; 1.38 / 2.46 and 2.52 / 3.17 on the dead
# mask row, which chose 2); the peers' published DFlash drafts use 5 at 8B scale.
NUM_LAYERS = 2
# Their target layers (``RULES``' layer_ids) are the peers' spread, one per draft layer (z-lab's published drafts:
# 5 layers reading [1, 9, 17, 25, 33] of Qwen3-8B's 36 in their numbering); 02 extracts them for a run training one.
# 03's block settings both read (model.fresh_draft, objective.BlockObjective.from_params); DSpark's heads add two.
BLOCK = ("block_size", "anchors_per_seq", "block_loss", "block_weighting", "block_gamma", "dpace_alpha")
RULES = {
    "dflash": MethodRules(summary="a block drafter: one forward drafts a block from the target's states, "
                                  "docs/block-drafters.md", block=True, params=(*BLOCK, "block_causal"),
                          layer_ids=spread_layer_ids, serves_shorter=True),
    "dspark": MethodRules(summary="DFlash with a Markov and a confidence head", block=True, samples_from_anchor=True,
                          params=(*BLOCK, "markov_rank", "confidence_weight"), layer_ids=spread_layer_ids),
    "dflash2": MethodRules(summary="DFlash with grouped dynamic convolutions and a candidate selector", block=True,
                           params=(*BLOCK, "block_causal", "conv_kernel_size", "conv_group_size", "selector_rank",
                                   "selector_top_k"),
                           served_as="dflash", layer_ids=spread_layer_ids, serves_shorter=True),
}

__getattr__ = lazy_methods(__name__)
