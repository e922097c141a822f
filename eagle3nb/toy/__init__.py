"""The toy world's target: a tiny Kimi-style reasoning model built at first use (see ``build``).

Light to import: torch and transformers load only when a model is built.
"""

from __future__ import annotations

from pathlib import Path

from eagle3nb import paths
from eagle3nb.toy.build import build
from eagle3nb.toy.dialogues import write_prompts

__all__ = ["build", "resolve_model_path", "write_prompts", "resolve_prompts"]


def resolve_model_path(value: str) -> Path:
    """``toy:smoke`` / ``toy:demo`` -> the (cached) toy build; anything else -> that existing model folder."""
    if value.startswith("toy:"):
        return build(size=value[4:])
    p = paths.resolve(value)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model_path {value!r} -> {p} is not a folder: run `eagle3nb toy build --out {p}` for a toy model, "
            "or set model_path to a Hugging Face model folder (or toy:smoke / toy:demo)")
    return p


def resolve_prompts(value: str, n: int) -> Path:
    """``toy:train`` / ``toy:heldout`` -> a generated prompt file of ``n`` rows in the cache; else the path given."""
    if value.startswith("toy:"):
        split = value[4:]
        if split not in ("train", "heldout"):
            raise ValueError(f"unknown toy prompt set {value!r}: use toy:train or toy:heldout")
        path = paths.cache_dir() / "prompts" / f"toy-{split}-{n}.jsonl"
        return path if path.exists() else write_prompts(path, n, split)
    return paths.resolve(value)
