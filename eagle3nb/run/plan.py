"""A run's plan: its parameters and notebooks validated before any notebook starts."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3nb.params import ON_REQUEST, STAGE_MODULES, STAGES, ParamsError, from_dict
from eagle3nb.params_yaml import run_params
from eagle3nb.paths import outputs_root, project_root


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


def user_path(path: str | os.PathLike) -> Path:
    """A path the user typed: absolute, or relative to the cwd when it exists there, else to the project."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute() and not p.exists():
        p = project_root() / p
    return p.resolve()


def parse_stages(spec: str | list[str] | None) -> list[str] | None:
    """``"01,03"`` / ``["01_synth", "3"]`` -> full stage names in pipeline order; None means the default ones
    (:func:`default_stages`)."""
    if spec is None:
        return None
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    chosen = set()
    for item in items:
        hits = [s for s in STAGE_MODULES if item in (s, s[:2], s[1:2], s[3:])]
        if len(hits) != 1:
            raise ParamsError(f"--stages: unknown stage {item!r}; use numbers or names from "
                              f"{', '.join(STAGE_MODULES)} (e.g. --stages 01,03)")
        chosen.add(hits[0])
    if not chosen:
        raise ParamsError("--stages is empty; give e.g. --stages 01,03, or leave it out to run every stage")
    return [s for s in STAGE_MODULES if s in chosen]


def default_stages(params_dir: Path) -> list[str]:
    """The stages a run without ``--stages`` executes: the four, then each stage run only on request
    (``params.ON_REQUEST``: 05_refresh) whose YAML the run's folder holds."""
    return [*STAGES, *(s for s in ON_REQUEST if (params_dir / f"{s}.yaml").exists())]


def plan(params_dir: str | os.PathLike, stages: str | list[str] | None = None, force: bool = False,
         output_root: str | os.PathLike | None = None,
         notebooks_dir: str | os.PathLike | None = None) -> Plan:
    """Validate the run's parameters and notebooks; every problem is a ParamsError before work starts.

    Paths a later stage needs may be made by an earlier one (04's draft by 03), so only the first stage's
    path checks are errors here; later ones are checked again as that stage starts, and until then a missing
    path is a note, unless it lies in the folder of an earlier stage of this run (which makes it: no warning)."""
    params_dir = user_path(params_dir)
    if not params_dir.is_dir():
        raise ParamsError(f"{params_dir}: no such parameter folder; pass params/<run>/ (e.g. params/demo/)")
    if not any((params_dir / f"{name}.yaml").exists() for name in ["common", *STAGE_MODULES]):
        raise ParamsError(f"{params_dir} holds no parameter files (common.yaml, {STAGES[0]}.yaml, ...); "
                          f"pass a folder like params/demo/")
    requested = parse_stages(stages)
    chosen = requested or default_stages(params_dir)
    nb_dir = user_path(notebooks_dir) if notebooks_dir else project_root() / "notebooks"
    if output_root:  # the stages' default folders follow it (in this process and the kernels it starts)
        os.environ["EAGLE3NB_OUTPUTS"] = str(Path(output_root).expanduser().resolve())
    root = outputs_root()
    values, stage_dirs, problems, notes = {}, {}, [], []
    for stage in chosen:
        if not (params_dir / f"{stage}.yaml").exists():
            notes.append(f"{stage}: no {stage}.yaml in {rel(params_dir)}; the notebook's defaults apply")
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



def rel(path: str | Path | None) -> str:
    """A path as the user would type it: relative to the cwd when below it."""
    if path is None:
        return "-"
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)
