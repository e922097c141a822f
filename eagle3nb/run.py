"""The run orchestrator: ``eagle3nb run params/<run>/`` executes the stage notebooks in order with papermill,
skips what is done, re-runs what failed or was killed (each stage resumes from its own files), and can
detach into its own session; ``eagle3nb status outputs/<run>/`` reads what it recorded.

``outputs/<run>/`` holds, besides each stage's own folder: ``NN_name.ipynb`` (executed notebook),
``NN_name.html`` (report without input cells), ``run.log`` (timestamped runner lines and every cell's
output), ``status.json`` (per-stage state, times, paths, errors), ``run.lock`` (held while a run is alive)
and ``run.pid``. Papermill and nbconvert are imported only when a stage runs, so ``status`` is instant.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import psutil

from eagle3nb.errors import UserError
from eagle3nb.params import STAGES, ParamsError, from_dict, injectable, run_params
from eagle3nb.paths import outputs_root, project_root
from eagle3nb.progress import read_progress, write_json_atomic
from eagle3nb.render import render

STATUS_FILE = "status.json"
LOG_FILE = "run.log"
LOCK_FILE = "run.lock"
PID_FILE = "run.pid"
KERNEL = "python3"


class RunLocked(UserError, RuntimeError):
    """Another live run holds this output folder."""


class _Interrupted(KeyboardInterrupt):
    """Raised from the signal handler so the running stage is recorded as killed. A KeyboardInterrupt,
    because asyncio (under papermill) re-raises those from its callbacks but swallows other exceptions."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclass
class Plan:
    """Everything a run needs, validated before any notebook starts."""

    params_dir: Path
    run_name: str
    out_dir: Path
    notebooks_dir: Path
    stages: list[str]
    requested: list[str] | None
    values: dict[str, dict[str, Any]]
    stage_dirs: dict[str, Path]
    force: bool
    notes: list[str]

    def argv(self) -> list[str]:
        """The ``eagle3nb`` arguments that repeat this run (absolute paths, no --detach)."""
        args = ["run", str(self.params_dir)]
        if self.out_dir.parent != project_root() / "outputs":
            args += ["--output-root", str(self.out_dir.parent)]
        if self.notebooks_dir != project_root() / "notebooks":
            args += ["--notebooks-dir", str(self.notebooks_dir)]
        if self.requested:
            args += ["--stages", ",".join(self.requested)]
        return args + (["--force"] if self.force else [])

    def command(self) -> str:
        return shlex.join(["eagle3nb", *self.argv()])


