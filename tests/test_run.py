"""The run orchestrator for real: papermill executes tiny fixture notebooks (written to tmp folders) in
real kernels, runs are killed with real signals, detached runs outlive their terminal's process group.

The fixture notebooks stand in for the four stages, so these tests never depend on the real stage
schemas: they register a throwaway schema for each stage name (in this process into a patched registry,
in subprocesses through a ``sitecustomize`` on PYTHONPATH, the way coverage.py reaches subprocesses).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest
import yaml

from eagle3nb import params
from eagle3nb.cli import main
from eagle3nb.params import ON_REQUEST, STAGES, ParamsError
from eagle3nb.progress import read_progress
from eagle3nb.run.execute import run
from eagle3nb.run.lock import RunLocked
from eagle3nb.run.plan import parse_stages, plan
from eagle3nb.run.status import status

ROOT = Path(__file__).resolve().parents[1]

# The fixture notebook's schema, registered under every stage name. It is written to a module in the test's
# tmp folder: this process loads it from there, subprocesses through a sitecustomize beside it (kernels
# skip it: the notebooks only use the injected values).
SCHEMAS = '''
from pathlib import Path
from pydantic import Field
from eagle3nb.params import STAGE_MODULES, ParamsError, StageParams, register


class FixtureParams(StageParams):
    output_dir: str = Field(description="the stage folder (progress.json, executions.txt)")
    steps: int = Field(3, description="work items, one progress step each")
    hold_at: int = Field(-1, description="step at which the notebook waits while hold_file exists")
    hold_file: str | None = Field(None, description="file whose existence holds the notebook at hold_at")
    fail: bool = Field(False, description="raise in the cell after the work")
    needs: str | None = Field(None, description="a path that must exist when the stage starts")

    def check_paths(self) -> None:
        if self.needs and not Path(self.needs).exists():
            raise ParamsError(f"parameter 'needs' in {self.params_file}: {self.needs} does not exist")


for stage in STAGE_MODULES:
    register(stage)(type(f"Fixture_{stage}", (FixtureParams,), {}))
'''

SITECUSTOMIZE = '''
import sys
if not any("ipykernel" in a for a in sys.argv):
    import fixture_schemas
'''

PARAMETERS = '''run_name = "fixture"  # output folder name
params_file = None  # the YAML these came from
output_dir = "unset"  # stage folder
steps = 3  # work items
hold_at = -1  # wait at this step while hold_file exists
hold_file = None  # see hold_at
fail = False  # raise after the work
needs = None  # a path that must exist
'''

WORK = '''# SOURCE-ONLY-MARKER: input cells never reach the HTML report
import os, time
from pathlib import Path
from eagle3nb.progress import Progress, read_progress
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
with open(out / "executions.txt", "a") as f:
    f.write(f"{os.getpid()}\\n")
prev = read_progress(out)
start = prev["done"] if prev else 0  # resume from this stage's own progress
(out / "resumed_from.txt").write_text(str(start))
bar = Progress(out, total=steps, desc="fixture", unit="step", done=start, write_every_s=0)
for i in range(start, steps):
    while i == hold_at and hold_file and os.path.exists(hold_file):
        time.sleep(0.1)
    bar.update(1, loss=1.0 / (i + 1))
'''


def write_fixture_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Fixture stage\nA visible narrative line."),
        nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(WORK),
        nbformat.v4.new_code_cell('if fail:\n    raise RuntimeError("fixture stage failed on purpose")'),
        nbformat.v4.new_code_cell('bar.close(state="done")\nprint("VISIBLE-OUTPUT", steps)'),
    ]
    nbformat.write(nb, path)


@dataclass
class World:
    params: Path  # params/<run>/
    nbs: Path  # fixture notebooks
    root: Path  # --output-root
    data: Path  # stage folders live under here
    env: dict[str, str]  # environment for subprocess runs (fixture schemas via sitecustomize)

    @property
    def out(self) -> Path:
        return self.root / self.params.name

    def stage_dir(self, stage: str) -> Path:
        return self.data / stage

    def set(self, stage: str, **values) -> None:
        values.setdefault("output_dir", str(self.stage_dir(stage)))
        (self.params / f"{stage}.yaml").write_text(yaml.safe_dump(values))

    def kw(self, **extra) -> dict:
        return {"output_root": self.root, "notebooks_dir": self.nbs, **extra}

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "eagle3nb", *args]

    def run_args(self, *args: str) -> list[str]:
        return self.cli("run", str(self.params), "--output-root", str(self.root),
                        "--notebooks-dir", str(self.nbs), *args)

    def executions(self, stage: str) -> list[int]:
        f = self.stage_dir(stage) / "executions.txt"
        return [int(x) for x in f.read_text().split()] if f.exists() else []

    def status_json(self) -> dict:
        return json.loads((self.out / "status.json").read_text())

    def log(self) -> str:
        p = self.out / "run.log"
        return p.read_text() if p.exists() else ""


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "fixture_schemas.py").write_text(SCHEMAS)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setattr(params, "_REGISTRY", {})  # throwaway schemas, gone after the test
    spec = importlib.util.spec_from_file_location("fixture_schemas", hook / "fixture_schemas.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    for stage in [*STAGES, *ON_REQUEST]:
        write_fixture_notebook(nbs / f"{stage}.ipynb")
    pdir = tmp_path / "params" / "fx"
    pdir.mkdir(parents=True)
    (pdir / "common.yaml").write_text("steps: 2\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    w = World(pdir, nbs, tmp_path / "outputs", tmp_path / "data", env)
    for stage in STAGES:
        w.set(stage)
    return w


def wait_for(cond, what: str, w: World, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}; run.log tail:\n{w.log()[-3000:]}")


def held_at(w: World, stage: str, done: int):
    return lambda: (read_progress(w.stage_dir(stage)) or {}).get("done") == done and w.executions(stage)


def test_stages_selection_skip_done_force_html_and_log(world, capsys):
    w = world
    assert run(w.params, stages="01", **w.kw()) == 0
    st = status(w.out)
    assert st["stages"]["01_synth"]["state"] == "done"
    assert [st["stages"][s]["state"] for s in STAGES[1:]] == ["pending"] * 3
    assert st["state"] == "done" and st["running_stage"] is None and st["host"]
    rec = st["stages"]["01_synth"]
    assert rec["notebook"] == str(w.out / "01_synth.ipynb") and rec["stage_dir"] == str(w.stage_dir("01_synth"))
    assert rec["started"] <= rec["ended"] and rec["progress"]["done"] == 2  # common.yaml's steps: 2

    html = (w.out / "01_synth.html").read_text()
    assert "VISIBLE-OUTPUT 2" in html and "A visible narrative line" in html
    assert "SOURCE-ONLY-MARKER" not in html and "raise RuntimeError" not in html
    executed = nbformat.read(w.out / "01_synth.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)

    assert run(w.params, stages="01,02", **w.kw()) == 0
    assert len(w.executions("01_synth")) == 1 and len(w.executions("02_hidden_states")) == 1
    assert "01_synth: done at" in capsys.readouterr().err

    assert run(w.params, stages="2", force=True, **w.kw()) == 0
    assert len(w.executions("01_synth")) == 1 and len(w.executions("02_hidden_states")) == 2
    st = w.status_json()
    assert st["stages"]["02_hidden_states"]["attempts"] == 2 and st["stages"]["03_train"]["state"] == "pending"
    log = w.log()
    assert log.count("02_hidden_states: start") == 2 and "VISIBLE-OUTPUT 2" in log
    assert log.splitlines()[0][:4].isdigit()  # timestamped lines

    # a later stage's missing path is a note at the start, and an error (no kernel) when the stage comes
    w.set("03_train", needs=str(w.data / "never-made"))
    assert run(w.params, stages="02,03", **w.kw()) == 1
    assert "checked again when 03_train starts" in w.log()
    rec = w.status_json()["stages"]["03_train"]
    assert rec["state"] == "failed" and "'needs'" in rec["error"] and not (w.out / "03_train.ipynb").exists()


def test_refresh_runs_after_04_only_when_asked(world):
    """05 is in a run when its YAML is in the run's folder or --stages names it, and then after 04."""
    w = world
    assert plan(w.params, **w.kw()).stages == STAGES
    assert parse_stages("5,4") == ["04_acceptance", "05_refresh"]
    w.set("05_refresh")
    assert plan(w.params, **w.kw()).stages == [*STAGES, "05_refresh"]
    assert run(w.params, stages="05", **w.kw()) == 0
    st = w.status_json()
    states = {s: r["state"] for s, r in st["stages"].items()}
    assert states == {**dict.fromkeys(STAGES, "pending"), "05_refresh": "done"}
    assert w.executions("05_refresh") and (w.out / "05_refresh.html").exists()


