"""The candidates a selection tries and what training them takes: every registered method's own recipes (its rules'
``recipes``), or the user's list; recipes that differ only in a chain drafter's k share one training (one draft
served at each k), and trainings whose states are the same (the target layers their method reads, the vocabulary
they draft over) share one extraction by 02. No method is named here: the registry says what each reads."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3nb.drafts import PACKAGES, declared_method, fresh_num_layers, method_layer_ids, rules
from eagle3nb.params import ParamsError, from_dict, schema_for
from eagle3nb.paths import resolve

# 03's and 02's settings the selection sets itself for each training and extraction (the user's are refused there)
OWN_TRAIN = ("data_dir", "output_dir", "max_steps", "run_name", "params_file")
OWN_HIDDEN = ("synth_dir", "output_dir", "model_path", "run_name", "params_file", "draft_method", "draft_num_layers",
              "aux_layer_ids")
K = "num_speculative_tokens"


def slug(text: str) -> str:
    """A folder name for ``text``: its letters and digits, the rest one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def recipe_name(method: str, settings: dict[str, Any]) -> str:
    """``<method> k=<k>``, then its own settings in brackets (a flag by its name): how a recipe reads in a table."""
    rest = [key if value is True else f"{key}={value}" for key, value in settings.items()
            if key not in ("method", K) and value is not False]
    return f"{method} k={settings[K]}" + (f" ({', '.join(rest)})" if rest else "")


@dataclass
class Candidate:
    """One recipe: what it is called, its method, the k it is served at, the 03 settings that train it (None for a
    draft given as it is) and the training it shares."""

    name: str
    method: str
    k: int
    settings: dict[str, Any] | None
    draft: Path | None = None
    training: str | None = None

    @property
    def slug(self) -> str:
        return slug(self.name)


@dataclass
class Training:
    """One 03 run: its settings (k the largest of the candidates it serves), the extraction it reads, its
    candidates."""

    slug: str
    settings: dict[str, Any]
    need: str
    candidates: list[str] = field(default_factory=list)


@dataclass
class Need:
    """One 02 extraction: the target layers and the draft vocabulary of the trainings that read it, extracted as
    the first one's method at its depth asks (recorded in 02's ``layers_for``)."""

    slug: str
    layer_ids: list[int]
    vocab: int
    method: str
    num_layers: int


@dataclass
class Plan:
    candidates: list[Candidate]
    trainings: dict[str, Training]
    needs: dict[str, Need]


def registry_candidates(train: dict[str, Any], per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every registered method's own recipes (``MethodRules.recipes``), in the registry's order, as the user's list
    would give them: ``{name, <03 settings>}``, the shared and the per-method settings under each recipe's own."""
    out = []
    for method in PACKAGES:
        for recipe in rules(method).recipes:
            own = {"method": method, **recipe}
            out.append({"name": recipe_name(method, own), **train, **per_method.get(method, {}), **own})
    return out


def rows(candidates: list[Any] | None, train: dict[str, Any], per_method: dict[str, dict[str, Any]]
         ) -> list[dict[str, Any]]:
    """Each candidate as ``{name, draft, <its 03 settings>}``: the user's list (``Candidate`` models of the
    parameters) or, for None, every registered method's recipes; the shared and per-method settings under each
    candidate's own."""
    if candidates is None:
        return [{"draft": None, **row} for row in registry_candidates(train, per_method)]
    return [{"name": c.name, "draft": c.draft, **train, **per_method.get(c.method, {}), **c.settings}
            for c in candidates]


def check_all(candidates: list[Any] | None, train: dict[str, Any], per_method: dict[str, dict[str, Any]],
              hidden: dict[str, Any], src: str = "06_select") -> None:
    """Every candidate to train checked by 03's schema, and the settings the selection sets itself refused in
    ``train`` / ``hidden``: one line naming the candidate and the setting, before any work."""
    own = sorted(set(train) & set(OWN_TRAIN)) + sorted(set(hidden) & set(OWN_HIDDEN))
    if own:
        raise ParamsError(f"{src}: {', '.join(own)} set by the selection itself for each candidate; remove them from "
                          "train / hidden")
    for row in rows(candidates, train, per_method):
        if not row["draft"]:
            check(row["name"], {k: v for k, v in row.items() if k not in ("name", "draft")})


def plan(candidates: list[Any] | None, train: dict[str, Any], per_method: dict[str, dict[str, Any]],
         num_layers: int, vocab_size: int, hidden: dict[str, Any], src: str = "06_select") -> Plan:
    """The candidates (:func:`rows`, checked by :func:`check_all`), their trainings and extractions; ``num_layers``
    / ``vocab_size``: the target's."""
    check_all(candidates, train, per_method, hidden, src)
    chain_vocab = hidden.get("draft_vocab_size",
                             schema_for("02_hidden_states").model_fields["draft_vocab_size"].default)
    out = Plan([], {}, {})
    for row in rows(candidates, train, per_method):
        name, given = row.pop("name"), row.pop("draft")
        if given:
            draft = resolve(given)
            out.candidates.append(Candidate(name, declared_method(draft), row[K], None, draft))
            continue
        method = row["method"]
        block = rules(method).block
        key = {k: v for k, v in row.items() if block or k != K}  # a chain drafter's k: served, not trained
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        tslug = f"{slug(method)}-{digest[:8]}"
        depth = row.get("num_layers") or fresh_num_layers(method)
        ids = method_layer_ids(method, num_layers, depth)
        vocab = vocab_size if block else chain_vocab
        nslug = f"layers-{'-'.join(map(str, ids))}-vocab-{vocab}"
        out.needs.setdefault(nslug, Need(nslug, ids, vocab, method, depth))
        training = out.trainings.setdefault(tslug, Training(tslug, dict(row), nslug))
        training.settings[K] = max(training.settings[K], row[K])
        training.candidates.append(name)
        out.candidates.append(Candidate(name, method, row[K], row, training=tslug))
    for t in out.trainings.values():
        check(" / ".join(t.candidates), t.settings)  # the shared training at its largest k
    return out


def check(name: str, settings: dict[str, Any]) -> None:
    """03's schema on a candidate's settings (paths not checked: 02 makes them), as one line naming it."""
    try:
        from_dict("03_train", {**settings, "max_steps": 1}, source=f"candidate {name!r}", check_paths=False)
    except ParamsError as e:
        raise ParamsError("; ".join(str(e).splitlines())) from None
