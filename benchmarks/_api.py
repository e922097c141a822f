"""Where the eagle3nb functions the benchmarks call live, across the stage-package refactor.

The stage packages are being reshaped (``eagle3nb.hidden.extract`` -> ``eagle3nb.hidden.stage.run``,
``eagle3nb.train.train`` -> ``eagle3nb.train.stage.run``, ``eagle3nb/accept.py`` -> ``eagle3nb/accept/``), so each
benchmark names a function by its candidate homes, newest first, and imports it lazily on first use.
Not a benchmark itself (``make bench`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

import importlib

CANDIDATES = {
    "extract": ("eagle3nb.hidden.stage:run", "eagle3nb.hidden.stage:extract", "eagle3nb.hidden:extract"),
    "train": ("eagle3nb.train.stage:run", "eagle3nb.train.stage:train", "eagle3nb.train:train"),
    "offline_acceptance": ("eagle3nb.accept.offline:offline_acceptance", "eagle3nb.accept:offline_acceptance"),
    "chain_logits": ("eagle3nb.accept.offline:chain_logits", "eagle3nb.accept:chain_logits"),
    "greedy_hidden_states": ("eagle3nb.accept.heldout:greedy_hidden_states",
                             "eagle3nb.accept.offline:greedy_hidden_states", "eagle3nb.accept:greedy_hidden_states"),
    "split_holdout": ("eagle3nb.train.data:split_holdout",),
    "TTTObjective": ("eagle3nb.train.ttt:TTTObjective",),
    "HiddenStates": ("eagle3nb.hidden.reader:HiddenStates", "eagle3nb.hidden:HiddenStates"),
    "from_dict": ("eagle3nb.params:from_dict",),
}


def get(name: str):
    """The first of ``CANDIDATES[name]`` that imports; an error naming every place tried otherwise."""
    tried = []
    for spec in CANDIDATES[name]:
        mod, attr = spec.split(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            tried.append(f"{spec} ({type(e).__name__}: {e})")
            continue
        if callable(obj):
            return obj
        tried.append(f"{spec} (not callable)")
    raise ImportError(f"eagle3nb has no {name} any more; tried: " + "; ".join(tried))
