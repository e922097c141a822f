"""What a check-up returns: one ``CheckResult`` per check (pass / warn / fail / skip, what was measured, what
to do), gathered in a ``Report`` that prints as aligned lines and shows as a table in JupyterLab. Its own
module so the checks and their context import it without importing the doctor package back."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from eagle3nb.errors import UserError

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"

# Stable names: the acceptance notebook's verdict and the docs point at them.
CHECKS = ["family", "server", "token_stream", "thinking", "layer_ids", "shapes_vocab", "serving", "data_health",
          "disk", "draft_sanity"]

# What is worth checking at the start of each stage (the artifacts that stage reads or writes).
STAGE_CHECKS = {
    "01_synth": ["family", "server", "token_stream", "thinking", "data_health", "disk"],
    "02_hidden_states": ["family", "token_stream", "thinking", "data_health", "layer_ids", "shapes_vocab", "disk"],
    "03_train": ["family", "thinking", "data_health", "layer_ids", "shapes_vocab"],
    "04_acceptance": ["family", "thinking", "data_health", "layer_ids", "shapes_vocab", "serving", "draft_sanity"],
}


class DoctorError(UserError, RuntimeError):
    """Raised by ``check_stage(..., strict=True)`` when a check fails."""


@dataclass
class CheckResult:
    name: str
    status: str  # pass | warn | fail | skip
    measured: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        head = f"{self.status.upper():4}  {self.name:12}  {self.measured}"
        return head if self.status == PASS or not self.fix else f"{head}\n{'':18}-> {self.fix}"


class Report(list):
    """The results of one check-up; shows as aligned lines (text) or a table (JupyterLab)."""

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self if r.status == FAIL]

    def __repr__(self) -> str:
        return render(self)

    def _repr_html_(self) -> str:
        colors = {PASS: "#1a7f37", WARN: "#9a6700", FAIL: "#cf222e", SKIP: "#6e7781"}
        rows = "".join(
            f"<tr><td style='color:{colors[r.status]};font-weight:bold'>{r.status.upper()}</td>"
            f"<td><code>{r.name}</code></td><td style='text-align:left'>{html.escape(r.measured)}</td>"
            f"<td style='text-align:left'>{html.escape(r.fix)}</td></tr>"
            for r in self
        )
        return (f"<table><tr><th>status</th><th>check</th><th>measured</th><th>what to do</th></tr>{rows}</table>"
                f"<p>{html.escape(summary(self))}</p>")


def summary(results: list[CheckResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL, SKIP)}
    return "doctor: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def render(results: list[CheckResult]) -> str:
    """One line per check (plus a '-> fix' line for anything but pass), then the counts."""
    return "\n".join([r.line() for r in results] + [summary(results)])