def _user_path(path: str | os.PathLike) -> Path:
    """A path the user typed: absolute, or relative to the cwd when it exists there, else to the project."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute() and not p.exists():
        p = project_root() / p
    return p.resolve()


def parse_stages(spec: str | list[str] | None) -> list[str] | None:
    """``"01,03"`` / ``["01_synth", "3"]`` -> full stage names in pipeline order; None means all."""
    if spec is None:
        return None
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    chosen = set()
    for item in items:
        hits = [s for s in STAGES if item in (s, s[:2], s[1:2], s[3:])]
        if len(hits) != 1:
            raise ParamsError(f"--stages: unknown stage {item!r}; use numbers or names from {', '.join(STAGES)} "
                              f"(e.g. --stages 01,03)")
        chosen.add(hits[0])
    if not chosen:
        raise ParamsError("--stages is empty; give e.g. --stages 01,03, or leave it out to run every stage")
    return [s for s in STAGES if s in chosen]


def plan(params_dir: str | os.PathLike, stages: str | list[str] | None = None, force: bool = False,
         output_root: str | os.PathLike | None = None,
         notebooks_dir: str | os.PathLike | None = None) -> Plan:
    """Validate the run's parameters and notebooks; every problem is a ParamsError before work starts.

    Paths a later stage needs may be made by an earlier one (04's draft by 03), so only the first stage's
    path checks are errors here; later ones are checked again as that stage starts, and until then a missing
    path is a note, unless it lies in the folder of an earlier stage of this run (which makes it: no warning)."""
    params_dir = _user_path(params_dir)
    if not params_dir.is_dir():
        raise ParamsError(f"{params_dir}: no such parameter folder; pass params/<run>/ (e.g. params/demo/)")
    if not any((params_dir / f"{name}.yaml").exists() for name in ["common", *STAGES]):
        raise ParamsError(f"{params_dir} holds no parameter files (common.yaml, {STAGES[0]}.yaml, ...); "
                          f"pass a folder like params/demo/")
    requested = parse_stages(stages)
    chosen = requested or list(STAGES)
    nb_dir = _user_path(notebooks_dir) if notebooks_dir else project_root() / "notebooks"
    if output_root:  # the stages' default folders follow it (in this process and the kernels it starts)
        os.environ["EAGLE3NB_OUTPUTS"] = str(Path(output_root).expanduser().resolve())
    root = outputs_root()
    values, stage_dirs, problems, notes = {}, {}, [], []
    for stage in chosen:
        if not (params_dir / f"{stage}.yaml").exists():
            notes.append(f"{stage}: no {stage}.yaml in {_rel(params_dir)}; the notebook's defaults apply")
        if not (nb_dir / f"{stage}.ipynb").exists():
            problems.append(f"{nb_dir / f'{stage}.ipynb'}: notebook missing; restore it (git checkout) "
                            f"or pass --notebooks-dir")
            continue
        try:
            values[stage] = run_params(params_dir, stage)
            p = from_dict(stage, values[stage], check_paths=False)
        except ParamsError as e:
            problems.append(str(e))
            continue
        stage_dirs[stage] = p.out_dir(getattr(p, "output_dir", None), stage)
        try:
            p.check_paths()
        except ParamsError as e:
            if stage == chosen[0]:
                problems.append(str(e))
            elif not any(str(d) in str(e) for s, d in stage_dirs.items() if s != stage):  # no earlier stage makes it
                notes.append(f"{stage}: {e} (fine if an earlier stage of this run makes it; checked again "
                             f"when {stage} starts)")
    names = sorted({str(v["run_name"]) for v in values.values()})
    if len(names) > 1:
        problems.append(f"run_name differs between the stages of {params_dir} ({', '.join(names)}): remove "
                        f"run_name from the YAMLs (it defaults to the folder name) or make them agree")
    if problems:
        raise ParamsError("\n".join(problems))
    run_name = names[0] if names else params_dir.name
    return Plan(params_dir, run_name, root / run_name, nb_dir, chosen, requested, values, stage_dirs, force,
                notes)


# --- the lock -------------------------------------------------------------------------------------------

def _lock(out_dir: Path, fd: int | None = None) -> int:
    """Hold ``run.lock`` (flock) for this process's life; ``fd`` is one inherited from a detaching parent."""
    path = out_dir / LOCK_FILE
    if fd is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    elif os.fstat(fd).st_ino != path.stat().st_ino:
        raise RunLocked(f"--lock-fd {fd} is not {path}; start runs without --lock-fd (it is internal)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = path.read_text().strip() or "?"
        os.close(fd)
        raise RunLocked(
            f"{out_dir} is in use by run pid {holder} (it holds {path}); refusing to start a second run there. "
            f"Follow it with `eagle3nb status {out_dir}`, wait for it, or stop it with `kill {holder}`.") from None
    os.set_inheritable(fd, False)  # an fd handed over by a detaching parent goes no further
    _write_pid(fd, os.getpid())
    return fd


def _write_pid(fd: int, pid: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)


# --- status.json ----------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _load_status(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / STATUS_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ParamsError(f"{out_dir / STATUS_FILE} is not valid JSON ({e}); delete it to start the run's "
                          f"bookkeeping afresh (stage outputs are kept)") from None


def _pid_alive(pid: int | None, started: float | None = None) -> bool:
    """True if ``pid`` is a live process (and the same one: its start time matches when recorded)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(p.create_time() - started) < 1.0
    except psutil.Error:
        return False


def _rel(path: str | Path | None) -> str:
    """A path as the user would type it: relative to the cwd when below it."""
    if path is None:
        return "-"
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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
    fd = _lock(p.out_dir, lock_fd)
    try:
        st = _load_status(p.out_dir) or {}
        (p.out_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        with _run_log(p.out_dir, console) as log, _signals_recorded():
            return _run_locked(p, st, log)
    finally:
        os.close(fd)


def _run_locked(p: Plan, before: dict[str, Any], log: logging.Logger) -> int:
    recs = before.get("stages", {})
    for stage in STAGES:
        recs.setdefault(stage, {"state": "pending"})
    for rec in recs.values():  # we hold the lock, so whoever was executing these is gone
        if rec["state"] == "running":
            rec.update(state="killed", error=f"killed: the run executing it (pid {before.get('pid')}) died")
    st = dict(run_name=p.run_name, params_dir=str(p.params_dir), notebooks_dir=str(p.notebooks_dir),
              out_dir=str(p.out_dir), pid=os.getpid(), pid_started=psutil.Process().create_time(),
              host=socket.gethostname(), command=p.command(), state="running", started=_now(), ended=None,
              stages=recs)

    def save() -> None:
        st["updated"] = _now()
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
            rec.update(state="running", started=_now(), ended=None, error=None, failed_cell=None,
                       notebook=str(nb_out), html=None, stage_dir=str(p.stage_dirs[stage]),
                       attempts=rec.get("attempts", 0) + 1)
            save()
            log.info(f"{stage}: start -> {_rel(nb_out)} (stage folder {_rel(p.stage_dirs[stage])})")
            t0 = time.time()
            try:
                from_dict(stage, p.values[stage])
            except ParamsError as e:
                failure = {"error": str(e)}
            else:
                failure = _execute(p, stage, nb_out, log)
                rec["html"] = _render_html(nb_out, html_out, log)
            rec["ended"] = _now()
            if failure:
                rec.update(state="failed", **failure)
                st.update(state="failed", ended=_now())
                save()
                cell = failure.get("failed_cell")
                where = (f" -> see {_rel(nb_out)} cell In [{cell['execution_count']}] (index {cell['index']})"
                         if cell else "")
                log.error(f"{stage} FAILED: {failure['error']}{where}; "
                          f"after a fix, `eagle3nb run {_rel(p.params_dir)}` resumes here")
                return 1
            rec["state"] = "done"
            current = None
            save()
            log.info(f"{stage}: done in {time.time() - t0:.1f}s -> {_rel(html_out)}")
    except _Interrupted as e:
        why = f"killed by {signal.Signals(e.signum).name}"
        if current:
            recs[current].update(state="killed", ended=_now(), error=why)
        st.update(state="killed", ended=_now())
        save()
        log.error(f"run {p.run_name}: {why} during {current or 'bookkeeping'}; "
                  f"`eagle3nb run {_rel(p.params_dir)}` resumes it")
        return 128 + e.signum
    st.update(state="done", ended=_now())
    save()
    log.info(f"run {p.run_name}: all requested stages done ({_rel(p.out_dir)})")
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
        return {"error": f"{type(e).__name__}: {e} (traceback in {_rel(nb_out.parent / LOG_FILE)})"}
    return None


def _render_html(nb_path: Path, html_path: Path, log: logging.Logger) -> str | None:
    """The executed notebook as a report: markdown and outputs, no input cells, its widgets working offline."""
    if not nb_path.exists():
        return None
    try:
        note = render(nb_path, html_path)
    except Exception as e:
        log.warning(f"could not render {_rel(nb_path)} to HTML ({type(e).__name__}: {e}); the notebook is intact")
        return None
    if note:
        log.warning(f"{_rel(html_path)}: {note}")
    return str(html_path)


def detach(params_dir: str | os.PathLike, stages: str | list[str] | None = None, force: bool = False,
           output_root: str | os.PathLike | None = None, notebooks_dir: str | os.PathLike | None = None) -> int:
    """Start the run in its own session (it survives the terminal closing) and return at once.

    Parameters and the lock are checked here, so a bad YAML or a busy folder is refused in the terminal;
    the locked file descriptor is handed to the child, so no other run can slip in between."""
    p = plan(params_dir, stages, force, output_root, notebooks_dir)
    p.out_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock(p.out_dir)
    try:
        with open(p.out_dir / LOG_FILE, "ab") as logf:
            child = subprocess.Popen(
                [sys.executable, "-m", "eagle3nb", *p.argv(), "--lock-fd", str(fd)], cwd=project_root(),
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(fd,))
        _write_pid(fd, child.pid)
    finally:
        os.close(fd)
    (p.out_dir / PID_FILE).write_text(f"{child.pid}\n")
    out = _rel(p.out_dir)
    print(f"run {p.run_name} started in the background, pid {child.pid}; it keeps running if this terminal closes.\n"
          f"  follow it:  eagle3nb status {out}/\n"
          f"              tail -f {out}/{LOG_FILE}\n"
          f"  stop it:    kill {child.pid}")
    return 0


# --- status ---------------------------------------------------------------------------------------------

def status(run_out_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``status.json`` records, checked against reality: ``pid_alive``, stages whose run died shown as
    ``killed``, ``running_stage``, and each started stage's ``progress`` (its progress.json)."""
    out = _user_path(run_out_dir)
    st = _load_status(out)
    if st is None:
        if any(out.glob("*.yaml")):
            hint = f"{out} is a parameter folder; status takes the run's output folder, outputs/{out.name}/"
        elif (out / LOG_FILE).exists():
            hint = f"the run has not recorded a stage yet; see {_rel(out / LOG_FILE)}"
        else:
            hint = f"nothing has run into {out} yet; start a run with `eagle3nb run params/<run>/`"
        raise FileNotFoundError(f"no {STATUS_FILE} in {out}: {hint}")
    alive = _pid_alive(st.get("pid"), st.get("pid_started"))
    st["pid_alive"] = alive
    if st.get("state") == "running" and not alive:
        st["state"] = "killed"
    st["running_stage"] = None
    for name, rec in st.get("stages", {}).items():
        if rec.get("state") == "running":
            if alive:
                st["running_stage"] = name
            else:
                rec["state"] = "killed"
                rec["error"] = f"the run (pid {st.get('pid')}) died while executing this stage"
        stage_dir = Path(rec.get("stage_dir") or out / name)
        rec["progress"] = read_progress(stage_dir) if rec.get("state") != "pending" else None
    return st


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _seconds_between(a: str | None, b: str | None) -> float | None:
    if not a:
        return None
    end = datetime.fromisoformat(b) if b else datetime.now().astimezone()
    return (end - datetime.fromisoformat(a)).total_seconds()


def _progress_line(pr: dict[str, Any]) -> str:
    done, total, unit = pr.get("done", 0), pr.get("total") or 0, pr.get("unit", "it")
    rate = pr.get("rate_per_s") or 0.0
    parts = [f"[{pr.get('desc', '')}] {done}/{total} {unit}"]
    if total:
        parts.append(f"{100 * done / total:.0f}%")
    if rate > 0:
        parts.append(f"{rate:.2f} {unit}/s")
        if total > done:
            parts.append(f"ETA {_duration((total - done) / rate)}")
    parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (pr.get("metrics") or {}).items()]
    if pr.get("updated"):
        parts.append(f"(updated {_duration(time.time() - pr['updated'])} ago)")
    return " ".join(parts)


