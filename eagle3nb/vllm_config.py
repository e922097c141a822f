"""vLLM facts eagle3nb's stages, server launcher and doctor share: the tested release, what other releases do
differently, and the JSON of the ``--speculative-config`` / ``--kv-transfer-config`` flags of the recipe.

Core: imports no stage, so 02 (which prints the extraction command) and the launcher build one set of flags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle3nb.drafts import rules

# The vLLM release the project is tested against (README, `make vllm`, the doctor's version check).
TESTED_VERSION = "0.32.0"
CPU_CONNECTOR = "CpuHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "cpu_hidden_states_connector"
GPU_CONNECTOR = "ExampleHiddenStatesConnector"


# What a vLLM release other than the tested one is known to do differently at the boundaries eagle3nb uses:
# (introduced in, what older releases do). Read by the doctor's server check.
KNOWN_CHANGES: list[tuple[str, str]] = [
    ("0.10.2", "no return_token_ids: 01 re-tokenizes the text instead of keeping the server's ids, and 02's "
               "backend: vllm cannot check the ids it sent"),
    ("0.11.1", "the reasoning arrives in message.reasoning_content, not message.reasoning (eagle3nb reads both; "
               "scripts reading only one see empty reasoning)"),
]


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def version_notes(version: str) -> list[str]:
    """What differs from the tested vLLM for a server reporting ``version`` (empty when it is the tested one):
    the known changes it predates, or that it is newer and untested."""
    if version == TESTED_VERSION:
        return []
    v, tested = _version_tuple(version), _version_tuple(TESTED_VERSION)
    if v > tested:
        return [f"newer than the tested {TESTED_VERSION}, so untested: rehearse the recipe on it first "
                "(`make rehearse` with VLLM_SPEC set to that release in a fresh .venv-vllm)"]
    notes = [f"before {since}: {what}" for since, what in KNOWN_CHANGES if v < _version_tuple(since)]
    return notes or [f"older than the tested {TESTED_VERSION}; no known difference at eagle3nb's boundaries"]


def connector_config(storage_dir: str | os.PathLike, cpu: bool) -> dict:
    """The ``--kv-transfer-config`` of extract mode: vLLM's connector on GPUs, ours (same files) on CPU."""
    cfg = {"kv_connector": CPU_CONNECTOR if cpu else GPU_CONNECTOR, "kv_role": "kv_producer",
           "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if cpu:
        cfg["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return cfg


def extract_spec(layer_ids: list[int]) -> dict:
    """``--speculative-config`` of ``extract_hidden_states``: ``layer_ids`` are the aux ids plus ``L`` (the final
    state, the last layer's output before the final norm)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def draft_spec(draft_dir: str | os.PathLike, num_speculative_tokens: int, method: str) -> dict:
    """``--speculative-config`` that serves the draft folder ``draft_dir`` as vLLM's ``method`` (a registered method,
    or the one a method is served as: ``eagle3nb.drafts.served_as``), with the keys that method's rules read off the
    draft's config.json (``MethodRules.speculative``: EAGLE-3's parallel drafting)."""
    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": num_speculative_tokens}
    config = Path(draft_dir) / "config.json"
    extra = rules(method).speculative
    if extra is not None and config.is_file():
        spec.update(extra(json.loads(config.read_text())))
    return spec
