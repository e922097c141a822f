"""For the 02 and 03 tests: real 02 output (toy dialogues as 01-style samples, through 02's extraction), 03 run
in a child process that is killed -9 at a checkpoint, and a server killed -9 once a run is under way."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from worlds import THREADS


def make_records(root: Path, model_dir: Path, n: int = 48, seed: int = 0) -> Path:
    """``root/01``: 01-style records of ``n`` toy dialogues rendered with the toy's chat template."""
    from transformers import AutoTokenizer

    from eagle3nb.toy import dialogues

    synth = root / "01"
    synth.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        d = dialogues.dialogue(rng, "train")
        kw = {"thinking": d["thinking"]}
        reply = {"role": "assistant", "content": d["answer"],
                 "reasoning_content": d["reasoning"] if d["thinking"] else ""}
        prompt = tok.apply_chat_template(d["messages"], tokenize=False, add_generation_prompt=True, **kw)
        full = tok.apply_chat_template(d["messages"] + [reply], tokenize=False, **kw)
        ids = tok.encode(full, add_special_tokens=False)
        prompt_len = len(tok.encode(prompt, add_special_tokens=False))
        rows.append({"id": f"toy-{k:03d}", "status": "ok", "messages": d["messages"], "input_ids": ids,
                     "loss_mask": [0] * prompt_len + [1] * (len(ids) - prompt_len), "category": None,
                     "thinking": d["thinking"]})
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return synth


def make_hidden_states(root: Path, model_dir: Path, n: int = 48, draft_vocab_size: int = 160, seed: int = 0) -> Path:
    """``root/02`` (stage 02's output over ``n`` toy dialogues rendered with the toy's chat template)."""
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict

    synth = make_records(root, model_dir, n, seed)
    P = from_dict("02_hidden_states", {"synth_dir": str(synth), "model_path": str(model_dir),
                                       "output_dir": str(root / "02"), "draft_vocab_size": draft_vocab_size,
                                       "storage": "fp32", "run_name": "test"})
    extract(P)
    return root / "02"



def child_env() -> dict[str, str]:
    """A child 03 process: the fixtures' thread count (1 unless tools/variations.py says otherwise: a resumed run
    repeats the in-process reference bit for bit only at the same count), this checkout on its path."""
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(Path(__file__).parents[1])}


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, step: int) -> None:
    """Return once checkpoint ``step`` (or a later one) exists in ``out``, while 03's process ``proc`` still runs."""
    from eagle3nb.train.checkpoint import checkpoints

    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        done = checkpoints(out / "checkpoints")
        if done and int(done[-1].stem.split("-")[1]) >= step:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"


def kill_after(folder: Path, out: Path, step: int) -> int:
    """Start ``python -m eagle3nb.train folder`` and kill -9 it once checkpoint ``step`` exists in ``out``;
    returns the last checkpoint's step."""
    from eagle3nb.train.checkpoint import checkpoints

    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.train", str(folder)], env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_checkpoint(proc, out, step)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return int(checkpoints(out / "checkpoints")[-1].stem.split("-")[1])


def kill_when(path_glob: tuple[Path, str], handle) -> threading.Thread:
    """kill -9 the server ``handle`` once a file matching ``path_glob`` appears (the run is under way)."""
    folder, pattern = path_glob

    def watch() -> None:
        deadline = time.time() + 120
        while not list(folder.glob(pattern)) and time.time() < deadline:
            time.sleep(0.005)
        handle.proc.kill()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t
