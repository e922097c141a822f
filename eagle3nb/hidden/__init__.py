"""Stage 02 (``notebooks/02_hidden_states.ipynb``): run the target over 01's token stream and store the hidden
states EAGLE-3 trains on. ``stage.run(P)`` does the work, ``report`` shows what it wrote, ``reader.HiddenStates``
reads it (03 and 04 do); ``cost`` compares the compact storages. Light to import: torch loads on first use.
"""

from eagle3nb.hidden.params import HiddenParams

__all__ = ["HiddenParams"]
