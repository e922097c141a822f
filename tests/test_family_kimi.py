"""Every path on Kimi-K2's own architecture: ``toy:kimi`` is a DeepseekV3 (MLA at Kimi's 512 + 64 widths, a
sigmoid-routed MoE) with Kimi's chat format, shipped as fixed bytes. 01 through the real vLLM's kimi_k2 parser,
02 in-process and through vLLM's extraction, 03 training an MLA draft, 04 local decoding, the embedded server,
and vLLM serving the draft (its deepseek_eagle3 class). Each test is named ``test_kimi_<path>`` after its cell of
the family table in docs/families.md (tests/family_matrix.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from served_drafts import family_servers, held_out, local_acceptance
from stage_params import synth_params

from engines import Servers
from worlds import SEED, family_world, requires_vllm

SERVED_TOKENS = 64
# 03's MLA draft: 60 steps, not the healthy run's 200 (a third of the fixture's cost). Measured held-out / local
# acceptance length: 200 steps 3.94 / 3.03 (seed 0); 60 steps 3.74 / 2.78 (seed 0), 3.41 / 2.76 (seed 1, kernels
# capped at AVX2); every line judged here is 1.5.
TRAIN_STEPS = 60


# The shipped toy:kimi; the embedded server on it; the trained run (01 from an embedded server, 02 in-process, 03 an
# MLA draft: the one vLLM's CPU build serves beside an MLA target), built in the background as the session starts.
kimi, kimi_embedded, kimi_trained = family_world("kimi", "toy:kimi", draft_attention="mla", max_steps=TRAIN_STEPS)


@pytest.fixture(scope="module")
def kimi_vllm(kimi, request, engines):
    """The real vLLM on toy:kimi (kimi_k2 parser): plain, extracting hidden states, serving the MLA draft."""
    yield from family_servers(engines, kimi, lambda: request.getfixturevalue("kimi_trained"))


@pytest.fixture(scope="module")
def kimi_spread(kimi):
    """The distribution test's prompt on toy:kimi (tests/sampling.py): a near-certain token, then a spread one (the
    target's top second token p 0.42). 2-18 s by load."""
    from sampling import spread_prompt

    return spread_prompt(kimi)


def test_kimi_toy_is_kimis_architecture(kimi):
    """The shipped toy is what its recipe says: Kimi-K2's architecture at Kimi's MLA widths, its router, its
    chat format (so every stage reads it as the kimi family), served in the dtype vLLM's CPU rule gives."""
    from safetensors import safe_open

    from eagle3nb.families import detect, is_mla, vllm_cpu_dtype
    from eagle3nb.serve.vllm import vllm_args
    from eagle3nb.toy.build import ROUTER, SIZES

    cfg = json.loads((kimi / "config.json").read_text())
    recipe = SIZES["kimi"]
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"] and is_mla(cfg)
    assert {k: cfg[k] for k in recipe["mla"]} == recipe["mla"] and {k: cfg[k] for k in recipe["moe"]} == recipe["moe"]
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # the only latent width vLLM's CPU MLA takes
    assert {k: cfg[k] for k in ROUTER["deepseek_v3"]} == {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    with safe_open(str(kimi / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in names)
    assert any(".mlp.experts." in n for n in names) and any(".mlp.shared_experts." in n for n in names)
    assert detect(kimi).name == "kimi"
    args = vllm_args(kimi, "plain")
    assert args[args.index("--dtype") + 1] == vllm_cpu_dtype(cfg)
    assert args[args.index("--reasoning-parser") + 1] == "kimi_k2"


def test_kimi_draft_without_mla_is_refused_by_stock_vllm_only(kimi, tmp_path):
    """Stock vLLM's CPU build (``fixes=False``) cannot serve a draft with ordinary attention (a Llama EAGLE-3, a
    DFlash block drafter) beside an MLA target, no common KV block size: the launcher says so in one line, naming
    the plugin and the parameter, instead of a worker traceback a minute later. With the plugin (the default,
    eagle3nb_vllm_fixes/blocksize.py in eagle3nb/serve/vllm_ext/) and on a GPU it passes each on, and an MLA draft
    always."""
    from eagle3nb.drafts.dflash.layouts import save_draft as save_block_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.drafts.eagle3.layouts import save_draft
    from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft
    from eagle3nb.errors import InputError
    from eagle3nb.families import MLA_ARCHS
    from eagle3nb.serve.vllm import vllm_args

    llama = Eagle3Draft(Eagle3Config(hidden_size=128, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, head_dim=64, vocab_size=8, draft_vocab_size=8))
    block = DFlashDraft(from_target(json.loads((kimi / "config.json").read_text()), block_size=4))
    drafts = {"eagle3": save_draft(llama, tmp_path / "llama"), "dflash": save_block_draft(block, tmp_path / "dflash")}
    for mode, draft in drafts.items():
        with pytest.raises(InputError, match="fixes=False.*only beside an MLA draft.*plugin.*draft_attention: mla"):
            vllm_args(kimi, mode, draft_dir=draft, fixes=False)
        assert "--speculative-config" in vllm_args(kimi, mode, draft_dir=draft)
        assert "--speculative-config" in vllm_args(kimi, mode, draft_dir=draft, cpu=False, fixes=False)
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"architectures": [MLA_ARCHS[0]]}))
    assert "--speculative-config" in vllm_args(kimi, "eagle3", draft_dir=tmp_path / "mla", fixes=False)


