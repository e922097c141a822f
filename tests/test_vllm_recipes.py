"""Issue 24's recipes, as 03 trains and exports them, served by the real vLLM (CPU build).

A loss or the optimizer changes only the weights, never the export's layout (config.json and the tensors' names,
shapes and dtypes), so one test states that against the EAGLE-3.0 baseline's export and the real vLLM serves only
the layouts that differ: the EAGLE-3.0 baseline (``fc_norm: false, norm_output: false``: the published drafters'
layout, which a fine-tune keeps) and a 2-layer draft (``num_layers: 2``), two servers side by side, started while
the layout runs train. Every draft here is over the target's whole vocabulary (02 with ``draft_vocab_size`` the
toy's), the export without d2t/t2d that vLLM builds no vocabulary map for. EAGLE-3.1, 03's default, with a reduced
vocabulary, is what tests/test_vllm.py serves (the trained fixture's draft); the MLA draft is served in
tests/test_family_kimi.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors import safe_open
from served_drafts import K, held_out

from engines import Servers
from worlds import SEED, requires_vllm

pytestmark = [requires_vllm(), pytest.mark.usefixtures("one_thread")]

BASELINE = {"fc_norm": False, "norm_output": False}  # EAGLE-3.0, whatever 03's defaults are
SERVED = {"eagle3.0": BASELINE, "num_layers=2": {**BASELINE, "num_layers": 2}}
SAME_LAYOUT = {"loss=lk_lambda": {**BASELINE, "loss": "lk_lambda"}, "muon": {**BASELINE, "optimizer": "muon"}}
V31 = {"fc_norm": True, "norm_output": True}
PROMPTS, MAX_TOKENS = 6, 48


def train(data_dir: Path, out: Path, steps: int, **recipe) -> Path:
    """03 itself on ``data_dir`` (the trained fixture's 02 output) at a tiny budget; returns the exported draft."""
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    run(from_dict("03_train", {"run_name": "recipes", "data_dir": str(data_dir), "output_dir": str(out),
                               "ttt_steps": K, "lr": 5e-3, "max_length": 512, "batch_tokens": 1024,
                               "max_steps": steps, "eval_every": 0, "save_every": 1000, "seed": SEED, **recipe}))
    return out / "draft"


def layout(draft_dir: Path) -> tuple[dict, dict[str, tuple]]:
    """What vLLM's loader reads of an export: config.json, and each tensor's name -> (shape, dtype)."""
    with safe_open(draft_dir / "model.safetensors", "pt") as f:
        tensors = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    return json.loads((draft_dir / "config.json").read_text()), tensors


@pytest.fixture(scope="module")
def recipes(trained, toy_smoke, engines, tmp_path_factory) -> dict:
    """The two served recipes trained (60 steps: held-out tau ~3 here), their vLLM servers started side by side
    while EAGLE-3.1 and the same-layout recipes train (2 steps: only their layout is judged)."""
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict

    tmp = tmp_path_factory.mktemp("recipes")
    data = tmp / "02-whole-vocabulary"
    vocab = json.loads((toy_smoke / "config.json").read_text())["vocab_size"]
    extract(from_dict("02_hidden_states", {**{k: str(v) if isinstance(v, Path) else v
                                              for k, v in trained["stages"]["02_hidden_states"].items()},
                                           "output_dir": str(data), "draft_vocab_size": vocab}))
    served = {name: train(data, tmp / name, 60, **r) for name, r in SERVED.items()}
    servers = Servers(engines, toy_smoke)
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(servers.start, **{
                name: {"mode": "eagle3", "draft_dir": d, "num_speculative_tokens": K} for name, d in served.items()})
            try:
                drafts = {name: train(data, tmp / name, 2, **r)
                          for name, r in {"eagle3.1": V31, **SAME_LAYOUT}.items()}
            finally:
                started.result()
        yield {"servers": servers, "drafts": {**drafts, **served}}
    finally:
        servers.stop()


def test_a_loss_or_muon_exports_the_baselines_layout_and_31_and_2_layers_differ_as_vllm_builds_them(recipes):
    drafts = recipes["drafts"]
    base_cfg, base_tensors = layout(drafts["eagle3.0"])
    assert "fc_norm" not in base_cfg and base_cfg["num_hidden_layers"] == 1  # the 3.0 baseline, explicitly
    assert base_cfg["draft_vocab_size"] == base_cfg["vocab_size"] and not {"d2t", "t2d"} & set(base_tensors)
    for name in SAME_LAYOUT:
        assert layout(drafts[name]) == (base_cfg, base_tensors), name
    cfg, tensors = layout(drafts["eagle3.1"])
    assert {k: v for k, v in cfg.items() if k not in ("fc_norm", "norm_output")} == base_cfg
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    h = base_cfg["hidden_size"]
    assert set(tensors) - set(base_tensors) == {f"fc_norm.{i}.weight" for i in range(3)}
    assert all(tensors[f"fc_norm.{i}.weight"][0] == (h,) for i in range(3))
    cfg, tensors = layout(drafts["num_layers=2"])
    assert {**cfg, "num_hidden_layers": 1} == base_cfg and cfg["num_hidden_layers"] == 2
    # a second layer: vLLM's layers.1, a plain decoder layer (no hidden_norm; its attention reads H, not 2H)
    second = {k for k in tensors if k.startswith("layers.1.")}
    assert second and not any("hidden_norm" in k for k in second)
    assert tensors["layers.1.self_attn.q_proj.weight"][0][1] == h


@pytest.mark.parametrize("name", list(SERVED))
def test_vllm_serves_the_recipe_greedy_as_the_target_with_the_acceptance_decoded_locally(recipes, toy_smoke, name):
    """vLLM's greedy output on held-out prompts is the target's own (our plain decoding), and its spec-decode
    counters' acceptance is within 10% of our local speculative decoding of the same draft on the same prompts."""
    import httpx

    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.accept.online import first_model, metrics_url, scrape
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft
    from eagle3nb.formulas import spec_counters, spec_delta
    from eagle3nb.hf import DECODER, load_target

    server, draft_dir = recipes["servers"][name], recipes["drafts"][name]
    tpl = Template(toy_smoke, True)
    prompts = [tpl.prompt_ids(p["messages"]) for p in held_out(PROMPTS)]
    target = load_target(toy_smoke, trust_remote_code=False, use=DECODER)
    draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach())
    local = compare_with_plain(target, draft, prompts, K, MAX_TOKENS, 0.0, [tpl.end_id])
    assert local["identical_to_target"], local["mismatched_prompts"]
    model = first_model(server.base_url, "EMPTY")

    def complete(ids: list[int]) -> list[int]:
        r = httpx.post(server.base_url + "/completions", timeout=120, json={
            "model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, "skip_special_tokens": False})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    before = spec_counters(scrape(metrics_url(server.base_url)))
    with ThreadPoolExecutor(3) as pool:
        served = list(pool.map(complete, prompts))
    got = spec_delta(before, spec_counters(scrape(metrics_url(server.base_url))))
    assert served == local["outputs"]  # the target's greedy tokens (identical_to_target above)
    print(f"{name}: vLLM acceptance length {got['acceptance_length']:.3f}, local {local['acceptance_length']:.3f}")
    # Both greedy on the same prompts and the same draft: the same rounds up to float ties. A layout vLLM reads
    # otherwise (norms left out, a layer not loaded) drops vLLM's far below ours; an untrained draft gives ~1.0.
    assert got["engine"] == "vllm" and local["acceptance_length"] > 1.5, (got, local["acceptance_length"])
    assert abs(got["acceptance_length"] - local["acceptance_length"]) <= 0.10 * local["acceptance_length"], \
        (got["acceptance_length"], local["acceptance_length"])