def test_failing_cell_reports_and_stops(world, capsys):
    w = world
    w.set("01_synth", fail=True)
    assert run(w.params, **w.kw()) == 1
    pointer = [line for line in capsys.readouterr().err.splitlines() if "FAILED" in line]
    assert len(pointer) == 1
    assert "01_synth.ipynb cell In [" in pointer[0] and "RuntimeError: fixture stage failed on purpose" in pointer[0]

    st = w.status_json()
    rec = st["stages"]["01_synth"]
    assert st["state"] == "failed" and rec["state"] == "failed"
    assert rec["error"] == "RuntimeError: fixture stage failed on purpose"
    cell = nbformat.read(w.out / "01_synth.ipynb", as_version=4).cells[rec["failed_cell"]["index"]]
    assert "raise RuntimeError" in cell.source and cell.source.startswith(rec["failed_cell"]["source"].split("\n")[0])
    assert any(o.get("output_type") == "error" for o in cell.outputs)
    assert f"In [{rec['failed_cell']['execution_count']}]" in pointer[0]
    assert st["stages"]["02_hidden_states"]["state"] == "pending" and not (w.out / "02_hidden_states.ipynb").exists()
    assert (w.out / "01_synth.html").exists()
    assert "error: RuntimeError" in main_output(["status", str(w.out)], capsys)


