"""The toy world's target: a tiny Kimi-style reasoning model, shipped as fixed bytes (``shipped``) and
rebuildable from its recipe (``build``).

Light to import: torch and transformers load only when a model is built.
"""

from __future__ import annotations

from pathlib import Path

from eagle3nb import paths
from eagle3nb.errors import InputError
from eagle3nb.toy.build import SIZES, build, is_shipped
from eagle3nb.toy.prompt_sets import write_prompts
from eagle3nb.toy.shipped import ShippedToyError, shipped

__all__ = ["build", "resolve_model_path", "write_prompts", "resolve_prompts", "shipped", "ShippedToyError"]


def resolve_model_path(value: str) -> Path:
    """``toy:smoke`` / ``toy:demo`` / ``toy:kimi`` -> the shipped toy (the same bytes on every machine);
    ``toy:qwen3`` (not shipped: tens of MB) -> its cached build, built here first when absent; anything else ->
    that existing model folder."""
    if value.startswith("toy:"):
        size = value[4:]
        if size not in SIZES:
            raise InputError(f"unknown toy size {value!r}: use one of {', '.join('toy:' + s for s in sorted(SIZES))}")
        return shipped(size) if is_shipped(size) else build(size=size)
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
            raise InputError(f"unknown toy prompt set {value!r}: use toy:train or toy:heldout")
        path = paths.cache_dir() / "prompts" / f"toy-{split}-{n}.jsonl"
        return path if path.exists() else write_prompts(path, n, split)
    return paths.resolve(value)
