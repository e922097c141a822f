"""gpt-oss in its own chat format: ``toy:gptoss`` (GptOss on the real gpt-oss tokenizer, our Harmony template) and
the real vLLM's gpt-oss chat path, which renders the prompt itself through openai_harmony from the encoding file
``real_tokenizers.harmony_encodings`` writes from the tokenizer package (docs/harmony.md). The paths of the
family table on the toy are named ``test_gpt_oss_<path>`` (tests/family_matrix.py); the random-weight GptOss
target's paths stay in tests/test_family_gptoss.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from background import register
from served_drafts import K
from stage_params import synth_params

from engines import Servers
from worlds import requires_vllm

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY = "gpt_oss"
N_RECORDS = 6
TRAIN_STEPS = 20  # 03 on the toy's 201,088-row vocabulary pays ~1 s a step for the target's argmax on CPU
# Conversations vLLM and our template must render alike: a plain user turn; system instructions (Harmony's
# developer message), an answered turn whose reasoning Harmony drops, non-ASCII text; an explicit effort.
CONVERSATIONS = [
    ([{"role": "user", "content": "What is 2+2?"}], None),
    ([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Spell naïve, s'il vous plaît"},
      {"role": "assistant", "content": "n a ï v e", "reasoning": "Spell it: n 1, a 2."},
      {"role": "user", "content": "And  2026 éléphants?\n"}], None),
    ([{"role": "user", "content": "Compute 4 + 8."}], "high"),
]
# What vLLM renders (its own harmony_utils, the functions its chat path calls) and how openai_harmony tokenizes a
# text, in vLLM's environment.
VLLM_RENDER = """
import json, sys
from vllm.entrypoints.openai.parser import harmony_utils as h
cases, texts = json.loads(sys.stdin.read())
out = []
for messages, effort in cases:
    instructions, rest = h.extract_instructions_from_messages(list(messages))
    msgs = h.build_harmony_preamble(instructions=instructions, reasoning_effort=effort)
    out.append(h.render_for_completion(msgs + h.parse_chat_inputs_to_harmony_messages(rest)))
enc = h.get_encoding()
print(json.dumps([out, [enc.encode(t, allowed_special="all") for t in texts]]))
"""


# the toy, built in the background as the session starts (tests/background.py)
register("gptoss", "toy", spec="toy:gptoss")


@pytest.fixture(scope="module")
def gptoss(_project_env) -> Path:
    """The toy, built at first use (about two minutes on two cores; cached in .cache/ between runs): in the
    background, or here, waiting on the background's build lock."""
    from eagle3nb.toy import resolve_model_path

    return resolve_model_path("toy:gptoss")


@pytest.fixture(scope="module")
def tok(gptoss):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gptoss)


@pytest.fixture(scope="module")
def gptoss_vllm(gptoss, engines):
    """The real vLLM on toy:gptoss with its family's `--reasoning-parser openai_gptoss` (chat through Harmony)."""
    servers = Servers(engines, gptoss)
    try:
        servers.start(plain={"mode": "plain"})
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def records(gptoss_vllm, gptoss, tmp_path_factory) -> Path:
    """01 through vLLM's gpt-oss chat: the synth folder."""
    from eagle3nb.synth.stage import run

    out = tmp_path_factory.mktemp("gptoss-01")
    run(synth_params(out, gptoss_vllm["plain"].url, gptoss, max_samples=N_RECORDS))
    return out / "01"


# -- the encoding file and the toy ------------------------------------------------------------------------------

