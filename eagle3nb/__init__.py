"""eagle3nb: train and judge EAGLE-3 draft models for large reasoning LLMs.

The four notebooks in ``notebooks/`` narrate; this package does the work. Stages:
``synth`` (01), ``hidden`` (02), ``train`` (03), ``accept`` (04); below them a core (``draft``, ``spec``,
``formulas``, ...), above them ``serve``, ``doctor`` and ``run``.
"""

__version__ = "0.1.0"
