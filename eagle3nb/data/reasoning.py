"""Where the reasoning is in an OpenAI-compatible response (docs/DESIGN-FACTS.md "Reasoning in server responses").

vLLM with a reasoning parser puts it in ``message.reasoning`` (older vLLM and SGLang: ``reasoning_content``);
the openai client keeps such unknown fields as attributes and in ``model_extra``. Without a parser the
``<think>...</think>`` text stays inline in ``content``. The story read the wrong field; we read all three.
"""

from __future__ import annotations

from typing import Any

from eagle3nb.tokens import THINK_END, THINK_START

REASONING_FIELDS = ("reasoning", "reasoning_content")


def field(obj: Any, name: str) -> Any:
    """A response field by name: dict key, declared attribute, or pydantic extra (``model_extra``)."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def split_inline(content: str | None) -> tuple[str | None, str | None]:
    """Split ``<think>r</think>c`` inline text into (r, c); (None, content) when no closing tag is present.
    Text is kept byte-exact: the training stream is rebuilt from it."""
    if content is None or THINK_END not in content:
        return None, content
    head, _, answer = content.partition(THINK_END)
    start = head.find(THINK_START)
    reasoning = head[start + len(THINK_START):] if start >= 0 else head
    return reasoning, answer


def extract(message: Any) -> tuple[str | None, str | None, str]:
    """(reasoning, content, source) from a chat message; source is the field the reasoning came from:
    ``reasoning`` | ``reasoning_content`` | ``inline`` | ``none``. Empty reasoning counts as none."""
    content = field(message, "content")
    for name in REASONING_FIELDS:
        value = field(message, name)
        if value:
            return value, content, name
    reasoning, answer = split_inline(content)
    if reasoning:
        return reasoning, answer, "inline"
    return None, answer, "none"


NO_REASONING_FIX = (
    "thinking is on but the first {n} responses came back without reasoning: the server is not splitting it "
    "out, so the training data would lose it (the story's bug). Fix the server, e.g. start vLLM with "
    "`--reasoning-parser kimi_k2` (Kimi; `qwen3` / `deepseek_r1` for those families) or SGLang with "
    "`--reasoning-parser kimi_k2`; check that `{kwarg}` is the template kwarg your model reads (Qwen: "
    "enable_thinking); or set thinking: false if the model should not reason. Look at the probe cell's output."
)
