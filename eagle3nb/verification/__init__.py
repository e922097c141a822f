"""The decoding core below the draft algorithms: ``verify`` (which drafted tokens the target keeps, sampling,
counters) and ``padded`` (one KV cache shared by rows of different lengths). It imports no draft; the drafts'
drafting steps and the decoder above them (``eagle3nb.decoder``) import it."""