def main_output(argv: list[str], capsys) -> str:
    rc = main(argv)
    out = capsys.readouterr()
    return f"rc={rc}\n{out.out}{out.err}"


def test_bad_params_fail_before_any_notebook(world, capsys):
    w = world
    w.set("03_train", stpes=4)
    with pytest.raises(ParamsError) as e:
        run(w.params, **w.kw())
    msg = str(e.value)
    assert "'stpes'" in msg and "03_train.yaml" in msg and "did you mean 'steps'" in msg
    assert not w.out.exists() and not w.data.exists()  # stage 01 (valid) did not run either

    w.set("03_train", steps="many")
    assert "'steps'" in main_output(["run", str(w.params), "--output-root", str(w.root),
                                     "--notebooks-dir", str(w.nbs)], capsys)
    (w.params / "02_hidden_states.yaml").write_text("steps: [1, 2\n")
    out = main_output(["run", str(w.params), "--output-root", str(w.root), "--notebooks-dir", str(w.nbs),
                       "--stages", "02"], capsys)
    assert out.startswith("rc=2") and "02_hidden_states.yaml line" in out and "not valid YAML" in out
    with pytest.raises(ParamsError, match="unknown stage '07'"):
        run(w.params, stages="01,07", **w.kw())
    with pytest.raises(ParamsError, match="no such parameter folder"):
        run(w.params.parent / "nope", **w.kw())
    w.set("02_hidden_states", run_name="elsewhere")
    w.set("03_train")
    with pytest.raises(ParamsError, match="run_name differs between the stages"):
        run(w.params, **w.kw())  # their outputs would land in two folders
    w.set("02_hidden_states")
    w.set("01_synth", needs=str(w.data / "missing"))
    with pytest.raises(ParamsError, match="parameter 'needs' in .*01_synth.yaml"):
        run(w.params, stages="01,02", **w.kw())  # the first stage's paths must exist before work starts
    assert not w.out.exists()
    assert "is a parameter folder; status takes the run's output folder, outputs/fx/" in \
        main_output(["status", str(w.params)], capsys)


