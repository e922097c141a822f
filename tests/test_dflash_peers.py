"""Our block drafters held against speculators 0.9.0, the second implementation of DFlash and DSpark: an export
of ours, loaded by speculators' own loader (``SpeculatorModel.from_pretrained``; a vLLM-layout DFlash export
through speculators' own ``DFlashConverter`` first), gives our logits for the same inputs (the target's states,
the anchors, the block), and DSpark's Markov bias and confidence head give ours too. Speculators runs its real
training forward; its logits are read where its loss receives them. The differences between the two
implementations that no logit shows are in docs/block-drafters.md ("Held against speculators")."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

BLOCK = 4
T = 24  # context positions
ANCHORS = [0, 3, 4, 9, 15, 19]  # the first position (no context before it), neighbours, and the last usable one

pytestmark = pytest.mark.usefixtures("one_thread")


# DFlash2's additions at a shape the toy fits (hidden 64: groups of 16 channels; two taps; 8 of 546 candidates)
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 8}


def drafter(toy_smoke, markov_rank: int = 0, **heads: int):
    """A 2-layer drafter for ``toy:smoke`` on its embedding and head, every trained weight drawn away from its
    initial value (norms not 1, DSpark's ``markov_w2`` not 0, DFlash2's convolutions not the identity), so no tensor
    can be read wrongly unseen."""
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    torch.manual_seed(0)
    m = DFlashDraft(from_target(json.loads((toy_smoke / "config.json").read_text()), num_layers=2, block_size=BLOCK,
                                markov_rank=markov_rank, **heads))
    target = load_file(toy_smoke / "model.safetensors")
    m.set_target(target["model.embed_tokens.weight"], target["lm_head.weight"])
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.requires_grad:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return m.eval()


def same_inputs(m):
    """Both sides' inputs: (the generator, drawn on for the verifier's last states next), the target's aux states
    [1, T, n*H_t], the tokens [1, T], the anchors [N] and the loss mask [1, T] on exactly them (speculators draws its
    anchors among the loss-masked positions; asked for as many as there are, it takes all of them in order)."""
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, T, m.fc.in_features, generator=g)  # shape: [1, T, n*H_t]
    ids = torch.randint(1, m.config.vocab_size, (1, T), generator=g)  # shape: [1, T]
    pos = torch.tensor(ANCHORS)  # shape: [N]
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, pos] = 1
    return g, aux, ids, pos, loss_mask


def speculators_model(folder, layout: str, toy_smoke, tmp_path):
    """Speculators' model of our export in ``layout``, with its eager attention (the flex kernel compiles)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.convert.entrypoints import maybe_convert_external_checkpoint

    if layout == "vllm":  # what speculators' from_pretrained does to an external DFlash checkpoint, to tmp_path
        folder = maybe_convert_external_checkpoint(folder, verifier=str(toy_smoke), output_path=str(tmp_path / "conv"))
    config = SpeculatorModelConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(str(folder), config=config).eval()


