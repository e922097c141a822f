"""Rebuild the shipped toy targets from the recipe and re-ship them (run once when the recipe changes).

    python tools/ship_toys.py [--sizes smoke,demo,kimi]

Builds each size at seed 0 with the recipe's thread count into a temporary folder, copies it into
``eagle3nb/toy/shipped/<size>/`` and records every file's sha256 in ``eagle3nb/toy/shipped/MANIFEST.json``;
commit both. Every machine then uses these bytes (``tests/test_toy.py`` checks that the manifest matches the
recipe's settings and that a fresh rebuild is as good as the shipped build).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eagle3nb.toy.build import SIZES, build, is_shipped, settings_hash
from eagle3nb.toy.shipped import ship


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(s for s in SIZES if is_shipped(s)),
                    help="comma-separated toy sizes to re-ship (default: every shipped size; toy:qwen3 is built at "
                         "first use, not shipped)")
    args = ap.parse_args(argv)
    for size in args.sizes.split(","):
        if not is_shipped(size):
            raise SystemExit(f"toy:{size} is built at first use, not shipped (its size entry says shipped: False)")
        with tempfile.TemporaryDirectory() as tmp:
            out = build(Path(tmp) / size, size=size, seed=0)
            dest = ship(size, out, settings_hash(size, 0), 0)
        print(f"shipped toy:{size} -> {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
