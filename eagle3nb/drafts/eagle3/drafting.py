"""EAGLE-3's drafting step inside the batched decoder (``eagle3nb.decoder.batch.SpecBatch``): the draft, fed the
target's aux hidden states of every verified token, proposes k tokens one at a time (its own KV cache, its own output
hidden state fed back); rejected drafts leave its cache. A parallel-drafting (P-EAGLE) draft proposes its k tokens in
the same forward that feeds it the verified tokens, as vLLM's ``parallel_drafting`` runs it: k-1 mask slots follow each
row's last pending entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from eagle3nb.drafts.eagle3.cache import DraftCache
from eagle3nb.drafts.eagle3.model import Eagle3Draft
from eagle3nb.verification.padded import PaddedKV, draft_mask
from eagle3nb.verification.verify import Sampling, probs_at


class Eagle3Drafting:
    """An EAGLE-3 draft's step for rows sharing one ``PaddedKV`` (``eagle3nb.drafts.base.Drafting``), ``k``
    drafted tokens a round; ``device`` is where the target's tensors live."""

    def __init__(self, draft: Eagle3Draft, k: int, device: torch.device):
        self.draft, self.k, self.device = draft, k, device
        d2t_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self.d2t_ids = d2t_ids.to(device)  # shape: [Vd], the target id of each draft id
        self.vocab = draft.config.vocab_size

    def draft_probs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The draft's distribution over its vocab, placed onto the target vocab (zero outside it)."""
        q = torch.zeros(self.vocab, device=logits.device)
        return q.index_copy(0, self.d2t_ids, probs_at(logits, temperature))

    def prefill(self, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> PaddedKV:
        """The draft's cache over new rows' prompts (aux [B, T, 3H_t], ids / pos / mask [B, T], left-padded): every
        prompt position but the last, whose aux state pairs with the first token and opens the row's first round."""
        cfg, dtype, B = self.draft.config, self.draft.fc.weight.dtype, ids.shape[0]
        cache = DraftCache.empty(cfg.num_layers, torch.zeros(B, cfg.num_key_value_heads, 0, cfg.head_dim,
                                                             device=self.device, dtype=dtype))
        kv = PaddedKV(cache, mask[:, :-1])
        if ids.shape[1] > 1:
            self.draft(self.draft.fuse(aux[:, :-1]), ids[:, 1:], pos[:, :-1], cache=cache,
                       attention_mask=draft_mask(kv.mask, ids.shape[1] - 1))
        return kv

    def propose(self, kv: PaddedKV, pend_aux: torch.Tensor, pend_ids: torch.Tensor, pend_n: torch.Tensor,
                rows: Sequence[Sampling]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """k draft tokens per row [B, k] (target ids) and, for sampled rows, the distributions [k, V] they were
        drawn from. Step 0 feeds each row's pending target states (``pend_aux`` [B, P, 3H_t], ``pend_ids`` [B, P],
        ``pend_n`` [B] real entries); later steps feed the draft's own hidden state one position further, and
        their K/V are dropped after (only verified positions stay cached). A parallel-drafting draft has its k-1
        mask slots in step 0's forward instead: every draft from one pass."""
        draft = self.draft
        width = int(pend_n.max())
        masks = self.k - 1 if draft.config.mask_token_id is not None else 0
        feats, ids = draft.fuse(pend_aux[:, :width]), pend_ids[:, :width]  # shape: [B, width, H], [B, width]
        if masks:
            feats, ids = self._mask_slots(feats, ids, pend_n, masks)  # shape: [B, width + masks, H], [B, width + masks]
        pos = kv.extend(width + masks)
        h, logits = draft(feats, ids, pos, cache=kv.cache, attention_mask=draft_mask(kv.mask, width + masks))
        kv.reject(width + masks - pend_n)
        index = torch.arange(len(rows), device=self.device)
        # shape: [B, 1 + masks, Vd]: the logits of the row's last pending entry, then of its mask slots
        every = logits[index[:, None], pend_n[:, None] - 1 + torch.arange(1 + masks, device=self.device)]
        h, logits = h[index, pend_n - 1][:, None], every[:, 0]
        toks: list[torch.Tensor] = []
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(self.k):
            if masks:
                logits = every[:, j]  # shape: [B, Vd]
            tok = self.d2t_ids[logits.argmax(-1)]
            for i, s in enumerate(rows):
                if not s.greedy:
                    q = self.draft_probs(logits[i], s.temperature)
                    tok[i] = int(torch.multinomial(q.cpu(), 1, generator=s.generator))
                    qs[i].append(q)
            toks.append(tok)
            if j + 1 < self.k and not masks:
                pos = kv.extend(1)
                h, logits = draft(h, tok[:, None], pos, cache=kv.cache, attention_mask=draft_mask(kv.mask, 1))
                logits = logits[:, -1]
        if self.k > 1 and not masks:
            kv.reject(torch.full_like(pend_n, self.k - 1))
        return torch.stack(toks, dim=1), [torch.stack(q) if q else None for q in qs]

    def _mask_slots(self, feats: torch.Tensor, ids: torch.Tensor, pend_n: torch.Tensor, masks: int,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's pending entries followed by ``masks`` mask slots (the mask token, the draft's mask feature),
        right after its own last entry; columns past them are padding, after every query that matters."""
        B, width, H = feats.shape
        slot = torch.arange(width + masks, device=ids.device)[None] - pend_n[:, None]  # shape: [B, width + masks]
        is_mask = (slot >= 0) & (slot < masks)  # shape: [B, width + masks]
        feats = torch.cat([feats, feats.new_zeros(B, masks, H)], dim=1)  # shape: [B, width + masks, H]
        feats = torch.where(is_mask[..., None], self.draft.mask_feature().to(feats.dtype), feats)
        ids = torch.cat([ids, ids.new_zeros(B, masks)], dim=1).masked_fill(is_mask, self.draft.config.mask_token_id)
        return feats, ids

    def step_timer(self, aux: torch.Tensor, ids: torch.Tensor) -> Callable[[], None]:
        """One decoding step of the draft after the context ``aux`` [1, T, 3H_t], ``ids`` [1, T] (cached once),
        undone after each call: what a draft step costs at this context length."""
        context = ids.shape[1]
        cache = DraftCache()
        h, _ = self.draft(self.draft.fuse(aux[:, :-1]), ids[:, 1:], torch.arange(context - 1, device=ids.device)[None],
                          cache=cache)
        one, pos = ids[:, -1:], torch.tensor([[context - 1]], device=ids.device)

        def step() -> None:
            self.draft(h[:, -1:], one, pos, cache=cache)
            cache.crop(context - 1)

        return step
