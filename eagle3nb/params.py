"""Typed, validated stage parameters: the schema base every stage's ``params.py`` builds on, and the stage registry.

Each stage defines a ``StageParams`` subclass (in its own module) and registers it under its notebook
name with ``@register("01_synth")``. A notebook's parameters cell holds plain literals; papermill injects
values from ``params/<run>/<NN_name>.yaml`` (read and layered by ``eagle3nb.params_yaml``); the next cell calls
``validate("01_synth", globals())`` (``eagle3nb.params_notebook``), whose ``from_dict`` turns every problem (unknown
key, wrong type, missing path) into one error naming the key, the file and the fix, before any work starts.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from eagle3nb.errors import UserError, has_credential
from eagle3nb.families import AUTO, FAMILIES, Family, detect
from eagle3nb.paths import outputs_root, resolve
from eagle3nb.toy import resolve_model_path
from eagle3nb.track import NONE, missing

STAGES = ["01_synth", "02_hidden_states", "03_train", "04_acceptance"]  # what a run runs unless told otherwise
# Run after those only when asked (``--stages``, or the stage's YAML in the run's folder): 05 needs traffic a
# deployment served, which a first run does not have; 06 trains and serves several drafts, hours where 03 takes one.
ON_REQUEST = ["05_refresh", "06_select"]
STAGE_MODULES = {  # every stage, in pipeline order
    "01_synth": "eagle3nb.synth",
    "02_hidden_states": "eagle3nb.hidden",
    "03_train": "eagle3nb.train",
    "04_acceptance": "eagle3nb.accept",
    "05_refresh": "eagle3nb.refresh",
    "06_select": "eagle3nb.select",
}
_REGISTRY: dict[str, type["StageParams"]] = {}


class ParamsError(UserError, ValueError):
    """A parameter problem, phrased for the person who wrote the YAML."""


class StageError(UserError, RuntimeError):
    """A stage cannot do faithful work with what it was given; the message says what to fix. Each stage's own
    errors derive from it, so every command line reports them the same way (``eagle3nb.stage_cli``)."""


class StageParams(BaseModel):
    """Base of every stage's schema: unknown keys are errors; common keys every stage has."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    stage: ClassVar[str] = ""

    run_name: str = Field("demo", description="names the output folder outputs/<run_name>/")
    params_file: str | None = Field(None, description="the YAML these values came from (set by eagle3nb run; named in "
                                                      "errors)")
    report_to: list[Literal["none", "tensorboard", "mlflow", "wandb", "trackio"]] = Field(
        [NONE], description="trackers that get the stage's metrics and figures, one run per run_name "
                            "(docs/tracking.md): none, or a list of tensorboard, mlflow, wandb, trackio")
    tracking_uri: str | None = Field(None, description="MLflow's tracking URI; null = $MLFLOW_TRACKING_URI, else "
                                                       "sqlite:///<run folder>/mlflow.db")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:
        """``report_to: mlflow`` is the list of that one (how 03's single value was written before)."""
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _trackers_installed(self) -> "StageParams":
        """A tracker's missing package is a one-line error before the stage starts, naming the pip install."""
        problem = missing(self.report_to, self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("api_key_env", check_fields=False)
    @classmethod
    def _key_is_a_name(cls, v: str | None) -> str | None:
        """Stages that talk to a server take the NAME of the variable holding the key, never the key."""
        if v and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("api_key_env is the NAME of an environment variable (e.g. VLLM_API_KEY), not the key")
        return v

    @property
    def stage_dir(self) -> Path:
        """This stage's output folder: ``output_dir`` if set, else ``outputs/<run_name>/<stage>``."""
        return self.out_dir(getattr(self, "output_dir", None), self.stage)

    def api_key(self) -> str:
        """The key from the environment variable ``api_key_env`` names (``EMPTY`` when none is named:
        vLLM's default accepts anything). Keys never live in parameter files."""
        name = getattr(self, "api_key_env", None)
        if not name:
            return "EMPTY"
        key = os.environ.get(name)
        if not key:
            raise ParamsError(f"api_key_env names {name!r} but that environment variable is not set: "
                              f"export {name}=<key> before starting, or set api_key_env: null")
        return key

    def out_dir(self, value: str | None, default_sub: str) -> Path:
        """Resolve a stage's output folder: the given value, else ``<outputs root>/<run_name>/<default_sub>``."""
        return resolve(value) if value else outputs_root() / self.run_name / default_sub

    def default_of(self, name: str) -> Any:
        """Field ``name``'s default for this run (what the changed-parameters table compares with): the schema's,
        unless a schema resolves a null default at validation."""
        return type(self).model_fields[name].get_default(call_default_factory=True)

    def check_paths(self) -> None:
        """Hook for schemas: raise ParamsError for paths that must exist (called by ``validate``)."""


class TargetParams(StageParams):
    """Base of the stages that load the target's tokenizer or weights from ``model_path`` (01, 02, 04)."""

    trust_remote_code: bool = Field(False, description="let transformers run Python code shipped in model_path (Kimi's "
                                                       "tokenizer needs it); off because that code runs with your "
                                                       "rights")
    family: str = Field(AUTO, description="the target's model family (docs/families.md: reasoning markers, thinking "
                                          "switch, end-of-turn token, server parser); auto = told from config.json "
                                          "and the chat template")
    _model_dir: tuple[str, Path] | None = PrivateAttr(None)
    _family: tuple[tuple[str, str], Family] | None = PrivateAttr(None)

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v != AUTO and v not in FAMILIES:
            raise ValueError(f"unknown model family {v!r}: use auto or one of {', '.join(FAMILIES)}")
        return v

    @property
    def model_dir(self) -> Path:
        """``model_path`` as a folder, resolved once: ``toy:smoke`` / ``toy:demo`` is built (or taken from the
        cache) on first use, any other value is checked to be a folder. Every stage reads the target from here."""
        model_path = getattr(self, "model_path")
        if self._model_dir is None or self._model_dir[0] != model_path:
            self._model_dir = (model_path, resolve_model_path(model_path))
        return self._model_dir[1]

    @property
    def target_family(self) -> Family:
        """The target's family (``eagle3nb.families``): the ``family`` parameter, or with ``auto`` the one
        ``model_dir``'s config.json and chat template name; resolved once per (model_path, family)."""
        key = (getattr(self, "model_path"), self.family)
        if self._family is None or self._family[0] != key:
            self._family = (key, detect(self.model_dir, self.family))
        return self._family[1]


def register(stage: str):
    """Class decorator: make ``validate(stage, ...)`` use this schema."""

    def deco(cls: type[StageParams]) -> type[StageParams]:
        cls.stage = stage
        _REGISTRY[stage] = cls
        return cls

    return deco


def schema_for(stage: str) -> type[StageParams]:
    if stage not in STAGE_MODULES:
        raise ParamsError(f"unknown stage {stage!r}; stages are {', '.join(STAGE_MODULES)}")
    if stage not in _REGISTRY:
        importlib.import_module(STAGE_MODULES[stage])
    return _REGISTRY[stage]


COMMON = "_common"  # bookkeeping key: {"file": common.yaml's path, "keys": [keys taken from it]} (params_yaml)
HANDED = "_handed"  # bookkeeping key: {key: where the run's plan took it from (another stage's file)} (params_yaml)


def _source(values: dict[str, Any], stage: str) -> str:
    if values.get("params_file"):
        return str(values["params_file"])
    return "the notebook's parameters (its parameters cell, or papermill's -p / -y / -f values)"


def _sources(values: dict[str, Any], stage: str, source: str | None) -> tuple[str, dict[str, str]]:
    """The stage's source and, per key, the file its value came from (common.yaml under a run's stage file)."""
    src = source or _source(values, stage)
    common = values.get(COMMON) or {}
    return src, {**{k: common["file"] for k in common.get("keys", ())}, **(values.get(HANDED) or {})}


def _fmt_loc(loc: tuple) -> str:
    return ".".join(str(x) for x in loc)


def from_dict(stage: str, values: dict[str, Any], source: str | None = None, check_paths: bool = True) -> StageParams:
    """Validate ``values`` against the stage schema; raise ParamsError naming key, file and fix.
    ``check_paths=False`` checks types only (for a production run prepared on another machine)."""
    cls = schema_for(stage)
    src, per_key = _sources(values, stage, source)
    values = {k: v for k, v in values.items() if k not in (COMMON, HANDED)}
    known = set(cls.model_fields)
    problems: list[str] = []
    for key, value in values.items():
        where = per_key.get(key, src)
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
            problems.append(f"unknown parameter {key!r} in {where}: remove it or rename it ({hint})")
        elif any(isinstance(v, str) and has_credential(v) for v in (value if isinstance(value, list) else [value])):
            problems.append(f"parameter {key!r} in {where} carries a credential inside its URL: write it as "
                            f"http://host:port and put the key in an environment variable named by api_key_env")
    if problems:
        raise ParamsError("\n".join(problems))
    try:
        params = cls(**values)
    except ValidationError as e:
        for err in e.errors():
            if not err["loc"]:  # a check across parameters: its message names them
                problems.append(f"{src}: {err['msg'].removeprefix('Value error, ')}")
                continue
            key = _fmt_loc(err["loc"])
            where = per_key.get(str(err["loc"][0]), src)
            # a value put where a key's variable NAME belongs may be the key itself: never echo it
            got = "<hidden>" if "key" in key else repr(err.get("input"))
            field = cls.model_fields.get(str(err["loc"][0]))
            want = f" ({field.description})" if field is not None and field.description else ""
            problems.append(
                f"parameter {key!r} in {where}: {err['msg']} (got {got}); "
                f"fix the value in {where}{want}"
            )
        raise ParamsError("\n".join(problems)) from None
    if check_paths:
        params.check_paths()
    return params
