"""LiLiCorr: DFlash's block drafter plus a learned correlator over its candidates, as vLLM 0.32's ``lilicorr.py``
serves it. No I/O here: ``layouts`` reads and writes checkpoints.

Read top to bottom like the paper:

1. **The backbone** is DFlash's (``eagle3nb.drafts.dflash.model``): one forward gives every block slot's post-norm
   state; slot j >= 1 drafts the token at the anchor's position + j through the target's head.
2. **The lattice.** Per drafting slot (``n`` of them) the head's top ``K`` candidates, in rank order, with their
   log-probabilities over the whole vocabulary (live: the lattice's loss trains the backbone through them).
3. **The head** embeds every candidate: the target's embedding row of its token (``token_proj``), its slot's state
   (``pass_hidden_proj``), five features of its log-probability (``feature_norm``, ``feature_mlp``: log p, p, the
   gap to its slot's best, rank / (K-1), is-top-1), a slot and a rank embedding. ``lilicorr_num_layers`` pre-norm
   attention layers run over the flattened ``n x K`` lattice, unmasked, with a learned per-head bias by slot
   distance and for the same slot. Each candidate's state, joined with the *anchor* (``context_proj`` of the
   context feature before the block, ``hidden_norm(fc(aux))`` at the last verified token), gives an ``out`` and an
   ``in`` vector, L2-normalised: a transition from candidate i of slot s to candidate j of slot s+1 scores
   ``cos(out[s, i], in[s+1, j])``, the first slot's candidates ``cos(anchor_out, in[0, j])``; times the fixed
   ``lilicorr_logit_scale`` these are the path logits.
4. **The walk** (vLLM's ``_selector_walk_kernel``): slot 0 picks the argmax of the start logits, each next slot the
   argmax of the transition row leaving the candidate picked before (``greedy_path``); sampled at T > 0 from the
   softmax of that row over the ``K`` candidates, which is the draft's distribution rejection sampling reads (-inf
   off the candidates).

The ``# shape:`` comments use M lattices (blocks), n drafting slots, K candidates per slot, H the draft's hidden
size, h the head's, f the factor width, nh the head's attention heads, V the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3nb.drafts.base import DraftMismatchError
from eagle3nb.drafts.dflash.model import DFlashConfig, DFlashDraft
from eagle3nb.drafts.dflash.model import fresh_draft as fresh_backbone
from eagle3nb.drafts.lilicorr.settings import PUBLISHED_WIDTH, topk_problem
from eagle3nb.drafts.nn import RMSNorm

FEATURES = 5  # log p, p, log p - max log p, rank / (K - 1), is top-1


@dataclass
class LiLiCorrConfig(DFlashConfig):
    """DFlash's shape plus the head's (vLLM's ``dflash_config.lilicorr_*``; ``lilicorr_topk`` is its
    ``lilicorr_candidate_topk``). ``block_size`` is the block the head was built for: its slot embedding and its
    slot-distance bias are that block's."""

    lilicorr_topk: int = 8
    lilicorr_hidden_size: int = PUBLISHED_WIDTH
    lilicorr_factor_dim: int = PUBLISHED_WIDTH
    lilicorr_num_layers: int = 2
    lilicorr_num_heads: int = 8
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_logit_scale: float = 8.0
    lilicorr_vector_eps: float = 1e-4

    @property
    def method(self) -> str:
        """Its name in the registry (vLLM serves it as ``dflash``, its architecture telling it apart)."""
        return "lilicorr"

    def backbone(self) -> DFlashConfig:
        """The DFlash backbone's own config (what DFlash's layouts write the layers from)."""
        return DFlashConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DFlashConfig)})


def head_problem(cfg: LiLiCorrConfig) -> str | None:
    """Why the head cannot be built or served at this shape (one line naming 03's setting), or None."""
    k = cfg.lilicorr_topk
    if problem := topk_problem(k):
        return problem
    if k > cfg.vocab_size:
        return f"lilicorr_topk {k} exceeds the vocabulary ({cfg.vocab_size}): lower lilicorr_topk in 03_train"
    if cfg.lilicorr_hidden_size % cfg.lilicorr_num_heads:
        return (f"lilicorr_num_heads {cfg.lilicorr_num_heads} does not divide the head's width "
                f"{cfg.lilicorr_hidden_size}: set lilicorr_num_heads or lilicorr_hidden_size in 03_train")
    if cfg.selector_rank or cfg.markov_rank:
        return "a LiLiCorr draft has neither DSpark's Markov head nor DFlash2's selector: its lattice picks the path"
    return None


