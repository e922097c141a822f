"""Generated reasoning dialogues for the toy target: arithmetic, counting, string operations, unit conversions.

Each problem has a canonical key (e.g. ``add:47:38``); a hash of the key puts it in the train or the held-out
split, so the two prompt sets never share a question. Reasoning is a short, regular chain of thought (column
addition, letter-by-letter spelling, one multiplication), which makes the target's outputs structured,
mostly correct and predictable enough for a draft to learn.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

CATEGORIES = ["arithmetic", "counting", "string", "units"]
HELDOUT_PERCENT = 10

WORDS = (
    "apple banana cat dog house river green table chair water light music paper stone cloud bread horse tiger "
    "lemon plant train smile dream ocean pencil garden window rabbit orange planet forest candle rocket silver "
    "bottle button castle dragon flower guitar island jacket kitten ladder magnet needle parrot puzzle summer "
    "winter yellow zebra moon star fish bird tree book lamp door ring frog kite nest leaf sand snow rain wind fire"
).split()

# (from, to, factor, largest n)
UNITS = [("km", "m", 1000, 99), ("m", "cm", 100, 99), ("kg", "g", 1000, 99), ("cm", "mm", 10, 99),
         ("h", "min", 60, 12), ("min", "s", 60, 12)]

ADD_QUESTIONS = ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]
LEN_QUESTIONS = ["How many letters are in the word {w}?", "Count the letters in {w}."]
COUNT_QUESTIONS = ["How many times does the letter {c} appear in {w}?"]
REV_QUESTIONS = ["Reverse the word {w}.", "Write {w} backwards."]
UPPER_QUESTIONS = ["Write {w} in capitals."]
UNIT_QUESTIONS = ["Convert {n} {u} to {v}.", "How many {v} are in {n} {u}?"]
PLACES = ["Units", "Tens", "Hundreds"]

# Every fixed phrase the generator writes, so the tokenizer can hold each word as one piece.
PHRASES = (
    ADD_QUESTIONS + LEN_QUESTIONS + COUNT_QUESTIONS + REV_QUESTIONS + UPPER_QUESTIONS + UNIT_QUESTIONS + PLACES
    + ["write carry So is", "Spell it", "The word has letters", "yes no appears times", "Letters Backwards Joined",
       "to In capitals", "user assistant system tool"]
)


def words_for_vocab() -> list[str]:
    """The words of the generator's fixed phrases and units, for the tokenizer's word pieces. The WORDS that
    questions spell, reverse or count stay out: they tokenize letter by letter, so those tasks are copying,
    which a small model learns fast, rather than memorising every word's spelling."""
    text = " ".join(re.sub(r"\{\w+\}", " ", p) for p in PHRASES)
    text += " " + " ".join(f"{u} {v}" for u, v, _, _ in UNITS)
    return sorted(set(re.findall(r"[A-Za-z]+", text)) - set(WORDS))


