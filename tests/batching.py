"""Continuous batching driven as a server drives it, shared by the decoder's tests: rows join a ``SpecBatch`` one
or two every other round and leave once finished, so the batch pads, merges and drops rows between rounds; and a
row that joins a batch drafts what it drafts alone (deeper drafts, parallel drafting)."""

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


def assert_batched_rows_draft_as_alone(dec, prompts: list[list[int]], runs) -> None:
    """Two rows start a batch, a third joins at the second round (padding, merges, holes in every layer's cache):
    each drafts in its first rounds exactly what it drafted alone (``runs``: ``dec.generate`` of each prompt)."""
    from eagle3nb.decoder.batch import SpecBatch
    from eagle3nb.verification.verify import Sampling

    alone = [r.drafted_per_round for r in runs]
    batch = SpecBatch(dec)
    batch.add(prompts[:2], [Sampling()] * 2)
    together: list[list[list[int]]] = [[], [], []]
    for r in range(3):
        if r == 1:
            batch.add(prompts[2:], [Sampling()])
        batch.round()
        for row, i in enumerate([0, 1] if r == 0 else [0, 1, 2]):
            together[i].append(batch.drafted[row])
    assert [a[:3] for a in together[:2]] == [a[:3] for a in alone[:2]]
    assert together[2][:2] == alone[2][:2]
