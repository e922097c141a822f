"""Draft algorithms, one package each, and the registry every caller reaches them through.

Each package ``eagle3nb/drafts/<method>/`` has the same files (as vllm-project/speculators'
``src/speculators/models/<algo>/``): ``model.py`` the model (no I/O, ``# shape:`` lines), ``objective.py`` its
training objective, ``layouts.py`` its checkpoint layouts (ours, vLLM's, speculators', SGLang's), ``drafting.py``
its step in the batched decoder, ``offline.py`` 04's offline acceptance simulation, ``method.py`` whose classes
subclass ``eagle3nb.drafts.base.DraftMethod`` (the contract: ``claims``, ``load``, ``save``, ``config_json``,
``objective``, ``drafting``, ``chain_acceptance``, ``fresh``, ``serving_problems``, ``tensor_problems``,
``check_usable``), one per method it serves (``dflash`` serves DFlash, DSpark and DFlash2, DFlash's backbone with
more heads), and a light ``__init__.py`` (no torch: 03's parameters read it while validating) holding ``NUM_LAYERS``
(:func:`fresh_num_layers`), ``PARAMS`` (its own 03 settings, which 03's schema assembles), ``RULES`` (each method's
``base.MethodRules``: :func:`rules`, :func:`block_methods`, :func:`params_readers`) and ``method_named(name)``, which
imports its ``method.py`` on first use.

This module imports each light package for real (:data:`PACKAGES`), so a call such as ``get(name).fresh(...)`` is
followed into the method's package by a reader or a tool. Every model has a ``method`` attribute (its name here)
and a ``config`` with ``vocab_size``, ``draft_vocab_size``, ``target_hidden_size`` and ``aux_layer_ids``; ``d2t`` /
``t2d`` buffers and ``draft_to_target(ids)``. 03, 04, the decoder, the embedded server, the doctor and the export
call only this module: :func:`get` by name, :func:`of` a model, :func:`method_of` a config.json, :func:`load_draft` a
folder (03's EAGLE-3 parameters aside, the imports ``tests/test_architecture.py`` names). A new algorithm is its
package plus one line in ``PACKAGES`` (docs/ARCHITECTURE.md "Draft algorithms").
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from eagle3nb.drafts import dflash, eagle3, lilicorr
from eagle3nb.drafts.base import (
    DraftMethod,
    DraftMismatchError,
    MethodRules,
    Misfit,
    ServedTarget,
    Serving,
    ServingError,
    check_fits,
)
from eagle3nb.layers import default_aux_layer_ids

__all__ = ["DEFAULT", "PACKAGES", "DraftMethod", "DraftMismatchError", "MethodRules", "Misfit", "ServedTarget",
           "Serving", "ServingError", "block_methods", "check_fits", "check_serving", "declared_method",
           "fresh_num_layers", "get", "load_draft", "method_layer_ids", "method_of", "of", "one_forward_per_round",
           "packages", "params_readers", "rules", "served_as", "served_method", "serving_problems"]

# method name -> the package whose METHODS holds it (its light __init__, imported here: no torch); the first
# claims a config.json before the others. A method is its package plus one line here.
PACKAGES: dict[str, ModuleType] = {
    "eagle3": eagle3,
    "dflash": dflash,
    "dspark": dflash,
    "dflash2": dflash,
    "lilicorr": lilicorr,
}
DEFAULT = "eagle3"  # 03's method when none is set, and every 03 run's before the choice existed


def get(name: str) -> DraftMethod:
    """The draft algorithm called ``name``."""
    if name not in PACKAGES:
        raise DraftMismatchError(f"unknown draft method {name!r}; known: {', '.join(PACKAGES)}")
    return PACKAGES[name].method_named(name)


def fresh_num_layers(name: str) -> int:
    """A fresh ``name`` draft's decoder layers when 03's ``num_layers`` is null: its package's ``NUM_LAYERS``, read
    without building its ``METHODS`` (no torch: 03's parameters resolve it while validating)."""
    return PACKAGES[name].NUM_LAYERS


def rules(name: str) -> MethodRules:
    """What callers read of method ``name`` before any torch import: its package's ``RULES`` entry."""
    return PACKAGES[name].RULES[name]


def served_as(name: str) -> str:
    """The ``method`` of vLLM's ``--speculative-config`` that serves a ``name`` draft (its own name but where its
    rules say otherwise: DFlash2 is served as ``dflash``)."""
    return rules(name).served_as or name


def declared_method(draft_dir: str | Path) -> str:
    """The registered method the draft in ``draft_dir`` is, by its config.json."""
    path = Path(draft_dir)
    return method_of(json.loads((path / "config.json").read_text()), str(path)).name


def served_method(draft_dir: str | Path) -> str:
    """The ``method`` vLLM serves the draft in ``draft_dir`` as: :func:`served_as` of the method its config.json
    declares (what 05's served A/B and ``eagle3nb serve`` start it with, never a name written at the call)."""
    return served_as(declared_method(draft_dir))


def method_layer_ids(name: str, target_layers: int, draft_layers: int | None = None) -> list[int]:
    """The target layers (HF/vLLM ids) a fresh ``name`` draft of ``draft_layers`` layers (None: its package's
    depth) reads by its recipe: its rules' ``layer_ids``, else EAGLE-3's ``[2, L//2, L-3]``; what 02 extracts for a
    run training it when 02's aux_layer_ids is unset, and what 03 holds such states to."""
    pick = rules(name).layer_ids
    return pick(target_layers, draft_layers or fresh_num_layers(name)) if pick else default_aux_layer_ids(target_layers)


def block_methods() -> tuple[str, ...]:
    """The registered block drafters (one forward drafts a block), in the registry's order."""
    return tuple(name for name in PACKAGES if rules(name).block)


def packages() -> list[ModuleType]:
    """The registered draft packages, each once, in the registry's order."""
    return list(dict.fromkeys(PACKAGES.values()))


def params_readers(key: str) -> tuple[str, ...]:
    """The methods that read 03's setting ``key`` of those only some read (``MethodRules.params``)."""
    return tuple(name for name in PACKAGES if key in rules(name).params)


def of(model: Any) -> DraftMethod:
    """The algorithm of a draft model (its ``method`` attribute)."""
    return get(model.method)


def one_forward_per_round(model: Any) -> bool:
    """Whether the draft proposes a round's tokens in one forward (a P-EAGLE draft's mask slots, a block drafter's
    block: both have a ``mask_token_id``), so 04 and the doctor charge one draft forward per round, not k."""
    return getattr(model.config, "mask_token_id", None) is not None


def method_of(config: dict[str, Any], where: str = "config.json") -> DraftMethod:
    """The algorithm that reads a draft whose config.json is ``config``."""
    for name in PACKAGES:
        method = get(name)
        if method.claims(config):
            return method
    known = ", ".join(f"{name} ({get(name).title})" for name in PACKAGES)
    raise DraftMismatchError(f"{where}: {declared(config)} is not a draft this package reads (methods: {known})")


def declared(config: dict[str, Any]) -> str:
    """What in a config.json names its kind of draft, for messages: its speculators_model_type or architectures."""
    if config.get("speculators_model_type"):
        return f"speculators_model_type {config['speculators_model_type']!r}"
    return f"architectures {config.get('architectures') or []}"


def serving_problems(draft_dir: str | Path, serving: Serving) -> list[Misfit]:
    """Why vLLM would serve the draft in ``draft_dir`` wrong as ``serving`` says, (what, fix) pairs ([] when it
    fits): first the method (a checkpoint served as another method than it declares is built as that method's
    model on its weights), then its method's own rules (``DraftMethod.serving_problems``)."""
    path = Path(draft_dir)
    if not (path / "config.json").is_file():
        return [(f"{path} has no config.json", "point the draft at a checkpoint folder (03_train's draft/)")]
    config = json.loads((path / "config.json").read_text())
    try:
        method = method_of(config, str(path))
    except DraftMismatchError as e:
        return [(str(e), f"serve a draft of one of the methods {', '.join(PACKAGES)}")]
    if served_as(method.name) != serving.method:  # DFlash2 is vLLM's dflash, its model chosen by architecture
        return [(f"{path} holds a draft of method {method.name} ({declared(config)}) served as {serving.method}: vLLM "
                 f"would build its {get(serving.method).title} model on these weights",
                 f"set {serving.method_field} to {served_as(method.name)}")]
    return method.serving_problems(path, config, serving)


def check_serving(draft_dir: str | Path, serving: Serving) -> None:
    """Raise ServingError, one line naming each misfit and its fix, when :func:`serving_problems` finds any."""
    problems = serving_problems(draft_dir, serving)
    if problems:
        raise ServingError("; ".join(f"{what}: {fix}" for what, fix in problems))


def load_draft(path: str | Path, **kwargs: Any) -> Any:
    """Load the draft in folder ``path`` with its algorithm's ``load`` (``embed_tokens``, ``device``, ``dtype``,
    ``lm_head``)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found; point at a draft checkpoint folder (config.json + "
                                "model.safetensors)")
    return method_of(json.loads(cfg_file.read_text()), str(path)).load(path, **kwargs)
