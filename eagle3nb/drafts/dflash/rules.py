"""The block drafters' light facts (no torch): their depth, their own 03 settings and checks, and their rules; the
package's ``__init__`` gives them to the registry, and the package's modules read them here (``serving`` the name vLLM
serves each method as)."""

from typing import Any, Literal

from pydantic import Field

from eagle3nb.drafts.base import MethodRules
from eagle3nb.layers import spread_layer_ids

# A fresh draft's decoder layers when 03's num_layers is null: on the smoke toy (60 steps, 3 seeds) one layer
# accepted 2.31 (DFlash) / 2.97 (DSpark), two 2.71 / 3.35 (docs/recipes.md; 1.38 / 2.46 and 2.52 / 3.17 on the dead
# mask row, which chose 2); the peers' published DFlash drafts use 5 at 8B scale.
NUM_LAYERS = 2
# Their target layers (``RULES``' layer_ids) are the peers' spread, one per draft layer (z-lab's published drafts:
# 5 layers reading [1, 9, 17, 25, 33] of Qwen3-8B's 36 in their numbering); 02 extracts them for a run training one.
# 03's block settings both read (model.fresh_draft, objective.BlockObjective.from_params); DSpark's heads add two.
BLOCK = ("block_size", "anchors_per_seq", "block_loss", "block_weighting", "block_gamma", "dpace_alpha")
# Their own 03 settings (name -> (type, Field)), which 03's schema takes from here; each help is opened there by the
# methods reading it (their rules' params).
PARAMS: dict[str, tuple[Any, Any]] = {
    "block_size": (int, Field(8, ge=2, description="block slots per draft forward (the anchor then masks); DFlash "
                                                   "drafts block_size-1 tokens a round, DSpark block_size: "
                                                   "num_speculative_tokens is that (DFlash, DFlash2: or fewer, "
                                                   "exported as the served block of k+1)")),
    "block_causal": (bool, Field(False, description="each slot attends only to the slots before it in its block "
                                                    "(vLLM's dflash_config.causal), so a block served shorter than "
                                                    "trained drafts what its first slots drafted in training; false "
                                                    "= the whole block (the papers')")),
    "anchors_per_seq": (int, Field(512, ge=1, description="blocks trained per sequence, anchored at random generated "
                                                          "tokens (all of them when fewer)")),
    "block_loss": (Literal["kl", "ce"], Field("kl", description="per slot KL to the target's distribution, or CE on "
                                                                "its argmax")),
    "block_weighting": (Literal["decay", "dpace"], Field(
        "decay", description="the block positions' weights: decay exp(-i/block_gamma) (DFlash), or dpace (D-PACE, "
                             "arXiv 2605.18810: suffix sums of the running products of the draft's own confidence, "
                             "the gradient of the expected accepted length)")),
    "block_gamma": (float, Field(4.0, gt=0, description="decay's gamma (DSpark's confidence loss uses it too)")),
    "dpace_alpha": (float, Field(0.5, ge=0, le=1, description="weighting dpace: the confidence's smoothing "
                                                              "(1 - alpha) q + alpha")),
    "markov_rank": (int, Field(32, ge=1, description="rank r of the Markov head (V x r, r x V)")),
    "confidence_weight": (float, Field(1.0, ge=0, description="weight of the confidence head's loss")),
    "conv_kernel_size": (int, Field(2, ge=1, description="taps of each layer's grouped dynamic convolutions within "
                                                         "the block (at most block_size)")),
    "conv_group_size": (int, Field(16, ge=1, description="hidden channels sharing one dynamic kernel (must divide "
                                                         "the draft's hidden size)")),
    "selector_rank": (int, Field(256, ge=1, description="rank of the candidate selector's codebooks (2 x V x r)")),
    "selector_top_k": (int, Field(16, ge=1, description="unary candidates the selector rescores per slot")),
}


def check_convolutions(P: Any) -> str | None:
    """Why DFlash2's convolutions cannot serve as 03's parameters set them (None when they can): served shorter
    than trained (k + 1 slots), the kernel may not reach past the served block."""
    k = P.num_speculative_tokens
    if P.conv_kernel_size > k + 1:
        return (f"method {P.method}: served at num_speculative_tokens {k}, a block of {k + 1} slots, shorter than "
                f"conv_kernel_size ({P.conv_kernel_size}): set conv_kernel_size to at most {k + 1}")
    return None


RULES = {
    "dflash": MethodRules(summary="a block drafter: one forward drafts a block from the target's states, "
                                  "docs/block-drafters.md", block=True, params=(*BLOCK, "block_causal"),
                          layer_ids=spread_layer_ids, serves_shorter=True,
                          recipes=({"block_size": 8, "block_causal": True, "num_speculative_tokens": 7},)),
    "dspark": MethodRules(summary="DFlash with a Markov and a confidence head", block=True, samples_from_anchor=True,
                          params=(*BLOCK, "markov_rank", "confidence_weight"), layer_ids=spread_layer_ids,
                          v2_only=True, recipes=({"block_size": 8, "num_speculative_tokens": 8},)),
    "dflash2": MethodRules(summary="DFlash with grouped dynamic convolutions and a candidate selector", block=True,
                           params=(*BLOCK, "block_causal", "conv_kernel_size", "conv_group_size", "selector_rank",
                                   "selector_top_k"),
                           served_as="dflash", layer_ids=spread_layer_ids, serves_shorter=True, v2_only=True,
                           check=check_convolutions,
                           recipes=({"block_size": 8, "block_causal": True, "num_speculative_tokens": 7},)),
}
