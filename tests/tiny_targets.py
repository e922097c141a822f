"""Tiny random targets built in a test, and what they generate (a pytest plugin tests/conftest.py loads, so its
fixtures are every module's): a 4-layer gpt-oss alternating sliding window ``WINDOW`` and full attention, with
attention sinks (``gpt_oss``, saved with the smoke toy's ``tokenizer`` and loaded back), transformers' own greedy
tokens for one prompt alone (``generate_alone``: the reference a speculative decoder is held to), and 01-format rows
of a target's own continuations (``own_continuations``: data a draft can learn from a random target).

Shared by the sliding-window decoder tests and the gpt-oss and GLM family modules; the fixtures are module-scoped
(each module that asks builds its own, as when it defined them)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

WINDOW = 8


@pytest.fixture(scope="module")
def tokenizer(toy_smoke):
    """The shipped smoke toy's tokenizer (the tiny targets' vocabulary and chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_smoke)


def save_and_load(model, tokenizer, path: Path):
    """Through the checkpoint, as a user's target arrives (transformers picks the attention implementation)."""
    import torch
    from transformers import AutoModelForCausalLM

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tokenizer):
    """A tiny random gpt-oss: 4 layers alternating sliding (window 8) / full, 2 experts, attention sinks drawn
    large enough to matter, weights large enough that the window changes the greedy tokens."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=WINDOW, max_position_embeddings=256,
                       initializer_range=0.2, pad_token_id=0, eos_token_id=6,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 64})
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model = save_and_load(model, tokenizer, tmp_path_factory.mktemp("gpt_oss"))
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert model.config._attn_implementation == "eager"  # gpt-oss has no sdpa: sinks are eager's extra logit
    return model


def generate_alone(target, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate of one prompt alone (no padding), ``n`` tokens past any EOS: the reference
    (``min_new_tokens`` would instead mask EOS out of the argmax)."""
    import torch

    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def own_continuations(target, tokenizer, n: int, new_tokens: int, out: Path) -> Path:
    """01_synth-format rows in ``out``: ``n`` toy prompts in the tokenizer's chat template, each followed by the
    target's own greedy continuation (past any end of turn), loss on the continuation."""
    import torch

    from eagle3nb.toy import dialogues

    rng = random.Random(0)
    rows = []
    with torch.inference_mode():
        for i in range(n):
            d = dialogues.dialogue(rng, "train")
            prompt = list(tokenizer.apply_chat_template(d["messages"], add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
            reply = generate_alone(target, prompt, new_tokens)
            rows.append({"id": f"s{i:03d}", "status": "ok", "messages": d["messages"], "input_ids": prompt + reply,
                         "loss_mask": [0] * len(prompt) + [1] * len(reply), "category": "toy"})
    (out / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
