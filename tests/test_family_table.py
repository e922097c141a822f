"""docs/families.md's family table is tests/family_matrix.py's, and every test it cites exists."""

from __future__ import annotations

import ast
from pathlib import Path

from family_matrix import DOC, MATRIX, PATHS, cited_tests, current, render

ROOT = Path(__file__).resolve().parents[1]


def test_docs_table_is_the_matrix():
    assert current() == render(), "docs/families.md's family table drifted: run `python tests/family_matrix.py`"


def test_every_cell_is_filled_and_every_cited_test_exists():
    for family, (_, cells) in MATRIX.items():
        assert set(cells) == set(PATHS), family
    for node in cited_tests():
        path, name = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert name in names, f"{DOC.name} cites {node}, which does not exist"
