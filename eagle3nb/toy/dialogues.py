"""Generated reasoning dialogues for the toy target: arithmetic, counting, string operations, unit conversions.

Each problem has a canonical key (e.g. ``unit:km:m:47``); a hash of the key puts it in the train or the held-out
split, so the two prompt sets never share a question. The tasks are easy for a tiny model (one-digit sums, a
word's length, its first or last letter, power-of-ten unit facts) and the reasoning is a short, regular chain of
thought whose last sentence is the answer, so the target's outputs are structured, mostly correct and predictable
enough for a draft to learn.
"""

from __future__ import annotations

import hashlib
import random
import re

CATEGORIES = ["arithmetic", "counting", "string", "units"]
HELDOUT_PERCENT = 10

WORDS = (
    "apple banana cat dog house river green table chair water light music paper stone cloud bread horse tiger "
    "lemon plant train smile dream ocean pencil garden window rabbit orange planet forest candle rocket silver "
    "bottle button castle dragon flower guitar island jacket kitten ladder magnet needle parrot puzzle summer "
    "winter yellow zebra moon star fish bird tree book lamp door ring frog kite nest leaf sand snow rain wind fire "
    "bag bed box bus cup egg fan hat jam key map net owl pen pig pot rug sun toy van web yak ant bee cow fox hen "
    "bell boat cake coat desk drum duck farm gate goat hill jar king lake lion milk nose pear road rock rose salt "
    "ship shoe sock soup tent town wall wolf yarn bench brush chalk clock crown grape heart juice knife mouse "
    "peach plate queen sheep shirt spoon storm sugar tooth truck whale wheel"
).split()

# (from, to, factor): fixed power-of-ten facts, so a conversion is a copy of the number plus some zeros
UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("cm", "mm", 10), ("m", "mm", 1000)]

ADD_QUESTIONS = ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "What is the sum of {a} and {b}?"]
LEN_QUESTIONS = ["How many letters are in the word {w}?", "Count the letters in {w}.", "How long is the word {w}?"]
LETTER_QUESTIONS = {"first": ["What is the first letter of {w}?", "Which letter does {w} start with?"],
                    "last": ["What is the last letter of {w}?", "Which letter does {w} end with?"]}
# The reasoning ends with the answer sentence, so the reply copies it token for token.
ANSWER = "The answer is {}."
UNIT_QUESTIONS = ["Convert {n} {u} to {v}.", "How many {v} are in {n} {u}?"]

# Every fixed phrase the generator writes, so the tokenizer can hold each word as one piece.
PHRASES = (
    ADD_QUESTIONS + LEN_QUESTIONS + LETTER_QUESTIONS["first"] + LETTER_QUESTIONS["last"] + UNIT_QUESTIONS + [ANSWER]
    + ["Spell it", "The first last letter of the word is", "user assistant system tool"]
)


def words_for_vocab() -> list[str]:
    """The words of the generator's fixed phrases and units, for the tokenizer's word pieces. The WORDS that
    questions spell stay out: they tokenize mostly letter by letter (a few start with a phrase piece such as
    " to"), so those tasks are copying, which a small model learns fast, rather than memorising spellings."""
    text = " ".join(re.sub(r"\{\w+\}", " ", p) for p in PHRASES)
    text += " " + " ".join(f"{u} {v}" for u, v, _ in UNITS)
    return sorted(set(re.findall(r"[A-Za-z]+", text)) - set(WORDS))


def split_of(key: str) -> str:
    """'heldout' for about HELDOUT_PERCENT% of problem keys, else 'train' (stable across runs and machines)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _addition(rng: random.Random) -> tuple[str, str, str, str]:
    """One-digit sums. There are only 100 facts, so the split is by question: a held-out question asks a fact
    that training asked in other words (a model cannot know a sum it never saw)."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    q = rng.choice(ADD_QUESTIONS).format(a=a, b=b)
    return f"add:{q}", q, f"Add: {a} + {b} = {a + b}. {ANSWER.format(a + b)}", ANSWER.format(a + b)


def _counting(rng: random.Random) -> tuple[str, str, str, str]:
    w = rng.choice(WORDS)
    q = rng.choice(LEN_QUESTIONS).format(w=w)
    spelled = ", ".join(f"{c} {i + 1}" for i, c in enumerate(w))
    return f"len:{w}", q, f"Spell it: {spelled}. {ANSWER.format(len(w))}", ANSWER.format(len(w))


def _string(rng: random.Random) -> tuple[str, str, str, str]:
    w = rng.choice(WORDS)
    end = rng.choice(["first", "last"])
    q = rng.choice(LETTER_QUESTIONS[end]).format(w=w)
    c = w[0] if end == "first" else w[-1]
    return f"{end}:{w}", q, f"The {end} letter of the word is {c}. {ANSWER.format(c)}", ANSWER.format(c)


def _units(rng: random.Random) -> tuple[str, str, str, str]:
    u, v, f = rng.choice(UNITS)
    n = rng.randint(1, 99)
    q = rng.choice(UNIT_QUESTIONS).format(n=n, u=u, v=v)
    answer = ANSWER.format(f"{n * f} {v}")
    return f"unit:{u}:{v}:{n}", q, f"1 {u} is {f} {v}. {n} * {f} = {n * f}. {answer}", answer


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
