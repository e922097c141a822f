"""The speculative decoder here (04's local check and benchmark sets, the embedded server's ``--draft``): ``batch``
(``SpecDecoder`` and the continuously batched ``SpecBatch``, drafting through the draft algorithm's
``eagle3nb.drafts`` interface) and ``reference`` (the same for one sequence, no padding: read it first). It sits
above ``eagle3nb.drafts``; the primitives it and the drafts share are below both, in ``eagle3nb.verification``."""