def split_of(key: str) -> str:
    """'heldout' for about HELDOUT_PERCENT% of problem keys, else 'train' (stable across runs and machines)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _addition(rng: random.Random) -> tuple[str, str, str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    s = a + b
    steps, carry = [], 0
    for i, place in enumerate(PLACES[:2]):
        da, db = (a // 10**i) % 10, (b // 10**i) % 10
        total = da + db + carry
        terms = f"{da} + {db}" + (f" + {carry}" if carry else "")
        carry = total // 10
        steps.append(f"{place}: {terms} = {total}, write {total % 10}" + (f" carry {carry}." if carry else "."))
    if carry:
        steps.append(f"Hundreds: write {carry}.")
    q = rng.choice(ADD_QUESTIONS).format(a=a, b=b)
    reasoning = " ".join(steps) + f" So {a} + {b} = {s}."
    return f"add:{a}:{b}", q, reasoning, f"{a} + {b} = {s}."


def _counting(rng: random.Random) -> tuple[str, str, str, str]:
    w = rng.choice(WORDS)
    if rng.random() < 0.5:
        q = rng.choice(LEN_QUESTIONS).format(w=w)
        spelled = ", ".join(f"{c} {i + 1}" for i, c in enumerate(w))
        return f"len:{w}", q, f"Spell it: {spelled}. The word has {len(w)} letters.", f"{w} has {len(w)} letters."
    c = rng.choice(sorted(set(w)) + ["e", "o", "a"])
    q = COUNT_QUESTIONS[0].format(c=c, w=w)
    n, marks = 0, []
    for x in w:
        if x == c:
            n += 1
            marks.append(f"{x} yes {n}")
        else:
            marks.append(f"{x} no")
    return f"count:{w}:{c}", q, f"Spell it: {', '.join(marks)}. So {c} appears {n} times.", f"{c} appears {n} times in {w}."


def _string(rng: random.Random) -> tuple[str, str, str, str]:
    w = rng.choice(WORDS)
    if rng.random() < 0.5:
        q = rng.choice(REV_QUESTIONS).format(w=w)
        r = w[::-1]
        return f"rev:{w}", q, f"Letters: {' '.join(w)}. Backwards: {' '.join(r)}. Joined: {r}.", f"{w} backwards is {r}."
    q = UPPER_QUESTIONS[0].format(w=w)
    steps = ", ".join(f"{c} to {c.upper()}" for c in w)
    return f"upper:{w}", q, f"{steps}. So {w.upper()}.", f"In capitals: {w.upper()}."


def _units(rng: random.Random) -> tuple[str, str, str, str]:
    u, v, f, top = rng.choice(UNITS)
    n = rng.randint(1, top)
    q = rng.choice(UNIT_QUESTIONS).format(n=n, u=u, v=v)
    reasoning = f"1 {u} is {f} {v}. So {n} {u} is {n} * {f} = {n * f} {v}."
    return f"unit:{u}:{v}:{n}", q, reasoning, f"{n} {u} is {n * f} {v}."


MAKERS = {"arithmetic": _addition, "counting": _counting, "string": _string, "units": _units}


def problem(rng: random.Random, split: str) -> dict:
    """One problem from ``split``: key, category, question, reasoning, answer (resampled until in the split)."""
    category = rng.choice(CATEGORIES)
    while True:
        key, q, reasoning, answer = MAKERS[category](rng)
        if split_of(key) == split:
            return {"key": key, "category": category, "question": q, "reasoning": reasoning, "answer": answer}


def dialogue(rng: random.Random, split: str = "train", p_think: float = 0.8, p_multi: float = 0.1) -> dict:
    """A conversation to train on: ``messages`` (the prompt, maybe with one earlier exchange whose reasoning
    the template drops), the final turn's ``reasoning``/``answer``, and whether ``thinking`` is on."""
    p = problem(rng, split)
    messages = []
    if rng.random() < p_multi:
        h = problem(rng, split)
        messages += [{"role": "user", "content": h["question"]}, {"role": "assistant", "content": h["answer"]}]
    messages.append({"role": "user", "content": p["question"]})
    return {**p, "messages": messages, "thinking": rng.random() < p_think}


def write_prompts(path: str | Path, n: int, split: str = "train", seed: int = 0) -> Path:
    """Write ``n`` distinct prompts of ``split`` as JSONL rows ``{"id", "messages", "category"}`` (01_synth's
    prompt format). Train and held-out rows never share a problem."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    path = Path(path)
    rng = random.Random(f"prompts:{split}:{seed}")
    rows, seen = [], set()
    for _ in range(n * 50):
        if len(rows) == n:
            break
        p = problem(rng, split)
        if p["question"] in seen:
            continue
        seen.add(p["question"])
        rows.append({"id": f"toy-{split}-{seed}-{len(rows):06d}",
                     "messages": [{"role": "user", "content": p["question"]}], "category": p["category"]})
    if len(rows) < n:
        raise ValueError(f"the toy generator has only {len(rows)} distinct {split} prompts; ask for n <= {len(rows)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path
