"""The padded KV cache: one cache (transformers' or a draft's) shared by rows of different lengths, as continuous
batching needs (``PaddedKV``), and the masks and positions that make left padding, holes of rejected drafts and
sliding windows cost no copy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle3nb.errors import InputError


def left_padded(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, position_ids) [B, T] of sequences of different lengths, left-padded so that every row's
    next token lands in the same column; positions count each row's real tokens, so padding changes nothing."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _map_kv(cache, fn) -> None:
    """Apply ``fn`` to every key and value tensor [B, heads, T, d] of a transformers cache, in place; a draft's own
    cache (one with ``map_kv``) does it itself."""
    if hasattr(cache, "map_kv"):
        cache.map_kv(fn)
        return
    for layer in cache.layers:
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def _zip_kv(a, b, fn) -> None:
    """``a``'s tensors become ``fn(a's, b's)``, layer by layer (the two caches have the same kind and depth; a
    draft's own cache, one with ``zip_kv``, does it itself)."""
    if hasattr(a, "zip_kv"):
        a.zip_kv(b, fn)
        return
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
    """One KV cache (transformers', or a draft's offering ``map_kv`` / ``zip_kv``) shared by rows of different
    lengths, as continuous batching needs. Rows share columns; ``mask`` [B, T] (1 = a real token of that row) says
    which are a row's own, so left padding, rejected drafts and finished neighbours cost no copy, only masked
    attention, until holes waste a quarter of the width and the rows are packed again. ``length`` [B] counts each
    row's real tokens: the position of its next token. Every forward over it must pass the positions of ``extend``
    and ``mask`` (a target: ``attention_mask(n, ...)``, also applying sliding windows by each row's real tokens)."""

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


def draft_mask(kv_mask: torch.Tensor, n: int) -> torch.Tensor:
    """The draft's boolean attention mask [B, 1, n, T] for the last ``n`` of ``kv_mask``'s [B, T] columns:
    causal over the row's real tokens; each query also sees itself, so a padding query never attends to
    nothing (NaN)."""
    width = kv_mask.shape[1]
    q = torch.arange(width - n, width, device=kv_mask.device)[:, None]
    k = torch.arange(width, device=kv_mask.device)[None]
    return (kv_mask.bool()[:, None, None, :] & (k <= q)) | (k == q)

