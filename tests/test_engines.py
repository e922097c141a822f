"""The session's vLLM helpers (tests/engines.py) that are not a server: vLLM's model-info cache filled in one process,
as vLLM itself writes it, so a fresh machine's servers do not each inspect their model classes in a subprocess."""

from __future__ import annotations

import json

import engines
from worlds import requires_vllm


@requires_vllm()
def test_one_process_fills_vllms_model_info_cache_with_vllms_own_inspection(tmp_path, monkeypatch):
    """On an empty cache (``VLLM_CACHE_ROOT``) the class is missing; ``warm_model_info`` writes it with vLLM's own
    inspection (its file hash and model info), after which none is missing and a second call starts nothing."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(engines, "SERVED_CLASSES", (("llama", "LlamaForCausalLM"),))
    assert engines.uncached_classes() == [("llama", "LlamaForCausalLM")]
    proc = engines.warm_model_info()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert engines.uncached_classes() == [] and engines.model_info_cache() == tmp_path / "modelinfos"
    cached = engines.model_info_cache() / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    written = json.loads(cached.read_text())
    assert len(written["hash"]) >= 32 and written["modelinfo"]["is_text_generation_model"] is True
    assert engines.warm_model_info() is None
