"""A vLLM general plugin with eagle3nb's fixes for defects of vLLM's CPU build, loaded by vLLM (never by eagle3nb).

vLLM finds it through the ``vllm.general_plugins`` entry point declared in the ``.dist-info`` folder beside this
package, so putting this folder (``tools/vllm/``) on vLLM's ``PYTHONPATH`` is all it takes: every vLLM the project
starts has it (``eagle3nb.serve.vllm.start_vllm``), and a user who starts vLLM on a CPU adds one line
(docs/vllm.md). Each fix first tests for its defect and replaces vLLM's function only where the defect is present,
so a fixed vLLM, or vLLM on a GPU, is left alone; each says one line in the server log either way. Standalone on
purpose: it runs in vLLM's environment.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's entry point: install each fix (called once per process, in the API server, engine core and workers)."""
    from eagle3nb_vllm_fixes import blocksize, grouped_norm, rotary, sampling

    sampling.install()
    rotary.install()
    blocksize.install()
    grouped_norm.install()
