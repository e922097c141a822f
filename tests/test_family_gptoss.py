"""Every path on gpt-oss's architecture: a tiny random GptOss target (tests/tiny_targets.py's ``gpt_oss``:
4 layers alternating sliding window 8 / full attention, attention sinks, 2 experts, YaRN rope) saved with the
smoke toy's tokenizer. 02 in-process and through the real vLLM's extract_hidden_states, 03 training a fresh draft
shaped from the GptOss config, and vLLM serving that draft beside the target with its own spec-decode counters
against local decoding. Each test is named ``test_gpt_oss_<path>`` after its cell of the family table.

The folder carries the toy's (Kimi-format) chat template, so ``families.detect`` reads it as kimi; vLLM refuses
any parser but Harmony's for a gpt_oss model_type ("Harmony requires GptOssReasoningParser, got
KimiK2ParserReasoningAdapter"), so every stage is told ``family: gpt_oss``. Chat would render Harmony, which the
toy tokenizer lacks, so requests go to /v1/completions with token ids; gpt-oss's own tokenizer and Harmony chat
through vLLM are tests/test_harmony.py's, on ``toy:gptoss``.

The data is the target's own greedy continuations of 8 prompts, and the draft is trained on them until it has
learned them: a random target's next token cannot be predicted from a few hundred tokens (a fresh draft stays at
acceptance ~1.04 on held-out text), so acceptance is measured on those same prompts, where it is high enough
(measured 2.79) that a draft vLLM read differently (layer ids, rope, norms, vocab map) would show."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from served_drafts import K
from stage_params import aux_ids, train_on_all
from tiny_targets import WINDOW, own_continuations

from engines import Servers
from worlds import requires_vllm

FAMILY = "gpt_oss"
N_PROMPTS = 8
NEW_TOKENS = 32  # ~30-token prompts end at ~64 tokens: well past the window of 8
TRAIN_STEPS = 60  # measured: train acc0 0.008 -> 0.81 on these 8 rows (ttt_steps 3, lr 0.02), 3 s
DRAFT_VOCAB = 256  # below the toy's 546: vLLM 0.32 loads d2t only for a draft vocabulary smaller than the target's
TOL = 1e-4  # vLLM's CPU kernels vs transformers in fp32 (measured max abs gap 6e-5 on states up to ~33)


@pytest.fixture(scope="module")
def target_dir(gpt_oss) -> Path:
    """The folder ``gpt_oss`` was saved to and loaded from: config, weights and the smoke toy's tokenizer."""
    path = Path(gpt_oss.name_or_path)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in path.iterdir()}
    return path


@pytest.fixture(scope="module")
def synth(target_dir, gpt_oss, tokenizer, tmp_path_factory) -> Path:
    """01_synth-format rows: toy prompts in the toy template, each followed by the target's own greedy
    continuation (generate, past any EOS), loss on the continuation."""
    return own_continuations(gpt_oss, tokenizer, N_PROMPTS, NEW_TOKENS, tmp_path_factory.mktemp("gpt-oss-synth"))


def hidden_params(synth: Path, out: Path, model_dir: Path, **kw):
    """02's parameters for the gpt-oss folder: fp32 storage (exact), explicit aux ids and family."""
    from stage_params import hidden_params as params

    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return params(synth, out, model_path=str(model_dir), aux_layer_ids=aux_ids(layers), family=FAMILY,
                  draft_vocab_size=DRAFT_VOCAB, **kw)


