"""The shipped toy targets: ``toy:smoke`` and ``toy:demo`` are the same bytes on every machine.

Training the toy on another CPU (other vector kernels, another reduction order) ends at other weights however
fixed the seed and thread count, and every number downstream (its answers, 01's records, the drafts trained on
them, acceptance) would then be one machine's number. So the builds made once by the recipe in ``build.py``
ship with the package under ``shipped/<size>/``, with the sha256 of every file in ``shipped/MANIFEST.json``;
a folder that does not match is refused. ``eagle3nb toy build`` still rebuilds from the recipe (into the cache),
and ``tools/ship_toys.py`` rebuilds and re-ships them when the recipe changes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

from eagle3nb.errors import UserError
from eagle3nb.paths import file_sha256

SHIPPED = Path(__file__).resolve().parent / "shipped"
MANIFEST = SHIPPED / "MANIFEST.json"


class ShippedToyError(UserError, RuntimeError):
    """The shipped toy is missing or its bytes differ from the manifest."""


def folder_digest(files: dict[str, str]) -> str:
    """One sha256 for a build: over its sorted ``name  sha256`` lines (as ``sha256sum`` prints them)."""
    return hashlib.sha256("".join(f"{h}  {n}\n" for n, h in sorted(files.items())).encode()).hexdigest()


def manifest() -> dict:
    """``{size: {"files": {name: sha256}, "sha256": digest, "settings_hash": ..., "seed": ...}}`` ({} before the
    first ``tools/ship_toys.py``)."""
    if not MANIFEST.exists():
        return {}
    try:
        return json.loads(MANIFEST.read_text())
    except (OSError, ValueError) as e:
        raise ShippedToyError(f"{MANIFEST}: the shipped toy manifest cannot be read ({e}); reinstall eagle3nb "
                              f"(git checkout eagle3nb/toy/shipped)") from None


@lru_cache(maxsize=None)
def _verified(folder: Path, stamp: tuple) -> Path:
    entry = manifest().get(folder.name)
    if entry is None:
        raise ShippedToyError(f"no shipped toy of size {folder.name!r} (shipped: {', '.join(sorted(manifest()))})")
    for name, want in entry["files"].items():
        path = folder / name
        if not path.is_file() or file_sha256(path) != want:
            raise ShippedToyError(f"{path}: the shipped toy's bytes differ from {MANIFEST.name} (sha256 {want[:12]}); "
                                  f"restore it (git checkout eagle3nb/toy/shipped) or reinstall eagle3nb")
    return folder


def shipped(size: str) -> Path:
    """The verified shipped build of ``size`` (hashed once per process while its files are unchanged)."""
    folder = SHIPPED / size
    stamp = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())) \
        if folder.is_dir() else ()
    return _verified(folder, stamp)


def digest(size: str) -> str:
    return manifest()[size]["sha256"]


def ship(size: str, build_dir: Path, settings_hash: str, seed: int) -> Path:
    """Copy a finished build into ``shipped/<size>/`` and record its hashes in the manifest."""
    dest = SHIPPED / size
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(build_dir, dest)
    files = {p.name: file_sha256(p) for p in sorted(dest.iterdir()) if p.is_file()}
    entries = manifest()
    entries[size] = {"sha256": folder_digest(files), "settings_hash": settings_hash, "seed": seed, "files": files}
    MANIFEST.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return dest
