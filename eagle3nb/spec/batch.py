"""Chain speculative decoding with a Hugging Face target and our EAGLE-3 draft, for one sequence or a
continuously batched set of them (``SpecBatch``, what the embedded server runs).

One round: the draft, fed the target's aux hidden states of every verified token, proposes k tokens (its own
KV cache, its own output hidden state fed back); the target scores the last verified token plus the k
proposals in one forward pass (its KV cache); the longest agreeing prefix is kept plus one token from the
target. Greedy: agree = equal to the target's argmax, so the output is exactly the target's greedy output.
Sampling: standard rejection sampling (accept d with min(1, p(d)/q(d)), else draw from the residual
max(0, p - q)), so the output distribution is exactly the target's. Rejected drafts leave both caches.
A parallel-drafting (P-EAGLE) draft proposes its k tokens in the same forward that feeds it the verified tokens,
as vLLM's ``parallel_drafting`` runs it: k-1 mask slots follow each row's last pending entry.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3nb.errors import InputError
from eagle3nb.formulas import summarize_counts
from eagle3nb.layers import default_aux_layer_ids


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: drafts, drafted tokens, accepted tokens, accepted tokens per position."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_pos = self.per_pos or [0] * self.k

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted += n_accepted
        for i in range(n_accepted):
            self.per_pos[i] += 1

    def merge(self, other: "SpecCounters") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.per_pos = [a + b for a, b in zip(self.per_pos, other.per_pos)]

    def summary(self) -> dict[str, Any]:
        return summarize_counts(self.drafts, self.draft_tokens, self.accepted, self.per_pos)


def probs_at(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution at ``temperature`` (> 0) after nucleus filtering (``top_p``), in float32
    (the same rule as the embedded server's ``sample_next``: the most likely token is always kept)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification. ``draft_ids`` [k] target-vocab ids, ``target_logits`` [k+1, V] (row i predicts the
    token after draft i-1). Returns (accepted count n, the target's token after the accepted prefix)."""
    target = target_logits.argmax(-1)
    k = draft_ids.shape[0]
    n = int((draft_ids == target[:k]).long().cumprod(0).sum())
    return n, int(target[n])


