"""Where 01 resumes: the latest record per id already in the output folder, and per prompt the turns still to ask
(a conversation half done resumes at its next turn, after the target's own earlier answers) or why it stops."""

from __future__ import annotations

from pathlib import Path

from eagle3nb.data.samples import latest
from eagle3nb.data.turns import answer_message, replay, turn_id, turn_inputs

DONE_STATUSES = ("ok", "truncated")  # never requested again; error / no_reasoning are, with retry_errors


def needs_request(last: dict | None, retry_errors: bool) -> bool:
    if last is None:
        return True
    return last["status"] not in DONE_STATUSES and retry_errors


CUT_NOT_OK = "an earlier turn is not ok"
CUT_NO_CALL = "the dataset replays tool results the target did not call for"


def plan_conversation(item: dict, every: bool, done: dict[str, dict], retry_errors: bool) -> tuple[dict | None,
                                                                                                     str | None, int]:
    """(the job still to ask or None, why the conversation stops early or None, turns it loses) for one prompt.
    A job is ``{"item", "inputs", "start", "history", "calls"}``: ask turns ``start..`` of ``inputs``, the first
    after ``history`` (the earlier turns, each followed by the target's answer from ``done``); ``calls`` are the
    target's tool calls of the turn before ``start``."""
    if not every:
        job = {"item": item, "inputs": [item["messages"]], "start": 1, "history": [], "calls": None}
        return (job if needs_request(done.get(item["id"]), retry_errors) else None), None, 0
    inputs = turn_inputs(item["conversation"])
    history: list[dict] = []
    calls = None
    for k in range(1, len(inputs) + 1):
        new = replay(inputs[k - 1], calls)
        if new is None:
            return None, CUT_NO_CALL, len(inputs) - k + 1
        rec = done.get(turn_id(item["id"], k))
        if needs_request(rec, retry_errors):
            return {"item": item, "inputs": inputs, "start": k, "history": history, "calls": calls}, None, 0
        if rec["status"] != "ok":
            return None, CUT_NOT_OK, len(inputs) - k
        calls = rec.get("tool_calls")
        history = [*history, *new, answer_message(rec["reasoning"], rec["content"], calls)]
    return None, None, 0


def planned_ids(item: dict, every: bool) -> list[str]:
    return [turn_id(item["id"], k) for k in range(1, len(turn_inputs(item["conversation"])) + 1)] if every \
        else [item["id"]]


def history_records(stage_dir: Path, every: bool, torn: list[str] | None = None) -> dict[str, dict]:
    """The latest record per id, light; with ``multi_turn: every`` the answers are kept too: a conversation half
    done resumes at its next turn after the target's own earlier answers."""
    if not Path(stage_dir).exists():
        return {}
    if every:
        return latest(stage_dir, torn=torn, drop=("messages", "input_ids", "loss_mask"))
    return latest(stage_dir, light=True, torn=torn)
