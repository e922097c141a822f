"""Capturing chosen hidden states in one forward pass.

Forward hooks keep only what EAGLE-3 needs: for id ``i`` (HF ``hidden_states[i]`` = vLLM id ``i``) the
output of decoder layer ``i-1`` (the embeddings for ``i = 0``), and the final norm's output. Every other
layer's states are dropped as soon as the next layer has used them, unlike ``output_hidden_states=True``,
which keeps all L+1 of them. ``prenorm_final`` captures the final norm's *input* instead, which is what vLLM
returns for id ``L``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from eagle3nb.errors import InputError

if TYPE_CHECKING:
    import torch


def decoder_parts(model):
    """(embed_tokens, decoder layers, final norm) of a causal LM (Llama, Qwen, DeepSeek/Kimi shapes)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("layers", "norm", "embed_tokens"):
        if not hasattr(decoder, name):
            raise InputError(f"{type(model).__name__}: its decoder has no .{name}; only decoder-only causal LMs "
                            "with layers / norm / embed_tokens are supported")
    return decoder.embed_tokens, decoder.layers, decoder.norm


class Capture:
    """Context manager: hooks that store ``states[id]`` for the chosen ids and ``states["final"]``.

    ``ids`` may include ``L`` (= len(layers)) meaning the final norm's input (vLLM's id ``L``)."""

    def __init__(self, model, ids: list[int], final: bool = True):
        self.embed, self.layers, self.norm = decoder_parts(model)
        self.ids, self.final = list(ids), final
        self.states: dict = {}
        self._handles: list = []

    def _keep(self, key):
        def hook(module, args, out):
            if threading.get_ident() == self._thread:  # another thread's forward (a server's engine) is not ours
                self.states[key] = out[0] if isinstance(out, tuple) else out
        return hook

    def __enter__(self) -> "Capture":
        self._thread = threading.get_ident()
        n = len(self.layers)
        for i in self.ids:
            if i == 0:
                self._handles.append(self.embed.register_forward_hook(self._keep(0)))
            elif i < n:
                self._handles.append(self.layers[i - 1].register_forward_hook(self._keep(i)))
            elif i == n:
                self._handles.append(self.norm.register_forward_pre_hook(
                    lambda module, args, _k=n: self._keep(_k)(module, args, args[0])))
            else:
                raise InputError(f"layer id {i} out of range for {n} decoder layers")
        if self.final:
            self._handles.append(self.norm.register_forward_hook(self._keep("final")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def take(self) -> tuple["torch.Tensor", "torch.Tensor | None"]:
        """(states of ``ids`` stacked [B, T, n, H] on the last state's device, final [B, T, H] or None); clears."""
        import torch

        dev = self.states["final"].device if self.final else self.states[self.ids[-1]].device
        aux = torch.stack([self.states[i].to(dev) for i in self.ids], dim=2)
        final = self.states.get("final")
        self.states = {}
        return aux, final


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Right-padded ``input_ids`` and ``attention_mask`` [B, T]. With right padding and a causal mask, no real
    token ever attends to a pad, so real positions compute what they would alone."""
    import torch

    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, :len(s)] = 1
    return ids, mask


def input_device(model):
    import torch

    embed = decoder_parts(model)[0]
    return next(embed.parameters()).device if any(True for _ in embed.parameters()) else torch.device("cpu")


def run_decoder(model, seqs: list[list[int]]):
    """The bare forward pass over one right-padded batch: the decoder only (no lm_head over all positions)."""
    import torch

    input_ids, mask = pad_batch(seqs)
    dev = input_device(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with torch.inference_mode():
        return decoder(input_ids=input_ids.to(dev), attention_mask=mask.to(dev), use_cache=False)


def capture_batch(model, seqs: list[list[int]], ids: list[int], final: bool = True
                  ) -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """One forward over a padded batch -> (states of ``ids`` [B, T, n, H], final normed state [B, T, H])."""
    with Capture(model, ids, final=final) as cap:
        run_decoder(model, seqs)
        return cap.take()
