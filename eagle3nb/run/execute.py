"""Executing a plan: each stage's notebook under papermill, its report rendered, every step in run.log and
status.json, a signal recorded as a kill; or the same in a detached session."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil

from eagle3nb.params import STAGES, ParamsError, from_dict
from eagle3nb.params_yaml import injectable
from eagle3nb.paths import project_root
from eagle3nb.progress import write_json_atomic
from eagle3nb.render import render
from eagle3nb.run import LOG_FILE, PID_FILE, STATUS_FILE
from eagle3nb.run.lock import lock, write_pid
from eagle3nb.run.plan import Plan, plan, rel
from eagle3nb.run.status import load_status, now

KERNEL = "python3"


class _Interrupted(KeyboardInterrupt):
    """Raised from the signal handler so the running stage is recorded as killed. A KeyboardInterrupt,
    because asyncio (under papermill) re-raises those from its callbacks but swallows other exceptions."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

# --- logging to run.log ---------------------------------------------------------------------------------

class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).rstrip("\n")


@contextmanager
def _run_log(out_dir: Path, console: bool) -> Iterator[logging.Logger]:
    """Route the runner's lines and papermill's streamed cell output to run.log (and the terminal)."""
    handlers: list[logging.Handler] = [logging.FileHandler(out_dir / LOG_FILE, mode="a", encoding="utf-8")]
    handlers[0].setFormatter(_LineFormatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    if console:
        handlers.append(logging.StreamHandler(sys.stderr))
        handlers[1].setFormatter(_LineFormatter("%(message)s"))
    loggers = [logging.getLogger("eagle3nb.run"), logging.getLogger("papermill")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.propagate = False
        for h in handlers:
            lg.addHandler(h)
    try:
        yield loggers[0]
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            for h in handlers:
                lg.removeHandler(h)
            lg.setLevel(level)
            lg.propagate = propagate
        for h in handlers:
            if isinstance(h, logging.FileHandler):
                h.close()


@contextmanager
def _signals_recorded() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGINT raise _Interrupted, so the running stage is recorded as killed;
    papermill shuts its kernel down on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --- running --------------------------------------------------------------------------------------------

def run(params_dir: str | os.PathLike, stages: str | list[str] | None = None, force: bool = False,
        output_root: str | os.PathLike | None = None, notebooks_dir: str | os.PathLike | None = None,
        *, lock_fd: int | None = None, console: bool = True) -> int:
    """Run the stages of ``params_dir`` in order; 0 when all are done, non-zero when one failed or the run
    was killed. Raises ParamsError (bad parameters, missing notebook) or RunLocked (a live run holds the
    folder) before any notebook starts."""
    p = plan(params_dir, stages, force, output_root, notebooks_dir)
    p.out_dir.mkdir(parents=True, exist_ok=True)
    fd = lock(p.out_dir, lock_fd)
    try:
        st = load_status(p.out_dir) or {}
        (p.out_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        with _run_log(p.out_dir, console) as log, _signals_recorded():
            return _run_locked(p, st, log)
    finally:
        os.close(fd)


def _run_locked(p: Plan, before: dict[str, Any], log: logging.Logger) -> int:
    recs = before.get("stages", {})
    for stage in dict.fromkeys([*STAGES, *p.stages]):
        recs.setdefault(stage, {"state": "pending"})
    for rec in recs.values():  # we hold the lock, so whoever was executing these is gone
        if rec["state"] == "running":
            rec.update(state="killed", error=f"killed: the run executing it (pid {before.get('pid')}) died")
    st = dict(run_name=p.run_name, params_dir=str(p.params_dir), notebooks_dir=str(p.notebooks_dir),
              out_dir=str(p.out_dir), pid=os.getpid(), pid_started=psutil.Process().create_time(),
              host=socket.gethostname(), command=p.command(), state="running", started=now(), ended=None,
              stages=recs)

    def save() -> None:
        st["updated"] = now()
        write_json_atomic(p.out_dir / STATUS_FILE, st)

    save()
    log.info(f"run {p.run_name}: stages {', '.join(p.stages)} (pid {os.getpid()} on {st['host']})")
    for note in p.notes:
        log.info(note)
    current = None
    try:
        for stage in p.stages:
            rec = recs[stage]
            if rec["state"] == "done" and not p.force:
                log.info(f"{stage}: done at {rec.get('ended')}, skipping it (--force re-runs it)")
                continue
            if rec["state"] in ("failed", "killed"):
                log.info(f"{stage}: {rec['state']} last time ({rec.get('error')}); re-running it (the stage resumes "
                         f"from its own progress)")
            current = stage
            nb_out, html_out = p.out_dir / f"{stage}.ipynb", p.out_dir / f"{stage}.html"
            rec.update(state="running", started=now(), ended=None, error=None, failed_cell=None,
                       notebook=str(nb_out), html=None, stage_dir=str(p.stage_dirs[stage]),
                       attempts=rec.get("attempts", 0) + 1)
            save()
            log.info(f"{stage}: start -> {rel(nb_out)} (stage folder {rel(p.stage_dirs[stage])})")
            t0 = time.time()
            try:
                from_dict(stage, p.values[stage])
            except ParamsError as e:
                failure = {"error": str(e)}
            else:
                failure = _execute(p, stage, nb_out, log)
                rec["html"] = _render_html(nb_out, html_out, log)
            rec["ended"] = now()
            if failure:
                rec.update(state="failed", **failure)
                st.update(state="failed", ended=now())
                save()
                cell = failure.get("failed_cell")
                where = (f" -> see {rel(nb_out)} cell In [{cell['execution_count']}] (index {cell['index']})"
                         if cell else "")
                log.error(f"{stage} FAILED: {failure['error']}{where}; "
                          f"after a fix, `eagle3nb run {rel(p.params_dir)}` resumes here")
                return 1
            rec["state"] = "done"
            current = None
            save()
            log.info(f"{stage}: done in {time.time() - t0:.1f}s -> {rel(html_out)}")
    except _Interrupted as e:
        why = f"killed by {signal.Signals(e.signum).name}"
        if current:
            recs[current].update(state="killed", ended=now(), error=why)
        st.update(state="killed", ended=now())
        save()
        log.error(f"run {p.run_name}: {why} during {current or 'bookkeeping'}; "
                  f"`eagle3nb run {rel(p.params_dir)}` resumes it")
        return 128 + e.signum
    st.update(state="done", ended=now())
    save()
    log.info(f"run {p.run_name}: all requested stages done ({rel(p.out_dir)})")
    return 0


def _execute(p: Plan, stage: str, nb_out: Path, log: logging.Logger) -> dict[str, Any] | None:
    """Execute one notebook; None on success, else the failure fields for status.json."""
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    try:
        papermill.execute_notebook(
            str(p.notebooks_dir / f"{stage}.ipynb"), str(nb_out), parameters=injectable(p.values[stage]),
            kernel_name=KERNEL, cwd=str(project_root()), log_output=True, progress_bar=False)
    except PapermillExecutionError as e:
        nb = nbformat.read(nb_out, as_version=4)
        index = next((i for i, c in enumerate(nb.cells)
                      if any(o.get("output_type") == "error" for o in c.get("outputs", []))), e.cell_index)
        lines = e.source.splitlines()
        excerpt = "\n".join(lines[:12]) + ("\n..." if len(lines) > 12 else "")
        return {"error": f"{e.ename}: {e.evalue}",
                "failed_cell": {"index": index, "execution_count": e.exec_count, "source": excerpt}}
    except Exception as e:  # kernel died, notebook unreadable, ...: recorded, never silent
        log.exception(f"{stage}: papermill could not execute the notebook")
        return {"error": f"{type(e).__name__}: {e} (traceback in {rel(nb_out.parent / LOG_FILE)})"}
    return None


def _render_html(nb_path: Path, html_path: Path, log: logging.Logger) -> str | None:
    """The executed notebook as a report: markdown and outputs, no input cells, its widgets working offline."""
    if not nb_path.exists():
        return None
    try:
        note = render(nb_path, html_path)
    except Exception as e:
        log.warning(f"could not render {rel(nb_path)} to HTML ({type(e).__name__}: {e}); the notebook is intact")
        return None
    if note:
        log.warning(f"{rel(html_path)}: {note}")
    return str(html_path)


def detach(params_dir: str | os.PathLike, stages: str | list[str] | None = None, force: bool = False,
           output_root: str | os.PathLike | None = None, notebooks_dir: str | os.PathLike | None = None) -> int:
    """Start the run in its own session (it survives the terminal closing) and return at once.

    Parameters and the lock are checked here, so a bad YAML or a busy folder is refused in the terminal;
    the locked file descriptor is handed to the child, so no other run can slip in between."""
    p = plan(params_dir, stages, force, output_root, notebooks_dir)
    p.out_dir.mkdir(parents=True, exist_ok=True)
    fd = lock(p.out_dir)
    try:
        with open(p.out_dir / LOG_FILE, "ab") as logf:
            child = subprocess.Popen(
                [sys.executable, "-m", "eagle3nb", *p.argv(), "--lock-fd", str(fd)], cwd=project_root(),
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(fd,))
        write_pid(fd, child.pid)
    finally:
        os.close(fd)
    (p.out_dir / PID_FILE).write_text(f"{child.pid}\n")
    out = rel(p.out_dir)
    print(f"run {p.run_name} started in the background, pid {child.pid}; it keeps running if this terminal closes.\n"
          f"  follow it:  eagle3nb status {out}/\n"
          f"              tail -f {out}/{LOG_FILE}\n"
          f"  stop it:    kill {child.pid}")
    return 0


