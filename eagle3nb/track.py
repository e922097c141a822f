"""One tracking hook for every stage, so a run's numbers reach the experiment trackers its users keep.

A stage with ``report_to: [mlflow, tensorboard, ...]`` calls :func:`stage_done` once at its end (after
``metrics.json`` and its figures are written): every numeric leaf of ``metrics.json`` goes out as
``<stage>/<key>/<subkey>`` and every PNG in the stage folder as a figure. 03 also sends each row of its curve
(:meth:`Tracker.log_step`, step = optimizer step). In MLflow the whole pipeline is ONE run, found again by the
``run_name``: the stage prefixes keep the four stages apart inside it, and one row per pipeline run is what the
runs table compares (01's throughput beside 04's acceptance); a parent with four children would spread a run over
four rows. Re-running a stage (resume) reopens that run and logs only what is new.

Backends: ``tensorboard`` (``<stage_dir>/tensorboard``), ``mlflow`` (``tracking_uri``, else $MLFLOW_TRACKING_URI,
else ``sqlite:///<run folder>/mlflow.db`` with the artifacts beside it), and ``wandb`` / ``trackio`` where installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from eagle3nb.errors import UserError, scrub

NONE = "none"
# tracker -> (the modules it imports, what to pip install for them)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "mlflow": (("mlflow",), "mlflow-skinny"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
TRACK_EXTRA = ("tensorboard", "mlflow")  # what pyproject.toml's track extra installs
# MLflow's database stores (sqlite:///, postgresql://, ...) run on SQLAlchemy and alembic; http(s) servers do not.
MLFLOW_SQL = (("sqlalchemy", "alembic"), "sqlalchemy alembic")
MLFLOW_REMOTE = ("http", "https", "databricks", "file")
EXPERIMENT = "eagle3nb"  # the MLflow experiment; $MLFLOW_EXPERIMENT_NAME overrides, as MLflow's own clients read it
RUN_TAG = "eagle3nb.run_name"
_KEY = re.compile(r"[^\w./\- ]")  # characters MLflow and TensorBoard keys do not take


class TrackingError(UserError):
    """A tracker cannot be used as configured; the message names the package or setting to fix."""


def enabled(report_to: list[str]) -> list[str]:
    """The trackers asked for (``none`` names none)."""
    return [t for t in report_to if t != NONE]


def default_uri(run_dir: Path) -> str:
    """MLflow's store when nothing else is said: a sqlite file in the run's folder."""
    return f"sqlite:///{(run_dir / 'mlflow.db').as_posix()}"


def tracking_uri(P: Any) -> str:
    """The MLflow tracking URI: the ``tracking_uri`` parameter, else $MLFLOW_TRACKING_URI, else the run folder's
    sqlite file."""
    return P.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(P.stage_dir.parent)


def missing(report_to: list[str], uri: str | None) -> str | None:
    """One line naming the pip install that a tracker in ``report_to`` lacks (``uri``: MLflow's, None = the sqlite
    default), or None when every one can be imported."""
    for name in enabled(report_to):
        needs = [TRACKERS[name]]
        if name == "mlflow" and (uri or "sqlite:").split(":", 1)[0] not in MLFLOW_REMOTE:
            needs.append(MLFLOW_SQL)
        for modules, pip in needs:
            if any(importlib.util.find_spec(m) is None for m in modules):
                extra = " (or pip install 'eagle3nb[track]')" if name in TRACK_EXTRA else ""
                return f"report_to: {name} needs {pip}: pip install {pip}{extra}, or take {name} out of report_to"
    return None


def flat(values: Any, prefix: str) -> dict[str, float]:
    """The numeric leaves of a JSON value as ``prefix/key/subkey`` (list items by index); strings, booleans and
    nulls are not metrics."""
    if isinstance(values, bool) or values is None or isinstance(values, str):
        return {}
    if isinstance(values, (int, float)):
        return {_KEY.sub("_", prefix): float(values)}
    items = values.items() if isinstance(values, dict) else enumerate(values) if isinstance(values, list) else ()
    out: dict[str, float] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}/{k}"))
    return out


def _params(P: Any) -> dict[str, str]:
    """The stage's parameters as ``<stage>.<name>``: the text a tracker shows, with the API key (the value of the
    variable ``api_key_env`` names) and credentials inside URLs hidden, should any value carry them."""
    secret = os.environ.get(P.api_key_env) if getattr(P, "api_key_env", None) else None
    out = {}
    for name, value in P.model_dump(mode="json").items():
        text = scrub(value if isinstance(value, str) else json.dumps(value))
        out[f"{P.stage}.{name}"] = text.replace(secret, "<hidden>") if secret else text
    return out


class _TensorBoard:
    """Scalars and figures in ``<stage_dir>/tensorboard`` (``tensorboard --logdir outputs/<run>`` shows each
    stage as one of its runs)."""

    def __init__(self, P: Any, params: dict[str, str]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(P.stage_dir / "tensorboard"))

    def log_step(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def stage_done(self, values: dict[str, float], figures: dict[str, Path]) -> None:
        from matplotlib.image import imread

        self.log_step(values, 0)
        for key, png in figures.items():
            self.writer.add_image(key, imread(png), 0, dataformats="HWC")  # shape: [H, W, RGB(A)] floats in [0, 1]
        self.writer.close()


class _MLflow:
    """One MLflow run per ``run_name`` in the experiment: found again on every stage and re-run, created once."""

    def __init__(self, P: Any, params: dict[str, str]):
        from mlflow import MlflowClient

        for name in ("alembic", "mlflow.store.db.utils"):  # their INFO lines on every open of the sqlite store
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = tracking_uri(P)
        self.client = MlflowClient(uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        found = self.client.get_experiment_by_name(experiment)
        if found is None:  # a sqlite store keeps its figures beside its file
            where = Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts" if uri.startswith("sqlite:") else None
            exp_id = self.client.create_experiment(experiment, where.resolve().as_uri() if where else None)
        else:
            exp_id = found.experiment_id
        quote = '"' if "'" in P.run_name else "'"
        runs = self.client.search_runs([exp_id], f"tags.`{RUN_TAG}` = {quote}{P.run_name}{quote}",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        run = runs[0] if runs else self.client.create_run(exp_id, tags={RUN_TAG: P.run_name}, run_name=P.run_name)
        self.run_id, self.stage = run.info.run_id, P.stage
        self.client.update_run(self.run_id, status="RUNNING")
        self.logged = run.data.metrics  # key -> latest value, so a re-run logs only what changed
        self.seen: dict[str, int] = {}  # key -> last step in its history, so a resumed curve does not repeat
        new = {k: v for k, v in params.items() if k not in run.data.params}  # MLflow params never change
        self._batch(params=[(k, v[:6000]) for k, v in new.items()])  # 6000: the longest value MLflow keeps

    def _batch(self, metrics: list[tuple[str, float, int]] = (), params: list[tuple[str, str]] = ()) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        ms = [Metric(k, v, now, step) for k, v, step in metrics]
        ps = [Param(k, v) for k, v in params]
        for i in range(0, max(len(ms), len(ps)), 100):  # MLflow's batch limits (100 params, 1000 metrics)
            self.client.log_batch(self.run_id, metrics=ms[i:i + 100], params=ps[i:i + 100])

    def log_step(self, values: dict[str, float], step: int) -> None:
        for key in values.keys() - self.seen.keys():
            self.seen[key] = max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
        fresh = [(k, v, step) for k, v in values.items() if step > self.seen[k]]
        self._batch(metrics=fresh)
        self.seen.update({k: step for k, _, _ in fresh})

    def stage_done(self, values: dict[str, float], figures: dict[str, Path]) -> None:
        self._batch(metrics=[(k, v, 0) for k, v in values.items() if self.logged.get(k) != v])
        for png in figures.values():
            self.client.log_artifact(self.run_id, str(png), artifact_path=self.stage)
        self.client.set_tag(self.run_id, f"eagle3nb.{self.stage}", "done")
        self.client.set_terminated(self.run_id, "FINISHED")


class _WandbLike:
    """W&B or trackio (the same calls: init, log, Image, finish), one run per ``run_name``, resumed."""

    def __init__(self, module: str, P: Any, params: dict[str, str]):
        self.mod, self.stage = importlib.import_module(module), P.stage
        extra = {"id": re.sub(r"[^\w-]", "-", P.run_name), "dir": str(P.stage_dir.parent)} if module == "wandb" else {}
        self.mod.init(project=EXPERIMENT, name=P.run_name, config=params, resume="allow", **extra)

    def log_step(self, values: dict[str, float], step: int) -> None:
        self.mod.log({**values, f"{self.stage}/step": step})

    def stage_done(self, values: dict[str, float], figures: dict[str, Path]) -> None:
        self.mod.log({**values, **{k: self.mod.Image(str(png)) for k, png in figures.items()}})
        self.mod.finish()


def _backend(name: str, P: Any, params: dict[str, str]):
    if name == "tensorboard":
        return _TensorBoard(P, params)
    if name == "mlflow":
        return _MLflow(P, params)
    return _WandbLike(name, P, params)


class Tracker:
    """The trackers of one stage run (none when ``report_to`` names none, so callers never branch)."""

    def __init__(self, P: Any):
        self.stage, self.stage_dir = P.stage, P.stage_dir
        names = enabled(P.report_to)
        problem = missing(names, tracking_uri(P)) if names else None
        if problem:
            raise TrackingError(problem)
        params = _params(P) if names else {}
        self.backends = [_backend(name, P, params) for name in names]

    def log_step(self, row: dict[str, Any]) -> None:
        """One curve row (``kind`` train|eval, ``step``): its numbers as ``<stage>/<kind>/<key>`` at that step."""
        if self.backends:
            values = flat({k: v for k, v in row.items() if k not in ("kind", "step")},
                          f"{self.stage}/{row.get('kind', 'train')}")
            for b in self.backends:
                b.log_step(values, int(row["step"]))

    def stage_done(self) -> None:
        """The stage's ``metrics.json`` leaves and its figures (``<stage_dir>/*.png``), then close."""
        if not self.backends:
            return
        path = self.stage_dir / "metrics.json"
        values = flat(json.loads(path.read_text()), self.stage) if path.exists() else {}
        figures = {_KEY.sub("_", f"{self.stage}/{png.stem}"): png for png in sorted(self.stage_dir.glob("*.png"))}
        for b in self.backends:
            b.stage_done(values, figures)


def stage_done(P: Any) -> None:
    """The hook each stage's ``run(P)`` calls at its end: its metrics and figures to every tracker asked for."""
    Tracker(P).stage_done()
