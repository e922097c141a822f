"""Stage 06 (``notebooks/06_select.ipynb``): the draft that pays, chosen by served throughput at the user's load:
candidate recipes trained on the run's data, served on the user's engine beside the plain target, the winner written
as the run's draft (``eagle3nb.select.stage.run``; docs/select.md)."""

from __future__ import annotations

from eagle3nb.select.params import SelectParams

__all__ = ["SelectParams"]