def test_kill_9_then_resume_status_and_refusal(world, capsys):
    w = world
    hold = w.data.parent / "hold"
    hold.touch()
    w.set("02_hidden_states", steps=3, hold_at=1, hold_file=str(hold),
          needs=str(w.stage_dir("01_synth") / "progress.json"))  # made by stage 01
    proc = subprocess.Popen(w.run_args("--stages", "01,02"), cwd=ROOT, env=w.env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(held_at(w, "02_hidden_states", 1), "stage 02 to reach step 1", w)
        st = status(w.out)
        assert st["pid"] == proc.pid and st["pid_alive"] and st["running_stage"] == "02_hidden_states"
        assert st["stages"]["01_synth"]["state"] == "done"
        assert st["stages"]["02_hidden_states"]["progress"]["done"] == 1
        text = subprocess.run(w.cli("status", str(w.out)), env=w.env, capture_output=True, text=True).stdout
        assert "alive" in text and "02_hidden_states   running" in text and "[fixture] 1/3 step" in text

        with pytest.raises(RunLocked, match=f"in use by run pid {proc.pid}"):
            run(w.params, stages="01,02", **w.kw())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    kernel = w.executions("02_hidden_states")[0]
    wait_for(lambda: not psutil.pid_exists(kernel), "the orphaned kernel to exit on its own", w, timeout=30)

    st = status(w.out)
    assert not st["pid_alive"] and st["state"] == "killed"
    assert st["stages"]["02_hidden_states"]["state"] == "killed"
    text = main_output(["status", str(w.out)], capsys)
    assert "not running" in text and "02_hidden_states   killed" in text and "resume: eagle3nb run" in text

    hold.unlink()
    assert run(w.params, stages="01,02", **w.kw()) == 0
    assert len(w.executions("01_synth")) == 1  # done stage skipped
    assert len(w.executions("02_hidden_states")) == 2
    assert (w.stage_dir("02_hidden_states") / "resumed_from.txt").read_text() == "1"
    st = w.status_json()
    assert st["stages"]["02_hidden_states"]["state"] == "done" and st["stages"]["02_hidden_states"]["attempts"] == 2
    assert f"(killed: the run executing it (pid {proc.pid}) died); re-running it" in w.log()
    # 02's input lies in 01's folder: an earlier stage of this run makes it, so no note is logged about it
    assert "checked again when 02_hidden_states starts" not in w.log()


def test_detach_survives_its_terminal_and_refuses_a_second_run(world):
    w = world
    hold = w.data.parent / "hold"
    hold.touch()
    w.set("03_train", steps=2, hold_at=1, hold_file=str(hold))
    said = w.data.parent / "terminal.txt"
    cmd = shlex.join(w.run_args("--stages", "03", "--detach"))
    # a "terminal": the shell stays after the parent returns, so its process group can be killed later
    term = subprocess.Popen(["bash", "-c", f"{cmd} > {said} 2>&1; echo parent-returned-$? >> {said}; exec sleep 300"],
                            cwd=ROOT, env=w.env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "parent-returned" in (said.read_text() if said.exists() else ""), "the parent", w)
        text = said.read_text()
        assert "parent-returned-0" in text, text
        assert f"eagle3nb status {w.out}/" in text and f"tail -f {w.out}/run.log" in text
        child = int((w.out / "run.pid").read_text())
        assert f"pid {child}" in text
        assert os.getsid(child) == child != term.pid  # its own session, outside the terminal's group
        wait_for(held_at(w, "03_train", 1), "the detached stage to reach step 1", w)
        assert w.status_json()["state"] == "running"  # the parent returned before the run could finish

        os.killpg(term.pid, signal.SIGHUP)
        os.killpg(term.pid, signal.SIGKILL)
        term.wait()
        time.sleep(0.5)
        st = status(w.out)
        assert st["pid"] == child and st["pid_alive"] and st["running_stage"] == "03_train"

        second = subprocess.run(w.run_args("--detach"), cwd=ROOT, env=w.env, capture_output=True, text=True)
        assert second.returncode == 2 and f"in use by run pid {child}" in second.stderr
    finally:
        if term.poll() is None:
            os.killpg(term.pid, signal.SIGKILL)
            term.wait()
        hold.unlink(missing_ok=True)
    wait_for(lambda: not status(w.out)["pid_alive"], "the detached run to finish", w)
    st = status(w.out)
    assert st["state"] == "done" and st["stages"]["03_train"]["state"] == "done"
    assert st["stages"]["03_train"]["progress"]["done"] == 2
    assert "VISIBLE-OUTPUT 2" in w.log() and (w.out / "03_train.html").exists()


def test_sigterm_marks_the_running_stage_killed(world):
    w = world
    hold = w.data.parent / "hold"
    hold.touch()
    w.set("04_acceptance", steps=2, hold_at=1, hold_file=str(hold))
    finished = threading.Event()

    def terminate_when_held() -> None:
        deadline = time.time() + 120
        while not finished.is_set() and time.time() < deadline:
            if held_at(w, "04_acceptance", 1)():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=terminate_when_held, daemon=True)
    killer.start()
    try:
        rc = run(w.params, stages="04", **w.kw())
    finally:
        finished.set()
        hold.unlink()
        killer.join()
    assert rc == 128 + signal.SIGTERM
    st = status(w.out)
    assert st["state"] == "killed" and st["stages"]["04_acceptance"]["state"] == "killed"
    assert st["stages"]["04_acceptance"]["error"] == "killed by SIGTERM"
    kernel = w.executions("04_acceptance")[0]
    wait_for(lambda: not psutil.pid_exists(kernel), "the kernel to be shut down", w, timeout=30)
