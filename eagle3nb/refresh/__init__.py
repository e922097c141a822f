"""Stage 05 (``notebooks/05_refresh.ipynb``): from the requests a deployment served to a refreshed draft, shipped
only if the gate finds it faster on held-out traffic and no group significantly worse (``eagle3nb.refresh.stage.run``;
docs/refresh.md)."""

from __future__ import annotations

from eagle3nb.refresh.params import RefreshParams

__all__ = ["RefreshParams"]
