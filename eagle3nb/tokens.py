"""Kimi-K2.5 chat-format token names (docs/DESIGN-FACTS.md "Kimi-K2.5 chat format"), shared by every stage."""

from __future__ import annotations

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"

SPECIAL_TOKENS = [IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, THINK_START, THINK_END]


def segment_ids(input_ids: list[int], loss_mask: list[int], think_start: int, think_end: int) -> list[int]:
    """Per-token segment of an assistant turn: 0 prompt (loss_mask 0), 1 reasoning (inside <think>..</think>,
    wrappers included), 2 answer (after </think>). Used for reasoning-vs-answer breakdowns."""
    out: list[int] = []
    inside = False
    for tok, m in zip(input_ids, loss_mask):
        if not m:
            out.append(0)
            inside = False
            continue
        if tok == think_start:
            inside = True
            out.append(1)
        elif tok == think_end:
            inside = False
            out.append(1)
        else:
            out.append(1 if inside else 2)
    return out
