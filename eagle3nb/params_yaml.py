"""The parameter files: one YAML file read strictly (a key given twice is an error), a run folder's
``common.yaml`` layered under each stage's file, and ``KEY=VALUE`` overrides, as raw values for
``eagle3nb.params.from_dict`` to validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from eagle3nb.params import COMMON, HANDED, ParamsError, schema_for


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                lines = f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice ({lines}): keep one",
                                                        key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read one parameter file; malformed YAML or a key given twice is an error naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else None
        data = yaml.load(text, Loader=_UniqueKeyLoader) if text is not None else None
    except UnicodeDecodeError:
        raise ParamsError(f"{path}: not UTF-8 text; a parameter file is YAML text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ParamsError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of parameter: value, got {type(data).__name__}")
    return data


def run_params(run_dir: Path, stage: str) -> dict[str, Any]:
    """A stage's raw values for a run folder: ``common.yaml`` (keys the stage knows) layered under
    ``<stage>.yaml``. ``run_name`` defaults to the folder name and ``params_file`` to the stage file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ParamsError(f"{run_dir}: no such parameter folder; create it or pass params/<run>/")
    cls = schema_for(stage)
    common = load_yaml(run_dir / "common.yaml")
    values = {k: v for k, v in common.items() if k in cls.model_fields}
    stage_file = run_dir / f"{stage}.yaml"
    own = load_yaml(stage_file)
    values.update(own)
    values.setdefault("run_name", run_dir.name)
    values.setdefault("params_file", str(stage_file))
    from_common = sorted(k for k in values if k in common and k not in own)
    if from_common:
        values[COMMON] = {"file": str(run_dir / "common.yaml"), "keys": from_common}
    handed = handoffs(run_dir, stage, values)
    if handed:
        values.update({key: value for key, (value, _) in handed.items()})
        values[HANDED] = {key: where for key, (_, where) in handed.items()}
    return values


def handoffs(run_dir: Path, stage: str, values: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """What the run's plan hands ``stage`` from another stage's file in ``run_dir`` (:data:`HANDOFFS`), for the keys
    ``values`` does not set itself: key -> (value, where it came from)."""
    if stage not in HANDOFFS:
        return {}
    source, keys = HANDOFFS[stage]
    if not (run_dir / f"{source}.yaml").is_file():
        return {}
    theirs = run_params(run_dir, source)
    return {ours: (theirs[key], f"{run_dir / source}.yaml's {key}") for key, ours in keys.items()
            if key in theirs and ours not in values}


def injectable(values: dict[str, Any]) -> dict[str, Any]:
    """A stage's values as papermill injects them into its notebook (without run_params' bookkeeping)."""
    return {k: v for k, v in values.items() if k not in (COMMON, HANDED)}


def stage_values(stage: str, source: Path, overrides: list[str]) -> dict:
    """The stage's raw values from a run folder (``common.yaml`` under the stage file) or one YAML file,
    with ``KEY=VALUE`` overrides (values parsed as YAML)."""
    if not source.exists():
        raise ParamsError(f"{source} does not exist; pass params/<run>/ or params/<run>/{stage}.yaml")
    if source.is_dir():
        values = run_params(source, stage)
    else:
        values = {"run_name": source.parent.name, **load_yaml(source), "params_file": str(source)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ParamsError(f"--set {item!r}: use KEY=VALUE")
        values[key] = yaml.safe_load(value)
    return values


# What the run's plan hands a stage from another stage's settings, resolved once here, where a run folder is read, so
# that no stage reads another stage's file: stage -> (the stage it takes from, {that stage's key: this stage's key}).
# 02 extracts the layers of the draft 03 trains (its method's recipe, at its depth) when its aux_layer_ids is unset.
# 06 serves its candidates at the concurrencies 04 sweeps, unless its own file names others.
HANDOFFS: dict[str, tuple[str, dict[str, str]]] = {
    "02_hidden_states": ("03_train", {"method": "draft_method", "num_layers": "draft_num_layers"}),
    "06_select": ("04_acceptance", {"concurrency_levels": "concurrencies"}),
}
