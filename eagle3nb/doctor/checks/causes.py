"""Why acceptance is low: the checks' results ranked into causes, likeliest first."""

from __future__ import annotations

from eagle3nb.doctor.result import FAIL, SKIP, WARN, CheckResult

# Why acceptance is low, in the order these causes are seen in practice (docs/DESIGN-FACTS.md "What users report").
CAUSES = {
    "layer_ids": "aux layer ids: the draft reads other target layers than it was trained on (off-by-one)",
    "token_stream": "token stream: training ids differ from what the target sees at serving (template/tokenizer)",
    "thinking": "thinking mode: the draft learned the other mode's output",
    "data_health": "training data: reasoning missing, truncated or cut by max_length",
    "shapes_vocab": "draft vocabulary / shapes do not fit the target",
    "serving": "serving: vLLM serves the draft as another method, k or block layout than it was trained for",
    "server": "the server: reasoning not returned, so the data lacks it",
}
UNDERTRAINED = "too little training: more samples (01 max_samples) or steps (03 max_steps)"


def short(text: str, n: int = 140) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def rank_causes(results: list[CheckResult]) -> list[str]:
    """Causes of a low acceptance, likeliest first: failed checks, then warnings, then plain undertraining
    (what remains when every check passes), then the checks that could not run (not ruled out)."""
    by_name = {r.name: r for r in results}

    def with_status(status: str, tag: str) -> list[str]:
        return [f"{cause} [{name} {tag}: {short(by_name[name].measured)}]" for name, cause in CAUSES.items()
                if name in by_name and by_name[name].status == status]

    out = with_status(FAIL, "failed") + with_status(WARN, "warned") + [UNDERTRAINED] + with_status(SKIP, "skipped")
    unchecked = [n for n in CAUSES if n not in by_name]
    if unchecked:
        out.append(f"not checked here: {', '.join(unchecked)} (run `eagle3nb doctor params/<run>/`)")
    return out

