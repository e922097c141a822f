"""The toy target: a Kimi-shaped tokenizer and chat template, a trained Llama that answers in
``<think>..</think>answer<|im_end|>`` form, cached deterministic builds, and disjoint prompt sets."""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
from pathlib import Path

import pytest

from eagle3nb import paths
from eagle3nb.tokens import IM_END, SPECIAL_TOKENS, THINK_END, THINK_START
from eagle3nb.toy import dialogues, resolve_model_path, resolve_prompts, write_prompts

toy_build = importlib.import_module("eagle3nb.toy.build")
toy_train = importlib.import_module("eagle3nb.toy.train")
shipped_mod = importlib.import_module("eagle3nb.toy.shipped")

REPLY = re.compile(r"<think>(.*)</think>(.*)<\|im_end\|>", re.S)
U = {"role": "user", "content": "What is 2 + 3?"}
TOKEN_ACCURACY = 0.75  # the shipped smoke toy: 0.80 (rebuilds elsewhere: 0.80-0.86; demo: 0.93; untrained: ~0)
# Exact final answers of the shipped demo toy: 23/40 (the smoke toy gets 1/40: too small to be judged by it;
# untrained: 0). The bytes are shipped; the margin covers greedy near-ties that another CPU may round otherwise.
EXACT_ACCURACY = 0.35


@pytest.fixture(scope="module")
def tok(toy_smoke):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_smoke)


@pytest.fixture(scope="module")
def model(toy_smoke):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(toy_smoke).eval()


def completion_ids(model, prompt_ids: list[int], sample: bool = False, seed: int = 0) -> list[int]:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=120, do_sample=sample, temperature=1.0 if sample else None, top_p=None,
                             top_k=None)
    return out[0, len(prompt_ids):].tolist()


def ids_of(tok, messages: list[dict], **kw) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)


def heldout(category: str, n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        p = dialogues.problem(rng, "heldout")
        if p["category"] == category and p["question"] not in {q["question"] for q in out}:
            out.append(p)
    return out


# --- tokenizer and template ----------------------------------------------------------------------------------

def test_tokenizer_loads_without_remote_code_and_keeps_kimi_tokens_whole(tok):
    ids = [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tok.unk_token_id not in ids
    for s, i in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(s, add_special_tokens=False) == [i]
        assert tok.encode(f"a{s}b", add_special_tokens=False)[1] == i
    assert tok.eos_token == IM_END and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS
    assert 300 <= len(tok) <= 1000


def test_any_text_round_trips(tok):
    for text in ["What is 47 + 38?", "  two  spaces\nand\ttabs ", "naïve café ✓ 🙂", "<0x41> [PAD]x"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_template_default_system_prompt_and_roles(tok):
    text = tok.apply_chat_template([U], tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                    "<|im_user|>user<|im_middle|>What is 2 + 3?<|im_end|>")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, U], tokenize=False)
    assert own.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>") and "Kimi" not in own


def test_template_generation_prompt_and_thinking_kwarg(tok):
    base = tok.apply_chat_template([U], tokenize=False)
    on = tok.apply_chat_template([U], tokenize=False, add_generation_prompt=True)
    assert on == base + "<|im_assistant|>assistant<|im_middle|>"
    assert tok.apply_chat_template([U], tokenize=False, add_generation_prompt=True, thinking=True) == on
    off = tok.apply_chat_template([U], tokenize=False, add_generation_prompt=True, thinking=False)
    assert off == on + "<think></think>"


def test_template_strips_reasoning_from_history_only(tok):
    a1 = {"role": "assistant", "content": "5.", "reasoning_content": "2 plus 3"}
    u2 = {"role": "user", "content": "And 4 + 4?"}
    a2 = {"role": "assistant", "content": "8.", "reasoning": "4 plus 4"}  # vLLM's newer field name works too
    text = tok.apply_chat_template([U, a1, u2, a2], tokenize=False)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>5.<|im_end|>" in text and "2 plus 3" not in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>4 plus 4</think>8.<|im_end|>")
    gen = tok.apply_chat_template([U, a1, u2], tokenize=False, add_generation_prompt=True)
    assert "2 plus 3" not in gen and gen.endswith("<|im_middle|>")
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