def format_status(st: dict[str, Any]) -> str:
    """The text ``eagle3nb status`` prints."""
    out = Path(st.get("out_dir", "."))
    pid = st.get("pid")
    if st.get("state") == "running":
        alive = "alive"
    else:
        alive = f"finished {st.get('ended')}" if st.get("ended") else "not running"
    lines = [f"run {st.get('run_name')}  ({_rel(out)}/)  {st.get('state')}",
             f"pid {pid} on {st.get('host')}: {alive}   command: {st.get('command')}"]
    for name, rec in st.get("stages", {}).items():
        state = rec.get("state", "pending")
        row = f"  {name:<18} {state:<8}"
        if rec.get("started"):
            took = _seconds_between(rec["started"], rec.get("ended"))
            row += f" {rec['started'][11:19]} -> {rec['ended'][11:19] if rec.get('ended') else '...':<8}"
            row += f" ({_duration(took)})" if took is not None else ""
        if state in ("running", "killed", "failed") and rec.get("progress"):
            row += "  " + _progress_line(rec["progress"])
        lines.append(row.rstrip())
        if rec.get("error"):
            cell = rec.get("failed_cell")
            where = f", cell In [{cell['execution_count']}] (index {cell['index']})" if cell else ""
            lines.append(f"      error: {rec['error']} -> {_rel(rec.get('notebook'))}{where}")
    if st.get("state") == "running":
        lines.append(f"follow: tail -f {_rel(out / LOG_FILE)}    stop: kill {pid}")
    elif st.get("state") in ("killed", "failed"):
        lines.append(f"resume: eagle3nb run {_rel(st.get('params_dir'))}/")
    return "\n".join(lines)


