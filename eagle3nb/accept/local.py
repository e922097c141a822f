"""04's local check: the target and the draft decode the same prompts here, plainly and speculatively
(``eagle3nb.spec``, greedy), so the output must be token-for-token the target's; it also measures the costs the
prediction uses (draft step / target step, and a real round's cost beyond them: ``predict.round_costs``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.misses import ROUNDS, local_records, with_pieces, write_records
from eagle3nb.accept.params import AcceptParams
from eagle3nb.accept.predict import round_costs
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.stream import Template
from eagle3nb.progress import Progress
from eagle3nb.spec import compare_with_plain, measure_costs


def prompt_token_ids(P: AcceptParams, n: int) -> tuple[list[list[int]], list[int]]:
    """The first ``n`` prompts rendered with the target's chat template, and the end-of-turn ids."""
    tpl = Template(P.model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    rows = load_prompts(P.prompts, n)
    eos = {i for i in (tpl.end_id, tpl.tokenizer.eos_token_id) if i is not None}
    return [tpl.prompt_ids(r["messages"]) for r in rows], sorted(eos)


# torch threads of the timed decoding: the embedded server's (``eagle3nb serve --threads``, default 1), so the costs
# are those of the decoder 04's online step serves. Torch's default (every core) on two shared cores made a plain
# step 4x and a verify pass 6x slower than the server's (measured), and the prediction then meant nothing.
TIMED_THREADS = 1


@contextlib.contextmanager
def timed_threads() -> Iterator[None]:
    """:data:`TIMED_THREADS` torch threads for the block, the caller's restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(TIMED_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def run_local(P: AcceptParams, target, draft, tokenizer) -> dict[str, Any]:
    """Lossless greedy speculative decoding here vs the target alone, plus the measured costs; the real rounds
    (what was drafted, how much accepted) go to ``local_rounds.jsonl`` for the miss view."""
    prompts, eos = prompt_token_ids(P, P.local_prompts)
    config = {"draft": fingerprint(P.draft_path), "model": P.model_path, "k": P.k, "prompts": P.prompts,
              "n": P.local_prompts, "max_tokens": P.max_tokens, "thinking": P.thinking,
              "fields": ["outputs", "drafted_per_round", "round_cost"],  # what later steps read (older results lack it)
              "threads": TIMED_THREADS}

    def work() -> dict[str, Any]:
        prog = Progress(P.stage_dir, len(prompts), "local speculative decoding", "prompts")
        with timed_threads():
            res = compare_with_plain(target, draft, prompts, P.k, P.max_tokens, 0.0, eos, P.seed, prog)
            forward = measure_costs(target, draft, P.k, context=min(256, max(len(p) for p in prompts) + P.max_tokens))
        prog.close()
        res["costs"] = round_costs(res, forward, P.k, parallel=draft.config.mask_token_id is not None)
        return res

    local = cached(P.stage_dir / "local.json", config, work)
    rows = load_prompts(P.prompts, P.local_prompts)
    records = local_records(prompts, local, rows)
    write_records(P.stage_dir / ROUNDS, [with_pieces(r, tokenizer, "local", P.target_family) for r in records])
    return local
