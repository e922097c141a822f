"""Speculative decoding inside the embedded server (``eagle3nb serve --draft DIR --num-speculative-tokens k``).

The engine's swappable decoder (``join`` / ``step`` / ``leave``, see ``eagle3nb.serve.engine``). Each running
request keeps its own ``eagle3nb.spec.SpecSequence`` (target KV cache + draft KV cache); a step runs one
draft-and-verify round per request, one request after another. Requests are not batched together: each
is exactly lossless on its own and the code stays small, but throughput at high concurrency is lower than
a batched speculative engine (vLLM's) would reach, which the benchmark shows as it is.

Counters are vLLM's, by vLLM's names (``eagle3nb.formulas``), so 04 reads this server and vLLM alike.
"""

from __future__ import annotations

from pathlib import Path

from eagle3nb.formulas import VLLM_ACCEPTED, VLLM_DRAFT_TOKENS, VLLM_DRAFTS, VLLM_PER_POS


class SpecEngine:
    """Decoder for ``Engine``: chain speculative decoding of every running request, k drafted tokens a step."""

    def __init__(self, model, tokenizer, draft_dir: Path, num_speculative_tokens: int, metrics):
        from eagle3nb.draft import load_draft
        from eagle3nb.spec import SpecDecoder

        embed = model.get_input_embeddings().weight.detach()
        draft = load_draft(draft_dir, embed_tokens=embed, device=model.device, dtype=model.dtype)
        self.dec = SpecDecoder(model, draft, num_speculative_tokens)
        self.k = num_speculative_tokens
        self.running: list = []
        self.seqs: dict[str, object] = {}
        self.c_drafts = metrics.counter(VLLM_DRAFTS, "Number of spec decoding drafts.")
        self.c_draft_tokens = metrics.counter(VLLM_DRAFT_TOKENS, "Number of draft tokens.")
        self.c_accepted = metrics.counter(VLLM_ACCEPTED, "Number of accepted tokens.")
        self.c_pos = metrics.counter(VLLM_PER_POS, "Accepted tokens per draft position.")
        for c in (self.c_drafts, self.c_draft_tokens, self.c_accepted):
            c.inc(0.0)
        for i in range(self.k):
            self.c_pos.inc(0.0, position=i)

    def join(self, reqs: list) -> list:
        """Prefill each new request (its own caches) and return its first token."""
        out = []
        for r in reqs:
            seq = self.dec.sequence(r.prompt_ids + r.output_ids, r.params.temperature, r.params.top_p, r.generator)
            self.seqs[r.id] = seq
            out.append((r, [seq.prefill()]))
        self.running += reqs
        return out

    def step(self) -> list:
        """One speculative round per running request: its accepted drafts plus the target's next token."""
        out = []
        for r in self.running:
            seq = self.seqs[r.id]
            new = seq.round()
            n = len(new) - 1
            self.c_drafts.inc(1)
            self.c_draft_tokens.inc(self.k)
            self.c_accepted.inc(n)
            for i in range(n):
                self.c_pos.inc(1, position=i)
            out.append((r, new))
        return out

    def leave(self, reqs: list) -> None:
        gone = {r.id for r in reqs}
        self.running = [r for r in self.running if r.id not in gone]
        for rid in gone:
            self.seqs.pop(rid, None)
