"""Speculative decoding here (04's local check and benchmark sets, the embedded server's ``--draft``), by what each
part does: ``verify`` (which drafted tokens the target keeps, sampling, counters), ``padded`` (one KV cache shared
by rows of different lengths), ``batch`` (``SpecDecoder`` and the continuously batched ``SpecBatch``, drafting
through the draft algorithm's ``eagle3nb.drafts`` interface) and ``reference`` (the same for one sequence, no
padding: read it first)."""
