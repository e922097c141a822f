"""02_hidden_states speed and size, measured side by side in one run (timings on a shared machine are noisy;
the ratios are what matters).

1. Extraction tokens/s (the stage's batch loop: forward with capture hooks, storage encoding, copy to CPU,
   per-sample slicing; shard writes overlap in a background thread) as a ratio to a bare forward pass of the
   decoder over the same batches. Target: >= 0.9.
2. Bytes/token of each storage option as a ratio to the bf16 layout: measured on the files written here, and
   from the layout formula at Kimi-K2.5's width (H = 7168).

The model is a randomly initialised Llama (real transformers code; weights do not change the cost), so the
benchmark needs no trained model: ``python -m benchmarks.bench_hidden [--hidden 512 --layers 8 --tokens 20000]``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.harness import REPEATS, THREADS, alternate, command_line, parse, write_samples


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def chat_lengths(rng: random.Random, tokens: int) -> Iterator[int]:
    """Sample lengths spread like chat data (64..1024) until they hold ``tokens``."""
    total = 0
    while total < tokens:
        n = rng.randint(64, 1024)
        total += n
        yield n


def bare_forward_tok_s(model, seqs: list[list[int]], tokens_per_batch: int) -> float:
    from eagle3nb.data.batching import pack_batches
    from eagle3nb.hidden.capture import run_decoder

    t0, n = time.perf_counter(), 0
    for rows in pack_batches([len(s) for s in seqs], tokens_per_batch):
        run_decoder(model, [seqs[r] for r in rows])
        n += sum(len(seqs[r]) for r in rows)
    return n / (time.perf_counter() - t0)


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=20000, help="tokens extracted per measurement")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--repeats", **REPEATS)
    ap.add_argument("--threads", **THREADS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
    from eagle3nb.data.shards import STORAGES, bytes_per_token
    from eagle3nb.hf import STATES, load_target
    from eagle3nb.hidden.prepare import prepare_samples
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict

    work = Path(tempfile.mkdtemp(prefix="bench-hidden-"))
    model_dir = make_model(work / "model", args.hidden, args.layers, args.vocab)
    rng = random.Random(0)  # prompt ~ 1/4 of a sample, loss on the rest
    synth = write_samples(work / "synth", args.vocab, chat_lengths(rng, args.tokens), rng)

    def params(storage: str, out: str):
        return from_dict("02_hidden_states", {
            "synth_dir": str(synth), "model_path": str(model_dir), "output_dir": str(work / out), "storage": storage,
            "dtype": "float32", "tokens_per_batch": args.tokens_per_batch, "shard_tokens": 16384,
            "draft_vocab_size": 4096, "force": True})

    samples, _ = prepare_samples(params("bf16", "x"))  # the same order and batches as extraction
    seqs = [s["input_ids"] for s in samples]
    model = load_target(model_dir, trust_remote_code=False, use=STATES, dtype="float32")
    run = itertools.count()
    sides = alternate({"bare": lambda: bare_forward_tok_s(model, seqs, args.tokens_per_batch),
                       "extract": lambda: extract(params("bf16", f"bf16-{next(run)}"))["session_tokens_per_s"]},
                      args.repeats)  # best of each: load from other processes hits both alike
    bare, ext = sides["bare"], sides["extract"]
    print(f"\nmodel: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.threads} thread(s); "
          f"{sum(map(len, seqs)):,} tokens in {len(seqs)} samples, {args.tokens_per_batch} tokens/batch")
    print(f"bare decoder forward : {max(bare):10.0f} tok/s  (runs: {', '.join(f'{x:.0f}' for x in bare)})")
    print(f"extraction (bf16)    : {max(ext):10.0f} tok/s  (runs: {', '.join(f'{x:.0f}' for x in ext)})")
    print(f"ratio extraction / bare forward: {max(ext) / max(bare):.3f}  (target >= 0.9)")

    measured = {"bf16": extract(params("bf16", "bf16-0"))["bytes_per_token"]}  # resumes: all shards on disk
    for s in ("fp8", "topk", "fp32"):
        measured[s] = extract(params(s, s))["bytes_per_token"]
    print(f"\n{'storage':8} {'bytes/token here':>17} {'vs bf16':>8} {'at H=7168':>10} {'vs bf16':>8}")
    kimi_bf16 = bytes_per_token("bf16", 7168)
    for s in STORAGES:
        k = bytes_per_token(s, 7168, topk=32, draft_vocab_size=32000)
        print(f"{s:8} {measured[s]:17.1f} {measured[s] / measured['bf16']:8.3f} {k:10d} {k / kimi_bf16:8.3f}")
    print(f"\n(files in {work})")


if __name__ == "__main__":
    main()
