"""Reuse of finished steps: each of 04's steps (offline, local, each endpoint's benchmark) stores its result
with the settings it was made with, so a re-run, or a resume after a kill, redoes only what did not finish."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3nb.paths import file_sha256
from eagle3nb.progress import write_json_atomic


def cached(path: Path, config: dict[str, Any], fn) -> dict[str, Any]:
    """``fn()``'s result, stored at ``path`` with the settings it was made with; reused when they match, so
    a re-run (or a resume after a kill) redoes only the steps that did not finish."""
    path = Path(path)
    if path.exists():
        try:
            stored = json.loads(path.read_text())
            if stored.get("config") == json.loads(json.dumps(config, default=str)):
                print(f"{path.name}: reusing the finished result (delete it to redo)")
                return stored["result"]
        except ValueError:
            pass
    result = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"config": config, "result": result})
    return result


def cached_rows(path: Path, config: dict[str, Any], fn) -> list[dict[str, Any]]:
    """``cached`` for a step whose result is a list of rows."""
    return cached(path, config, lambda: {"rows": fn()})["rows"]


def fingerprint(draft_dir: Path) -> str:
    """Identity of a draft checkpoint for result reuse: the sha256 of its config and weights. Size and mtime
    are not enough: a draft retrained or copied in place can keep both. Drafts are small (a Kimi-K2.5 drafter
    is ~2-3 GB, seconds to hash)."""
    files = sorted(Path(draft_dir).glob("*.safetensors")) + [Path(draft_dir) / "config.json"]
    return ";".join(f"{f.name}:{file_sha256(f)}" for f in files if f.exists())
