"""The fused TTT loss (ttt.SoftCrossEntropy, padded-view shifts) computes exactly what the plain formulation does:
log_softmax, -(p * logp).sum, shift() by copies, a separate argmax. Same loss, stats and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3nb.drafts.eagle3.cache import TTTCache
from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft
from eagle3nb.drafts.eagle3.objective import TTTObjective

V, VD, STEPS, DECAY = 96, 40, 4, 0.8


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


def reference(d: Eagle3Draft, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """ttt.TTTObjective.forward as first written (the EAGLE-3 reference formulation), kept here as the spec."""
    ids, mask, argmax, probs = batch["input_ids"], batch["loss_mask"].bool(), batch["target_argmax"], \
        batch["target_probs"]
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    hidden, cache = d.fuse(batch["aux"]), TTTCache()
    loss = torch.zeros(())
    stats = torch.zeros(4, STEPS, dtype=torch.float64)
    for i in range(STEPS):
        tgt_argmax, scored = _shift(argmax, 1 + i), _shift(mask, 2 + i)
        counted = scored & d.t2d[tgt_argmax]
        hidden, logits = d(hidden, _shift(ids, 1 + i), pos + i, cache)
        keep = T - 1 - i
        ce = -(probs[:, 1 + i:] * F.log_softmax(logits[:, :keep].float(), dim=-1)).sum(-1)
        n = counted.sum()
        ce_sum = (ce * counted[:, :keep]).sum()
        loss = loss + DECAY ** i * ce_sum / n.clamp(min=1)
        with torch.no_grad():
            correct = (d.draft_to_target(logits.argmax(-1)) == tgt_argmax) & scored
            stats[:, i] = torch.stack([ce_sum.detach().double(), n.double(), correct.sum().double(),
                                       scored.sum().double()])
    return loss, stats


def test_fused_loss_equals_reference():
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=V, draft_vocab_size=VD)
    d = Eagle3Draft(cfg)
    d2t = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    d.set_vocab(d2t - torch.arange(VD), t2d)
    B, T = 3, 20
    probs = torch.softmax(3 * torch.randn(B, T, VD), -1)
    mask = (torch.rand(B, T) > 0.3).long()
    probs[2, 14:], mask[2, 14:] = 0, 0  # a right-padded sample: all-zero target rows
    # target argmaxes partly outside the draft vocabulary; the draft's predictions hit some of them
    argmax = torch.where(torch.rand(B, T) > 0.3, d2t[probs.argmax(-1)], torch.randint(0, V, (B, T)))
    aux, ids = torch.randn(B, T, 3 * 32), torch.randint(0, V, (B, T))
    with torch.no_grad():  # make the draft's step-0 prediction at t right at every other t (target of t: argmax[t+1])
        pred = d.draft_to_target(d(d.fuse(aux), _shift(ids, 1), torch.arange(T).expand(B, T), TTTCache())[1].argmax(-1))
    argmax[:, 1::2] = pred[:, 0::2][:, :argmax[:, 1::2].shape[1]]
    batch = {"aux": aux, "input_ids": ids, "loss_mask": mask, "target_argmax": argmax, "target_probs": probs}

    def run(fn):
        d.zero_grad(set_to_none=True)
        loss, stats = fn(batch)
        loss.backward()
        return loss.detach(), stats, {k: p.grad.clone() for k, p in d.named_parameters() if p.requires_grad}

    want = run(lambda b: reference(d, b))
    got = run(TTTObjective(d, STEPS, DECAY))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert want[1][2].sum() > 0 and (want[1][1] < want[1][3]).all()  # some correct; some positions not counted
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-5, atol=1e-5, msg=k)
