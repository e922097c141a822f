"""LiLiCorr's settings checks and defaults, light (no torch): read by the package's ``__init__`` (03's schema runs
its ``check`` while validating) and by the model and objective, which refuse the same misfits when built directly."""

from __future__ import annotations

# The published head (ModelOpt's lilicorr recipe, Qwen3-8B: a 4096-wide draft) is 1024 wide; a narrower draft (the
# toys' 64) gets a head as wide as itself.
PUBLISHED_WIDTH = 1024


def topk_problem(topk: int) -> str | None:
    """Why vLLM's head cannot take ``topk`` candidates per slot (one line naming 03's setting), or None."""
    if 1 <= topk <= 16 and not topk & (topk - 1):
        return None
    return (f"lilicorr_topk {topk}: vLLM's LiLiCorr head takes a power of two up to 16 candidates per slot (1, 2, 4, "
            "8 or 16): set lilicorr_topk in 03_train")


def weights_problem(w_ce: float, w_margin: float, w_pen: float, margin: float) -> str | None:
    """Why these lattice weights cannot train the head (one line naming 03's setting), or None."""
    if min(w_ce, w_margin, w_pen) < 0:
        return (f"lilicorr_w_ce {w_ce}, lilicorr_w_margin {w_margin}, lilicorr_w_pen {w_pen}: the lattice's weights "
                "are absolute and at least 0: fix them in 03_train")
    if not (w_ce or w_margin or w_pen):
        return ("lilicorr_w_ce, lilicorr_w_margin and lilicorr_w_pen are all 0: the lattice head would never train "
                "and be exported as initialised: set at least one above 0 in 03_train (published: w_ce 0.25, w_pen "
                "0.25)")
    if w_margin > 0 and margin <= 0:
        return (f"lilicorr_w_margin {w_margin} with lilicorr_margin {margin}: the hinge needs a positive width: set "
                "lilicorr_margin above 0 in 03_train (published: 2.0)")
    return None
