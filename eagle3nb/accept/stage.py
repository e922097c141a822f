"""04_acceptance's work, ``run(P) -> metrics``: what the notebook and ``python -m eagle3nb.accept params/<run>/``
call. It loads the target and the draft, measures acceptance offline on held-out hidden states, decodes locally
(lossless check and costs; sampled, token-wise vs block verification), predicts the speedup, benchmarks the
endpoints, simulates adaptive verification per concurrency (a draft with a confidence head: ``adaptive.py``), and
writes ``metrics.json`` and every figure into the stage folder. Each step's result is reused when a re-run finds it
finished (``offline.json``, ``local.json``, ``verification.json``, ``online-<label>.json``; the embedded sweep's
``online-baseline.json`` and ``online-<method>-k<k>.json``, one per served k; ``adaptive_blocks.pt`` and
``adaptive.json``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eagle3nb import track
from eagle3nb.accept.adaptive import confidence_blocks, run_adaptive
from eagle3nb.accept.bench import run_benchmarks
from eagle3nb.accept.concurrency import best_k_by_concurrency, concurrency_verdict, serve_flags
from eagle3nb.accept.local import prompt_token_ids, run_local
from eagle3nb.accept.misses import summary as miss_summary
from eagle3nb.accept.models import check_serving, load_models, trained_with
from eagle3nb.accept.offline import run_offline
from eagle3nb.accept.online import baseline_label, probe_endpoints, run_online
from eagle3nb.accept.params import STAGE, AcceptParams
from eagle3nb.accept.predict import prediction
from eagle3nb.accept.report import save_figures
from eagle3nb.accept.verification import run_verification
from eagle3nb.accept.verification import summary as verification_summary
from eagle3nb.drafts import one_forward_per_round, served_as
from eagle3nb.progress import write_json_atomic


def run(P: AcceptParams) -> dict[str, Any]:
    """The whole stage: offline acceptance, the local check (when ``local_prompts``), the prediction, the
    online benchmark and adaptive verification simulated on its costs; writes ``metrics.json`` and the figures
    (``report.FIGURES``) and returns the metrics as written (NaN as None)."""
    check_serving(P)  # the draft at each k the stage serves it with, before anything loads
    probe_endpoints(P)
    target, draft, tokenizer = load_models(P, need_target=P.local_prompts > 0 or bool(P.benchmarks))
    print(f"draft {P.draft_path}: aux layers {draft.config.aux_layer_ids}, draft vocab {draft.config.draft_vocab_size}")
    print(f"held-out data {P.data_path}; output {P.stage_dir}", flush=True)
    offline = run_offline(P, draft, tokenizer)
    local = run_local(P, target, draft, tokenizer) if P.local_prompts else None
    per_seed = run_verification(P, target, draft) if P.local_prompts else {}  # sampled: standard vs block
    benchmarks = run_benchmarks(P, target, draft)
    pred = prediction(P, offline, local, parallel=one_forward_per_round(draft))
    blocks = confidence_blocks(P, draft)  # the draft's own acceptance estimates, for adaptive verification
    method = draft.method
    del target, draft  # the benchmark's servers load their own
    context = context_check(P)
    online = run_online(P)
    metrics = clean({**assemble(P, offline, local, pred, online), **by_concurrency(P, offline, online, method),
                     "benchmarks": benchmarks, "adaptive_verification": run_adaptive(P, blocks, online, pred, local)})
    metrics.update(context=context, misses=clean(miss_summary(P.stage_dir)),
                   verification=verification_summary(per_seed), verification_seeds=per_seed)
    for source, m in metrics["misses"].items():
        print(f"misses ({source}): {m['worst']}", flush=True)
    save_figures(P.stage_dir, metrics)
    write_metrics(P, metrics)
    track.stage_done(P)
    return metrics


def context_check(P: AcceptParams) -> dict[str, Any]:
    """The longest sequence the online benchmark serves (its longest prompt plus max_tokens) against the longest
    the draft trained on, with a warning when the served ones run longer: acceptance past the trained length is
    untested and usually falls (see the offline acceptance by context length)."""
    prompts, _ = prompt_token_ids(P, P.num_prompts)
    served = max(len(p) for p in prompts) + P.max_tokens
    trained = trained_with(P, "longest_train_sequence")
    warning = None
    if trained is not None and served > trained:
        warning = (f"the online prompts plus their answers run to {served} tokens, but the draft trained on sequences "
                   f"of at most {trained} (03's longest training sequence): acceptance past {trained} tokens is "
                   "untested and usually falls; train on longer samples (01 max_completion_tokens, 02/03 max_length) "
                   "or compare with a shorter max_tokens")
        print(f"WARNING: {warning}", flush=True)
    return {"longest_trained": trained, "longest_served": served, "warning": warning}


def assemble(P: AcceptParams, offline: dict[str, Any], local: dict[str, Any] | None,
             prediction: dict[str, Any] | None, online: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The stage's metrics in the contract's shape (docs/ARCHITECTURE.md "04_acceptance output")."""
    return {"stage": STAGE, "run_name": P.run_name, "draft_dir": str(P.draft_path), "data_dir": str(P.data_path),
            "model_path": P.model_path, "offline": offline, "local": local, "prediction": prediction,
            "online": online or [], "online_baseline": baseline_label(P)}


def by_concurrency(P: AcceptParams, offline: dict[str, Any], online: list[dict[str, Any]], method: str
                   ) -> dict[str, Any]:
    """Up to which concurrency the draft pays and with which k (``concurrency``): the best k per measured
    concurrency (0: plain wins), the crossover measured and predicted from the engine's step costs, and the vLLM
    flags for each level."""
    best = best_k_by_concurrency(online, baseline_label(P))
    return {"best_k_by_concurrency": best,
            "concurrency": {**concurrency_verdict(online, baseline_label(P), offline.get("acceptance_length")),
                            "serve_flags": serve_flags(best, served_as(method), str(P.draft_path))}}


def clean(x):
    """NaN and infinities as None, so every JSON reader takes the metrics."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def write_metrics(P: AcceptParams, metrics: dict[str, Any]) -> Path:
    """``output_dir/metrics.json`` (NaN written as null so every JSON reader takes it)."""
    path = P.stage_dir / "metrics.json"
    write_json_atomic(path, clean(metrics))
    return path