# --- CLI ------------------------------------------------------------------------------------------------

def _cmd_run(args: argparse.Namespace) -> int:
    if args.detach:
        return detach(args.params_dir, args.stages, args.force, args.output_root, args.notebooks_dir)
    return run(args.params_dir, args.stages, args.force, args.output_root, args.notebooks_dir,
               lock_fd=args.lock_fd, console=args.lock_fd is None)


def _cmd_status(args: argparse.Namespace) -> int:
    st = status(args.run_out_dir)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="execute a run's notebooks in order with papermill (resumes; can detach)",
                       description="Execute notebooks/NN_name.ipynb in order with the parameters in "
                                   "params/<run>/ into outputs/<run>/; done stages are skipped, failed or "
                                   "killed ones re-run and resume from their own progress.")
    r.add_argument("params_dir", help="the run's parameter folder, e.g. params/demo/")
    r.add_argument("--stages", help="only these stages, in pipeline order: numbers or names, e.g. 01,03")
    r.add_argument("--force", action="store_true",
                   help="re-execute stages already done (each still resumes from its own files; delete "
                        "outputs/<run>/<NN_name>/ to redo one from scratch)")
    r.add_argument("--detach", action="store_true",
                   help="run in the background in a new session (survives closing the terminal) and return")
    r.add_argument("--output-root", help="folder that holds <run>/ (default: $EAGLE3NB_OUTPUTS, else "
                                         "<project>/outputs); the stages' default folders go there too, an "
                                         "output_dir set in the params wins")
    r.add_argument("--notebooks-dir", help="folder with the NN_name.ipynb notebooks (default: <project>/notebooks)")
    r.add_argument("--lock-fd", type=int, help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_run)
    s = sub.add_parser("status", help="what a run is doing: stage states, live progress, whether it is alive")
    s.add_argument("run_out_dir", help="the run's output folder, e.g. outputs/demo/")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=_cmd_status)
