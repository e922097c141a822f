"""Samples on disk: append-only JSON Lines, fsynced in small batches, one file per session.

A kill -9 can only tear the last line of the file being written; a new session never appends to an old
file (it would glue its first line onto a torn one), it opens the next ``samples-NNNNN.jsonl``. Readers
keep the latest record per id, so a retried error is superseded, never duplicated.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from eagle3nb.errors import InputError
from eagle3nb.params import ParamsError
from eagle3nb.progress import one_writer, write_json_atomic

SAMPLES_GLOB = "samples-*.jsonl"
RUN_CONFIG = "run_config.json"
STATUSES = ("ok", "truncated", "no_reasoning", "error")
# Heavy fields left out of the per-id summaries a resume and the metrics need.
HEAVY = ("messages", "reasoning", "content", "input_ids", "loss_mask")


def sample_files(synth_dir: Path) -> list[Path]:
    return sorted(Path(synth_dir).glob(SAMPLES_GLOB))


def read_records(synth_dir: Path, torn: list[str] | None = None) -> Iterator[dict]:
    """Every record in write order. A file's unfinished last line (a kill mid-write) is skipped and
    noted in ``torn``; a bad line anywhere else is corruption and raises."""
    for path in sample_files(synth_dir):
        with open(path, "rb") as f:  # line by line: a session's file can be tens of GB at a million samples
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except ValueError:
                    if not line.endswith(b"\n"):  # the file's unfinished last line
                        if torn is not None:
                            torn.append(f"{path.name} line {n + 1}")
                        continue
                    raise InputError(f"{path} line {n + 1} is not valid JSON (corrupted file); move the file away "
                                     f"and re-run to regenerate its samples") from None


def latest(synth_dir: Path, light: bool = False, torn: list[str] | None = None,
           drop: Iterable[str] = ()) -> dict[str, dict]:
    """The last record of each id; ``light`` drops the heavy fields (resume and metrics need only the rest),
    ``drop`` the fields named (each record as it is read, so a million samples' texts are never held at once)."""
    out: dict[str, dict] = {}
    gone = {*HEAVY, *drop} if light else set(drop)
    for rec in read_records(synth_dir, torn):
        if gone:
            rec = {k: v for k, v in rec.items() if k not in gone}
        out[rec["id"]] = rec
    return out


def load_samples(synth_dir: str | Path, statuses: Iterable[str] | None = ("ok",)) -> list[dict]:
    """01_synth's samples (latest record per id) whose status is in ``statuses`` (None = all)."""
    synth_dir = Path(synth_dir)
    if not sample_files(synth_dir):
        raise FileNotFoundError(f"no {SAMPLES_GLOB} in {synth_dir}: run notebooks/01_synth.ipynb first "
                                f"(or point the synth_dir parameter at its output_dir)")
    keep = None if statuses is None else set(statuses)
    return [r for r in latest(synth_dir).values() if keep is None or r["status"] in keep]


class SampleWriter:
    """Appends records to this session's own file; ``write`` returns after the batch is on disk."""

    def __init__(self, synth_dir: Path):
        synth_dir.mkdir(parents=True, exist_ok=True)
        files = sample_files(synth_dir)
        n = int(files[-1].stem.split("-")[-1]) + 1 if files else 0
        self.path = synth_dir / f"samples-{n:05d}.jsonl"
        self._f = open(self.path, "x")
        self.written = 0

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self._f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.written += len(records)

    def close(self) -> None:
        self._f.close()
        if self.written == 0:
            self.path.unlink(missing_ok=True)


def exclusive(synth_dir: Path) -> contextlib.AbstractContextManager:
    """One writer per output folder: a second run (a notebook opened twice) would ask for the same ids."""
    return one_writer(synth_dir, "01_synth")


def check_run_config(synth_dir: Path, config: dict[str, Any], force: bool, write: bool = True) -> None:
    """Refuse to mix data made with different settings into one output_dir; record the settings."""
    path = Path(synth_dir) / RUN_CONFIG
    old = json.loads(path.read_text()) if path.exists() else None
    history = []
    if old is not None:
        changed = {k: (old.get(k), v) for k, v in config.items() if old.get(k) != v}
        history = old.get("forced_changes", [])
        if changed and sample_files(synth_dir):
            lines = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            if not force:
                raise ParamsError(
                    f"{synth_dir} holds samples made with other settings ({lines}); resuming would mix two "
                    f"datasets. Use a new output_dir (or run_name), put the old values back, or set force: true "
                    f"to mix them on purpose")
            history = [*history, {"time": time.time(), "changed": {k: list(v) for k, v in changed.items()}}]
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**config, "forced_changes": history})
