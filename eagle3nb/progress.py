"""Progress of a long stage: a small JSON file ``eagle3nb status`` reads, plus periodic printed lines.

Under papermill a tqdm widget is only a snapshot, so ``Progress.update`` also prints a metric line every
``print_every_s`` seconds; in JupyterLab the tqdm.auto bar is live.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from eagle3nb.errors import UserError

PROGRESS_FILE = "progress.json"
LOCK_FILE = ".lock"


class FolderLocked(UserError):
    """Another live run writes to this output folder."""


@contextlib.contextmanager
def one_writer(folder: Path, stage: str) -> Iterator[None]:
    """One writer per output folder (``flock`` on ``<folder>/.lock``, which holds the writer's pid): a second
    run of the stage on the same folder (a notebook opened twice, a command run again) is refused naming the
    first one's pid. The lock dies with its process, kill -9 included, so a resume never waits for a dead run."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise FolderLocked(f"another {stage} run (pid {f.read().strip() or '?'}) is writing to {folder}; let it "
                               f"finish or stop it, or use another output_dir") from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and rename, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_progress(stage_dir: Path) -> dict[str, Any] | None:
    """The last progress a stage recorded, or None."""
    p = Path(stage_dir) / PROGRESS_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


class Progress:
    """Track done/total for a stage; writes ``<stage_dir>/progress.json`` and prints periodic lines."""

    def __init__(self, stage_dir: Path, total: int, desc: str, unit: str = "it", done: int = 0,
                 print_every_s: float = 30.0, write_every_s: float = 2.0):
        self.path = Path(stage_dir) / PROGRESS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total, self.done, self.desc, self.unit = total, done, desc, unit
        self.metrics: dict[str, Any] = {}
        self.t0 = time.time()
        self._start_done = done
        self._last_print = self._last_write = 0.0
        self.print_every_s, self.write_every_s = print_every_s, write_every_s
        self.bar = tqdm(total=total, initial=done, desc=desc, unit=unit)
        self._write(force=True)

    def update(self, n: int = 1, **metrics: Any) -> None:
        self.done += n
        self.metrics.update(metrics)
        self.bar.update(n)
        if metrics:
            self.bar.set_postfix({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}, refresh=False)
        now = time.time()
        if now - self._last_print >= self.print_every_s:
            self._last_print = now
            print(self.line(), flush=True)
        self._write()

    def rate(self) -> float:
        dt = time.time() - self.t0
        return (self.done - self._start_done) / dt if dt > 0 else 0.0

    def line(self) -> str:
        m = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.metrics.items())
        return f"[{self.desc}] {self.done}/{self.total} {self.unit} ({self.rate():.2f} {self.unit}/s) {m}".rstrip()

    def _write(self, force: bool = False, state: str = "running") -> None:
        now = time.time()
        if not force and now - self._last_write < self.write_every_s:
            return
        self._last_write = now
        write_json_atomic(self.path, {
            "desc": self.desc, "done": self.done, "total": self.total, "unit": self.unit,
            "rate_per_s": self.rate(), "metrics": self.metrics, "state": state,
            "updated": now, "pid": os.getpid(),
        })

    def close(self, state: str = "done") -> None:
        self.bar.close()
        print(self.line(), flush=True)
        self._write(force=True, state=state)
