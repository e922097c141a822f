"""Where things live: the project root, the build cache, and how relative paths in params resolve.

Notebooks run with cwd ``notebooks/`` in JupyterLab and with the caller's cwd under papermill, so every
relative path in a parameter file is resolved against the project root, never the cwd.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def project_root() -> Path:
    """The folder holding ``params/`` and ``notebooks/``: $EAGLE3NB_ROOT, else the nearest one above cwd."""
    env = os.environ.get("EAGLE3NB_ROOT")
    if env:
        return Path(env).resolve()
    here = Path.cwd().resolve()
    for cand in (here, *here.parents):
        if (cand / "params").is_dir() and (cand / "notebooks").is_dir():
            return cand
    return here


def resolve(path: str | os.PathLike, root: Path | None = None) -> Path:
    """Absolute path for a parameter value: ``~`` expanded, relative paths taken from the project root."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute():
        return p
    return (root or project_root()) / p


def outputs_root() -> Path:
    """Where runs land by default: $EAGLE3NB_OUTPUTS (the runner's ``--output-root``), else ``<project>/outputs``."""
    env = os.environ.get("EAGLE3NB_OUTPUTS")
    return Path(env).expanduser().resolve() if env else project_root() / "outputs"


def cache_dir() -> Path:
    """Build cache for the toy world ($EAGLE3NB_CACHE, default ~/.cache/eagle3nb); created on demand."""
    d = Path(os.environ.get("EAGLE3NB_CACHE", Path.home() / ".cache" / "eagle3nb"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def file_sha256(path: str | os.PathLike) -> str:
    """A file's sha256, read in 16 MB blocks (shards and model weights are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
