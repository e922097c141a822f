"""vLLM's GPU build (``.venv-vllm-gpu/``) serving on the GPU through the project's launcher (``start_vllm(...,
cpu=False)``): its own hidden-states connector, EAGLE-3 drafts, block verification, the recipes' layouts and every
registered block drafter, against our CPU fp32 decoding of the same drafts. vLLM runs last (tests/gpu/conftest.py
ORDER), with what is left of the 10 minutes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_world import (
    BLOCK_DRAFTERS,
    MAX_TOKENS,
    VERIFY_PROMPTS,
    WIDTH_COSTS,
    K,
    adaptive_methods,
    block_package_files,
    fmt,
    needs_cuda,
    reads_differently,
    rel,
    versus_local,
    within,
)

from eagle3nb.drafts import block_methods, served_as

pytestmark = needs_cuda()


@pytest.mark.covers(fix="install vLLM's GPU build into .venv-vllm-gpu")
def test_vllm_install(vllm_install, record_property):
    """vLLM's GPU build in ``.venv-vllm-gpu/``, found or installed (``make gpu-check`` asks for the install;
    bounded by the budget, started in the background at the tier's first test)."""
    status, measured, fix = vllm_install
    record_property("measured", measured)
    assert status == "pass", f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/serve/vllm.py", "eagle3nb/vllm_config.py", fix="see eagle3nb/vllm_config.py "
                    "connector_config")
def test_vllm_hidden_states(vllm_gpu, work, toy, reference, record_property):
    """``start_vllm(mode="extract", cpu=False)`` (vLLM's own ``ExampleHiddenStatesConnector``) read by 02's vllm
    backend vs the CPU fp32 transformers states (worst relative error <= 1e-3)."""
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.layers import default_aux_layer_ids
    from eagle3nb.params import from_dict

    L = json.loads((toy / "config.json").read_text())["num_hidden_layers"]
    with vllm_gpu("extract", layer_ids=[*default_aux_layer_ids(L), L], storage_dir=work / "vllm-hidden") as h:
        extract(from_dict("02_hidden_states", {"synth_dir": str(reference["synth"]), "model_path": str(toy),
                                               "backend": "vllm", "vllm_url": h.url, "storage": "fp32",
                                               "output_dir": str(work / "02-vllm"), "run_name": "gpu-check"}))
    got = HiddenStates(work / "02-vllm")
    cpu = HiddenStates(reference["cpu-fp32"])
    ref = {cpu[i]["id"]: cpu[i] for i in range(len(cpu))}
    a = [got[i] for i in range(len(got))]
    err = max(max(rel(x["aux"], ref[x["id"]]["aux"]), rel(x["final"], ref[x["id"]]["final"])) for x in a)
    measured = (f"{len(a)} of {len(ref)} samples through ExampleHiddenStatesConnector, "
                f"{within('worst state error', err, 1e-3)} vs CPU fp32 transformers")
    record_property("measured", measured)
    fix = ("vLLM's states differ from transformers': check the layer ids (aux ids + L) and the file layout "
           "eagle3nb/data/reader.py expects")
    assert len(a) == len(ref), f"{measured}  -> {fix}"
    assert err <= 1e-3, f"{measured}  -> {fix}"


def serve_eagle3(vllm_gpu: Any, draft: Path, rows: list[dict], name: str, what: str) -> dict[str, Any]:
    """The EAGLE-3 ``draft`` served by vLLM on the GPU (K drafts a round), 04's ``bench_endpoint`` greedy on
    ``rows``: its row, once vLLM answered every request and its spec-decode counters count accepted tokens (else
    ``what`` to check)."""
    from eagle3nb.accept.online import bench_endpoint

    with vllm_gpu("eagle3", draft_dir=draft, num_speculative_tokens=K) as h:
        row = bench_endpoint(name, h.base_url, rows, [4], MAX_TOKENS, 0.0, warmup=0)[0]
    assert row["errors"] == 0 and row["metrics_engine"] == "vllm" and (row["acceptance_length"] or 0) > 1.0, (
        f"errors {row['errors']}, counters from {row['metrics_engine']}, acceptance length "
        f"{fmt(row['acceptance_length'])}  -> vLLM accepted no drafted token of {what}")
    return row