class FeedForward(nn.Module):
    """up_proj, SiLU, down_proj, both with biases (vLLM's non-gated ``NemotronHMLP``)."""

    def __init__(self, size_in: int, hidden: int, size_out: int):
        super().__init__()
        self.up_proj = nn.Linear(size_in, hidden)
        self.down_proj = nn.Linear(hidden, size_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))  # shape: [..., in] -> [..., hidden] -> [..., out]


class LatticeAttention(nn.Module):
    """Multi-head self-attention over the lattice with an additive bias (``torch.nn.MultiheadAttention``'s tensors:
    one fused ``in_proj``, ``out_proj``), no mask: every candidate sees every other."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * h, h))  # shape: [3h, h], q / k / v stacked
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * h))
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [M, Q, h] (Q = n*K), bias [nh, Q, Q] -> [M, Q, h]."""
        M, Q, h = x.shape
        q, k, v = (t.view(M, Q, self.heads, self.d).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))  # shape: [M, nh, Q, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(x.dtype))  # shape: [M, nh, Q, d]
        return self.out_proj(out.transpose(1, 2).reshape(M, Q, h))


class LatticeLayer(nn.Module):
    """Pre-norm attention over the lattice, then a pre-norm non-gated MLP."""

    def __init__(self, h: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(h, eps)
        self.attn = LatticeAttention(h, heads)
        self.mlp_norm = RMSNorm(h, eps)
        self.mlp = FeedForward(h, int(h * mlp_ratio), h)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)  # shape: [M, Q, h]
        return x + self.mlp(self.mlp_norm(x))


