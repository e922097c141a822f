"""Random EAGLE-3 drafts small enough to build in every test that needs one, and their inputs: a tiny draft of
its own sizes (``tiny_draft``, with ``inputs`` shaped for it) and a draft on the shipped smoke toy's embedding
and lm_head (``smoke_draft``). Shared by the draft, recipe, EAGLE-3.1 and parallel-drafting tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft

H, V, VD, T = 32, 50, 20, 12  # tiny_draft's hidden size, vocabulary, draft vocabulary; inputs' sequence length
# DeepSeek's latent attention at tiny_draft's size (``tiny_draft(mla=MLA)``), without a low-rank query
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)


def tiny_draft(seed: int = 0, **over) -> Eagle3Draft:
    """A seeded random draft (``over``: Eagle3Config fields) with weights far from their init and a random draft
    vocabulary, so a swapped norm or a wrong vocab map changes its outputs."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(**{**dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5],
                                 rope_theta=10000.0), **over})
    m = Eagle3Draft(cfg)
    for p in m.parameters():  # norms away from 1, so a swapped norm would show
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab(ids - torch.arange(VD), t2d)
    return m.eval()


def inputs(B: int = 2, seed: int = 1):
    """Seeded (aux states, token ids, positions) for ``tiny_draft``: ``B`` rows of ``T`` positions."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, 3 * H, generator=g)  # shape: [B, T, 3H]
    ids = torch.randint(0, V, (B, T), generator=g)  # shape: [B, T]
    return aux, ids, torch.arange(T).expand(B, T)


def smoke_draft(toy: Path, num_layers: int) -> Eagle3Draft:
    """A seeded random draft of ``num_layers`` for the shipped smoke toy, on its embedding and lm_head."""
    tc = json.loads((toy / "config.json").read_text())
    tc = tc.get("text_config") or tc
    cfg = Eagle3Config.from_llama_dict(tc, target_hidden_size=tc["hidden_size"], aux_layer_ids=[2, 4, 5],
                                       num_layers=num_layers)
    torch.manual_seed(0)
    m = Eagle3Draft(cfg)
    w = {}
    for f in sorted(toy.glob("*.safetensors")):
        w.update(load_file(f))
    with torch.no_grad():
        m.embed_tokens.weight.copy_(w["model.embed_tokens.weight"].float())
        m.lm_head.weight.copy_(w.get("lm_head.weight", w["model.embed_tokens.weight"]).float())
    m.set_vocab(torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool))
    return m.eval()