# Run in vLLM's own Python: the rotary kernel on toy:kimi's MLA layouts (q's rope part of [T, H, 64 + 64], k_pe
# sliced from the 576-wide latent, DeepSeek's interleaved style) and Llama's 2-D qkv split, against vLLM's own
# PyTorch formula; stock first, then after vLLM loads its general plugins (the project's, through PYTHONPATH).
ROTARY_CHECK = """
import json, torch
from vllm import _custom_ops as ops
from vllm.plugins import load_general_plugins
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
T, H, NOPE, ROPE, LATENT = 5, 2, 64, 64, 512
inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float) / ROPE))
freqs = torch.outer(torch.arange(64, dtype=torch.float), inv)
cache, pos = torch.cat((freqs.cos(), freqs.sin()), -1), torch.arange(T) + 3
def error(q_of, k_of, q, k, neox):
    want_q, want_k = q.clone(), k.clone()
    q_of(want_q)[:], k_of(want_k)[:] = RotaryEmbedding.forward_static(pos, q_of(q), k_of(k), ROPE, ROPE, cache, neox)
    ops.rotary_embedding(pos, q_of(q), k_of(k), ROPE, cache, neox)
    return max(float((q - want_q).abs().max()), float((k - want_k).abs().max()))
def errors():
    g = torch.Generator().manual_seed(0)
    mla = error(lambda q: q[..., NOPE:], lambda kv: kv[:, None, LATENT:], torch.randn(T, H, NOPE + ROPE, generator=g),
                torch.randn(T, LATENT + ROPE, generator=g), False)
    qkv = torch.randn(T, 3 * H * ROPE, generator=g)
    llama = error(lambda x: x[:, :H * ROPE], lambda x: x[:, H * ROPE:2 * H * ROPE], qkv, qkv.clone(), True)
    return {"mla": mla, "llama": llama}
stock = errors()
load_general_plugins()
print(json.dumps({"stock": stock, "fixed": errors(), "wrapped": hasattr(ops.rotary_embedding, "eagle3nb_wrapped")}))
"""