def test_harmony_encoding_is_derived_from_the_package_and_checked(tok, tmp_path, monkeypatch):
    """The encoding file written from the tokenizer package is OpenAI's (its published sha256), each line the
    token's bytes by rank; a vocabulary that writes other bytes is refused in one line naming the hash."""
    import base64

    from eagle3nb.errors import InputError
    from eagle3nb.paths import file_sha256
    from eagle3nb.toy import real_tokenizers as rt

    path = rt.harmony_encodings() / rt.HARMONY_FILE
    assert file_sha256(path) == rt.HARMONY_SHA256
    lines = path.read_bytes().splitlines()
    vocab = tok.get_vocab()
    assert len(lines) == 199998 == min(tok.all_special_ids)
    for token in ("Ġthe", "ĠparÃ¢metros", "Ċ"):  # ASCII, a two-byte character, a shifted byte (newline)
        rank = vocab[token]
        b64, r = lines[rank].split()
        assert int(r) == rank and base64.b64decode(b64).decode() == tok.decode([rank]), token
    bad = {"model": {"vocab": {"Ġthe": 0, "!": 1}}}  # another vocabulary: other bytes, another hash
    (tmp_path / "tokenizer.json").write_text(json.dumps(bad))
    assert rt.tiktoken_bpe(tmp_path / "tokenizer.json") == b"IHRoZQ== 0\nIQ== 1\n"
    monkeypatch.setattr(rt, "fetch", lambda spec: tmp_path)
    monkeypatch.setattr(rt.paths, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(InputError, match=f"not OpenAI's {rt.HARMONY_SHA256[:12]}"):
        rt.harmony_encodings()


def test_gptoss_toy_is_gpt_oss_on_the_real_tokenizer(gptoss, tok):
    """GptOss with sliding-window and full layers, sinks and experts, the real vocabulary size, the package's
    tokenizer files as fetched, our Harmony template, told as the gpt_oss family."""
    from eagle3nb import families
    from eagle3nb.paths import file_sha256
    from eagle3nb.toy import real_tokenizers as rt

    cfg = json.loads((gptoss / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["vocab_size"] == 201088 and len(tok) == 200019
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)
    assert cfg["sliding_window"] == 32 and cfg["num_local_experts"] == 4 and cfg["head_dim"] >= 32
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|return|>")
    for name, sha in rt.GPTOSS.files.items():
        assert file_sha256(gptoss / name) == sha, name
    assert families.detect(gptoss).name == FAMILY


@requires_vllm()
def test_harmony_template_renders_as_vllm(tok):
    """Our template gives, token for token, the prompt vLLM's gpt-oss chat path renders through openai_harmony
    (its system message with today's date, developer instructions, dropped reasoning of answered turns, the
    reasoning effort), and the package's tokenizer encodes text as Harmony's encoding does."""
    from eagle3nb.serve.vllm import vllm_python
    from eagle3nb.toy.real_tokenizers import HARMONY_ENV, harmony_encodings

    texts = ["Spell naïve: n 1, a 2.  Ünïcödé 12345 \n\n tabs\there 你好 🙂", "<|start|>user<|message|>hi<|end|>"]
    env = {HARMONY_ENV: str(harmony_encodings()), "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([str(vllm_python()), "-c", VLLM_RENDER], input=json.dumps([CONVERSATIONS, texts]),
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rendered, encoded = json.loads(done.stdout.strip().splitlines()[-1])
    for (messages, effort), want in zip(CONVERSATIONS, rendered):
        kw = {"reasoning_effort": effort} if effort else {}
        ours = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
        assert list(ours) == want, tok.decode(want)
    assert encoded == [tok.encode(t, add_special_tokens=False) for t in texts]


# -- the paths of the family table ------------------------------------------------------------------------------

@requires_vllm()
def test_gpt_oss_synth_vllm_parser(records, tok):
    """01 through the real vLLM's gpt-oss chat with `--reasoning-parser openai_gptoss`: every record ok, its ids
    the server's: the prompt our template's rendering, the turn the parser's reasoning (analysis channel) and
    answer (final channel) in Harmony's markers, ending <|return|>, the template's rendering of both wherever the
    model sampled the canonical tokens of its text (ids_match false exactly where it did not: o200k's digits
    split in threes, and the toy sometimes writes "13" "00" for "130" "0"); reasoning / content token counts by
    channel."""
    from eagle3nb.data.samples import load_samples

    rows = load_samples(records, statuses=("ok", "truncated", "no_reasoning", "error"))
    assert len(rows) == N_RECORDS and all(r["status"] == "ok" for r in rows), [(r["status"], r["error"]) for r in rows]
    assert all(r["token_source"] == "server" for r in rows)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    analysis, final = enc("<|channel|>analysis<|message|>"), enc("<|end|><|start|>assistant<|channel|>final<|message|>")
    end = tok.convert_tokens_to_ids("<|end|>")
    canonical = 0
    for r in rows:
        assert r["reasoning"].strip() and r["content"].strip(), r["id"]
        cut = r["loss_mask"].index(1)
        prompt, completion = r["input_ids"][:cut], r["input_ids"][cut:]
        assert prompt == tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, reasoning_effort="medium"), r["id"]
        reply = {"role": "assistant", "content": r["content"], "reasoning_content": r["reasoning"]}
        text = tok.apply_chat_template(r["messages"] + [reply], tokenize=False, reasoning_effort="medium")
        assert tok.decode(r["input_ids"], skip_special_tokens=False) == text, r["id"]
        n_reason = completion.index(end) + 1  # the analysis message, its <|end|> included
        assert completion[:len(analysis)] == analysis and completion[n_reason - 1:][:len(final)] == final
        assert tok.decode(completion[len(analysis):n_reason - 1]) == r["reasoning"], r["id"]
        assert tok.decode(completion[n_reason - 1 + len(final):-1]) == r["content"], r["id"]
        assert completion[-1] == tok.convert_tokens_to_ids("<|return|>"), r["id"]
        assert r["tokens"] == {"prompt": cut, "reasoning": n_reason, "content": len(completion) - n_reason}, r["id"]
        is_canonical = enc(text) == r["input_ids"]
        assert r["ids_match"] is is_canonical, r["id"]
        canonical += is_canonical
    assert canonical >= N_RECORDS // 2, f"{canonical}/{N_RECORDS} records in canonical tokens"


def test_harmony_split_by_channel(tok):
    """The token-level segments (01's reasoning / content counts, via ``Specials.segments``) and the embedded
    server's text split follow Harmony's channels: the analysis message is reasoning, its header and <|end|>
    included, the final message the answer; a stream's growing text splits into growing parts."""
    from eagle3nb import families

    fam = families.get(FAMILY)
    sp = families.specials(fam, tok)
    messages = [{"role": "user", "content": "Compute 4 + 8."}]
    reply = {"role": "assistant", "content": "The answer is 12.", "reasoning_content": "Add: 4 + 8 = 12."}
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(messages + [reply], tokenize=True, return_dict=False)
    mask = [0] * len(prompt) + [1] * (len(full) - len(prompt))
    seg = sp.segments(full, mask)
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    n_reason = len(enc("<|channel|>analysis<|message|>Add: 4 + 8 = 12.<|end|>"))
    assert seg == [0] * len(prompt) + [1] * n_reason + [2] * (len(full) - len(prompt) - n_reason)
    text = tok.decode(full[len(prompt):], skip_special_tokens=False).removesuffix("<|return|>")
    assert families.harmony_split(text, fam.harmony_channels) == (reply["reasoning_content"], reply["content"])
    turn = full[len(prompt):]
    parts = [families.harmony_split(tok.decode(turn[:i], skip_special_tokens=False), fam.harmony_channels)
             for i in range(len(turn))]  # the growing text of a stream, token by token
    for (r0, c0), (r1, c1) in zip(parts, parts[1:]):
        assert (r1 or "").startswith(r0 or "") and (c1 or "").startswith(c0 or "")
    assert families.harmony_split("<|channel|>final<|message|>42", fam.harmony_channels) == (None, "42")


@pytest.fixture(scope="module")
def hidden(records, gptoss, tmp_path_factory) -> Path:
    """02 in-process on 01's records (fp32 storage)."""
    from stage_params import hidden_params

    from eagle3nb.hidden.stage import run

    out = tmp_path_factory.mktemp("gptoss-02")
    run(hidden_params(records, out, model_path=str(gptoss), aux_layer_ids=[1, 2, 3], draft_vocab_size=256))
    return out


@pytest.fixture(scope="module")
def model(gptoss):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gptoss, dtype=torch.float32).eval()


def test_gpt_oss_hidden_inprocess(hidden, model):
    """02's in-process states of the trained gpt-oss toy (sliding-window layers, sinks) are transformers' own
    forward at the aux layer ids, and the final norm's output, past the window."""
    from eagle3nb.data.reader import HiddenStates

    data = HiddenStates(hidden)
    ids = data.meta["layer_ids"]
    assert len(data) == N_RECORDS and ids == [1, 2, 3]
    for i in range(len(data)):
        row = data[i]
        assert len(row["input_ids"]) > 2 * model.config.sliding_window
        with torch.no_grad():
            hs = model(input_ids=row["input_ids"][None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(row["aux"], torch.cat([hs[j][0] for j in ids], dim=-1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(row["final"], hs[-1][0], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def trained(hidden, tmp_path_factory) -> Path:
    """03: a fresh draft on 02's data, a few steps (04's lossless check holds for any draft)."""
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    out = tmp_path_factory.mktemp("gptoss-03")
    run(from_dict("03_train", {"data_dir": str(hidden), "output_dir": str(out), "max_length": 512,
                               "batch_tokens": 4096, "max_steps": TRAIN_STEPS, "lr": 0.02, "ttt_steps": K,
                               "eval_every": 0, "save_every": 1000, "seed": 0, "holdout_fraction": 0.0}))
    return out


def test_gpt_oss_train_and_local_lossless(trained, records, model, tok, gptoss):
    """03 trains a draft shaped from the toy's GptOss config, and 04's local speculative decoding with it on
    01's prompts is lossless: greedy output identical to the target's own, past the sliding window."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.data.samples import load_samples
    from eagle3nb.drafts import load_draft

    target = json.loads((gptoss / "config.json").read_text())
    cfg = json.loads((trained / "draft" / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert cfg[key] == target[key], key
    train = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert len(train) == TRAIN_STEPS and train[-1]["loss"] < train[0]["loss"]
    rows = load_samples(records)
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows[:4]]
    draft = load_draft(trained / "draft", embed_tokens=model.get_input_embeddings().weight.detach())
    local = compare_with_plain(model, draft, prompts, K, 80, 0.0, [tok.convert_tokens_to_ids("<|return|>")])
    assert local["identical_to_target"], local
    print(f"gpt-oss toy: local acceptance {local['acceptance_length']:.3f} after {TRAIN_STEPS} steps")



def test_gpt_oss_offline_acceptance_by_channel(trained, hidden, tok):
    """04's offline breakdown by segment reads the family's segments: on Harmony samples the analysis channel's
    tokens are reasoning and the final channel's answer (with think-tag ids the whole turn was answer), and the
    two together are every judged position."""
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.drafts import load_draft
    from eagle3nb.families import get, specials

    data = HiddenStates(hidden)
    sp = specials(get("gpt_oss"), tok)
    seg = [s for i in range(len(data)) for s in sp.segments(data[i]["input_ids"].tolist(),
                                                               data[i]["loss_mask"].tolist())]
    assert seg.count(1) > 0 and seg.count(2) > 0  # the samples have both channels
    draft = load_draft(trained / "draft", embed_tokens=data.embed_tokens())
    res = offline_acceptance(draft, data, K, K, segments=sp.segments)
    by = res["by_segment"]
    assert set(by) == {"reasoning", "answer"}, by
    assert by["reasoning"]["greedy"]["positions"] + by["answer"]["greedy"]["positions"] == res["positions"]


@pytest.fixture(scope="module")
def embedded(gptoss):
    from eagle3nb.launch import start_server

    with start_server(gptoss) as server:
        yield server


@requires_vllm()
def test_gpt_oss_embedded_server(embedded, records, model, tok):
    """The embedded server on toy:gptoss renders 01's prompts as vLLM did (the records' prompt ids), returns
    transformers' greedy tokens, and splits them by channel exactly as vLLM's openai_gptoss parser split the
    same tokens (the records' reasoning and content, wherever the two engines' greedy tokens agree)."""
    import httpx

    from eagle3nb.data.samples import load_samples

    served = httpx.get(embedded.base_url + "/models").json()["data"][0]["id"]
    same = 0
    for r in load_samples(records):
        cut = r["loss_mask"].index(1)
        prompt, vllm_ids = r["input_ids"][:cut], r["input_ids"][cut:]
        reply = httpx.post(embedded.base_url + "/chat/completions", timeout=120, json={
            "model": served, "messages": r["messages"], "max_tokens": 96, "temperature": 0.0,
            "return_token_ids": True}).json()
        choice = reply["choices"][0]
        assert reply["prompt_token_ids"] == prompt, r["id"]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=96, do_sample=False)[0, len(prompt):].tolist()
        assert choice["token_ids"] == want, r["id"]
        if choice["token_ids"] == vllm_ids:
            same += 1
            assert choice["message"]["reasoning"] == r["reasoning"], r["id"]
            assert choice["message"]["content"] == r["content"], r["id"]
    assert same >= N_RECORDS - 1, f"{same}/{N_RECORDS} greedy replies equal vLLM's"
