"""eagle3nb: train and judge speculative-decoding draft models (EAGLE-3, DFlash, DSpark) for large reasoning LLMs.

The five notebooks in ``notebooks/`` narrate; this package does the work. Stages: ``synth`` (01), ``hidden`` (02),
``train`` (03), ``accept`` (04); below them a core (``drafts``, ``verification``, ``decoder``, ``formulas``, ...), above
them ``refresh`` (05, on request), ``serve``, ``doctor`` and ``run``.
"""

__version__ = "0.1.0"
