"""Training-time test (EAGLE-3 paper section 3.3): the loss one micro-batch contributes.

Step 0 pairs the target's fused feature g_t with the embedding of x_{t+1} and learns the target's
distribution over x_{t+2}. Step i feeds the draft's own output feature back in (same position t), with the
token ids, targets and loss mask shifted i further: position t at step i stands for "i tokens drafted
ahead of t", attends to the causal step-0 keys plus its own keys from steps 1..i (``TTTCache``) and uses
rotary position t+i, exactly as when decoding with a KV cache. Loss: soft cross-entropy against the
target's distribution restricted to the draft vocabulary, counted where the predicted token is in the loss
mask and the target's argmax is in the draft vocabulary, weighted step_decay**i.

A parallel-drafting draft (P-EAGLE: ``mask_token_id`` in its config) unrolls the same way with the inputs vLLM
feeds its k-1 mask slots: step i >= 1 reads the mask token and ``mask_feature()`` instead of token t+1+i and
step i-1's output, at rotary position t+i, attending to the causal step-0 keys 0..t plus the mask keys of steps
1..i at t (``TTTCache``'s diagonal): exactly vLLM's one forward over [the verified tokens, mask, ..., mask].

``TTTObjective`` is that unroll, step by step. The vocabulary side ([B, T, Vd] per step) is most of the
non-matmul work, so it runs as one fused function after it (``SoftCrossEntropy``): a single max (which also
gives the argmax the accuracy needs), exp and sum, and a backward that turns the saved exponentials into the
gradient in place. The other losses 03 offers (``loss``; :func:`divergence`: reverse KL, total variation,
Jensen-Shannon, and the LK losses of arXiv 2602.23881 that aim at the acceptance rate sum_v min(p_v, q_v)
itself) go through autograd instead. Shapes: B batch, T positions, H / H_t the draft's / target's hidden size,
Vd the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from eagle3nb.drafts.base import REJECTED
from eagle3nb.drafts.eagle3.cache import TTTCache
from eagle3nb.drafts.eagle3.model import Eagle3Draft

# 03's ``loss`` choices; forward_kl is EAGLE-3's soft cross-entropy (KL(p||q) + H(p): the same gradient), fused.
LOSSES = ("forward_kl", "reverse_kl", "tv", "jsd", "lk_alpha", "lk_lambda", "opd")
TINY = torch.finfo(torch.float32).tiny  # the floor under a log of a probability that may be 0 (compact storage)


def divergence(loss: str, z: torch.Tensor, p: torch.Tensor, eta: float = 3.0,
               rejected: torch.Tensor | None = None) -> torch.Tensor:
    """The per-position loss [B, T] of the draft's logits ``z`` [B, T, V] (float32) against the target's
    distribution ``p`` [B, T, V] (rows of zeros: padding, finite and weighted 0), q = softmax(z):

    reverse_kl KL(q||p) = sum q log(q/p); tv 1/2 sum |p - q| (= 1 - acceptance); jsd 1/2 KL(p||m) + 1/2 KL(q||m),
    m = (p + q)/2; lk_alpha -log(acceptance); lk_lambda lambda KL(p||q) + (1 - lambda)(1 - acceptance), lambda =
    exp(-eta sg[acceptance]): KL's strong gradient while the draft is far, TV's (acceptance itself) once close;
    acceptance = sum min(p, q), what rejection sampling accepts; opd (on-policy distillation over the draft's own
    replayed proposals) KL(q||p) where ``rejected`` [B, T] (the target rejected the token predicted there:
    push the draft's mass off what the target does not want), KL(p||q) elsewhere (accepted: cover the target's
    mass). forward_kl here is KL(p||q) (the fused
    ``SoftCrossEntropy`` trains on it plus the constant H(p))."""
    logq = torch.log_softmax(z, dim=-1)  # shape: [B, T, V]
    q = logq.exp()
    if loss == "reverse_kl":
        return (q * (logq - p.clamp_min(TINY).log())).sum(-1)  # shape: [B, T]
    if loss == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if loss == "jsd":
        logm = ((p + q) / 2).clamp_min(TINY).log()  # shape: [B, T, V]
        return 0.5 * (torch.xlogy(p, p) - p * logm).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)  # shape: [B, T]: KL(p||q)
    if loss == "forward_kl":
        return kl
    accept = torch.minimum(p, q).sum(-1)  # shape: [B, T]
    if loss == "lk_alpha":
        return -accept.clamp_min(TINY).log()
    if loss == "lk_lambda":
        lam = torch.exp(-eta * accept.detach())
        return lam * kl + (1 - lam) * (1 - accept)
    if loss == "opd":
        if rejected is None:
            raise ValueError("loss opd needs the per-position rejected flags")
        return torch.where(rejected, divergence("reverse_kl", z, p), kl)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")


def ahead(i: int, T: int) -> slice:
    """Step i's view of a right-padded ``[B, T + pad]`` tensor: position t reads entry t+1+i, i tokens further
    ahead than step 0's t+1 (at step i, position t stands for "the draft has drafted i tokens past t")."""
    return slice(1 + i, T + 1 + i)


