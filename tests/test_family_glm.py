"""Every path on GLM-4.5's family: a tiny Glm4Moe target (transformers' Glm4MoeForCausalLM: partial rotary 0.5,
an explicit head_dim wider than hidden / heads, q/k norms, attention bias, the first layer dense and the rest a
sigmoid-routed MoE with a shared expert) trained briefly here on the toy dialogues in GLM-4.5's chat format, so its
answers reason and end their turn. Each test of a path is named ``test_glm_<path>`` after its cell of the family
table in docs/families.md (tests/family_matrix.py).

No package registry carries GLM-4.5's tokenizer (npm has ``@lenml/tokenizer-chatglm3`` only, ChatGLM3's older
format), so the chat format is written below from its public description onto the smoke toy's tokenizer with
GLM's special tokens added: ``[gMASK]<sop>``, ``<|system|>``/``<|user|>``/``<|assistant|>``/``<|observation|>``
each followed by a newline and the text, an assistant turn ``\\n<think>reasoning</think>\\ncontent`` (earlier
turns' reasoning dropped to ``<think></think>``), ``enable_thinking: false`` appending ``/nothink`` to the user
turns and ``\\n<think></think>`` to the generation prompt. A turn has no end token of its own: it ends at the next
role token, so the model stops on ``<|user|>`` / ``<|observation|>`` (its generation config's eos ids, with
``<|endoftext|>``), and a training stream ends with the ``<|user|>`` it sampled.

vLLM 0.32 serves Glm4Moe plainly with ``--reasoning-parser glm45`` (one server, started while 01-03 run here);
its extract_hidden_states and EAGLE-3 need the model class's EAGLE-3 interface, which Glm4MoeForCausalLM lacks:
the extraction cell pins vLLM's own refusal.
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from served_drafts import K
from stage_params import aux_ids, synth_params, train_on_all
from tiny_targets import own_continuations

from engines import Servers
from worlds import requires_vllm

pytestmark = pytest.mark.usefixtures("one_thread")

# GLM-4.5's chat format (zai-org/GLM-4.5's chat_template.jinja as its model card and vLLM's glm45 parser describe
# it; written here, tools left out).
TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set thinking_off = enable_thinking is defined and not enable_thinking -%}"
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'system' -%}{{ '<|system|>\\n' + content }}"
    "{%- elif m['role'] == 'user' -%}{{ '<|user|>\\n' + content }}"
    "{{ '/nothink' if thinking_off and not content.endswith('/nothink') else '' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<|assistant|>' }}"
    "{%- set reasoning = m.get('reasoning_content') or m.get('reasoning') or '' -%}"
    "{%- if loop.index0 > ns.last_user and reasoning.strip() -%}{{ '\\n<think>' + reasoning.strip() + '</think>' }}"
    "{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}"
    "{%- if content.strip() -%}{{ '\\n' + content.strip() }}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}{{ '<|observation|>\\n' + content }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m['role'] ~ ': use system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{{ '\\n<think></think>' if thinking_off else '' }}"
    "{%- endif -%}")
SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"]
EOS = ["<|endoftext|>", "<|user|>", "<|observation|>"]  # GLM-4.5's generation_config eos ids, in its order

# The target: 4 heads of 32 over hidden 64 (vLLM's CPU attention wants head size >= 32), GLM-4.5's partial rotary.
TRAIN_STEPS, BATCH, LR = 200, 4, 1e-2  # measured: held-out loss 0.87, greedy replies close <think> and stop, 13 s
N_PROMPTS = 8
NEW_TOKENS = 32
DRAFT_STEPS = 60
DRAFT_VOCAB = 256
TOL = 1e-4  # fp32: vLLM's CPU kernels vs transformers (test_family_gptoss measured 6e-5)


def _batches(tpls: dict, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` padded batches of toy dialogues as 01 would store them (``stream.build`` over the GLM template, each
    finished turn closed by the ``<|user|>`` the model is to sample): (input_ids, labels -100 outside the reply)."""
    from eagle3nb.data.stream import build
    from eagle3nb.toy import dialogues

    rng = random.Random("glm-train:0")
    pad = tpls[True].tokenizer.pad_token_id
    out = []
    for _ in range(n):
        rows = []
        for _ in range(BATCH):
            d = dialogues.dialogue(rng, "train")
            r = build(tpls[d["thinking"]], d["messages"], d["reasoning"] if d["thinking"] else None, d["answer"],
                      "stop", None, None)
            rows.append((r["input_ids"], r["loss_mask"].index(1)))
        T = max(len(ids) for ids, _ in rows)
        x = torch.full((BATCH, T), pad, dtype=torch.long)
        y = torch.full((BATCH, T), -100, dtype=torch.long)
        for i, (ids, p) in enumerate(rows):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, p - 1 : len(ids) - 1] = torch.tensor(ids[p:])  # shape: [T]: next-token labels on the reply
        out.append((x, y))
    return out