def verify_sampling(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """Rejection sampling. ``draft_probs`` [k, V] the draft's distributions (over the target vocab) the ids were
    drawn from, ``target_probs`` [k+1, V]. Accept draft i with prob min(1, p/q); at the first rejection draw
    from normalize(max(0, p - q)); if all k are accepted draw the bonus token from p[k]. Drawn on the CPU, where
    the request's generator lives, whatever device the models run on."""
    k = draft_ids.shape[0]
    draft_probs, target_probs = draft_probs.cpu(), target_probs.cpu()
    u = torch.rand(k, generator=generator)
    for i in range(k):
        d = int(draft_ids[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and u[i] * q <= p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is undefined, p is exact
            residual = target_probs[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def _crop(cache, length: int) -> None:
    """Crop a transformers cache to ``length`` tokens (negative = tokens to remove, valid in 4.x and 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _is_greedy(temperature: float) -> bool:
    return temperature < 1e-5  # the embedded server's rule


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if _is_greedy(temperature):
        return int(logits.argmax(-1))
    return int(torch.multinomial(probs_at(logits, temperature, top_p).cpu(), 1, generator=generator))


@torch.inference_mode()
def plain_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                   eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                   top_p: float = 1.0) -> list[int]:
    """The target alone, one token per forward pass with a KV cache: the baseline speculative decoding is
    measured against (and, greedy, must reproduce exactly)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)], device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        tok = _pick(logits, temperature, top_p, generator)
        out.append(tok)
        if tok in eos_token_ids:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out


@dataclass
class SpecOutput:
    tokens: list[int]
    counters: SpecCounters
    seconds: float
    accepted_per_round: list[int]  # n accepted drafts in each round (round r starts right after round r-1's tokens)
    drafted_per_round: list[list[int]] = field(default_factory=list)  # the k drafted tokens of each round (04's misses)


def left_padded(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, position_ids) [B, T] of sequences of different lengths, left-padded so that every row's
    next token lands in the same column; positions count each row's real tokens, so padding changes nothing."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _map_kv(cache, fn) -> None:
    """Apply ``fn`` to every key and value tensor [B, heads, T, d] of a transformers or draft cache, in place."""
    from eagle3nb.draft import DraftCache

    if isinstance(cache, DraftCache):
        for layer in cache.layers():
            layer.k, layer.v = fn(layer.k), fn(layer.v)
    else:
        for layer in cache.layers:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def _zip_kv(a, b, fn) -> None:
    """``a``'s tensors become ``fn(a's, b's)``, layer by layer (the two caches have the same kind and depth)."""
    from eagle3nb.draft import DraftCache

    if isinstance(a, DraftCache):
        for la, lb in zip(a.layers(), b.layers()):
            la.k, la.v = fn(la.k, lb.k), fn(la.v, lb.v)
    else:
        for la, lb in zip(a.layers, b.layers):
            la.keys, la.values = fn(la.keys, lb.keys), fn(la.values, lb.values)


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    n = width - x.shape[dim]
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def attention_windows(config) -> dict[str, int | None] | None:
    """The target's attention window by layer type, e.g. ``{"sliding_attention": 128, "full_attention": None}``
    (gpt-oss), or None when no layer slides. Other layer kinds (chunked, linear, shared KV) raise: PaddedKV
    edits every layer's keys and values column by column, which only plain attention layers allow."""
    cfg = config.get_text_config(decoder=True)
    try:  # what DynamicCache(config=...) itself reads
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: the same rule from the config's fields
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None) or \
            ["sliding_attention" if window is not None else "full_attention"] * cfg.num_hidden_layers
        kwargs = [{"sliding_window": window} if t == "sliding_attention" else {} for t in types]
    else:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    windows: dict[str, int | None] = {}
    for t, kw in zip(types, kwargs):
        if t not in ("full_attention", "sliding_attention"):
            raise InputError(f"the target has {t!r} layers: local speculative decoding supports full and "
                             "sliding-window attention layers only (serve it with vLLM instead)")
        windows[t] = kw.get("sliding_window") if t == "sliding_attention" else None
    return windows if any(w is not None for w in windows.values()) else None


def full_cache(config):
    """An empty DynamicCache for ``config`` whose every layer keeps all its columns: transformers' sliding layers
    drop columns past the window by count, and with holes and padding a row's window is not the last columns
    (``attention_mask`` applies the windows instead). Costs the memory of full layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


class PaddedKV:
    """One KV cache (transformers' or the draft's) shared by rows of different lengths, as continuous batching
    needs. Rows share columns; ``mask`` [B, T] (1 = a real token of that row) says which are a row's own, so
    left padding, rejected drafts and finished neighbours cost no copy, only masked attention, until holes
    waste a quarter of the width and the rows are packed again. ``length`` [B] counts each row's real tokens:
    the position of its next token. Every forward over it must pass the positions of ``extend`` and ``mask``
    (a target: ``attention_mask(n, ...)``, which also applies sliding windows by each row's real tokens)."""

    def __init__(self, cache, mask: torch.Tensor, windows: dict[str, int | None] | None = None):
        self.cache, self.mask, self.windows = cache, mask, windows
        self.length = mask.sum(1)

    @classmethod
    def for_target(cls, config, mask: torch.Tensor) -> "PaddedKV":
        """An empty target cache for rows whose columns ``mask`` [B, T] describes (the prefill comes next). A
        target with sliding-window layers gets full layers and its windows applied by ``attention_mask``."""
        windows = attention_windows(config)  # first: it refuses the layer kinds full_cache would not keep
        return cls(full_cache(config), mask, windows)

    def attention_mask(self, n: int, config, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """What a target forward over the last ``n`` columns passes as ``attention_mask``.

        Without sliding layers the 2D ``mask``: transformers builds causal + padding from it. With them, 4D masks
        [B, 1, n, T] built here, one per layer type (one tensor if every layer has the same window): a key is
        seen if it is one of the row's real tokens, not after the query, and for a sliding layer fewer than
        ``window`` real tokens before it. transformers' own sliding mask counts columns, which holes and padding
        make wrong, and its sliding cache layers keep only the last window of columns."""
        if not self.windows:
            return self.mask
        impl = getattr(config.get_text_config(decoder=True), "_attn_implementation", None)
        if impl not in ("eager", "sdpa"):
            raise InputError(f"local decoding of a sliding-window target needs attn_implementation 'eager' or "
                             f"'sdpa' (explicit 4D masks), not {impl!r}: load the target with one of them")
        width = self.mask.shape[1]
        q = torch.arange(width - n, width, device=self.mask.device)[:, None]
        k = torch.arange(width, device=self.mask.device)[None]
        seen = self.mask.bool()[:, None, None, :] & (k <= q)  # shape: [B, 1, n, T]
        count = self.mask.cumsum(1)  # shape: [B, T]: real tokens up to each column
        # shape: [B, 1, n, T]: real tokens after the key up to the query = their position difference (for real keys)
        dist = (count[:, width - n:, None] - count[:, None, :])[:, None]
        masks = {t: seen if w is None else seen & (dist < w) for t, w in self.windows.items()}
        if impl == "eager":  # additive: 0 where seen, the dtype's minimum elsewhere (as transformers' eager_mask)
            zero, low = torch.zeros((), dtype=dtype, device=q.device), torch.finfo(dtype).min
            masks = {t: torch.where(m, zero, low) for t, m in masks.items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def extend(self, n: int) -> torch.Tensor:
        """Columns for ``n`` new tokens per row (the forward that follows appends their K/V): position ids [B, n]."""
        pos = self.length[:, None] + torch.arange(n, device=self.mask.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], n)], dim=1)
        self.length = self.length + n
        return pos

    def reject(self, counts: torch.Tensor) -> None:
        """Row i keeps all but its last ``counts[i]`` tokens (rejected drafts): they become holes."""
        width = self.mask.shape[1]
        cols = torch.arange(width, device=self.mask.device)
        self.mask = self.mask * (cols[None] < width - counts[:, None])
        self.length = self.length - counts
        self._tidy()

    def merge(self, other: "PaddedKV") -> None:
        """Append ``other``'s rows (new requests): both left-padded to the wider one."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        _zip_kv(self.cache, other.cache, lambda a, b: torch.cat([_left_pad(a, width, 2), _left_pad(b, width, 2)]))
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        self.length = torch.cat([self.length, other.length])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished requests leave), then drop the columns nobody needs any more."""
        _map_kv(self.cache, lambda x: x[rows])
        self.mask, self.length = self.mask[rows], self.length[rows]
        self._tidy()

    def _tidy(self) -> None:
        """Drop columns that are holes in every row at either end; pack the rows when holes waste too much."""
        used = self.mask.any(0).nonzero()
        first, last = int(used[0]), int(used[-1]) + 1
        if first > 0 or last < self.mask.shape[1]:
            _map_kv(self.cache, lambda x: x[:, :, first:last])
            self.mask = self.mask[:, first:last]
        width, longest = self.mask.shape[1], int(self.length.max())
        if width - longest > max(8, width // 4):
            # A stable sort puts each row's holes first and its real columns after, in order: the last `longest`
            # entries right-align every row's tokens (attention is order-free given the mask; K keeps its rotary).
            idx = self.mask.argsort(dim=1, stable=True)[:, width - longest:]
            _map_kv(self.cache, lambda x: x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])))
            self.mask = self.mask.gather(1, idx)


