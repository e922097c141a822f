"""Judging sampled outputs by the model's own probabilities: seeded sampling is checked against numbers computed
from the target, not against one run's tokens."""

from __future__ import annotations

import math
from pathlib import Path

# A draw from another seed equals a given output with exactly that output's probability; below this the test's
# "other seeds differ" fails by chance less than once in a thousand runs.
COLLISION = 1e-3


def sequence_logprob(model_dir: Path, prompt_ids: list[int], ids: list[int], temperature: float) -> float:
    """log P(ids | prompt) when each token is drawn from softmax(logits / temperature) (top_p = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([list(prompt_ids) + list(ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0, len(prompt_ids) - 1 : -1].double() / temperature, -1)
    return float(logp.gather(-1, torch.tensor(ids)[:, None]).sum())


def greedy_ids(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation (transformers' generate)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                         dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def check_seeded_sampling(ask, model_dir: Path, temperature: float, max_tokens: int) -> None:
    """``ask(seed, temperature) -> (prompt_ids, ids)``: the same seed repeats; temperature 0 is the target's
    greedy output whatever the seed; and another seed differs from an output whose computed probability makes a
    collision improbable (a server that ignores the temperature or the seed fails one of these)."""
    prompt, a = ask(123, temperature)
    assert ask(123, temperature)[1] == a, "the same seed must give the same tokens"
    p = math.exp(sequence_logprob(model_dir, prompt, a, temperature))
    assert p < COLLISION, f"the sampled output has probability {p:.2g}: pick a prompt or length with more entropy"
    assert ask(7, temperature)[1] != a, f"another seed gave the same output (probability {p:.2g} by the model)"
    assert ask(123, 0.0)[1] == ask(7, 0.0)[1] == greedy_ids(model_dir, prompt, max_tokens), \
        "temperature 0 must be the target's greedy output, whatever the seed"
