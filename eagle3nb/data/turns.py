"""Conversations answered turn by turn (01's ``multi_turn: every``): where the target speaks, what each turn sends,
and how a turn's record is named.

A dataset conversation is cut at every point where the assistant speaks next: where the dataset has an assistant
message, between two user messages with no answer between them (MT-Bench's turns), and at the end. The dataset's
own assistant messages are dropped there (the target writes its own); everything else (system, user, tool
results) is replayed as the dataset has it. Turn ``k``'s request is the earlier turns' inputs each followed by
the target's own answer to it, then turn ``k``'s inputs.

One record per turn, named ``<conversation id>/turn-<k>`` (k from 1): the stream the engine sees at turn ``k``
is the template's rendering of the conversation so far, which is not a prefix of turn ``k+1``'s (Kimi's and
Qwen3's templates drop earlier turns' reasoning, gpt-oss its earlier analysis channels), so no single stream
with per-turn masks could hold both exactly.
"""

from __future__ import annotations

import json
import re
from typing import Any

from eagle3nb.data.reasoning import field

TURN_RE = re.compile(r"^(?P<conv>.+)/turn-(?P<k>[1-9][0-9]*)$")
SPEAKS_AFTER = ("user", "tool")  # the assistant answers these


def turn_id(conversation: str, k: int) -> str:
    return f"{conversation}/turn-{k}"


def parse_turn(sample_id: str) -> tuple[str, int] | None:
    """(conversation id, turn number) of a per-turn record's id; None for a one-record conversation's id."""
    m = TURN_RE.match(str(sample_id))
    return (m["conv"], int(m["k"])) if m else None


def conversation_of(sample_id: str) -> str:
    """The conversation a sample belongs to (its own id when it is not a per-turn record)."""
    parsed = parse_turn(sample_id)
    return parsed[0] if parsed else str(sample_id)


def turn_inputs(conversation: list[dict]) -> list[list[dict]]:
    """The messages each target turn answers, in order (the dataset's assistant messages left out): a turn ends
    before an assistant message and before a user message that follows an unanswered one (MT-Bench's turns);
    trailing messages with no user or tool message among them (a closing system message) answer nothing."""
    turns: list[list[dict]] = []
    pending: list[dict] = []

    def speaks() -> bool:
        return any(m["role"] in SPEAKS_AFTER for m in pending)

    for m in conversation:
        if m["role"] == "assistant" or (m["role"] == "user" and speaks()):
            if speaks():
                turns.append(pending)
                pending = []
            if m["role"] == "assistant":
                continue
        pending.append(m)
    if speaks():
        turns.append(pending)
    return turns


def answer_message(reasoning: str | None, content: str | None, tool_calls: list[dict] | None) -> dict[str, Any]:
    """The target's answer as the next turn sends it back: vLLM reads ``reasoning`` (and hands the template both
    it and ``reasoning_content``), so both are set; the template decides what of it history keeps."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        msg["reasoning"] = msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def calls_of(message: Any) -> list[dict] | None:
    """The tool calls of a response's message as plain dicts, arguments as the target generated them."""
    calls = field(message, "tool_calls")
    if not calls:
        return None
    return [c.model_dump(exclude_none=True) if hasattr(c, "model_dump") else dict(c) for c in calls]


def replay(inputs: list[dict], calls: list[dict] | None) -> list[dict] | None:
    """Turn inputs with the dataset's tool results answering the target's own calls: the i-th result takes the
    i-th call's id (the dataset's ids name calls the target never made), its content as the dataset has it.
    None when the dataset replays tool results the target did not ask for (the conversation stops there)."""
    results = [m for m in inputs if m["role"] == "tool"]
    if not results:
        return inputs
    if not calls or len(calls) != len(results):
        return None
    ids = iter(c.get("id") for c in calls)
    return [{**m, "tool_call_id": next(ids)} if m["role"] == "tool" else m for m in inputs]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as an engine hands them to the chat template: an assistant tool call's ``arguments`` JSON string
    parsed into an object (vLLM does this before rendering; templates index the arguments)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"] else {}
                    except ValueError:
                        fn["arguments"] = {}
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
