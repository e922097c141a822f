"""Stage 01 (``notebooks/01_synth.ipynb``): ask the target to answer prompts, keep its reasoning, and build the
exact training token stream. ``stage.run(P)`` does the work, ``report`` shows what it wrote, ``data.samples``
reads it.

Light to import (the CLI and ``eagle3nb status`` import it for the schema).
"""

from eagle3nb.synth.params import SynthParams

__all__ = ["SynthParams"]
