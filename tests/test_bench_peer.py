"""What ``benchmarks/bench_peer.py`` hands speculators: our samples in its per-sample layout (read back the way its
trainers read them), and ours trained with the mask input frozen as speculators trains it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_peer import mask_frozen, to_per_sample  # noqa: E402


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

    with mask_frozen(True):
        frozen = DFlashDraft(cfg)
    free = DFlashDraft(cfg)
    assert "mask_embedding" in trainable(free)
    assert trainable(frozen) == trainable(free) - {"mask_embedding"}
    with mask_frozen(False):
        assert "mask_embedding" in trainable(DFlashDraft(cfg))