def _draft_mask(kv_mask: torch.Tensor, n: int) -> torch.Tensor:
    """The draft's boolean attention mask [B, 1, n, T] for the last ``n`` of ``kv_mask``'s [B, T] columns:
    causal over the row's real tokens; each query also sees itself, so a padding query never attends to
    nothing (NaN)."""
    width = kv_mask.shape[1]
    q = torch.arange(width - n, width, device=kv_mask.device)[:, None]
    k = torch.arange(width, device=kv_mask.device)[None]
    return (kv_mask.bool()[:, None, None, :] & (k <= q)) | (k == q)


@dataclass
class Sampling:
    """How one sequence picks its tokens: greedy (temperature 0) or sampled with its own generator, so its
    tokens do not depend on which other sequences share its batch."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return _is_greedy(self.temperature)


class SpecDecoder:
    """A target + draft pair that decodes sequences speculatively, ``k`` drafted tokens per target step.

    ``layer_ids`` are HF ``hidden_states`` indices (docs/DESIGN-FACTS.md "Layer ids"); default: the draft's
    config, else vLLM's default (2, L//2, L-3), which is what vLLM would use for a draft config without ids."""

    def __init__(self, target, draft, k: int = 3, layer_ids: Sequence[int] | None = None):
        if k < 1:
            raise InputError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.target, self.draft, self.k = target.eval(), draft.eval(), k
        n_layers = target.config.num_hidden_layers
        ids = layer_ids if layer_ids is not None else draft.config.aux_layer_ids
        self.layer_ids = list(ids) if ids is not None else default_aux_layer_ids(n_layers)
        bad = [i for i in self.layer_ids if not 0 <= i <= n_layers]
        if bad:
            raise InputError(f"aux layer ids {bad} are outside the target's hidden_states 0..{n_layers}; check the "
                             "draft's eagle_aux_hidden_state_layer_ids (eagle3nb doctor: layer_ids)")
        if draft.config.vocab_size != target.config.vocab_size:
            raise InputError(f"the draft maps onto a vocabulary of {draft.config.vocab_size} tokens but the target "
                             f"has {target.config.vocab_size}: wrong target for this draft "
                             "(eagle3nb doctor: shapes_vocab)")
        self.device = target.device
        self.d2t_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self.d2t_ids = self.d2t_ids.to(self.device)
        self.vocab = target.config.vocab_size
        attention_windows(target.config)  # layer kinds PaddedKV cannot hold fail here, before any request

    def target_forward(self, ids: torch.Tensor, kv: PaddedKV, pos: torch.Tensor, keep: int = 0):
        """Target forward over ``ids`` [B, n] after ``kv``: (logits [B, n, V] (the last ``keep`` only, if > 0),
        aux [B, n, 3H] at the draft's layers)."""
        mask = kv.attention_mask(ids.shape[1], self.target.config, self.target.dtype)
        out = self.target(input_ids=ids, attention_mask=mask, position_ids=pos, cache=kv.cache, use_cache=True,
                          output_hidden_states=True, logits_to_keep=keep)
        kv.cache = out.cache
        return out.logits, torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)

    def draft_probs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The draft's distribution over its vocab, placed onto the target vocab (zero outside it)."""
        q = torch.zeros(self.vocab, device=logits.device)
        return q.index_copy(0, self.d2t_ids, probs_at(logits, temperature))

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                 top_p: float = 1.0) -> SpecOutput:
        """Decode one prompt (a batch of one) to ``max_new_tokens`` or an EOS: tokens, counters and seconds."""
        t0 = time.perf_counter()
        batch = SpecBatch(self)
        out = batch.add([prompt_ids], [Sampling(temperature, top_p, generator)])
        rounds: list[int] = []
        drafted: list[list[int]] = []
        while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
            new = batch.round()[0]
            rounds.append(len(new) - 1)
            drafted.append(batch.drafted[0])
            for tok in new:
                out.append(tok)
                if tok in eos_token_ids or len(out) >= max_new_tokens:
                    break
        return SpecOutput(out, batch.counters, time.perf_counter() - t0, rounds, drafted)