@pytest.mark.covers("eagle3nb/serve/vllm.py", "eagle3nb/vllm_config.py", fix="see eagle3nb/serve/vllm.py vllm_args")
def test_vllm_eagle3(vllm_gpu, draft_dir, prompts, local_cpu, record_property):
    """``start_vllm(mode="eagle3", cpu=False)`` serving the draft trained on cuda: vLLM's spec-decode counters count
    accepted tokens, acceptance length within 15% of CPU local decoding."""
    row = serve_eagle3(vllm_gpu, draft_dir, prompts[0], "vllm-eagle3", "the EAGLE-3 draft: check its config.json "
                       "(eagle_aux_hidden_state_layer_ids, draft_vocab_size) against `eagle3nb doctor`")
    tau, local = row["acceptance_length"], local_cpu(draft_dir)["acceptance_length"]
    measured = f"{versus_local(tau, local, 0.15)}, {row['output_tokens_per_s']:.0f} tok/s"
    record_property("measured", measured)
    assert abs(tau - local) <= 0.15 * local, f"{measured}  -> {reads_differently('vLLM')}"


@pytest.mark.covers("eagle3nb/serve/vllm.py", "eagle3nb/verification/block.py", "eagle3nb/accept/verification.py",
                    fix="see eagle3nb/serve/vllm.py V2_SPECULATIVE and eagle3nb/verification/block.py")
def test_vllm_block_verification(vllm_gpu, toy, cpu_target, draft_dir, record_property):
    """vLLM's block verification (``rejection_sample_method: block``, ``draft_sample_method: probabilistic``; its
    V2 model runner only, pinned by ``serve.vllm.V2_SPECULATIVE``) at T=1 on VERIFY_PROMPTS held-out prompts:
    vLLM's acceptance length within 10% of our block verification's (``accept.verification.compare_verification``,
    CPU fp32, same draft and prompts; 64 prompts keep the two samplers' spread near 3%)."""
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.accept.verification import compare_verification
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft

    rows, tpl = load_prompts("toy:heldout", VERIFY_PROMPTS), Template(toy, True)
    local = compare_verification(cpu_target, load_draft(draft_dir), [tpl.prompt_ids(r["messages"]) for r in rows],
                                 K, MAX_TOKENS, [1.0], [tpl.end_id], seeds=1)["1"]
    ours, standard = local["block"][0], local["standard"][0]
    spec = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    with vllm_gpu("eagle3", draft_dir=draft_dir, num_speculative_tokens=K, speculative=spec) as h:
        row = bench_endpoint("vllm-block", h.base_url, rows, [4], MAX_TOKENS, 1.0, warmup=0, k=K)[0]
    tau = row["acceptance_length"] or 0.0
    measured = (f"T=1, {len(rows)} prompts: vLLM block verification acceptance length {tau:.3f} vs ours {ours:.3f} "
                f"(within 10%; our token-wise {standard:.3f}), errors {row['errors']}, counters from "
                f"{row['metrics_engine']}, {row['output_tokens_per_s']:.0f} tok/s")
    record_property("measured", measured)
    fix = ("vLLM's block verification accepts differently from eagle3nb/verification/block.py: compare the two rules "
           "on one round's probabilities (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py)")
    assert row["errors"] == 0 and row["metrics_engine"] == "vllm", f"{measured}  -> {fix}"
    assert abs(tau - ours) <= 0.1 * ours, f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/serve/vllm.py", "eagle3nb/drafts/eagle3/layouts.py",
                    fix="see eagle3nb/drafts/eagle3/layouts.py save_draft (the layers and fc_norm names)")
def test_vllm_recipes(vllm_gpu, served_recipe, prompts, local_cpu, record_property):
    """One draft in both recipe layouts vLLM builds differently (a 2-layer EAGLE-3.1 draft: ``fc_norm`` +
    ``norm_output`` and ``num_hidden_layers: 2``, one server start instead of two), trained on cuda, served: its
    acceptance length within 15% of CPU local decoding of that draft."""
    row = serve_eagle3(vllm_gpu, served_recipe, prompts[0], "vllm-recipe", "the 2-layer EAGLE-3.1 draft: check its "
                       "config.json (num_hidden_layers, fc_norm, norm_output) and tensor names (layers.1.*, fc_norm.*) "
                       "against vLLM's llama_eagle3.py")
    tau, local = row["acceptance_length"], local_cpu(served_recipe)["acceptance_length"]
    measured = f"{versus_local(tau, local, 0.15)}, {row['output_tokens_per_s']:.0f} tok/s"
    record_property("measured", measured)
    assert abs(tau - local) <= 0.15 * local, f"{measured}  -> {reads_differently('vLLM (2-layer EAGLE-3.1 draft)')}"


