"""What ``benchmarks/bench_peer.py`` hands speculators: our samples in its per-sample layout (read back the way its
trainers read them), and ours trained with the mask input frozen as speculators trains it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.bench_peer import mask_frozen, to_per_sample


def test_per_sample_files_give_back_our_states_tokens_and_final_state(tmp_path):
    """aux -> hidden_states[:, :3], tokens and loss mask unshifted (the block drafters read them so), and the
    target's RMSNorm of the last slot (speculators' verifier_norm) gives back our normed final state."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    T, H = 7, 8
    norm = LlamaRMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
        final = norm(torch.randn(T, H, generator=g) * 3)  # shape: [T, H], stored normed as 02 stores it
    item = {"input_ids": torch.randint(0, 50, (T,), generator=g), "loss_mask": torch.tensor([0, 0, 1, 1, 1, 0, 1]),
            "aux": torch.randn(T, 3 * H, generator=g), "final": final}
    f = load_file(str(to_per_sample([item], [0], norm.weight.detach(), tmp_path) / "000000.safetensors"))
    assert f["hidden_states"].shape == (T, 4, H)
    torch.testing.assert_close(f["hidden_states"][:, :3].flatten(1), item["aux"])
    assert torch.equal(f["token_ids"], item["input_ids"]) and torch.equal(f["loss_mask"].long(), item["loss_mask"])
    with torch.no_grad():
        torch.testing.assert_close(norm(f["hidden_states"][:, -1]), final)


def test_mask_frozen_freezes_only_the_mask_input_and_only_inside(toy_smoke):
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    cfg = from_target(json.loads((toy_smoke / "config.json").read_text()), num_layers=1, block_size=4)

    def trainable(m: DFlashDraft) -> set[str]:
        return {n for n, p in m.named_parameters() if p.requires_grad}

    with mask_frozen(DFlashDraft, True):
        frozen = DFlashDraft(cfg)
    free = DFlashDraft(cfg)
    assert "mask_embedding" in trainable(free)
    assert trainable(frozen) == trainable(free) - {"mask_embedding"}
    with mask_frozen(DFlashDraft, False):
        assert "mask_embedding" in trainable(DFlashDraft(cfg))


def test_a_peer_goes_to_each_registered_method_speculators_ships_and_to_no_other():
    """The peer table is speculators' own registry (what ``_peer_speculators.py`` answers to ``ships``), met with
    ours: 0.9.0 ships EAGLE-3, DFlash, DSpark and DFlash2; a registered method it does not ship trains on our side
    alone, with the reason."""
    import benchmarks._peer_speculators as driver
    from benchmarks.bench_peer import peer_methods
    from eagle3nb.drafts import PACKAGES

    shipped = driver.ships({})["types"]  # the speculators installed here (make setup: 0.9.0)
    assert {"eagle3", "dflash", "dspark", "dflash2"} <= set(peer_methods(shipped))
    assert set(peer_methods(shipped)) <= set(PACKAGES) & set(shipped)
    assert peer_methods([t for t in shipped if t != "dspark"]) == [m for m in peer_methods(shipped) if m != "dspark"]


@pytest.mark.parametrize("heads", [{}, {"markov_rank": 4},
                                   {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4,
                                    "selector_top_k": 2}], ids=["plain", "markov", "selector"])
def test_the_peer_reads_each_block_drafters_loss_inputs_by_name(heads, toy_smoke, tmp_path):
    """Speculators' block drafters pass their loss its inputs in different orders (a confidence head's logits
    before the mask, a selector's unary logits by name): the peer binds them to the loss' own parameter names, so it
    keeps the block's logits over the vocabulary and the aligned 0/1 loss mask of every anchor's slots."""
    import benchmarks._peer_speculators as driver
    from benchmarks.bench_peer import to_per_sample
    from eagle3nb.data.head import read_head_tensors
    from eagle3nb.drafts import get
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    T, B = 24, 4
    cfg = from_target(json.loads((toy_smoke / "config.json").read_text()), num_layers=1, block_size=B,
                      aux_layer_ids=[1, 2, 3], **heads)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    target = load_file(toy_smoke / "model.safetensors")
    draft.set_target(target["model.embed_tokens.weight"], target["lm_head.weight"])
    folder = get(draft.method).save(draft, tmp_path / "draft", "speculators", verifier=str(toy_smoke))
    g = torch.Generator().manual_seed(1)
    H = cfg.target_hidden_size
    item = {"input_ids": torch.randint(1, cfg.vocab_size, (T,), generator=g), "aux": torch.randn(T, 3 * H, generator=g),
            "final": torch.randn(T, H, generator=g), "loss_mask": (torch.arange(T) >= 6).long()}
    sample = to_per_sample([item], [0], read_head_tensors(toy_smoke)["norm.weight"], tmp_path / "sample")
    anchors = int(item["loss_mask"][: T - B].sum())  # every loss-masked position before the last block
    driver.block_logits({"draft": str(folder), "sample": str(sample / "000000.safetensors"), "max_anchors": anchors,
                         "logits_file": str(tmp_path / "logits.safetensors")})
    seen = load_file(tmp_path / "logits.safetensors")
    assert seen["logits"].shape == seen["targets"].shape == (anchors * B, cfg.vocab_size)
    assert not seen["mask"].is_floating_point() and set(seen["mask"].unique().tolist()) <= {0, 1}
    assert seen["mask"].shape == (anchors * B,) and 0 < int(seen["mask"].sum()) <= anchors * B