@pytest.fixture(scope="module")
def target_dir(toy_smoke, tmp_path_factory) -> Path:
    """The GLM folder: the smoke toy's tokenizer with GLM's specials and template, a Glm4Moe trained on it."""
    from transformers import AutoTokenizer, GenerationConfig, Glm4MoeConfig, Glm4MoeForCausalLM

    from eagle3nb.data.stream import Template
    from eagle3nb.toy.train import heldout_loss

    out = tmp_path_factory.mktemp("glm45")
    tok = AutoTokenizer.from_pretrained(toy_smoke)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})  # skipped in text, as GLM's tokenizer lists them
    tok.eos_token = "<|endoftext|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    eos = tok.convert_tokens_to_ids(EOS)
    torch.manual_seed(0)
    cfg = Glm4MoeConfig(vocab_size=-(-len(tok) // 128) * 128, hidden_size=64, intermediate_size=192,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=1024, moe_intermediate_size=64, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        use_qk_norm=True, attention_bias=True, tie_word_embeddings=False, eos_token_id=eos,
                        pad_token_id=tok.pad_token_id, bos_token_id=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    model = Glm4MoeForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False)
    data = _batches({t: Template(out, t) for t in (True, False)}, TRAIN_STEPS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    t0 = time.perf_counter()
    model.train()
    for step, (x, y) in enumerate(data):
        for g in opt.param_groups:  # the toy build's schedule: warm-up, then cosine
            g["lr"] = LR * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / TRAIN_STEPS))
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    print(f"glm45 target: {TRAIN_STEPS} steps in {time.perf_counter() - t0:.1f} s, held-out loss "
          f"{heldout_loss(model, tok, 0):.3f}")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def glm(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def synth(target_dir, glm, tok, tmp_path_factory) -> Path:
    """01_synth-format rows: toy prompts in the GLM template, each followed by the target's own greedy
    continuation (past any end of turn), loss on the continuation."""
    return own_continuations(glm, tok, N_PROMPTS, NEW_TOKENS, tmp_path_factory.mktemp("glm-synth"))


def hidden_params(synth: Path, out: Path, model_dir: Path, **kw):
    """02's parameters for the GLM folder: fp32 storage (exact), explicit aux ids, the family told from the
    folder (its template's ``[gMASK]``)."""
    from stage_params import hidden_params as params

    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return params(synth, out, model_path=str(model_dir), aux_layer_ids=aux_ids(layers), draft_vocab_size=DRAFT_VOCAB,
                  **kw)


@pytest.fixture(scope="module")
def hidden(synth, target_dir, tmp_path_factory) -> Path:
    from eagle3nb.hidden.stage import run

    out = tmp_path_factory.mktemp("glm-02")
    run(hidden_params(synth, out, target_dir))
    return out


@pytest.fixture(scope="module")
def trained(hidden, tmp_path_factory) -> Path:
    """03: a fresh draft on 02's data, no held-out split (local decoding runs on the training prompts)."""
    return train_on_all(hidden, tmp_path_factory.mktemp("glm-03"), DRAFT_STEPS)


@pytest.fixture(scope="module")
def vllm(target_dir, request, engines):
    """The real vLLM serving the GLM target plainly (its glm45 parser), starting while 01-03 run here."""
    servers = Servers(engines, target_dir)
    try:
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(servers.start, plain={"mode": "plain"})
            try:
                request.getfixturevalue("trained")
            finally:
                early.result()
        yield servers["plain"]
    finally:
        servers.stop()


# -- the format itself -----------------------------------------------------------------------------------------

def test_glm_format_is_glm45s(target_dir, tok):
    """The folder renders GLM-4.5's format, every stage reads it as the glm45 family (its think markers, the
    enable_thinking switch, <|user|> ending a turn), and vLLM gets `--reasoning-parser glm45` in fp32."""
    from eagle3nb.data.stream import Template
    from eagle3nb.families import detect
    from eagle3nb.serve.vllm import vllm_args

    fam = detect(target_dir)
    assert (fam.name, fam.think_tags, fam.end_of_turn) == ("glm45", ("<think>", "</think>"), "<|user|>")
    u = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add: 2 + 3 = 5."}
    on = tok.apply_chat_template(u + [reply], tokenize=False, **fam.template_kwargs(True))
    assert on == "[gMASK]<sop><|user|>\nWhat is 2 + 3?<|assistant|>\n<think>Add: 2 + 3 = 5.</think>\nThe answer is 5."
    off = tok.apply_chat_template(u, tokenize=False, add_generation_prompt=True, **fam.template_kwargs(False))
    assert off == "[gMASK]<sop><|user|>\nWhat is 2 + 3?/nothink<|assistant|>\n<think></think>"
    for t in ["<think>", "</think>", *SPECIALS]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    # The stream of a finished turn ends at the <|user|> the model sampled, though the template never renders it;
    # a turn cut by max_tokens does not.
    tpl = Template(target_dir, True)
    assert tpl.completion_text(u, reply["reasoning_content"], reply["content"], False) == \
        "\n<think>Add: 2 + 3 = 5.</think>\nThe answer is 5.<|user|>"
    assert tpl.completion_text(u, reply["reasoning_content"], reply["content"], True).endswith("is 5.")
    args = vllm_args(target_dir, "plain")
    assert args[args.index("--reasoning-parser") + 1] == "glm45" and args[args.index("--dtype") + 1] == "float32"


# -- the paths of the family table -----------------------------------------------------------------------------

@requires_vllm()
def test_glm_synth_vllm_parser(vllm, target_dir, tok, tmp_path):
    """01 through the real vLLM with `--reasoning-parser glm45`: every record ok, its ids the server's and equal to
    the GLM template rendering the prompt plus the split reasoning and answer, closed by the sampled <|user|>;
    the doctor's token-stream check passes against that server, and its family check refuses vLLM for the draft."""
    from eagle3nb.data.samples import load_samples
    from eagle3nb.doctor import FAIL, PASS, run_checks
    from eagle3nb.synth.stage import run

    from worlds import write_run

    url = vllm.url
    run(synth_params(tmp_path, url, target_dir))
    rows = load_samples(tmp_path / "01", statuses=("ok", "truncated", "no_reasoning", "error"))
    # A target trained 200 steps on another CPU (other weights) may ramble past max_tokens on one prompt; measured
    # here: 8 of 8 ok.
    assert len(rows) == 8 and sum(r["status"] == "ok" for r in rows) >= 7, [r["status"] for r in rows]
    rows = [r for r in rows if r["status"] == "ok"]
    assert all(r["token_source"] == "server" and r["ids_match"] is True for r in rows)
    nl, start, end, user = [tok.encode(t, add_special_tokens=False)[0] for t in ("\n", "<think>", "</think>",
                                                                                  "<|user|>")]
    for r in rows:
        assert r["reasoning"].strip() and r["content"].strip(), r["id"]
        reply = {"role": "assistant", "content": r["content"], "reasoning_content": r["reasoning"]}
        text = tok.apply_chat_template(r["messages"] + [reply], tokenize=False, enable_thinking=True)
        assert r["input_ids"] == tok.encode(text + "<|user|>", add_special_tokens=False), r["id"]
        completion = r["input_ids"][r["loss_mask"].index(1):]
        assert completion[:2] == [nl, start] and completion.count(end) == 1 and completion[-1] == user, r["id"]
    folder = write_run(tmp_path / "run", {"01_synth": {"model_path": str(target_dir), "vllm_url": url,
                                                        "max_completion_tokens": 96}})
    checks = {c.name: c for c in run_checks(folder, "01")}
    assert checks["server"].status == PASS and checks["token_stream"].status == PASS, \
        (checks["server"], checks["token_stream"])
    assert "whole conversation" in checks["token_stream"].measured, checks["token_stream"]
    assert checks["family"].status == FAIL and "SGLang" in checks["family"].fix, checks["family"]


def test_glm_hidden_inprocess(hidden, glm):
    """02's in-process states of the Glm4Moe target are transformers' own forward (one sample alone) at the aux
    ids, and the final norm's output; its partial rotary matters (a full rotary moves the states far beyond the
    tolerance), so a capture that ran another attention cannot pass."""
    from eagle3nb.data.reader import HiddenStates

    data = HiddenStates(hidden)
    L = glm.config.num_hidden_layers
    ids = data.meta["layer_ids"]
    assert ids == aux_ids(L) and data.meta["num_layers"] == L and len(data) == N_PROMPTS

    def states(row) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            hs = glm(input_ids=row["input_ids"][None], output_hidden_states=True).hidden_states
        return torch.cat([hs[j][0] for j in ids], dim=-1), hs[-1][0]

    for i in range(3):
        row = data[i]
        aux, final = states(row)
        torch.testing.assert_close(row["aux"], aux, rtol=TOL, atol=TOL)
        torch.testing.assert_close(row["final"], final, rtol=TOL, atol=TOL)


def _bases(source: str, name: str) -> set[str]:
    """The base-class names of class ``name`` in a module's source, through the bases defined in that module."""
    import ast

    classes = {c.name: c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef)}
    seen, todo = set(), [name]
    while todo:
        for b in classes[todo.pop()].bases:
            base = ast.unparse(b).split(".")[-1]
            if base not in seen:
                seen.add(base)
                todo += [base] if base in classes else []
    return seen


