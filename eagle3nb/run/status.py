"""What a run recorded in ``status.json``, checked against reality, and the text ``eagle3nb status`` prints."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle3nb.params import ParamsError
from eagle3nb.progress import read_progress
from eagle3nb.run import LOG_FILE, STATUS_FILE
from eagle3nb.run.lock import pid_alive
from eagle3nb.run.plan import rel, user_path


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def load_status(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / STATUS_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ParamsError(f"{out_dir / STATUS_FILE} is not valid JSON ({e}); delete it to start the run's "
                          f"bookkeeping afresh (stage outputs are kept)") from None


def status(run_out_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``status.json`` records, checked against reality: ``pid_alive``, stages whose run died shown as
    ``killed``, ``running_stage``, and each started stage's ``progress`` (its progress.json)."""
    out = user_path(run_out_dir)
    st = load_status(out)
    if st is None:
        if any(out.glob("*.yaml")):
            hint = f"{out} is a parameter folder; status takes the run's output folder, outputs/{out.name}/"
        elif (out / LOG_FILE).exists():
            hint = f"the run has not recorded a stage yet; see {rel(out / LOG_FILE)}"
        else:
            hint = f"nothing has run into {out} yet; start a run with `eagle3nb run params/<run>/`"
        raise FileNotFoundError(f"no {STATUS_FILE} in {out}: {hint}")
    alive = pid_alive(st.get("pid"), st.get("pid_started"))
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
    lines = [f"run {st.get('run_name')}  ({rel(out)}/)  {st.get('state')}",
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
            lines.append(f"      error: {rec['error']} -> {rel(rec.get('notebook'))}{where}")
    if st.get("state") == "running":
        lines.append(f"follow: tail -f {rel(out / LOG_FILE)}    stop: kill {pid}")
    elif st.get("state") in ("killed", "failed"):
        lines.append(f"resume: eagle3nb run {rel(st.get('params_dir'))}/")
    return "\n".join(lines)


