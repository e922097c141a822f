"""Block drafters: DFlash and, on its backbone with a Markov and a confidence head, DSpark (``markov_rank > 0``).

``model`` the network (no I/O), ``objective`` its training loss, ``layouts`` its checkpoints (vLLM's and
speculators'), ``drafting`` a block's drafting step and greedy local decoding, ``offline`` acceptance by block
position on stored states. docs/block-drafters.md explains the model, the layouts and the layer-id convention.
"""

METHODS = ("dflash", "dspark")  # the draft config's method names this package serves