# --- model ---------------------------------------------------------------------------------------------------

def test_model_is_an_untied_llama_in_safetensors(toy_smoke, model, tok):
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.num_hidden_layers >= 8
    assert not cfg.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    assert cfg.vocab_size == len(tok) and cfg.max_position_embeddings >= 512
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert (toy_smoke / "model.safetensors").exists() and not list(toy_smoke.glob("*.bin"))


def test_greedy_answers_are_structured(model, tok):
    probs = [p for c in dialogues.CATEGORIES for p in heldout(c, 3)]
    structured = 0
    for p in probs:
        ids = ids_of(tok, [{"role": "user", "content": p["question"]}], add_generation_prompt=True)
        m = REPLY.fullmatch(tok.decode(completion_ids(model, ids), skip_special_tokens=False))
        structured += bool(m and m.group(1).strip() and m.group(2).strip()
                           and THINK_START not in m.group(1) + m.group(2))
    assert structured >= len(probs) - 2, f"{structured}/{len(probs)} held-out answers in <think>..</think>answer form"


def token_accuracy(model, tok) -> float:
    """Teacher-forced next-token accuracy on assistant tokens of held-out dialogues."""
    import torch

    hit = n = 0
    with torch.no_grad():
        for x, y in toy_train.batches(tok, random.Random(5), 4, 16, "heldout"):
            mask = y != -100
            hit += int((model(input_ids=x).logits.argmax(-1)[mask] == y[mask]).sum())
            n += int(mask.sum())
    return hit / n


def test_reasoning_is_mostly_predicted_on_heldout_dialogues(model, tok):
    """Teacher-forced next-token accuracy on assistant tokens of held-out dialogues (an untrained model: ~0)."""
    acc = token_accuracy(model, tok)
    assert acc > TOKEN_ACCURACY, f"held-out token accuracy {acc:.2f}"


