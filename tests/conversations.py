"""MT-Bench-shaped conversations and the per-turn checks 01's ``multi_turn: every`` runs against any server (the
embedded one in tests/test_multiturn.py, the real vLLM in tests/test_vllm.py), and a tool-calling conversation the
real vLLM answers with forced calls (tests/test_family_qwen3.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from eagle3nb.data.stream import Template
from eagle3nb.data.turns import parse_turn, turn_id

SECOND = "Rewrite your previous response in one short sentence."


def mt_bench(path: Path, n: int) -> Path:
    """Rows in MT-Bench's question.jsonl shape: two user turns, the second about the target's own first answer."""
    rows = [{"question_id": 81 + i, "category": ["writing", "math"][i % 2],
             "turns": [f"What is {i} plus {i + 2}? Show the steps.", SECOND]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_turns(records: list[dict], tpl: Template, n_conversations: int) -> None:
    """Every conversation answered in two turns; each turn's stream is the template's rendering of the
    conversation so far (computed here from the record's messages) and equals the server's ids; turn 2 sends
    turn 1's record as its history."""
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == 2 * n_conversations and {r["status"] for r in records} == {"ok"}
    for r in records:
        conv, k = parse_turn(r["id"])
        assert (r["conversation_id"], r["turn"], r["turns"]) == (conv, k, 2)
        n_prompt = r["loss_mask"].count(0)
        assert r["input_ids"][:n_prompt] == tpl.prompt_ids(r["messages"])  # the stream the engine saw
        assert r["token_source"] == "server" and r["ids_match"] is True
        assert r["loss_mask"] == [0] * n_prompt + [1] * (len(r["input_ids"]) - n_prompt)  # this turn only
        if k == 2:
            first = by_id[turn_id(conv, 1)]
            user1, answer, user2 = r["messages"]
            assert user1 == first["messages"][0] and user2 == {"role": "user", "content": SECOND}
            assert (answer["role"], answer["content"], answer["reasoning"]) == \
                ("assistant", first["content"], first["reasoning"])
            # Turn 1's reasoning is not in what the engine read at turn 2: the template drops it from history.
            assert first["reasoning"] and first["reasoning"] not in tpl.decode(r["input_ids"][:n_prompt])
            assert first["content"] in tpl.decode(r["input_ids"][:n_prompt])


# A tool whose arguments a grammar bounds (integers in a range): what a forced call can be constrained to.
ADD = {"type": "function", "function": {"name": "add", "description": "Add two whole numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
RESULT = "44"  # the dataset's tool result, replayed against whatever call the target makes


def tool_conversation(path: Path) -> Path:
    """One conversation in the OpenAI tools shape, the named tool forced: the dataset's call (id ``d1``), its tool
    result, the dataset's answer and a second question, so three turns (user, tool result, user) are answered."""
    row = {"id": "add", "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}},
           "messages": [{"role": "user", "content": "Add 4 and 40."},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "d1", "type": "function",
                                                                               "function": {"name": "add", "arguments":
                                                                                            '{"a": 4, "b": 40}'}}]},
                        {"role": "tool", "tool_call_id": "d1", "content": RESULT},
                        {"role": "assistant", "content": "44"}, {"role": "user", "content": "Now add 3 to it."}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def check_tool_turns(records: list[dict], tpl: Template, served: Callable[[dict], dict]) -> dict[int, dict]:
    """Every turn of ``tool_conversation`` answered with one call of the forced tool, its arguments the generated
    text itself and within the tool's bounds; the record keeps the server's answer exactly (``served(rec)`` asks
    the server again for the record's messages: greedy, so the same call and ids, up to the call id vLLM draws);
    the next turn sends that call back and replays the dataset's result under its id, and its prompt ids are both
    the server's and our template's rendering. Returns the records by turn."""
    by_turn = {r["turn"]: r for r in records}
    assert sorted(by_turn) == [1, 2, 3] and {r["status"] for r in records} == {"ok"}, [r["status"] for r in records]
    for k, r in by_turn.items():
        (call,) = r["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "add" and set(args) == {"a", "b"}, call
        assert all(isinstance(v, int) and 0 <= v <= 99 for v in args.values()), args
        n_prompt = r["loss_mask"].count(0)
        completion = tpl.decode(r["input_ids"][n_prompt:])
        assert completion.endswith(call["function"]["arguments"] + tpl.end_text), completion  # generated as kept
        assert r["token_source"] == "server" and r["input_ids"][:n_prompt] == tpl.prompt_ids(r["messages"], [ADD])
        again = served(r)
        choice = again["choices"][0]
        assert [{**c, "id": None} for c in choice["message"]["tool_calls"]] == [{**call, "id": None}], (choice, call)
        assert again["prompt_token_ids"] + choice["token_ids"] == r["input_ids"][:n_prompt + len(choice["token_ids"])]
        if k > 1:
            (prev,) = by_turn[k - 1]["tool_calls"]
            new = r["messages"][len(by_turn[k - 1]["messages"]):]
            assert new[0]["role"] == "assistant" and new[0]["tool_calls"] == [prev]
            assert new[1:] == ([{"role": "tool", "tool_call_id": prev["id"], "content": RESULT}] if k == 2 else
                               [{"role": "user", "content": "Now add 3 to it."}])
    return by_turn
