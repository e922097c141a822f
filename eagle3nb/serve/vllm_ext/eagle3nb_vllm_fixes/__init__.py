"""A vLLM general plugin with eagle3nb's fixes for defects of vLLM's CPU build, loaded by vLLM (never by eagle3nb).

vLLM finds it through the ``vllm.general_plugins`` entry point declared in the ``.dist-info`` folder beside this
package, so putting that folder (``eagle3nb/serve/vllm_ext/`` of the installed package) on vLLM's ``PYTHONPATH`` is
all it takes: every vLLM the project starts has it (``eagle3nb.serve.vllm.start_vllm``), and a user who starts vLLM
on a CPU adds one line (docs/vllm.md). Each fix first tests for its defect and replaces vLLM's function only where
the defect is present, then runs its test again through the replacement; a fixed vLLM, or vLLM on a GPU, is left
alone. A fix that cannot run (a private name vLLM renamed, a changed signature) is skipped with one warning and the
others still install (``guard.guarded``). Standalone on purpose: it runs in vLLM's environment, where eagle3nb is
not installed.
"""

from __future__ import annotations

import importlib

from eagle3nb_vllm_fixes.guard import guarded

FIXES = ("sampling", "rotary", "blocksize", "grouped_norm")


def register() -> None:
    """vLLM's entry point: install each fix on its own (called once per process, in the API server, engine core
    and workers); a fix that fails is skipped, never the server."""
    for name in FIXES:
        fix = importlib.import_module(f"eagle3nb_vllm_fixes.{name}")  # torch at the top, every vLLM name inside
        guarded(name, fix.install, fix.WITHOUT)
    # not a fix: the profile of the served rounds 04 predicts an endpoint from, only where EAGLE3NB_VLLM_ROUNDS
    # names its file (rounds.py)
    from eagle3nb_vllm_fixes import parent, rounds

    guarded("rounds", rounds.install, "no profile of the served rounds is written")
    # not a fix either: a vLLM eagle3nb started stops when the process that started it is gone (parent.py)
    guarded("parent", parent.install, "this vLLM outlives the process that started it")
