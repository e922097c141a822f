"""03's export: the trained draft in the layouts vLLM, SGLang and speculators load, and the flags that serve
it."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from eagle3nb import drafts
from eagle3nb.drafts.eagle3.layouts import EAGLE31_KEYS
from eagle3nb.progress import write_json_atomic
from eagle3nb.train.params import TrainParams
from eagle3nb.vllm_config import draft_spec


def export(draft, P: TrainParams, verifier: str | None = None) -> dict[str, Any]:
    """Write ``draft/`` (the layout vLLM serves: its algorithm's first, with vLLM's layer ids), ``draft-sglang/``
    (same weights, SGLang's output-of-layer ids) where the algorithm has an SGLang layout and, on request,
    ``draft-speculators/`` (naming ``verifier``, the target); print the serving flags."""
    out = P.stage_dir
    dtype = getattr(torch, P.export_dtype)
    draft = draft.to("cpu").eval()
    method = drafts.of(draft)
    paths: dict[str, Any] = {}
    k = P.num_speculative_tokens
    if P.export_format in ("eagle3", "both"):
        vllm_dir = method.save(draft, out / "draft", format=method.layouts[0], dtype=dtype,
                               include_embed=P.export_embed_tokens, num_speculative_tokens=k)
        paths["draft_dir"] = str(vllm_dir)
        if "sglang" in method.layouts:
            sglang_dir = out / "draft-sglang"
            sglang_dir.mkdir(exist_ok=True)
            weights = sglang_dir / "model.safetensors"
            weights.unlink(missing_ok=True)
            os.link(vllm_dir / "model.safetensors", weights)
            write_json_atomic(sglang_dir / "config.json", method.config_json(draft, "sglang", dtype))
            paths["sglang_draft_dir"] = str(sglang_dir)
    if P.export_format in ("speculators", "both"):
        paths["speculators_dir"] = str(method.save(draft, out / "draft-speculators", format="speculators",
                                                   dtype=dtype, include_embed=P.export_embed_tokens,
                                                   verifier=verifier, num_speculative_tokens=k))
    paths["serve"] = serve_commands(paths, k, drafts.served_as(method.name),
                                    eagle31=[key for key in EAGLE31_KEYS if getattr(draft.config, key, False)])
    for line in paths["serve"].values():
        print(line, flush=True)
    return paths


def serve_commands(paths: dict[str, Any], k: int, method: str, eagle31: list[str]) -> dict[str, str]:
    """The flags that serve the exported draft (``method``: vLLM's name for it) beside its target; for an EAGLE-3.1
    draft (``eagle31``: its keys that are on) what an SGLang without them would do with it."""
    cmds = {}
    vllm_dir = paths.get("draft_dir") or paths.get("speculators_dir")
    spec = json.dumps(draft_spec(vllm_dir, k, method))  # a parallel-drafting draft's with parallel_drafting on
    cmds["vllm"] = f"vllm serve <target> --speculative-config '{spec}'"
    if paths.get("sglang_draft_dir"):
        cmds["sglang"] = (f"python -m sglang.launch_server --model-path <target> --speculative-algorithm EAGLE3 "
                          f"--speculative-draft-model-path {paths['sglang_draft_dir']} --speculative-num-steps {k} "
                          f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
        if eagle31:
            cmds["sglang_note"] = (f"SGLang: this is an EAGLE-3.1 draft ({', '.join(eagle31)}); an SGLang whose "
                                   "llama_eagle3 does not read those keys loads it without them, silently, and "
                                   "accepts less: check yours, or train with fc_norm: false, norm_output: false")
    return cmds