def local_block(cpu_target: Any, ids: list[list[int]], draft_dir: Path) -> dict[str, Any]:
    """Our batched decoder (``SpecDecoder``, through 04's ``compare_with_plain``) with the block drafter in
    ``draft_dir`` on the CPU target, greedy, k = the block's drafts, MAX_TOKENS a prompt past any end of turn (as
    the served requests, with ``ignore_eos``): ``outputs``, ``identical_to_target``, ``acceptance_length``, ``k``."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.drafts import load_draft

    draft = load_draft(draft_dir, embed_tokens=cpu_target.get_input_embeddings().weight.detach(),
                       lm_head=cpu_target.get_output_embeddings().weight.detach())
    return compare_with_plain(cpu_target, draft, ids, draft.config.drafts_per_block, MAX_TOKENS, 0.0)


def serve_greedy(vllm_gpu: Any, mode: str, draft_dir: Path, k: int,
                 ids: list[list[int]]) -> tuple[list[list[int]], dict[str, Any], float]:
    """``ids`` through vLLM on the GPU serving ``draft_dir`` (``mode``, ``k`` drafts a round), greedy, MAX_TOKENS
    each with ``ignore_eos``: (the completions' token ids, vLLM's spec-decode counters over them, output tokens/s)."""
    import httpx

    from eagle3nb.accept.online import first_model, metrics_url, scrape
    from eagle3nb.formulas import spec_counters, spec_delta

    with vllm_gpu(mode, draft_dir=draft_dir, num_speculative_tokens=k) as h:
        model, murl = first_model(h.base_url, "EMPTY"), metrics_url(h.base_url)
        before, t0 = spec_counters(scrape(murl)), time.monotonic()
        served = [httpx.post(h.base_url + "/completions", timeout=300, json={
            "model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}).raise_for_status().json()["choices"][0]["token_ids"] for p in ids]
        seconds = time.monotonic() - t0
        return served, spec_delta(before, spec_counters(scrape(murl))), sum(map(len, served)) / seconds


@pytest.mark.covers("eagle3nb/serve/vllm.py", *block_package_files(),
                    fix="see the vLLM server log named in the traceback (a method vLLM drafts in its V2 runner only: "
                        "eagle3nb/serve/vllm.py V2_ENV, MethodRules.v2_only; training: the method's objective.py)")
@pytest.mark.parametrize("method", block_methods())
def test_vllm_block_drafters(method, vllm_gpu, block_draft, cpu_target, prompts, record_property):
    """Each registered block drafter (``eagle3nb.drafts.block_methods()``: BLOCK_DRAFTERS, block 4, 2 layers, 03 on
    cuda under autocast for the served draft's steps, on the reference data with the whole vocabulary) served by
    vLLM as the method it serves it as (``served_as``; DSpark and DFlash2 in vLLM's V2 model runner, the only one with
    DSpark's speculator and DFlash2's candidate walk), greedy on the held-out prompts' ids: our CPU decoding of the
    draft is the target's greedy output, >= 90% of vLLM's completions equal it (GPU kernels may break near-ties), and
    vLLM's acceptance length is within 15% of that local decoding's."""
    draft = block_draft(method)
    local = local_block(cpu_target, prompts[1], draft)
    assert local["identical_to_target"], (f"{method}: our CPU block decoding differs from the target's greedy output "
                                          f"on prompts {local['mismatched_prompts']}  -> our block decoding is not "
                                          "lossless: see eagle3nb/drafts/dflash/drafting.py (BlockDrafting) and "
                                          "eagle3nb/decoder/batch.py")
    served, acc, tps = serve_greedy(vllm_gpu, served_as(method), draft, local["k"], prompts[1])
    same = sum(a == b for a, b in zip(served, local["outputs"]))
    tau, ref = acc.get("acceptance_length") or 0.0, local["acceptance_length"]
    measured = (f"{method} (k={local['k']}): {same}/{len(served)} greedy completions the target's (>= 90%), "
                f"acceptance length {tau:.3f} vs CPU local {ref:.3f} (within 15%; {acc.get('accepted', 0):.0f} of "
                f"{acc.get('draft_tokens', 0):.0f} drafted), counters from {acc.get('engine')}, {tps:.0f} tok/s")
    record_property("measured", measured)
    assert same >= 0.9 * len(served), (f"{measured}  -> vLLM's {method} drafting is not lossless against the target: "
                                       "check the draft's config.json (dflash_config, target_layer_ids, mask_token_id, "
                                       "sample_from_anchor) from eagle3nb/drafts/dflash/layouts.py draft_config_json")
    assert acc.get("engine") == "vllm" and tau > 1.0 and abs(tau - ref) <= 0.15 * ref, (
        f"{measured}  -> vLLM reads the {method} draft differently from eagle3nb/drafts/dflash/drafting.py: compare "
        "the tensor names and layer ids eagle3nb/drafts/dflash/layouts.py writes with vLLM's qwen3_dflash.py / "
        "qwen3_dspark.py")


@pytest.mark.covers("eagle3nb/accept/adaptive.py", "eagle3nb/drafts/dflash/offline.py",
                    fix="see eagle3nb/accept/adaptive.py and eagle3nb/drafts/dflash/offline.py block_confidences")
@pytest.mark.parametrize("method", adaptive_methods())
def test_vllm_adaptive_verification(method, vllm_gpu, block_draft, reference, prompts, record_property):
    """The block drafter of ``test_vllm_block_drafters`` whose draft estimates its own acceptance
    (``DraftMethod.confidences``: DSpark) served with vLLM's adaptive verification (``enable_adaptive_verification:
    true``; V2 runner, CUDA graphs), greedy at concurrency 4 on the held-out prompts, against 04's simulation of the
    rule (``accept.adaptive.simulate``, c=4) on the draft's blocks of 03's held-out split of the reference data,
    priced at each width cost of WIDTH_COSTS (vLLM prices its own profiled step times, which the test cannot read):
    vLLM's acceptance length within 15% of the simulated range; its counters' drafted tokens per round equal to k
    (within 1%): vLLM's scheduler counts the scheduled drafts, not the trimmed budget
    (``v1/core/sched/scheduler.py``), so /metrics cannot give the verified count, and the line names the width cost
    whose simulated tau is nearest and the verify budget the rule gives there."""
    from eagle3nb.accept.adaptive import simulate
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout
    from eagle3nb.drafts import get, load_draft
    from eagle3nb.params import schema_for

    draft_dir, k = block_draft(method), BLOCK_DRAFTERS[method]["num_speculative_tokens"]
    data = HiddenStates(reference["cpu-full"])
    draft = load_draft(draft_dir, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    _, held = split_holdout([s["id"] for s in data.meta["samples"]],
                            schema_for("03_train").model_fields["holdout_fraction"].default)
    blocks = [b for i in held if len((b := get(method).confidences(draft, data[i], data.target_argmax(data[i])))
                                     ["anchors"])]
    sims = {b: simulate(blocks, 4, (1.0, b), 0.0) for b in WIDTH_COSTS}
    lo, hi = min(s["tau"] for s in sims.values()), max(s["tau"] for s in sims.values())
    with vllm_gpu(served_as(method), draft_dir=draft_dir, num_speculative_tokens=k,
                  speculative={"enable_adaptive_verification": True}) as h:
        row = bench_endpoint("vllm-adaptive", h.base_url, prompts[0], [4], MAX_TOKENS, 0.0, warmup=0, k=k)[0]
    tau, rate = row["acceptance_length"] or 0.0, row["acceptance_rate"] or 0.0
    drafted = (tau - 1) / rate if rate else 0.0
    near = min(sims, key=lambda b: abs(sims[b]["tau"] - tau))
    measured = (f"{method} c=4, k={k}: vLLM acceptance length {tau:.3f} vs simulated {lo:.3f}..{hi:.3f} (within 15%; "
                f"nearest at width cost {near}: budget {sims[near]['verify_budget']:.2f} of {k}), {drafted:.2f} "
                f"drafted per round counted (k), errors {row['errors']}, counters from {row['metrics_engine']}, "
                f"{row['output_tokens_per_s']:.0f} tok/s")
    record_property("measured", measured)
    fix = ("vLLM's adaptive verification accepts outside 04's simulation of its rule: compare "
           "eagle3nb/accept/adaptive.py budget/admit with vllm/v1/worker/gpu/spec_decode/adaptive_verification.py "
           "get_num_tokens")
    assert row["errors"] == 0 and row["metrics_engine"] == "vllm", f"{measured}  -> {fix}"
    assert 0.85 * lo <= tau <= 1.15 * hi, f"{measured}  -> {fix}"
    assert abs(drafted - k) <= 0.01 * k, (f"{measured}  -> a drafted count below k means vLLM now counts the trimmed "
                                          "budget: compare it with the simulated verify_budget instead")