@pytest.fixture(scope="module")
def hidden(synth, target_dir, tmp_path_factory) -> Path:
    """02 in-process (transformers backend), samples packed several to a forward pass (padded batches)."""
    from eagle3nb.hidden.stage import run

    out = tmp_path_factory.mktemp("gpt-oss-02")
    t0 = time.perf_counter()
    run(hidden_params(synth, out, target_dir))
    print(f"02 in-process: {time.perf_counter() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def trained(hidden, tmp_path_factory) -> Path:
    """03: a fresh draft on 02's data, no held-out split (acceptance is measured on the training prompts)."""
    t0 = time.perf_counter()
    out = train_on_all(hidden, tmp_path_factory.mktemp("gpt-oss-03"), TRAIN_STEPS)
    print(f"03: {TRAIN_STEPS} steps in {time.perf_counter() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def vllm(target_dir, trained, gpt_oss, engines):
    """The real vLLM on the gpt-oss target, started side by side: extracting hidden states, and serving 03's
    draft. Yields (servers, errors): a mode that failed to start is in errors with vLLM's own words, and only
    the test of that mode fails."""
    L = gpt_oss.config.num_hidden_layers
    common = {"family": FAMILY, "max_model_len": gpt_oss.config.max_position_embeddings}
    servers = Servers(engines, target_dir)
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    try:
        try:
            servers.start(extract={"mode": "extract", "layer_ids": [*aux_ids(L), L], **common},
                          eagle3={"mode": "eagle3", "draft_dir": trained / "draft", "num_speculative_tokens": K,
                                  **common})
        except RuntimeError as e:  # Servers.start keeps the modes that started
            errors = {mode: str(e) for mode in ("extract", "eagle3") if mode not in servers.handles}
        print(f"vLLM extract + eagle3 side by side: {time.perf_counter() - t0:.1f} s to start")
        yield servers, errors
    finally:
        servers.stop()


def started(vllm, mode: str):
    servers, errors = vllm
    assert mode in servers.handles, f"vLLM {mode} on gpt-oss did not start: {errors.get(mode, errors)}"
    return servers[mode]


# -- 02 ----------------------------------------------------------------------------------------------------------

def test_gpt_oss_hidden_inprocess(hidden, gpt_oss):
    """02's in-process states are transformers' own forward (one sample, no padding) at the aux ids, and the final
    norm's output; the window and the sinks both change those states far beyond the tolerance, so a capture that
    dropped either (or padded batches that moved a row's window) cannot pass."""
    from eagle3nb.data.reader import HiddenStates

    data = HiddenStates(hidden)
    L = gpt_oss.config.num_hidden_layers
    ids = data.meta["layer_ids"]
    assert ids == aux_ids(L) and data.meta["num_layers"] == L and len(data) == N_PROMPTS
    assert gpt_oss.config.layer_types == ["sliding_attention", "full_attention"] * (L // 2)

    def states(row) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            hs = gpt_oss(input_ids=row["input_ids"][None], output_hidden_states=True).hidden_states
        return torch.cat([hs[j][0] for j in ids], dim=-1), hs[-1][0]

    tol, gaps = TOL, {"window": [], "sinks": []}  # fp32 noise of batched vs alone: measured 1.8e-5 on states ~30
    for i in range(3):
        row = data[i]
        assert len(row["input_ids"]) > 3 * WINDOW
        aux, final = states(row)
        torch.testing.assert_close(row["aux"], aux, rtol=tol, atol=tol)
        torch.testing.assert_close(row["final"], final, rtol=tol, atol=tol)
        gpt_oss.config.sliding_window = 10_000  # the same weights, every layer full
        try:
            gaps["window"].append(float((states(row)[1] - row["final"]).abs().max()))
        finally:
            gpt_oss.config.sliding_window = WINDOW
        sinks = [layer.self_attn.sinks.detach().clone() for layer in gpt_oss.model.layers]
        try:
            with torch.no_grad():
                for layer in gpt_oss.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: attention without sinks
            gaps["sinks"].append(float((states(row)[1] - row["final"]).abs().max()))
        finally:
            with torch.no_grad():
                for layer, s in zip(gpt_oss.model.layers, sinks):
                    layer.self_attn.sinks.copy_(s)
    print(f"gpt-oss final-state change without the window {min(gaps['window']):.3f}, without sinks "
          f"{min(gaps['sinks']):.3f} (max abs; tolerance {tol})")
    assert min(gaps["window"]) > 1000 * tol and min(gaps["sinks"]) > 1000 * tol, gaps


@requires_vllm()
def test_gpt_oss_hidden_vllm(vllm, synth, target_dir, hidden, tmp_path):
    """02 through the real vLLM's extract_hidden_states (its CPU attention with sliding windows and sinks, its
    MoE): the same samples, ids and layers as the in-process backend, equal within float noise at every
    position, past the window included."""
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.hidden.stage import run

    handle = started(vllm, "extract")
    n = 4
    t0 = time.perf_counter()
    run(hidden_params(synth, tmp_path / "vllm", target_dir, backend="vllm", vllm_url=handle.url,
                      tokens_per_batch=1, max_samples=n))
    print(f"02 through vLLM: {n} samples in {time.perf_counter() - t0:.1f} s")
    a, b = HiddenStates(tmp_path / "vllm"), HiddenStates(hidden)
    assert len(a) == n and a.meta["layer_ids"] == b.meta["layer_ids"]
    where = {s["id"]: i for i, s in enumerate(b.samples)}
    gaps = []
    for i in range(n):
        x = a[i]
        y = b[where[x["id"]]]
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert len(x["input_ids"]) > 3 * WINDOW
        torch.testing.assert_close(x["aux"], y["aux"], rtol=TOL, atol=TOL)
        torch.testing.assert_close(x["final"], y["final"], rtol=TOL, atol=TOL)
        gaps.append(max(float((x["aux"] - y["aux"]).abs().max()), float((x["final"] - y["final"]).abs().max())))
    print(f"vLLM CPU vs transformers on gpt-oss: max abs gap {max(gaps):.2e} (states up to "
          f"{float(b[0]['aux'].abs().max()):.1f})")


# -- 03 ----------------------------------------------------------------------------------------------------------

def test_gpt_oss_train(trained, target_dir, hidden):
    """03 trained a fresh draft on 02's gpt-oss data: the loss fell and the first draft token learned the
    target's; its attention is shaped from the GptOss config (heads, KV heads, head_dim, MLP width, the YaRN
    rope) and it reads 02's aux layers."""
    from eagle3nb.data.reader import HiddenStates

    target = json.loads((target_dir / "config.json").read_text())
    cfg = json.loads((trained / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert cfg[key] == target[key], key
    assert cfg["target_hidden_size"] == target["hidden_size"] and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["rope_scaling"]["rope_type"] == target["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["rope_theta"] == target["rope_parameters"]["rope_theta"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == HiddenStates(hidden).meta["layer_ids"]
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == TRAIN_STEPS
    first, last = train[0], train[-1]
    print(f"03 on gpt-oss: loss {first['loss']:.3f} -> {last['loss']:.3f}, acc0 {first['acc'][0]:.3f} -> "
          f"{last['acc'][0]:.3f}, acc per step {[round(a, 3) for a in last['acc']]}")
    assert last["loss"] < 0.85 * first["loss"], (first["loss"], last["loss"])
    assert first["acc"][0] < 0.1 and last["acc"][0] > 0.5, (first["acc"], last["acc"])


# -- vLLM serving the draft ----------------------------------------------------------------------------------------

@requires_vllm()
def test_gpt_oss_vllm_eagle3(vllm, synth, trained, gpt_oss):
    """vLLM serves 03's draft beside the gpt-oss target; its own counters (/metrics) give the acceptance of the
    same greedy prompts that local decoding (compare_with_plain) runs. Both greedy with the same draft, so the
    same rounds up to float ties: within 15% (measured: equal, 163 of 273 drafted tokens both), and every
    continuation the target's own (the data is the target's greedy output; the smallest top-1/top-2 logit margin
    on it is 5.5e-3, far above vLLM's ~1e-4 state gap, so no greedy token flips)."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.accept.online import metrics_url, scrape
    from eagle3nb.drafts import load_draft
    from eagle3nb.formulas import spec_counters, spec_delta

    handle = started(vllm, "eagle3")
    rows = [json.loads(line) for line in (synth / "samples-00000.jsonl").read_text().splitlines()]
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    want = [r["input_ids"][r["loss_mask"].index(1):] for r in rows]
    model = httpx.get(handle.base_url + "/models", timeout=30).json()["data"][0]["id"]
    murl = metrics_url(handle.base_url)
    before = spec_counters(scrape(murl))
    t0 = time.perf_counter()
    served = []
    for ids in prompts:
        reply = httpx.post(handle.base_url + "/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert reply["choices"][0]["prompt_token_ids"] == ids
        served.append(reply["choices"][0]["token_ids"])
    served_s = time.perf_counter() - t0
    acc = spec_delta(before, spec_counters(scrape(murl)))
    assert acc["engine"] == "vllm" and acc["drafts"] > 0, acc

    draft = load_draft(trained / "draft", embed_tokens=gpt_oss.get_input_embeddings().weight.detach())
    t0 = time.perf_counter()
    local = compare_with_plain(gpt_oss, draft, prompts, K, NEW_TOKENS, 0.0, ())
    local_s = time.perf_counter() - t0
    print(f"gpt-oss eagle3: vLLM acceptance length {acc['acceptance_length']:.3f} ({acc['accepted']:.0f} of "
          f"{acc['draft_tokens']:.0f} drafted, {acc['drafts']:.0f} drafts, per position "
          f"{[round(p, 3) for p in acc['per_position']]}; {served_s:.1f} s), local {local['acceptance_length']:.3f} "
          f"({local['accepted']} of {local['draft_tokens']}; {local_s:.1f} s)")
    assert local["identical_to_target"] and local["outputs"] == want
    assert served == want, [i for i, (a, b) in enumerate(zip(served, want)) if a != b]
    assert local["acceptance_length"] > 2.0, local["acceptance_length"]
    assert abs(acc["acceptance_length"] - local["acceptance_length"]) <= 0.15 * local["acceptance_length"], \
        (acc["acceptance_length"], local["acceptance_length"])
