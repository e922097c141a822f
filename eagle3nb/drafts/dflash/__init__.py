"""Block drafters: DFlash (arXiv 2602.06036) and, on its backbone, DSpark with a Markov and a confidence head
(arXiv 2607.05147; ``markov_rank > 0``) and DFlash2 with grouped dynamic convolutions and a candidate selector
(``selector_rank > 0``: ``dflash2.py``). One package serves the three methods, as EAGLE-3's serves its options: the
same model, objective, layouts, drafting and offline simulation, with the additions on or off.

``model`` the network (no I/O), ``objective`` its training loss, ``layouts`` its checkpoints (vLLM's and
speculators'), ``drafting`` a block's drafting step and greedy local decoding, ``offline`` acceptance by block
position on stored states, ``method`` the two ``DraftMethod``s (``METHODS``, loaded on first use).
docs/block-drafters.md explains the model, the layouts and the layer-id convention.
"""

from eagle3nb.drafts.base import DraftMethod
from eagle3nb.drafts.dflash.rules import BLOCK, NUM_LAYERS, PARAMS, RULES, check_convolutions

__all__ = ["BLOCK", "NUM_LAYERS", "PARAMS", "RULES", "check_convolutions", "method_named"]


def method_named(name: str) -> DraftMethod:
    """This package's ``DraftMethod`` called ``name`` (its ``method`` module loads torch: imported on first use)."""
    from eagle3nb.drafts.dflash.method import METHODS

    return METHODS[name]
