"""Stage 05 (``notebooks/05_refresh.ipynb``): from the requests a deployment served to a refreshed draft, shipped
only if it wins everywhere (``eagle3nb.refresh.stage.run``; docs/refresh.md)."""

from __future__ import annotations

from eagle3nb.refresh.params import RefreshParams

__all__ = ["RefreshParams"]
