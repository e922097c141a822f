"""MT-Bench-shaped conversations and the per-turn checks 01's ``multi_turn: every`` runs against any server (the
embedded one in tests/test_multiturn.py, the real vLLM in tests/test_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

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
