"""Where the reasoning is in an OpenAI-compatible response (docs/DESIGN-FACTS.md "Reasoning in server responses").

vLLM with a reasoning parser puts it in ``message.reasoning`` (older vLLM and SGLang: ``reasoning_content``);
the openai client keeps such unknown fields as attributes and in ``model_extra``. Without a parser the
reasoning stays inline in ``content`` between the family's think markers (``eagle3nb.families``). The story read
the wrong field; we read all three.
"""

from __future__ import annotations

from typing import Any

from eagle3nb.families import Family, think_tag_pairs

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


def split_inline(content: str | None, tags: tuple[str, str] | None = None) -> tuple[str | None, str | None]:
    """Split ``<start>r<end>c`` inline text into (r, c) at the family's think ``tags`` (None: any registered
    family's); (None, content) when no closing tag is present. Text is kept byte-exact: the training stream is
    rebuilt from it."""
    for start, end in ([tags] if tags else think_tag_pairs()):
        if content is None or end not in content:
            continue
        head, _, answer = content.partition(end)
        at = head.find(start)
        reasoning = head[at + len(start):] if at >= 0 else head
        return reasoning, answer
    return None, content


def extract(message: Any, tags: tuple[str, str] | None = None) -> tuple[str | None, str | None, str]:
    """(reasoning, content, source) from a chat message; source is the field the reasoning came from:
    ``reasoning`` | ``reasoning_content`` | ``inline`` (between the think ``tags``, None: any family's) |
    ``none``. Empty reasoning counts as none."""
    content = field(message, "content")
    for name in REASONING_FIELDS:
        value = field(message, name)
        if value:
            return value, content, name
    reasoning, answer = split_inline(content, tags)
    if reasoning:
        return reasoning, answer, "inline"
    return None, answer, "none"


def no_reasoning_fix(n: int, family: Family, kwarg: str | None) -> str:
    """What to do when thinking is on but the first ``n`` answers came back without reasoning, for the family."""
    switch = (f"check that `{kwarg}` is the template kwarg your model reads (the thinking_kwarg parameter; "
              f"docs/families.md)" if kwarg else f"the {family.name} family's template has no thinking switch")
    return (f"thinking is on but the first {n} responses came back without reasoning: the server is not splitting "
            f"it out, so the training data would lose it (the story's bug). Fix the server: start vLLM with "
            f"{family.parser_flag('vllm')} or SGLang with {family.parser_flag('sglang')} (the {family.name} "
            f"family's parser); {switch}; or set thinking: false if the model should not reason. Look at the probe "
            f"cell's output.")