def test_greedy_final_answers_are_often_exact_on_heldout_questions():
    """Exact final answers (the text after </think>) of the demo toy on held-out questions of every category."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("toy:demo"))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("toy:demo")).eval()
    probs = [p for c in dialogues.CATEGORIES for p in heldout(c, 10, seed=3)]
    right = {c: 0 for c in dialogues.CATEGORIES}
    for p in probs:
        ids = ids_of(tok, [{"role": "user", "content": p["question"]}], add_generation_prompt=True)
        text = tok.decode(completion_ids(model, ids), skip_special_tokens=False)
        right[p["category"]] += text.split(THINK_END)[-1] == p["answer"] + IM_END
    assert sum(right.values()) / len(probs) >= EXACT_ACCURACY, f"exact held-out answers per category (of 10): {right}"


def test_thinking_off_gives_an_empty_think_block(model, tok):
    for p in heldout("arithmetic", 2) + heldout("string", 2):
        msgs = [{"role": "user", "content": p["question"]}]
        on = completion_ids(model, ids_of(tok, msgs, add_generation_prompt=True))
        off_prompt = ids_of(tok, msgs, add_generation_prompt=True, thinking=False)
        assert tok.decode(off_prompt).endswith("<think></think>")
        off = tok.decode(completion_ids(model, off_prompt), skip_special_tokens=False)
        assert off.endswith(IM_END) and THINK_START not in off and THINK_END not in off
        assert tok.decode(on, skip_special_tokens=False).startswith(THINK_START)


@pytest.mark.parametrize("sample", [False, True])
def test_prompt_plus_completion_equals_the_rerendered_conversation(model, tok, sample):
    """What a server returns (prompt ids + completion ids) is what the template renders for the same messages."""
    for i, p in enumerate(heldout("arithmetic", 2) + heldout("string", 2) + heldout("units", 2)):
        msgs = [{"role": "user", "content": p["question"]}]
        thinking = i % 3 != 2
        prompt = ids_of(tok, msgs, add_generation_prompt=True, thinking=thinking)
        comp = completion_ids(model, prompt, sample=sample, seed=i)
        text = tok.decode(comp, skip_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == comp
        assert text.endswith(IM_END), text
        body = text[: -len(IM_END)]
        # split as a reasoning parser does: at the first </think>; the reply keeps any later one in its content
        reasoning, content = body.split(THINK_END, 1) if thinking else (THINK_START, body)
        assert reasoning.startswith(THINK_START), text
        reply = {"role": "assistant", "content": content, "reasoning_content": reasoning.removeprefix(THINK_START)}
        assert ids_of(tok, msgs + [reply], thinking=thinking) == prompt + comp


# --- build: cache, determinism, model paths --------------------------------------------------------------------

def test_toy_paths_are_the_shipped_bytes_and_match_the_recipe(toy_smoke):
    """``toy:<size>`` is the shipped build, every file as the manifest hashes it, and the manifest was made by
    the recipe as it stands (a changed recipe with a stale shipped toy fails here: run tools/ship_toys.py)."""
    entries = shipped_mod.manifest()
    assert sorted(entries) == sorted(s for s in toy_build.SIZES if toy_build.is_shipped(s))  # qwen3: built at first use
    for size, entry in entries.items():
        folder = resolve_model_path(f"toy:{size}")
        assert folder == shipped_mod.SHIPPED / size
        assert entry["settings_hash"] == toy_build.settings_hash(size, entry["seed"]), \
            f"the recipe changed since toy:{size} was shipped: run tools/ship_toys.py and commit the result"
        files = {p.name: shipped_mod.file_sha256(p) for p in folder.iterdir()}
        assert files == entry["files"] and shipped_mod.folder_digest(files) == entry["sha256"]
        assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
                "toy_build.json"} <= set(files)
    assert toy_smoke == shipped_mod.SHIPPED / "smoke"
    report = json.loads((toy_smoke / "toy_build.json").read_text())
    assert report["heldout_loss"] < 1.5 and len(report["samples"]) == 5


def test_a_shipped_toy_with_other_bytes_is_refused(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "shipped"
    shutil.copytree(shipped_mod.SHIPPED, copy)
    monkeypatch.setattr(shipped_mod, "SHIPPED", copy)
    monkeypatch.setattr(shipped_mod, "MANIFEST", copy / "MANIFEST.json")
    assert shipped_mod.shipped("smoke") == copy / "smoke"
    weights = copy / "smoke" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte flipped
    weights.write_bytes(bytes(data))
    with pytest.raises(shipped_mod.ShippedToyError, match=r"model.safetensors.*differ.*git checkout"):
        shipped_mod.shipped("smoke")


def test_a_fresh_rebuild_is_as_good_as_the_shipped_toy(tmp_path, toy_smoke, tok, model, capsys):
    """The recipe still makes a toy of the shipped one's quality on this machine (its weights may differ: another
    CPU rounds otherwise). Judged by held-out loss and teacher-forced token accuracy with margins, not equality;
    a second build of the same folder is reused without training."""
    from transformers import AutoModelForCausalLM

    out = toy_build.build(tmp_path / "rebuilt", size="smoke", seed=0)
    printed = capsys.readouterr().out
    assert "step" in printed and "shipped toy:smoke" in printed
    assert toy_build.build(tmp_path / "rebuilt", size="smoke", seed=0) == out
    assert "step" not in capsys.readouterr().out  # reused, no training
    shipped_loss = json.loads((toy_smoke / "toy_build.json").read_text())["heldout_loss"]
    rebuilt_loss = json.loads((out / "toy_build.json").read_text())["heldout_loss"]
    assert rebuilt_loss < 1.25 * shipped_loss + 0.05, (rebuilt_loss, shipped_loss)
    rebuilt = AutoModelForCausalLM.from_pretrained(out).eval()
    shipped_acc, rebuilt_acc = token_accuracy(model, tok), token_accuracy(rebuilt, tok)
    assert rebuilt_acc > 0.9 * shipped_acc, (rebuilt_acc, shipped_acc)


def test_same_seed_same_weights(tmp_path, monkeypatch):
    monkeypatch.setitem(toy_build.SIZES, "tiny", {**toy_build.SIZES["smoke"], "steps": 3, "batch": 4})
    monkeypatch.setattr(toy_train, "SAMPLE_TOKENS", 8)

    def weights(out: Path) -> str:
        weights = toy_build.build(out, size="tiny", seed=seed) / "model.safetensors"
        return hashlib.sha256(weights.read_bytes()).hexdigest()

    seed = 0
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    seed = 1
    c = weights(tmp_path / "c")
    assert a == b != c
    with pytest.raises(FileExistsError, match="pick another --out"):
        toy_build.build(tmp_path / "a", size="tiny", seed=5)
    assert not list(tmp_path.glob(".*.tmp"))  # built in a temporary folder, renamed into place


def test_resolve_model_path_errors_clearly(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match=r"nope.*eagle3nb toy build"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="smoke"):
        resolve_model_path("toy:huge")


# --- prompt sets -----------------------------------------------------------------------------------------------

def test_prompt_sets_are_disjoint_and_well_formed(tmp_path):
    train = [json.loads(x) for x in write_prompts(tmp_path / "t.jsonl", 300, "train").read_text().splitlines()]
    held = [json.loads(x) for x in write_prompts(tmp_path / "h.jsonl", 150, "heldout").read_text().splitlines()]
    assert len(train) == 300 and len(held) == 150
    for rows in (train, held):
        assert len({r["id"] for r in rows}) == len(rows)
        assert {r["category"] for r in rows} == set(dialogues.CATEGORIES)
        assert all(r["messages"][0]["role"] == "user" and set(r) == {"id", "messages", "category"} for r in rows)
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}
    # the model never trains on a held-out question
    rng = random.Random(0)
    trained = {dialogues.dialogue(rng)["question"] for _ in range(3000)}
    assert not trained & {r["messages"][0]["content"] for r in held}
    assert write_prompts(tmp_path / "t2.jsonl", 300, "train").read_text() == (tmp_path / "t.jsonl").read_text()


def test_prompts_past_the_single_questions_carry_an_earlier_exchange(tmp_path):
    """Past the split's single questions the prompts add one earlier exchange (so a run can ask for 10,000): the
    single ones stay first and unchanged, every prompt is distinct, and both questions keep to the split."""
    rows = [json.loads(x) for x in write_prompts(tmp_path / "h.jsonl", 600, "heldout").read_text().splitlines()]
    singles = sum(len(r["messages"]) == 1 for r in rows)
    assert 0 < singles < 600 and all(len(r["messages"]) == 1 for r in rows[:singles])
    alone = write_prompts(tmp_path / "s.jsonl", singles, "heldout").read_text().splitlines()
    assert [json.loads(x) for x in alone] == rows[:singles]
    later = rows[singles:]
    assert [[m["role"] for m in r["messages"]] for r in later] == [["user", "assistant", "user"]] * len(later)
    assert all(r["messages"][1]["content"].startswith("The answer is") for r in later)
    assert len({json.dumps(r["messages"]) for r in rows}) == 600 and len({r["id"] for r in rows}) == 600
    train_questions = {r["messages"][0]["content"] for r in (json.loads(x) for x in write_prompts(
        tmp_path / "t.jsonl", 300, "train").read_text().splitlines())}
    assert not train_questions & {m["content"] for r in later for m in r["messages"] if m["role"] == "user"}


def test_resolve_prompts_and_cli(tmp_path):
    from eagle3nb.cli import main

    p = resolve_prompts("toy:heldout", 12)
    assert p.parent.parent == paths.cache_dir() and len(p.read_text().splitlines()) == 12
    assert resolve_prompts("params/x.jsonl", 5) == paths.project_root() / "params/x.jsonl"
    out = tmp_path / "cli.jsonl"
    assert main(["toy", "prompts", "--out", str(out), "--n", "7", "--split", "heldout"]) == 0
    assert len(out.read_text().splitlines()) == 7
    with pytest.raises(ValueError, match="toy:train or toy:heldout"):
        resolve_prompts("toy:test", 3)
