"""A trained draft served by the real vLLM and held to our own decoder on the same prompts: the draft tokens a
round (``K``), a family toy's server set started while its draft trains (``family_servers``), the held-out
prompts (``held_out``), the acceptance our decoder measures on them (``local_acceptance``), and the vLLM parameter
an exported tensor is loaded onto (``vllm_name``). Shared by the smoke toy's vLLM tests and the family, recipe,
block-drafter and parallel-drafting modules."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from engines import Engines, Servers

K = 3  # draft tokens a round: vLLM's num_speculative_tokens, our decoder's k, and 03's ttt_steps for these drafts


def family_servers(engines: Engines, model: Path, make_trained: Callable[[], dict],
                   plain: dict | None = None) -> Iterator[Servers]:
    """A family toy's real vLLM servers: plainly (its family's parser; ``plain``: more ``start_vllm`` options,
    e.g. ``tools``) and extracting hidden states, both starting while ``make_trained()`` returns the trained run
    (built in the background, or waited for), then serving that run's draft as ``eagle3``, all three starting side
    by side."""
    from eagle3nb.layers import default_aux_layer_ids

    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    early = {"plain": {"mode": "plain", **(plain or {})},
             "extract": {"mode": "extract", "layer_ids": [*default_aux_layer_ids(layers), layers]}}
    servers = Servers(engines, model)
    try:
        servers.submit(**early)
        trained = make_trained()
        servers.start(**early, eagle3={"mode": "eagle3", "draft_dir": trained["out"] / "03_train" / "draft",
                                       "num_speculative_tokens": K})
        yield servers
    finally:
        servers.stop()


def held_out(n: int) -> list[dict]:
    """The first ``n`` of the toy's held-out prompts (``toy:heldout``: never in a draft's training data)."""
    from eagle3nb.data.prompts import load_prompts

    return load_prompts("toy:heldout", n)


def local_acceptance(toy_smoke: Path, draft_dir: Path, prompts: list[dict], max_tokens: int,
                     temperature: float = 0.0) -> dict:
    """04's local speculative decoding (our decoder; greedy, or sampled at ``temperature`` with one seed per
    prompt) on the same prompts vLLM gets."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft
    from eagle3nb.hf import DECODER, load_target

    tpl = Template(toy_smoke, True)
    ids = [tpl.prompt_ids(p["messages"]) for p in prompts]
    target = load_target(toy_smoke, trust_remote_code=False, use=DECODER)
    draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach())
    return compare_with_plain(target, draft, ids, K, max_tokens, temperature, [tpl.end_id])


def vllm_name(ours: str) -> str:
    """Our tensor name -> the parameter vLLM's loader puts it on (``model.`` prefixed, q/k/v and gate/up stacked):
    how an export is held to vLLM's own parameters."""
    for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                        ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        if f".{part}." in ours:
            ours = ours.replace(f".{part}.", f".{fused}.")
    return "model." + ours
