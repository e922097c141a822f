"""Continuous batching driven as a server drives it, shared by the decoder's tests: rows join a ``SpecBatch`` one
or two every other round and leave once finished, so the batch pads, merges and drops rows between rounds."""

from __future__ import annotations

from collections.abc import Callable


def join_and_leave(batch, prompts: list[list[int]], finished: Callable[[int, list[int]], list[int] | None]):
    """Run ``prompts`` through ``batch`` (a ``SpecBatch``, greedy rows); ``finished(i, tokens)`` returns row i's
    final tokens once it is done, else None. Returns (each row's tokens, batch size per round, rounds whose rows
    accepted runs of different lengths)."""
    from eagle3nb.verification.verify import Sampling

    outs: dict[int, list[int]] = {}
    active: list[int] = []
    sizes, ragged = [], 0
    for r in range(200):
        if r % 2 == 0 and len(outs) < len(prompts):  # one or two new rows every other round
            new = list(range(len(outs), min(len(outs) + 1 + r % 4 // 2, len(prompts))))
            for i, tok in zip(new, batch.add([prompts[i] for i in new], [Sampling()] * len(new))):
                outs[i] = [tok]
            active += new
        if not active:
            break
        got = batch.round()
        sizes.append(len(got))
        ragged += len({len(t) for t in got}) > 1
        keep = []
        for j, (i, toks) in enumerate(zip(active, got)):
            outs[i] += toks
            final = finished(i, outs[i])
            if final is None:
                keep.append(j)
            else:
                outs[i] = final
        active = [active[j] for j in keep]
        batch.keep(keep)
    return [outs[i] for i in range(len(prompts))], sizes, ragged
