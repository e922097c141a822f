"""The parameter files: one YAML file read strictly (a key given twice is an error), a run folder's
``common.yaml`` layered under each stage's file, and ``KEY=VALUE`` overrides, as raw values for
``eagle3nb.params.from_dict`` to validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from eagle3nb.drafts import DEFAULT, PACKAGES
from eagle3nb.params import COMMON, ParamsError, StageError, schema_for


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
    return values


def injectable(values: dict[str, Any]) -> dict[str, Any]:
    """A stage's values as papermill injects them into its notebook (without run_params' bookkeeping)."""
    return {k: v for k, v in values.items() if k != COMMON}


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


TRAIN_STAGE = "03_train"  # the stage whose method 02's default layers are for


def run_method(params_file: str | None) -> tuple[str, int | None]:
    """The 03 ``method`` and ``num_layers`` of the run whose parameter folder holds ``params_file`` (02's or 03's):
    the draft 02's states are for. EAGLE-3 (the registry's default) outside a run folder or where 03 names none."""
    folder = Path(params_file).parent if params_file else None
    if folder is None or not (folder / f"{TRAIN_STAGE}.yaml").is_file():
        return DEFAULT, None
    raw = run_params(folder, TRAIN_STAGE)
    method = raw.get("method") or DEFAULT
    if method not in PACKAGES:
        raise StageError(f"{folder / TRAIN_STAGE}.yaml: method {method!r} is not one of {', '.join(PACKAGES)}; 02 "
                         "extracts the layers that method reads: fix 03's method, or set 02's aux_layer_ids")
    return method, raw.get("num_layers")
