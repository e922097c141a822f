"""LiLiCorr (NVIDIA, arXiv 2608.20530): DFlash's block drafter, whose top-``k`` candidates per block slot a small
learned correlator scores as a lattice (a start score per first-slot candidate, a transition score per pair of
adjacent slots' candidates); the block drafted is the path a greedy walk takes through it. vLLM 0.32 serves it as
``method: dflash`` by the draft's architecture ``LiLiCorrDraftModel`` (its V2 runner only).

``model`` the head and the draft on DFlash's backbone (no I/O), ``objective`` DFlash's block loss plus the lattice's
three terms, ``layouts`` vLLM's checkpoint layout (speculators 0.9.0 has no LiLiCorr), ``drafting`` the walk in the
batched decoder, ``offline`` 04's chains and the lattice's prefix diagnostics, ``serving`` what vLLM would read
wrong, ``method`` its ``DraftMethod`` (``METHODS``, loaded on first use). docs/block-drafters.md explains it.
"""

from typing import Any, Literal

from pydantic import Field

from eagle3nb.drafts.base import DraftMethod, MethodRules
from eagle3nb.drafts.dflash.rules import BLOCK, check_convolutions
from eagle3nb.drafts.dflash.rules import NUM_LAYERS as BACKBONE_LAYERS
from eagle3nb.drafts.lilicorr.settings import PUBLISHED_WIDTH, topk_problem, weights_problem
from eagle3nb.layers import spread_layer_ids

# The backbone is DFlash's and so is its depth.
NUM_LAYERS = BACKBONE_LAYERS

# Its own 03 settings (name -> (type, Field)); the defaults are the published recipe's (ModelOpt's lilicorr.yaml:
# the ``base`` variant; ``margin`` is w_ce 0.125, w_margin 0.125).
PARAMS: dict[str, tuple[Any, Any]] = {
    "lilicorr_topk": (int, Field(8, ge=1, le=16, description="candidates per block slot the lattice scores (vLLM's "
                                                              "lilicorr_candidate_topk: a power of two up to 16)")),
    "lilicorr_hidden_size": (int | None, Field(None, ge=1, description=f"the lattice head's width; null = "
                                                                       f"{PUBLISHED_WIDTH} (published), or the "
                                                                       "draft's hidden size when narrower")),
    "lilicorr_factor_dim": (int | None, Field(None, ge=1, description="width of the out / in vectors whose cosines "
                                                                      "score the transitions; null = the head's "
                                                                      "width")),
    "lilicorr_num_layers": (int, Field(2, ge=1, description="attention layers over the lattice")),
    "lilicorr_num_heads": (int, Field(8, ge=1, description="heads of the lattice attention (dividing the head's "
                                                           "width)")),
    "lilicorr_mlp_ratio": (float, Field(2.0, gt=0, description="the lattice layers' MLP width over the head's")),
    "lilicorr_logit_scale": (float, Field(8.0, gt=0, description="the cosines' scale into path logits (fixed, not "
                                                                 "trained)")),
    "lilicorr_vector_eps": (float, Field(1e-4, gt=0, lt=0.5, description="eps of the out / in vectors' L2 "
                                                                         "normalisation")),
    "lilicorr_conv": (bool, Field(False, description="DFlash2's grouped convolutions (conv_kernel_size, "
                                                     "conv_group_size) around every backbone sublayer (the "
                                                     "lilicorr_conv recipe)")),
    "lilicorr_truth": (Literal["target", "data"], Field(
        "target", description="the token each slot's lattice is trained to pick: target, the target's argmax there "
                              "(what greedy decoding accepts, and what the block loss learns here), or data, the "
                              "data's token (ModelOpt's recipe, whose backbone learns the data's tokens too; on the "
                              "smoke toy it walked below its own top-1, docs/block-drafters.md)")),
    "lilicorr_joint": (bool, Field(True, description="the lattice's terms train the backbone too, through the "
                                                     "candidates' live log-probabilities and the slots' states "
                                                     "(ModelOpt's recipe); false: the head only, the backbone on "
                                                     "DFlash's block loss alone (on the demo and Kimi toys at 400 "
                                                     "steps joint training cost the backbone 0.4-1.1 tau, "
                                                     "docs/block-drafters.md)")),
    "lilicorr_w_ce": (float, Field(0.25, ge=0, description="weight of the lattice's cross-entropy of each slot's true "
                                                           "token (lilicorr_truth), the walk held to the true ones")),
    "lilicorr_w_margin": (float, Field(0.0, ge=0, description="weight of the hinge keeping the true token "
                                                              "lilicorr_margin above the best other candidate (0.125 "
                                                              "in the published margin variant, w_ce 0.125 there)")),
    "lilicorr_w_pen": (float, Field(0.25, ge=0, description="weight of the penalty: the lattice's probability of "
                                                            "each candidate times how far the target ranks it below "
                                                            "the true token")),
    "lilicorr_margin": (float, Field(2.0, description="the hinge's width in path-logit units (> 0 when "
                                                      "lilicorr_w_margin is)")),
}


def check(P: Any) -> str | None:
    """03's parameters that cannot train a LiLiCorr draft vLLM serves (its schema runs this before any work): the
    candidate count, the lattice's weights, and with ``lilicorr_conv`` DFlash2's rule for its convolutions."""
    return (topk_problem(P.lilicorr_topk)
            or weights_problem(P.lilicorr_w_ce, P.lilicorr_w_margin, P.lilicorr_w_pen, P.lilicorr_margin)
            or (check_convolutions(P) if P.lilicorr_conv else None))


# The 03 settings it reads: DFlash's block settings and causal flag, DFlash2's convolution geometry (with
# lilicorr_conv), and its own (PARAMS).
RULES = {
    "lilicorr": MethodRules(summary="DFlash whose top-k candidates per slot a learned lattice walks into a path",
                            block=True, params=(*BLOCK, "block_causal", "conv_kernel_size", "conv_group_size",
                                                *PARAMS),
                            served_as="dflash", layer_ids=spread_layer_ids, serves_shorter=True, v2_only=True,
                            check=check, recipes=({"block_size": 8, "num_speculative_tokens": 7},)),
}


def method_named(name: str) -> DraftMethod:
    """This package's ``DraftMethod`` called ``name`` (its ``method`` module loads torch: imported on first use)."""
    from eagle3nb.drafts.lilicorr.method import METHODS

    return METHODS[name]