@requires_vllm()
def test_glm_hidden_vllm():
    """The named limit, measured: vLLM 0.32 asked to extract hidden states from this target exits at start-up with
    "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested" (its model
    runner checks ``supports_eagle3`` on the model class; extract_hidden_states captures through that interface).
    Pinned here by reading vLLM's installed source (a start-up costs ~90 s on two cores, an import of the model
    module ~30 s): fails when Glm4MoeForCausalLM gains SupportsEagle3 or the runner stops refusing, so the cell is
    revisited. Qwen3-MoE's class, which vLLM serves drafts for, shows the reading finds the interface."""
    from eagle3nb.serve.vllm import vllm_python

    root = next((vllm_python().parent.parent / "lib").glob("python3*/site-packages/vllm"))
    models = root / "model_executor" / "models"
    assert "SupportsEagle3" not in _bases((models / "glm4_moe.py").read_text(), "Glm4MoeForCausalLM")
    assert "SupportsEagle3" in _bases((models / "qwen3_moe.py").read_text(), "Qwen3MoeForCausalLM")
    runner = (root / "v1" / "worker" / "gpu_model_runner.py").read_text()
    assert "if not supports_eagle3(self.get_model()):" in runner and "does not support EAGLE3 interface" in runner


def test_glm_train(trained, target_dir, hidden):
    """03 trained a fresh draft shaped from the Glm4Moe config: its heads, KV heads and explicit head_dim (4 x 32
    over hidden 64), the dense MLP width; a Llama layer of full rotary (GLM's partial_rotary_factor and q/k norms
    are the target's attention, not the draft's); reading 02's aux layers; and it learned."""
    from eagle3nb.data.reader import HiddenStates

    target = json.loads((target_dir / "config.json").read_text())
    cfg = json.loads((trained / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert cfg[key] == target[key], key
    assert target["num_attention_heads"] * target["head_dim"] != target["hidden_size"]
    assert target["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert "partial_rotary_factor" not in json.dumps(cfg) and not cfg.get("rope_scaling"), cfg
    assert cfg["rope_theta"] == target["rope_parameters"]["rope_theta"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == HiddenStates(hidden).meta["layer_ids"]
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    first, last = train[0], train[-1]
    print(f"03 on glm45: loss {first['loss']:.3f} -> {last['loss']:.3f}, acc0 {first['acc'][0]:.3f} -> "
          f"{last['acc'][0]:.3f}")
    assert len(train) == DRAFT_STEPS and last["loss"] < 0.85 * first["loss"], (first["loss"], last["loss"])


def test_glm_local_lossless(trained, synth, glm):
    """04's local speculative decoding on the Glm4Moe target: greedy output identical to transformers' generate,
    with drafts accepted (the draft learned these prompts)."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.drafts import load_draft

    rows = [json.loads(line) for line in (synth / "samples-00000.jsonl").read_text().splitlines()]
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    want = [r["input_ids"][r["loss_mask"].index(1):] for r in rows]
    draft = load_draft(trained / "draft", embed_tokens=glm.get_input_embeddings().weight.detach())
    local = compare_with_plain(glm, draft, prompts, K, NEW_TOKENS, 0.0, ())
    print(f"glm45 local acceptance length {local['acceptance_length']:.3f}")
    assert local["identical_to_target"] and local["outputs"] == want
    assert local["acceptance_length"] > 1.5, local["acceptance_length"]


def test_glm_embedded_server(target_dir, glm, tok, request):
    """The embedded server on the GLM target returns transformers' greedy tokens, stops at the <|user|> that
    ends GLM's turn, and splits the reasoning as vLLM's glm45 parser does: it starts in the reasoning and drops
    <think> there, so the "\\n" GLM writes before <think> is reasoning, and the content follows </think>. Where the
    real vLLM runs, its answers to the same prompts split the same wherever both chose the same tokens."""
    from eagle3nb.launch import start_server
    from eagle3nb.serve.vllm import unavailable_reason
    from eagle3nb.toy import dialogues

    vllm = request.getfixturevalue("vllm") if unavailable_reason() is None else None
    nl, start, end, user = [tok.encode(t, add_special_tokens=False)[0] for t in ("\n", "<think>", "</think>",
                                                                                  "<|user|>")]
    rng = random.Random(7)
    prompts = [[{"role": "user", "content": dialogues.problem(rng, "heldout")["question"]}] for _ in range(4)]

    def ask(base: str, messages: list[dict]) -> dict:
        model = httpx.get(base + "/models").json()["data"][0]["id"]
        return httpx.post(base + "/chat/completions", timeout=120, json={
            "model": model, "messages": messages, "max_tokens": 96, "temperature": 0.0,
            "return_token_ids": True}).json()["choices"][0]

    same = closed = 0
    with start_server(target_dir) as server:
        for messages in prompts:
            ours = ask(server.base_url, messages)
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            with torch.no_grad():
                want = glm.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                      dtype=torch.long),
                                    max_new_tokens=96, do_sample=False)[0, len(prompt):].tolist()
            assert ours["token_ids"] == want, messages
            if ours["finish_reason"] != "stop":  # rambled past max_tokens (measured: never here)
                continue
            closed += 1
            assert want[:2] == [nl, start] and want.count(end) == 1 and want[-1] == user, tok.decode(want)
            cut = want.index(end)
            assert ours["message"]["reasoning"] == tok.decode([nl] + want[2:cut])
            assert ours["message"]["content"] == tok.decode(want[cut + 1:], skip_special_tokens=True)
            theirs = ask(vllm.base_url, messages) if vllm else None
            if theirs and theirs["token_ids"] == want:
                same += 1
                assert [ours["message"][f] for f in ("reasoning", "content")] == \
                    [theirs["message"][f] for f in ("reasoning", "content")], (ours, theirs)
    assert closed >= len(prompts) - 1 and (vllm is None or same >= closed - 1), (closed, same)