class LatticeHead(nn.Module):
    """The correlator (vLLM's ``LiLiCorrHead``): ``score`` gives the start and transition cosines, ``forward``
    vLLM's path logits [M, n, K, K] (the first slot's row repeated K times, then the transitions)."""

    def __init__(self, cfg: LiLiCorrConfig):
        super().__init__()
        H, h, f, K = cfg.hidden_size, cfg.lilicorr_hidden_size, cfg.lilicorr_factor_dim, cfg.lilicorr_topk
        heads, self.block_size, self.topk = cfg.lilicorr_num_heads, cfg.block_size, K
        self.eps, self.scale = cfg.lilicorr_vector_eps, cfg.lilicorr_logit_scale
        self.token_proj = nn.Identity() if h == H else nn.Linear(H, h)
        self.pass_hidden_proj = nn.Linear(H, h)
        self.feature_norm = nn.LayerNorm(FEATURES)
        self.feature_mlp = FeedForward(FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, cfg.block_size - 1, 1, h))  # shape: [1, 1, S-1, 1, h]
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, K, h))  # shape: [1, 1, 1, K, h]
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * cfg.block_size - 1))  # by slot distance
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(H, h)
        self.layers = nn.ModuleList(LatticeLayer(h, heads, cfg.lilicorr_mlp_ratio, cfg.rms_norm_eps)
                                    for _ in range(cfg.lilicorr_num_layers))
        self.output_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.anchor_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)  # reads [candidate, anchor, candidate * anchor]
        self.out_head = nn.Linear(h, f)
        self.in_head = nn.Linear(h, f)
        self.anchor_out_head = nn.Linear(h, f)
        for m in self.modules():  # small weights, zero biases: near-uniform scores that still carry a gradient
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def attention_bias(self, n: int) -> torch.Tensor:
        """[nh, n*K, n*K]: per head, the learned bias of the two candidates' slot distance (centred on the trained
        block, so a shorter lattice reads the same weights) plus the same-slot bias."""
        slot = torch.arange(n, device=self.same_slot_bias.device).repeat_interleave(self.topk)  # shape: [n*K]
        rel = slot[:, None] - slot[None]  # shape: [n*K, n*K]
        same = (rel == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, rel + self.block_size - 1] + same * self.same_slot_bias[:, None, None]

    def score(self, tokens: torch.Tensor, log_probs: torch.Tensor, slots: torch.Tensor, anchor: torch.Tensor,
              valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [M, n, K, H] the candidates' target embedding rows, log_probs [M, n, K] theirs under the draft
        (rank order), slots [M, n, H] the slots' states, anchor [M, H] the context feature before each block and
        valid [M] whether it has one -> the cosines: start [M, K] (anchor -> slot 0), pairs [M, n-1, K, K]
        (candidate i of slot s -> candidate j of slot s+1)."""
        M, n, K = log_probs.shape
        lp = log_probs.float()
        rank = torch.arange(K, device=lp.device, dtype=lp.dtype) / max(K - 1, 1)  # shape: [K]
        top1 = (torch.arange(K, device=lp.device) == 0).to(lp.dtype)  # shape: [K]
        feats = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                             top1.expand_as(lp)], -1)  # shape: [M, n, K, 5]
        x = self.token_proj(tokens) + self.pass_hidden_proj(slots)[:, :, None]  # shape: [M, n, K, h]
        x = x + self.feature_mlp(self.feature_norm(feats.to(x.dtype)))
        x = x + self.slot_embedding[:, 0, :n] + self.rank_embedding[:, 0]
        x = x.reshape(M, n * K, -1)  # shape: [M, n*K, h]
        bias = self.attention_bias(n)  # shape: [nh, n*K, n*K]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(M, n, K, -1)  # shape: [M, n, K, h]
        a = self.anchor_norm(self.context_proj(anchor) * valid[:, None].to(x.dtype))  # shape: [M, h]
        a4 = a[:, None, None].expand_as(x)  # shape: [M, n, K, h]
        factor = F.silu(self.factor_input_proj(torch.cat([x, a4, x * a4], -1)))  # shape: [M, n, K, h]
        out = F.normalize(self.out_head(factor), dim=-1, eps=self.eps)  # shape: [M, n, K, f]
        into = F.normalize(self.in_head(factor), dim=-1, eps=self.eps)  # shape: [M, n, K, f]
        a_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.eps)  # shape: [M, f]
        start = (a_out[:, None] * into[:, 0]).sum(-1)  # shape: [M, K]
        pairs = out[:, :-1] @ into[:, 1:].transpose(-1, -2)  # shape: [M, n-1, K, K]
        return start, pairs

    def forward(self, tokens: torch.Tensor, log_probs: torch.Tensor, slots: torch.Tensor, anchor: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        """vLLM's layout of the path logits [M, n, K, K]: step s's row r scores the candidates after candidate r of
        slot s-1; the first step's K rows all hold the start logits (its walk reads row 0)."""
        start, pairs = self.score(tokens, log_probs, slots, anchor, valid)
        first = (self.scale * start.float())[:, None, None].expand(-1, 1, self.topk, -1)  # shape: [M, 1, K, K]
        return torch.cat([first, self.scale * pairs.float()], 1)


def next_row(pairs_s: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The transition logits [..., K] leaving candidate ``prev`` [...] of the slot before: rows of pairs_s [..., K,
    K]."""
    K = pairs_s.shape[-1]
    return pairs_s.gather(-2, prev[..., None, None].expand(*prev.shape, 1, K)).squeeze(-2)


def greedy_path(start: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The walk vLLM's kernel takes at T = 0: start [..., K] and pairs [..., n-1, K, K] logits -> the candidate
    picked at each slot [..., n]: the argmax of the start logits, then of the row leaving the candidate picked
    before."""
    pick = start.argmax(-1)  # shape: [...]
    out = [pick]
    for s in range(pairs.shape[-3]):
        pick = next_row(pairs[..., s, :, :], pick).argmax(-1)
        out.append(pick)
    return torch.stack(out, -1)  # shape: [..., n]


def chain_logits(start: torch.Tensor, pairs: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Each slot's logits over its candidates [..., n, K] with the walk held to ``previous`` [..., n-1] (the candidate
    at each slot before the last: the true token's in training, which is how the objective walks the chain)."""
    rows = [start] + [next_row(pairs[..., s, :, :], previous[..., s]) for s in range(pairs.shape[-3])]
    return torch.stack(rows, -2)


class LiLiCorrDraft(DFlashDraft):
    """DFlash's drafter (its ``context``, ``forward``, ``logits``) with the lattice head ``lilicorr``."""

    def __init__(self, cfg: LiLiCorrConfig, mask_embedding: bool = True):
        if problem := head_problem(cfg):
            raise DraftMismatchError(problem)
        super().__init__(cfg, mask_embedding)
        self.lilicorr = LatticeHead(cfg)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> the top ``lilicorr_topk`` ids [..., K] in rank order (no gradient: a choice) and their
        log-probabilities over the whole vocabulary [..., K] (live: the lattice's loss reaches the backbone)."""
        logits = logits.float()
        ids = logits.detach().topk(self.config.lilicorr_topk, dim=-1).indices  # shape: [..., K]
        return ids, logits.gather(-1, ids) - logits.logsumexp(-1, keepdim=True)

    def lattice(self, slots: torch.Tensor, anchor: torch.Tensor, valid: torch.Tensor,
                logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks' lattices: slots [M, n, H] the drafting slots' states (their ``logits`` [M, n, V] when already
        computed), anchor [M, H] and valid [M] -> the candidates [M, n, K] (target ids), the start logits [M, K]
        and the transition logits [M, n-1, K, K] (cosines times ``lilicorr_logit_scale``)."""
        ids, lp = self.candidates(self.logits(slots) if logits is None else logits)
        start, pairs = self.lilicorr.score(self.embed_tokens(ids).detach(), lp, slots, anchor, valid)
        scale = self.config.lilicorr_logit_scale
        return ids, scale * start.float(), scale * pairs.float()

    @staticmethod
    def anchor_rows(ctx: torch.Tensor, anchor_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, T, H] context features, anchor_pos [B, N] -> the anchor the head reads per block [B, N, H]: the
        feature at the position before the block's anchor token (the last verified token's target state, which vLLM
        takes at the last accepted token), and whether there is one [B, N]."""
        at = (anchor_pos - 1).clamp_min(0)  # shape: [B, N]
        rows = ctx.gather(1, at[..., None].expand(-1, -1, ctx.shape[-1]))  # shape: [B, N, H]
        return rows, anchor_pos > 0


def head_settings(P: Any, hidden_size: int) -> dict[str, Any]:
    """The head's shape from 03's parameters (``P.lilicorr_*``; null widths resolved for a draft of
    ``hidden_size``)."""
    width = P.lilicorr_hidden_size or min(PUBLISHED_WIDTH, hidden_size)
    return {"lilicorr_topk": P.lilicorr_topk, "lilicorr_hidden_size": width,
            "lilicorr_factor_dim": P.lilicorr_factor_dim or width, "lilicorr_num_layers": P.lilicorr_num_layers,
            "lilicorr_num_heads": P.lilicorr_num_heads, "lilicorr_mlp_ratio": P.lilicorr_mlp_ratio,
            "lilicorr_logit_scale": P.lilicorr_logit_scale, "lilicorr_vector_eps": P.lilicorr_vector_eps}


def fresh_draft(P: Any, meta: dict[str, Any], target_config: dict[str, Any], embed_tokens: torch.Tensor,
                lm_head: torch.Tensor) -> LiLiCorrDraft:
    """03's fresh LiLiCorr draft: DFlash's fresh backbone (its ``block_size``, ``num_layers``, ``block_causal``,
    and with ``lilicorr_conv`` DFlash2's convolutions) under a fresh head of 03's ``lilicorr_*`` shape, refused in
    one line where vLLM could not serve it."""
    conv = {"conv_kernel_size": P.conv_kernel_size, "conv_group_size": P.conv_group_size} if P.lilicorr_conv else {}
    backbone = fresh_backbone(P, meta, target_config, embed_tokens, lm_head, causal=P.block_causal, **conv)
    cfg = LiLiCorrConfig(**dataclasses.asdict(backbone.config), **head_settings(P, backbone.config.hidden_size))
    model = LiLiCorrDraft(cfg)
    missing, unexpected = model.load_state_dict(backbone.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("lilicorr.") for k in missing), (missing, unexpected)
    return model