@requires_vllm()
def test_kimi_rotary_fix_in_vllms_process():
    """vLLM 0.32's CPU rotary kernel mis-rotates MLA's 3-D strided views (and writes into the latent beside
    k_pe) while reading Llama's 2-D views right; the project's vLLM plugin, loaded the way vLLM loads it, makes
    the MLA layout exact. (~15 s: one vLLM import.)"""
    import os
    import subprocess

    from eagle3nb.serve.vllm import VLLM_EXT, vllm_python

    env = {**os.environ, "PYTHONPATH": str(VLLM_EXT)}
    out = subprocess.run([str(vllm_python()), "-c", ROTARY_CHECK], env=env, capture_output=True, text=True,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    print(f"vLLM CPU rotary, max abs error: {got}")
    assert got["stock"]["llama"] < 1e-5 and got["fixed"]["mla"] < 1e-5 and got["fixed"]["llama"] < 1e-5, got
    assert got["wrapped"] == (got["stock"]["mla"] > 1e-5), got  # wrapped where, and only where, it misreads (0.32)


# Run in vLLM's own Python: the block-size fix's probe and vLLM's own choice of a kernel block size for an MLA layer
# (CPU_MLA) beside an ordinary one (CPU_ATTN), the function that refuses "No common block size" in a worker; stock
# first, then with the kernel made to read the wrong blocks at 16 only (the probe must catch it and leave vLLM's
# declaration alone), then after vLLM loads its general plugins (the project's, through PYTHONPATH).
BLOCKSIZE_CHECK = """
import json
from vllm import _custom_ops as ops
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.worker.utils import select_common_block_size
from eagle3nb_vllm_fixes import blocksize
def state():
    try:
        common = select_common_block_size(16, [CPUMLABackend, CPUAttentionBackend])
    except ValueError as e:
        common = str(e)
    return {"declared": str(CPUAttentionBackend.get_supported_kernel_block_sizes()), "common": common}
stock = {**state(), "probe": blocksize.probe()}
kernel = ops.cpu_attention_with_kv_cache
def misreads_16(**kw):
    at_16 = kw["key_cache"].shape[2] == 16
    return kernel(**{**kw, "block_table": kw["block_table"].roll(1, 1) if at_16 else kw["block_table"]})
ops.cpu_attention_with_kv_cache = misreads_16
blocksize.check_and_fix()
broken = {"error": blocksize.kernel_error(16), "at_32": blocksize.kernel_error(32), **state()}
ops.cpu_attention_with_kv_cache = kernel
load_general_plugins()
print(json.dumps({"stock": stock, "broken": broken, "fixed": state()}))
"""


@requires_vllm()
def test_kimi_blocksize_fix_in_vllms_process():
    """vLLM 0.32's CPU attention declares KV blocks of 32 only, so its own block-size choice finds none for an MLA
    layer (16 only) beside an ordinary one, while its kernel computes blocks of 16 as exactly as 32 in every dtype,
    causal or not. The probe is not vacuous: a kernel reading the wrong blocks at 16 shows a large error there and
    the declaration stays; the plugin, loaded the way vLLM loads it, declares 16 and vLLM chooses it. (~10 s: one
    vLLM import.)"""
    import os
    import subprocess

    from eagle3nb.serve.vllm import VLLM_EXT, vllm_python

    env = {**os.environ, "PYTHONPATH": str(VLLM_EXT)}
    out = subprocess.run([str(vllm_python()), "-c", BLOCKSIZE_CHECK], env=env, capture_output=True, text=True,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    print(f"vLLM CPU attention, max abs error by case at blocks of 16 / 32: {got['stock']['probe']}")
    stock, broken = got["stock"], got["broken"]
    assert stock["probe"]["float32"][0] < 1e-5 and stock["probe"]["float32 non-causal"][0] < 1e-5, stock
    assert all(e16 <= 2 * e32 + 1e-6 for e16, e32 in stock["probe"].values()), stock  # half dtypes round alike
    assert broken["error"] > 0.5 and broken["at_32"] < 1e-5, broken  # the probe can fail, at 16 only
    assert broken["declared"] == stock["declared"] and broken["common"] == stock["common"], broken  # then no 16
    if stock["common"] != 16:  # vLLM 0.32's declaration; a vLLM declaring 16 itself is left as it is
        assert stock["declared"] == "[MultipleOf(32)]" and "No common block size for 16" in stock["common"], stock
    assert got["fixed"]["common"] == 16 and "16" in got["fixed"]["declared"], got["fixed"]


@requires_vllm()
def test_kimi_synth_vllm_parser(kimi_vllm, kimi, tmp_path):
    """01 through the real vLLM with Kimi's parser, greedy: the records finish within 256 tokens as transformers'
    toy does (before the rotary fix vLLM's answers rambled: 4 of 8 past 96 tokens), each has its reasoning split
    out, opens with the think marker, ends the turn, and matches the template's rendering exactly unless its
    stream closed the reasoning twice (then 01 flags it). 7 of 8, not 8: a float tie may flip a greedy token on
    another CPU."""
    from eagle3nb.data.samples import load_samples
    from eagle3nb.data.stream import Template
    from eagle3nb.synth.stage import run

    run(synth_params(tmp_path, kimi_vllm["plain"].url, kimi, max_completion_tokens=256))
    rows = load_samples(tmp_path / "01", statuses=("ok", "truncated", "no_reasoning", "error"))
    statuses = [r["status"] for r in rows]
    print(f"kimi through vLLM: {statuses.count('ok')} of {len(rows)} finished within 256 tokens")
    assert len(rows) == 8 and set(statuses) <= {"ok", "truncated"} and statuses.count("ok") >= 7, statuses
    assert all(r["token_source"] == "server" for r in rows)
    tpl = Template(kimi, True)
    start, end = tpl.think_ids
    ok = [r for r in rows if r["status"] == "ok"]
    single = 0
    for r in ok:
        completion = r["input_ids"][r["loss_mask"].index(1):]
        assert r["reasoning"] and completion[0] == start and completion[-1] == tpl.end_id, r["id"]
        # A stream that closes its reasoning twice cannot be the template's rendering of the parsed reasoning
        # and answer: 01 flags it ids_match false; every other one matches exactly.
        assert r["ids_match"] is (completion.count(end) == 1), (r["id"], completion.count(end))
        single += completion.count(end) == 1
    assert single >= 7, [r["id"] for r in ok]


def test_kimi_hidden_inprocess(kimi, kimi_trained):
    """02's in-process states of the MLA + MoE target are transformers' own forward at the aux layer ids, and
    the final norm's output."""
    from transformers import AutoModelForCausalLM

    from eagle3nb.data.reader import HiddenStates

    data = HiddenStates(kimi_trained["out"] / "02_hidden_states")
    ids = data.meta["layer_ids"]
    model = AutoModelForCausalLM.from_pretrained(kimi, dtype=torch.float32).eval()
    for i in range(3):
        row = data[i]
        with torch.no_grad():
            hs = model(input_ids=row["input_ids"][None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[j][0] for j in ids], dim=-1)
        # the storage's rounding: bf16 keeps 8 significant bits (relative error up to 2**-8), fp32 only noise
        rtol = 1e-5 if data.storage == "fp32" else 2 ** -7
        torch.testing.assert_close(row["aux"].float(), want, rtol=rtol, atol=1e-5)
        torch.testing.assert_close(row["final"].float(), hs[-1][0], rtol=rtol, atol=1e-5)


@requires_vllm()
def test_kimi_hidden_vllm(kimi_vllm, kimi, tmp_path):
    """02 through vLLM's extract_hidden_states on the MLA target: the same samples, ids and layers as the
    in-process backend, and the same states up to the served dtype's rounding at every position. vLLM's CPU build
    serves an MLA target in bfloat16 where the CPU has AMX (``families.vllm_cpu_dtype``), else in float32: float32
    is held to the smoke toy's 1e-4 (test_vllm_backend_equals_transformers_backend); bfloat16 to a relative error
    per position of 16 bfloat16 epsilons, 0.125 (measured on an AMX Xeon: the aux states 0.0065 at worst, the final
    state, after every layer's rounding and the MoE's routing, 0.066; transformers' own bfloat16 aux states are
    0.027 from its float32 ones). Before the project's rotary fix vLLM agreed at position 0 only (its rotation is the
    identity) and was 0.4 relative apart after it: outside either."""
    import shutil

    from stage_params import hidden_params, write_synth

    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.families import vllm_cpu_dtype
    from eagle3nb.hidden.stage import run

    shutil.copytree(kimi, tmp_path / "model")
    synth = write_synth(tmp_path / "synth", tmp_path / "model", n=4)
    run(hidden_params(synth, tmp_path / "vllm", backend="vllm", vllm_url=kimi_vllm["extract"].url, tokens_per_batch=1))
    run(hidden_params(synth, tmp_path / "hf", tokens_per_batch=1))
    a, b = HiddenStates(tmp_path / "vllm"), HiddenStates(tmp_path / "hf")
    assert len(a) == len(b) == 4 and a.meta["layer_ids"] == b.meta["layer_ids"]
    served = vllm_cpu_dtype(json.loads((kimi / "config.json").read_text()))
    rel_tol = 16 * torch.finfo(torch.bfloat16).eps if served == "bfloat16" else None
    gaps = []
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"]) and len(x["input_ids"]) > 16
        for key in ("aux", "final"):
            if rel_tol is None:
                torch.testing.assert_close(x[key], y[key], rtol=1e-4, atol=1e-4)
            rel = float(((x[key] - y[key]).norm(dim=-1) / y[key].norm(dim=-1)).max())  # the worst position
            gaps.append(rel)
            assert rel_tol is None or rel <= rel_tol, (i, key, served, rel)
    print(f"vLLM CPU MLA ({served}) vs transformers (float32): worst relative state difference {max(gaps):.2e}")


def test_kimi_train(kimi_trained):
    """03 trained an MLA draft (vLLM's deepseek_eagle3 layout, the target's latent widths) that predicts the
    target: held-out simulated acceptance well above an untrained draft's ~1.0."""
    out = kimi_trained["out"] / "03_train"
    cfg = json.loads((out / "draft" / "config.json").read_text())
    target = json.loads((kimi_trained["stages"]["04_acceptance"]["model_path"] / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert cfg["kv_lora_rank"] == target["kv_lora_rank"] and cfg["qk_rope_head_dim"] == target["qk_rope_head_dim"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout"]["acceptance_length"] > 1.5, metrics["heldout"]


def test_kimi_local_lossless(kimi, kimi_trained):
    """04's local speculative decoding on the MLA + MoE target: greedy output identical to the target's own,
    with the draft accepted."""
    local = local_acceptance(kimi, kimi_trained["out"] / "03_train" / "draft", held_out(4), SERVED_TOKENS)
    assert local["identical_to_target"], local
    assert local["acceptance_length"] > 1.5, local


def greedy_replies_are_transformers(kimi: Path, base_url: str, n: int, max_tokens: int) -> list[list[int]]:
    """Chat requests at temperature 0 to ``base_url`` for ``n`` held-out prompts: each prompt is the template's,
    each answer transformers' greedy tokens from it (a prefix of them where the server stops on its own) with the
    reasoning split out. Returns the answers' tokens."""
    import httpx
    from transformers import AutoModelForCausalLM

    from eagle3nb.data.stream import Template

    tpl = Template(kimi, True)
    model = AutoModelForCausalLM.from_pretrained(kimi, dtype=torch.float32).eval()
    served = httpx.get(base_url + "/models").json()["data"][0]["id"]
    answers = []
    for p in held_out(n):
        prompt = tpl.prompt_ids(p["messages"])
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
        reply = httpx.post(base_url + "/chat/completions", timeout=120, json={
            "model": served, "messages": p["messages"], "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}).json()
        choice = reply["choices"][0]
        assert reply["prompt_token_ids"] == prompt
        assert choice["token_ids"] == want[:len(choice["token_ids"])], (choice["token_ids"], want)
        assert choice["message"]["reasoning"] and tpl.think_ids[0] in choice["token_ids"]
        answers.append(choice["token_ids"])
    return answers


def test_kimi_embedded_server(kimi, kimi_embedded):
    """The embedded server on toy:kimi splits the reasoning at Kimi's markers and returns transformers' greedy
    tokens."""
    assert len(greedy_replies_are_transformers(kimi, kimi_embedded.base_url, 1, 48)[0]) > 4


@requires_vllm()
def test_kimi_vllm_greedy_is_transformers(kimi_vllm, kimi):
    """vLLM on toy:kimi (its MLA path, the rotary embedding included) answers chat prompts with transformers'
    greedy tokens, token for token (4 prompts, ~24 tokens each): the CPU rotary kernel mis-rotated MLA's strided
    views until the project's vLLM plugin (eagle3nb_vllm_fixes/rotary.py in eagle3nb/serve/vllm_ext/) handed it 2-D
    copies (stock vLLM left transformers' tokens after 2)."""
    answers = greedy_replies_are_transformers(kimi, kimi_vllm["plain"].base_url, 4, 48)
    assert min(map(len, answers)) > 4 and sum(map(len, answers)) >= 56, list(map(len, answers))


# Run in a child Python from a temporary directory with EAGLE3NB_ROOT unset: the launcher finds the plugin itself.
LAUNCH_ELSEWHERE = """
import sys
from eagle3nb.serve.vllm import start_vllm
with start_vllm("toy:kimi", timeout=500) as handle:
    print(handle.base_url, flush=True)
    sys.stdin.read()  # serves until the test closes this
"""


@requires_vllm()
def test_kimi_vllm_started_from_another_directory_has_the_fixes(kimi, tmp_path):
    """The launcher started where there is no project (a temporary current directory, ``EAGLE3NB_ROOT`` unset) gives
    vLLM the plugin from the package it is imported from: toy:kimi answers with transformers' greedy tokens, token
    for token (when it took the plugin from the cwd's project, this start served 6/9, 0/24 and 1/24 of them: MLA's
    rotary mis-rotated again). ~40 s: a server of its own (the slow tier)."""
    import os
    import subprocess
    import sys

    import eagle3nb
    from eagle3nb.serve.vllm import VLLM_VENV_ENV, vllm_python

    env = {k: v for k, v in os.environ.items() if k != "EAGLE3NB_ROOT"}
    env |= {"PYTHONPATH": str(Path(eagle3nb.__file__).parents[1]), VLLM_VENV_ENV: str(vllm_python().parents[1])}
    away = tmp_path / "elsewhere"
    away.mkdir()
    with open(tmp_path / "stderr", "w") as err:
        child = subprocess.Popen([sys.executable, "-c", LAUNCH_ELSEWHERE], cwd=away, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://"), (tmp_path / "stderr").read_text()[-3000:]
        answers = greedy_replies_are_transformers(kimi, url, 3, 24)
    finally:
        child.stdin.close()
        child.wait(60)
    assert min(map(len, answers)) > 4 and sum(map(len, answers)) >= 24, list(map(len, answers))


@requires_vllm()
def test_kimi_vllm_eagle3(kimi_vllm, kimi, kimi_trained):
    """vLLM serves 03's MLA draft beside Kimi's architecture and reports acceptance from its own counters, within
    10% of local decoding on the same prompts (both greedy, the same states since the rotary fix: measured 3.095
    both; before it vLLM measured 1.83 against 3.08, the target's and the MLA draft's rotary both mis-rotated)."""
    from eagle3nb.accept.online import bench_endpoint

    prompts = held_out(16)
    row = bench_endpoint("eagle3", kimi_vllm["eagle3"].base_url, prompts, [4], max_tokens=SERVED_TOKENS,
                         temperature=0.0, warmup=0)[0]
    assert row["errors"] == 0 and row["metrics_engine"] == "vllm", row
    local = local_acceptance(kimi, kimi_trained["out"] / "03_train" / "draft", prompts, SERVED_TOKENS)
    print(f"kimi: vLLM acceptance length {row['acceptance_length']:.3f}, local {local['acceptance_length']:.3f}")
    assert local["acceptance_length"] > 1.5, local
    assert abs(row["acceptance_length"] - local["acceptance_length"]) <= 0.10 * local["acceptance_length"], \
        (row["acceptance_length"], local["acceptance_length"])


@requires_vllm()
def test_kimi_vllm_serves_a_dflash_block_drafter(kimi, engines, tmp_path):
    """vLLM serves a DFlash block drafter (Qwen3 attention) beside Kimi's MLA target: stock vLLM's CPU build cannot
    start it ("No common block size for 16": its MLA kernel takes KV blocks of 16, its other attention declared
    multiples of 32): with the plugin's block-size fix it starts, and vLLM says it loaded the draft's
    ``mask_embedding.pt``; greedy chat replies are
    transformers' greedy tokens and vLLM's spec-decode counters count the drafts (k per draft). Random weights: the
    target's verification makes any draft lossless. ~35 s (its own server; the slow tier)."""
    from eagle3nb.accept.online import metrics_url, scrape
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.formulas import spec_counters, spec_delta

    torch.manual_seed(SEED)
    draft = DFlashDraft(from_target(json.loads((kimi / "config.json").read_text()), num_layers=2, block_size=4))
    weights = load_file(kimi / "model.safetensors")  # the target's rows: the mask input starts at their live mean,
    draft.set_target(weights["model.embed_tokens.weight"].float(),  # as 03 starts it (a zero one is refused)
                     weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float())
    k = draft.config.drafts_per_block
    servers = Servers(engines, kimi)
    try:
        servers.start(dflash={"mode": "dflash", "draft_dir": save_draft(draft, tmp_path / "draft"),
                              "num_speculative_tokens": k})
        handle = servers["dflash"]
        murl = metrics_url(handle.base_url)
        before = spec_counters(scrape(murl))
        answers = greedy_replies_are_transformers(kimi, handle.base_url, 2, 32)
        acc = spec_delta(before, spec_counters(scrape(murl)))
        log = handle.log()  # vLLM's own lines (its mask-embedding loader's)
    finally:
        servers.stop()
    print(f"vLLM dflash beside toy:kimi: {acc['drafts']:.0f} drafts, acceptance length {acc['acceptance_length']:.3f}")
    assert min(map(len, answers)) > 4, list(map(len, answers))
    assert acc["engine"] == "vllm" and acc["drafts"] > 0 and acc["draft_tokens"] == k * acc["drafts"], acc
    assert f"Loaded DFlash mask embedding for mask_token_id {draft.config.mask_token_id}" in log, log[-2000:]


@requires_vllm()
def test_kimi_vllm_samples_the_targets_distribution(kimi_vllm, kimi_spread, one_thread):
    """vLLM at T=1 on the MLA + MoE target, plainly and verifying the MLA draft's greedy proposals by rejection
    sampling (the fixes plugin's dtype-preserving ``_expand`` carrying the temperature): the second generated token
    of N seeded requests to each fits transformers' probabilities, and the two agree (tests/sampling.py's G-tests;
    with sampled drafting, ``draft_sample_method: probabilistic``, measured p 0.25 and 0.86 once). 23 s."""
    from sampling import check_served_distribution

    check_served_distribution(kimi_vllm["plain"].base_url, kimi_vllm["eagle3"].base_url, kimi_spread)

