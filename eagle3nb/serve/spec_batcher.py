"""Speculative decoding inside the embedded server (``eagle3nb serve --draft DIR --num-speculative-tokens k``).

The engine's swappable decoder (``join`` / ``step`` / ``leave``, see ``eagle3nb.serve.batcher``), batched like
vLLM's: every running request sits in one ``eagle3nb.decoder.batch.SpecBatch``, so a step is one round for all of them
(one batched draft run per drafted position, one target forward verifying every request's k drafts, each
request accepting its own run) and requests join and leave between steps. Lossless per request: greedy is
the plain server's output, sampling keeps the target's distribution with the request's own generator.

Counters are vLLM's, by vLLM's names (``eagle3nb.formulas``), so 04 reads this server and vLLM alike, counted
per request round as vLLM does; ``BATCH_ROUNDS`` (ours) counts rounds by how many requests shared them.
"""

from __future__ import annotations

from pathlib import Path

from eagle3nb.formulas import VLLM_ACCEPTED, VLLM_DRAFT_TOKENS, VLLM_DRAFTS, VLLM_PER_POS

BATCH_ROUNDS = "eagle3nb:spec_decode_batch_rounds_total"


class SpecEngine:
    """Decoder for ``Engine``: chain speculative decoding of the running requests, k drafted tokens a step."""

    def __init__(self, model, tokenizer, draft_dir: Path, num_speculative_tokens: int, metrics):
        from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
        from eagle3nb.drafts import load_draft

        embed, head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
        draft = load_draft(draft_dir, embed_tokens=embed, lm_head=head, device=model.device, dtype=model.dtype)
        self.batch = SpecBatch(SpecDecoder(model, draft, num_speculative_tokens))
        self.k = num_speculative_tokens
        self.running: list = []
        self.c_drafts = metrics.counter(VLLM_DRAFTS, "Number of spec decoding drafts.")
        self.c_draft_tokens = metrics.counter(VLLM_DRAFT_TOKENS, "Number of draft tokens.")
        self.c_accepted = metrics.counter(VLLM_ACCEPTED, "Number of accepted tokens.")
        self.c_pos = metrics.counter(VLLM_PER_POS, "Accepted tokens per draft position.")
        self.c_batch = metrics.counter(BATCH_ROUNDS, "Speculative rounds (one target verify pass) by the number "
                                                     "of requests verified together.")
        for c in (self.c_drafts, self.c_draft_tokens, self.c_accepted):
            c.inc(0.0)
        for i in range(self.k):
            self.c_pos.inc(0.0, position=i)

    def join(self, reqs: list) -> list:
        """Prefill the new requests together, add them to the batch and return their first tokens."""
        from eagle3nb.verification.verify import Sampling

        first = self.batch.add([r.prompt_ids + r.output_ids for r in reqs],
                               [Sampling(r.params.temperature, r.params.top_p, r.generator) for r in reqs])
        self.running += reqs
        return [(r, [t]) for r, t in zip(reqs, first)]

    def step(self) -> list:
        """One speculative round for every running request: its accepted drafts plus the target's next token."""
        new = self.batch.round()
        self.c_batch.inc(1, batch_size=len(new))
        for toks in new:
            n = len(toks) - 1
            self.c_drafts.inc(1)
            self.c_draft_tokens.inc(self.k)
            self.c_accepted.inc(n)
            for i in range(n):
                self.c_pos.inc(1, position=i)
        return list(zip(self.running, new))

    def leave(self, reqs: list) -> None:
        gone = {id(r) for r in reqs}
        keep = [i for i, r in enumerate(self.running) if id(r) not in gone]
        self.running = [self.running[i] for i in keep]
        self.batch.keep(keep)
