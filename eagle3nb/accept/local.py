"""04's local check: the target and the draft decode the same prompts here, plainly and speculatively
(``eagle3nb.decoder``, greedy), so the output must be token-for-token the target's (``compare_with_plain``); it also
measures the costs the prediction uses (draft step / target step: ``measure_costs``, and a real round's cost beyond
them: ``predict.round_costs``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from eagle3nb import drafts
from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.misses import ROUNDS, local_records, with_pieces, write_records
from eagle3nb.accept.params import AcceptParams
from eagle3nb.accept.predict import round_costs
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.stream import Template
from eagle3nb.decoder.batch import SpecDecoder
from eagle3nb.decoder.reference import plain_generate
from eagle3nb.formulas import tau_per_request_mean
from eagle3nb.progress import Progress
from eagle3nb.verification.verify import SpecCounters, is_greedy


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
        res["costs"] = round_costs(res, forward, P.k, parallel=drafts.one_forward_per_round(draft))
        return res

    local = cached(P.stage_dir / "local.json", config, work)
    # its acceptance_length is the counters' (pooled over every round, vLLM's); the mean of each prompt's own beside it
    # (SpecForge's, eagle3nb.formulas)
    per_prompt = local["accepted_per_round"]
    local["acceptance_length_per_request"] = tau_per_request_mean([sum(r) for r in per_prompt],
                                                                  [len(r) for r in per_prompt])
    rows = load_prompts(P.prompts, P.local_prompts)
    records = local_records(prompts, local, rows, drafts.of(draft).unit)
    write_records(P.stage_dir / ROUNDS, [with_pieces(r, tokenizer, "local", P.target_family) for r in records])
    return local


def _crop(cache, length: int) -> None:
    """Crop a transformers cache to ``length`` tokens (negative = tokens to remove, valid in 4.x and 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)



def compare_with_plain(target, draft, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
                       temperature: float = 0.0, eos_token_ids: Sequence[int] = (), seed: int = 0,
                       progress=None) -> dict[str, Any]:
    """Decode every prompt plainly and speculatively, side by side: identical outputs (greedy), counters,
    tokens/s of each and the speedup. The local, lossless ground truth for the offline prediction."""
    dec = SpecDecoder(target, draft, k)
    if prompts:  # warm-up, untimed: first calls pay one-time allocation and dispatch costs
        plain_generate(target, prompts[0], 4)
        dec.generate(prompts[0], 4)
    counters = SpecCounters(k)
    plain_s = spec_s = 0.0
    plain_tokens = spec_tokens = 0
    mismatches: list[int] = []
    rounds: list[list[int]] = []
    drafted: list[list[list[int]]] = []
    outputs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        g = torch.Generator().manual_seed(seed + i)
        t0 = time.perf_counter()
        ref = plain_generate(target, prompt, max_new_tokens, temperature, eos_token_ids, g)
        plain_s += time.perf_counter() - t0
        g = torch.Generator().manual_seed(seed + i)
        res = dec.generate(prompt, max_new_tokens, temperature, eos_token_ids, g)
        spec_s += res.seconds
        plain_tokens += len(ref)
        spec_tokens += len(res.tokens)
        counters.merge(res.counters)
        rounds.append(res.accepted_per_round)
        drafted.append(res.drafted_per_round)
        outputs.append(res.tokens)
        if res.tokens != ref:
            mismatches.append(i)
        if progress is not None:
            progress.update(1, acceptance_length=counters.summary()["acceptance_length"])
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    return {
        "k": k, "temperature": temperature, "prompts": len(prompts),
        **counters.summary(),
        "identical_to_target": not mismatches if is_greedy(temperature) else None,
        "mismatched_prompts": mismatches,
        "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
        "accepted_per_round": rounds, "drafted_per_round": drafted, "outputs": outputs,
    }


@torch.inference_mode()
def measure_costs(target, draft, k: int, context: int = 128, repeats: int = 20) -> dict[str, float]:
    """Wall-clock costs on this machine, relative to one plain target decode step at ``context`` tokens:
    ``cost_ratio`` c = one draft step / one target step; ``overhead`` = verifying k+1 tokens / one target
    step - 1 (the extra the verify pass costs). They enter speedup = tau / (1 + k*c + overhead)."""
    from transformers import DynamicCache

    dec = SpecDecoder(target, draft, k)
    dev = dec.device
    ids = torch.randint(0, target.config.vocab_size, (1, context), device=dev)

    def timed(fn) -> float:
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    cache = DynamicCache()
    out = target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in dec.layer_ids], dim=-1)
    one, many = ids[:, -1:], ids[:, -(k + 1):]

    def target_step(x):
        target(input_ids=x, cache=cache, use_cache=True, output_hidden_states=True)
        _crop(cache, context)

    t_step = timed(lambda: target_step(one))
    t_verify = timed(lambda: target_step(many))
    t_draft = timed(dec.drafting.step_timer(aux, ids))
    return {"target_step_s": t_step, "verify_s": t_verify, "draft_step_s": t_draft,
            "cost_ratio": t_draft / t_step, "overhead": max(0.0, t_verify / t_step - 1.0), "context": context}