class SpecBatch:
    """Speculative decoding of many sequences at once, each with its own length, sampling and acceptance.

    A round drafts k tokens for every row (one batched draft run per step), verifies them all in one target
    forward (each row its own positions over the shared ``PaddedKV``), and accepts per row: the kept run is
    the row's longest agreeing prefix plus one target token, the rejected drafts become masked holes. Rows
    join (``add``) and leave (``keep``) between rounds, which is continuous batching. Per row the draft's
    pending state is the target's aux states of its verified tokens not yet fed to the draft (1..k+1 of them,
    right-padded): position p pairs the aux state at p with the token at p+1."""

    def __init__(self, dec: SpecDecoder):
        self.dec = dec
        self.counters = SpecCounters(dec.k)
        self._empty()

    def _empty(self) -> None:
        self.rows: list[Sampling] = []
        self.target: PaddedKV | None = None
        self.draft: PaddedKV | None = None
        self.last = torch.zeros(0, dtype=torch.long, device=self.dec.device)  # [B] emitted, not yet run by the target
        self.pend_aux: torch.Tensor | None = None  # [B, P, 3H]
        self.pend_ids = torch.zeros(0, 0, dtype=torch.long, device=self.dec.device)  # [B, P]
        self.pend_n = torch.zeros(0, dtype=torch.long, device=self.dec.device)  # [B] real entries of each pending row

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling]) -> list[int]:
        """Prefill new rows (their own left-padded batch, then merged in) and return their first tokens. The
        draft consumes every prompt position but the last, whose aux state pairs with the first token and
        opens the row's first round."""
        from eagle3nb.draft import DraftCache

        dec, B = self.dec, len(prompts)
        ids, mask, pos = left_padded(prompts, 0, dec.device)
        target = PaddedKV.for_target(dec.target.config, mask)
        logits, aux = dec.target_forward(ids, target, pos, keep=1)
        aux = aux.masked_fill(~mask.bool()[..., None], 0.0)  # padding's states may be NaN; the draft caches them
        first = [_pick(logits[i, -1], s.temperature, s.top_p, s.generator) for i, s in enumerate(sampling)]
        cfg, dtype = dec.draft.config, dec.draft.fc.weight.dtype
        cache = DraftCache.empty(cfg.num_layers, torch.zeros(B, cfg.num_key_value_heads, 0, cfg.head_dim,
                                                             device=dec.device, dtype=dtype))
        draft = PaddedKV(cache, mask[:, :-1])
        if ids.shape[1] > 1:
            dec.draft(dec.draft.fuse(aux[:, :-1]), ids[:, 1:], pos[:, :-1], cache=cache,
                      attention_mask=_draft_mask(draft.mask, ids.shape[1] - 1))
        firsts = torch.tensor(first, device=dec.device)
        if self.target is None:
            self.target, self.draft, self.pend_aux = target, draft, aux[:, -1:]
            self.pend_ids = firsts[:, None]
        else:
            self.target.merge(target)
            self.draft.merge(draft)
            width = self.pend_ids.shape[1]
            self.pend_aux = torch.cat([self.pend_aux, _right_pad(aux[:, -1:], width)])
            self.pend_ids = torch.cat([self.pend_ids, _right_pad(firsts[:, None], width)])
        self.pend_n = torch.cat([self.pend_n, torch.ones(B, dtype=torch.long, device=dec.device)])
        self.last = torch.cat([self.last, firsts])
        self.rows += list(sampling)
        return first

    @torch.inference_mode()
    def round(self) -> list[list[int]]:
        """One draft-and-verify round for every row: each row's accepted drafts plus the target's next token."""
        dec, k = self.dec, self.dec.k
        drafts, qs = self._propose()
        pos = self.target.extend(k + 1)
        logits, aux = dec.target_forward(torch.cat([self.last[:, None], drafts], dim=1), self.target, pos)
        accepted, nxt = [], []
        for i, s in enumerate(self.rows):
            if s.greedy:
                n, tok = verify_greedy(drafts[i], logits[i])
            else:
                target_p = probs_at(logits[i], s.temperature, s.top_p)
                n, tok = verify_sampling(drafts[i].cpu(), qs[i].cpu(), target_p.cpu(), s.generator)
            self.counters.record(k, n)
            accepted.append(n)
            nxt.append(tok)
        n = torch.tensor(accepted, device=dec.device)
        self.target.reject(k - n)
        self.last = torch.tensor(nxt, device=dec.device)
        # The verified positions 0..n of each row (the previous last token and its accepted drafts) pair with
        # the token after each: the next draft, or at n the target's own token.
        self.pend_aux, self.pend_n = aux, n + 1
        self.pend_ids = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n[:, None], self.last[:, None])
        self.drafted = drafts.tolist()  # each row's k drafted tokens of this round, accepted or not
        return [row[:a] + [t] for row, a, t in zip(self.drafted, accepted, nxt)]

    def _propose(self) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """k draft tokens per row [B, k] (target ids) and, for sampled rows, the distributions [k, V] they were
        drawn from. Step 0 feeds each row's pending target states; later steps feed the draft's own hidden
        state one position further, and their K/V are dropped after (only verified positions stay cached). A
        parallel-drafting draft has its k-1 mask slots in step 0's forward instead: every draft from one pass."""
        dec, draft, kv = self.dec, self.dec.draft, self.draft
        width = int(self.pend_n.max())
        masks = dec.k - 1 if draft.config.mask_token_id is not None else 0
        feats, ids = draft.fuse(self.pend_aux[:, :width]), self.pend_ids[:, :width]  # shape: [B, width, H], [B, width]
        if masks:
            feats, ids = self._mask_slots(feats, ids, masks)  # shape: [B, width + masks, H], [B, width + masks]
        pos = kv.extend(width + masks)
        h, logits = draft(feats, ids, pos, cache=kv.cache, attention_mask=_draft_mask(kv.mask, width + masks))
        kv.reject(width + masks - self.pend_n)
        rows = torch.arange(len(self.rows), device=dec.device)
        # shape: [B, 1 + masks, Vd]: the logits of the row's last pending entry, then of its mask slots
        every = logits[rows[:, None], self.pend_n[:, None] - 1 + torch.arange(1 + masks, device=dec.device)]
        h, logits = h[rows, self.pend_n - 1][:, None], every[:, 0]
        toks: list[torch.Tensor] = []
        qs: list[list[torch.Tensor]] = [[] for _ in self.rows]
        for j in range(dec.k):
            if masks:
                logits = every[:, j]  # shape: [B, Vd]
            tok = dec.d2t_ids[logits.argmax(-1)]
            for i, s in enumerate(self.rows):
                if not s.greedy:
                    q = dec.draft_probs(logits[i], s.temperature)
                    tok[i] = int(torch.multinomial(q.cpu(), 1, generator=s.generator))
                    qs[i].append(q)
            toks.append(tok)
            if j + 1 < dec.k and not masks:
                pos = kv.extend(1)
                h, logits = draft(h, tok[:, None], pos, cache=kv.cache, attention_mask=_draft_mask(kv.mask, 1))
                logits = logits[:, -1]
        if dec.k > 1 and not masks:
            kv.reject(torch.full_like(self.pend_n, dec.k - 1))
        return torch.stack(toks, dim=1), [torch.stack(q) if q else None for q in qs]

    def _mask_slots(self, feats: torch.Tensor, ids: torch.Tensor, masks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's pending entries followed by ``masks`` mask slots (the mask token, the draft's mask feature),
        right after its own last entry; columns past them are padding, after every query that matters."""
        B, width, H = feats.shape
        slot = torch.arange(width + masks, device=ids.device)[None] - self.pend_n[:, None]  # shape: [B, width+masks]
        is_mask = (slot >= 0) & (slot < masks)  # shape: [B, width + masks]
        feats = torch.cat([feats, feats.new_zeros(B, masks, H)], dim=1)  # shape: [B, width + masks, H]
        feats = torch.where(is_mask[..., None], self.dec.draft.mask_feature().to(feats.dtype), feats)
        ids = torch.cat([ids, ids.new_zeros(B, masks)], dim=1).masked_fill(is_mask, self.dec.draft.config.mask_token_id)
        return feats, ids

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order), e.g. when requests finish."""
        if not rows:
            self._empty()
            return
        idx = torch.tensor(list(rows), device=self.dec.device)
        self.target.select(idx)
        self.draft.select(idx)
        self.rows = [self.rows[i] for i in rows]
        self.last, self.pend_aux = self.last[idx], self.pend_aux[idx]
        self.pend_ids, self.pend_n = self.pend_ids[idx], self.pend_n[idx]


