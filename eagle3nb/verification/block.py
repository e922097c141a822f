"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025,
arXiv:2403.10444; vLLM's ``rejection_sample_method: block``): the k drafts are judged as one block instead of
token by token. Lossless like token-wise rejection sampling, and never worse in expected accepted drafts (the
paper proves it optimal among verifiers that see only the per-position distributions).

Notation: drafts X_1..X_k drawn from the draft's q_i = M_s(. | X_<i); the target's p_i = M_b(. | X_<i) for
i = 1..k+1 (row i-1 of ``target_probs``; row k is the distribution after the whole block).

1. Running weights: w_0 = 1, w_i = min(1, w_{i-1} * p_i(X_i) / q_i(X_i)) (the prefix's joint target/draft
   likelihood ratio, capped at 1 at every step).
2. Residual mass after prefix i (1 <= i < k): r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)).
3. Acceptance probability of each prefix: h_i = r_i / (r_i + 1 - w_i) for i < k (1 when the denominator is 0:
   w_i = 1 and p_{i+1} = q_{i+1}); h_k = w_k.
4. Draw eta_1..eta_k ~ U(0, 1) independently; tau = the largest i with eta_i <= h_i, else 0. Unlike token-wise
   verification a failed position does not stop the scan: a later prefix can still be accepted.
5. Keep X_1..X_tau and draw one more token from the correction distribution: p_{k+1} when tau = k, else
   normalize(max(0, w_tau p_{tau+1} - q_{tau+1})) (w_0 = 1: at tau = 0 this is token-wise's residual).

Token-wise verification (``verify.verify_sampling``) is the special case that stops at the first failed prefix.
"""

from __future__ import annotations

import torch


def block_weights(draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 for one block: (w [k+1] with w[0] = 1, h [k] with h[i-1] the acceptance probability of the
    prefix of i drafts). ``draft_ids`` [k] target-vocab ids, ``draft_probs`` [k, V], ``target_probs`` [k+1, V],
    float64 inside (the weights multiply k ratios)."""
    k = draft_ids.shape[0]
    q, p = draft_probs.double(), target_probs.double()
    rows = torch.arange(k)
    q_x, p_x = q[rows, draft_ids], p[rows, draft_ids]  # shape: [k]
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-300), torch.zeros_like(p_x))  # a draft q cannot draw: 0
    w = [torch.ones((), dtype=torch.float64)]
    for i in range(k):
        w.append(torch.clamp(w[-1] * ratio[i], max=1.0))
    w = torch.stack(w)  # shape: [k+1]
    resid = (w[1:k, None] * p[1:k] - q[1:k]).clamp_min(0).sum(-1)  # shape: [k-1], r_1..r_{k-1}
    denom = resid + 1 - w[1:k]
    h = torch.cat([torch.where(denom > 0, resid / denom.clamp_min(1e-300), torch.ones_like(denom)), w[k:]])
    return w, h  # shape: [k+1], [k]


def correction(tau: int, w: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Step 5's distribution [V] of the token after the kept prefix of ``tau`` drafts."""
    k = draft_probs.shape[0]
    if tau == k:
        return target_probs[k].double()
    residual = (w[tau] * target_probs[tau].double() - draft_probs[tau].double()).clamp_min(0)
    if float(residual.sum()) <= 0:  # reached only with probability 0 (h_tau = 0), or p == q up to rounding at 0
        return target_probs[tau].double()
    return residual / residual.sum()


def verify_block(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Block verification of one row, the signature of ``verify.verify_sampling``: (accepted count tau, the
    token after the kept prefix). Drawn on the CPU with the row's generator (k uniforms, then one token)."""
    draft_ids, draft_probs, target_probs = draft_ids.cpu(), draft_probs.cpu(), target_probs.cpu()
    w, h = block_weights(draft_ids, draft_probs, target_probs)
    eta = torch.rand(draft_ids.shape[0], generator=generator)  # shape: [k]; token-wise's draws (k = 1: its rule)
    passed = (eta.double() <= h).nonzero().flatten()
    tau = int(passed[-1]) + 1 if len(passed) else 0
    dist = correction(tau, w, draft_probs, target_probs).to(target_probs.dtype)  # shape: [V]
    return tau, int(torch.multinomial(dist, 1, generator=generator))
