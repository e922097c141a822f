"""Stage 04 (``notebooks/04_acceptance.ipynb``): how often the draft is accepted, what that means for throughput,
and why: offline on held-out hidden states, by local speculative decoding, predicted, and benchmarked online
(``eagle3nb.accept.stage.run``; tables and figures in ``eagle3nb.accept.report``)."""

from __future__ import annotations

from eagle3nb.accept.params import AcceptParams

__all__ = ["AcceptParams"]
