"""eagle3nb: train and judge EAGLE-3 draft models for large reasoning LLMs.

The four notebooks in ``notebooks/`` narrate; this package does the work. Stages:
``synth`` (01), ``hidden`` (02), ``draft``/``train`` (03), ``accept``/``spec``/``bench`` (04).
"""

__version__ = "0.1.0"
