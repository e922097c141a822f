"""Worlds built in one idle-priority subprocess as the session starts, on the core the one-process suite leaves idle.

`make test` runs in one process (two workers run out of memory, docs/testing.md), which keeps two cores about 141%
busy: one-thread trainings and waits on servers leave the second core idle. A world that needs nothing of the
session (a family's toy built from its recipe, a family's trained run, the papermill smoke run, 05's weak draft,
the smoke selection) is registered here under the name of the fixture that returns it (``register``), and the
``background`` session fixture (tests/conftest.py) hands this script the registered worlds the session's tests use,
in the order of their first users. The runner builds them one after another in Linux's SCHED_IDLE class: they get
only the CPU time no other process wants, so the tests beside them run about as fast as alone (measured on
tests/test_dflash.py beside the smoke run: 100 s alone, 104 s beside it at SCHED_IDLE, 133 s beside it at nice 10).
A fixture's ``result`` then finds its world built, or waits for it (and the runner has the idle core to itself). A
job that failed there is built again in the fixture's own process, so its error is raised where it always was.

    python tests/background.py FOLDER JOBS_JSON   # the runner (the fixture starts it)
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# job name (the fixture that returns it) -> (the builder's name in this module, its keyword arguments)
JOBS: dict[str, tuple[str, dict]] = {}


def register(name: str, builder: str, **kw: object) -> None:
    """Build fixture ``name``'s world with ``builder(out, **kw)`` in the background when the session has a test that
    uses that fixture."""
    JOBS[name] = (builder, kw)


# -- the builders: each takes the folder it may write in, returns what the fixture returns (pickled across) --------

def toy(out: Path, spec: str) -> Path:
    """A toy built from its recipe into the shared cache (``eagle3nb.toy.build`` locks it against a second builder)."""
    from eagle3nb.toy import resolve_model_path

    return resolve_model_path(spec)


def trained_run(out: Path, spec: str, threads: int, seed: int, **train03: object) -> dict:
    """01 from an embedded server on toy ``spec``, 02, 03 with ``train03`` (tests/worlds.py's build_trained_run), at
    ``threads`` torch threads throughout: ``{"run", "out", "stages"}``."""
    import torch

    from eagle3nb.launch import start_server
    from eagle3nb.toy import resolve_model_path

    from worlds import build_trained_run

    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = resolve_model_path(spec)
        with start_server(model) as server:
            return build_trained_run(out, model, server.url, seed=seed, **train03)
    finally:
        torch.set_num_threads(n)


def refresh_weak(out: Path, threads: int, seed: int) -> dict:
    """A trained run on the smoke toy's dialogues without arithmetic (weak at math, good at the rest), for 05:
    ``{"run", "out", "stages", "draft", "synth"}``."""
    from eagle3nb.data.prompts import load_prompts

    rows = [r for r in load_prompts("toy:train", 200) if r["category"] != "arithmetic"][:32]
    prompts = out / "no-arithmetic.jsonl"
    prompts.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"], "category": r["category"]})
                               + "\n" for r in rows))
    world = trained_run(out, "toy:smoke", threads, seed, synth01={"prompts": prompts})
    return {**world, "draft": out / "03_train" / "draft", "synth": out / "01_synth"}


def smoke_run(out: Path) -> dict:
    """``eagle3nb run params/smoke`` with its output root in ``out``: ``{"proc", "root"}``."""
    proc = subprocess.run([sys.executable, "-m", "eagle3nb", "run", str(ROOT / "params" / "smoke"), "--output-root",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    return {"proc": proc, "root": out}


def smoke_selection(out: Path) -> dict:
    """06 on the smoke toy's embedded engine, started as ``python -m eagle3nb.select`` over three candidates (two
    EAGLE k sharing one training, a causal DFlash block of 8) on a cheap budget, killed -9 (its whole process group)
    once its first (candidate, concurrency) cell lands, then resumed by ``eagle3nb run --stages 06`` (the notebook,
    through papermill): ``{"out", "first", "bytes", "log", "metrics", "root"}``."""
    import yaml

    from eagle3nb.drafts import DEFAULT, block_methods
    from eagle3nb.toy import shipped

    from train_data import make_records
    from worlds import THREADS

    synth = make_records(out, shipped("smoke"), n=48)
    params = out / "params" / "smoke-select"
    params.mkdir(parents=True)
    (params / "06_select.yaml").write_text(yaml.safe_dump({
        "run_name": params.name, "model_path": "toy:smoke", "synth_dir": str(synth), "steps": 30,
        "train": {"batch_tokens": 2048, "max_length": 512, "eval_every": 0, "lr": 5e-3},
        "hidden": {"max_length": 512}, "concurrencies": [1, 4], "num_prompts": 8, "tau_requests": 4, "max_tokens": 32,
        "candidates": [{"name": "chain k3", "method": DEFAULT, "num_speculative_tokens": 3, "ttt_steps": 3},
                       {"name": "chain k5", "method": DEFAULT, "num_speculative_tokens": 5, "ttt_steps": 3},
                       {"name": "block 8", "method": block_methods()[0], "num_speculative_tokens": 7,
                        "block_size": 8, "block_causal": True}]}))
    env = {**os.environ, "EAGLE3NB_OUTPUTS": str(out / "outputs"), "OMP_NUM_THREADS": str(THREADS)}
    select = out / "outputs" / "smoke-select" / "06_select"
    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.select", str(params)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 1800
        while not list(select.glob("serve/*/c*.json")):
            assert proc.poll() is None, f"06 exited ({proc.returncode}) before a cell landed"
            assert time.monotonic() < deadline, "no cell landed in 1800 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = next(iter(select.glob("serve/*/c*.json")))
    landed = first.read_bytes()
    done = subprocess.run([sys.executable, "-m", "eagle3nb", "run", str(params), "--stages", "06", "--output-root",
                           str(out / "outputs")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"out": select, "first": first, "bytes": landed, "log": (select.parent / "06_select.ipynb").read_text(),
            "root": out, "metrics": json.loads((select / "metrics.json").read_text())}


# -- the session's side ----------------------------------------------------------------------------------------------

class Background:
    """The runner of one session: ``result(name, folder)`` waits for a job and returns its value."""

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names, self.proc = folder, names, None
        if names:
            folder.mkdir(parents=True, exist_ok=True)
            jobs = [[name, *JOBS[name]] for name in names]
            with open(folder / "runner.log", "w") as log:
                self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(folder), json.dumps(jobs)],
                                             cwd=ROOT, start_new_session=True, stdout=log, stderr=log)

    def result(self, name: str, folder: Path) -> object:
        """Job ``name``'s value once built; built here in ``folder`` instead if it was not started in the
        background, failed there (its error is then raised here), or its runner died."""
        if name in self.names:
            done, failed = self.folder / f"{name}.pkl", self.folder / f"{name}.failed"
            while not done.exists() and not failed.exists() and self.proc.poll() is None:
                time.sleep(0.2)
            if done.exists():
                return pickle.loads(done.read_bytes())
        return build(name, *JOBS[name], folder)

    def close(self) -> None:
        """Stop the runner and whatever it started (only still running when the session ended first)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        if self.proc is not None:
            self.proc.wait()


def build(name: str, builder: str, kw: dict, folder: Path) -> object:
    """One job: its builder with the keyword arguments registered for it, writing under ``folder/<name>``."""
    out = folder / name.replace(":", "-")
    out.mkdir(parents=True, exist_ok=True)
    return globals()[builder](out, **kw)


def main(folder: Path, jobs: list[list]) -> None:
    """Build each job in order on idle CPU time only (SCHED_IDLE, inherited by every process a job starts):
    ``<name>.pkl`` (written whole, then renamed) when it is built, ``<name>.failed`` with the traceback when not."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    for name, builder, kw in jobs:
        try:
            value = build(name, builder, kw, folder)
        except BaseException:
            (folder / f"{name}.failed").write_text(traceback.format_exc())
            continue
        part = folder / f"{name}.pkl.part"
        part.write_bytes(pickle.dumps(value))
        part.rename(folder / f"{name}.pkl")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
