"""The parameters' notebook side: ``validate(stage, globals())``, the first step of every notebook; the table of
the values that differ from the defaults it shows; and the notebooks' ``parameters`` cells, generated from the
schemas (``make params-cells``)."""

from __future__ import annotations

import html
import json
import re
import types
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3nb.errors import install_notebook_handler
from eagle3nb.params import StageParams, from_dict, schema_for
from eagle3nb.paths import project_root

# Names present in a notebook's globals that are never parameters.
_NOT_PARAMS = {"In", "Out", "get_ipython", "exit", "quit", "open"}


class ChangedTable:
    """The parameters of a run that differ from the schema's defaults, as a short table (HTML in a notebook, text
    elsewhere): what a colleague reading the report needs, not the long repr of every value."""

    def __init__(self, params: "StageParams"):
        cls = type(params)
        self.stage = cls.stage
        self.source = params.params_file
        self.total = len(cls.model_fields) - 1  # params_file is bookkeeping, not a setting
        self.rows: list[tuple[str, str, str, str]] = []
        for name, field in cls.model_fields.items():
            if name == "params_file":
                continue
            value, default = getattr(params, name), params.default_of(name)
            if _plain(value) != _plain(default):
                self.rows.append((name, repr(_plain(value)), repr(_plain(default)), field.description or ""))

    def caption(self) -> str:
        src = f" (from {self.source})" if self.source else ""
        if not self.rows:
            return f"{self.stage}: every parameter at its default{src}"
        return f"{self.stage}: {len(self.rows)} of {self.total} parameters differ from the defaults{src}"

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td><code>{html.escape(n)}</code></td><td><code>{html.escape(v)}</code></td>"
                        f"<td><code>{html.escape(d)}</code></td><td style='text-align:left'>{html.escape(h)}</td></tr>"
                        for n, v, d, h in self.rows)
        head = "<tr><th>parameter</th><th>value</th><th>default</th><th style='text-align:left'>what</th></tr>"
        return (f"<table class='changed-params'><caption style='text-align:left'>{html.escape(self.caption())}"
                f"</caption>{head if self.rows else ''}{cells}</table>")

    def __repr__(self) -> str:
        width = max((len(n) for n, *_ in self.rows), default=0)
        return "\n".join([self.caption()] + [f"  {n:<{width}}  {v}  (default {d})" for n, v, d, _ in self.rows])


def _plain(value: Any) -> Any:
    """A value as plain data (nested schema models as dicts), so values compare and print as the YAML wrote them."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def changed_table(params: "StageParams") -> ChangedTable:
    """What a notebook's validate cell shows: the parameters that differ from the schema's defaults."""
    return ChangedTable(params)


def from_notebook(stage: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """The parameter values in a notebook namespace: every public plain value (not modules/functions)."""
    out = {}
    for k, v in namespace.items():
        if k.startswith("_") or k in _NOT_PARAMS:
            continue
        if isinstance(v, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)):
            continue
        if callable(v):
            continue
        out[k] = v
    return out


def validate(stage: str, namespace: dict[str, Any]) -> StageParams:
    """Validate the parameters a notebook holds (its ``globals()``), as the notebook's first step; from here on
    a user error in the notebook's cells shows as its one line (``eagle3nb.errors``)."""
    install_notebook_handler()
    return from_dict(stage, from_notebook(stage, namespace))


NOTEBOOKS = {"01_synth": "notebooks/01_synth.ipynb", "02_hidden_states": "notebooks/02_hidden_states.ipynb",
             "03_train": "notebooks/03_train.ipynb", "04_acceptance": "notebooks/04_acceptance.ipynb",
             "05_refresh": "notebooks/05_refresh.ipynb", "06_select": "notebooks/06_select.ipynb"}


def _literal(value: Any) -> str:
    """A default as the Python literal a notebook cell holds (strings in double quotes, as papermill writes)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, BaseModel):
        return _literal(value.model_dump())
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def parameters_cell(stage: str) -> str:
    """The notebook's ``parameters`` cell, generated from the schema (``make params-cells``): one
    ``name = default  # description`` line per field, so the schema is the one home of defaults and help and
    a notebook opened in JupyterLab and run as it is runs the demo."""
    cls = schema_for(stage)
    return "\n".join(f"{name} = {_literal(f.default)}  # {_cell_help(f.description or '')}".rstrip()
                     for name, f in cls.model_fields.items())


_NO_EQUALS = {">=": " ≥ ", "<=": " ≤ ", "==": " equals ", "=": ": "}


def _cell_help(text: str) -> str:
    """A description as a cell comment papermill can read: its parser skips a line with a second ``=`` (and then
    warns "Passed unknown parameter" for every value run with it), so the comment says the same without one."""
    return re.sub(r"\s*(>=|<=|==|=)\s*", lambda m: _NO_EQUALS[m.group(1)], text)


def write_parameters_cells(root: Path | None = None) -> list[Path]:
    """Rewrite every notebook's ``parameters`` cell from its schema; returns the notebooks that changed."""
    changed = []
    for stage, rel in NOTEBOOKS.items():
        path = (root or project_root()) / rel
        nb = json.loads(path.read_text())
        cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
        source = parameters_cell(stage).splitlines(keepends=True)
        if cell["source"] != source:
            cell["source"] = source
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            changed.append(path)
    return changed
