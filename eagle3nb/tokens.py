"""Kimi-K2.5 chat-format token strings (docs/DESIGN-FACTS.md "Kimi-K2.5 chat format"): read by the registry's
kimi entry (``eagle3nb.families``) and the toy tokenizer, which copies Kimi's format. Nothing else assumes them:
the stages read the target's family (other families' markers, Harmony's included, live in their entries)."""

from __future__ import annotations

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"

SPECIAL_TOKENS = [IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, THINK_START, THINK_END]