def with_target(i: int, T: int) -> int:
    """How many positions have a target at step i: those with t+1+i < T, i.e. ``t < T-1-i`` (the target's
    distribution at position t+1+i is over token t+2+i, so the last 1+i positions predict past the sequence)."""
    return max(T - 1 - i, 0)


class TTTObjective(nn.Module):
    """Wraps the draft so one ``forward`` = the whole unroll (one DDP call per micro-batch)."""

    unit = "TTT step"  # what 03's report calls the stats' columns

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, loss: str = "forward_kl", eta: float = 3.0):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        self.draft, self.steps, self.decay, self.loss, self.eta = draft, steps, decay, loss, eta

    @classmethod
    def from_params(cls, draft: Eagle3Draft, P) -> "TTTObjective":
        """The unroll 03's parameters ask for (``ttt_steps``, ``step_decay``, ``loss``, ``lk_eta``)."""
        return cls(draft, P.ttt_steps, P.step_decay, P.loss, P.lk_eta)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: aux [B,T,3H], input_ids/loss_mask/target_argmax [B,T], target_probs [B,T,Vd].
        Returns (weighted loss, stats [4, steps]: loss sum (of ``loss``), loss positions, correct, acceptance
        positions)."""
        d = self.draft
        ids, argmax, probs = batch["input_ids"], batch["target_argmax"], batch["target_probs"]  # [B,T] [B,T] [B,T,Vd]
        B, T = ids.shape

        # 1. The targets of every step at once, zero-padded on the right so each step's shift is a view.
        pad = self.steps + 1
        ids = torch.cat([ids, ids.new_zeros(B, pad)], dim=1)  # shape: [B, T + pad]
        argmax = torch.cat([argmax, argmax.new_zeros(B, pad)], dim=1)  # shape: [B, T + pad]
        # position u: the token after u is in the loss mask (scored), and also expressible in the draft vocab
        scored_at = torch.cat([batch["loss_mask"][:, 1:].bool(), ids.new_zeros(B, pad + 1, dtype=torch.bool)], 1)
        counted_at = scored_at & d.t2d[argmax]  # shape: [B, T + pad] both
        # loss opd: position u predicts a drafted token the target rejected (loss_mask value REJECTED)
        rejected_at = torch.cat([batch["loss_mask"][:, 1:] == REJECTED, scored_at.new_zeros(B, pad + 1)], 1)
        pos = torch.arange(T, device=ids.device).expand(B, T)  # shape: [B, T]

        # 2. Step 0's input feature: the target's low, mid and high hidden states fused into one (g_t).
        hidden = d.fuse(batch["aux"])  # shape: [B, T, 3H_t] -> [B, T, H]
        cache = TTTCache()  # the unroll's keys: step 0 causal, steps 1..i on the diagonal
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats = []

        # 3. Step i = 0 .. steps-1 (the paper's training-time test): the input is the draft's own output feature of
        #    step i-1 (step 0: the target's), the input token and the target are the target's shifted by 1+i, the
        #    rotary position is t+i, and the step's loss weighs decay**i (0.8**i by default).
        for i in range(self.steps):
            s, keep = ahead(i, T), with_target(i, T)
            inputs, hidden = d.unroll_inputs(i, ids[:, s], hidden)  # shape: [B, T], [B, T, H] (P-EAGLE: the mask's)
            tgt_argmax, scored, counted = argmax[:, s], scored_at[:, s], counted_at[:, s]  # shape: [B, T] each
            n = counted.sum()  # shape: [] (positions the loss counts at this step)
            weight = counted[:, :keep] * (self.decay ** i / n.clamp(min=1))  # shape: [B, keep]
            # a. the draft step: token t+1+i in, its feature out (fed back at step i+1)
            hidden, logits = d(hidden, inputs, pos + i, cache)  # shape: [B, T, H], [B, T, Vd]
            # b. the loss against the target's distribution at t+1+i (over token t+2+i): soft cross-entropy fused,
            #    another ``loss`` through autograd
            if self.loss == "forward_kl":
                loss_i, ce, pred = SoftCrossEntropy.apply(logits, probs[:, 1 + i:], weight, keep)  # [] [B,keep] x2
            else:
                z = logits[:, :keep].float()  # shape: [B, keep, Vd]
                per = divergence(self.loss, z, probs[:, 1 + i:].float(), self.eta,
                                 rejected_at[:, s][:, :keep])  # shape: [B, keep]
                loss_i, ce, pred = (per * weight).sum(), per.detach(), z.argmax(-1)
            loss = loss + loss_i
            # c. accuracy: the draft's greedy token is the target's
            correct = (d.draft_to_target(pred) == tgt_argmax[:, :keep]) & scored[:, :keep]  # shape: [B, keep]
            stats.append(torch.stack([(ce * counted[:, :keep]).sum().double(), n.double(), correct.sum().double(),
                                       scored.sum().double()]))  # shape: [4]
        return loss, torch.stack(stats, dim=1)  # shape: [], [4, steps]


class SoftCrossEntropy(torch.autograd.Function):
    """sum_t weight_t * CE(probs_t, softmax(logits_t)) over the first ``keep`` positions, with CE = lse(z) * sum(p)
    - p.z (= -p.log_softmax(z), also for all-zero padding rows), and the per-position CE and argmax.

    Forward keeps exp(z - max) in a [B, T, V] buffer whose rows >= keep are zero; backward rescales it in place
    into dL/dz = w * (sum(p) * softmax(z) - p), so neither a log-softmax copy nor a zero-filled gradient for the
    sliced-off rows is ever made. Call it once per graph (the buffer is consumed by backward)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor, keep: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [B, T, V]; probs [B, keep, V]; weight [B, keep] (no gradient). Returns (weighted sum, CE [B, keep],
        argmax [B, keep])."""
        B, T, V = logits.shape
        z = logits[:, :keep].float()
        m, argmax = z.max(-1, keepdim=True)
        buf = torch.empty(B, T, V, dtype=torch.float32, device=logits.device)
        buf[:, keep:].zero_()
        e = torch.sub(z, m, out=buf[:, :keep]).exp_()
        s = e.sum(-1)
        psum = probs.sum(-1)
        ce = (m.squeeze(-1) + s.log()) * psum - torch.linalg.vecdot(probs, z)
        ctx.buf, ctx.dtype = buf, logits.dtype
        ctx.save_for_backward(probs, weight * psum / s, weight)
        ctx.mark_non_differentiable(ce, argmax)
        return (ce * weight).sum(), ce, argmax.squeeze(-1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, _ce: torch.Tensor, _argmax: torch.Tensor):
        probs, coef, weight = ctx.saved_tensors
        buf, ctx.buf = ctx.buf, None
        keep = probs.shape[1]
        e = buf[:, :keep]
        e.mul_((coef * grad)[..., None]).addcmul_(probs, (weight * grad)[..., None], value=-1.0)
        return buf.to(ctx.dtype), None, None, None