def _right_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 1 of ``x`` with zeros up to ``width`` (pending entries past a row's count are never read)."""
    shape = list(x.shape)
    shape[1] = width - x.shape[1]
    return torch.cat([x, x.new_zeros(shape)], dim=1)


def compare_with_plain(target, draft, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
                       temperature: float = 0.0, eos_token_ids: Sequence[int] = (), seed: int = 0,
                       progress=None) -> dict[str, Any]:
    """Decode every prompt plainly and speculatively, side by side: identical outputs (greedy), counters,
    tokens/s of each and the speedup. The local, lossless ground truth for the offline prediction."""
    dec = SpecDecoder(target, draft, k)
    if prompts:  # warm-up, untimed: first calls pay one-time allocation and dispatch costs
        plain_generate(target, prompts[0], 4)
        dec.generate(prompts[0], 4)
    counters = SpecCounters(k)
    plain_s = spec_s = 0.0
    plain_tokens = spec_tokens = 0
    mismatches: list[int] = []
    rounds: list[list[int]] = []
    drafted: list[list[list[int]]] = []
    outputs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        g = torch.Generator().manual_seed(seed + i)
        t0 = time.perf_counter()
        ref = plain_generate(target, prompt, max_new_tokens, temperature, eos_token_ids, g)
        plain_s += time.perf_counter() - t0
        g = torch.Generator().manual_seed(seed + i)
        res = dec.generate(prompt, max_new_tokens, temperature, eos_token_ids, g)
        spec_s += res.seconds
        plain_tokens += len(ref)
        spec_tokens += len(res.tokens)
        counters.merge(res.counters)
        rounds.append(res.accepted_per_round)
        drafted.append(res.drafted_per_round)
        outputs.append(res.tokens)
        if res.tokens != ref:
            mismatches.append(i)
        if progress is not None:
            progress.update(1, acceptance_length=counters.summary()["acceptance_length"])
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    return {
        "k": k, "temperature": temperature, "prompts": len(prompts),
        **counters.summary(),
        "identical_to_target": not mismatches if _is_greedy(temperature) else None,
        "mismatched_prompts": mismatches,
        "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
        "accepted_per_round": rounds, "drafted_per_round": drafted, "outputs": outputs,
    }


@torch.inference_mode()
def measure_costs(target, draft, k: int, context: int = 128, repeats: int = 20) -> dict[str, float]:
    """Wall-clock costs on this machine, relative to one plain target decode step at ``context`` tokens:
    ``cost_ratio`` c = one draft step / one target step; ``overhead`` = verifying k+1 tokens / one target
    step - 1 (the extra the verify pass costs). They enter speedup = tau / (1 + k*c + overhead)."""
    from transformers import DynamicCache

    from eagle3nb.draft import DraftCache

    dec = SpecDecoder(target, draft, k)
    dev = dec.device
    ids = torch.randint(0, target.config.vocab_size, (1, context), device=dev)

    def timed(fn) -> float:
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    cache = DynamicCache()
    out = target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in dec.layer_ids], dim=-1)
    one, many = ids[:, -1:], ids[:, -(k + 1):]

    def target_step(x):
        target(input_ids=x, cache=cache, use_cache=True, output_hidden_states=True)
        _crop(cache, context)

    t_step = timed(lambda: target_step(one))
    t_verify = timed(lambda: target_step(many))
    dcache = DraftCache()
    h, _ = draft(draft.fuse(aux[:, :-1]), ids[:, 1:], torch.arange(context - 1, device=dev)[None], cache=dcache)
    pos = torch.tensor([[context - 1]], device=dev)

    def draft_step():
        draft(h[:, -1:], one, pos, cache=dcache)
        dcache.crop(context - 1)

    t_draft = timed(draft_step)
    return {"target_step_s": t_step, "verify_s": t_verify, "draft_step_s": t_draft,
            "cost_ratio": t_draft / t_step, "overhead": max(0.0, t_verify / t_step - 1.0), "context": context}