@pytest.mark.parametrize("method,layout", [("dflash", "speculators"), ("dflash", "vllm"), ("dspark", "speculators")])
def test_speculators_loads_our_export_and_gives_our_logits(toy_smoke, tmp_path, monkeypatch, method, layout):
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    from eagle3nb.drafts.dflash.layouts import save_draft

    m = drafter(toy_smoke, markov_rank=8 if method == "dspark" else 0)
    cfg = m.config
    theirs = speculators_model(save_draft(m, tmp_path / layout, layout, verifier=str(toy_smoke)), layout, toy_smoke,
                               tmp_path)
    # speculators reads no mask_embedding.pt: its mask slots read its table's row, the target's (docs: "Held against
    # speculators"); given our trained row there, the rest must agree
    assert not torch.equal(theirs.embed_tokens.weight[cfg.mask_token_id], m.mask_embedding)
    with torch.no_grad():
        theirs.embed_tokens.weight[cfg.mask_token_id] = m.mask_embedding
    assert type(theirs).__name__ == {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}[method]
    assert theirs.config.aux_hidden_state_layer_ids == cfg.aux_layer_ids  # the layer-id convention, both layouts
    assert theirs.config.sample_from_anchor == cfg.sample_from_anchor
    assert theirs.config.speculators_config.proposal_methods[0].speculative_tokens == cfg.drafts_per_block

    # 1. The same inputs: the target's aux states, tokens, and the anchors (speculators draws its anchors among the
    #    loss-masked positions; asked for exactly as many as there are, it takes all of them in order).
    g, aux, ids, pos, loss_mask = same_inputs(m)

    # 2. Theirs: the training forward, its logits (and DSpark's confidence logits) read where its loss takes them.
    seen = {}

    def capture(logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, args[1] if method == "dspark" else None
        return torch.zeros(()), {}

    monkeypatch.setattr(dspark_core if method == "dspark" else dflash_core, "compute_metrics", capture)
    with torch.no_grad():
        theirs(aux, ids, loss_mask, torch.randn(1, T, cfg.hidden_size, generator=g), torch.zeros_like(ids),
               max_anchors=len(ANCHORS))

    # 3. Ours: the blocks in one forward, DSpark's bias from the token before each slot (teacher-forced).
    with torch.no_grad():
        hidden = m(m.context(aux), ids[:, pos], pos[None])  # shape: [1, N, S, H]
        logits = m.logits(hidden)  # shape: [1, N, S, V]
        if method == "dspark":
            prev = ids[0, pos[:, None] + torch.arange(BLOCK)][None]  # shape: [1, N, S], the token at anchor + j
            logits = logits + m.markov_bias(prev)
            torch.testing.assert_close(seen["confidence"].view(1, len(ANCHORS), BLOCK),
                                       m.confidence_logit(hidden, prev))
    torch.testing.assert_close(seen["logits"].view(1, len(ANCHORS), BLOCK, -1), logits)


def test_speculators_loads_our_dflash2_export_and_gives_our_logits_and_selector_scores(toy_smoke, tmp_path,
                                                                                      monkeypatch):
    """DFlash2 (speculators' ``dflash2``): our export in its layout loads into its ``DFlash2DraftModel``; on the same
    states, tokens and anchors its unary logits are ours (the grouped dynamic convolutions around every sublayer
    included), and its selector scores of its own training candidates, each given the data's previous token, are
    our selector's."""
    import speculators.models.dflash2.core as dflash2_core

    from eagle3nb.drafts.dflash.layouts import save_draft

    m = drafter(toy_smoke, **DFLASH2)
    cfg = m.config
    assert m.method == "dflash2" and not cfg.sample_from_anchor
    theirs = speculators_model(save_draft(m, tmp_path / "s", "speculators", verifier=str(toy_smoke)), "speculators",
                               toy_smoke, tmp_path)
    assert type(theirs).__name__ == "DFlash2DraftModel"
    assert (theirs.config.conv_kernel_size, theirs.config.conv_group_size, theirs.config.selector_rank,
            theirs.config.selector_top_k) == tuple(DFLASH2.values())
    with torch.no_grad():
        theirs.embed_tokens.weight[cfg.mask_token_id] = m.mask_embedding  # it reads no mask_embedding.pt

    g, aux, ids, pos, loss_mask = same_inputs(m)
    seen = {}

    def capture(**kw):
        seen.update(kw)
        return torch.zeros(()), {}

    monkeypatch.setattr(dflash2_core, "compute_metrics", capture)
    with torch.no_grad():
        theirs(aux, ids, loss_mask, torch.randn(1, T, cfg.hidden_size, generator=g), torch.zeros_like(ids),
               max_anchors=len(ANCHORS))
        hidden = m(m.context(aux), ids[:, pos], pos[None])  # shape: [1, N, S, H]
        unary = m.logits(hidden)  # shape: [1, N, S, V]
        at = torch.maximum(pos[:, None] + torch.arange(BLOCK) - 1, pos[:, None])  # slot j's previous token
        cand = seen["training_candidate_ids"].view(1, len(ANCHORS), BLOCK, -1)  # shape: [1, N, S, K]
        scores = m.candidate_selector.scores(unary, hidden, ids[0, at][None], cand)  # shape: [1, N, S, K]
    torch.testing.assert_close(seen["unary_logits"].view_as(unary), unary)
    torch.testing.assert_close(seen["candidate_logits"].view_as(scores), scores)
